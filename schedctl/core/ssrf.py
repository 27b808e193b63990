"""Owns the SSRF guard: which HTTP destinations a tenant may make the scheduler call.

The rule: a destination whose address is in any block of the IANA IPv4 or IPv6
Special-Purpose Address Registries (loopback, private, link-local 169.254.0.0/16, CGNAT
100.64.0.0/10, documentation, benchmarking, 6to4, Teredo, NAT64, ...), multicast, reserved,
broadcast, IPv6 outside global unicast 2000::/3, or a known cloud metadata address -- in
IPv4 or IPv6, including IPv4 hidden inside IPv6 (mapped ``::ffff:a.b.c.d``, compatible
``::a.b.c.d``, 6to4, Teredo, NAT64) -- is refused unless the tenant's allow-list names its
host or holds a CIDR that contains the address (metadata addresses: only a CIDR). Public
destinations need no entry. The project's own table decides, never the standard library's
``is_global``/``is_private`` (which differ between Python patch releases).

A refusal tells the tenant what kind of address it is, never which address a name resolved
to; that goes to the log.

How it is checked, at job creation and again at every delivery:

1. the host is taken from the URL, a non-ASCII name converted by UTS-46 (``faß.de`` is
   ``xn--fa-hia.de``) and every label checked; numeric forms the C library would accept
   (``2130706433``, ``0x7f.1``, ``017700000001``, ``127.1``) are read as the address they
   denote, so they are checked as that address;
2. a host name is resolved and *every* address is checked: one bad address refuses the
   destination (a name with a public and a private address is not a loophole);
3. delivery connects to one of the checked addresses itself (`pinned_url`), sending the
   original host in the Host header and as TLS SNI and certificate name -- so a DNS answer
   that changes between the check and the connection (rebinding) is never used;
4. no redirect is followed: a 3xx is the endpoint's answer, not a new destination.

At creation a name that does not resolve is accepted (the check at delivery decides);
literal addresses and names that resolve are checked at once.

At delivery (`GuardCache`) a name's resolution is kept for DNS_CACHE_SECONDS (5 s), and so is
the check of a URL against an allow-list made with it: resolving on every call cost more
than the call itself. Every call still connects to an address checked with that resolution
and that allow-list (a changed allow-list is a new cache key); a DNS answer that changes is
used (and checked) at most 5 s later. Failed resolutions are not kept.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import idna

from schedctl.core import errors, limits

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the addresses the host resolves to, as text
Resolver = Callable[[str, int], Sequence[str]]

log = logging.getLogger(__name__)

MAX_ENTRY_LENGTH = 253
MAX_ALLOW_LIST = limits.MAX_ALLOW_LIST
MAX_LABEL_LENGTH = 63
# one ASCII label of a host name: letters, digits, '-' inside, '_' (real DNS names have it)
_ASCII_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?")
# one label of an inet_aton-style number: decimal, 0x-hex or 0-octal
_NUMERIC_PART = re.compile(r"0[xX][0-9a-fA-F]*|[0-9]+")


class UnresolvableHost(errors.SchedError):
    """The destination's host name does not resolve (yet)."""

    code = "unresolvable"


