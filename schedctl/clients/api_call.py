"""Owns one HTTP call from a Python client of the REST API (ApiClient, ApiLeaseBackend): an
API that cannot be reached or does not answer in time is StoreUnavailable, as an absent
database is, so callers wait it out or report it the same way; and what both clients check
and set up first (the API URL, the bearer token and user agent on the session)."""

from __future__ import annotations

from typing import Any

import requests

from schedctl.core import errors


def api_base_url(base_url: str, error: type[errors.SchedError]) -> str:
    """`base_url` without a trailing slash; `error` (field api) unless it is http(s)."""
    if not base_url.startswith(("http://", "https://")):
        raise error(
            f"the API URL must start with http:// or https://, got {base_url!r}", field="api"
        )
    return base_url.rstrip("/")


def authorize(session: requests.Session, token: str, user_agent: str) -> requests.Session:
    """`session`, every request of it sent with `token` and `user_agent`."""
    session.headers.update({"Authorization": f"Bearer {token}", "User-Agent": user_agent})
    return session


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
