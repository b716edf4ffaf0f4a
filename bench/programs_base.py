"""Research: what does the programs base learn from runs written out, and from runs written at more lengths?

The ``programs`` lineage can learn a level only where its champion is right sometimes (``selection.band``): a
base right on levels 1-2 and on nothing above gives the loop nothing to learn from. This script builds the
programs base three ways, each from the profile's recipe with one thing changed, and scores each on the test split,
greedy, ``--n`` tasks a level, levels 1..``--max-level`` (the selfplay bench's suite):

- ``v1``: the profile's base (harness ``programs/v1``: the output at once);
- ``v2``: harness ``programs/v2`` (the run worked out state by state, ``programs.worked``), context 1,024;
- ``v2-rewrites``: as ``v2``, each demonstration's program padded with k no-op pairs (``pad`` below, k drawn
  from 0..``--rewrites`` per task): the same programs, levels, splits and answers, written at more lengths.

``pad`` lives here, not in the family, while it is an experiment: no profile builds such a base yet (the
lineage's training does not yet promote on it, see the README). It reaches the build by wrapping
``rsi.basemodel._demonstrations`` (``rewritten``); the held-out measurement inside the build and the test
scores here read the family's own tasks. Each build's CPU-seconds (this process) are recorded with its scores.

    .venv/bin/python bench/programs_base.py [--arms v1,v2,v2-rewrites] [--rewrites 3] [--n 64] [--max-level 12]
        [--out bench/results/programs-base.json]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import resource
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)

V2 = {"harness": "programs/v2", "max_position_embeddings": 1024}
# pairs of tokens that leave the stack as it was (the ones programs.canonical removes)
NO_OPS = (("dup", "drop"), ("over", "drop"), ("swap", "swap"), ("x", "drop"), (None, "drop"), (0, "add"),
          (0, "sub"), (1, "mul"), (1, "div"))


def pad(rng: random.Random, payload: dict[str, Any], k: int) -> dict[str, Any]:
    """``payload``'s program with ``k`` no-op pairs (``NO_OPS``; None: a literal 0..9) inserted at random places
    after its first token: the same output on every input and the same canonical program, so the same level and
    split; its run is ``k`` or more steps longer. A program with jumps (whose targets an insertion would move) or
    at the token limit comes back as it is."""
    from rsi.task_generators import programs

    tokens = payload["program"].split()
    if any(":" in t for t in tokens):
        return payload
    want = programs.canonical(payload["program"])
    for _ in range(k):
        if len(tokens) + 2 > programs.MAX_TOKENS:
            break
        for _ in range(32):  # a pair that needs two values does not fit where the stack holds one: draw again
            first, second = rng.choice(NO_OPS)
            at = rng.randint(1, len(tokens))
            tried = [*tokens[:at], str(rng.randint(0, 9) if first is None else first), second, *tokens[at:]]
            text = " ".join(tried)
            if programs.run(text, payload["input"]).output is not None and programs.canonical(text) == want:
                tokens = tried
                break
    return {**payload, "program": " ".join(tokens)}


@contextlib.contextmanager
def rewritten(k: int) -> Iterator[None]:
    """While open, the base's demonstrations (``rsi.basemodel._demonstrations``) draw the programs family's tasks
    padded by ``pad`` (k from 0..``k`` per task); every other draw of the family is its own."""
    import rsi.basemodel as basemodel
    from rsi.task_generators import programs

    family, make, demonstrations = programs.family, programs.family.make, basemodel._demonstrations

    def padded(rng: random.Random, level: int) -> tuple[dict[str, Any], Any]:
        payload, answer = make(rng, level)
        return pad(rng, payload, rng.randint(0, k)), answer

    def padded_demonstrations(r):
        object.__setattr__(family, "make", padded)  # a frozen dataclass: the family's own draw, swapped for the call
        try:
            return demonstrations(r)
        finally:
            object.__setattr__(family, "make", make)

    basemodel._demonstrations = padded_demonstrations
    try:
        yield
    finally:
        basemodel._demonstrations = demonstrations


def recipe(arm: str):
    from rsi.basemodel import BaseRecipe
    from rsi.run import load_config

    mine = dict(load_config("programs").base_recipe)
    return BaseRecipe(**(mine if arm == "v1" else mine | V2))


def cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def measure(arm: str, rewrites: int, levels: list[int], n: int, out: Path) -> dict:
    from rsi.backends.hf import HFBackend
    from rsi.basemodel import train_base
    from rsi.evaluate import evaluate
    from rsi.hcp import load_harness
    from rsi.pair import Responder
    from rsi.tasks import get_family

    r, k = recipe(arm), rewrites if arm == "v2-rewrites" else 0
    start = cpu_s()
    with rewritten(k) if k else contextlib.nullcontext():
        train_base(r, out)
    built = cpu_s() - start
    backend = HFBackend(out)
    try:
        pair = Responder(load_harness(r.harness), backend, f"pair-{arm}", family=get_family(r.family))
        scores = evaluate(pair, levels, n, split="test")
    finally:
        backend.close()
    test = {s.level: s.accuracy for s in scores}
    row = {"arm": arm, "harness": r.harness, "rewrites": k, "recipe_digest": r.digest(),
           "build_cpu_s": round(built, 1), "test": test, "mean": sum(test.values()) / len(test)}
    print(f"{arm:12} build {built:7.0f} CPU-s  mean {row['mean']:.3f}  " +
          " ".join(f"L{lv} {acc:.2f}" for lv, acc in test.items()), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default="v1,v2,v2-rewrites")
    ap.add_argument("--rewrites", type=int, default=3)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-level", type=int, default=12)
    ap.add_argument("--out", default=str(REPO / "bench/results/programs-base.json"))
    args = ap.parse_args()
    levels = list(range(1, args.max_level + 1))
    rows = []
    with tempfile.TemporaryDirectory(prefix="rsi-programs-base-") as tmp:
        for arm in args.arms.split(","):
            rows.append(measure(arm, args.rewrites, levels, args.n, Path(tmp) / arm))
    write_result(args.out, {"command": "python bench/programs_base.py " + " ".join(sys.argv[1:]), "split": "test",
                            "levels": levels, "n": args.n, "arms": rows}, run_config(args))


if __name__ == "__main__":
    main()
