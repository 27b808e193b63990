"""Owns how job payloads are stored: JSON text, encrypted with the process-wide payload cipher
when keys are configured, and the re-encryption of every stored payload after a key rotation.

Every write of `jobs.payload` goes through `encode_payload` and every read through
`decode_payload`. The cipher is configured once per process: explicitly with
`configure_payload_cipher`, else from the environment on first use (see schedctl.core.crypto for
the variables and the rotation procedure).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select, update

from schedctl.core import errors
from schedctl.core.crypto import PayloadCipher, is_encrypted
from schedctl.storage.db import schema
from schedctl.storage.db.store import Store

ROTATE_BATCH = 500

_lock = threading.Lock()
_configured = False
_cipher: PayloadCipher | None = None


def configure_payload_cipher(cipher: PayloadCipher | None) -> None:
    """Use `cipher` from now on in this process (None: store payloads as plain JSON)."""
    global _configured, _cipher
    with _lock:
        _cipher, _configured = cipher, True


def reset_payload_cipher() -> None:
    """Forget the configured cipher: the next use reads the environment again (tests)."""
    global _configured, _cipher
    with _lock:
        _cipher, _configured = None, False


def payload_cipher() -> PayloadCipher | None:
    """The process's cipher; read from the environment the first time it is needed."""
    global _configured, _cipher
    if _configured:
        return _cipher
    with _lock:
        if not _configured:
            # raises ConfigError for an unreadable file or a bad key: better than storing
            # plaintext while the operator believes payloads are encrypted
            _cipher, _configured = PayloadCipher.from_env(), True
        return _cipher


def rotation_cipher(cipher: PayloadCipher | None) -> PayloadCipher:
    """The cipher a key rotation re-encrypts under: `cipher`, else the process's; a clear
    error when no keys are configured."""
    cipher = cipher or payload_cipher()
    if cipher is None:
        raise errors.ConfigError(
            "no payload keys are configured: set SCHEDULED_PAYLOAD_KEYS_FILE "
            "(or SCHEDULED_PAYLOAD_KEYS), the new key first",
            field="payload_keys",
        )
    return cipher


def encode_payload(value: Any) -> str:
    """The stored form of a payload (the caller has validated it is JSON)."""
    text = json.dumps(value)
    cipher = payload_cipher()
    return cipher.encrypt(text) if cipher is not None else text


def decode_payload(stored: str) -> Any:
    """The payload from its stored form, encrypted or (written before encryption) plain."""
    if is_encrypted(stored):
        cipher = payload_cipher()
        if cipher is None:
            raise errors.ConfigError(
                "a stored payload is encrypted but no payload keys are configured: set "
                "SCHEDULED_PAYLOAD_KEYS_FILE (or SCHEDULED_PAYLOAD_KEYS)",
                field="payload_keys",
            )
        stored = cipher.decrypt(stored)
    return json.loads(stored)


@dataclass(frozen=True)
class RotationResult:
    examined: int  # payloads read
    rewritten: int  # re-encrypted with the current key (including formerly plain ones)
    already_current: int


def rotate_payloads(
    store: Store, cipher: PayloadCipher | None = None, *, batch_size: int = ROTATE_BATCH
) -> RotationResult:
    """Re-encrypt every job payload that is not under the current key, in batches of short
    transactions (a payload never changes after its insert, so each update is conditional on
    the value read and nothing else can be lost)."""
    cipher = rotation_cipher(cipher)
    jobs = schema.jobs
    rewrite = (
        update(jobs)
        .where(jobs.c.job_id == bindparam("b_job_id"), jobs.c.payload == bindparam("b_old"))
        .values(payload=bindparam("b_new"))
    )
    examined = rewritten = current = 0
    after = ""
    while True:
        with store.tx() as connection:
            rows = connection.execute(
                select(jobs.c.job_id, jobs.c.payload)
                .where(jobs.c.job_id > after)
                .order_by(jobs.c.job_id)
                .limit(batch_size)
            ).all()
            if not rows:
                break
            changes = []
            for job_id, stored in rows:
                if cipher.is_current(stored):
                    current += 1
                else:
                    changes.append(
                        {"b_job_id": job_id, "b_old": stored, "b_new": cipher.rotate(stored)}
                    )
            if changes:
                connection.execute(rewrite, changes)
            examined += len(rows)
            rewritten += len(changes)
            after = rows[-1][0]
    return RotationResult(examined=examined, rewritten=rewritten, already_current=current)
