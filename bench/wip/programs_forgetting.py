"""Research: where does a programs candidate lose a level its parent had? Greedy runs of the base and of base +
adapter on ``--n`` test tasks of ``--level``; per task lost (right before, wrong after), the first state of the
run (``programs.worked``) that differs and whether the run's length changed; the first few printed whole.
Without ``--adapter``: where the base's own runs go wrong (against the right runs).

    .venv/bin/python bench/wip/programs_forgetting.py --base DIR [--adapter DIR] [--level 2] [--n 256] [--out F]

(The 2026-12-07 note: v3lr's generation 1 adapter on its base, level 2: every task lost is lost in its last state,
the arithmetic of the final operation, e.g. '14 7 mul' -> 112. The v2 base of ``programs_rank.py`` alone at level
3: every run it gets wrong goes wrong in state 0, the program copied with the input in place of x.)
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--level", type=int, default=2)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--show", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for name, path, file in (("--base", args.base, "config.json"), ("--adapter", args.adapter, "adapter_config.json")):
        if path is not None and not (path / file).exists():
            raise SystemExit(f"{name} {path}: no {file} there; pass a built base and a lineage's adapter folder")
    from rsi.backends.base import SamplingParams
    from rsi.backends.hf import HFBackend
    from rsi.hcp import load_harness
    from rsi.pair import Responder
    from rsi.task_generators import programs
    from rsi.tasks import get_family

    family, harness = get_family("programs"), load_harness("programs/v3")
    tasks = family.tasks("test", 3, args.level, args.n)
    greedy = SamplingParams(max_new_tokens=harness.document.decoding.max_new_tokens)
    backend = HFBackend(args.base)
    def runs(adapter: Path | None) -> list[str]:  # as the cycle samples them: the harness's prompt, greedy
        return [t.completion for t in Responder(harness, backend, "probe", adapter, family).episodes(tasks, greedy)]

    try:
        if args.adapter is None:  # the base against the right runs
            before, after = [programs.worked(t.payload) for t in tasks], runs(None)
        else:
            before, after = runs(None), runs(args.adapter)
    finally:
        backend.close()
    where: Counter = Counter()
    shown = 0
    for task, old, new in zip(tasks, before, after):
        want = programs.worked(task.payload)
        if old == want and new != want:
            states, got = want.split(" | "), new.split(" | ")
            first = next((k for k, (a, b) in enumerate(zip(states, got)) if a != b), min(len(states), len(got)))
            where[f"state {first} of {len(states)}, length {len(got) - len(states):+d}"] += 1
            if shown < args.show:
                print(f"{task.payload}\n  want {want}\n  got  {new}")
                shown += 1
    right = [sum(run == programs.worked(t.payload) for t, run in zip(tasks, side)) for side in (before, after)]
    lost = sum(a == programs.worked(t.payload) != b for t, a, b in zip(tasks, before, after))
    names = ("base", "candidate") if args.adapter else ("right runs", "base")
    print(f"level {args.level}: {names[0]} {right[0]}/{len(tasks)}, {names[1]} {right[1]}/{len(tasks)}, lost {lost}: "
          f"{dict(where)}")
    if args.out:
        write_result(args.out, {"right": right, "lost": lost, "where": dict(where)}, run_config(args))


if __name__ == "__main__":
    main()
