"""Rendering command results: rich tables for people, JSON for scripts."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich would exit 1 by itself; the CLI entry point ends a closed pipe its own way
        # (schedctl.cli.common.exit_closed_pipe), the same for tables and JSON
        self.quiet = True
        raise BrokenPipeError(32, "Broken pipe")


console = _Console()
err_console = Console(stderr=True)


class OutputFormat(enum.StrEnum):
    table = "table"
    json = "json"


def to_jsonable(value: Any) -> Any:
    """Datetimes as RFC 3339 UTC with Z; everything else as JSON knows it."""
    if isinstance(value, datetime):
        return format_time(value)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def format_time(value: datetime) -> str:
    text = value.isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def emit_json(data: Any) -> None:
    print(json.dumps(to_jsonable(data), indent=2, sort_keys=False))


def _cell(value: Any) -> str:
    return "" if value is None else str(to_jsonable(value))


def is_id_column(column: str) -> bool:
    """Columns holding ids (job_id, tenant_id, a letter's id, ...): never cut or wrapped."""
    return column == "id" or column.endswith("_id")


def emit_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *, title: str | None = None
) -> None:
    """Rows as a table. An id column keeps the whole of each id it shows (callers show
    the shortest unique prefix, which commands accept back) on a narrow terminal too:
    the other columns wrap instead, so a copied id always names one thing."""
    table = Table(title=title, show_lines=False)
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    for index, column in enumerate(columns):
        if is_id_column(column):
            widest = max([len(column), *(len(r[index]) for r in cells)])
            table.add_column(column, no_wrap=True, min_width=widest, overflow="fold")
        else:
            table.add_column(column)
    for row_cells in cells:
        # Text, not markup: a job named "[/x]" is data, not a rich tag
        table.add_row(*(Text(cell) for cell in row_cells))
    console.print(table)


def emit_record(record: Mapping[str, Any], *, title: str | None = None) -> None:
    """One object as a two-column key/value table."""
    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in record.items():
        shown = value if not isinstance(value, dict | list) else json.dumps(to_jsonable(value))
        table.add_row(Text(key), Text(_cell(shown)))
    console.print(table)


def emit(
    data: Any,
    output: OutputFormat,
    *,
    columns: Sequence[str] | None = None,
    title: str | None = None,
) -> None:
    """A list of rows (with columns) or one record, in the chosen format."""
    if output is OutputFormat.json:
        emit_json(data)
    elif isinstance(data, Mapping):
        emit_record(data, title=title)
    else:
        emit_table(data, columns or (list(data[0].keys()) if data else []), title=title)


def emit_tree(tree: Any) -> None:
    """A rich Tree (e.g. a job's dependencies), for people."""
    console.print(tree)
