"""The create combiner's rounds with a create_many that the test holds open (no database:
the combiner only passes items through): a second round starts while the first is still
in the database, a third waits for them and is created in a later round, each thread gets
its own item's outcome, and a failed round fails only its own creates."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import cast

from schedctl.app.create_combiner import ROUNDS_AT_ONCE, CreateCombiner
from schedctl.core import errors
from schedctl.domain.models import CreateOutcome
from schedctl.storage.jobs.job_create import NewJob

WAIT = 30.0


class HeldRounds:
    """A create_many whose rounds block until released; each outcome's error names its
    item, so a thread can tell it got its own."""

    def __init__(self, fail: str | None = None) -> None:
        self.rounds: list[list[str]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.fail = fail

    def __call__(self, items: Sequence[NewJob]) -> list[CreateOutcome]:
        names = [cast(str, item) for item in items]
        self.rounds.append(names)
        self.started.release()
        assert self.release.wait(WAIT)
        if self.fail in names:
            raise errors.StoreUnavailable("the database went away")
        return [CreateOutcome(error=errors.Conflict(name)) for name in names]


def create_in_thread(
    combiner: CreateCombiner, rounds: HeldRounds, name: str, answers: dict[str, object]
) -> threading.Thread:
    def create() -> None:
        try:
            answers[name] = combiner.create("tenant", cast(NewJob, name), rounds)
        except errors.SchedError as exc:
            answers[name] = exc

    thread = threading.Thread(target=create, name=name)
    thread.start()
    return thread


def test_a_second_round_runs_while_the_first_is_in_the_database() -> None:
    assert ROUNDS_AT_ONCE == 2
    combiner, rounds = CreateCombiner(), HeldRounds()
    answers: dict[str, object] = {}
    threads = [create_in_thread(combiner, rounds, "a", answers)]
    assert rounds.started.acquire(timeout=WAIT)  # a's round is in the database
    threads.append(create_in_thread(combiner, rounds, "b", answers))
    # b leads a round of its own at once: it does not wait for a's commit
    assert rounds.started.acquire(timeout=WAIT)
    assert rounds.rounds == [["a"], ["b"]]
    # two rounds are in flight: c and d wait, and go in one later round
    threads.append(create_in_thread(combiner, rounds, "c", answers))
    threads.append(create_in_thread(combiner, rounds, "d", answers))
    while len(combiner._pending.get("tenant", [])) < 2:
        assert threads[-1].is_alive()
        threading.Event().wait(0.01)
    assert len(rounds.rounds) == 2
    rounds.release.set()
    for thread in threads:
        thread.join(WAIT)
    assert rounds.rounds[2:] == [["c", "d"]]
    assert {name: str(cast(CreateOutcome, answer).error) for name, answer in answers.items()} == {
        name: name for name in "abcd"
    }
    assert (combiner._pending, combiner._leaders) == ({}, {})


def test_a_failed_round_fails_only_its_own_creates() -> None:
    combiner, rounds = CreateCombiner(), HeldRounds(fail="a")
    answers: dict[str, object] = {}
    threads = [create_in_thread(combiner, rounds, "a", answers)]
    assert rounds.started.acquire(timeout=WAIT)
    threads.append(create_in_thread(combiner, rounds, "b", answers))
    assert rounds.started.acquire(timeout=WAIT)
    rounds.release.set()
    for thread in threads:
        thread.join(WAIT)
    assert isinstance(answers["a"], errors.StoreUnavailable)
    assert str(cast(CreateOutcome, answers["b"]).error) == "b"
    assert (combiner._pending, combiner._leaders) == ({}, {})


def test_many_threads_each_get_their_own_outcome_and_nothing_is_left() -> None:
    combiner = CreateCombiner()
    sizes: list[int] = []
    pause = threading.Event()

    def create_many(items: Sequence[NewJob]) -> list[CreateOutcome]:
        sizes.append(len(items))
        pause.wait(0.002)  # a round in the database
        return [CreateOutcome(error=errors.Conflict(cast(str, item))) for item in items]

    answers: dict[str, object] = {}

    def create(name: str) -> None:
        answers[name] = combiner.create("tenant", cast(NewJob, name), create_many)

    threads = [threading.Thread(target=create, args=(f"j{i}",)) for i in range(200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert {name: str(cast(CreateOutcome, answer).error) for name, answer in answers.items()} == {
        f"j{i}": f"j{i}" for i in range(200)
    }
    assert sum(sizes) == 200
    assert (combiner._pending, combiner._leaders) == ({}, {})
