"""Owns the option declarations every `schedctl bench` command shares: a bounded count, a
bounded number of seconds (each naming its field and range in its help), and the process
counts and timeouts of the whole-path benchmarks and the HTTP lane width of the delivery
benchmarks, declared once."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from schedctl.cli.common import int_parser, number_parser
from schedctl.core import errors


def _field(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def count(flag: str, low: int, high: int, help: str, *short: str) -> Any:
    """An integer option `flag` (and `short` names) within [low, high]; bad input is an
    error naming it."""
    return typer.Option(
        flag, *short, parser=int_parser(_field(flag), low, high), help=f"{help} ({low}-{high})."
    )


def seconds(flag: str, low: float, high: float, help: str) -> Any:
    """A seconds option `flag` within [low, high]."""
    return typer.Option(
        flag, parser=number_parser(_field(flag), low, high), help=f"{help} ({low:g}-{high:g} s)."
    )


def keep_option(what: str) -> Any:
    """--keep: leave `what` in the database after the benchmark instead of deleting it."""
    return typer.Option("--keep", help=f"Keep the benchmark {what} afterwards.")


KeepJobsOption = Annotated[bool, keep_option("tenant and its jobs")]
TimeoutOption = Annotated[float, seconds("--timeout", 1.0, 86_400.0, "Give up after this")]
DispatchersOption = Annotated[
    int, count("--dispatchers", 1, 16, "Dispatcher processes; more than one needs --zookeeper")
]
ZooKeeperOption = Annotated[
    str | None, typer.Option("--zookeeper", help="ZooKeeper hosts for several dispatchers.")
]
BatchOption = Annotated[int, count("--batch-size", 1, 100_000, "Runs per claim")]
RelaysOption = Annotated[int, count("--relays", 1, 16, "`scheduled-d relay` processes")]
WorkersOption = Annotated[
    int,
    count(
        "--workers",
        0,
        64,
        "`scheduled-d worker` processes running /bin/true on the queue (--target queue); "
        "0: runs stop in the queue",
    ),
]
LaneWidthOption = Annotated[int, count("--concurrency", 1, 256, "The tenant's HTTP lane width")]
ConcurrencyOption = Annotated[
    int, count("--worker-concurrency", 1, 256, "Commands at once per worker")
]
SpawnOption = Annotated[
    float,
    typer.Option(
        "--spawn-seconds",
        parser=number_parser("spawn_seconds", 0.0, 600.0),
        help="First measure how fast Python starts /bin/true from 16 threads for this long "
        "(the spawn ceiling) and report the workers' starts/s against it; 0: not (0-600 s).",
    ),
]


EmbeddedOption = Annotated[
    bool,
    typer.Option(
        "--embedded",
        help="One `scheduled-d all` (the embedded default) with a \\[\\[worker]] table running "
        "/bin/true (when --workers is not 0) instead of separate dispatcher, relay and "
        "worker processes; --dispatchers and --relays then count nothing.",
    ),
]

TARGETS = ("queue", "http")


def target_parser(value: Any) -> str:
    """--target: where runs go, the built-in queue or a loopback HTTP receiver."""
    text = str(value)
    if text not in TARGETS:
        raise errors.ValidationError(
            f"must be one of {', '.join(TARGETS)}, not {text!r}", field="target"
        )
    return text


TargetOption = Annotated[
    str,
    typer.Option(
        "--target",
        parser=target_parser,
        help="queue: the built-in queue (workers start and finish the runs); http: signed "
        "POSTs to a loopback receiver that counts each run key.",
    ),
]
