"""config/scheduled.toml is what the configuration schema generates (`make config`), holds
every key, and each of its lines, uncommented, lands in the table it is shown in."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from schedctl.domain import config_doc
from schedctl.domain.config import Config, load_config
from schedctl.domain.config_doc import MissingDescription, check_complete, render

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "scheduled.toml"
_KEY_LINE = re.compile(r"^# ([A-Za-z_]+) = (.+)$")
_TABLE_LINE = re.compile(r"^# (\[\[?[a-z.]+\]\]?)$")


def test_the_shipped_file_is_what_the_schema_generates() -> None:
    generated = render()
    assert EXAMPLE.read_text() == generated, (
        f"{EXAMPLE} is not what the configuration schema generates: run `make config` "
        "(python -m schedctl.domain.config_doc > config/scheduled.toml) and commit the result"
    )


@pytest.mark.parametrize(
    ("table", "key", "named"),
    [
        (None, "new_key_seconds", "new_key_seconds"),
        ("host", "cgroup", "host.cgroup"),
        ("[[worker]]", "memory_max", "worker.memory_max"),
    ],
)
def test_a_key_added_without_a_description_is_named_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch, table: str | None, key: str, named: str
) -> None:
    schema = dict(config_doc._SCHEMA)
    schema[table] = (*schema[table], key)
    monkeypatch.setattr(config_doc, "_SCHEMA", schema)
    with pytest.raises(MissingDescription) as caught:
        check_complete()
    message = str(caught.value)
    assert (
        named in message and "schedctl/domain/config_doc.py" in message and "make config" in message
    )


def test_every_top_level_key_of_the_schema_is_in_the_file() -> None:
    text = EXAMPLE.read_text()
    shown = {m.group(1) for line in text.splitlines() if (m := _KEY_LINE.match(line))}
    known = {f for f in Config.__dataclass_fields__} - {
        "workers",
        "host",
        "alerts",
        "source",
        "config_file",
        "database_url_from",
    }
    assert known <= shown, f"missing from {EXAMPLE}: {sorted(known - shown)}"


def _lines() -> list[tuple[int, str | None, str, str]]:
    """(index, table, key, value) of each commented key line of the file."""
    table: str | None = None
    found = []
    for index, line in enumerate(EXAMPLE.read_text().splitlines()):
        header = _TABLE_LINE.match(line)
        if header:
            table = header.group(1)
            continue
        key = _KEY_LINE.match(line)
        if key:
            found.append((index, table, key.group(1), key.group(2)))
    return found


def _uncommented(indices: set[int]) -> str:
    lines = EXAMPLE.read_text().splitlines()
    return "\n".join(line[2:] if i in indices else line for i, line in enumerate(lines)) + "\n"


def _scaffold() -> set[int]:
    """Every table header (but [worker.env]) and the keys a [[worker]] table needs."""
    lines = EXAMPLE.read_text().splitlines()
    chosen = {i for i, line in enumerate(lines) if _TABLE_LINE.match(line)}
    chosen -= {i for i, line in enumerate(lines) if line == "# [worker.env]"}
    chosen |= {
        i for i, table, key, _ in _lines() if table == "[[worker]]" and key in ("queue", "command")
    }
    return chosen


def _value_in(config: Config, table: str | None, key: str) -> Any:
    holder: Any = {
        None: config,
        "[alerts]": config.alerts,
        "[host]": config.host,
        "[[worker]]": config.workers[0] if config.workers else None,
        "[worker.env]": None,
    }[table]
    if table == "[worker.env]":
        return dict(config.workers[0].env)[key]
    return getattr(holder, key)


def _same(actual: Any, shown: Any) -> bool:
    if isinstance(shown, list):
        return tuple(actual) == tuple(shown)
    if isinstance(shown, str) and isinstance(actual, str):
        return actual.lower() == shown.lower()  # log_level is kept upper-case
    return bool(actual == shown)


@pytest.mark.parametrize(
    ("index", "table", "key", "value"),
    [pytest.param(*entry, id=f"{entry[1] or ''}{entry[2]}-{entry[0]}") for entry in _lines()],
)
def test_each_line_uncommented_lands_where_it_is_shown(
    tmp_path: Path, index: int, table: str | None, key: str, value: str
) -> None:
    """With every table of the file in use, uncommenting one line sets that key in the
    table it is shown in (never a top-level key inside a table)."""
    chosen = _scaffold() | {index}
    if table == "[worker.env]":
        chosen |= {
            i for i, line in enumerate(EXAMPLE.read_text().splitlines()) if line == "# [worker.env]"
        }
    path = tmp_path / "scheduled.toml"
    path.write_text(_uncommented(chosen))
    config = load_config(path, environ={})
    shown = tomllib.loads(f"{key} = {value}")[key]
    assert _same(_value_in(config, table, key), shown), path.read_text()