def system_resolver(host: str, port: int) -> list[str]:
    """Every address getaddrinfo gives for a TCP connection to host:port, in its order."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise UnresolvableHost(f"{host} does not resolve: {exc}") from exc
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = str(sockaddr[0]).split("%", 1)[0]
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise UnresolvableHost(f"{host} does not resolve to any address")
    return addresses


def timed_resolver(seconds: float) -> Resolver:
    """system_resolver giving up after `seconds` (getaddrinfo itself has no timeout): an
    API request must not hang on a slow DNS server."""

    def resolve(host: str, port: int) -> list[str]:
        answer: list[list[str] | BaseException] = []

        def work() -> None:
            try:
                answer.append(system_resolver(host, port))
            except BaseException as exc:
                answer.append(exc)

        thread = threading.Thread(target=work, name="ssrf-resolve", daemon=True)
        thread.start()
        thread.join(seconds)
        if not answer:
            raise UnresolvableHost(f"{host} did not resolve within {seconds:g} s")
        result = answer[0]
        if isinstance(result, BaseException):
            raise result
        return result

    return resolve


CREATION_RESOLVE_SECONDS = 2.0


# -- the allow-list ---------------------------------------------------------------------------


def normalize_entry(entry: str) -> str:
    """One allow-list entry in canonical form: a CIDR ("10.1.0.0/16", a single address becomes
    /32 or /128) or a lower-case host name. ValidationError for anything else."""
    if not isinstance(entry, str) or not entry.strip():
        raise errors.ValidationError("must be a host name or a CIDR", field="allow_list")
    text = entry.strip().lower()
    if len(text) > MAX_ENTRY_LENGTH or any(c.isspace() for c in text):
        raise errors.ValidationError(f"{entry!r} is not a host name or a CIDR", field="allow_list")
    try:
        network = ipaddress.ip_network(text.replace("[", "").replace("]", ""), strict=False)
    except ValueError:
        pass
    else:
        return str(network)
    if "/" in text or ":" in text:
        raise errors.ValidationError(
            f"{entry!r} is not a valid CIDR (e.g. 10.0.0.0/8, fd00::/8) or host name",
            field="allow_list",
        )
    numeric = _inet_aton(text.rstrip("."))
    if numeric is not None:
        return f"{numeric}/32"
    return host_to_ascii(text, field="allow_list").rstrip(".")


@dataclass(frozen=True)
class AllowList:
    """A tenant's exceptions to the guard: host names (exact, case-insensitive) and networks."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in entries:
            try:
                canonical = normalize_entry(entry)
            except errors.ValidationError:
                # only a hand-edited database holds one (the CLI validates every entry);
                # an unreadable exception grants nothing, and must not fail every job
                continue
            if "/" in canonical:
                networks.append(ipaddress.ip_network(canonical))
            else:
                hosts.add(canonical)
        return cls(frozenset(hosts), tuple(networks))

    def allows_host(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.hosts

    def allows_address(self, address: IPAddress) -> bool:
        candidates = [address, *_embedded_ipv4(address)]
        return any(a in n for a in candidates for n in self.networks if a.version == n.version)


# -- classification ---------------------------------------------------------------------------
#
# The project's own table, not the standard library's is_global/is_private/is_reserved: those
# change between Python patch releases (3.11.7 lets 192.0.0.192, 168.63.129.16 and 3fff::/20
# through; later releases refuse them), and a guard must give the same answer everywhere.
# Only integer arithmetic over addresses is used below.
#
# Every block of the IANA IPv4 and IPv6 Special-Purpose Address Registries (as of 2025) is
# refused, including the "globally reachable" ones (AS112, AMT, PCP/TURN anycast): none is a
# place a tenant's webhook lives. Multicast, the deprecated site-local block, and IPv6 space
# outside global unicast (2000::/3) are refused too. Where blocks nest, the most specific one
# names the reason.

_IPV4_SPECIAL: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "unspecified ('this network')"),
    ("0.0.0.0/32", "unspecified"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "CGNAT shared"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "IETF protocol assignment"),
    ("192.0.0.0/29", "IPv4 service continuity (DS-Lite)"),
    ("192.0.0.8/32", "IPv4 dummy"),
    ("192.0.0.9/32", "PCP anycast"),
    ("192.0.0.10/32", "TURN anycast"),
    ("192.0.0.170/32", "NAT64/DNS64 discovery"),
    ("192.0.0.171/32", "NAT64/DNS64 discovery"),
    ("192.0.2.0/24", "documentation"),
    ("192.31.196.0/24", "AS112"),
    ("192.52.193.0/24", "AMT"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
    ("192.88.99.2/32", "6a44 relay anycast"),
    ("192.168.0.0/16", "private"),
    ("192.175.48.0/24", "AS112 direct delegation"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("255.255.255.255/32", "broadcast"),
)

_IPV6_SPECIAL: tuple[tuple[str, str], ...] = (
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "deprecated IPv4-compatible"),
    ("::ffff:0:0/96", "IPv4-mapped"),
    ("::ffff:0:0:0/96", "IPv4-translated (SIIT)"),
    ("64:ff9b::/96", "NAT64"),
    ("64:ff9b:1::/48", "local-use NAT64"),
    ("100::/64", "discard-only"),
    ("100:0:0:1::/64", "dummy"),
    # IETF protocol assignments; every sub-block is special too, the whole /23 is refused
    ("2001::/23", "IETF protocol assignment"),
    ("2001::/32", "Teredo"),
    ("2001:1::1/128", "PCP anycast"),
    ("2001:1::2/128", "TURN anycast"),
    ("2001:1::3/128", "DNS-SD SRP anycast"),
    ("2001:2::/48", "benchmarking"),
    ("2001:3::/32", "AMT"),
    ("2001:4:112::/48", "AS112"),
    ("2001:10::/28", "deprecated ORCHID"),
    ("2001:20::/28", "ORCHIDv2"),
    ("2001:30::/28", "drone remote ID (DET)"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "6to4"),
    ("2620:4f:8000::/48", "AS112 direct delegation"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "segment routing (SRv6) SID"),
    ("fc00::/7", "private (unique local)"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "deprecated site-local"),
    ("ff00::/8", "multicast"),
)

