"""The one error hierarchy: every failure a user can see is a SchedError with an exit code.

The CLI maps `exit_code` to the process exit status and prints `str(error)`; the API
maps `http_status` and `code` to a JSON error body. A traceback reaching a user is a bug.
"""

from __future__ import annotations


class SchedError(Exception):
    """Something went wrong."""

    exit_code = 1
    http_status = 500
    code = "internal"

    def __init__(self, message: str | None = None, *, field: str | None = None) -> None:
        self.field = field
        text = message or (self.__doc__ or self.__class__.__name__).strip()
        if field and not text.startswith(field):
            text = f"{field}: {text}"
        super().__init__(text)

    @property
    def message(self) -> str:
        return str(self)

    @property
    def public_message(self) -> str:
        """What an HTTP answer may say: the message itself, unless the class holds details
        only the operator should see (then they go to the log)."""
        return self.message


class ValidationError(SchedError):
    """The input is invalid."""

    exit_code = 2
    http_status = 422
    code = "invalid"


class PayloadTooLarge(ValidationError):
    """The request or its payload is larger than the limit."""

    http_status = 413
    code = "payload_too_large"


class NotFound(SchedError):
    """No such object."""

    exit_code = 3
    http_status = 404
    code = "not_found"


class Conflict(SchedError):
    """The request conflicts with the current state."""

    exit_code = 4
    http_status = 409
    code = "conflict"


class QuotaExceeded(SchedError):
    """A quota or rate limit was exceeded."""

    exit_code = 5
    http_status = 429
    code = "quota_exceeded"


class Unauthorized(SchedError):
    """Missing or invalid credentials."""

    exit_code = 6
    http_status = 401
    code = "unauthorized"


class StoreUnavailable(SchedError):
    """The database cannot be reached.

    The message is for the operator (the CLI prints it, the daemons log it): it may name
    the database's host, port and the driver's words. An HTTP answer -- to anyone, token or
    not -- says only PUBLIC_MESSAGE."""

    exit_code = 7
    http_status = 503
    code = "unavailable"

    PUBLIC_MESSAGE = "database unavailable"

    @property
    def public_message(self) -> str:
        return self.PUBLIC_MESSAGE


class SchemaOutdated(SchedError):
    """The database's schema is not the one this version needs: `schedctl db upgrade`
    (exit 2: the operator's step is missing, waiting will not help)."""

    exit_code = 2
    http_status = 503
    code = "schema_outdated"


class LockRace(StoreUnavailable):
    """The transaction lost a lock race (deadlock or serialization failure); nothing was
    committed and the same work can simply be tried again."""

    code = "lock_race"


class FencingError(SchedError):
    """This process no longer owns the partition (its fencing epoch is stale)."""

    exit_code = 8
    http_status = 409
    code = "fenced"


class ConfigError(SchedError):
    """The configuration is invalid."""

    exit_code = 2
    http_status = 500
    code = "config"


class SignatureError(Unauthorized):
    """The delivery's signature is missing, malformed, wrong or too old."""

    code = "bad_signature"


class ForbiddenDestination(ValidationError):
    """The HTTP destination is not allowed for this tenant (SSRF guard)."""

    code = "forbidden_destination"
