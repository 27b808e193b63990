"""Owns `Closing`: `with X(...) as x:` for anything that has a close(), written once."""

from __future__ import annotations

import abc
from typing import Self


class Closing(abc.ABC):
    """A context manager whose block's end closes it (also when the block raises)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
