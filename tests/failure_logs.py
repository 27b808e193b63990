"""Owns attaching log tails to the report of a failing test: the pytest hook both conftest
modules install, each with its own way of finding the logs a test's processes wrote."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import pytest

Sections = Callable[[pytest.Item], list[tuple[str, str]]]


def attach_log_tails(sections: Sections) -> Any:
    """A `pytest_runtest_makereport` hook: a failing test's report gets `sections(item)`
    (title, text) pairs; a log that cannot be read is left out, never a second failure."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        del call
        report = yield
        if report.failed:
            with contextlib.suppress(Exception):
                report.sections.extend(sections(item))
        return report

    return pytest_runtest_makereport
