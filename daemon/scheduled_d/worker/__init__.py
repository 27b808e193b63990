"""The queue worker (the cron replacement), a package of its components: `Worker` (loop.py)
and `run_api_worker` (api.py) are what the rest of the daemon uses."""

from scheduled_d.direct_backend import DirectBackend
from scheduled_d.worker.admission import RECORD_BACKLOG_DIVISOR
from scheduled_d.worker.api import run_api_worker
from scheduled_d.worker.launch import INHERITED_VARIABLES
from scheduled_d.worker.loop import Worker
from scheduled_d.worker.runs import RunSpec, TailBuffer

__all__ = [
    "INHERITED_VARIABLES",
    "RECORD_BACKLOG_DIVISOR",
    "DirectBackend",
    "RunSpec",
    "TailBuffer",
    "Worker",
    "run_api_worker",
]
