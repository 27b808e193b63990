"""Owns the aiohttp prototype of HttpDelivery's exchange (measurement only, issue 31 step 3):
the same request to the SSRF-checked address, Host header and TLS name (SNI and certificate)
of the URL's host, on aiohttp's pooled connections."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import aiohttp
import certifi
from yarl import URL

MAX_RESPONSE_BYTES = 64 * 1024
RESPONSE_SNIPPET_BYTES = 512


class AioExchange:
    def __init__(self, *, ca_bundle: str | None, connect_timeout: float, pool_size: int) -> None:
        self.ca_bundle = ca_bundle
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        self._tls: ssl.SSLContext | None = None

    def _get(self) -> aiohttp.ClientSession:
        if self._session is None:
            context = ssl.create_default_context(cafile=self.ca_bundle or certifi.where())
            self._tls = context  # check_hostname on: against server_hostname
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, ssl=context, keepalive_timeout=30, use_dns_cache=False
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def exchange(
        self,
        *,
        scheme: str,
        address: str,
        port: int,
        target: str,
        tls_name: str | None,
        headers: dict[str, str],
        body: bytes,
        deadline: float,
    ) -> tuple[int, str, dict[str, str], str, bool, str | None]:
        """(status, reason, headers, snippet, cut, broken); TimeoutError / OSError /
        aiohttp.ClientError before the head arrived."""
        session = self._get()
        host = f"[{address}]" if ":" in address else address
        url = URL(f"{scheme}://{host}:{port}{target}", encoded=True)
        options: dict[str, Any] = {}
        if tls_name is not None:
            options["server_hostname"] = tls_name
        async with asyncio.timeout_at(deadline):
            response = await session.post(
                url, data=body, headers=headers, allow_redirects=False, **options
            )
        try:
            answer = {k.lower(): v for k, v in response.headers.items()}
            data = b""
            cut, broken = False, None
            try:
                async with asyncio.timeout_at(deadline):
                    length = response.content_length
                    if length is not None and length > MAX_RESPONSE_BYTES:
                        data = await response.content.read(RESPONSE_SNIPPET_BYTES)
                        response.close()
                    else:
                        data = await response.content.read(MAX_RESPONSE_BYTES + 1)
                        if len(data) > MAX_RESPONSE_BYTES:
                            response.close()
            except TimeoutError:
                cut = True
                response.close()
            except (aiohttp.ClientError, OSError) as exc:
                broken = str(exc) or type(exc).__name__
                response.close()
            text = data[:RESPONSE_SNIPPET_BYTES].decode("utf-8", errors="replace")
            snippet = " ".join("".join(c if c.isprintable() else " " for c in text).split())
            return response.status, response.reason or "", answer, snippet, cut, broken
        finally:
            response.release()
