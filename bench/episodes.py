"""Episode throughput: tool episodes per second of each engine, and the hf backend against plain ``model.generate``.

Two measurements, each a ratio against a baseline in the same run:

- episodes: the same sorting tasks (``--levels``, ``--tasks`` per level) played greedily as episodes by
  ``rsi.pair.Responder.episodes`` (one backend batch per turn, the tool calls run on the substrate) on each
  engine of ``--engines`` (hf in process; vllm: a vLLM server behind the openai backend, ``rsi engine install``
  first). Prints episodes/s, turns/s and each engine's episodes/s over the hf backend's.
- audit: milliseconds per episode for the auditor to judge the episodes the hf arm played (every rule,
  the replay of every call included).
- single turn: the hf backend's ``generate`` against ``model.generate`` (transformers, greedy, the same
  model, the same batch of addition-style prompts of equal length, the same max_new_tokens), new tokens/s and
  the ratio backend / generate. ``--threads`` sets torch's intra-op threads of both and of the hf engine;
  the default 1 is what rsi's hf backend decodes with (``rsi.backends.hf``). ``--threads 0`` leaves torch's
  default (a thread per core): on a 2-core machine the hf episodes then took 3-4x longer (5.7-7.3 s against
  1.8 s for the same 256 episodes, 3 runs each) and ``model.generate`` swung between 676 and 30388 tok/s
  with what else ran.

The model is the sorting profile's base (``--model DIR`` to use another, e.g. a lineage's; it is built
first when missing, ~3 min). Run:

    .venv/bin/python bench/episodes.py [--engines hf,vllm] [--levels 2,4] [--tasks 128] [--out JSON]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from generation import ENGINES
from provenance import machine_info, run_config, write_result

from rsi.backends.base import SamplingParams

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "episodes.json"


def sorting_base() -> Path:
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import get_settings
    from rsi.run import load_config

    return ensure_base(get_settings(), BaseRecipe(**load_config("sorting").base_recipe))


def episodes_arm(name: str, model_dir: Path, levels: list[int], tasks_per_level: int,
                 threads: int | None) -> dict:
    from rsi.audit import audit
    from rsi.evaluate import solved
    from rsi.hcp import load_harness
    from rsi.pair import Responder, sampling_params
    from rsi.tasks import get_family

    harness, family = load_harness("sorting/v1"), get_family("sorting")
    tasks = [t for level in levels for t in family.tasks("test", 0, level, tasks_per_level)]
    params = sampling_params(harness, seed=0, greedy=True)
    backend = ENGINES[name](model_dir, threads)
    try:
        pair = Responder(harness, backend, "bench", family=family)
        pair.episodes(tasks[:8], params)  # warm-up
        started = time.perf_counter()
        trajectories = pair.episodes(tasks, params)
        seconds = time.perf_counter() - started
        right = sum(solved(pair, tasks, params).values())
    finally:
        backend.close()
    by_id = {t.id: t for t in tasks}
    started = time.perf_counter()
    for trajectory in trajectories:
        audit(trajectory, by_id[trajectory.task_id], harness, family)
    audit_ms = 1000 * (time.perf_counter() - started) / len(trajectories)
    turns = sum(m.role == "assistant" for t in trajectories for m in t.messages)
    return {"engine": name, "episodes": len(trajectories), "turns": turns, "seconds": round(seconds, 3),
            "episodes_per_s": len(trajectories) / seconds, "turns_per_s": turns / seconds, "solved": right,
            "audit_ms_per_episode": audit_ms}


def single_turn_arm(model_dir: Path, prompts: int, max_new: int, threads: int | None) -> dict:
    """The hf backend's generate vs model.generate on one batch of equal-length prompts (sorting episodes' first
    turns), greedy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rsi.backends.hf import HFBackend

    from rsi.hcp import load_harness
    from rsi.tasks import get_family

    harness, family = load_harness("sorting/v1"), get_family("sorting")
    tasks = [t for level in range(1, family.max_level + 1) for t in family.tasks("test", 0, level, prompts)]
    texts = [harness.prompt(t.payload) for t in tasks[:prompts]]  # the first turn of episodes: equal lengths
    params = SamplingParams(max_new_tokens=max_new)
    backend = HFBackend(model_dir, threads=threads or 1)
    backend.generate(texts[:8], params)
    started = time.perf_counter()
    out = backend.generate(texts, params)
    backend_s = time.perf_counter() - started
    backend_tokens = sum(c[0].completion_tokens for c in out)
    backend.close()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if threads:
        torch.set_num_threads(threads)
    ids = tokenizer(texts, return_tensors="pt")["input_ids"]  # equal lengths: no padding
    with torch.inference_mode():
        model.generate(ids[:8], max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        started = time.perf_counter()
        generated = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id)
        generate_s = time.perf_counter() - started
    new = generated[:, ids.shape[1]:]
    # tokens up to and including the first EOS of each row, as the backend counts them
    ends = [(row == tokenizer.eos_token_id).nonzero() for row in new]
    generate_tokens = sum(int(e[0]) + 1 if len(e) else new.shape[1] for e in ends)
    same = sum(c[0].text == tokenizer.decode(row[: (int(e[0]) if len(e) else None)], skip_special_tokens=True)
               for c, row, e in zip(out, new, ends))
    return {"prompts": len(texts), "max_new_tokens": max_new,
            "backend": {"tokens": backend_tokens, "seconds": round(backend_s, 3), "tokens_per_s": backend_tokens / backend_s},
            "generate": {"tokens": generate_tokens, "seconds": round(generate_s, 3),
                         "tokens_per_s": generate_tokens / generate_s},
            "backend_over_generate": (backend_tokens / backend_s) / (generate_tokens / generate_s),
            "same_text": same}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a saved model directory (default: the sorting profile's base)")
    parser.add_argument("--engines", default="hf", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--levels", default="2,4")
    parser.add_argument("--tasks", type=int, default=128, help="test tasks per level")
    parser.add_argument("--prompts", type=int, default=256, help="single-turn batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    args.threads = args.threads or None
    model_dir = args.model or sorting_base()
    levels = [int(x) for x in args.levels.split(",")]
    arms = [episodes_arm(name.strip(), model_dir, levels, args.tasks, args.threads) for name in args.engines.split(",")]
    single = single_turn_arm(model_dir, args.prompts, 10, args.threads)
    hf = next((a for a in arms if a["engine"] == "hf"), None)
    print(f"{'engine':<8}{'episodes':>9}{'turns':>7}{'seconds':>9}{'episodes/s':>12}{'turns/s':>9}{'solved':>8}{'/ hf':>7}"
          f"{'audit ms/ep':>12}")
    for a in arms:
        ratio = a["episodes_per_s"] / hf["episodes_per_s"] if hf else float("nan")
        a["over_hf"] = ratio
        print(f"{a['engine']:<8}{a['episodes']:>9}{a['turns']:>7}{a['seconds']:>9.2f}{a['episodes_per_s']:>12.1f}"
              f"{a['turns_per_s']:>9.1f}{a['solved']:>8}{ratio:>7.2f}{a['audit_ms_per_episode']:>12.2f}")
    b, g = single["backend"], single["generate"]
    print(f"single turn, {single['prompts']} prompts, greedy: hf backend {b['tokens_per_s']:.0f} tok/s, "
          f"model.generate {g['tokens_per_s']:.0f} tok/s, backend / generate = {single['backend_over_generate']:.2f}x "
          f"({single['same_text']}/{single['prompts']} identical texts)")
    report = {"model": str(model_dir), "levels": levels, "tasks_per_level": args.tasks, "episodes": arms,
              "single_turn": single, "machine": machine_info(args.threads)}
    write_result(args.out, report, run_config(args), args.threads)
    return report


if __name__ == "__main__":
    main()
