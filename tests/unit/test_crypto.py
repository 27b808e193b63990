"""Owns the tests of payload encryption at rest below the database: PayloadCipher (keys from a
file or the environment, rotation) and storage.payloads (encode/decode, the process cipher)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from schedctl.core import errors
from schedctl.core.crypto import KEYS_ENV, KEYS_FILE_ENV, PREFIX, PayloadCipher, is_encrypted
from schedctl.storage.jobs import payloads
from schedctl.storage.jobs.payloads import (
    configure_payload_cipher,
    decode_payload,
    encode_payload,
    payload_cipher,
    reset_payload_cipher,
)

MARKER = "PLAINTEXT-MARKER-7f3a"
OLD, NEW = PayloadCipher.generate_key(), PayloadCipher.generate_key()


@pytest.fixture(autouse=True)
def _fresh_process_cipher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(KEYS_ENV, raising=False)
    monkeypatch.delenv(KEYS_FILE_ENV, raising=False)
    reset_payload_cipher()
    yield
    reset_payload_cipher()


def test_round_trip_hides_the_plaintext() -> None:
    cipher = PayloadCipher([NEW])
    stored = cipher.encrypt(f'{{"secret": "{MARKER}"}}')
    assert stored.startswith(PREFIX) and is_encrypted(stored)
    assert MARKER not in stored
    assert cipher.decrypt(stored) == f'{{"secret": "{MARKER}"}}'
    # a fresh nonce every time: equal payloads do not give equal rows
    assert cipher.encrypt("same") != cipher.encrypt("same")


def test_plaintext_written_before_encryption_still_reads() -> None:
    assert PayloadCipher([NEW]).decrypt('{"a": 1}') == '{"a": 1}'


def test_old_rows_read_after_a_new_key_is_added_first() -> None:
    written = PayloadCipher([OLD]).encrypt(MARKER)
    rotated_config = PayloadCipher([NEW, OLD])
    assert rotated_config.decrypt(written) == MARKER
    assert not rotated_config.is_current(written)
    # new writes use the new key
    assert rotated_config.is_current(rotated_config.encrypt("x"))


def test_rotate_reencrypts_with_the_current_key() -> None:
    written = PayloadCipher([OLD]).encrypt(MARKER)
    both = PayloadCipher([NEW, OLD])
    rotated = both.rotate(written)
    assert both.is_current(rotated)
    # after rotation the old key can go
    assert PayloadCipher([NEW]).decrypt(rotated) == MARKER
    # plaintext rows get encrypted by a rotation
    assert PayloadCipher([NEW]).decrypt(both.rotate('{"p": 1}')) == '{"p": 1}'


def test_a_removed_key_is_a_clear_error_not_garbage() -> None:
    written = PayloadCipher([OLD]).encrypt(MARKER)
    with pytest.raises(errors.ConfigError) as info:
        PayloadCipher([NEW]).decrypt(written)
    assert "rotate-payload-key" in str(info.value)
    assert OLD not in str(info.value) and NEW not in str(info.value)


@pytest.mark.parametrize("bad", ["", "not-a-key", "A" * 44, "Zm9v"])
def test_bad_keys_are_refused_without_echoing_them(bad: str) -> None:
    with pytest.raises(errors.ConfigError) as info:
        PayloadCipher([NEW, bad]) if bad else PayloadCipher([])
    if bad:
        assert "key 2" in str(info.value)
        assert bad not in str(info.value)


def test_keys_from_a_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# current first\n{NEW}\n\n{OLD}\n")
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    cipher = PayloadCipher.from_env({KEYS_FILE_ENV: str(path)})
    assert cipher is not None and cipher.key_count == 2
    assert cipher.is_current(cipher.encrypt("x"))
    assert PayloadCipher([NEW]).decrypt(cipher.encrypt("x")) == "x"
    assert "readable by other users" not in caplog.text
    path.chmod(0o644)
    PayloadCipher.from_file(path)
    assert "readable by other users" in caplog.text
    assert NEW not in caplog.text


def test_keys_from_the_environment_and_the_file_wins(tmp_path: Path) -> None:
    cipher = PayloadCipher.from_env({KEYS_ENV: f" {NEW} , {OLD} "})
    assert cipher is not None and cipher.key_count == 2
    path = tmp_path / "keys"
    path.write_text(OLD + "\n")
    from_file = PayloadCipher.from_env({KEYS_ENV: NEW, KEYS_FILE_ENV: str(path)})
    assert from_file is not None and from_file.key_count == 1
    assert from_file.is_current(PayloadCipher([OLD]).encrypt("x"))
    assert PayloadCipher.from_env({}) is None


def test_unreadable_key_file(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError) as info:
        PayloadCipher.from_env({KEYS_FILE_ENV: str(tmp_path / "missing")})
    assert "cannot read the payload key file" in str(info.value)


# -- storage.payloads ------------------------------------------------------------------


def test_without_keys_payloads_are_plain_json() -> None:
    assert payload_cipher() is None
    stored = encode_payload({"a": [1, "two"]})
    assert json.loads(stored) == {"a": [1, "two"]}
    assert decode_payload(stored) == {"a": [1, "two"]}


def test_with_a_configured_cipher_payloads_are_encrypted() -> None:
    configure_payload_cipher(PayloadCipher([NEW]))
    stored = encode_payload({"secret": MARKER})
    assert is_encrypted(stored) and MARKER not in stored
    assert decode_payload(stored) == {"secret": MARKER}
    # rows from before encryption was switched on
    assert decode_payload('{"old": true}') == {"old": True}


def test_the_environment_configures_the_process_cipher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, NEW)
    stored = encode_payload({"secret": MARKER})
    assert MARKER not in stored
    assert PayloadCipher([NEW]).decrypt(stored) == json.dumps({"secret": MARKER})


def test_an_encrypted_row_without_keys_is_a_clear_error() -> None:
    stored = PayloadCipher([NEW]).encrypt("{}")
    configure_payload_cipher(None)
    with pytest.raises(errors.ConfigError) as info:
        decode_payload(stored)
    assert "SCHEDULED_PAYLOAD_KEYS_FILE" in str(info.value)


def test_a_bad_environment_fails_loudly_not_in_plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, "not-a-key")
    with pytest.raises(errors.ConfigError):
        encode_payload({"secret": MARKER})


def test_rotate_payloads_needs_keys() -> None:
    with pytest.raises(errors.ConfigError):
        payloads.rotate_payloads(store=None, cipher=None)  # type: ignore[arg-type]


def test_module_does_not_keep_keys_in_its_repr() -> None:
    cipher = PayloadCipher([NEW])
    assert NEW not in repr(cipher) and NEW not in str(vars(cipher))
    assert os.environ.get(KEYS_ENV) is None
