"""How the bench acceptance tests drive `schedctl bench`: one run read back as its JSON
report, and one refused invocation read back as the usage error it printed."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from schedctl.cli.app import app

runner = CliRunner()


def bench(db: str, *args: str) -> Any:
    """Run `schedctl --db DB -o json bench ARGS`, require success and return the report."""
    result = runner.invoke(app, ["--db", db, "-o", "json", "bench", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def bench_refusal(db: str, *args: str) -> str:
    """Run `schedctl --db DB bench ARGS`, require a usage error (exit 2) and return what it
    printed."""
    result = runner.invoke(app, ["--db", db, "bench", *args])
    assert result.exit_code == 2, result.output
    return result.output
