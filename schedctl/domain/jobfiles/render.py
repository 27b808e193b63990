"""Owns writing job files: job tables (dicts of the file's keys) as TOML text that
`load_file` reads back to the same values."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from schedctl.domain.jobfiles.load import JOB_KEYS

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+", re.ASCII)


def render(
    jobs: Sequence[Mapping[str, Any]],
    *,
    header: str | None = None,
    comments: Sequence[str | None] = (),
) -> str:
    """[[job]] tables in JOB_KEYS order, env as its own [job.env] table; `header` becomes
    comment lines at the top, comments[i] a comment line above the i-th table."""
    out: list[str] = []
    if header:
        out.extend(f"# {line}".rstrip() for line in header.splitlines())
        out.append("")
    for index, job in enumerate(jobs):
        comment = comments[index] if index < len(comments) else None
        if comment:
            out.extend(f"# {line}".rstrip() for line in comment.splitlines())
        out.append("[[job]]")
        for key in sorted(job, key=_order):
            if key == "env" or job[key] is None:
                continue
            out.append(f"{key} = {_value(job[key])}")
        env = job.get("env")
        if env:
            out.append("")
            out.append("[job.env]")
            out.extend(f"{_key(k)} = {_value(v)}" for k, v in env.items())
        out.append("")
    return "\n".join(out)


def _order(key: str) -> int:
    return JOB_KEYS.index(key) if key in JOB_KEYS else len(JOB_KEYS)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    # JSON's escapes are TOML's; DEL is the one control character JSON leaves raw
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to a job file")