# Cloud instance metadata and host services, refused by name: AWS/GCP/Azure/OCI/DigitalOcean
# (169.254.169.254), AWS ECS and EKS credentials (169.254.170.2, .23), Azure WireServer
# (168.63.129.16: a public address!), Alibaba (100.100.100.200), OCI legacy (192.0.0.192),
# AWS IMDS, DNS and EKS over IPv6 (fd00:ec2::254, ::253, ::23), GCP over IPv6 (fd20:ce::254).
# Only an allow-list CIDR
# containing one of them lets it through, never an allowed host name (whose DNS the tenant
# may control).
_METADATA_ADDRESSES: tuple[str, ...] = (
    "169.254.169.254",
    "169.254.170.2",
    "169.254.170.23",
    "168.63.129.16",
    "100.100.100.200",
    "192.0.0.192",
    "fd00:ec2::254",
    "fd00:ec2::253",
    "fd00:ec2::23",
    "fd20:ce::254",
)
METADATA_REASON = "cloud metadata service"

_GLOBAL_UNICAST_6 = ("2000::/3", "")  # IANA: the only IPv6 space assigned for unicast


@dataclass(frozen=True)
class _Block:
    version: int
    first: int
    last: int
    prefix: int
    reason: str


def _block(cidr: str, reason: str) -> _Block:
    network = ipaddress.ip_network(cidr)  # parsing only: stable across versions
    first = int(network.network_address)
    size = (32 if network.version == 4 else 128) - network.prefixlen
    return _Block(network.version, first, first + (1 << size) - 1, network.prefixlen, reason)


# most specific first, so the first match names the reason
SPECIAL_BLOCKS: tuple[_Block, ...] = tuple(
    sorted(
        (_block(cidr, reason) for cidr, reason in (*_IPV4_SPECIAL, *_IPV6_SPECIAL)),
        key=lambda b: -b.prefix,
    )
)
_GLOBAL_UNICAST = _block(*_GLOBAL_UNICAST_6)
METADATA = frozenset(ipaddress.ip_address(a) for a in _METADATA_ADDRESSES)


