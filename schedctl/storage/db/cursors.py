"""Owns page cursors and page sizes: opaque cursors (the last key a page showed, encoded)
and the one check of a listing's limit."""

from __future__ import annotations

import base64
import binascii

from schedctl.core import errors, limits

MAX_PAGE = limits.MAX_PAGE


def encode_cursor(*parts: str) -> str:
    return base64.urlsafe_b64encode("|".join(parts).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, count: int) -> list[str]:
    limits.check_cursor(cursor)
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        raw = base64.b64decode(padded.encode(), altchars=b"-_", validate=True)
        parts = raw.decode().split("|")
    except (ValueError, UnicodeDecodeError, binascii.Error) as exc:
        raise errors.ValidationError("not a cursor this server issued", field="cursor") from exc
    if len(parts) != count:
        raise errors.ValidationError("not a cursor this server issued", field="cursor")
    return parts


# one rule for every listing's page size
check_page_limit = limits.check_page
