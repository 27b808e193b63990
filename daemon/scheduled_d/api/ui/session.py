"""Owns the web console's session and its request guards: the signed-in tenant token in an
HttpOnly, SameSite=Strict cookie (Secure over TLS), the CSRF token every POST must carry,
the same-origin check of state-changing requests, and the security headers of every /ui
answer (a Content-Security-Policy without inline script, no framing, nosniff).

The CSRF token is an HMAC of the session cookie's value (the tenant's API token) under a
fixed label: a page can only be made to POST by someone who can read the cookie, which a
cross-site page cannot; it needs no server-side state, so it holds across API processes
behind one load balancer and ends with the session (sign-out, token revocation)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from schedctl.core import errors
from scheduled_d.api.auth import Caller, request_scheduler

COOKIE = "sd_console"
TZ_COOKIE = "sd_tz"
CSRF_FIELD = "csrf"
_CSRF_LABEL = b"scheduled-d console csrf v1"
# a signed-in session's cookie lives this long at most (the browser drops it; the token's
# revocation ends it at once)
SESSION_SECONDS = 12 * 3600

SECURITY_HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: under no-referrer a browser sends `Origin: null` with a
    # form's POST, and the origin check needs the real one
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def secure_headers(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def csrf_token(session: str) -> str:
    return hmac.new(session.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


def is_tls(request: Request) -> bool:
    return request.url.scheme == "https"


def set_session(response: Response, request: Request, token: str) -> None:
    response.set_cookie(
        COOKIE,
        token,
        max_age=SESSION_SECONDS,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=is_tls(request),
    )


def clear_session(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE, path="/ui", httponly=True, samesite="strict", secure=is_tls(request)
    )


async def signed_in(request: Request) -> Caller | None:
    """The caller of the session cookie, None when there is none or its token is no longer
    valid (revoked): the pages then send the browser to sign in."""
    token = request.cookies.get(COOKIE)
    if not token:
        return None
    try:
        return await authenticate(request, token)
    except (errors.Unauthorized, errors.Forbidden):
        return None


async def authenticate(request: Request, token: str) -> Caller:
    """The tenant of an API token, as the REST API checks a bearer token (the process's
    cache, else the database in the thread pool). Unauthorized when it is not valid."""
    tenants = request_scheduler(request).tenants
    found = tenants.cached_tenant(token)
    if found is None:
        found = await run_in_threadpool(tenants.authenticate_tenant, token)
    tenant, token_id, scope = found
    if scope is not None:
        # a host token is one host's worker's, for its own runs and job files: it sees
        # nothing of the tenant's other hosts here either. Only plain tenant tokens sign in.
        raise errors.Forbidden(
            "a host token cannot sign in to the console: use a tenant API token", field="token"
        )
    return Caller(tenant, token_id)


def check_origin(request: Request) -> None:
    """A state-changing request must come from this site: its Origin (or, without one, its
    Referer) is this server's, and the browser's Sec-Fetch-Site, when sent, is
    same-origin. Forbidden otherwise."""
    own = f"{request.url.scheme}://{request.url.netloc}"
    origin = request.headers.get("origin")
    if origin is None:
        referer = request.headers.get("referer")
        if referer:
            parts = urlsplit(referer)
            origin = f"{parts.scheme}://{parts.netloc}"
    if origin is not None and origin != own:
        raise errors.Forbidden("cross-site request refused", field="origin")
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        raise errors.Forbidden("cross-site request refused", field="origin")


def check_csrf(request: Request, form: Mapping[str, object]) -> None:
    """The POST's CSRF token matches the session's; Forbidden naming `csrf` otherwise."""
    check_origin(request)
    session = request.cookies.get(COOKIE, "")
    sent = form.get(CSRF_FIELD)
    if not session or not isinstance(sent, str) or not sent:
        raise errors.Forbidden("the form has no CSRF token: reload the page", field=CSRF_FIELD)
    if not hmac.compare_digest(sent.encode(), csrf_token(session).encode()):
        raise errors.Forbidden("the form's CSRF token is wrong: reload the page", field=CSRF_FIELD)
