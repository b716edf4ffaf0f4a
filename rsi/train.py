"""LoRA training on a selected dataset (PEFT), warm-started from the parent adapter, seeded, CPU-deterministic.

Two trainers, one recipe: the same batches (``batch_plan``: each mixes the frontier pool with the replay pool
in a fixed proportion, so old levels are rehearsed every step), AdamW (0.9, 0.98) on the ``lr_at`` schedule
with gradient clipping, and the loss on completion tokens and EOS only. ``TrainSpec.trainer`` picks one:

- ``loop`` (default): a plain PyTorch loop over a PEFT model, readable in one screen;
- ``trl``: TRL's SFTTrainer with ``peft_config`` (or the parent adapter), an optional dependency
  (``pip install 'rsi[trl]'``). Same losses, and weights equal to float rounding (``tests/test_train.py``).

Measured with ``bench/train.py`` (``bench/results/train.json``): generation 1 of the demo lineage, 660 verified
samples of the demo base (levels 4-5 frontier, 1-3 replay), the demo TrainSpec at 30 steps of batch 128, one
torch thread on a loaded 2-core CPU, arms alternated twice, fastest run each: loop 26.1 s, 5,157 tokens/s;
TRL 30.6 s, 4,386 tokens/s (TRL / loop 0.85; per CPU-second 0.84; the steps alone 0.90, the rest is TRL's
dataset preparation and set-up). Losses (0.0095 -> 0.0002) and held-out greedy accuracy were identical
(levels 4/5/6: 0.953/0.223/0.043, from the base's 0.855/0.055/0.008). With torch's two threads the same runs
varied twofold on that machine (TRL / loop 1.05, within noise). The loop stays the default: faster at equal
accuracy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rsi import plugins
from rsi.device import Device, Precision, autocast, autocast_dtype, resolve_device
from rsi.errors import UserError
from rsi.hashing import canonical_json, digest, digest_bytes
from rsi.select import Dataset, Example

OnStep = Callable[[int, float, float], None]  # (step, loss, lr) after each optimizer step
ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(100, ge=0, description="optimizer steps per generation; 0: the lineage trains no weights "
                       "and improves only its harness (it searches every generation; bench/ablation.py's harness arm)")
    batch_size: int = Field(128, ge=1, description="examples per forward pass (per device); an optimizer step "
                            "sees batch_size x grad_accum of them")
    grad_accum: int = Field(1, ge=1, description="micro-batches of batch_size per optimizer step, their gradients "
                            "summed and the loss averaged over all their completion tokens (as one batch would be)")
    device: Device = Field("auto", description="where training runs: auto (cuda when torch sees a GPU, else cpu), "
                           "cpu or cuda")
    precision: Precision = Field("fp32", description="fp32; bf16 (autocast; the CPU or a GPU that has it) or fp16 "
                                 "(autocast with loss scaling; CUDA only). Weights and optimizer stay fp32")
    checkpoint_every: int = Field(0, ge=0, description="every N steps, save the LoRA weights, optimizer, RNG state "
                                  "and step beside the output (<out>.checkpoint/); a train started again on the same "
                                  "inputs continues from there, to the same adapter. 0: off")
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    frontier_fraction: float = Field(0.5, ge=0, le=1, description="share of each batch from the frontier pool")
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    target_modules: tuple[str, ...] = ALL_PROJ
    trainer: str = Field("loop", description="loop: the plain PyTorch loop here (measured faster); trl: TRL's "
                         "SFTTrainer (pip install 'rsi[trl]'); same batches, schedule and loss (bench/train.py); or "
                         "another package's (rsi.plugins kind 'trainer', entry point group rsi.trainers)")

    @field_validator("trainer")
    @classmethod
    def _registered(cls, name: str) -> str:
        return plugins.known("trainer", name)


class TrainResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    adapter_dir: str | None  # None: the base itself (a candidate harness paired with an untrained champion)
    adapter_hash: str | None
    steps: int
    first_loss: float
    final_loss: float
    examples: int


def adapter_hash(adapter_dir: Path) -> str:
    """Identity of an adapter: its weights and config, not the model card PEFT writes beside them, nor the
    local path of the base (the pair records the base by content hash), so it is the same on every machine."""
    adapter_dir = Path(adapter_dir)
    config = _stable_config(json.loads((adapter_dir / "adapter_config.json").read_text()))
    config.pop("base_model_name_or_path", None)
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    return digest_bytes([("adapter_config.json", canonical_json(config)), ("adapter_model.safetensors", weights)])


def _stable_config(config: dict) -> dict:
    """PEFT writes target_modules from a set, in an order that changes with Python's hash seed."""
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return config


