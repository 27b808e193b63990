"""Secrets in URLs never reach a message: a database password (in the user part or as
libpq's ?password=) is hidden wherever the URL is shown, an unparseable database URL is
not repeated, and a target or webhook URL's path, query and user part stay out of every
error (those reach the run history, dead letters, alerts and logs), while the error still
names the field and the origin."""

from __future__ import annotations

import pytest

from schedctl.core import errors
from schedctl.core.ssrf import check_destination, split_url
from schedctl.domain.alerts.model import parse_alerts
from schedctl.domain.brokers import check_broker_url, redact_url
from schedctl.domain.jobspec import parse_target
from schedctl.storage.db.engine import make_engine, redact

SECRET = "S3CRET-4f1c"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://app:{SECRET}@db.example/app",
        f"postgresql+psycopg://app@db.example/app?password={SECRET}&sslmode=require",
        f"postgresql+psycopg://app@db.example/app?sslpassword={SECRET}",
    ],
)
def test_redact_hides_every_password_of_a_database_url(url: str) -> None:
    shown = redact(url)
    assert SECRET not in shown
    assert "db.example/app" in shown and "***" in shown


def test_redact_keeps_what_is_not_secret() -> None:
    url = "postgresql+psycopg://app@db.example:5433/app?sslmode=require"
    assert redact(url) == url


def test_an_unparseable_database_url_is_not_repeated() -> None:
    # quotes kept by an env file: SQLAlchemy cannot parse it, the password is still in it
    with pytest.raises(errors.ConfigError) as refused:
        make_engine(f'"postgresql://app:{SECRET}@db.example/app"')
    assert refused.value.field == "database_url"
    assert SECRET not in str(refused.value)


def test_a_refused_destination_names_its_origin_not_its_path_or_query() -> None:
    url = f"http://127.0.0.1:8080/hook/{SECRET}?token={SECRET}"
    with pytest.raises(errors.ForbiddenDestination) as refused:
        check_destination(url, [])
    message = str(refused.value)
    assert SECRET not in message
    assert "http://127.0.0.1:8080" in message and refused.value.field == "target.url"


@pytest.mark.parametrize(
    "url",
    [
        f"ftp://host.example/{SECRET}",
        f"http:///{SECRET}",
        f"http://host.example:99999/{SECRET}",
    ],
)
def test_a_malformed_url_is_refused_without_repeating_it(url: str) -> None:
    with pytest.raises(errors.ValidationError) as by_guard:
        split_url(url, "target.url")
    assert SECRET not in str(by_guard.value) and by_guard.value.field == "target.url"
    with pytest.raises(errors.ValidationError) as at_create:
        parse_target({"type": "http", "url": url})
    assert SECRET not in str(at_create.value) and at_create.value.field == "target.url"


def test_a_webhook_with_credentials_is_refused_naming_the_field() -> None:
    with pytest.raises(errors.ValidationError) as refused:
        parse_alerts({"webhook": f"https://ops:{SECRET}@alerts.example/hook"})
    assert refused.value.field == "alerts.webhook"
    assert "credentials" in str(refused.value) and SECRET not in str(refused.value)
    # without them it is taken
    assert parse_alerts({"webhook": "https://alerts.example/hook"}) is not None


def test_a_broker_url_with_an_unescaped_slash_in_its_password_is_refused() -> None:
    # it would parse as host "ops", port 1234, no password: shown whole by tenant show
    with pytest.raises(errors.ValidationError) as refused:
        check_broker_url(f"amqp://ops:1234/{SECRET}@rabbit.example/vhost")
    assert refused.value.field == "broker_url" and SECRET not in str(refused.value)
    escaped = f"amqp://ops:1234%2F{SECRET}@rabbit.example/vhost"
    assert check_broker_url(escaped) == escaped
    assert SECRET not in redact_url(escaped)
