"""A task family that lives outside rsi, as another package would ship one: ``parity`` (is the number of 1s in a
bit string odd?), with its own answer parser (``yes_no``) and harness proposer (``parity``). ``tests/test_plugins.py``
installs it as a throwaway distribution whose entry points (``rsi.families``, ``rsi.parsers``, ``rsi.proposers``)
are all that tells rsi about it: no file of rsi names it."""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import BaseModel

from rsi.parsers import Parsed, ParserSpec
from rsi.proposers import Proposal, variant
from rsi.tasks import TaskFamily


def make(rng: random.Random, level: int) -> tuple[dict[str, Any], Any]:
    bits = "".join(rng.choice("01") for _ in range(level))
    return {"bits": bits}, bits.count("1") % 2 == 1


family = TaskFamily(name="parity", version="1", description="is the number of 1s in a bit string of n bits odd?",
                    make=make, verify=lambda task, answer: answer is task.answer, max_level=64,
                    solve=lambda payload: payload["bits"].count("1") % 2 == 1,
                    level_of=lambda payload: len(payload["bits"]))


class NoParams(BaseModel):
    pass


def parse_yes_no(text: str) -> Parsed:
    m = re.match(r"(yes|no)\b", text)
    if m is None:
        return Parsed(ok=False, error=f"expected 'yes' or 'no', got {text[:20]!r}")
    return Parsed(ok=True, value=m.group() == "yes", extra=text[m.end():])


yes_no = ParserSpec(parse_yes_no, NoParams)


def propose(harness, space: dict[str, list], evidence=None) -> list[Proposal]:
    """The harness with each question of the space as its prompt's wording."""
    return [variant(harness, f"q{i}", f"asks {question!r}", {"prompt.vars": {"question": question}})
            for i, question in enumerate(space.get("question", []))]


def longest(attempts: list, spec: Any) -> list:
    """A selection policy: the passed attempt with the longest completion, one per task."""
    passed = [c for c in attempts if c.passed]
    return [max(passed, key=lambda c: len(c.completion))] if passed else []


# The family's profile: what `rsi run parity` runs under (a harness of its own is given on the command line).
profile = {"family": "parity", "target_level": 8, "curriculum": {"rule": "plus_one", "max_level": 8},
           "harness_search": {"proposers": ["parity"], "space": {"question": ["odd?"]}}}


class Pretraining:
    """How rsi's built-in base learns parity (plugin kind ``pretraining``): the text ``<bits>=`` then ``y`` or ``n``,
    the loss on the answer and EOS, no harness; measured as greedy accuracy on held-out strings per level."""

    harness = False

    def check(self, r: Any) -> None:
        if r.max_position_embeddings < max(r.train_levels) + 4:
            raise ValueError("max_position_embeddings shorter than one parity example")

    def rows(self, split: str, r: Any, level: int, n: int) -> tuple[Any, Any]:
        """(ids, labels) of ``n`` tasks of ``level``: BOS, the bits, ``=``, the answer, EOS."""
        import torch

        from rsi.basemodel import BOS_ID, EOS_ID, VOCAB

        tasks = family.tasks(split, r.seed, level, n)
        ids = torch.tensor([[BOS_ID, *[VOCAB.index(c) for c in t.payload["bits"] + "=" + "ny"[t.answer]], EOS_ID]
                            for t in tasks])
        labels = torch.full_like(ids, -100)
        labels[:, -2:] = ids[:, -2:]
        return ids, labels

    def batches(self, r: Any):
        rng = random.Random(r.seed)
        for _ in range(r.steps):
            yield self.rows("train", r, rng.choices(r.train_levels, r.level_weights)[0], r.batch_size)

    def loss(self, model: Any, batch: Any, r: Any) -> tuple[Any, int]:
        import torch.nn.functional as F

        ids, labels = batch
        logits = model(input_ids=ids[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)), ids.numel()

    def measure(self, model: Any, model_dir: Any, r: Any, n: int) -> tuple[dict[int, float], dict[int, float]]:
        import torch

        accuracy = {}
        for level in r.train_levels:
            ids, _ = self.rows("heldout", r, level, n)
            with torch.inference_mode():
                guess = model(input_ids=ids[:, :-2]).logits[:, -1].argmax(-1)
            accuracy[level] = float((guess == ids[:, -2]).float().mean())
        return accuracy, {}


pretraining = Pretraining()