class Schedule(Protocol):
    lr: float
    warmup: int
    steps: int
    min_lr_ratio: float


def lr_at(step: int, spec: Schedule) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak (LoRA training and the base's)."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def encode(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one example: the prompt masked (-100), the completion and EOS as labels; for an
    episode, each assistant turn and its EOS as labels, the tool messages between them masked."""
    prompt = tokenizer(example.prompt, add_special_tokens=not example.chat)["input_ids"]
    if example.turns:
        ids, labels = list(prompt), [-100] * len(prompt)
        for text, trained in example.turns:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if trained else [])
            ids += piece
            labels += piece if trained else [-100] * len(piece)
        return ids, labels
    completion = tokenizer(example.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + completion, [-100] * len(prompt) + completion


def _collate(rows: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids, labels, mask


def _lora_config(spec: TrainSpec):
    from peft import LoraConfig

    return LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                      target_modules=list(spec.target_modules), task_type="CAUSAL_LM")


def _load_base(base_dir: Path, parent_adapter: Path | None):
    """The base model, with the parent adapter on it (trainable) when warm-starting."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
    return base if parent_adapter is None else PeftModel.from_pretrained(base, parent_adapter, is_trainable=True)


def batch_plan(dataset: Dataset, spec: TrainSpec, seed: int) -> list[list[int]]:
    """Per step, the batch as indices into ``frontier + replay`` (the order ``train_adapter`` trains on):
    drawn with replacement, ``frontier_fraction`` of each batch from the frontier pool, the rest from replay.
    A step's batch is ``batch_size x grad_accum`` examples, so 2 micro-batches of 4 draw what one of 8 draws."""
    import torch

    size = spec.batch_size * spec.grad_accum
    n_frontier, n_replay = len(dataset.pool("frontier")), len(dataset.pool("replay"))
    share = size if not n_replay else 0 if not n_frontier else round(size * spec.frontier_fraction)
    gen = torch.Generator().manual_seed(seed)
    draw = lambda size, n: torch.randint(size, (n,), generator=gen).tolist() if n and size else []  # noqa: E731
    return [draw(n_frontier, share) + [n_frontier + i for i in draw(n_replay, size - share)]
            for _ in range(spec.steps)]


def train_adapter(
    base_dir: Path,
    parent_adapter: Path | None,
    dataset: Dataset,
    spec: TrainSpec,
    out_dir: Path,
    *,
    seed: int,
    on_step: OnStep | None = None,
) -> TrainResult:
    """Train a LoRA adapter on ``dataset`` with ``spec.trainer`` and save it atomically to ``out_dir``."""
    examples = dataset.pool("frontier") + dataset.pool("replay")
    if not examples:
        raise ValueError("the selected dataset is empty: nothing passed the audit to train on")
    fit, plan = plugins.get("trainer", spec.trainer), batch_plan(dataset, spec, seed)
    checkpoint = Checkpoint.beside(Path(out_dir), spec, {
        "spec": spec.model_dump(mode="json", exclude={"checkpoint_every", "device"}), "seed": seed, "plan": plan,
        "examples": [e.model_dump(mode="json") for e in examples], "base": str(base_dir),
        "parent": str(parent_adapter)})
    model, losses = fit(Path(base_dir), parent_adapter, examples, plan, spec, seed,
                        on_step or (lambda step, loss, lr: None), checkpoint=checkpoint)
    _save_atomically(model, Path(out_dir))
    if checkpoint is not None:
        checkpoint.clear()
    return TrainResult(adapter_dir=str(out_dir), adapter_hash=adapter_hash(Path(out_dir)), steps=spec.steps,
                       first_loss=losses[0], final_loss=losses[-1], examples=len(dataset.examples))


@plugins.plugin("trainer", "loop")
def _fit_loop(base_dir: Path, parent_adapter: Path | None, examples: list[Example], plan: list[list[int]],
              spec: TrainSpec, seed: int, on_step: OnStep, checkpoint: Checkpoint | None = None):
    """The plain loop: AdamW (0.9, 0.98), ``lr_at`` set each step, loss = mean over the completion tokens of the
    step's batch (its ``grad_accum`` micro-batches together), on ``spec.device`` in ``spec.precision``; continues
    from ``checkpoint`` where one was saved."""
    import torch
    from peft import get_peft_model
    from transformers import AutoTokenizer

    device = resolve_device(spec.device)
    dtype = autocast_dtype(spec.precision, device)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = _load_base(base_dir, parent_adapter)
    model = get_peft_model(model, _lora_config(spec)) if parent_adapter is None else model
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.98), weight_decay=spec.weight_decay)
    scaler = torch.amp.GradScaler(device, enabled=spec.precision == "fp16")  # off: each call passes through
    encoded = [encode(tokenizer, e) for e in examples]
    losses = checkpoint.restore(model, optimizer, on_step) if checkpoint else []
    for step in range(len(losses), len(plan)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        optimizer.zero_grad(set_to_none=True)
        rows = [encoded[i] for i in plan[step]]
        tokens = sum(1 for _, labels in rows for y in labels[1:] if y != -100)  # the loss's tokens, whole step
        loss = 0.0
        for start in range(0, len(rows), spec.batch_size):
            ids, labels, mask = (t.to(device) for t in _collate(rows[start:start + spec.batch_size],
                                                                tokenizer.pad_token_id))
            with autocast(device, dtype):
                micro = model(input_ids=ids, attention_mask=mask, labels=labels,
                              **({"num_items_in_batch": tokens} if spec.grad_accum > 1 else {})).loss
            scaler.scale(micro).backward()
            loss += micro.item()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss)
        if checkpoint and (step + 1) % spec.checkpoint_every == 0 and step + 1 < len(plan):
            checkpoint.save(model, optimizer, losses, [lr_at(s, spec) for s in range(step + 1)])
        on_step(step, losses[-1], lr_at(step, spec))
    return model, losses


