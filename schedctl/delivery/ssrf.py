"""Owns the SSRF guard: which HTTP destinations a tenant may make the scheduler call.

The rule: a destination whose address is loopback, private, link-local (169.254.0.0/16,
where cloud metadata lives), CGNAT shared space (100.64.0.0/10), multicast, unspecified,
broadcast, reserved or otherwise not globally routable -- in IPv4 or IPv6, including IPv4
hidden inside IPv6 (mapped ``::ffff:a.b.c.d``, compatible ``::a.b.c.d``, 6to4, Teredo,
NAT64) -- is refused unless the tenant's allow-list names its host or holds a CIDR that
contains the address. Public destinations need no entry.

How it is checked, at job creation and again at every delivery:

1. the host is taken from the URL; numeric forms the C library would accept
   (``2130706433``, ``0x7f.1``, ``017700000001``, ``127.1``) are read as the address they
   denote, so they are checked as that address;
2. a host name is resolved and *every* address is checked: one bad address refuses the
   destination (a name with a public and a private address is not a loophole);
3. delivery connects to one of the checked addresses itself (`PinnedAdapter`), sending the
   original host in the Host header and as TLS SNI and certificate name -- so a DNS answer
   that changes between the check and the connection (rebinding) is never used;
4. no redirect is followed: a 3xx is the endpoint's answer, not a new destination.

At creation a name that does not resolve is accepted (the check at delivery decides);
literal addresses and names that resolve are checked at once.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from requests import PreparedRequest
from requests.adapters import HTTPAdapter

from schedctl import errors

if TYPE_CHECKING:
    from requests.adapters import _HostParams, _PoolKwargs

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the addresses the host resolves to, as text
Resolver = Callable[[str, int], Sequence[str]]

MAX_ENTRY_LENGTH = 253
MAX_ALLOW_LIST = 200
_HOST_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.?)+")
# one label of an inet_aton-style number: decimal, 0x-hex or 0-octal
_NUMERIC_PART = re.compile(r"0[xX][0-9a-fA-F]*|[0-9]+")

_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_LINK_LOCAL_4 = ipaddress.IPv4Network("169.254.0.0/16")
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_UNIQUE_LOCAL = ipaddress.IPv6Network("fc00::/7")
_RFC1918 = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)


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
    if not _HOST_NAME.fullmatch(text):
        raise errors.ValidationError(
            f"{entry!r} is not a host name (letters, digits, '-', '.') or a CIDR",
            field="allow_list",
        )
    return text.rstrip(".")


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


def _embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (mapped, compatible, 6to4, Teredo, NAT64)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    if address in _NAT64 or address in _IPV4_COMPATIBLE:
        # the low 32 bits are the IPv4 address (::/96 also holds ::1 and ::, which are
        # classified as IPv6 loopback and unspecified before this matters)
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def forbidden_reason(address: IPAddress) -> str | None:
    """Why the guard refuses this address (e.g. "loopback"), or None for a public one."""
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if isinstance(address, ipaddress.IPv4Address):
        return _ipv4_reason(address)
    for inner in _embedded_ipv4(address):
        reason = _ipv4_reason(inner)
        if reason is not None:
            kind = "IPv4-mapped" if address.ipv4_mapped is not None else "IPv4-embedding"
            return f"{kind} IPv6 form of a {reason} address ({inner})"
    if address.is_multicast:
        return "multicast"
    if address.is_link_local:
        return "link-local"
    if address.is_site_local:
        return "site-local"
    if address in _NAT64_LOCAL:
        return "local-use NAT64"
    if address in _UNIQUE_LOCAL:
        return "private (unique local)"
    if address.is_reserved:
        return "reserved"
    if not address.is_global:
        return "non-global (special-purpose)"
    return None


def _ipv4_reason(address: ipaddress.IPv4Address) -> str | None:
    if address.is_unspecified or address in _THIS_NETWORK:
        return "unspecified ('this network')"
    if address.is_loopback:
        return "loopback"
    if address in _LINK_LOCAL_4:
        return "link-local (cloud metadata)"
    if address in _CGNAT:
        return "CGNAT shared"
    if address.is_multicast:
        return "multicast"
    if address == _BROADCAST:
        return "broadcast"
    if any(address in network for network in _RFC1918):
        return "private"
    if address.is_reserved:
        return "reserved"
    if not address.is_global:
        return "non-global (special-purpose)"
    return None


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


def split_url(url: str, field: str = "target.url") -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL; ValidationError naming `field` otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise errors.ValidationError(f"{url!r} is not a valid URL: {exc}", field=field) from exc
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise errors.ValidationError(f"{url!r} must use http or https", field=field)
    host = (parts.hostname or "").lower()
    if not host:
        raise errors.ValidationError(f"{url!r} has no host", field=field)
    if not host.isascii():
        # the Host header, TLS name and resolver all want the ASCII (IDNA) form
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise errors.ValidationError(
                f"{url!r}: {host!r} is not a valid host name", field=field
            ) from exc
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
            f"{url!r}: {host!r} is neither a host name nor a valid IP address", field=field
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
            raise errors.ForbiddenDestination(
                f"{url!r}: {host} resolved to {text!r}, which is not an IP address", field=field
            ) from None
        _check_address(url, host, address, allowed, field=field, host_allowed=host_allowed)
        addresses.append(str(address))
    return Destination(url, scheme, host, port, tuple(addresses))


def check_at_creation(
    url: str, allow_list: AllowList | Iterable[str], *, resolver: Resolver | None = None
) -> None:
    """The creation-time check: like check_destination, but a name that does not resolve
    now is accepted (DNS may not exist yet; every delivery checks again)."""
    try:
        check_destination(
            url,
            allow_list,
            resolver=resolver or timed_resolver(CREATION_RESOLVE_SECONDS),
            field="target.url",
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
    reason = forbidden_reason(address)
    if reason is None or host_allowed or allowed.allows_address(address):
        return
    shown = host if str(address) == host else f"{host} (resolves to {address})"
    raise errors.ForbiddenDestination(
        f"{url!r} is refused: {shown} is a {reason} address; an operator may allow it "
        f"with `schedctl tenant allow TENANT {host}` (or a CIDR)",
        field=field,
    )


# -- connecting to the checked address -------------------------------------------------------


class PinnedAdapter(HTTPAdapter):
    """A requests adapter for requests whose URL already names the checked IP address: the
    TLS handshake sends the original host name (from the Host header) as SNI and checks the
    certificate against it, so pinning the address changes nothing but where we connect."""

    def build_connection_pool_key_attributes(
        self, request: PreparedRequest, verify: Any, cert: Any = None
    ) -> tuple[_HostParams, _PoolKwargs]:
        host_params, pool_kwargs = super().build_connection_pool_key_attributes(
            request, verify, cert
        )
        if host_params.get("scheme") == "https":
            name = tls_name(request.headers.get("Host", ""))
            if name:
                # part of the pool key, so each (address, name) pair has its own pool
                extra = cast(dict[str, Any], pool_kwargs)
                extra["server_hostname"] = name
                extra["assert_hostname"] = name
        return host_params, pool_kwargs


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
