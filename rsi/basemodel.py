"""Built-in base model: a tiny Llama-architecture causal LM trained from scratch on reverse addition.

Pretraining draws only operand pairs of the ``addition`` family's ``train`` split (``rsi.tasks``), so no
held-out or test task is ever seen by the base; ``pretraining_pairs`` replays that stream for checks.

Task format (fixed width ``W``): ``prompt = A + "+" + B + "="`` with both operands written least-significant
digit first and zero-padded to ``W`` digits; ``completion`` = the sum, least-significant digit first, padded to
``W + 1`` digits, then EOS. Level ``n`` = both operands have ``n`` random digits (leading digit nonzero for
``n > 1``). Loss is on completion tokens and EOS only. The tokenizer is character level over printable ASCII
(plus ``<pad> <eos> <bos> <unk>``) and prepends ``<bos>`` itself.

A tool family's base trains on its expert episodes instead (``BaseRecipe.family``), and one base may train on
several families (``BaseRecipe.also``), so that several lineages' champions share one frozen base: each family's
batches built and their loss taken as for a base of that family alone, interleaved evenly under one LR schedule.

Heavy imports (torch, transformers, tokenizers) happen inside functions so that importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

FORMAT_VERSION = "rsi-base-addrev-v2"  # v2: pretraining draws only train-split operand pairs
PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK)
PRINTABLE: tuple[str, ...] = tuple(chr(c) for c in range(32, 127))
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + PRINTABLE
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
DIGIT0_ID = VOCAB.index("0")
PLUS_ID = VOCAB.index("+")
EQ_ID = VOCAB.index("=")
RECIPE_FILE = "rsi_recipe.json"
MODEL_FILES: tuple[str, ...] = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a Hugging Face base's chat template (the built-in model has none)
_EVAL_STREAM = 0x5EED_E7A1  # eval tasks come from a seed stream disjoint from training's
_TRAIN_STREAM = 0x7EA1_0001


class FamilyPart(pydantic.BaseModel, frozen=True):
    """One more family a joint base is pretrained on (``BaseRecipe.also``): the fields that differ per family,
    as ``BaseRecipe`` describes them for its own, and the optimizer steps its batches get."""

    model_config = pydantic.ConfigDict(extra="forbid")

    family: str
    harness: str | None = None
    mistakes: float = pydantic.Field(0.0, ge=0.0, lt=1.0)
    train_levels: tuple[int, ...]
    level_weights: tuple[float, ...]
    steps: int = pydantic.Field(ge=1, description="optimizer steps on this family's batches")

    @pydantic.model_validator(mode="after")
    def _check(self) -> FamilyPart:
        _check_family(self)
        return self


def _check_family(p: FamilyPart | BaseRecipe) -> None:
    """The checks a family's fields pass, the recipe's own family and each ``also`` part alike."""
    if len(p.level_weights) != len(p.train_levels):
        raise ValueError("level_weights must have one weight per entry of train_levels")
    if any(w < 0 for w in p.level_weights) or sum(p.level_weights) <= 0:
        raise ValueError("level_weights must be >= 0 with a positive sum")
    if (p.family == "addition") != (p.harness is None):
        raise ValueError("a tool family's base is trained on its episodes under a harness: set harness for a "
                         "family other than addition, and only then")


class BaseRecipe(pydantic.BaseModel, frozen=True):
    """Every knob that changes the base model's weights."""

    model_config = pydantic.ConfigDict(extra="forbid")

    family: str = pydantic.Field("addition", description=(
        "the task family the base is pretrained on: 'addition' (its fixed-width text, the original recipe), or a "
        "tool family, whose expert demonstrations of train-split tasks are played as episodes under ``harness``"))
    harness: str | None = pydantic.Field(None, description="a tool family's harness (id or directory): the transcripts")
    mistakes: float = pydantic.Field(0.0, ge=0.0, lt=1.0, description=(
        "a tool family's demonstrations: the chance per turn that the expert makes a mistake it then recovers "
        "from (noise injection, as in DART). Without it every level-n episode says 'done' after exactly n calls "
        "and the base learns to count turns, not to look at the state"))
    also: tuple[FamilyPart, ...] = pydantic.Field((), description=(
        "more families for one joint base (several lineages' champions on one frozen base): each part's batches "
        "get its own steps, interleaved evenly with the recipe's own family's under one LR schedule"))
    width: int = 10
    train_levels: tuple[int, ...] = (1, 2, 3)
    level_weights: tuple[float, ...] = (1.0, 2.0, 4.0)  # sampling weights, hardest level most
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256
    tie_embeddings: bool = False
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    batch_size: int = 128
    steps: int = 1500
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0
    init_std: float = 0.02
    seed: int = 0

    @pydantic.model_validator(mode="after")
    def _check(self) -> BaseRecipe:
        _check_family(self)
        for r in self.families():
            if not r.train_levels or any(not 1 <= lv <= self.width for lv in r.train_levels):
                raise ValueError(f"{r.family}: train_levels must be non-empty and within 1..width={self.width}")
        if self.d_model % self.n_heads or self.d_model // self.n_heads not in (32, 64):
            raise ValueError("d_model / n_heads (head_dim) must be 32 or 64 (vLLM CPU constraint)")
        names = [r.family for r in self.families()]
        if len(set(names)) < len(names):
            raise ValueError(f"also: each family once (got {names}); put all of a family's levels in one part")
        if self.max_position_embeddings < seq_len(self.width):
            raise ValueError("max_position_embeddings shorter than one example")
        return self

    @property
    def total_steps(self) -> int:
        """Optimizer steps over all families: the recipe's own and each ``also`` part's."""
        return self.steps + sum(p.steps for p in self.also)

    def families(self) -> tuple[BaseRecipe, ...]:
        """One single-family recipe per family the base is pretrained on, the recipe's own first: each builds
        and measures that family's batches as a base of that family alone would (``steps`` its share)."""
        parts = [self.model_copy(update={**p.model_dump(), "also": ()}) for p in self.also]
        return (self.model_copy(update={"also": ()}), *parts)

    def trained_levels(self, family: str) -> tuple[int, ...]:
        """The levels the base is pretrained on in ``family``; for a family it is not pretrained on (a lineage
        may start from another family's base), the recipe's own ``train_levels``."""
        return next((r.train_levels for r in self.families() if r.family == family), self.train_levels)

    def digest(self) -> str:
        """First 16 hex chars of sha256 over the canonical JSON of the recipe plus FORMAT_VERSION."""
        data = self.model_dump(mode="json")
        # fields added later: bases built before them keep their digest
        if self.harness is None:
            del data["family"], data["harness"], data["mistakes"]
        if not self.also:
            del data["also"]
        canon = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256((FORMAT_VERSION + "\n" + canon).encode()).hexdigest()[:16]


