"""Built-in base model: a tiny Llama-architecture causal LM trained from scratch on train-split tasks of a family.

How the base learns a family is the family's (plugin kind ``pretraining``, by the family's name): its batches,
their loss, and how the built base is measured. A family that registers none learns from its expert episodes
under the recipe's harness (``Episodes``: the transcripts, the loss on the assistant turns). Addition registers
its own fixed-width reverse text (``rsi.task_generators.addition``). Only train-split tasks are drawn, so no
held-out or test task is ever seen by the base. The tokenizer is character level over printable ASCII (plus
``<pad> <eos> <bos> <unk>``) and prepends ``<bos>`` itself.

One base may train on several families (``BaseRecipe.also``), so that several lineages' champions share one
frozen base: each family's batches built and their loss taken as for a base of that family alone, interleaved
evenly under one LR schedule.

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
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic

from rsi import plugins

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

FORMAT_VERSION = "rsi-base-addrev-v2"  # v2: pretraining draws only train-split operand pairs
PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK)
PRINTABLE: tuple[str, ...] = tuple(chr(c) for c in range(32, 127))
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + PRINTABLE
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
RECIPE_FILE = "rsi_recipe.json"
MODEL_FILES: tuple[str, ...] = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a Hugging Face base's chat template (the built-in model has none)
EVAL_STREAM = 0x5EED_E7A1  # eval tasks come from a seed stream disjoint from training's
TRAIN_STREAM = 0x7EA1_0001


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
    if pretraining(p.family).harness != (p.harness is not None):
        text = ", ".join(n for n in plugins.names("pretraining") if not plugins.get("pretraining", n).harness)
        raise ValueError("a tool family's base is trained on its episodes under a harness: set harness for a "
                         f"family other than {text} (those learn their own text), and only then")


class BaseRecipe(pydantic.BaseModel, frozen=True):
    """Every knob that changes the base model's weights."""

    model_config = pydantic.ConfigDict(extra="forbid")

    family: str = pydantic.Field("addition", description=(
        "the task family the base is pretrained on: one with its own pretraining (addition: its fixed-width text, "
        "the original recipe), or a tool family, whose expert demonstrations of train-split tasks are played as "
        "episodes under ``harness``"))
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
        for r in self.families():
            pretraining(r.family).check(r)
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


def _demonstrations(r: BaseRecipe) -> dict[int, list[tuple[list[int], list[int]]]]:
    """Per train level, the (input ids, labels) of the family's expert episodes of every distinct train-split
    task drawn (up to 4,096 a level): the transcript under the recipe's harness (an answer family's: the prompt
    and the right answer), the loss on the assistant turns and their EOS only (``rsi.pair.text.segments``), not
    on the expert's mistakes (``BaseRecipe.mistakes``)."""
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


class Episodes:
    """The base learns a family from its expert episodes under the recipe's harness (an answer family's: its
    prompts and right answers): every family but those that register their own pretraining (plugin kind
    ``pretraining``; addition's text). Another family's pretraining is an object with the same attributes."""

    harness = True  # reads the recipe's harness

    def check(self, r: BaseRecipe) -> None:
        """What the recipe must satisfy for this family beyond ``BaseRecipe``'s own checks (nothing here: a
        demonstration longer than the context is named when it is built)."""

    def batches(self, r: BaseRecipe) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The training stream: per step, (ids, labels) tensors of demonstrations, levels by weight,
        right-padded (labels -100 on padding)."""
        import numpy as np
        import torch

        pools = _demonstrations(r)
        rng = np.random.default_rng([TRAIN_STREAM, r.seed])
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

    def loss(self, model: PreTrainedModel, batch: Any, r: BaseRecipe) -> tuple[torch.Tensor, int]:
        """One batch's loss, on the assistant turns (their labels), and the tokens read."""
        import torch.nn.functional as F

        ids, labels = (t.to(model.device) for t in batch)
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        return loss, ids.shape[0] * (ids.shape[1] - 1)

    def measure(self, model: PreTrainedModel, model_dir: Path, r: BaseRecipe,
                n: int) -> tuple[dict[int, float], dict[int, float]]:
        """Measured as the cycle measures a pair: greedy episodes per level (the trained levels and two above)
        and pass@8 one level above the trained ones, on held-out tasks under the recipe's harness, each audited."""
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


def pretraining(family: str) -> Any:
    """How the base learns ``family``: the family's own pretraining if it registered one, else ``Episodes``."""
    return plugins.get("pretraining", family) if family in plugins.names("pretraining") else Episodes()


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
    device: str = "cpu",
) -> dict[int, float]:
    """Train the base model, write it (HF format + tokenizer + rsi_recipe.json) atomically to ``out_dir``.

    Returns greedy exact-match accuracy per trained level on held-out tasks. ``num_threads`` (default: torch's
    own, i.e. the physical cores) does not change the weights on CPU. ``device`` (cpu, cuda or auto) is where
    it trains; it is measured on the CPU.
    """
    import torch

    from rsi.device import resolve_device

    device = resolve_device(device)
    prev = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        return _train_base(recipe, Path(out_dir), progress, eval_n, device)
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
    recipe: BaseRecipe, out_dir: Path, progress: Callable[[int, int, float], None] | None, eval_n: int, device: str
) -> dict[int, float]:
    import torch
    from transformers import GenerationConfig

    from rsi.train import lr_at

    t_start = time.perf_counter()
    r = recipe
    torch.manual_seed(r.seed)
    model = _build_model(r).to(device)  # initialised on the CPU, so every device starts from the same weights
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": r.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=r.lr, betas=(r.beta1, r.beta2), eps=1e-8,
    )
    families = r.families()
    ways = [pretraining(f.family) for f in families]
    streams = [way.batches(f) for way, f in zip(ways, families)]
    schedule = r.model_copy(update={"steps": r.total_steps})  # one LR schedule over every family's steps
    t0 = time.perf_counter()
    loss_val = float("nan")
    tokens = 0
    for step, k in enumerate(interleave([f.steps for f in families])):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, schedule)
        loss, read = ways[k].loss(model, next(streams[k]), families[k])
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
    model.to("cpu").eval()
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
        (greedy, pass8), *parts = [way.measure(model, tmp, f, eval_n) for way, f in zip(ways, families)]
        acc = {lv: greedy[lv] for lv in r.train_levels}
        eval_s = time.perf_counter() - t1
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "digest": r.digest(),
            "recipe": r.model_dump(mode="json"),
            "final_loss": loss_val,
            "train_seconds": round(train_s, 2),
            "torch_threads": torch.get_num_threads(),
            "device": device,
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


def _scores(greedy: dict[int, float], pass8: dict[int, float]) -> dict[str, dict[str, float]]:
    """A family's measurements as rsi_recipe.json keeps them (levels as strings: JSON keys)."""
    return {"greedy": {str(k): v for k, v in greedy.items()}, "pass_at_8": {str(k): v for k, v in pass8.items()}}


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
    device: str = "cpu",
) -> Path:
    """The cached base model for ``recipe`` under ``settings.home``; trains it first (on ``device``) if missing
    or ``force``."""
    path = base_dir_for(settings, recipe)
    if force or not _is_complete(path, recipe):
        train_base(recipe, path, progress, device=device)
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
