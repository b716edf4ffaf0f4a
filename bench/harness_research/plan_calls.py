"""Which calls of a plan does a pair get wrong? Per kind of call: equal-length operands or unequal lengths (a
part that starts with a 0 in one operand), and with ``--by-level`` per level; greedy, audited like any call.

    .venv/bin/python bench/harness_research/plan_calls.py HARNESS_DIR BASE_DIR ADAPTER_DIR [--level 7] [--n 200]
        [--even]

``--even`` cuts parts as evenly as possible whatever their digits instead of ``rsi.task_generators.addition.cuts``.
Measured (issue 10 session 2) with the demo's generation-2 adapter (``$RSI_HOME/adapters/addition/gen-002-*``)
and addition/v2 + digit_chunks(chunk 5) (the harness store's folder ``$RSI_HOME/harnesses/addition/v2.chunks5-*``),
level 7 heldout, 200 tasks, ``--by-level``: with ``--even``, unequal-length calls were right in 2 of 36 (level 4)
while equal ones were 1.00 (L3), .99 (L4); with ``cuts`` every call has equal lengths: L3 193/193, L4 217/219,
L5 157/171, L6 2/7. (A first version carried with a call ``x + 1``, whose operands again differ in length, and
the model often got it wrong; hence the carry-select calls ``a5 + b5``.)
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("harness")
    parser.add_argument("base")
    parser.add_argument("adapter")
    parser.add_argument("--level", type=int, default=7)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--even", action="store_true", help="cut evenly, whatever the digits")
    parser.add_argument("--by-level", action="store_true", help="one row per kind and level of call")
    args = parser.parse_args()
    if args.even:
        import rsi.task_generators.addition as addition

        def even(a: str, b: str, chunk: int) -> list[int]:
            count = -(-len(a) // chunk)
            sizes = [len(a) // count + (k < len(a) % count) for k in range(count)]
            return [sum(sizes[:k]) for k in range(count + 1)]

        addition.cuts = even

    from rsi.audit import audit
    from rsi.backends import get_backend
    from rsi.backends.base import SamplingParams
    from rsi.hcp import load_harness
    from rsi.pair import Responder
    from rsi.tasks import get_family

    harness, family = load_harness(args.harness), get_family("addition")
    tasks = family.tasks("heldout", 0, args.level, args.n)
    pair = Responder(harness, get_backend("hf", model_dir=args.base), "plan-calls", args.adapter, family)
    done = pair.run(tasks, SamplingParams(max_new_tokens=harness.document.decoding.max_new_tokens, n=1))
    seen, wrong = collections.Counter(), collections.Counter()
    for trajectory in done.trajectories:
        call = done.tasks[trajectory.task_id]
        a, b = call.payload["a"], call.payload["b"]
        kind = "equal lengths" if len(str(a)) == len(str(b)) else "unequal lengths"
        kind += f" L{call.level}" if args.by_level else ""
        seen[kind] += 1
        wrong[kind] += not audit(trajectory, call, harness, family).passed
    print(f"{'call':16} {'calls':>6} {'right':>6} {'share':>6}")
    for kind in sorted(seen):
        print(f"{kind:16} {seen[kind]:>6} {seen[kind] - wrong[kind]:>6} {1 - wrong[kind] / seen[kind]:>6.3f}")


if __name__ == "__main__":
    main()
