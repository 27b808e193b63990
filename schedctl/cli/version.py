"""Owns `--version` of both programs (schedctl and scheduled-d): print the program's name and
the package version, and exit before any command runs."""

from __future__ import annotations

from typing import Any

import typer

from schedctl import __version__


def version_option(program: str) -> Any:
    """The eager `--version` flag of a typer callback; prints `PROGRAM VERSION`."""

    def print_version(value: bool) -> None:
        if value:
            typer.echo(f"{program} {__version__}")
            raise typer.Exit()

    return typer.Option(
        "--version", callback=print_version, is_eager=True, help="Print the version."
    )
