"""Trainer: rsi's plain LoRA loop beside TRL's SFTTrainer (``peft_config``), on the same data and spec.

Data: generation 1 of a lineage of ``--profile`` (demo: the demo base), built as the cycle builds it from
rsi's own functions: the base's held-out greedy accuracy picks the levels (``plan_levels``), the base samples
the harness's k completions per train-split task at those levels plus replay tasks at its mastered levels
(``rollout``), the auditor judges each (``audit``), selection keeps one passed sample per task (``select``).
So both arms train on real verified samples, none on labels.

Each arm runs ``train_adapter`` from the base (generation 1 has no parent) with the profile's ``TrainSpec``
(``--steps`` overrides its steps) and the cycle's generation-1 seed; only ``trainer`` differs. Both consume
the same batches (``batch_plan``), schedule (``lr_at``), optimizer and completion-only loss. Per arm:

- wall seconds of ``train_adapter`` (model load, data preparation, steps, save) and training tokens/s: the
  non-pad tokens of all batches over those seconds; "step tokens/s" counts the steps alone;
- the process's CPU seconds and tokens per CPU-second, steadier than wall time on a shared machine;
- first and final loss, and held-out greedy accuracy per level after training (``rsi.evaluate.evaluate``
  on the heldout split, ``eval_n`` tasks per level, as the cycle's gate measures).

Arms alternate (ABBA) ``--repeat`` times per seed and each arm's fastest run is reported, so load elsewhere
on the machine hits neither arm alone; TRL / loop is the ratio of those. Training is deterministic, so
accuracy is measured once per arm and seed. Prints a markdown table and writes JSON.

    .venv/bin/python bench/train.py [--profile demo] [--steps N] [--repeat 2] [--seeds 1] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)

ARMS = ("loop", "trl")


def open_run(profile: str, root: Path):
    """A ``rsi.run.Run`` of ``profile`` in a fresh RSI_HOME under ``root``, with the cached base (built once)."""
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import Settings
    from rsi.run import Run, RunContext, load_config

    config = load_config(profile)
    base = ensure_base(Settings(home=REPO / ".rsi"), BaseRecipe(**config.base_recipe))
    home = root / "home"
    shutil.copytree(base, home / "models" / base.name)
    os.environ["RSI_HOME"] = str(home)
    return Run(RunContext.of(config, Settings(home=home)))


def heldout(run, adapter: Path | None, levels: list[int], n: int) -> dict[int, float]:
    """Greedy held-out accuracy per level of the base plus ``adapter``, as the cycle evaluates a pair."""
    from rsi.evaluate import evaluate
    from rsi.pair import Responder
    from rsi.train import adapter_hash

    pair = run.pair(adapter_hash(adapter) if adapter else None)
    scores = evaluate(Responder(run.harnesses.start, run.base.backend, pair.id, adapter, run.family), levels, n,
                      lineage_seed=run.config.seed)
    return {sc.level: sc.accuracy for sc in scores}


def generation_one_data(run, levels: list[int], eval_n: int) -> tuple[Any, dict[str, Any]]:
    """Generation 1's selection: the base's verified samples at the levels the curriculum picks."""
    from rsi.audit import audit, prompt_text
    from rsi.curriculum import frontier, plan_levels
    from rsi.pair import Responder, sampling_params
    from rsi.select import Candidate, select
    from rsi.splits import stream_seed

    config, started = run.config, time.perf_counter()
    accuracy = heldout(run, None, levels, eval_n)
    plan = plan_levels(accuracy, run.harnesses.curriculum(run.harnesses.start))
    mastered = frontier(accuracy, config.curriculum.mastery)
    seed = stream_seed("rollout", config.seed, 1)
    tasks = [t for p in plan for t in run.family.tasks("train", seed, p.level, p.n_tasks)]
    tasks += [t for lvl in range(1, mastered + 1)
              for t in run.family.tasks("train", stream_seed("replay", config.seed, 1), lvl, config.replay_tasks_per_level)]
    by_id = {t.id: t for t in tasks}
    samples = Responder(run.harnesses.start, run.base.backend, run.pair(None).id, family=run.family).episodes(
        tasks, sampling_params(run.harnesses.start, seed=seed))
    candidates = [Candidate(trajectory_id=s.id, task_id=s.task_id, level=by_id[s.task_id].level,
                            prompt=prompt_text(s), completion=s.completion,
                            passed=audit(s, by_id[s.task_id], run.harnesses.start, run.family).passed) for s in samples]
    dataset = select(candidates, [], config.selection, frontier_levels={p.level for p in plan}, seed=config.seed + 1)
    levels_of = lambda pool: sorted({e.level for e in dataset.pool(pool)})  # noqa: E731
    return dataset, {"source": "verified samples of the base (generation 1 of the lineage)", "base": accuracy,
                     "plan": [p.model_dump() for p in plan], "samples": len(samples),
                     "passed": sum(c.passed for c in candidates), "examples": len(dataset.examples),
                     "frontier": len(dataset.pool("frontier")), "frontier_levels": levels_of("frontier"),
                     "replay": len(dataset.pool("replay")), "replay_levels": levels_of("replay"),
                     "seconds": time.perf_counter() - started}


def batch_tokens(run, dataset, spec, seed: int) -> int:
    """Non-pad tokens of every batch the trainer consumes (both arms consume the same batches)."""
    from transformers import AutoTokenizer

    from rsi.train import batch_plan, encode

    tokenizer = AutoTokenizer.from_pretrained(run.base.dir)
    lengths = [len(encode(tokenizer, e)[0]) for e in dataset.pool("frontier") + dataset.pool("replay")]
    return sum(lengths[i] for batch in batch_plan(dataset, spec, seed) for i in batch)


def train_once(run, dataset, spec, seed: int, out: Path, tokens: int) -> dict[str, Any]:
    from rsi.train import train_adapter

    stamps: list[float] = []
    load = os.getloadavg()[0]
    started, cpu = time.perf_counter(), time.process_time()
    result = train_adapter(run.base.dir, None, dataset, spec, out, seed=seed,
                           on_step=lambda step, loss, lr: stamps.append(time.perf_counter()))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    # stamps are step ends: the first-to-last span times N-1 steps; scaled to N steps without the set-up
    steady = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) * len(stamps)
    return {"trainer": spec.trainer, "seed": seed, "wall_s": wall, "steps_s": steady, "cpu_s": cpu, "tokens": tokens,
            "tokens_per_s": tokens / wall, "step_tokens_per_s": tokens / steady, "tokens_per_cpu_s": tokens / cpu,
            "first_loss": result.first_loss, "final_loss": result.final_loss, "adapter_hash": result.adapter_hash,
            "loadavg_1m": load}


def summarize(runs: list[dict], accuracy: dict[str, dict[int, dict[int, float]]]) -> dict[str, dict]:
    """Per arm: its fastest run's timings, the losses, and accuracy per level averaged over seeds."""
    arms = {}
    for arm in ARMS:
        mine = [r for r in runs if r["trainer"] == arm]
        fastest = min(mine, key=lambda r: r["wall_s"])
        levels = sorted(next(iter(accuracy[arm].values())))
        arms[arm] = {"wall_s": fastest["wall_s"], "tokens_per_s": fastest["tokens_per_s"],
                     "step_tokens_per_s": max(r["step_tokens_per_s"] for r in mine),
                     "cpu_s": min(r["cpu_s"] for r in mine), "tokens_per_cpu_s": max(r["tokens_per_cpu_s"] for r in mine),
                     "first_loss": fastest["first_loss"], "final_loss": fastest["final_loss"],
                     "deterministic": len({(r["seed"], r["adapter_hash"]) for r in mine}) == len(accuracy[arm]),
                     "heldout": {lvl: sum(a[lvl] for a in accuracy[arm].values()) / len(accuracy[arm])
                                 for lvl in levels}}
    return arms


