"""Owns `schedctl status`: the cluster at a glance (members, partitions per member and their
epochs, lag, outbox, queue and dead-letter depths) as rich tables or --output json."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.table import Table
from rich.text import Text

from schedctl.cli.common import OutputOption, cli_state, output_format, say
from schedctl.cli.output import OutputFormat, console, emit_json, format_time

if TYPE_CHECKING:
    from schedctl.app.cluster_status import ClusterStatus, MemberStatus


def status(ctx: typer.Context, output: OutputOption = None) -> None:
    """Cluster status: members, partitions and epochs, lag, outbox and queue depths.

    Lag is the age of the oldest due and unclaimed run; depths cover the outbox, the
    built-in queues (per tenant: a queue is a tenant's) and the dead letters.

    Each queue shows how long its oldest ready run has waited and its live workers (seen
    leasing or heartbeating within max(15 s, their lease time)); a queue with ready runs and
    no live worker is flagged ("none!", a warning line, "unserved": true in JSON).

    Members come from ZooKeeper when it is configured ($SCHEDULED_ZOOKEEPER or the config
    file), else from the partitions table. A ZooKeeper that does not answer within a few
    seconds is reported, not fatal."""
    from schedctl.app.cluster_status import gather_status

    state = cli_state(ctx)
    snapshot = gather_status(state.store(), state.config())
    if output_format(ctx, output) is OutputFormat.json:
        emit_json(snapshot.to_dict())
        return
    _render(snapshot)


def _render(snapshot: ClusterStatus) -> None:
    if snapshot.coordinator == "zookeeper":
        where = f"zookeeper {snapshot.zookeeper} (root {snapshot.zookeeper_root})"
    else:
        where = "local coordinator (embedded)"
    say(f"cluster: {where}, {snapshot.partition_count} partitions, at {format_time(snapshot.at)}")
    console.print(_members_table(snapshot))
    console.print(_summary_table(snapshot))
    if snapshot.queues:
        queues = Table(title="queues")
        columns = ("tenant", "queue", "ready", "delayed", "leased", "total", "oldest ready")
        for column in (*columns, "workers"):
            queues.add_column(column, justify="left" if column in ("tenant", "queue") else "right")
        for q in snapshot.queues:
            live = len(snapshot.live_workers(q))
            queues.add_row(
                Text(q.tenant),
                Text(q.queue),
                str(q.depth.ready),
                str(q.depth.delayed),
                str(q.depth.leased),
                str(q.depth.total),
                f"{q.oldest_ready_seconds:.0f} s" if q.depth.ready else "",
                # a queue with ready runs and nobody to run them is the one to look at
                Text("none!", style="bold red") if snapshot.unserved(q) else str(live),
            )
        console.print(queues)
    for note in snapshot.notes:
        say(f"{'warning' if 'no live worker' in note else 'note'}: {note}")


def _live(member: MemberStatus) -> Text:
    if member.live is None:
        return Text("?", style="dim")
    return Text("yes", style="green") if member.live else Text("no", style="red")


def _epochs(member: MemberStatus) -> str:
    if member.epoch_min is None or member.epoch_max is None:
        return ""
    if member.epoch_min == member.epoch_max:
        return str(member.epoch_min)
    return f"{member.epoch_min}..{member.epoch_max}"


def _members_table(snapshot: ClusterStatus) -> Table:
    table = Table(title="members")
    for column in ("member", "live", "host", "pid", "partitions", "epochs"):
        table.add_column(column, justify="right" if column == "partitions" else "left")
    for member in snapshot.members:
        table.add_row(
            Text(member.name),
            _live(member),
            Text(member.host or ""),
            "" if member.pid is None else str(member.pid),
            str(len(member.partitions)),
            _epochs(member),
        )
    if not snapshot.members:
        table.add_row(Text("(none)", style="dim"), "", "", "", "0", "")
    return table


def _summary_table(snapshot: ClusterStatus) -> Table:
    table = Table(show_header=False, title="work")
    table.add_column("field", style="bold")
    table.add_column("value")
    owned = snapshot.partition_count - len(snapshot.unowned)
    partitions = f"{owned}/{snapshot.partition_count} owned"
    if snapshot.moving:
        partitions += f", {snapshot.moving} moving to their assigned member"
    lag = snapshot.lag
    if lag.oldest_due_at is None:
        lag_text = "0 s (nothing due)"
    else:
        lag_text = (
            f"{lag.seconds:.3f} s (oldest due {format_time(lag.oldest_due_at)}, "
            f"{lag.due} due and unclaimed)"
        )
    outbox = snapshot.outbox
    outbox_text = f"{outbox.depth} row{'' if outbox.depth == 1 else 's'}"
    if outbox.depth:
        outbox_text += (
            f" ({outbox.ready} ready, oldest {outbox.age_seconds:.3f} s; "
            f"{outbox.delivering} being delivered; {outbox.waiting} waiting to retry)"
        )
    rows = [
        ("partitions", partitions),
        ("lag", lag_text),
        ("outbox", outbox_text),
        (
            "dead letters",
            f"{snapshot.dead_letters} pending ({snapshot.dead_letters_total} in all)",
        ),
    ]
    for key, value in rows:
        table.add_row(Text(key), Text(value))
    return table
