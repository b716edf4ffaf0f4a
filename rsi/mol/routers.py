"""Routers: one specialist per user turn, with a confidence; below the threshold the base model answers.

Routers are plug-ins registered by decorator (``@router("ngram")``), like rsi's parsers. Each learns from routing
examples, the user messages a specialist understands: tasks of its lineage's family rendered by its champion's
harness (``harness.prompt(task.payload)``), from the family's ``train`` split; ``rsi router eval`` measures on the
family's ``heldout`` split, which no router trains on (the splits share no task by construction, ``rsi.tasks``).

- ``ngram``: multinomial naive Bayes over character 1-3-grams (Laplace smoothing), in plain Python. Its confidence
  is the posterior of the best specialist times the share of the text's 1-2-grams seen in training, so a text
  of characters no specialist's examples have (small talk) falls back to the base.
- ``lora``: a route hop by the model itself: a small "router" LoRA adapter on a specialist base, trained with
  ``rsi.train`` on ``<text>|route:`` -> ``<name>``; routing scores log P(name | prompt) for each specialist name
  and takes the argmax; the softmax over the names is the confidence.

A trained router is a folder ``RSI_HOME/routers/<kind>`` holding ``router.json`` (kind, specialists, the digest
of its training examples, its own digest) and the kind's files.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from rsi import plugins
from rsi.errors import UserError
from rsi.hashing import digest

if TYPE_CHECKING:
    from rsi.mol.registry import Champion

ROUTE_SUFFIX = "|route:"
MANIFEST = "router.json"


class RoutingExample(BaseModel):
    model_config = ConfigDict(frozen=True)

    text: str
    specialist: str
    level: int
    task_id: str


class Route(BaseModel):
    """A routing decision: ``specialist`` None means the base model without adapter answers."""

    model_config = ConfigDict(frozen=True)

    specialist: str | None
    confidence: float
    scores: dict[str, float]
    router: str
    reason: str


class Router(Protocol):
    kind: ClassVar[str]
    decodes: ClassVar[bool]  # whether routing runs a model (the proxy then routes on a worker thread)
    names: tuple[str, ...]

    def fit(self, examples: Sequence[RoutingExample], champions: dict[str, Champion]) -> None: ...
    def save(self, folder: Path) -> None: ...
    def probabilities(self, texts: Sequence[str]) -> list[dict[str, float]]:
        """Per text, a confidence per specialist name (the best one's is the route's confidence)."""
        ...


def router(kind: str) -> Callable[[type], type]:
    """Register a router class under ``kind`` (``rsi.plugins`` kind "router"; another package's by entry point in
    ``rsi.routers``); it is built with no arguments, then fitted or loaded."""

    def register(cls: type) -> type:
        cls.kind = kind
        plugins.add("router", kind, cls)
        return cls

    return register


def get_router_class(kind: str) -> Callable[[], Router]:
    return plugins.get("router", kind)


# ---- routing examples ---------------------------------------------------------------------------------


def user_text(harness: Any, payload: dict[str, Any]) -> str:
    """The user message a harness writes for a task: the whole prompt in completion mode, the user message in
    chat mode (the system message is the harness's own)."""
    if harness.chat:
        return [m.content for m in harness.prompt_messages(payload) if m.role == "user"][-1]
    return harness.prompt(payload)


def routing_tasks(champion: Champion, split: Literal["train", "heldout"], per_level: int, seed: int = 0) -> list:
    """Tasks of a specialist's family at its levels (those its harness can pose), from ``split``."""
    from rsi.evaluate import expressible
    from rsi.splits import stream_seed
    from rsi.tasks import get_family

    family = get_family(champion.harness.document.family)
    levels = [lvl for lvl in champion.specialist.levels
              if family.min_level <= lvl <= family.max_level and expressible(champion.harness, family, lvl)]
    stream = stream_seed("heldout" if split == "heldout" else "rollout", seed, generation=-7)
    return [t for lvl in levels for t in family.tasks(split, stream, lvl, per_level)]


def routing_examples(champions: dict[str, Champion], split: Literal["train", "heldout"], per_level: int,
                     seed: int = 0) -> list[RoutingExample]:
    return [RoutingExample(text=user_text(c.harness, t.payload), specialist=name, level=t.level, task_id=t.id)
            for name, c in champions.items() for t in routing_tasks(c, split, per_level, seed)]


# ---- training, loading, routing -----------------------------------------------------------------------


def router_dir(home: Path, kind: str) -> Path:
    return Path(home) / "routers" / kind


def train_router(kind: str, champions: dict[str, Champion], home: Path, per_level: int = 32, seed: int = 0) -> dict:
    """Fit a router of ``kind`` on the specialists' train-split routing examples and save it; its manifest."""
    if len(champions) < 1:
        raise UserError("no specialist has a promoted champion; `rsi specialists add LINEAGE` a lineage with one")
    examples = routing_examples(champions, "train", per_level, seed)
    model = get_router_class(kind)()
    model.fit(examples, champions)
    folder = router_dir(home, kind)
    folder.mkdir(parents=True, exist_ok=True)
    model.save(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST)  # the adapter's too
    manifest = {"kind": kind, "names": list(model.names), "examples": len(examples),
                "examples_digest": digest([[e.text, e.specialist] for e in examples]),
                "digest": digest([[p.relative_to(folder).as_posix(), digest(p.read_bytes().hex())] for p in files])
                if files else ""}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def load_router(kind: str, home: Path) -> Router:
    folder = router_dir(home, kind)
    if not (folder / MANIFEST).is_file():
        raise UserError(f"no trained {kind!r} router at {folder}; run `rsi router train --kind {kind}`")
    model = get_router_class(kind)()
    model.load(folder)  # type: ignore[attr-defined]
    return model


def decide(model: Router, text: str, available: Sequence[str], threshold: float) -> Route:
    """Route one user message: the most probable specialist among ``available``, or the base when the
    confidence is below ``threshold`` or the router knows none of them."""
    probs = {k: v for k, v in model.probabilities([text])[0].items() if k in available}
    if not probs:
        return Route(specialist=None, confidence=0.0, scores={}, router=model.kind,
                     reason="the router knows none of the serving specialists; retrain it (`rsi router train`)")
    best = max(probs, key=probs.__getitem__)
    if probs[best] < threshold:
        return Route(specialist=None, confidence=probs[best], scores=probs, router=model.kind,
                     reason=f"confidence {probs[best]:.3f} below threshold {threshold}")
    return Route(specialist=best, confidence=probs[best], scores=probs, router=model.kind, reason="router")


# ---- the n-gram naive Bayes router --------------------------------------------------------------------


def ngrams(text: str, orders: Sequence[int] = (1, 2, 3)) -> list[str]:
    """The distinct character n-grams of a text, its start and end marked (each counted once: a run of zeros
    in a padded number would otherwise outweigh the one character that tells two formats apart)."""
    padded = f"\x02{text}\x03"
    return sorted({padded[i:i + n] for n in orders for i in range(len(padded) - n + 1)})


@router("ngram")
class NGramRouter:
    """Multinomial naive Bayes on character n-gram counts; the posterior scaled by the known-n-gram share."""

    kind: ClassVar[str]
    decodes: ClassVar[bool] = False

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.counts: dict[str, dict[str, int]] = {}
        self.priors: dict[str, float] = {}
        self._tables()

    def fit(self, examples: Sequence[RoutingExample], champions: dict[str, Any]) -> None:
        self.names = tuple(sorted({e.specialist for e in examples}))
        per_class = {name: Counter() for name in self.names}
        for e in examples:
            per_class[e.specialist].update(ngrams(e.text))
        self.counts = {name: dict(sorted(c.items())) for name, c in per_class.items()}
        total = len(examples)
        self.priors = {name: sum(e.specialist == name for e in examples) / total for name in self.names}
        self._tables()

    def _tables(self) -> None:
        """What every turn's routing reads, computed once per fit or load: the vocabulary, and per specialist
        the log-probability of each n-gram it has seen and of an unseen one (Laplace smoothing)."""
        self.vocab = set().union(*self.counts.values()) if self.counts else set()
        self.logp: dict[str, dict[str, float]] = {}
        self.unseen: dict[str, float] = {}
        for name, counts in self.counts.items():
            denominator = sum(counts.values()) + len(self.vocab) + 1
            self.logp[name] = {g: math.log((c + 1) / denominator) for g, c in counts.items()}
            self.unseen[name] = math.log(1 / denominator)

    def save(self, folder: Path) -> None:
        (folder / "ngram.json").write_text(json.dumps({"names": self.names, "priors": self.priors,
                                                       "counts": self.counts}, sort_keys=True))

    def load(self, folder: Path) -> None:
        data = json.loads((folder / "ngram.json").read_text())
        self.names, self.priors, self.counts = tuple(data["names"]), data["priors"], data["counts"]
        self._tables()

    def probabilities(self, texts: Sequence[str]) -> list[dict[str, float]]:
        out = []
        for text in texts:
            grams = ngrams(text)
            short = [g for g in grams if len(g) <= 2]  # a fit measure that digit trigrams seen by chance do not sway
            known = sum(g in self.vocab for g in short) / len(short)
            logp = {name: math.log(self.priors[name]) + sum(self.logp[name].get(g, self.unseen[name]) for g in grams)
                    for name in self.names}
            top = max(logp.values())
            z = sum(math.exp(v - top) for v in logp.values())
            out.append({name: known * math.exp(v - top) / z for name, v in logp.items()})
        return out


# ---- the route-adapter router ---------------------------------------------------------------------------


@router("lora")
class LoraRouter:
    """A LoRA adapter trained to write the specialist's name after ``<text>|route:``; routes by comparing
    log P(name | prompt) over the names (constrained choice), softmax as confidence."""

    kind: ClassVar[str]
    decodes: ClassVar[bool] = True
    steps = 60
    batch_size = 16

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.base_dir: Path | None = None
        self.folder: Path | None = None
        self._model = None
        self._tokenizer = None

    def fit(self, examples: Sequence[RoutingExample], champions: dict[str, Any]) -> None:
        self.names = tuple(sorted({e.specialist for e in examples}))
        self.base_dir = champions[self.names[0]].base_dir  # the router hops on one base: the first specialist's
        self._examples = examples

    def save(self, folder: Path) -> None:
        from rsi.select import Dataset, Example
        from rsi.train import TrainSpec, train_adapter

        data = Dataset(examples=tuple(Example(trajectory_id=e.task_id, level=e.level, prompt=e.text + ROUTE_SUFFIX,
                                              completion=e.specialist, source="frontier") for e in self._examples))
        spec = TrainSpec(steps=self.steps, batch_size=self.batch_size, warmup=4, lr=1e-2, lora_r=8, lora_alpha=16)
        train_adapter(self.base_dir, None, data, spec, folder / "adapter", seed=0)
        (folder / "lora.json").write_text(json.dumps({"names": self.names, "base_dir": str(self.base_dir)}))

    def load(self, folder: Path) -> None:
        data = json.loads((folder / "lora.json").read_text())
        self.names, self.base_dir, self.folder = tuple(data["names"]), Path(data["base_dir"]), folder

    def _ready(self) -> None:
        if self._model is not None:
            return
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.base_dir, local_files_only=True)
        base = AutoModelForCausalLM.from_pretrained(self.base_dir, local_files_only=True).float().eval()
        self._model = PeftModel.from_pretrained(base, str(self.folder / "adapter")).eval()

    def probabilities(self, texts: Sequence[str]) -> list[dict[str, float]]:
        import torch

        self._ready()
        tok, out = self._tokenizer, []
        for text in texts:
            prompt = tok(text + ROUTE_SUFFIX)["input_ids"]
            rows = [prompt + tok(name, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for name in self.names]
            width = max(map(len, rows))
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # after each row: unread
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
            with torch.inference_mode():
                logp = torch.log_softmax(self._model(input_ids=ids).logits.float(), dim=-1)
            scores = []
            for i, row in enumerate(rows):  # sum of log P(token) over the name and its EOS
                targets = torch.tensor(row[len(prompt):])
                positions = torch.arange(len(prompt) - 1, len(row) - 1)
                scores.append(logp[i, positions, targets].sum().item())
            probs = torch.softmax(torch.tensor(scores), dim=0).tolist()
            out.append(dict(zip(self.names, probs)))
        return out


def timed_routes(model: Router, texts: Sequence[str], available: Sequence[str], threshold: float
                 ) -> tuple[list[Route], list[float]]:
    """Routes of ``texts`` one at a time (as the proxy routes) and the seconds each took; one untimed route
    first, so a model's lazy load (the lora router's) is not counted as routing time."""
    routes, seconds = [], []
    if texts:
        decide(model, texts[0], available, threshold)
    for text in texts:
        started = time.perf_counter()
        routes.append(decide(model, text, available, threshold))
        seconds.append(time.perf_counter() - started)
    return routes, seconds
