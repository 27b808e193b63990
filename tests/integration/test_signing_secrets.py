"""Tenants' signing secrets in the database, on SQLite and a real Postgres: encrypted at rest
with the payload keys (and plain without keys, like payloads), migration 0006 encrypting the
secrets already stored, rotation with a grace period (repository and CLI, audited without the
secret), and re-encryption by `schedctl db rotate-payload-key`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text
from typer.testing import CliRunner

from schedctl.cli.app import app as cli_app
from schedctl.core import errors
from schedctl.core.crypto import PayloadCipher, is_encrypted
from schedctl.storage.db import schema
from schedctl.storage.db.engine import make_engine
from schedctl.storage.db.migrate import head_revision, upgrade
from schedctl.storage.db.store import Store
from schedctl.storage.jobs.payloads import configure_payload_cipher
from schedctl.storage.tenants.signing_secrets import (
    SigningKeyCache,
    SigningKeys,
    SigningSecretRepo,
    rotate_signing_secrets,
)
from schedctl.storage.tenants.tenants import TenantRepo

runner = CliRunner()
EMPTY = ["empty_sqlite_url", pytest.param("empty_pg_url", marks=pytest.mark.postgres)]


@pytest.fixture
def first_key(keys: tuple[str, str]) -> str:
    """The first of the two keys, configured as the process's payload cipher."""
    configure_payload_cipher(PayloadCipher([keys[0]]))
    return keys[0]


def raw_secrets(store: Store, tenant_id: str) -> tuple[str, str | None, datetime | None]:
    t = schema.tenants
    with store.read() as connection:
        row = connection.execute(
            select(
                t.c.signing_secret, t.c.signing_secret_previous, t.c.signing_secret_previous_until
            ).where(t.c.tenant_id == tenant_id)
        ).one()
    return row[0], row[1], row[2]


def test_secret_is_stored_encrypted_when_keys_are_configured(
    store: Store, keys: tuple[str, str]
) -> None:
    configure_payload_cipher(PayloadCipher([keys[0]]))
    repo = TenantRepo(store)
    tenant, _token = repo.create("acme", actor="test")
    secret = repo.signing_secret("acme")
    assert len(secret) >= 32
    stored, previous, until = raw_secrets(store, tenant.tenant_id)
    assert is_encrypted(stored) and secret not in stored
    assert PayloadCipher([keys[0]]).decrypt(stored) == secret
    assert (previous, until) == (None, None)
    # the other key cannot read it, and the error names the cause
    configure_payload_cipher(PayloadCipher([keys[1]]))
    with pytest.raises(errors.ConfigError, match="signing secret cannot be decrypted"):
        repo.signing_secret("acme")


def test_without_keys_secrets_are_plain_like_payloads(store: Store, keys: tuple[str, str]) -> None:
    configure_payload_cipher(None)
    repo = TenantRepo(store)
    tenant, _token = repo.create("acme", actor="test")
    stored, _, _ = raw_secrets(store, tenant.tenant_id)
    assert not is_encrypted(stored) and repo.signing_secret("acme") == stored
    # plain secrets from before encryption still read once keys are configured
    configure_payload_cipher(PayloadCipher([keys[0]]))
    assert repo.signing_secret("acme") == stored
    SigningSecretRepo(store).rotate("acme", grace=timedelta(hours=1), actor="test")
    new, previous, _ = raw_secrets(store, tenant.tenant_id)
    assert is_encrypted(new) and previous is not None and is_encrypted(previous)
    # an encrypted secret with no keys configured says so instead of signing wrongly
    configure_payload_cipher(None)
    with pytest.raises(errors.ConfigError, match="no payload keys are configured"):
        repo.signing_secret("acme")
    cache = SigningKeyCache(store)
    cache.refresh()
    with pytest.raises(errors.ConfigError, match="signing secret is encrypted"):
        cache.secrets_for(tenant.tenant_id)


@pytest.fixture(params=EMPTY)
def empty_url(request: pytest.FixtureRequest) -> str:
    url = request.getfixturevalue(request.param)
    assert isinstance(url, str)
    return url


@pytest.mark.parametrize("with_keys", [True, False], ids=["keys", "no-keys"])
def test_migration_0006_encrypts_the_stored_secrets(
    empty_url: str, keys: tuple[str, str], with_keys: bool
) -> None:
    configure_payload_cipher(None)
    upgrade(empty_url, "0004")
    engine = make_engine(empty_url)
    try:
        with engine.begin() as connection:
            for tenant_id, secret in (("t1", "plain-secret-1"), ("t2", "plain-secret-2")):
                connection.execute(
                    text(
                        "INSERT INTO tenants (tenant_id, name, signing_secret, max_jobs, "
                        "create_rate_per_minute, dispatch_rate_per_second, allow_list, "
                        "created_at) VALUES (:id, :id, :secret, 10, 10, 10, '[]', :now)"
                    ),
                    {"id": tenant_id, "secret": secret, "now": datetime(2026, 1, 1)},
                )
    finally:
        engine.dispose()
    if with_keys:
        configure_payload_cipher(PayloadCipher([keys[0]]))
    before, after = upgrade(empty_url)
    assert (before, after) == ("0004", head_revision())
    store = Store(make_engine(empty_url))
    try:
        for tenant_id, secret in (("t1", "plain-secret-1"), ("t2", "plain-secret-2")):
            stored, previous, until = raw_secrets(store, tenant_id)
            assert (previous, until) == (None, None)
            if with_keys:
                assert is_encrypted(stored) and secret not in stored
            else:
                assert stored == secret
            assert TenantRepo(store).signing_secret(tenant_id) == secret
    finally:
        store.close()


