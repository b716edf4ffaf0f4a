"""rsi as a user installs it: the wheel, built from this checkout, in a fresh venv outside it.

The venv gets the wheel alone (``--no-deps``); its dependencies come from the test's own environment through a
path file that adds that environment's site-packages (as a path: its editable install of this checkout is not
loaded), so what is tested is the wheel's content: its packages, package data (harness versions, migrations),
console script and entry points.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow
SKIP = shutil.ignore_patterns(".git", ".venv", ".rsi", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                              "results", "out", "screenshots", "mlruns", ".ci-test.log")


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_wheel_installs_outside_the_checkout_and_runs_a_lineage(tmp_path: Path, tiny_base: Path) -> None:
    source, dist = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(REPO, source, ignore=SKIP)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), "."], source)
    (wheel,) = dist.glob("rsi-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    (site / "rsi-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], tmp_path)

    work = tmp_path / "elsewhere"
    (work / "home" / "models").mkdir(parents=True)
    shutil.copytree(tiny_base, work / "home" / "models" / tiny_base.name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RSI_HOME", "PREFECT_HOME")}
    env |= {"RSI_HOME": str(work / "home"), "PREFECT_HOME": str(work / "prefect")}
    rsi = str(venv / "bin" / "rsi")
    names = ["rsi.flows", "rsi.task_generators", "rsi.migrations", "rsi.harness_versions",
             *[".".join(d.parent.relative_to(REPO).parts) for d in sorted((REPO / "rsi").rglob("__init__.py"))]]
    where = run([str(python), "-c", "import importlib, sys; [print(importlib.import_module(n).__file__) "
                 "for n in sys.argv[1:]]", *names], work, env)
    assert all(Path(line).is_relative_to(site / "rsi") for line in where.split()), where  # not the checkout's code
    # rsi claims no top-level name but its own (flows, migrations, ... live under rsi/)
    assert sorted(p.name for p in site.iterdir() if (p / "__init__.py").exists()) == ["rsi"]
    assert {"addition", "sorting"} <= set(run([rsi, "tasks", "list"], work, env).split())
    run([rsi, "harness", "validate", "addition/v2"], work, env)
    run([rsi, "db", "upgrade"], work, env)
    out = run([rsi, "run", "addition", "--profile", "tiny", "--generations", "1"], work, env, timeout=900)
    assert "1 generation(s) run" in out, out
