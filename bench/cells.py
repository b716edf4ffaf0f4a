"""A bench's cells in child processes: each cell (an arm, a seed) runs in a process of its own, under an RSI_HOME
of its own holding a copy of the shared base, so cells run side by side and each one's CPU is its own process
tree's. The child prints its result as one line, ``CELL`` then JSON (``report``); every other line it prints is
passed on as it comes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

MARK = "CELL "


def report(result: dict[str, Any]) -> None:
    """In the child: its result, as the line the parent reads."""
    print(MARK + json.dumps(result), flush=True)


def child_cell(cmd: list[str], base: Path, home: Path, prefect_home: Path, threads: int, what: str,
               partial: Path) -> dict[str, Any]:
    """Run ``cmd`` (the bench script with its ``--cell`` argument) with ``RSI_HOME=home`` (``base`` copied into
    its models) and ``threads`` torch threads; its result, or SystemExit naming ``what`` failed and where the
    cells finished before it are (``partial``)."""
    shutil.copytree(base, home / "models" / base.name)
    env = os.environ | {"RSI_HOME": str(home), "PREFECT_HOME": str(prefect_home), "OMP_NUM_THREADS": str(threads)}
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            (lines.append(line) if line.startswith(MARK) else print(line, end="", flush=True))
    if child.returncode or not lines:
        raise SystemExit(f"{what} failed (exit {child.returncode}); the cells finished before it are in {partial}: "
                         "rerun with --resume")
    shutil.rmtree(home, ignore_errors=True)
    return json.loads(lines[-1][len(MARK):])