@pytest.mark.usefixtures("first_key")
def test_rotation_keeps_the_previous_secret_for_the_grace_period(store: Store) -> None:
    tenants = TenantRepo(store)
    tenant, _ = tenants.create("acme", actor="test")
    old = tenants.signing_secret("acme")
    repo = SigningSecretRepo(store)
    started = datetime.now(UTC)
    after, new = repo.rotate("acme", grace=timedelta(hours=24), actor="ops")
    assert new != old and tenants.signing_secret("acme") == new
    assert (after.current, after.previous) == (new, old)
    assert after.previous_until is not None
    assert timedelta(hours=23) < after.previous_until - started < timedelta(hours=25)
    assert after.active() == (new, old)
    assert after.active(after.previous_until) == (new,)
    stored, previous, _ = raw_secrets(store, tenant.tenant_id)
    assert is_encrypted(stored) and previous is not None and is_encrypted(previous)
    assert old not in previous and new not in stored
    # the relay's view
    cache = SigningKeyCache(store)
    assert cache.secrets_for(tenant.tenant_id) == (new, old)
    # the grace ends (moved into the past): only the new secret signs
    repo.set_previous_until("acme", datetime.now(UTC) - timedelta(seconds=1), actor="ops")
    cache.refresh()
    assert cache.secrets_for(tenant.tenant_id) == (new,)
    # again, without a grace: the previous secret is gone at once
    after, newest = repo.rotate("acme", grace=timedelta(0), actor="ops")
    assert (after.previous, after.previous_until, after.active()) == (None, None, (newest,))
    for bad in (timedelta(seconds=-1), timedelta(days=31)):
        with pytest.raises(errors.ValidationError, match="grace"):
            repo.rotate("acme", grace=bad, actor="ops")
    # audited, never with a secret
    with store.read() as connection:
        rows = connection.execute(
            select(schema.audit_log.c.action, schema.audit_log.c.detail).where(
                schema.audit_log.c.action.like("signing_secret%")
            )
        ).all()
    assert [r.action for r in rows] == [
        "signing_secret_rotate",
        "signing_secret_grace",
        "signing_secret_rotate",
    ]
    for row in rows:
        for secret in (old, new, newest):
            assert secret not in str(row.detail)


def test_signing_keys_active_only_within_the_grace() -> None:
    until = datetime(2026, 1, 1, tzinfo=UTC)
    keys = SigningKeys("t", current="new", previous="old", previous_until=until)
    assert keys.active(until - timedelta(seconds=1)) == ("new", "old")
    assert keys.active(until) == ("new",)
    assert SigningKeys("t", current="only").active() == ("only",)


def test_rotate_payload_key_reencrypts_signing_secrets(store: Store, keys: tuple[str, str]) -> None:
    old_key, new_key = keys
    configure_payload_cipher(None)
    tenants = TenantRepo(store)
    plain, _ = tenants.create("plain", actor="test")
    configure_payload_cipher(PayloadCipher([old_key]))
    acme, _ = tenants.create("acme", actor="test")
    _, secret = SigningSecretRepo(store).rotate("acme", grace=timedelta(hours=1), actor="test")
    configure_payload_cipher(PayloadCipher([new_key, old_key]))
    result = rotate_signing_secrets(store)
    # plain's secret, acme's current and previous ones
    assert (result.examined, result.rewritten, result.already_current) == (3, 3, 0)
    for tenant in (plain, acme):
        stored, previous, _ = raw_secrets(store, tenant.tenant_id)
        assert PayloadCipher([new_key]).is_current(stored)
        if previous is not None:
            assert PayloadCipher([new_key]).is_current(previous)
    assert rotate_signing_secrets(store).rewritten == 0
    # the old key can go
    configure_payload_cipher(PayloadCipher([new_key]))
    assert tenants.signing_secret("acme") == secret
    assert len(SigningKeyCache(store).secrets_for(acme.tenant_id)) == 2


@pytest.mark.usefixtures("first_key")
def test_cli_rotate_then_show(db_url: str) -> None:
    def run(*args: str) -> str:
        result = runner.invoke(cli_app, ["--db", db_url, *args])
        assert result.exit_code == 0, result.output
        return str(result.stdout)

    run("tenant", "create", "acme")
    first = run("tenant", "signing-secret", "acme").strip()
    rotated = json.loads(
        run("tenant", "signing-secret", "rotate", "acme", "--grace", "2h", "-o", "json")
    )
    assert rotated["signing_secret"] != first and rotated["grace_seconds"] == 7200
    assert rotated["previous_until"].endswith("Z")
    assert run("tenant", "signing-secret", "show", "acme").strip() == rotated["signing_secret"]
    assert run("tenant", "signing-secret", "acme").strip() == rotated["signing_secret"]
    said = run("tenant", "signing-secret", "rotate", "acme", "--grace", "0")
    assert "no longer signs" in said
    bad = runner.invoke(
        cli_app, ["--db", db_url, "tenant", "signing-secret", "rotate", "acme", "--grace", "soon"]
    )
    assert bad.exit_code == 2 and "grace" in bad.output
