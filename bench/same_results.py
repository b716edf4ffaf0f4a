"""Does a change of code change results? The same lineages run on two versions of rsi, compared row by row.

A refactor must change no result: each side runs the same lineages from an empty ``RSI_HOME`` (torch threads
pinned), then the state DB's generations (status, adapter hash, harness) and every stored evaluation (pair,
split, level, correct of n, decoding) are compared. Equal rows mean the same adapters were trained on the same
selected data and scored the same. A side is a git ref (exported with ``git archive``) or the working tree, run
by this venv's Python with that side first on ``sys.path`` (its ``rsi``, ``flows``, ``task_generators`` and
``harness_versions``), so both sides share installed packages and differ only in the repository's code.

    .venv/bin/python bench/same_results.py --before d4b1df8~1 [--after HEAD] [--generations 2]

Prints the rows that differ (none: "identical") and writes ``bench/results/same-results.json``; exits 1 when
the sides differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import REPO, run_config, write_result  # noqa: E402 (after the path it needs)

# (lineage, family, generations: None for --generations, more arguments of `rsi run`). The searching lineage's
# one generation proposes plan harnesses, so plans run through the responder too.
LINEAGES = (("addition", "addition", None, ["--profile", "tiny"]),
            ("addition-searching", "addition", 1, ["--profile", "tiny", "--set", "harness_search.enabled=true",
                                                   "--set", "harness_search.every=1", "--set",
                                                   'harness_search.space={"chunk": [1, 2]}', "--set", "train.steps=0"]))
DUMP = """
import json
from sqlalchemy import select
from rsi.store import open_store
from rsi.store.schema import EvaluationRow, Generation, PairRow
rows = []
with open_store().session() as s:
    for g in s.scalars(select(Generation).order_by(Generation.lineage, Generation.number)):
        p = s.get(PairRow, g.candidate_pair_id) if g.candidate_pair_id else None
        rows.append(["generation", g.lineage, g.number, g.status, p and p.adapter_hash, p and p.harness_id])
    for e in s.scalars(select(EvaluationRow).order_by(EvaluationRow.pair_id, EvaluationRow.split, EvaluationRow.level,
                                                      EvaluationRow.decoding)):
        rows.append(["evaluation", e.pair_id, e.split, e.level, e.correct, e.n, e.decoding])
print(json.dumps(rows))
"""


def source(ref: str | None, into: Path) -> Path:
    """The repository's code at ``ref`` (None: the working tree itself)."""
    if ref is None:
        return REPO
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"same_results: git archive {ref!r} failed: {archive.stderr.decode().strip()}; pass a "
                         "commit, branch or tag of this repository")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def entry_points_of(code: Path, into: Path) -> Path:
    """A folder holding a distribution with the entry points ``code``'s pyproject.toml declares (its families,
    proposers, ...): the installed rsi's metadata is this checkout's, and another version may name other groups."""
    import tomllib

    declared = tomllib.loads((code / "pyproject.toml").read_text())["project"].get("entry-points", {})
    dist = into / "rsi_same_results_side-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rsi-same-results-side\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in found.items()) + "\n"
        for group, found in declared.items()))
    return into


def run_side(code: Path, home: Path, generations: int, threads: int) -> tuple[list, float]:
    """The lineages run on ``code`` in a fresh ``home``: the dumped rows and the wall seconds."""
    home.mkdir(parents=True, exist_ok=True)
    path = f"{code}{os.pathsep}{entry_points_of(code, home / 'entry-points')}"
    env = os.environ | {"PYTHONPATH": path, "RSI_HOME": str(home / "rsi"), "PREFECT_HOME": str(home / "prefect"),
                        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    for args in (["db", "upgrade"], *[["run", family, "--lineage", lineage, "--generations", str(n or generations),
                                       *more] for lineage, family, n, more in LINEAGES]):
        done = subprocess.run([sys.executable, "-m", "rsi", *args], cwd=code, env=env, capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise SystemExit(f"{(done.stdout + done.stderr)[-3000:]}\nsame_results: `rsi {' '.join(args)}` on {code} "
                             f"exited {done.returncode} (its output's end above)")
    dumped = subprocess.run([sys.executable, "-c", DUMP], cwd=code, env=env, capture_output=True, text=True, check=True)
    return json.loads(dumped.stdout), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git ref of the code before the change")
    parser.add_argument("--after", default=None, help="git ref of the code after it (default: the working tree)")
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both sides")
    parser.add_argument("--out", default=str(REPO / "bench/results/same-results.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rsi-same-results-") as tmp:
        sides = {}
        for name, ref in (("before", args.before), ("after", args.after)):
            code = source(ref, Path(tmp) / name / "src")
            sides[name] = run_side(code, Path(tmp) / name / "home", args.generations, args.threads)
            print(f"{name} ({ref or 'working tree'}): {len(sides[name][0])} rows in {sides[name][1]:.0f} s", flush=True)
    before, after = ([tuple(r) for r in sides[n][0]] for n in ("before", "after"))
    only_before = [r for r in before if r not in after]
    only_after = [r for r in after if r not in before]
    for mark, rows in (("-", only_before), ("+", only_after)):
        for row in rows:
            print(mark, *row)
    same = not only_before and not only_after and before == after
    print("identical" if same else f"differ: {len(only_before)} rows only before, {len(only_after)} only after")
    write_result(args.out, {"before": args.before, "after": args.after or "working tree", "lineages": LINEAGES,
                            "rows": len(before), "identical": same, "only_before": only_before,
                            "only_after": only_after, "seconds": {n: round(sides[n][1], 1) for n in sides}},
                 run_config(args))
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
