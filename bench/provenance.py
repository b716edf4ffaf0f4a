"""Where a benchmark result came from: the commit, whether the code was committed, the config and the machine.

Every bench script writes its result JSON with ``write_result``, which adds a ``provenance`` block: a number in
the README can then be traced to the code, config and machine that produced it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import tomllib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rsi.hashing import digest

REPO = Path(__file__).resolve().parent.parent
# The code a result depends on; outputs under it (result files, research models and logs) are not code.
CODE_PATHS = ("rsi", "flows", "task_generators", "bench", "harness_versions", "pyproject.toml",
              ":(exclude)bench/results", ":(exclude)bench/harness_research/results",
              ":(exclude)bench/harness_research/out")


def machine_info(threads: int | None) -> dict:
    """The CPUs, library versions, torch threads (and the --threads asked for) and load a number was measured under."""
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "threads_arg": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_1m": os.getloadavg()[0],  # other jobs on the machine make the numbers noisy
    }


def _git(root: Path, *args: str) -> str | None:
    """git's stdout in ``root``, or None where git is missing or ``root`` is not in a repository."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


MEASURED = ("rsi", "flows", "task_generators")  # the code every bench result measures (and its own script)
# The serving layer (`rsi serve`, specialists, routers, keys, conversations): no lineage run, base build, evaluation
# or repair imports it (tests/test_bench_provenance.py runs `rsi run` and `rsi eval` and reads what they imported),
# so a result of those does not go stale when only it changes; a result of serving measures it (``serving``).
SERVING = ("rsi/mol",)
# Code no bench result's runs load: `python -m rsi.starts` (start adapters for chat bases) runs on its own, before a
# lineage (the same test reads what `rsi run` and `rsi eval` imported); a result that does measure it names it in
# ``also``.
OUTSIDE = ("rsi/starts.py",)


PROFILES_FILE = "rsi/run/profiles.toml"
MAKEFILE = "Makefile"


def changed_since(commit: str, script: str, root: Path = REPO, also: tuple[str, ...] = (),
                  serving: bool = True, families: tuple[str, ...] | None = None,
                  profiles: tuple[str, ...] | None = None,
                  make_targets: tuple[str, ...] | None = None) -> list[str] | None:
    """The measured files (``MEASURED`` but ``OUTSIDE``, ``script`` and ``also``: what else the result depends on;
    without ``serving``, not the serving layer; with ``families``, of the family modules in ``task_generators`` only
    those named) that differ between ``commit`` and the working tree, or None where ``commit`` is not in
    ``root``'s history (a shallow clone, or another repository).

    A run loads a family's module when it first asks for that family (``rsi.plugins``: entry points, loaded by
    name), so a result of addition lineages never imports ``task_generators/programs.py``
    (``tests/test_bench_provenance.py`` lists the modules ``rsi run`` and ``rsi eval`` hold when they exit):
    ``families`` names the modules a result's runs load, and a change to another family's module leaves it
    current. Likewise ``profiles``: the profiles a result's runs use; ``PROFILES_FILE`` counts as changed only
    where one of them reads otherwise (its table, after ``extends``, as ``rsi.run.config`` resolves it), so an
    edit of another profile, or of a comment, leaves it current. And ``make_targets``: the Makefile rules a result
    runs; ``MAKEFILE`` counts as changed only where its text differs outside the paragraphs of other targets'
    rules (``_make_text``)."""
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None
    excluded = tuple(f":(exclude){path}" for path in OUTSIDE if path not in also)
    excluded += () if serving else tuple(f":(exclude){path}" for path in SERVING)
    if families is not None:
        others = sorted({p.stem for p in (root / "task_generators").glob("*.py")} - {"__init__", *families})
        excluded += tuple(f":(exclude)task_generators/{stem}.py" for stem in others)
    out = _git(root, "diff", "--name-only", commit, "--", *MEASURED, script, *also, *excluded)
    if out is None:
        return None
    changed = out.split()
    if profiles is not None and PROFILES_FILE in changed:
        then, now = _git(root, "show", f"{commit}:{PROFILES_FILE}"), (root / PROFILES_FILE).read_text()
        if then is not None and all(_profile(then, p) == _profile(now, p) for p in profiles):
            changed.remove(PROFILES_FILE)
    if make_targets is not None and MAKEFILE in changed:
        then, now = _git(root, "show", f"{commit}:{MAKEFILE}"), (root / MAKEFILE).read_text()
        if then is not None and _make_text(then, make_targets) == _make_text(now, make_targets):
            changed.remove(MAKEFILE)
    return changed


def _make_text(text: str, targets: tuple[str, ...]) -> list[str]:
    """A Makefile's paragraphs (blank-line separated) but those whose rules (``.PHONY`` aside) all make other
    targets than ``targets``: variables, comments and the named targets' rules stay."""
    kept = []
    for paragraph in text.split("\n\n"):
        made = {m.group(1) for m in re.finditer(r"^([^\s:#=]+)\s*:(?!=)", paragraph, re.M)} - {".PHONY"}
        if not made or made & set(targets):
            kept.append(paragraph.strip())
    return kept


def _profile(text: str, name: str) -> dict | None:
    """Profile ``name`` of a profiles.toml's ``text``, its ``extends`` resolved as ``rsi.run.config`` resolves it
    (the other's tables, replaced key by key at the top level); None where it has none, or the text does not parse."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None
    spec = raw.get(name)
    if not isinstance(spec, dict) or "extends" not in spec:
        return spec
    return {**raw.get(spec["extends"], {}), **{k: v for k, v in spec.items() if k != "extends"}}


def run_config(args: argparse.Namespace, **more: Any) -> dict:
    """A script's arguments as its config (``--out`` left out: where a result goes is not how it was made)."""
    return {k: v for k, v in vars(args).items() if k != "out"} | more


def provenance(config: dict | None = None, threads: int | None = None, root: Path = REPO) -> dict:
    """The commit of ``root``'s repository, whether its code paths were clean, the config's digest, the machine."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--", *CODE_PATHS) if commit else None
    # default=str: argument values such as Path are digested by their text
    config_digest = None if config is None else digest(json.loads(json.dumps(config, default=str)))
    return {"commit": commit.strip() if commit else None, "clean": status == "", "config_digest": config_digest,
            "machine": machine_info(threads), "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_result(path: Path | str, payload: dict, config: dict | None = None, threads: int | None = None) -> None:
    """``payload`` plus its ``provenance`` as indented JSON at ``path`` (folder made), replaced atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload | {"provenance": provenance(config, threads)}, indent=2) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same folder: os.replace is then atomic
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {path}")
