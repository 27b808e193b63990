"""Owns `ApiServer`: uvicorn serving scheduled_d.api.create_app from a thread, bound to its
socket before it starts (a taken port is a ConfigError at once), stopped with a drain."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

import uvicorn

from schedctl.app.service import Scheduler
from schedctl.core import errors
from schedctl.storage.jobs.payloads import payload_cipher
from scheduled_d.api import create_app

log = logging.getLogger("scheduled_d.api")

START_TIMEOUT_SECONDS = 10.0


def parse_listen(listen: str) -> tuple[str, int]:
    """ "127.0.0.1:8080", "[::1]:8080" or ":8080" (all interfaces) -> (host, port)."""
    host, sep, port_text = listen.strip().rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise errors.ConfigError(
            f"{listen!r} is not HOST:PORT (e.g. 127.0.0.1:8080)", field="api_listen"
        )
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class ApiServer:
    """uvicorn serving create_app(...) from a thread: start() binds (raising ConfigError at
    once if it cannot) and returns when the server accepts connections; stop() drains."""

    def __init__(
        self,
        scheduler: Scheduler,
        listen: str,
        *,
        access_log: bool = True,
        max_request_bytes: int | None = None,
    ) -> None:
        self.host, self._requested_port = parse_listen(listen)
        self.app = create_app(scheduler, max_request_bytes=max_request_bytes)
        self._config = uvicorn.Config(
            self.app,
            log_config=None,  # the process's logging setup, not uvicorn's own
            access_log=access_log,
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=5,
            # keep an idle keep-alive connection 75 s (nginx's default), not uvicorn's 5 s:
            # longer than the idle timeouts of the load balancers and proxies in front
            # (60 s for AWS's and nginx's upstream keep-alive), so the server is never
            # the side that closes a connection the peer is about to send on (a request
            # written into a connection closing under it fails with a broken pipe)
            timeout_keep_alive=75,
            # C parsers, not h11's pure Python (a dependency, so never the fallback); the loop
            # is uvloop where it installs (not on Windows), else asyncio's
            http="httptools",
            loop="auto",
        )
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.port = self._requested_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        # fail now, not on the first job read, when the payload keys are misconfigured
        payload_cipher()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so,
        # and without it Nagle and delayed ACKs add 40 ms to every response
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
        except OSError as exc:
            sock.close()
            raise errors.ConfigError(
                f"cannot listen on {self.host}:{self._requested_port}: {exc.strerror}",
                field="api_listen",
            ) from exc
        self._socket = sock
        self.port = sock.getsockname()[1]
        if not _is_loopback(self.host):
            log.warning(
                "the API listens on %s, beyond this machine, without TLS: put a "
                "TLS-terminating proxy in front of it",
                self.url,
            )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="api", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise errors.ConfigError(f"the API server did not start on {self.url}")
        log.info("API listening on %s", self.url)

    def is_serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._server.started

    def stop(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the API server did not stop within %.0f s", timeout)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
