"""The queue worker (the cron replacement), a package of its components: `Worker` and
`run_api_worker` are what the rest of the daemon uses."""

from scheduled_d.worker.loop import (
    INHERITED_VARIABLES,
    RECORD_BACKLOG_DIVISOR,
    DirectBackend,
    RunSpec,
    TailBuffer,
    Worker,
    _Batcher,
    run_api_worker,
)

__all__ = [
    "INHERITED_VARIABLES",
    "RECORD_BACKLOG_DIVISOR",
    "DirectBackend",
    "RunSpec",
    "TailBuffer",
    "Worker",
    "_Batcher",
    "run_api_worker",
]