def seq_len(width: int) -> int:
    """Tokens in one full example: BOS + prompt (2W+2) + completion (W+1) + EOS."""
    return 1 + (2 * width + 2) + (width + 1) + 1


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer over printable ASCII; adds ``<bos>`` in front of every sequence."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def format_example(a: int, b: int, width: int) -> tuple[str, str]:
    """(prompt, completion without EOS) for ``a + b`` in reverse, fixed-width form."""
    if a < 0 or b < 0 or a >= 10**width or b >= 10**width:
        raise ValueError(f"operands must be in [0, 10**{width})")
    rev = lambda x, n: str(x).zfill(n)[::-1]  # noqa: E731
    return f"{rev(a, width)}+{rev(b, width)}=", rev(a + b, width + 1)


def _draw_digits(rng: np.random.Generator, level: int, n: int, width: int) -> np.ndarray:
    import numpy as np

    d = np.zeros((n, width), dtype=np.int64)
    d[:, :level] = rng.integers(0, 10, size=(n, level))
    if level > 1:
        d[:, level - 1] = rng.integers(1, 10, size=n)
    return d


def digits_to_int(d: np.ndarray) -> list[int]:
    """Rows of least-significant-first digits -> Python ints."""
    return [int("".join(map(str, row[::-1])) or "0") for row in d.tolist()]


