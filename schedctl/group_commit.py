"""Owns group commit: many threads each hand over one item and wait for its result, while one
thread turns whatever has gathered into a single call (one transaction for many settles).

No timer: a batch is what arrived while the previous call ran, so a lone caller waits for
nothing but its own call, and under load each call carries many items.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_BATCH = 500  # items in one call at most (one transaction's size)
IDLE_SECONDS = 30.0  # the committing thread ends after this long without work


class _Waiter(Generic[Item, Result]):
    __slots__ = ("done", "error", "item", "result")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.done = threading.Event()
        self.result: Result | None = None
        self.error: BaseException | None = None


class GroupCommit(Generic[Item, Result]):
    """`submit(item)` returns `call(batch)[i]` for its item, raising what `call` raised for
    the whole batch. `call` must return one result per item, in order."""

    def __init__(
        self, call: Callable[[Sequence[Item]], Sequence[Result]], *, name: str = "group-commit"
    ) -> None:
        self._call = call
        self._name = name
        self._lock = threading.Lock()
        self._pending: list[_Waiter[Item, Result]] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def submit(self, item: Item) -> Result:
        waiter: _Waiter[Item, Result] = _Waiter(item)
        with self._lock:
            self._pending.append(waiter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            else:
                self._wake.notify()
        waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        return waiter.result  # type: ignore[return-value]

    def _serve(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._wake.wait(IDLE_SECONDS)
                if not self._pending:
                    # idle: end; the next submit starts a new thread
                    self._thread = None
                    return
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            self._run(batch)

    def _run(self, batch: list[_Waiter[Item, Result]]) -> None:
        try:
            results = self._call([w.item for w in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{self._name}: {len(results)} results for {len(batch)} items")
        except BaseException as exc:  # every waiter learns what happened to its item
            for w in batch:
                w.error = exc
                w.done.set()
            return
        for w, result in zip(batch, results, strict=True):
            w.result = result
            w.done.set()
