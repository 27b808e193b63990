"""The SSRF guard's own table of special-purpose ranges, on any Python version: the first and
last address of every IANA IPv4/IPv6 Special-Purpose block (and multicast, site-local,
metadata) is refused, public neighbours of those blocks pass, IPv4 hidden in IPv6 forms is
refused, the standard library's is_global & co are never consulted, host names follow
UTS-46, and no refusal tells the tenant what a name resolved to."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime

import pytest

from schedctl.core import errors
from schedctl.core.ssrf import (
    AllowList,
    UnresolvableHost,
    check_at_creation,
    check_destination,
    forbidden_reason,
    hide_addresses,
    host_to_ascii,
    normalize_entry,
    split_url,
)
from schedctl.delivery.http import DeliveryResult, HttpDelivery
from schedctl.domain.models import Verdict


def resolver(table: dict[str, Sequence[str]]):  # type: ignore[no-untyped-def]
    seen: list[str] = []

    def resolve(host: str, port: int) -> Sequence[str]:
        del port
        seen.append(host)
        if host not in table:
            raise UnresolvableHost(f"{host} does not resolve")
        return table[host]

    resolve.seen = seen  # type: ignore[attr-defined]
    return resolve


NO_DNS = resolver({})

# Written out here on purpose (not imported from the module): the test is the spec.
IPV4_SPECIAL = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.0.0/29",
    "192.0.0.8/32",
    "192.0.0.9/32",
    "192.0.0.10/32",
    "192.0.0.170/31",
    "192.0.2.0/24",
    "192.31.196.0/24",
    "192.52.193.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "192.175.48.0/24",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "255.255.255.255/32",
]
IPV6_SPECIAL = [
    "::/128",
    "::1/128",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "100:0:0:1::/64",
    "2001::/23",
    "2001::/32",
    "2001:1::1/128",
    "2001:1::2/128",
    "2001:1::3/128",
    "2001:2::/48",
    "2001:3::/32",
    "2001:4:112::/48",
    "2001:10::/28",
    "2001:20::/28",
    "2001:30::/28",
    "2001:db8::/32",
    "2002::/16",
    "2620:4f:8000::/48",
    "3fff::/20",
    "5f00::/16",
    "fc00::/7",
    "fe80::/10",
    "fec0::/10",
    "ff00::/8",
]
METADATA = [
    "169.254.169.254",
    "168.63.129.16",
    "100.100.100.200",
    "fd00:ec2::254",
    "fd20:ce::254",
    "192.0.0.192",
]
# public, and most of them right next to a special block
PUBLIC = [
    "1.1.1.1",
    "8.8.8.8",
    "9.255.255.255",
    "11.0.0.0",
    "100.63.255.255",
    "100.128.0.0",
    "126.255.255.255",
    "128.0.0.0",
    "168.63.129.15",
    "168.63.129.17",
    "169.253.255.255",
    "169.255.0.0",
    "172.15.255.255",
    "172.32.0.0",
    "192.0.1.255",
    "192.0.3.0",
    "192.88.98.255",
    "192.167.255.255",
    "192.169.0.0",
    "198.17.255.255",
    "198.20.0.0",
    "223.255.255.255",
    "2001:200::1",
    "2001:4860:4860::8888",
    "2001:db7:ffff::1",
    "2001:db9::1",
    "2003::1",
    "2606:4700:4700::1111",
    "2620:4f:7fff:ffff::1",
    "2620:4f:8001::1",
    "3ffe:ffff::1",
    "3fff:1000::1",
]


def first_and_last(cidr: str) -> Iterator[str]:
    network = ipaddress.ip_network(cidr)
    bits = 32 if network.version == 4 else 128
    first = int(network.network_address)
    last = first | ((1 << (bits - network.prefixlen)) - 1)
    yield str(ipaddress.ip_address(first))
    yield str(ipaddress.ip_address(last))


def url_of(address: str) -> str:
    return f"http://[{address}]/" if ":" in address else f"http://{address}/"


@pytest.mark.parametrize("cidr", IPV4_SPECIAL + IPV6_SPECIAL)
def test_first_and_last_address_of_every_special_block_are_refused(cidr: str) -> None:
    for text in first_and_last(cidr):
        assert forbidden_reason(ipaddress.ip_address(text)) is not None, text
        with pytest.raises(errors.ForbiddenDestination, match="destination is not allowed"):
            check_destination(url_of(text), [], resolver=NO_DNS)
        with pytest.raises(errors.ForbiddenDestination):
            check_at_creation(url_of(text), [], resolver=NO_DNS)


@pytest.mark.parametrize("text", METADATA)
def test_cloud_metadata_addresses_are_refused(text: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(text)) == "cloud metadata service"
    with pytest.raises(errors.ForbiddenDestination, match="cloud metadata"):
        check_destination(url_of(text), [], resolver=NO_DNS)


@pytest.mark.parametrize("text", PUBLIC)
def test_public_addresses_are_accepted(text: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(text)) is None
    assert check_destination(url_of(text), [], resolver=NO_DNS).addresses == (text,)


def test_ipv6_outside_global_unicast_is_reserved() -> None:
    for text in ("4000::1", "8000::1", "e000::1", "fe00::1", "1::1", "200::1"):
        reason = forbidden_reason(ipaddress.ip_address(text))
        assert reason is not None and "reserved" in reason, text


def test_the_standard_librarys_classification_is_never_consulted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """is_global & co differ between Python patch releases: poisoned, they must not matter."""

    def boom(self: object) -> bool:
        raise AssertionError("the SSRF guard asked the standard library")

    for cls in (
        ipaddress.IPv4Address,
        ipaddress.IPv6Address,
        ipaddress.IPv4Network,
        ipaddress.IPv6Network,
    ):
        for name in (
            "is_global",
            "is_private",
            "is_reserved",
            "is_loopback",
            "is_link_local",
            "is_multicast",
            "is_unspecified",
            "is_site_local",
            "ipv4_mapped",
            "sixtofour",
            "teredo",
        ):
            if hasattr(cls, name):
                monkeypatch.setattr(cls, name, property(boom))
    for cidr in IPV4_SPECIAL + IPV6_SPECIAL:
        for text in first_and_last(cidr):
            assert forbidden_reason(ipaddress.ip_address(text)) is not None, text
    for text in METADATA:
        assert forbidden_reason(ipaddress.ip_address(text)) is not None, text
    for text in PUBLIC:
        assert forbidden_reason(ipaddress.ip_address(text)) is None, text
    for url in ("http://[::ffff:10.0.0.1]/", "http://[2002:a9fe:a9fe::]/", "http://0x7f.1/"):
        with pytest.raises(errors.ForbiddenDestination):
            check_destination(url, [], resolver=NO_DNS)


def teredo(server: str, client: str) -> str:
    """A Teredo address: 2001:0::/32, server IPv4, flags, port, client IPv4 (both of the
    last two stored inverted)."""
    number = (0x20010000 << 96) | (int(ipaddress.IPv4Address(server)) << 64)
    number |= (0xFFFF ^ 0x1234) << 32 | (~int(ipaddress.IPv4Address(client)) & 0xFFFFFFFF)
    return str(ipaddress.IPv6Address(number))


def embeddings(v4: str) -> dict[str, str]:
    """Every IPv6 form that carries the IPv4 address `v4`, by name."""
    n = int(ipaddress.IPv4Address(v4))
    six = ipaddress.IPv6Address
    return {
        "mapped": str(six((0xFFFF << 32) | n)),
        "translated": str(six((0xFFFF << 48) | n)),
        "compatible": str(six(n)),
        "nat64": str(six((0x64FF9B << 96) | n)),
        "6to4": str(six((0x2002 << 112) | (n << 80) | 1)),
        "teredo-server": teredo(v4, "93.184.216.34"),
        "teredo-client": teredo("93.184.216.34", v4),
    }


@pytest.mark.parametrize(
    "inner", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "168.63.129.16", "100.64.0.1"]
)
def test_ipv4_hidden_in_ipv6_is_refused_as_what_it_hides(inner: str) -> None:
    for kind, text in embeddings(inner).items():
        reason = forbidden_reason(ipaddress.ip_address(text))
        assert reason is not None, (kind, text)
        assert "IPv6 form of a" in reason, (kind, text, reason)
        if kind == "mapped":
            assert reason.startswith("IPv4-mapped"), reason
        with pytest.raises(errors.ForbiddenDestination):
            check_destination(url_of(text), [], resolver=NO_DNS)


def test_ipv6_forms_of_a_public_ipv4_are_refused_too() -> None:
    """The transition blocks themselves are special: a tenant's endpoint has a plain
    address, never ::ffff:8.8.8.8 or 2002:808:808::."""
    for kind, text in embeddings("8.8.8.8").items():
        reason = forbidden_reason(ipaddress.ip_address(text))
        assert reason is not None and "IPv6 form" not in reason, (kind, text, reason)


def test_allow_list_still_opens_what_it_names() -> None:
    dns = resolver(
        {
            "hooks.internal": ["10.1.2.3"],
            "localhost": ["127.0.0.1", "::1"],
            "meta": ["fd00:ec2::254"],
        }
    )
    # tests (and an operator) may allow loopback explicitly
    loopback = AllowList.parse(["127.0.0.0/8", "::1"])
    assert check_destination("http://localhost:8080/", loopback, resolver=dns).addresses == (
        "127.0.0.1",
        "::1",
    )
    check_destination("http://[::ffff:127.0.0.1]:8080/", loopback, resolver=dns)
    check_destination("http://hooks.internal/", ["hooks.internal"], resolver=dns)
    check_destination("http://192.0.2.7/", ["192.0.2.0/24"], resolver=dns)
    with pytest.raises(errors.ForbiddenDestination):
        check_destination("http://10.1.2.3/", loopback, resolver=dns)


def test_an_allowed_host_name_never_opens_cloud_metadata() -> None:
    dns = resolver({"hooks.acme.test": ["169.254.169.254"], "six.acme.test": ["fd00:ec2::254"]})
    for host in ("hooks.acme.test", "six.acme.test"):
        with pytest.raises(errors.ForbiddenDestination, match="never by an allowed host name"):
            check_destination(f"http://{host}/", [host], resolver=dns)
    # only a CIDR holding the address does
    check_destination("http://hooks.acme.test/", ["169.254.169.254/32"], resolver=dns)
    check_destination("http://six.acme.test/", ["fd00:ec2::/64"], resolver=dns)


# -- host names: UTS-46 -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "ascii"),
    [
        ("faß.de", "xn--fa-hia.de"),  # IDNA 2003 would say fass.de: another host
        ("FAß.DE", "xn--fa-hia.de"),
        ("ｆａß。ｄｅ", "xn--fa-hia.de"),  # full-width letters and dot  # noqa: RUF001
        ("xn--fa-hia.de", "xn--fa-hia.de"),
        ("faß.de.", "xn--fa-hia.de."),
        ("日本.jp", "xn--wgv71a.jp"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("hooks.example.com", "hooks.example.com"),
        ("My_Host.internal", "my_host.internal"),
    ],
)
def test_host_names_follow_uts46(host: str, ascii: str) -> None:
    assert host_to_ascii(host, field="target.url") == ascii
    scheme, got, port = split_url(f"https://{host}:8443/x")
    assert (scheme, got, port) == ("https", ascii.lower(), 8443)


def test_the_resolver_and_host_header_get_the_ascii_name() -> None:
    dns = resolver({"xn--fa-hia.de": ["93.184.216.34"]})
    destination = check_destination("https://faß.de/hook", [], resolver=dns)
    assert destination.host == "xn--fa-hia.de"
    assert dns.seen == ["xn--fa-hia.de"]  # type: ignore[attr-defined]
    assert normalize_entry("Faß.de") == "xn--fa-hia.de"
    check_destination(
        "https://faß.de/", ["faß.de"], resolver=resolver({"xn--fa-hia.de": ["10.0.0.9"]})
    )


@pytest.mark.parametrize(
    "host",
    [
        "-x.example",
        "x-.example",
        "a..b",
        "xn--zz.example",
        "xn--a.example",
        "\u200d.example",  # a lone zero-width joiner
        "a" * 64 + ".example",
        "ex%41mple.com",
        "bad!.example",
        "a\u0300\u0301b\u05d0.example",  # mixed right-to-left: bidi rule
    ],
)
def test_invalid_host_labels_are_refused_naming_the_field(host: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        check_destination(f"https://{host}/", [], resolver=NO_DNS)
    assert not isinstance(caught.value, errors.ForbiddenDestination)
    assert caught.value.field == "target.url"
    assert str(caught.value).startswith("target.url: ")
    assert "not a valid host name" in str(caught.value)
    with pytest.raises(errors.ValidationError) as entry:
        normalize_entry(host)
    assert entry.value.field == "allow_list"


def test_full_width_digits_are_the_address_they_spell() -> None:
    with pytest.raises(errors.ForbiddenDestination, match="loopback"):
        check_destination("http://１２７．０．０．１/", [], resolver=NO_DNS)  # noqa: RUF001


# -- what the tenant is told ----------------------------------------------------------------


RESOLVED = {
    "private.acme.test": ["10.20.30.40"],
    "meta.acme.test": ["169.254.169.254"],
    "mixed.acme.test": ["93.184.216.34", "172.16.9.9"],
    "mapped.acme.test": ["::ffff:192.168.77.1"],
    "azure.acme.test": ["168.63.129.16"],
    "junk.acme.test": ["not-an-address-7.7.7.7"],
}


@pytest.mark.parametrize("host", sorted(RESOLVED))
def test_a_refusal_never_tells_the_tenant_what_a_name_resolved_to(
    host: str, caplog: pytest.LogCaptureFixture
) -> None:
    dns = resolver(RESOLVED)
    caplog.set_level(logging.INFO, logger="schedctl.core.ssrf")
    for check in (check_destination, check_at_creation):
        with pytest.raises(errors.ForbiddenDestination) as caught:
            check(f"https://{host}/hook?token=s3cret", [], resolver=dns)
        message = str(caught.value)
        assert "destination is not allowed" in message
        for text in RESOLVED[host]:
            assert text not in message
        for fragment in ("10.20", "169.254", "172.16", "192.168", "c0a8", "168.63", "7.7.7.7"):
            assert fragment not in message
    # the operator's log has the detail, without the URL's path and query
    logged = "\n".join(r.getMessage() for r in caplog.records)
    last = RESOLVED[host][-1]
    try:
        shown = str(ipaddress.ip_address(last))  # ::ffff:c0a8:4d01 on some Pythons
    except ValueError:
        shown = repr(last)
    assert shown in logged
    assert "s3cret" not in logged


def deliver_once(delivery: HttpDelivery, url: str, allow_list: list[str]) -> DeliveryResult:
    """One attempt of a run to `url`; `delivery` is closed after it."""
    try:
        return delivery.deliver(
            url=url,
            allow_list=allow_list,
            secret="x" * 32,
            job_id="0123abcd",
            scheduled_at=datetime(2026, 1, 1, tzinfo=UTC),
            attempt=1,
            payload={},
        )
    finally:
        delivery.close()


def test_the_run_history_error_of_a_refused_delivery_hides_the_address() -> None:
    delivery = HttpDelivery(resolver=resolver({"hooks.acme.test": ["10.66.77.88"]}))
    result = deliver_once(delivery, "https://hooks.acme.test/run", [])
    assert result.verdict is Verdict.failed
    assert result.error is not None and "not allowed" in result.error
    assert "10.66.77.88" not in result.error


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        (
            "HTTPConnection(host='10.1.2.3', port=8080): Failed to establish a new connection",
            "HTTPConnection(host='<address>', port=8080): Failed to establish a new connection",
        ),
        ("Connection to 10.0.0.1 timed out. (connect timeout=5.0)", None),
        ("Connection to [fe80::1%eth0]:80 refused", "Connection to [<address>]:80 refused"),
        ("via ::ffff:10.0.0.1 and 2001:db8::1.", "via <address> and <address>."),
        ("to 10.0.0.1.", "to <address>."),
        # not addresses: left alone
        ("at 12:30:45, version 1.2.3, 1.2.3.4.5", "at 12:30:45, version 1.2.3, 1.2.3.4.5"),
        ("hooks.test:443 certificate", "hooks.test:443 certificate"),
    ],
)
def test_hide_addresses(text: str, hidden: str | None) -> None:
    got = hide_addresses(text)
    if hidden is not None:
        assert got == hidden
    assert "10.0.0.1" not in got and "10.1.2.3" not in got


def test_a_network_error_in_the_run_history_hides_the_pinned_address() -> None:
    """The connection goes to the checked address, and urllib3's message names it: the
    error the tenant reads names the host it gave, never where that host pointed."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: connecting is refused
    delivery = HttpDelivery(timeout=5, resolver=resolver({"hooks.acme.test": ["127.0.0.1"]}))
    result = deliver_once(delivery, f"http://hooks.acme.test:{port}/run", ["hooks.acme.test"])
    assert result.verdict is Verdict.retry
    assert result.error is not None and "network error" in result.error
    assert "127.0.0.1" not in result.error