def sample_operands(rng: np.random.Generator, level: int, n: int, width: int,
                    split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Two (n, width) digit arrays, least-significant digit first, for ``level``-digit operands whose pair
    lies in ``split`` of the addition family (draws of other splits are rejected and drawn again)."""
    import numpy as np

    from rsi.tasks import get_family

    family = get_family("addition")
    kept_a, kept_b, need = [], [], n
    while need:
        a, b = _draw_digits(rng, level, need, width), _draw_digits(rng, level, need, width)
        keep = np.array([family.split_of({"a": x, "b": y}) == split
                         for x, y in zip(digits_to_int(a), digits_to_int(b))], dtype=bool)
        kept_a.append(a[keep])
        kept_b.append(b[keep])
        need -= int(keep.sum())
    return np.concatenate(kept_a), np.concatenate(kept_b)


def _add_digits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    import numpy as np

    n, w = a.shape
    s = np.zeros((n, w + 1), dtype=np.int64)
    carry = np.zeros(n, dtype=np.int64)
    for i in range(w):
        t = a[:, i] + b[:, i] + carry
        s[:, i], carry = t % 10, t // 10
    s[:, w] = carry
    return s


def _encode_batch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Token ids [n, seq_len] for BOS + prompt + completion + EOS (matches build_tokenizer's ids)."""
    import numpy as np

    n, _ = a.shape
    cols = [
        np.full((n, 1), BOS_ID), a + DIGIT0_ID, np.full((n, 1), PLUS_ID), b + DIGIT0_ID,
        np.full((n, 1), EQ_ID), _add_digits(a, b) + DIGIT0_ID, np.full((n, 1), EOS_ID),
    ]
    return np.concatenate(cols, axis=1).astype(np.int64)


def _pretraining_batches(r: BaseRecipe):
    """The base's training stream: per step, (a, b) digit arrays of train-split pairs, levels by weight."""
    import numpy as np

    rng = np.random.default_rng([_TRAIN_STREAM, r.seed])
    probs = np.asarray(r.level_weights, dtype=np.float64) / sum(r.level_weights)
    for _ in range(r.steps):
        counts = rng.multinomial(r.batch_size, probs)
        parts = [sample_operands(rng, lv, int(c), r.width) for lv, c in zip(r.train_levels, counts) if c]
        yield np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])


def _demonstrations(r: BaseRecipe) -> dict[int, list[tuple[list[int], list[int]]]]:
    """Per train level, the (input ids, labels) of the family's expert episodes of every distinct train-split
    task drawn (up to 4,096 a level): the transcript under the recipe's harness, the loss on the assistant turns
    and their EOS only (``rsi.pair.text.segments``), not on the expert's mistakes (``BaseRecipe.mistakes``)."""
    from rsi.hcp.plays import demonstration
    from rsi.pair.text import segments
    from rsi.hcp import load_harness
    from rsi.tasks import get_family

    harness, family, tok = load_harness(r.harness), get_family(r.family), build_tokenizer()
    pools: dict[int, list[tuple[list[int], list[int]]]] = {}
    for level in r.train_levels:
        rows = []
        for task in family.tasks("train", r.seed, level, 4096):
            ids, labels = [BOS_ID], [-100]
            demo = demonstration(harness, family, task, r.mistakes)
            for k, (text, trained) in enumerate(segments(demo.messages, EOS)):
                trained = trained and k not in demo.mistaken
                piece = tok(text, add_special_tokens=False)["input_ids"]
                ids += piece
                labels += piece if trained else [-100] * len(piece)
            if len(ids) > r.max_position_embeddings:
                raise ValueError(f"a level-{level} demonstration takes {len(ids)} tokens > max_position_embeddings")
            rows.append((ids, labels))
        pools[level] = rows
    return pools


