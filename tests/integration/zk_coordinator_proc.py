"""A dispatcher stand-in that tests run as a subprocess, so they can kill -9 or SIGSTOP it.

It holds partitions with a real ZooKeeperCoordinator and answers one JSON line on stdout
per command line read from stdin:

    owned          -> {"event": "owned", "owned": {partition: epoch}, "stable": bool}
    load           -> remember owned() and the due jobs of those partitions, as a
                      dispatcher does before it sleeps until their time:
                      {"event": "loaded", "owned": {...}, "due": [[job_id, partition], ...]}
    claim          -> claim what `load` remembered, with the epochs remembered then (what a
                      paused dispatcher does when it wakes up):
                      {"event": "claimed", "dispatched": [...], "fenced": [...], ...}
    stop           -> stop the coordinator and exit: {"event": "stopped"}

At start it prints {"event": "started", "pid": ..., "owned": {...}} once stable.
Usage: python zk_coordinator_proc.py --hosts H --db URL --name N --partitions P
       [--session-timeout S]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from schedctl.coordination.zookeeper import ZooKeeperCoordinator
from schedctl.storage.db.store import Store
from schedctl.storage.pipeline.claim import Claimer, DueJob


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--partitions", type=int, required=True)
    parser.add_argument("--session-timeout", type=float, default=4.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {args.name} %(name)s %(levelname)s %(message)s",
    )
    store = Store.open(args.db)
    coordinator = ZooKeeperCoordinator(
        store,
        args.hosts,
        node_name=args.name,
        partition_count=args.partitions,
        session_timeout=args.session_timeout,
    )
    coordinator.start(timeout=30)
    coordinator.wait_until_stable(30)
    emit("started", pid=os.getpid(), owned=dict(coordinator.owned()))
    claimer = Claimer(store, args.name)
    remembered: dict[int, int] = {}
    due: list[DueJob] = []
    for line in sys.stdin:
        command = line.strip()
        if command == "owned":
            stable = coordinator.wait_until_stable(30)
            emit("owned", owned=dict(coordinator.owned()), stable=stable)
        elif command == "load":
            remembered = dict(coordinator.owned())
            due = claimer.load_due(remembered.keys(), store.now())
            emit("loaded", owned=remembered, due=[[d.job_id, d.partition] for d in due])
        elif command == "claim":
            result = claimer.claim(due, remembered, store.now())
            emit(
                "claimed",
                dispatched=[job_id for job_id, _ in result.dispatched],
                fenced=sorted(result.fenced),
                stale=result.stale,
                aborted=result.aborted,
            )
        elif command == "stop":
            break
        else:
            emit("error", message=f"unknown command {command!r}")
    coordinator.stop()
    store.close()
    emit("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
