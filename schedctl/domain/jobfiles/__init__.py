"""Job files (`/etc/scheduled/jobs.d/*.toml`): the format, its validation and its writing.

load_dir(DIR) -> [JobFile]      every file validated together (JobFilesError lists all)
load_file(PATH) / parse_text(TEXT, PATH) -> JobFile
FileJob.job_body(queue)         the REST / `job create` body: schedule, limits and the
                                reference (file, name) as payload -- never the command
render(jobs) -> TOML text       what import-crontab writes (loads back through load_*)
placement                       central name and queue of a job per host (NAME@HOST, host:H,
                                group:G), and the queues a host's worker serves
"""

from __future__ import annotations

from schedctl.domain.jobfiles.load import (
    DEFAULT_DIR,
    JOB_KEYS,
    load_dir,
    load_file,
    parse_text,
    resolve,
)
from schedctl.domain.jobfiles.model import (
    Alerts,
    FileJob,
    JobFile,
    JobFilesError,
    JobRef,
    Problem,
    RunOn,
    RunOnKind,
)
from schedctl.domain.jobfiles.render import render

__all__ = [
    "DEFAULT_DIR",
    "JOB_KEYS",
    "Alerts",
    "FileJob",
    "JobFile",
    "JobFilesError",
    "JobRef",
    "Problem",
    "RunOn",
    "RunOnKind",
    "load_dir",
    "load_file",
    "parse_text",
    "render",
    "resolve",
]
