"""The guard's cache at delivery (GuardCache): a name is resolved once per DNS_CACHE_SECONDS,
every check with that resolution still refuses private addresses, an allow-list is checked
as given (a changed one is not served from the cache), a changed DNS answer is used and
checked once the entry expires, and failed resolutions are not kept. A fake clock: no
sleeping, no timing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schedctl.core import errors
from schedctl.core.ssrf import DNS_CACHE_SECONDS, GuardCache, UnresolvableHost
from tests.fakes import ManualClock


class Dns:
    """A resolver whose answers the test changes, counting lookups."""

    def __init__(self, answers: dict[str, Sequence[str]]) -> None:
        self.answers = dict(answers)
        self.lookups: list[str] = []

    def __call__(self, host: str, port: int) -> Sequence[str]:
        del port
        self.lookups.append(host)
        if host not in self.answers:
            raise UnresolvableHost(f"{host} does not resolve")
        return self.answers[host]


def test_a_name_is_resolved_once_per_ttl_and_connects_to_the_checked_address() -> None:
    dns, clock = Dns({"hooks.example.com": ["93.184.216.34"]}), ManualClock(1000.0)
    guard = GuardCache(dns, clock=clock)
    first, expires = guard.check("https://hooks.example.com/run", [])
    again, _ = guard.check("https://hooks.example.com/other", [])
    assert first.addresses == again.addresses == ("93.184.216.34",)
    assert dns.lookups == ["hooks.example.com"]
    assert expires == clock.now + DNS_CACHE_SECONDS
    clock.now += DNS_CACHE_SECONDS + 0.1
    guard.check("https://hooks.example.com/run", [])
    assert dns.lookups == ["hooks.example.com"] * 2


def test_a_cached_private_resolution_is_refused_on_every_call() -> None:
    dns, clock = Dns({"internal.example.com": ["10.1.2.3"]}), ManualClock(1000.0)
    guard = GuardCache(dns, clock=clock)
    for _ in range(3):
        with pytest.raises(errors.ForbiddenDestination, match="a private address"):
            guard.check("https://internal.example.com/run", [])
    assert dns.lookups == ["internal.example.com"]  # cached, and checked every time
    # an allow-list naming the host is another check of the same resolution
    destination, _ = guard.check("https://internal.example.com/run", ["internal.example.com"])
    assert destination.addresses == ("10.1.2.3",)
    with pytest.raises(errors.ForbiddenDestination):
        guard.check("https://internal.example.com/run", [])


def test_a_rebinding_answer_is_checked_when_the_entry_expires() -> None:
    dns, clock = Dns({"rebind.example.com": ["93.184.216.34"]}), ManualClock(1000.0)
    guard = GuardCache(dns, clock=clock)
    guard.check("https://rebind.example.com/", [])
    dns.answers["rebind.example.com"] = ["93.184.216.34", "169.254.169.254"]
    clock.now += DNS_CACHE_SECONDS + 0.1
    with pytest.raises(errors.ForbiddenDestination, match="cloud metadata"):
        guard.check("https://rebind.example.com/", [])


def test_a_failed_resolution_is_not_kept() -> None:
    dns, clock = Dns({}), ManualClock(1000.0)
    guard = GuardCache(dns, clock=clock)
    with pytest.raises(UnresolvableHost):
        guard.check("https://later.example.com/", [])
    dns.answers["later.example.com"] = ["93.184.216.34"]
    destination, _ = guard.check("https://later.example.com/", [])
    assert destination.addresses == ("93.184.216.34",)
    assert dns.lookups == ["later.example.com"] * 2


def test_literal_addresses_need_no_resolution_and_are_still_refused() -> None:
    dns = Dns({})
    guard = GuardCache(dns, clock=ManualClock(1000.0))
    with pytest.raises(errors.ForbiddenDestination, match="loopback"):
        guard.check("http://127.0.0.1:8080/", [])
    assert dns.lookups == []
