"""Owns the tests' loopback SMTP server: an aiosmtpd server on a free 127.0.0.1 port whose
Inbox keeps every message it receives (the `smtp` fixture in tests/conftest.py yields it)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from email import message_from_bytes
from typing import Any


class Inbox:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        self.messages.append(message_from_bytes(envelope.content))
        return "250 OK"


@contextlib.contextmanager
def smtp_server() -> Iterator[tuple[Inbox, int]]:
    """The server's inbox and port, the server stopped on exit."""
    from aiosmtpd.controller import Controller  # only the tests that send mail load it

    inbox = Inbox()
    with socket.socket() as probe:  # a free loopback port (aiosmtpd cannot take port 0)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield inbox, port
    finally:
        controller.stop()
