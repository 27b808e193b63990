"""Job file text for the tests that need jobs from a file but not the file's own syntax:
/bin/true jobs, each named, scheduled and placed (run_on) as a test gives them."""

from __future__ import annotations


def true_jobs(*jobs: tuple[str, str, str | None]) -> str:
    """A job file of /bin/true jobs, each (name, schedule, run_on): `schedule` is the
    schedule's key and value as TOML (`every = "1h"`), `run_on` None for the default (this
    host)."""
    blocks = []
    for name, schedule, run_on in jobs:
        lines = ["[[job]]", f'name = "{name}"', schedule, 'command = ["/bin/true"]']
        if run_on is not None:
            lines.append(f'run_on = "{run_on}"')
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)
