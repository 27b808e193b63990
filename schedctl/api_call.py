"""Owns one HTTP call from a Python client of the REST API (ApiClient, ApiLeaseBackend): an
API that cannot be reached or does not answer in time is StoreUnavailable, as an absent
database is, so callers wait it out or report it the same way."""

from __future__ import annotations

from typing import Any

import requests

from schedctl import errors


def send(
    session: requests.Session,
    method: str,
    base_url: str,
    path: str,
    *,
    timeout: float,
    **kwargs: Any,
) -> requests.Response:
    """The answer to `method` `base_url + path`, whatever its status."""
    try:
        return session.request(method, base_url + path, timeout=timeout, **kwargs)
    except requests.Timeout as exc:
        raise errors.StoreUnavailable(
            f"the API at {base_url} did not answer within {timeout:.0f} s"
        ) from exc
    except requests.RequestException as exc:
        raise errors.StoreUnavailable(
            f"cannot reach the API at {base_url}: {type(exc).__name__}"
        ) from exc
