"""The SSRF guard without a network: every refused address class, numeric tricks, IPv6 and
IPv4-in-IPv6 forms, names resolving to private addresses (injected resolver), allow-list
exceptions by name and CIDR, URL pinning and allow-list entry validation."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import pytest

from schedctl.core import errors
from schedctl.core.ssrf import (
    AllowList,
    UnresolvableHost,
    check_at_creation,
    check_destination,
    forbidden_reason,
    literal_address,
    normalize_entry,
    pinned_url,
    tls_name,
)


def resolver(table: dict[str, Sequence[str]]):  # type: ignore[no-untyped-def]
    def resolve(host: str, port: int) -> Sequence[str]:
        del port
        if host not in table:
            raise UnresolvableHost(f"{host} does not resolve")
        return table[host]

    return resolve


NO_DNS = resolver({})


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1/", "loopback"),
        ("http://127.8.9.10:8080/x", "loopback"),
        ("http://10.0.0.1/", "private"),
        ("http://172.16.5.4/", "private"),
        ("http://192.168.1.1/", "private"),
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://169.254.1.1/", "link-local"),
        ("http://100.64.0.1/", "CGNAT"),
        ("http://100.127.255.254/", "CGNAT"),
        ("http://224.0.0.1/", "multicast"),
        ("http://239.255.255.250/", "multicast"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://0.1.2.3/", "unspecified"),
        ("http://240.0.0.1/", "reserved"),
        ("http://255.255.255.255/", "broadcast"),
        ("http://192.0.2.10/", "documentation"),
        ("http://[::1]/", "loopback"),
        ("http://[::]/", "unspecified"),
        ("http://[fc00::1]/", "unique local"),
        ("http://[fd12:3456::1]/", "unique local"),
        ("http://[fe80::1]/", "link-local"),
        ("http://[ff02::1]/", "multicast"),
        ("http://[::ffff:127.0.0.1]/", "IPv4-mapped IPv6 form of a loopback"),
        ("http://[::ffff:169.254.169.254]/", "IPv4-mapped IPv6 form of a cloud metadata"),
        ("http://[::ffff:169.254.1.1]/", "IPv4-mapped IPv6 form of a link-local"),
        ("http://[::ffff:10.1.2.3]/", "IPv4-mapped IPv6 form of a private"),
        ("http://[::ffff:7f00:1]/", "IPv4-mapped IPv6 form of a loopback"),
        ("http://[64:ff9b::a00:1]/", "IPv4-embedding IPv6 form of a private"),
        ("http://[2002:a00:1::]/", "IPv4-embedding IPv6 form of a private"),
        ("http://[::127.0.0.1]/", "IPv4-embedding IPv6 form of a loopback"),
        # numeric tricks the C library reads as 127.0.0.1 / 10.0.0.1
        ("http://2130706433/", "loopback"),
        ("http://0x7f.1/", "loopback"),
        ("http://0x7f000001/", "loopback"),
        ("http://017700000001/", "loopback"),
        ("http://0177.0.0.1/", "loopback"),
        ("http://127.1/", "loopback"),
        ("http://127.0.1/", "loopback"),
        ("http://167772161/", "private"),
        ("http://127.0.0.1./", "loopback"),
    ],
)
def test_each_refused_class(url: str, reason: str) -> None:
    with pytest.raises(errors.ForbiddenDestination, match=reason) as caught:
        check_destination(url, [], resolver=NO_DNS)
    assert caught.value.field == "target.url"
    assert "schedctl tenant allow" in str(caught.value)
    # creation refuses them too: no DNS is involved for a literal address
    with pytest.raises(errors.ForbiddenDestination):
        check_at_creation(url, [], resolver=NO_DNS)


def test_numeric_forms_denote_the_address_they_trick_with() -> None:
    for text in ("2130706433", "0x7f.1", "017700000001", "0x7F.0.0.1", "127.1"):
        assert literal_address(text) == ipaddress.IPv4Address("127.0.0.1"), text
    assert literal_address("hooks.example.com") is None
    assert literal_address("1.2.3.4.5") is None


def test_digits_that_are_no_address_are_refused() -> None:
    for url in ("http://1.2.3.4.5/", "http://4294967296/", "http://08.1.1.1/"):
        with pytest.raises(errors.ForbiddenDestination, match="neither a host name"):
            check_destination(url, [], resolver=NO_DNS)


def test_public_addresses_pass() -> None:
    for url in ("https://93.184.216.34/hook", "http://8.8.8.8:8080/", "https://[2606:4700::1]/"):
        destination = check_destination(url, [], resolver=NO_DNS)
        assert len(destination.addresses) == 1


def test_a_name_resolving_to_a_private_address_is_refused() -> None:
    dns = resolver({"hooks.acme.test": ["10.0.0.1"]})
    with pytest.raises(errors.ForbiddenDestination, match="resolves to a private address"):
        check_destination("https://hooks.acme.test/run", [], resolver=dns)
    with pytest.raises(errors.ForbiddenDestination):
        check_at_creation("https://hooks.acme.test/run", [], resolver=dns)


def test_every_resolved_address_is_checked() -> None:
    dns = resolver({"mixed.test": ["93.184.216.34", "169.254.169.254"]})
    with pytest.raises(errors.ForbiddenDestination, match="cloud metadata"):
        check_destination("http://mixed.test/", [], resolver=dns)


def test_localhost_resolves_to_loopback_with_the_system_resolver() -> None:
    with pytest.raises(errors.ForbiddenDestination, match="loopback"):
        check_destination("http://localhost:8080/", [])


def test_allow_list_by_host_name_and_by_cidr() -> None:
    dns = resolver({"hooks.internal": ["10.1.2.3"], "other.internal": ["10.9.9.9"]})
    by_name = AllowList.parse(["Hooks.Internal"])
    assert check_destination("http://hooks.internal/", by_name, resolver=dns).addresses == (
        "10.1.2.3",
    )
    with pytest.raises(errors.ForbiddenDestination):
        check_destination("http://other.internal/", by_name, resolver=dns)
    allowed_and_refused = {
        # an allowed CIDR also covers the IPv4-mapped form of its addresses
        "10.0.0.0/8": (
            ["http://other.internal/", "http://10.200.0.1/", "http://[::ffff:10.0.0.5]/"],
            "http://192.168.0.1/",
        ),
        "127.0.0.1": (["http://127.0.0.1:9000/", "http://2130706433:9000/"], "http://127.0.0.2/"),
    }
    for entry, (allowed, refused) in allowed_and_refused.items():
        allow = AllowList.parse([entry])
        for url in allowed:
            check_destination(url, allow, resolver=dns)
        with pytest.raises(errors.ForbiddenDestination):
            check_destination(refused, allow, resolver=dns)


def test_creation_accepts_a_name_that_does_not_resolve_yet() -> None:
    check_at_creation("https://not-yet.example.test/", [], resolver=NO_DNS)
    with pytest.raises(UnresolvableHost):
        check_destination("https://not-yet.example.test/", [], resolver=NO_DNS)


def test_forbidden_reason_of_public_addresses_is_none() -> None:
    for text in ("1.1.1.1", "8.8.4.4", "2001:4860:4860::8888", "2606:4700::1"):
        assert forbidden_reason(ipaddress.ip_address(text)) is None, text


@pytest.mark.parametrize(
    ("entry", "canonical"),
    [
        ("10.0.0.0/8", "10.0.0.0/8"),
        ("10.1.2.3/8", "10.0.0.0/8"),
        ("127.0.0.1", "127.0.0.1/32"),
        ("::1", "::1/128"),
        ("[fd00::]/8", "fd00::/8"),
        ("Hooks.Example.COM.", "hooks.example.com"),
        ("localhost", "localhost"),
        ("0x7f.1", "127.0.0.1/32"),
    ],
)
def test_allow_list_entries_are_canonical(entry: str, canonical: str) -> None:
    assert normalize_entry(entry) == canonical


@pytest.mark.parametrize("entry", ["", "  ", "10.0.0.0/33", "http://x/", "a b", "ex ample", "-x-"])
def test_bad_allow_list_entries_are_refused(entry: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        normalize_entry(entry)
    assert caught.value.field == "allow_list"


def test_pinned_url_keeps_path_query_and_host_header() -> None:
    destination = check_destination(
        "https://Hooks.Example.com:8443/a/b?x=1#frag",
        [],
        resolver=resolver({"hooks.example.com": ["93.184.216.34"]}),
    )
    url, host = pinned_url(destination, destination.addresses[0])
    assert url == "https://93.184.216.34:8443/a/b?x=1"
    assert host == "hooks.example.com:8443"
    assert tls_name(host) == "hooks.example.com"
    six = check_destination("http://[2606:4700::1]/", [], resolver=NO_DNS)
    url, host = pinned_url(six, six.addresses[0])
    assert url == "http://[2606:4700::1]:80/"
    assert host == "[2606:4700::1]"
    assert tls_name(host) == "2606:4700::1"


def test_bad_urls_are_validation_errors() -> None:
    for url in ("ftp://example.com/", "http:///x", "http://exa mple.com:99999/"):
        with pytest.raises(errors.ValidationError):
            check_destination(url, [], resolver=NO_DNS)
