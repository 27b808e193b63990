"""Owns the `schedctl.plugins` entry point of schedctl-bench: `register(root)` adds the
`schedctl bench` group, with its commands in the order its help lists them, to schedctl's
root app (schedctl.cli.app discovers it). The benchmarks themselves are imported when a
command runs: `schedctl --help` must not load sqlalchemy."""

from __future__ import annotations

import typer

from schedctl_bench.cli import (
    bench,
    bench_console,
    bench_create,
    bench_dispatch,
    bench_peers,
    bench_relay,
    bench_scale,
)

for _name, _command in (
    ("delivery", bench_dispatch.delivery),
    ("burst", bench_dispatch.burst),
    ("steady", bench_dispatch.steady),
    ("failover", bench_dispatch.failover),
    ("relay", bench_relay.relay),
    ("spawn", bench_dispatch.spawn),
    ("worker", bench_dispatch.worker),
    ("create", bench_create.create),
    ("scale", bench_scale.scale),
    ("peers", bench_peers.peers),
    ("console", bench_console.console),
):
    bench.app.command(_name)(_command)


def register(root: typer.Typer) -> None:
    """Add the `bench` group to `root` (schedctl's root app)."""
    root.add_typer(bench.app, name="bench")