class Checkpoint:
    """A train's state every ``checkpoint_every`` steps, in ``<out>.checkpoint/`` beside the output: the LoRA
    weights, the optimizer, torch's RNG state and the steps' losses, written atomically. It belongs to one set
    of inputs (``key``: the spec, seed, batches, examples, base and parent); a folder of other inputs is
    dropped, and the folder goes once the adapter is saved."""

    def __init__(self, folder: Path, key: str):
        self.folder, self.key = folder, key
        self.state = folder / "state.pt"

    @classmethod
    def beside(cls, out_dir: Path, spec: TrainSpec, inputs: dict) -> Checkpoint | None:
        """The checkpoint of a train writing ``out_dir`` (None when ``spec.checkpoint_every`` is 0)."""
        if not spec.checkpoint_every:
            return None
        checkpoint = cls(out_dir.with_name(f"{out_dir.name}.checkpoint"), digest(inputs))
        key_file = checkpoint.folder / "key"
        if checkpoint.folder.exists() and (not key_file.is_file() or key_file.read_text() != checkpoint.key):
            shutil.rmtree(checkpoint.folder)  # another train's state (other inputs) is no place to continue from
        checkpoint.folder.mkdir(parents=True, exist_ok=True)
        key_file.write_text(checkpoint.key)
        return checkpoint

    def save(self, model, optimizer, losses: list[float], lrs: list[float]) -> None:
        import torch

        state = {"weights": {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
                 "optimizer": optimizer.state_dict(), "losses": list(losses), "lrs": lrs,
                 "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []}
        tmp = self.folder / f".state-{os.getpid()}.pt"
        torch.save(state, tmp)
        os.replace(tmp, self.state)

    def restore(self, model, optimizer, on_step: OnStep) -> list[float]:
        """The saved steps' losses (none saved: []), the model and optimizer set to where they stopped; each
        restored step reported to ``on_step`` again, so the caller's record of the train is whole."""
        import torch

        if not self.state.is_file():
            return []
        state = torch.load(self.state, weights_only=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.requires_grad:
                    param.copy_(state["weights"][name])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        for step, (loss, lr) in enumerate(zip(state["losses"], state["lrs"])):
            on_step(step, loss, lr)
        return list(state["losses"])

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@plugins.plugin("trainer", "trl")
def _fit_trl(base_dir: Path, parent_adapter: Path | None, examples: list[Example], plan: list[list[int]],
             spec: TrainSpec, seed: int, on_step: OnStep, checkpoint: Checkpoint | None = None):
    """TRL's SFTTrainer on the same batches: the loop's own token ids and labels (``encode``: the loss on the
    completion, or on each assistant turn of an episode or chat, and EOS), ``peft_config`` from the spec (or the
    parent adapter, trainable), the loop's optimizer and ``lr_at`` schedule, ``grad_accum``, on ``spec.device``
    in ``spec.precision``; per-step loss and lr reach ``on_step`` through a TrainerCallback. With
    ``checkpoint_every``, TRL's own checkpoints (``save_steps``) in the checkpoint folder, resumed from the last."""
    trl = _require_trl()
    import torch
    from datasets import Dataset as HFDataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    device = resolve_device(spec.device)
    autocast_dtype(spec.precision, device)  # refuses a precision the device lacks, as the loop does
    steps: list[tuple[float, float]] = []  # (loss, lr) of each optimizer step, recorded by the trainer
    micro: list[tuple[float, float]] = []  # (loss, lr) of the current step's micro-batches

    class Report(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append((sum(loss for loss, _ in micro), micro[0][1]))
            micro.clear()
            on_step(state.global_step - 1, *steps[state.global_step - 1])

        def on_save(self, args, state, control, **kwargs):  # written last: the checkpoint is whole
            done = Path(args.output_dir) / f"checkpoint-{state.global_step}" / STEPS_FILE
            done.write_text(json.dumps(steps))

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = [encode(tokenizer, e) for e in examples]
    torch.manual_seed(seed)
    data = HFDataset.from_dict({"input_ids": [ids for ids, _ in rows], "labels": [labels for _, labels in rows]})
    with tempfile.TemporaryDirectory(prefix="rsi-trl-") as scratch:
        output_dir = str(checkpoint.folder) if checkpoint else scratch
        with _quiet_datasets():
            trainer = _sft_trainer(trl, plan, spec, micro)(
                model=_load_base(base_dir, parent_adapter), args=_sft_config(trl, spec, seed, output_dir, device),
                train_dataset=data, processing_class=tokenizer, callbacks=[Report()],
                peft_config=_lora_config(spec) if parent_adapter is None else None)
        trainer.remove_callback(PrinterCallback)  # it prints the run's summary dict to stdout
        if len(trainer.train_dataset) != len(examples):  # TRL drops examples without a loss token
            raise ValueError(f"TRL kept {len(trainer.train_dataset)} of {len(examples)} examples")
        resume = _last_trl_checkpoint(checkpoint.folder) if checkpoint else None
        if resume is not None:
            steps += [tuple(s) for s in json.loads((resume / STEPS_FILE).read_text())]
            for step, (loss, lr) in enumerate(steps):
                on_step(step, loss, lr)
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer.model, [loss for loss, _ in steps]


STEPS_FILE = "rsi_steps.json"  # in a TRL checkpoint: the (loss, lr) of the steps before it


def _last_trl_checkpoint(folder: Path) -> Path | None:
    """The latest whole TRL checkpoint in ``folder`` (one with the steps file, which is written last)."""
    whole = [p for p in folder.glob("checkpoint-*") if (p / STEPS_FILE).is_file()]
    return max(whole, key=lambda p: int(p.name.rpartition("-")[2]), default=None)


def _sft_trainer(trl, plan: list[list[int]], spec: TrainSpec, micro: list[tuple[float, float]]):
    """SFTTrainer with the loop's batches (``plan``, in order) and ``lr_at`` schedule, recording each
    micro-batch's (loss, lr)."""
    import torch

    class Trainer(trl.SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return [i for batch in plan for i in batch]

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda step: lr_at(step, spec) / spec.lr)
            return self.lr_scheduler

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            micro.append((loss.item(), self.optimizer.param_groups[0]["lr"]))
            return loss

    return Trainer


def _sft_config(trl, spec: TrainSpec, seed: int, output_dir: str, device: str):
    """The loop's settings in TRL's terms; TRL's own defaults (bf16, gradient checkpointing) turned off unless
    the spec asks for them."""
    saves = {"save_strategy": "steps", "save_steps": spec.checkpoint_every} if spec.checkpoint_every else {
        "save_strategy": "no"}
    return trl.SFTConfig(
        output_dir=output_dir, max_steps=spec.steps, per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.grad_accum, learning_rate=spec.lr, weight_decay=spec.weight_decay,
        adam_beta1=0.9, adam_beta2=0.98, max_grad_norm=spec.grad_clip, optim="adamw_torch", seed=seed,
        use_cpu=device == "cpu", bf16=spec.precision == "bf16", fp16=spec.precision == "fp16",
        gradient_checkpointing=False, completion_only_loss=True, max_length=None, logging_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, **saves)


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars from TRL's dataset preparation (five per training), restored afterwards."""
    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    shown = not are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            enable_progress_bars()


def _require_trl():
    try:
        import trl
    except ImportError as exc:
        raise UserError("train.trainer = 'trl' needs TRL, an optional dependency: pip install 'rsi[trl]' "
                        "(or set train.trainer = 'loop')") from exc
    return trl


def _save_atomically(model, out_dir: Path) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    model.save_pretrained(tmp)
    config_file = tmp / "adapter_config.json"
    config_file.write_text(json.dumps(_stable_config(json.loads(config_file.read_text())), indent=2, sort_keys=True))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
