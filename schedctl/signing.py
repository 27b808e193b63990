"""The public path of the delivery signature check for tenants' receivers,
`schedctl.signing.verify` (named in `schedctl tenant signing-secret show --help` and
docs/delivery.md). The scheme itself is schedctl.core.signing; this module only keeps
the path users' code imports."""

from schedctl.core.errors import SignatureError
from schedctl.core.signing import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    verify,
    verify_signature,
)

__all__ = [
    "IDEMPOTENCY_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "SignatureError",
    "verify",
    "verify_signature",
]