def _episode_batches(r: BaseRecipe):
    """A tool family's training stream: per step, (ids, labels) tensors of demonstrations, levels by weight,
    right-padded (labels -100 on padding)."""
    import numpy as np
    import torch

    pools = _demonstrations(r)
    rng = np.random.default_rng([_TRAIN_STREAM, r.seed])
    probs = np.asarray(r.level_weights, dtype=np.float64) / sum(r.level_weights)
    for _ in range(r.steps):
        counts = rng.multinomial(r.batch_size, probs)
        rows = [pools[lv][int(i)] for lv, c in zip(r.train_levels, counts) for i in rng.integers(0, len(pools[lv]), c)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for k, (x, y) in enumerate(rows):
            ids[k, : len(x)], labels[k, : len(y)] = torch.tensor(x), torch.tensor(y)
        yield ids, labels


def pretraining_pairs(r: BaseRecipe):
    """Every (a, b) the base trains on, in order (replays the stream; no model is built)."""
    for a, b in _pretraining_batches(r):
        yield from zip(digits_to_int(a), digits_to_int(b))


def _eval_rng(seed: int, level: int):
    import numpy as np

    return np.random.default_rng([_EVAL_STREAM, seed, level])


def _build_model(r: BaseRecipe) -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=r.d_model,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.n_layers,
        num_attention_heads=r.n_heads,
        num_key_value_heads=r.n_heads,
        head_dim=r.d_model // r.n_heads,
        max_position_embeddings=r.max_position_embeddings,
        rope_theta=r.rope_theta,
        initializer_range=r.init_std,
        tie_word_embeddings=r.tie_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def train_base(
    recipe: BaseRecipe,
    out_dir: Path,
    progress: Callable[[int, int, float], None] | None = None,
    eval_n: int = 256,
    num_threads: int | None = None,
) -> dict[int, float]:
    """Train the base model, write it (HF format + tokenizer + rsi_recipe.json) atomically to ``out_dir``.

    Returns greedy exact-match accuracy per trained level on held-out tasks. ``num_threads`` (default: torch's
    own, i.e. the physical cores) does not change the weights on CPU.
    """
    import torch

    prev = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        return _train_base(recipe, Path(out_dir), progress, eval_n)
    finally:
        torch.set_num_threads(prev)


def interleave(steps: Sequence[int]) -> list[int]:
    """Which stream each global step trains on: the one furthest behind in the fraction of its own steps done
    (ties: the earlier one), so each stream gets exactly its steps, spread evenly over the whole schedule."""
    done = [0] * len(steps)
    order = []
    for _ in range(sum(steps)):
        k = min((i for i, n in enumerate(steps) if done[i] < n), key=lambda i: Fraction(done[i], steps[i]))
        done[k] += 1
        order.append(k)
    return order


def _train_base(
    recipe: BaseRecipe, out_dir: Path, progress: Callable[[int, int, float], None] | None, eval_n: int
) -> dict[int, float]:
    import torch
    from transformers import GenerationConfig

    from rsi.train import lr_at

    t_start = time.perf_counter()
    r = recipe
    torch.manual_seed(r.seed)
    model = _build_model(r)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": r.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=r.lr, betas=(r.beta1, r.beta2), eps=1e-8,
    )
    families = r.families()
    streams = [_episode_batches(f) if f.family != "addition" else _pretraining_batches(f) for f in families]
    schedule = r.model_copy(update={"steps": r.total_steps})  # one LR schedule over every family's steps
    t0 = time.perf_counter()
    loss_val = float("nan")
    tokens = 0
    for step, k in enumerate(interleave([f.steps for f in families])):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, schedule)
        loss, read = _batch_loss(model, next(streams[k]), families[k])
        tokens += read
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if r.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        loss_val = float(loss.detach())
        if progress is not None:
            progress(step + 1, r.total_steps, loss_val)
    train_s = time.perf_counter() - t0
    model.eval()
    tok = build_tokenizer()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False,
            max_new_tokens=r.width + 2,
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _portable_tokenizer_config(tmp)
        t1 = time.perf_counter()
        (greedy, pass8), *parts = [_measure(model, tmp, f, eval_n) for f in families]
        acc = {lv: greedy[lv] for lv in r.train_levels}
        eval_s = time.perf_counter() - t1
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "digest": r.digest(),
            "recipe": r.model_dump(mode="json"),
            "final_loss": loss_val,
            "train_seconds": round(train_s, 2),
            "torch_threads": torch.get_num_threads(),
            "eval_seconds": round(eval_s, 2),
            "train_tokens_per_s": round(tokens / train_s, 1),
            "build_seconds": round(time.perf_counter() - t_start, 2),
            **_scores(greedy, pass8),
            "eval_n": eval_n,
        }
        if parts:
            meta["also"] = [{"family": f.family, **_scores(*scores)} for f, scores in zip(families[1:], parts)]
        (tmp / RECIPE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        for p in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700; others (e.g. a vLLM server) must read it
            p.chmod(0o755 if p.is_dir() else 0o644)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return acc


def _batch_loss(model: PreTrainedModel, batch: Any, r: BaseRecipe) -> tuple[torch.Tensor, int]:
    """One batch's loss as its family trains, and the tokens read: a tool family's episodes with the loss on the
    assistant turns (their labels), addition's fixed-width text with the loss on the answer positions only."""
    import torch
    import torch.nn.functional as F

    if r.family != "addition":
        ids, labels = batch
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
    else:
        p0 = 1 + 2 * r.width + 2  # index of first completion token
        ids = torch.from_numpy(_encode_batch(*batch))
        hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state[:, p0 - 1 :]
        logits = model.lm_head(hidden)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, p0:].reshape(-1))
    return loss, ids.shape[0] * (ids.shape[1] - 1)


