"""Owns `schedctl completion SHELL`: the shell completion script for bash, zsh or fish.

typer's own `--show-completion` detects the shell it runs under (and ignores a shell named
after it), so a script for another shell, or one written from a provisioning tool, comes
from here. The script calls `schedctl` back with _SCHEDCTL_COMPLETE set on each TAB; that is
cheap because `schedctl` imports no database or network library until a command runs.
"""

from __future__ import annotations

import enum
from typing import Annotated

import typer

# typer's script templates; the public options (--show-completion) offer no shell choice
from typer._completion_shared import get_completion_script

from schedctl.cli.common import say

PROG = "schedctl"
COMPLETE_VAR = "_SCHEDCTL_COMPLETE"


class Shell(enum.StrEnum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def completion(
    shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish.", case_sensitive=False)],
) -> None:
    """Print the completion script for SHELL.

    bash: `schedctl completion bash > /etc/bash_completion.d/schedctl`;
    zsh: `schedctl completion zsh > "${fpath[1]}/_schedctl"`;
    fish: `schedctl completion fish > ~/.config/fish/completions/schedctl.fish`."""
    say(get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell.value))