def print_table(arms: dict[str, dict], base: dict[int, float]) -> None:
    levels = sorted(base)
    head = " | ".join(f"L{lvl}" for lvl in levels)
    print(f"| trainer | wall s | tokens/s | step tokens/s | CPU s | tokens/CPU-s | first loss | final loss | {head} |")
    print("|---" * (8 + len(levels)) + "|")
    print(f"| base (no training) | | | | | | | | {' | '.join(f'{base[lvl]:.3f}' for lvl in levels)} |")
    for arm, a in arms.items():
        accs = " | ".join(f"{a['heldout'][lvl]:.3f}" for lvl in levels)
        print(f"| {arm} | {a['wall_s']:.1f} | {a['tokens_per_s']:.0f} | {a['step_tokens_per_s']:.0f} | "
              f"{a['cpu_s']:.1f} | {a['tokens_per_cpu_s']:.0f} | {a['first_loss']:.4f} | {a['final_loss']:.4f} | {accs} |")
    print("TRL / loop: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios(arms).items()))


def ratios(arms: dict[str, dict]) -> dict[str, float]:
    return {key: arms["trl"][key] / arms["loop"][key]
            for key in ("tokens_per_s", "step_tokens_per_s", "tokens_per_cpu_s", "wall_s", "cpu_s")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="demo", help="cycle profile: its base, harness, selection, TrainSpec")
    parser.add_argument("--steps", type=int, help="training steps (default: the profile's TrainSpec)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each arm per seed, alternating ABBA")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds: the cycle's generation-1 seed, +1, ...")
    parser.add_argument("--levels", type=int, default=6, help="held-out levels 1..N evaluated (base and arms)")
    parser.add_argument("--eval-n", type=int, help="held-out tasks per level (default: the profile's eval_n)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; on a busy machine "
                        "1 spins less against the other load)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/train.json")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="rsi-bench-train-"))
    try:
        run = open_run(args.profile, root)
        levels = list(range(1, min(args.levels, run.harnesses.max_level(run.harnesses.start)) + 1))
        spec = run.config.train.model_copy(update={"steps": args.steps} if args.steps else {})
        eval_n = args.eval_n or run.config.eval_n
        dataset, data = generation_one_data(run, levels, eval_n)
        print(f"data: {data['examples']} examples ({data['frontier']} frontier at levels {data['frontier_levels']}, "
              f"{data['replay']} replay at {data['replay_levels']}) from {data['samples']} samples, "
              f"{data['passed']} passed the audit; {data['seconds']:.0f} s")
        runs: list[dict] = []
        accuracy: dict[str, dict[int, dict[int, float]]] = {arm: {} for arm in ARMS}
        for s in range(args.seeds):
            seed = run.config.seed * 1000 + 1 + s  # the cycle trains generation g with seed * 1000 + g
            tokens = batch_tokens(run, dataset, spec, seed)
            for rep in range(args.repeat):
                for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                    out = root / f"{arm}-{seed}-{rep}"
                    runs.append(train_once(run, dataset, spec.model_copy(update={"trainer": arm}), seed, out, tokens))
                    r = runs[-1]
                    print(f"  seed {seed} run {rep} {arm}: {r['wall_s']:.1f} s, {r['tokens_per_s']:.0f} tok/s, "
                          f"loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}, load {r['loadavg_1m']:.1f}")
                    if rep == 0:
                        accuracy[arm][seed] = heldout(run, out, levels, eval_n)
        arms = summarize(runs, accuracy)
        print_table(arms, data["base"])
        result = {"profile": args.profile, "spec": spec.model_dump(mode="json", exclude={"trainer"}), "data": data,
                  "levels": levels, "eval_n": eval_n, "repeat": args.repeat, "seeds": args.seeds,
                  "arms": arms, "runs": runs,
                  "trl_over_loop": ratios(arms),
                  "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                              "python": platform.python_version(), "torch": torch.__version__,
                              "versions": versions()}}
        run.base.backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_result(args.out, result, run_config(args), args.threads)
    return result


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("transformers", "peft", "trl", "accelerate", "datasets")}


if __name__ == "__main__":
    main()