def special_reason(address: IPAddress) -> str | None:
    """The registry block `address` falls in (most specific first), as a reason; None for
    an ordinary unicast address. Embedded IPv4 is not looked at here."""
    number = int(address)
    for block in SPECIAL_BLOCKS:
        if block.version == address.version and block.first <= number <= block.last:
            return block.reason
    if address.version == 6 and not _GLOBAL_UNICAST.first <= number <= _GLOBAL_UNICAST.last:
        return "reserved (outside global unicast 2000::/3)"
    return None


def _v4(number: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(number & 0xFFFFFFFF)


def _embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries: mapped ``::ffff:a.b.c.d``, translated
    ``::ffff:0:a.b.c.d``, compatible ``::a.b.c.d``, NAT64 ``64:ff9b::a.b.c.d``, 6to4
    ``2002:AABB:CCDD::`` and Teredo (server and de-obfuscated client). Bit arithmetic only."""
    if address.version != 6:
        return []
    number = int(address)
    high96 = number >> 32
    found: list[ipaddress.IPv4Address] = []
    if high96 in (0xFFFF, 0xFFFF0000, 0) or high96 == 0x0064FF9B << 64:
        if not (high96 == 0 and number <= 1):  # :: and ::1 are IPv6 themselves
            found.append(_v4(number))
    if number >> 112 == 0x2002:
        found.append(_v4(number >> 80))
    if number >> 96 == 0x20010000:
        found.append(_v4(number >> 64))  # the Teredo server
        found.append(_v4(~number))  # the client, stored inverted
    return found


def forbidden_reason(address: IPAddress) -> str | None:
    """Why the guard refuses this address (e.g. "loopback"), or None for a public one. The
    same answer on every Python version: only the tables above decide."""
    if address in METADATA:
        return METADATA_REASON
    for inner in _embedded_ipv4(address):
        inner_reason = METADATA_REASON if inner in METADATA else special_reason(inner)
        if inner_reason is not None:
            mapped = int(address) >> 32 == 0xFFFF
            kind = "IPv4-mapped" if mapped else "IPv4-embedding"
            return f"{kind} IPv6 form of {_a(inner_reason)}"
    return special_reason(address)


def _a(reason: str) -> str:
    """ "a loopback", "an unspecified", "an IPv4-mapped"."""
    return f"{'an' if reason[:1].lower() in 'aeiou' else 'a'} {reason}"


def is_metadata(address: IPAddress) -> bool:
    """A cloud metadata address, itself or inside an IPv6 form."""
    return address in METADATA or any(a in METADATA for a in _embedded_ipv4(address))


# -- checking a destination -------------------------------------------------------------------


@dataclass(frozen=True)
class Destination:
    """A checked destination: connect to `addresses[0]` (or the next), never re-resolve."""

    url: str
    scheme: str
    host: str  # as in the URL (lower case, no brackets); the Host header and TLS name
    port: int
    addresses: tuple[str, ...]


def literal_address(host: str) -> IPAddress | None:
    """The address a URL host denotes by itself: a plain IPv4/IPv6 literal or any numeric
    form inet_aton accepts. None for a host name."""
    text = host.strip("[]").rstrip(".")
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        pass
    numeric = _inet_aton(text)
    if numeric is not None:
        return numeric
    return None


def _inet_aton(text: str) -> ipaddress.IPv4Address | None:
    """What the C library's inet_aton makes of `text` (1-4 parts, each decimal, 0x-hex or
    0-octal; the last part fills the remaining bytes). None when `text` is not numeric."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4 or not all(_NUMERIC_PART.fullmatch(p) for p in parts):
        return None
    values: list[int] = []
    for part in parts:
        if part[:2].lower() == "0x":
            values.append(int(part[2:] or "0", 16))
        elif len(part) > 1 and part.startswith("0"):
            if any(c in "89" for c in part):
                return None
            values.append(int(part, 8))
        else:
            values.append(int(part))
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (4 - len(head)):
        return None
    number = last
    for index, value in enumerate(head):
        number |= value << (8 * (3 - index))
    return ipaddress.IPv4Address(number)


