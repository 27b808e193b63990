"""The one error hierarchy, and the one table of error codes: every failure a user can see is
a SchedError whose class says its `code`, `exit_code` and `http_status`.

The CLI maps `exit_code` to the process exit status and prints `str(error)`; the API
maps `http_status` and `code` to a JSON error body; the API's clients (schedctl.clients.client,
schedctl.clients.queue_client) turn a body's code back into its class with `from_code`, or its
status with `from_status`. Nothing else keeps a copy of these mappings. A traceback
reaching a user is a bug.
"""

from __future__ import annotations


class SchedError(Exception):
    """Something went wrong.

    Each class says its `code` (an API error body's), `exit_code` (the CLI's) and
    `http_status`; a class that owns an exit code a CLI user can meet says what it means in
    `exit_meaning` (`schedctl --help` lists them)."""

    exit_code = 1
    exit_meaning = "internal error"
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
    exit_meaning = "invalid input or usage"
    http_status = 422
    code = "invalid"


class PayloadTooLarge(ValidationError):
    """The request or its payload is larger than the limit."""

    http_status = 413
    code = "payload_too_large"


class MalformedRequest(ValidationError):
    """The request is malformed."""

    http_status = 400
    code = "malformed"


class MethodNotAllowed(ValidationError):
    """The method is not allowed on this path."""

    http_status = 405
    code = "method_not_allowed"


class UnsupportedMediaType(ValidationError):
    """The body must be JSON."""

    http_status = 415
    code = "unsupported_media_type"


class RequestTooLarge(PayloadTooLarge):
    """The request body is larger than the limit."""

    code = "request_too_large"


class NotFound(SchedError):
    """No such object."""

    exit_code = 3
    exit_meaning = "not found"
    http_status = 404
    code = "not_found"


class Conflict(SchedError):
    """The request conflicts with the current state."""

    exit_code = 4
    exit_meaning = "conflict"
    http_status = 409
    code = "conflict"


class QuotaExceeded(SchedError):
    """A quota or rate limit was exceeded."""

    exit_code = 5
    exit_meaning = "quota exceeded"
    http_status = 429
    code = "quota_exceeded"

    # the Retry-After of a refusal that does not know better (a quota that frees up only
    # when something else changes)
    DEFAULT_RETRY_AFTER_SECONDS = 60

    def __init__(
        self,
        message: str | None = None,
        *,
        field: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message, field=field)
        seconds = self.DEFAULT_RETRY_AFTER_SECONDS if retry_after is None else retry_after
        self.retry_after = max(1, seconds)


class Unauthorized(SchedError):
    """Missing or invalid credentials."""

    exit_code = 6
    exit_meaning = "unauthorized"
    http_status = 401
    code = "unauthorized"


class Forbidden(SchedError):
    """The credentials are valid but may not do this: a host token outside its host's
    queues and jobs (schedctl.domain.host_scope), or on the web console; the console's missing or
    wrong CSRF token, or a cross-site Origin."""

    exit_code = 6
    http_status = 403
    code = "forbidden"


class StoreUnavailable(SchedError):
    """The database cannot be reached.

    The message is for the operator (the CLI prints it, the daemons log it): it may name
    the database's host, port and the driver's words. An HTTP answer -- to anyone, token or
    not -- says only PUBLIC_MESSAGE."""

    exit_code = 7
    exit_meaning = "database unavailable"
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


def _classes() -> tuple[type[SchedError], ...]:
    """Every error class of this module, in the order written (a parent before its children)."""
    found = [SchedError]
    for value in list(globals().values()):
        if isinstance(value, type) and issubclass(value, SchedError) and value is not SchedError:
            if value.__module__ == __name__:
                found.append(value)
    return tuple(found)


ERROR_CLASSES: tuple[type[SchedError], ...] = _classes()
_BY_CODE: dict[str, type[SchedError]] = {}
_BY_STATUS: dict[int, type[SchedError]] = {}
for _kind in ERROR_CLASSES:
    # a code names one class; 'code' is set on every class (a subclass without its own code
    # would share its parent's, and from_code could not tell them apart)
    assert "code" in vars(_kind), f"{_kind.__name__} has no code of its own"
    assert _kind.code not in _BY_CODE, f"{_kind.code!r} is used twice"
    _BY_CODE[_kind.code] = _kind
    # a status names the first, most general class that answers with it
    _BY_STATUS.setdefault(_kind.http_status, _kind)
del _kind


def from_code(code: str) -> type[SchedError] | None:
    """The class whose `code` is `code` (an API error body's), or None if no class has it."""
    return _BY_CODE.get(code)


def from_status(status: int) -> type[SchedError] | None:
    """The most general class answering with HTTP `status`, or None if none does."""
    return _BY_STATUS.get(status)


def exit_codes() -> dict[int, str]:
    """The CLI's documented exit codes and what each means (0 is success)."""
    meanings = {0: "ok"}
    for kind in ERROR_CLASSES:
        if "exit_meaning" in vars(kind):
            meanings[kind.exit_code] = vars(kind)["exit_meaning"]
    return dict(sorted(meanings.items()))
