"""Owns the tests of schedctl's plugins (the `schedctl.plugins` entry points): with
schedctl-bench installed the root help lists `bench` and its commands; without any plugin
the root help is the same less the bench line; a plugin that fails to load is a one-line
warning on stderr and every other command still works."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import typer
from typer.testing import CliRunner

from schedctl.cli.app import PLUGIN_GROUP, add_plugins

BENCH = EntryPoint("bench", "schedctl_bench.cli.plugin:register", PLUGIN_GROUP)
BROKEN = EntryPoint("broken", "schedctl_no_such_plugin:register", PLUGIN_GROUP)

# the console script's main() with the plugin entry points replaced by `found` (None: as
# installed), so that one interpreter shows the CLI without a plugin or with a broken one
_PROBE = """
import importlib.metadata as metadata, sys
real = metadata.entry_points
found = {found}
def entry_points(**select):
    if select.get("group") == {group!r} and found is not None:
        return [metadata.EntryPoint(*args) for args in found]
    return real(**select)
metadata.entry_points = entry_points
sys.argv = ["schedctl", *sys.argv[1:]]
from schedctl.cli.app import main
main()
"""


def _schedctl(
    tmp_path: Path, *args: str, found: list[EntryPoint] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDULED_")}
    env.update(COLUMNS="120", XDG_DATA_HOME=str(tmp_path / "data"))
    listed = None if found is None else [(e.name, e.value, e.group) for e in found]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(found=listed, group=PLUGIN_GROUP), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


def test_the_dev_venv_has_the_bench_plugin() -> None:
    # the bench tests run the plugin as installed; `make deps` installs it editable
    assert [(e.name, e.value) for e in entry_points(group=PLUGIN_GROUP)] == [
        (BENCH.name, BENCH.value)
    ]


def test_without_plugins_the_help_loses_only_the_bench_line(tmp_path: Path) -> None:
    with_bench = _schedctl(tmp_path, "--help").stdout.splitlines()
    without = _schedctl(tmp_path, "--help", found=[]).stdout.splitlines()
    bench_lines = [line for line in with_bench if line.split()[1:2] == ["bench"]]
    assert len(bench_lines) == 1, with_bench
    assert [line for line in with_bench if line not in bench_lines] == without
    assert not any("bench" in line for line in without)
    refused = _schedctl(tmp_path, "bench", "--help", found=[])
    assert refused.returncode == 2 and "No such command 'bench'" in refused.stderr


def test_a_broken_plugin_is_a_warning_and_the_rest_works(tmp_path: Path) -> None:
    done = _schedctl(tmp_path, "--help", found=[BROKEN, BENCH])
    assert done.returncode == 0
    assert done.stderr.splitlines() == [
        "warning: plugin 'broken' (schedctl_no_such_plugin:register) not loaded: "
        "No module named 'schedctl_no_such_plugin'"
    ]
    assert any(line.split()[1:2] == ["bench"] for line in done.stdout.splitlines())
    version = _schedctl(tmp_path, "--version", found=[BROKEN])
    assert version.returncode == 0 and version.stdout.startswith("schedctl ")


def test_a_plugin_adds_its_commands_to_the_app_it_is_given() -> None:
    root = typer.Typer()

    @root.command("noop")
    def noop() -> None:
        """Nothing."""

    assert add_plugins(root, [BENCH, BROKEN]) == [
        "plugin 'broken' (schedctl_no_such_plugin:register) not loaded: "
        "No module named 'schedctl_no_such_plugin'"
    ]
    shown = CliRunner().invoke(root, ["bench", "--help"])
    assert shown.exit_code == 0, shown.output
    for command in ("api", "burst", "steady", "relay", "create", "scale", "peers", "console"):
        assert command in shown.output
    assert add_plugins(typer.Typer(), []) == []
