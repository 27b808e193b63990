"""The relay's HTTP client on its event loop, against loopback servers: a name is resolved
once for many calls (the guard's cache) while every call still goes to the checked address
and a name resolving to a private address is refused without a connection, call after
call; many concurrent calls to a trickling endpoint each end at their own deadline while a
quick endpoint on the same loop keeps answering."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from schedctl.delivery.http import DeliveryResult, HttpDelivery
from schedctl.delivery.http_client import Deadlines
from schedctl.domain.models import Verdict
from tests.integration.queue_support import hook_server
from tests.integration.test_http_transport import trickler

CALL: dict[str, Any] = {
    "secret": "secret",
    "job_id": "j1",
    "scheduled_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    "attempt": 1,
    "payload": {"x": 1},
}


def test_a_cached_name_still_goes_to_the_checked_address_and_private_ones_are_refused() -> None:
    lookups: list[str] = []

    def resolve(host: str, _port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"]

    with hook_server() as server:
        delivery = HttpDelivery(timeout=5, resolver=resolve)
        try:
            url = f"http://hooks.test:{server.port}/hook"
            results = [
                delivery.deliver(url=url, allow_list=["hooks.test"], **CALL) for _ in range(5)
            ]
            assert all(r.verdict is Verdict.succeeded for r in results), results
            assert lookups == ["hooks.test"]  # one resolution for the five calls
            assert {r.headers["Host"] for r in server.requests()} == {f"hooks.test:{server.port}"}
            # the same name (cached, loopback) without the allow-list entry: refused, no call
            for _ in range(3):
                refused = delivery.deliver(url=url, allow_list=[], **CALL)
                assert refused.verdict is Verdict.failed, refused
                assert "SSRF" in (refused.error or "") and "127.0.0.1" not in (refused.error or "")
            assert server.count() == 5
        finally:
            delivery.close()


def test_concurrent_calls_each_end_at_their_deadline_while_quick_ones_go_on() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Padding: " + b"." * 40 + b"\r\n\r\nok"
    with trickler(b"", answer) as slow, hook_server() as quick:
        delivery = HttpDelivery(timeout=1.0)

        async def both() -> tuple[list[DeliveryResult], list[DeliveryResult]]:
            slow_calls = [
                delivery.deliver_async(url=slow.url, allow_list=["127.0.0.1"], **CALL)
                for _ in range(8)
            ]

            async def quick_calls() -> list[DeliveryResult]:
                return [
                    await delivery.deliver_async(url=quick.url(), allow_list=["127.0.0.1"], **CALL)
                    for _ in range(10)
                ]

            done = await asyncio.gather(asyncio.gather(*slow_calls), quick_calls())
            return list(done[0]), done[1]

        try:
            slow_results, quick_results = asyncio.run_coroutine_threadsafe(
                both(), delivery.loop
            ).result(120)
        finally:
            delivery.close()
    for result in slow_results:
        assert result.verdict is Verdict.retry, result
        assert (result.error or "").startswith("timed out"), result.error
        assert result.seconds < len(answer) * 0.5 / 2  # liveness only
    assert all(r.verdict is Verdict.succeeded for r in quick_results), quick_results
    assert quick.count() == 10


def test_calls_share_one_deadline_timer_and_each_still_expires_at_its_own() -> None:
    """Quick calls one after another arm no loop timer each (one timer, at the nearest
    deadline, serves every call under way); a deadline armed after a later one moves that
    timer up, so its call expires at its own deadline, not the later one's."""
    with hook_server() as quick:
        delivery = HttpDelivery(timeout=30.0)
        loop = delivery.loop
        timers: list[float] = []
        call_at = loop.call_at

        def counted(when: float, *args: Any, **kwargs: Any) -> Any:
            timers.append(when)
            return call_at(when, *args, **kwargs)

        loop.call_at = counted  # type: ignore[method-assign,assignment]
        try:
            # the first call resolves, connects and arms the deadline timer
            results = [delivery.deliver(url=quick.url(), allow_list=["127.0.0.1"], **CALL)]
            first = len(timers)
            results += [
                delivery.deliver(url=quick.url(), allow_list=["127.0.0.1"], **CALL)
                for _ in range(19)
            ]
        finally:
            del loop.call_at
            delivery.close()
    assert all(r.verdict is Verdict.succeeded for r in results), results
    # a timer per call was 19 more of them
    assert timers[first:] == [], timers

    class Call:
        expired = False

        def expire(self) -> None:
            self.expired = True

    async def earlier_after_later() -> tuple[bool, bool]:
        deadlines = Deadlines()
        now = asyncio.get_running_loop().time()
        late, early = Call(), Call()
        deadlines.arm(late, now + 120)  # type: ignore[arg-type]
        deadlines.arm(early, now + 0.05)  # type: ignore[arg-type]
        for _ in range(6000):  # bounded: 60 s
            if early.expired:
                break
            await asyncio.sleep(0.01)
        result = (early.expired, late.expired)
        deadlines.disarm(late)  # type: ignore[arg-type]
        return result

    assert asyncio.run(earlier_after_later()) == (True, False)