def host_to_ascii(host: str, *, field: str) -> str:
    """The ASCII form of a host name, every label checked; ValidationError naming `field`.

    Non-ASCII names follow UTS-46 (IDNA 2008, non-transitional), as browsers do: ``faß.de``
    is ``xn--fa-hia.de``, not ``fass.de`` as the standard library's IDNA 2003 codec would
    make it, so the scheduler calls the host the tenant meant. Full-width letters and dots
    are mapped first (full-width digits and dots spelling 127.0.0.1 are checked as that
    address).
    ASCII labels are letters, digits, '-' (not first or last) and '_'; an ``xn--`` label
    must be a valid A-label.
    """

    def invalid(why: str) -> errors.ValidationError:
        return errors.ValidationError(f"{host!r} is not a valid host name: {why}", field=field)

    try:
        mapped = idna.uts46_remap(host, std3_rules=False, transitional=False)
    except (idna.IDNAError, UnicodeError) as exc:
        raise invalid(str(exc)) from None
    trailing_dot = mapped.endswith(".")
    labels = (mapped[:-1] if trailing_dot else mapped).split(".")
    encoded: list[str] = []
    for label in labels:
        if not label:
            raise invalid("empty label")
        if label.isascii():
            label = label.lower()
            if len(label) > MAX_LABEL_LENGTH:
                raise invalid(f"label {label[:20]!r}... is over {MAX_LABEL_LENGTH} characters")
            if not _ASCII_LABEL.fullmatch(label):
                raise invalid(
                    f"label {label!r} may hold only letters, digits, '-' (not first or "
                    "last) and '_'"
                )
            if label.startswith("xn--"):
                try:
                    idna.ulabel(label)
                except (idna.IDNAError, UnicodeError) as exc:
                    raise invalid(f"label {label!r} is not a valid A-label ({exc})") from None
            encoded.append(label)
        else:
            try:
                encoded.append(idna.alabel(label).decode("ascii"))
            except (idna.IDNAError, UnicodeError) as exc:
                raise invalid(f"label {label!r}: {exc}") from None
    name = ".".join(encoded)
    if len(name) > MAX_ENTRY_LENGTH:
        raise invalid(f"longer than {MAX_ENTRY_LENGTH} characters")
    return name + "." if trailing_dot else name


def split_url(url: str, field: str = "target.url") -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL; ValidationError naming `field` otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise errors.ValidationError(f"is not a valid URL: {exc}", field=field) from exc
    # the URL itself is never repeated: these messages reach run histories and logs, and
    # its path, query or user part may carry a secret
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise errors.ValidationError(
            f"must use http or https, not {scheme[:20]!r}" if scheme else "must use http or https",
            field=field,
        )
    host = (parts.hostname or "").lower()
    if not host:
        raise errors.ValidationError("has no host", field=field)
    if ":" not in host:  # an IPv6 literal is checked as an address
        # the Host header, TLS name and resolver all want the ASCII (IDNA) form
        host = host_to_ascii(host, field=field)
    return scheme, host, port or (443 if scheme == "https" else 80)


