"""LoRA training on a selected dataset (PEFT), warm-started from the parent adapter, seeded, CPU-deterministic.

A plain PyTorch loop over a PEFT model, readable in one screen. It has not been measured against TRL's
SFTTrainer yet (issue 9 adds ``bench/train.py`` for that); nothing here claims it is faster. Loss is on
completion tokens (and EOS) only. Each batch mixes the frontier pool
with the replay pool in a fixed proportion, so old levels are rehearsed every step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from rsi.hashing import canonical_json, digest_bytes
from rsi.select import Dataset, Example

ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(100, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    frontier_fraction: float = Field(0.5, ge=0, le=1, description="share of each batch from the frontier pool")
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    target_modules: tuple[str, ...] = ALL_PROJ


class TrainResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    adapter_dir: str
    adapter_hash: str
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


def _encode(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    prompt = tokenizer(example.prompt)["input_ids"]
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


def _load_trainable(base_dir: Path, parent_adapter: Path | None, spec: TrainSpec):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
    if parent_adapter is not None:
        return PeftModel.from_pretrained(base, parent_adapter, is_trainable=True)
    config = LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=0.0,
                        target_modules=list(spec.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def train_adapter(
    base_dir: Path,
    parent_adapter: Path | None,
    dataset: Dataset,
    spec: TrainSpec,
    out_dir: Path,
    *,
    seed: int,
    on_step: Callable[[int, float, float], None] | None = None,
) -> TrainResult:
    """Train a LoRA adapter on ``dataset`` and save it atomically to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer

    frontier, replay = dataset.pool("frontier"), dataset.pool("replay")
    if not frontier and not replay:
        raise ValueError("the selected dataset is empty: nothing passed the audit to train on")
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = _load_trainable(Path(base_dir), parent_adapter, spec)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.98), weight_decay=spec.weight_decay)
    encoded = {"frontier": [_encode(tokenizer, e) for e in frontier], "replay": [_encode(tokenizer, e) for e in replay]}
    n_front = spec.batch_size if not replay else 0 if not frontier else round(spec.batch_size * spec.frontier_fraction)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(spec.steps):
        rows = _draw(encoded["frontier"], n_front, gen) + _draw(encoded["replay"], spec.batch_size - n_front, gen)
        ids, labels, mask = _collate(rows, tokenizer.pad_token_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], lr_at(step, spec))
    _save_atomically(model, Path(out_dir))
    return TrainResult(adapter_dir=str(out_dir), adapter_hash=adapter_hash(Path(out_dir)), steps=spec.steps,
                       first_loss=losses[0], final_loss=losses[-1], examples=len(dataset.examples))


def _draw(pool: list, n: int, gen) -> list:
    import torch

    if n == 0 or not pool:
        return []
    return [pool[i] for i in torch.randint(len(pool), (n,), generator=gen).tolist()]


def _save_atomically(model, out_dir: Path) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    model.save_pretrained(tmp)
    config_file = tmp / "adapter_config.json"
    config_file.write_text(json.dumps(_stable_config(json.loads(config_file.read_text())), indent=2, sort_keys=True))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