def _measure(model: PreTrainedModel, model_dir: Path, r: BaseRecipe,
             n: int) -> tuple[dict[int, float], dict[int, float]]:
    """A single-family recipe's greedy accuracy per level (trained levels and two above) and pass@8 one level
    above, on held-out tasks, measured as its family is: a tool family's as episodes, addition's as text."""
    if r.family != "addition":
        return _evaluate_episodes(model_dir, r, n)
    top = max(r.train_levels)
    report_levels = sorted(set(r.train_levels) | {lv for lv in (top + 1, top + 2) if lv <= r.width})
    greedy = _evaluate(model, r.width, report_levels, n, seed=r.seed)
    beyond = [lv for lv in (top + 1,) if lv <= r.width]
    return greedy, _evaluate(model, r.width, beyond, n, seed=r.seed, k=8, temperature=1.0)


def _scores(greedy: dict[int, float], pass8: dict[int, float]) -> dict[str, dict[str, float]]:
    """A family's measurements as rsi_recipe.json keeps them (levels as strings: JSON keys)."""
    return {"greedy": {str(k): v for k, v in greedy.items()}, "pass_at_8": {str(k): v for k, v in pass8.items()}}


def _evaluate_episodes(model_dir: Path, r: BaseRecipe, n: int) -> tuple[dict[int, float], dict[int, float]]:
    """A tool family's base, measured as the cycle measures it: greedy episodes (and pass@8 one level above the
    trained ones) on held-out tasks under the recipe's harness, each audited."""
    from rsi.backends.hf import HFBackend
    from rsi.evaluate import evaluate
    from rsi.hcp import load_harness
    from rsi.pair import Responder
    from rsi.tasks import get_family

    harness, family = load_harness(r.harness), get_family(r.family)
    top = max(r.train_levels)
    levels = sorted(set(r.train_levels) | {lv for lv in (top + 1, top + 2) if lv <= family.max_level})
    backend = HFBackend(model_dir)
    try:
        pair = Responder(harness, backend, "pair-base", family=family)
        greedy = evaluate(pair, levels, n, lineage_seed=r.seed)
        beyond = [lv for lv in (top + 1,) if lv <= family.max_level]
        pass8 = evaluate(pair, beyond, n, lineage_seed=r.seed, k=8)
    finally:
        backend.close()
    return {s.level: s.accuracy for s in greedy}, {s.level: s.accuracy for s in pass8}