def check_destination(
    url: str,
    allow_list: AllowList | Iterable[str],
    *,
    resolver: Resolver | None = None,
    field: str = "target.url",
) -> Destination:
    """Check `url` against the guard; the Destination names the addresses to connect to.
    Raises ForbiddenDestination (refused), UnresolvableHost or ValidationError (bad URL)."""
    allowed = allow_list if isinstance(allow_list, AllowList) else AllowList.parse(allow_list)
    scheme, host, port = split_url(url, field)
    literal = literal_address(host)
    if literal is not None:
        _check_address(url, host, literal, allowed, field=field, host_allowed=False)
        return Destination(url, scheme, host, port, (str(literal),))
    if _looks_numeric(host):
        # digits and dots that no C library reads as one address: refuse rather than guess
        raise errors.ForbiddenDestination(
            f"{url_origin(url)} is refused: {host!r} is neither a host name nor a valid IP address",
            field=field,
        )
    resolved = list((resolver or system_resolver)(host, port))
    if not resolved:
        raise UnresolvableHost(f"{host} does not resolve to any address")
    host_allowed = allowed.allows_host(host)
    addresses: list[str] = []
    for text in resolved:
        try:
            address = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            log.info("SSRF guard: %s:%s resolved to %r, not an IP address", host, port, text)
            raise errors.ForbiddenDestination(
                f"{url_origin(url)} is refused: the destination is not allowed: {host} did not "
                "resolve to an IP address",
                field=field,
            ) from None
        _check_address(url, host, address, allowed, field=field, host_allowed=host_allowed)
        addresses.append(str(address))
    return Destination(url, scheme, host, port, tuple(addresses))


# How long a name's resolution, and the checks made with it, are reused at delivery: short,
# so a moved endpoint is followed within seconds; long enough that a busy destination costs
# one lookup every few seconds instead of one per call.
DNS_CACHE_SECONDS = 5.0
MAX_CACHED_NAMES = 10_000


