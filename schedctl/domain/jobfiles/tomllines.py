"""Owns finding the line of a table or key in TOML text (tomllib reports none for keys).

`key_lines(text)` maps each key path to its 1-based line: a header `[[job]]` is
("job", 0) for the first table of the array, a key under it ("job", 0, "name"), a
[job.env] header ("job", 0, "env") and its keys ("job", 0, "env", "PATH"). Strings
(multi-line ones included), arrays and inline tables spanning lines are skipped over, so
a line of stdin text that looks like `name = x` is never taken for a key.
"""

from __future__ import annotations

import re
import tomllib

_BARE = r"[A-Za-z0-9_-]+"
_BASIC = r'"(?:[^"\\\n]|\\.)*"'
_LITERAL = r"'[^'\n]*'"
_PART = f"(?:{_BARE}|{_BASIC}|{_LITERAL})"
_DOTTED = re.compile(rf"\s*({_PART}(?:\s*\.\s*{_PART})*)\s*")
_PARTS = re.compile(rf"\s*({_PART})\s*\.?")

Path = tuple[str | int, ...]


def _split(dotted: str) -> tuple[str, ...]:
    parts = []
    for match in _PARTS.finditer(dotted):
        raw = match.group(1)
        if raw[0] in "\"'":
            try:
                raw = str(tomllib.loads(f"k = {raw}")["k"])
            except tomllib.TOMLDecodeError:
                raw = raw[1:-1]
        parts.append(raw)
    return tuple(parts)


class _Scanner:
    """State carried from line to line: an open multi-line string, or bracket depth."""

    def __init__(self) -> None:
        self.in_multiline: str | None = None  # '"""' or "'''"
        self.depth = 0

    @property
    def at_top(self) -> bool:
        return self.in_multiline is None and self.depth == 0

    def scan(self, line: str) -> None:
        """Advance over the value text of one line."""
        i = 0
        n = len(line)
        while i < n:
            if self.in_multiline is not None:
                end = self._multiline_end(line, i)
                if end < 0:
                    return
                i = end
                self.in_multiline = None
                continue
            c = line[i]
            if c == "#":
                return
            if line.startswith('"""', i) or line.startswith("'''", i):
                self.in_multiline = line[i : i + 3]
                i += 3
                continue
            if c == '"':
                i = self._basic_end(line, i + 1)
                continue
            if c == "'":
                end = line.find("'", i + 1)
                i = n if end < 0 else end + 1
                continue
            if c in "[{":
                self.depth += 1
            elif c in "]}":
                self.depth = max(0, self.depth - 1)
            i += 1

    @staticmethod
    def _basic_end(line: str, i: int) -> int:
        while i < len(line):
            if line[i] == "\\":
                i += 2
                continue
            if line[i] == '"':
                return i + 1
            i += 1
        return len(line)

    def _multiline_end(self, line: str, i: int) -> int:
        quote = self.in_multiline or '"""'
        while i < len(line):
            if quote == '"""' and line[i] == "\\":
                i += 2
                continue
            if line.startswith(quote, i):
                # up to two quotes may close the content right before the delimiter
                end = i + 3
                while end < len(line) and line[end] == quote[0] and end - i < 5:
                    end += 1
                return end
            i += 1
        return -1


def key_lines(text: str) -> dict[Path, int]:
    """Every table header and key of `text` with its line (the first one when repeated)."""
    lines: dict[Path, int] = {}
    arrays: dict[tuple[str, ...], int] = {}  # array-of-tables path -> index of its last table
    table: Path = ()
    scanner = _Scanner()
    # TOML's lines end at LF (or CRLF) only: a U+2028 or U+0085 inside a string is no newline
    for number, line in enumerate((t.removesuffix("\r") for t in text.split("\n")), 1):
        if not scanner.at_top:
            scanner.scan(line)
            continue
        stripped = line.lstrip()
        if stripped.startswith("["):
            is_array = stripped.startswith("[[")
            match = _DOTTED.match(stripped, 2 if is_array else 1)
            if match is None:
                continue
            names = _split(match.group(1))
            if is_array:
                arrays[names] = arrays.get(names, -1) + 1
            table = _resolve(names, arrays)
            lines.setdefault(table, number)
            continue
        match = _DOTTED.match(line)
        if match is None or not line.startswith("=", match.end()):
            continue
        lines.setdefault(table + _split(match.group(1)), number)
        scanner.scan(line[match.end() + 1 :])
    return lines


def _resolve(names: tuple[str, ...], arrays: dict[tuple[str, ...], int]) -> Path:
    """A header's dotted names with the current index after each array-of-tables prefix."""
    path: list[str | int] = []
    for end in range(1, len(names) + 1):
        path.append(names[end - 1])
        if names[:end] in arrays:
            path.append(arrays[names[:end]])
    return tuple(path)


def locate(lines: dict[Path, int], path: Path) -> int | None:
    """The line of `path`, else of its closest enclosing table or key that is known."""
    for end in range(len(path), 0, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None
