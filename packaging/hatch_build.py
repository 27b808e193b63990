"""Owns the wheel's platform tag: a wheel that holds the native start helper
(daemon/scheduled_d/native/_vspawn.so, built by `make native`) is a wheel for this platform
and interpreter, not py3-none-any; without it the wheel stays pure (commands then start
through /bin/sh, scheduled_d/spawn.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HELPER = Path("daemon/scheduled_d/native/_vspawn.so")


class NativeHelperTag(BuildHookInterface):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and (Path(self.root) / HELPER).is_file():
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