class GuardCache:
    """check_destination for delivery, with each name's resolution kept `ttl` seconds (see
    the module documentation). Thread-safe; `check_async` resolves a name that is not cached
    in the loop's executor, so a slow resolver does not stop the event loop."""

    def __init__(
        self,
        resolver: Resolver | None = None,
        *,
        ttl: float = DNS_CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolver = resolver or system_resolver
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._names: dict[tuple[str, int], tuple[float, tuple[str, ...]]] = {}
        self.lookups = 0  # resolutions made (cache misses)

    def _cached(self, host: str, port: int) -> tuple[float, tuple[str, ...]] | None:
        with self._lock:
            found = self._names.get((host, port))
        if found is None or found[0] <= self._clock():
            return None
        return found

    def _store(
        self, host: str, port: int, addresses: Sequence[str]
    ) -> tuple[float, tuple[str, ...]]:
        entry = (self._clock() + self.ttl, tuple(addresses))
        with self._lock:
            if len(self._names) >= MAX_CACHED_NAMES:
                self._names.clear()  # a bound, not an eviction policy: entries live seconds
            self._names[(host, port)] = entry
            self.lookups += 1
        return entry

    def check(
        self, url: str, allow_list: AllowList | Iterable[str], *, field: str = "target.url"
    ) -> tuple[Destination, float]:
        """The checked Destination, and until when (monotonic clock) it may be reused."""
        expires = self._clock() + self.ttl

        def resolve(host: str, port: int) -> Sequence[str]:
            nonlocal expires
            entry = self._cached(host, port) or self._store(host, port, self._resolver(host, port))
            expires = entry[0]
            return entry[1]

        return check_destination(url, allow_list, resolver=resolve, field=field), expires

    async def check_async(
        self, url: str, allow_list: AllowList | Iterable[str]
    ) -> tuple[Destination, float]:
        """check(), resolving an uncached name off the event loop."""
        _scheme, host, port = split_url(url)
        if literal_address(host) is None and not _looks_numeric(host):
            if self._cached(host, port) is None:
                loop = asyncio.get_running_loop()
                addresses = await loop.run_in_executor(None, self._resolver, host, port)
                if addresses:
                    self._store(host, port, addresses)
        return self.check(url, allow_list)


def check_at_creation(
    url: str,
    allow_list: AllowList | Iterable[str],
    *,
    resolver: Resolver | None = None,
    field: str = "target.url",
) -> None:
    """The creation-time check of a target or an alert webhook (`field` names it): like
    check_destination, but a name that does not resolve now is accepted (DNS may not exist
    yet; every delivery checks again)."""
    try:
        check_destination(
            url,
            allow_list,
            resolver=resolver or timed_resolver(CREATION_RESOLVE_SECONDS),
            field=field,
        )
    except UnresolvableHost:
        return


def _looks_numeric(host: str) -> bool:
    return bool(host) and all(c.isdigit() or c in ".xX" for c in host.rstrip("."))


def _check_address(
    url: str,
    host: str,
    address: IPAddress,
    allowed: AllowList,
    *,
    field: str,
    host_allowed: bool,
) -> None:
    """Refuse `address` unless it is public or allowed. An allowed host name covers every
    special address but cloud metadata (its DNS may be the tenant's); an allowed CIDR covers
    what it contains.

    The message goes to the tenant (API answer, run history): it names the kind of address
    but never the address a name resolved to -- that would turn the guard into a probe of
    the scheduler's internal DNS. The address goes to the log."""
    reason = forbidden_reason(address)
    if reason is None or allowed.allows_address(address):
        return
    if host_allowed and not is_metadata(address):
        return
    literal = literal_address(host) is not None
    kind = f"{_a(reason)} address"
    log.info(
        "SSRF guard refused %s: %s%s is %s",
        url_origin(url),
        host,
        "" if literal else f" resolved to {address}, which",
        kind,
    )
    what = f"{host} is" if literal else f"{host} resolves to"
    if is_metadata(address):
        hint = (
            "cloud metadata is opened only by an operator's CIDR entry "
            "(`schedctl tenant allow TENANT CIDR`), never by an allowed host name"
        )
    else:
        hint = f"an operator may allow it with `schedctl tenant allow TENANT {host}` (or a CIDR)"
    raise errors.ForbiddenDestination(
        f"{url_origin(url)} is refused: the destination is not allowed: {what} {kind}; {hint}",
        field=field,
    )


def url_origin(url: str) -> str:
    """scheme://host:port of `url`: what a log line may show of it (the path and query may
    carry a tenant's secrets)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "<invalid URL>"
    host = parts.hostname or ""
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}" + (f":{port}" if port else "")


_IPV4_TEXT = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?!\w|\.\w)")
_IPV6_TEXT = re.compile(r"(?<![\w:.])[0-9A-Fa-f]*:[0-9A-Fa-f]*:[0-9A-Fa-f:.]*(?:%[\w.-]+)?")
HIDDEN_ADDRESS = "<address>"


def hide_addresses(text: str) -> str:
    """`text` with every IPv4 and IPv6 address replaced by HIDDEN_ADDRESS: a network error
    on the way to a pinned address names that address ("HTTPConnection(host='10.1.2.3',
    ..."), and a tenant must not learn from the run history what its host resolved to."""

    def replace(match: re.Match[str]) -> str:
        candidate = match.group(0)
        address = candidate.rstrip(".")  # the end of a sentence
        try:
            ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return candidate
        return HIDDEN_ADDRESS + candidate[len(address) :]

    # IPv6 first: "::ffff:10.1.2.3" goes as a whole
    return _IPV4_TEXT.sub(replace, _IPV6_TEXT.sub(replace, text))


# -- connecting to the checked address -------------------------------------------------------


def tls_name(host_header: str) -> str:
    """The host part of a Host header value ("[::1]:8443" -> "::1", "a.b:443" -> "a.b")."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def pinned_url(destination: Destination, address: str) -> tuple[str, str]:
    """(url to send to, Host header) for connecting `destination` at `address`."""
    parts = urlsplit(destination.url)
    ip = ipaddress.ip_address(address)
    where = f"[{ip}]" if ip.version == 6 else str(ip)
    default = 443 if destination.scheme == "https" else 80
    netloc = f"{where}:{destination.port}"
    shown_host = f"[{destination.host}]" if ":" in destination.host else destination.host
    host_header = shown_host if destination.port == default else f"{shown_host}:{destination.port}"
    path = parts.path or "/"
    url = f"{destination.scheme}://{netloc}{path}"
    if parts.query:
        url += f"?{parts.query}"
    return url, host_header
