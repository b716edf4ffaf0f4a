"""``make demo`` as a new user runs it: a fresh clone of this commit, installation included, timed; its log and
what it printed, as a result file.

Writes ``bench/results/demo-addition.log`` (progress bars removed) and ``bench/results/demo-addition.json``: wall
time, exit status, each generation's outcome line, the model versions it registered (generation, gate, adapter
hash, harness: what a refactor that changes no result registers again), the last table's mean accuracy over its
levels per pair (the champion beside the untrained base under the starting and the champion's harness, and the
champion's adapter under the starting harness), and the candidate harnesses' tree after it (``rsi harness archive
addition``). ``bench/readme.py`` writes the README's demo paragraph from the JSON.

    .venv/bin/python bench/demo.py [--generations 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)

OUTCOME = re.compile(r"^generation \d+: (promoted|rejected|harness search: .*|stopping.*)|^generation \d+ .*stopp")
MEANS = re.compile(r"^mean over levels (?P<levels>\d+-\d+): (?P<rest>.*?); weights' gain")


def summarize(log: str) -> dict:
    """The generations' outcome lines (accuracy dicts cut), and the last table's per-pair means."""
    generations = [re.sub(r"; accuracy \{.*", "", line) for line in log.splitlines() if OUTCOME.match(line)]
    means = [m for line in log.splitlines() if (m := MEANS.match(line))]
    if not means:
        return {"generations": generations, "levels": None, "final": {}, "gains": {}}
    pairs = re.findall(r"(.+?) (\d\.\d{3})(?:, |$)", means[-1]["rest"])
    table = log[log.rindex("its references"):]  # the last table: level, 4 pairs, weights' and harness's gain
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in table.splitlines() if line.startswith("│")]
    gains = {int(r[0]): {"weights": float(r[5]), "harness": float(r[6])} for r in rows if len(r) == 7}
    return {"generations": generations, "levels": means[-1]["levels"],
            "final": {name.strip(): float(acc) for name, acc in pairs}, "gains": gains}


def registered(clone: Path) -> list[dict[str, str]]:
    """The model versions the demo registered, in order: generation, gate, adapter and harness (what a refactor
    that changes no result registers again, byte for byte: ``bench/results`` keeps them to compare)."""
    code = ("import json, sys; from mlflow import MlflowClient; uri = sys.argv[1]; "
            "c = MlflowClient(tracking_uri=uri, registry_uri=uri); "
            "vs = sorted(c.search_model_versions(\"name = 'rsi-addition'\"), key=lambda v: int(v.version)); "
            "print(json.dumps([{k: v.tags.get(k) for k in ('generation', 'gate', 'adapter_hash', 'harness_id', "
            "'pair_id')} | {'version': v.version} for v in vs]))")
    out = subprocess.run([str(clone / ".venv/bin/python"), "-c", code, f"sqlite:///{clone / '.rsi/mlflow.db'}"],
                         capture_output=True, text=True, check=True, cwd=clone)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=4)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rsi-bench-demo-"))
    try:
        subprocess.run(["git", "clone", "-q", str(REPO), str(root / "rsi")], check=True)
        started = time.perf_counter()
        done = subprocess.run(["make", "demo", f"GENERATIONS={args.generations}"], cwd=root / "rsi",
                              env={k: v for k, v in os.environ.items() if not k.startswith(("RSI_", "PREFECT_"))},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - started
        versions = registered(root / "rsi") if done.returncode == 0 else []
        archive = subprocess.run([str(root / "rsi/.venv/bin/rsi"), "harness", "archive", "addition"], cwd=root / "rsi",
                                 capture_output=True, text=True).stdout if done.returncode == 0 else ""
    finally:
        shutil.rmtree(root, ignore_errors=True)
    log = "\n".join(line.rsplit("\r", 1)[-1] for line in done.stdout.splitlines() if "it/s]" not in line)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    (REPO / "bench/results/demo-addition.log").write_text(
        f"# make demo GENERATIONS={args.generations} on a fresh clone (bench/demo.py); {machine}; "
        f"wall {wall:.0f} s, rc {done.returncode}\n{log}\n\n# rsi harness archive addition (after the demo)\n{archive}")
    minutes, seconds = divmod(round(wall), 60)
    result = {"command": "make demo" + (f" GENERATIONS={args.generations}" if args.generations != 4 else ""),
              "machine": machine, "wall": f"{minutes} min {seconds} s", "wall_s": round(wall, 1),
              "rc": done.returncode, **summarize(log), "versions": versions,
              "archive": archive.splitlines()}
    write_result(REPO / "bench/results/demo-addition.json", result, run_config(args))
    print(f"make demo: {result['wall']}, rc {done.returncode}; final {result['final']}")
    if done.returncode:
        raise SystemExit(f"make demo failed (exit {done.returncode}): see bench/results/demo-addition.log")


if __name__ == "__main__":
    main()