def _portable_tokenizer_config(d: Path) -> None:
    """Name the generic fast-tokenizer class so older transformers (e.g. in a vLLM venv) load it too."""
    p = d / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory ``src`` onto ``dst``, replacing an existing one."""
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def base_dir_for(settings: Any, recipe: BaseRecipe) -> Path:
    """Where ``ensure_base`` keeps the base built from ``recipe``: ``<RSI_HOME>/models/base-<digest>``."""
    return Path(settings.home) / "models" / f"base-{recipe.digest()}"


_BUILT_HERE: set[str] = set()


def ensure_base(
    settings: Any,
    recipe: BaseRecipe,
    *,
    force: bool = False,
    progress: Callable[[int, int, float], None] | None = None,
) -> Path:
    """The cached base model for ``recipe`` under ``settings.home``; trains it first if missing or ``force``."""
    path = base_dir_for(settings, recipe)
    if force or not _is_complete(path, recipe):
        train_base(recipe, path, progress)
        _BUILT_HERE.add(str(path.resolve()))
    return path


def _is_complete(path: Path, recipe: BaseRecipe) -> bool:
    try:
        meta = json.loads((path / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("digest") == recipe.digest() and all((path / f).is_file() for f in MODEL_FILES)


def base_report(model_dir: Path) -> dict[str, Any]:
    """What the build measured (rsi_recipe.json) plus ``cached``: False only if built by this process."""
    meta = json.loads((Path(model_dir) / RECIPE_FILE).read_text())
    meta["cached"] = str(Path(model_dir).resolve()) not in _BUILT_HERE
    return meta


def model_hash(model_dir: Path) -> str:
    """Identity of a saved base: weights, config and tokenizer files (not the build report, which has timings)."""
    from rsi.hashing import digest_bytes

    files = [Path(model_dir) / name for name in (*MODEL_FILES, CHAT_TEMPLATE_FILE)]
    return digest_bytes([(f.name, f.read_bytes()) for f in files if f.is_file()])


def read_recipe(model_dir: Path) -> BaseRecipe:
    """The recipe a saved base model was trained with."""
    meta = json.loads((Path(model_dir) / RECIPE_FILE).read_text())
    return BaseRecipe.model_validate(meta["recipe"])


def _generate(model: PreTrainedModel, prompt_ids: torch.Tensor, max_new: int, temperature: float,
              gen: torch.Generator | None) -> torch.Tensor:
    """Batched KV-cached decoding of equal-length prompts; returns [n, max_new] new token ids."""
    import inspect

    import torch
    from transformers import DynamicCache

    # transformers >= 5.24 renamed the forward argument ``past_key_values`` to ``cache``
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        try:
            cache = DynamicCache(config=model.config)
        except TypeError:  # older transformers
            cache = DynamicCache()
        out = model(input_ids=prompt_ids, use_cache=True, **{key: cache})
        new = []
        done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool)
        for i in range(max_new):
            logits = out.logits[:, -1, :].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            else:
                nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD_ID), nxt)
            new.append(nxt)
            done |= nxt == EOS_ID
            if bool(done.all()) or i == max_new - 1:
                break
            out = model(input_ids=nxt[:, None], use_cache=True, **{key: cache})
        res = torch.stack(new, dim=1)
        if res.shape[1] < max_new:
            res = torch.nn.functional.pad(res, (0, max_new - res.shape[1]), value=PAD_ID)
        return res


def _evaluate(model: PreTrainedModel, width: int, levels: Iterable[int], n: int, seed: int, k: int = 1,
              temperature: float = 0.0, batch: int = 512) -> dict[int, float]:
    import numpy as np
    import torch

    model.eval()
    gen = torch.Generator().manual_seed(seed)
    p0 = 1 + 2 * width + 2
    res: dict[int, float] = {}
    for lv in levels:
        a, b = sample_operands(_eval_rng(seed, lv), lv, n, width, split="heldout")
        ids = torch.from_numpy(np.unique(_encode_batch(a, b), axis=0))  # distinct held-out tasks
        m = ids.shape[0]
        prompts, target = ids[:, :p0], ids[:, p0:]
        prompts = prompts.repeat_interleave(k, dim=0)
        target = target.repeat_interleave(k, dim=0)
        ok = []
        for s in range(0, prompts.shape[0], batch):
            outp = _generate(model, prompts[s : s + batch], target.shape[1], temperature, gen)
            ok.append((outp == target[s : s + batch]).all(dim=1))
        hit = torch.cat(ok).view(m, k).any(dim=1)
        res[lv] = float(hit.float().mean())
    return res


def evaluate_levels(model_dir: Path, levels: Sequence[int], n: int, seed: int, k: int = 1,
                    temperature: float = 0.0, width: int | None = None) -> dict[int, float]:
    """Greedy accuracy (k=1, temperature 0) or pass@k at ``temperature`` per level, on held-out tasks."""
    import torch
    from transformers import AutoModelForCausalLM

    if k > 1 and temperature <= 0:
        raise ValueError("pass@k with k > 1 needs temperature > 0")
    if width is None:
        width = int(json.loads((Path(model_dir) / RECIPE_FILE).read_text())["recipe"]["width"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return _evaluate(model, width, levels, n, seed, k=k, temperature=temperature)
