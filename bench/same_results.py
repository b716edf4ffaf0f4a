"""Does a change of code change results? The same lineages run on two versions of rsi, compared row by row.

A refactor must change no result: each side runs the same lineages from an empty ``RSI_HOME`` (torch threads
pinned): addition on the tiny profile, addition searching plan harnesses, and ``rsi run sorting`` (its own
profile). Then it dumps the state DB's generations (status, adapter hash, harness) and every stored evaluation
(pair, split, level, correct of n, decoding); every registered model version's pyfunc predictions
(``mlflow.pyfunc.load_model``) on held-out tasks of its family; and a serve session: the addition and sorting
lineages admitted as specialists, the ngram router trained, and ``rsi serve``'s app (in process, over HTTP)
asked each specialist's held-out questions as a person asks them (model ``rsi/auto``), the replies and who gave
them recorded. The rows of both sides are compared. Equal rows mean the same adapters were trained on the same
selected data, scored the same, and answer the same through the pyfunc model and the proxy. A side is a git ref
(exported with ``git archive``) or the working tree, run by this venv's Python with that side first on
``sys.path`` (its ``rsi`` and the folders it maps), so both sides share installed packages and differ only in
the repository's code.

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
# the tiny profile with the training and held-out tasks that promote generation 1 on seed 0 (tests/test_stack.py),
# so the pyfunc model and the proxy have a champion to answer with
PROMOTING = ["train.steps=120", "train.batch_size=32", "train.warmup=4", "eval_n=256", "gate.margin=0.1",
             "curriculum.rule=accelerated", "curriculum.tasks_per_level=128", "curriculum.lookahead_tasks=32"]
LINEAGES = (("addition", "addition", None, ["--profile", "tiny", *[a for s in PROMOTING for a in ("--set", s)]]),
            ("addition-searching", "addition", 1, ["--profile", "tiny", "--set", "harness_search.enabled=true",
                                                   "--set", "harness_search.every=1", "--set",
                                                   'harness_search.space={"chunk": [1, 2]}', "--set", "train.steps=0"]),
            ("sorting", "sorting", None, []))
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

# every registered version's pyfunc predictions on held-out tasks of its family (levels 1-3, 3 tasks each)
import mlflow
from mlflow import MlflowClient
from rsi.config import get_settings
from rsi.tasks import get_family
uri = get_settings().mlflow_uri
mlflow.set_tracking_uri(uri)
client = MlflowClient(tracking_uri=uri, registry_uri=uri)
for model in sorted(client.search_registered_models(), key=lambda m: m.name):
    family = get_family(model.name.removeprefix("rsi-").split("-")[0])
    payloads = [t.payload for level in (1, 2, 3) for t in family.tasks("heldout", 11, level, 3)]
    for v in sorted(client.search_model_versions(f"name='{model.name}'"), key=lambda v: int(v.version)):
        predicted = mlflow.pyfunc.load_model(f"models:/{model.name}/{v.version}").predict(payloads)
        rows.append(["pyfunc", model.name, int(v.version), json.dumps(predicted, sort_keys=True, default=str)])
print(json.dumps(rows))
"""
SERVE = ["specialists add addition", "specialists add sorting", "router train"]
# a serve session: each specialist's held-out questions (levels 1-3) as a person asks them, model rsi/auto
SESSION = """
import json
import re
from starlette.testclient import TestClient
from rsi.config import get_settings
from rsi.mol.proxy import ServeConfig, create_app
from rsi.mol.registry import Registry
from rsi.mol.state import create_key
from rsi.store import open_store
from rsi.tasks import get_family
store = open_store()
champions = Registry(store, get_settings().home).champions()
key = create_key(store, "same-results")
rows = []
with TestClient(create_app(ServeConfig(rate=1000, burst=1000))) as client:
    for name, champion in sorted(champions.items()):
        family = get_family(name)
        for level in (1, 2, 3):
            for task in family.tasks("heldout", 13, level, 3):
                [(role, question)] = [m for m in champion.harness.prompt_messages(task.payload) if m[0] == "user"]
                reply = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                    json={"model": "rsi/auto", "messages": [{"role": "user", "content": question}]})
                body = reply.json()
                message = json.dumps(body["choices"][0]["message"] if reply.status_code == 200 else body,
                                     sort_keys=True)
                # a tool call's id ends in random hex by design (call_<specialist>_<12 hex>): not a result
                rows.append(["serve", name, level, question, reply.status_code, body.get("model"),
                             re.sub(r"(call_[a-z0-9-]+)_[0-9a-f]{12}", r"\\1_<random>", message)])
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
    # named rsi: importlib.metadata takes the first distribution of a name on sys.path, so the installed rsi's
    # entry points (which may name modules this side has elsewhere) are not read
    dist = into / "rsi-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rsi\nVersion: 0.1.0\n")
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
                                       *more] for lineage, family, n, more in LINEAGES], *map(str.split, SERVE)):
        done = subprocess.run([sys.executable, "-m", "rsi", *args], cwd=code, env=env, capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise SystemExit(f"{(done.stdout + done.stderr)[-3000:]}\nsame_results: `rsi {' '.join(args)}` on {code} "
                             f"exited {done.returncode} (its output's end above)")
    rows = []
    for script in (DUMP, SESSION):
        dumped = subprocess.run([sys.executable, "-c", script], cwd=code, env=env, capture_output=True, text=True,
                                check=False)
        if dumped.returncode:
            raise SystemExit(f"{dumped.stderr[-3000:]}\nsame_results: dumping the results on {code} failed")
        rows += json.loads(dumped.stdout.strip().splitlines()[-1])
    return rows, time.perf_counter() - started


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
