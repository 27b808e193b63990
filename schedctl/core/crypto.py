"""Owns payload encryption at rest: `PayloadCipher` (Fernet keys with rotation) and where its
keys come from (a key file or the environment). Tenants' signing secrets are encrypted with
the same keys (schedctl.storage.tenants.signing_secrets).

Stored form: ``enc:v1:<Fernet token>``. Text without the prefix is a payload written before
encryption was enabled and is read as it is, so turning encryption on needs no migration.

Keys: ``SCHEDULED_PAYLOAD_KEYS_FILE`` names a file with one key per line (blank lines and
``#`` comments ignored), else ``SCHEDULED_PAYLOAD_KEYS`` holds them comma-separated. The first
key encrypts; every key decrypts. A key is 32 random bytes in url-safe base64, as
``schedctl db new-payload-key`` prints it.

Rotation, without downtime:
1. generate a key and put it FIRST in the key file, keeping the old keys after it;
2. restart every process that reads or writes jobs (API, daemons, CLI users): new payloads
   are now written with the new key, and rows under the old keys still read;
3. ``schedctl db rotate-payload-key`` re-encrypts every stored payload and tenant signing
   secret with the new key (and encrypts any plaintext ones from before encryption was
   enabled);
4. remove the old keys from the file and restart again.
Removing a key before step 3 finished leaves rows nobody can read: decrypt then fails with
an error that names the cause, never silently.

Keys are never logged or put into error messages.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from schedctl.core import errors

log = logging.getLogger(__name__)

PREFIX = "enc:v1:"
KEYS_FILE_ENV = "SCHEDULED_PAYLOAD_KEYS_FILE"
KEYS_ENV = "SCHEDULED_PAYLOAD_KEYS"


class PayloadCipher:
    """Encrypts with the first key, decrypts with any of them."""

    def __init__(self, keys: Sequence[str | bytes], *, source: str = "keys") -> None:
        if not keys:
            raise errors.ConfigError(f"{source}: no payload encryption key", field="payload_keys")
        fernets = []
        for number, key in enumerate(keys, start=1):
            try:
                fernets.append(Fernet(key.strip()))
            except (ValueError, TypeError):
                # the key itself is never shown: it may be a real key with a typo
                raise errors.ConfigError(
                    f"{source}: key {number} is not a Fernet key (32 bytes, url-safe base64; "
                    "make one with `schedctl db new-payload-key`)",
                    field="payload_keys",
                ) from None
        self._current = fernets[0]
        self._all = MultiFernet(fernets)
        self.key_count = len(fernets)
        self.source = source

    # -- construction ------------------------------------------------------------------

    @staticmethod
    def generate_key() -> str:
        return Fernet.generate_key().decode()

    @classmethod
    def from_file(cls, path: str | Path) -> PayloadCipher:
        path = Path(path)
        try:
            text = path.read_text()
            mode = path.stat().st_mode
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read the payload key file {path}: {exc.strerror}", field="payload_keys"
            ) from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("payload key file %s is readable by other users: chmod 600 it", path)
        keys = [
            line.strip()
            for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]
        return cls(keys, source=str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PayloadCipher | None:
        """The cipher the environment configures, or None when encryption is off."""
        env = os.environ if environ is None else environ
        if env.get(KEYS_FILE_ENV):
            return cls.from_file(env[KEYS_FILE_ENV])
        if env.get(KEYS_ENV):
            keys = [k.strip() for k in env[KEYS_ENV].split(",") if k.strip()]
            return cls(keys, source=KEYS_ENV)
        return None

    # -- use ---------------------------------------------------------------------------

    def encrypt(self, text: str) -> str:
        return PREFIX + self._current.encrypt(text.encode()).decode("ascii")

    def decrypt(self, stored: str) -> str:
        """The plaintext of a stored value; values without the prefix are plaintext already."""
        if not is_encrypted(stored):
            return stored
        try:
            return self._all.decrypt(_token(stored)).decode()
        except InvalidToken:
            raise errors.ConfigError(
                f"a stored payload cannot be decrypted with any of the {self.key_count} "
                f"configured key(s) from {self.source}: was a key removed before "
                "`schedctl db rotate-payload-key` finished?",
                field="payload_keys",
            ) from None

    def is_current(self, stored: str) -> bool:
        """True when `stored` is encrypted with the first (current) key."""
        if not is_encrypted(stored):
            return False
        try:
            self._current.decrypt(_token(stored))
        except InvalidToken:
            return False
        return True

    def rotate(self, stored: str) -> str:
        """`stored` encrypted with the current key (plaintext rows get encrypted)."""
        if not is_encrypted(stored):
            return self.encrypt(stored)
        try:
            return PREFIX + self._all.rotate(_token(stored)).decode("ascii")
        except InvalidToken:
            # the same readable error as decrypt
            self.decrypt(stored)
            raise


def is_encrypted(stored: str) -> bool:
    return stored.startswith(PREFIX)


def _token(stored: str) -> bytes:
    return stored[len(PREFIX) :].encode("ascii", errors="replace")
