"""Research helpers (self-contained): multi-width base pretraining, LoRA expert iteration, width migration.

Formats (fmt):
  pad : rsi v2 harness  "<a lsb, zero-padded W>+<b lsb, W>=" -> sum lsb W+1 digits, EOS
  idx : index hints      each operand/answer digit preceded by an index letter (a,b,c,... for digit 0,1,2..):
        "a3b4c0+a5b1c2=" -> "a8b5c2...", EOS (answer W+1 hinted digits)
Only levels 1..3 ever get labels from the generator; levels >= 4 are trained only on verified own samples.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rsi.basemodel import BOS_ID, EOS_ID, VOCAB, BaseRecipe, _build_model
from rsi.task_generators.addition import (DIGIT0_ID, EQ_ID, PLUS_ID, _add_digits, _generate, digits_to_int,
                                          sample_operands)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.provenance import provenance  # noqa: E402 (after the path it needs)

import os
torch.set_num_threads(int(os.environ.get("RW_THREADS", "2")))
OUT = Path(__file__).resolve().parent / "out"  # model folders and logs of the runs (results/ keeps the reported logs)
LETTER0 = VOCAB.index("a")


def log(f, **kw):
    kw["cpu_s"] = round(time.process_time(), 1)
    kw["wall"] = time.strftime("%H:%M:%S")
    line = json.dumps(kw)
    print(line, flush=True)
    if f:
        with open(f, "a") as fh:
            fh.write(line + "\n")


def log_start(f, args) -> None:
    """A run's first record: its arguments and their provenance (commit, clean tree, config digest, machine)."""
    log(f, tag="start", args=vars(args), provenance=provenance(vars(args)))


# ---------------------------------------------------------------- encoding
def int_digits(xs: list[int], w: int) -> np.ndarray:
    return np.array([[int(c) for c in str(x).zfill(w)[::-1]] for x in xs], dtype=np.int64)


def encode(a: np.ndarray, b: np.ndarray, fmt: str = "pad", s: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """ids [n, L] of BOS+prompt+completion+EOS and p0 = index of first completion token."""
    n, w = a.shape
    s = _add_digits(a, b) if s is None else s
    if fmt == "pad":
        cols = [np.full((n, 1), BOS_ID), a + DIGIT0_ID, np.full((n, 1), PLUS_ID), b + DIGIT0_ID,
                np.full((n, 1), EQ_ID)]
        p0 = 2 * w + 3
        cols += [s + DIGIT0_ID, np.full((n, 1), EOS_ID)]
    elif fmt == "idx":
        def hint(d):
            m = d.shape[1]
            out = np.empty((n, 2 * m), dtype=np.int64)
            out[:, 0::2] = LETTER0 + np.arange(m)[None, :]
            out[:, 1::2] = d + DIGIT0_ID
            return out
        cols = [np.full((n, 1), BOS_ID), hint(a), np.full((n, 1), PLUS_ID), hint(b), np.full((n, 1), EQ_ID)]
        p0 = 1 + 4 * w + 2
        cols += [hint(s), np.full((n, 1), EOS_ID)]
    else:
        raise ValueError(fmt)
    return np.concatenate(cols, axis=1).astype(np.int64), p0


# ---------------------------------------------------------------- model / training
def build_base(seed: int = 0) -> torch.nn.Module:
    return _build_model(BaseRecipe(seed=seed))  # 2L d128 4 heads RoPE, same as rsi


def lr_at(step, lr, warmup, steps, min_ratio=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def group_loss(model, groups: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Mean CE over completion tokens (+EOS) of several equal-length groups."""
    tot, cnt = 0.0, 0
    for ids, p0 in groups:
        logits = model(input_ids=ids[:, :-1]).logits[:, p0 - 1:]
        tgt = ids[:, p0:]
        tot = tot + F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), reduction="sum")
        cnt += tgt.numel()
    return tot / cnt


def fit(model, batch_fn, steps, lr, warmup, logf=None, tag="", wd=0.0):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=wd)
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, warmup, steps)
        loss = group_loss(model, batch_fn(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if logf and (step % 250 == 0 or step == steps - 1):
            log(logf, tag=tag, step=step, loss=round(float(np.mean(losses[-50:])), 4))
    model.eval()
    return losses


def add_lora(model, r=16, alpha=32):
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, cfg)


# ---------------------------------------------------------------- generation / eval
@torch.inference_mode()
def generate(model, prompts: torch.Tensor, max_new: int, temperature: float, gen) -> torch.Tensor:
    """rsi's own batched KV-cached decoding (one sampler for the base build, the backends and this research)."""
    return _generate(model, prompts, max_new, temperature, gen)


def operands(seed_key, level, n, w, split):
    rng = np.random.default_rng(seed_key)
    return sample_operands(rng, level, n, w, split=split)


def evaluate(model, w, levels, n=256, fmt="pad", seed=0) -> dict[int, float]:
    model.eval()
    res = {}
    for lv in levels:
        if lv > w:
            continue
        a, b = operands([0x5EED, seed, lv], lv, n, w, "heldout")  # same tasks for every width
        ids, p0 = encode(a, b, fmt)
        ids = torch.from_numpy(ids)
        ok = []
        for s in range(0, len(ids), 512):
            out = generate(model, ids[s:s + 512, :p0], ids.shape[1] - p0, 0.0, None)
            ok.append((out == ids[s:s + 512, p0:]).all(1))
        res[lv] = round(float(torch.cat(ok).float().mean()), 3)
    return res


def sample_verified(model, w, level, n_tasks, k, temp, fmt, seed) -> list[tuple[int, int]]:
    """Distinct train-split problems (a, b) at ``level`` where >= 1 of k samples is exactly right (verifier)."""
    a, b = operands([0xE1, seed, level, w], level, n_tasks, w, "train")
    ids, p0 = encode(a, b, fmt)
    ids = torch.from_numpy(ids)
    prompts = ids[:, :p0].repeat_interleave(k, 0)
    target = ids[:, p0:].repeat_interleave(k, 0)
    gen = torch.Generator().manual_seed(seed * 1000 + level)
    ok = []
    for s in range(0, len(prompts), 512):
        out = generate(model, prompts[s:s + 512], target.shape[1], temp, gen)
        ok.append((out == target[s:s + 512]).all(1))
    hit = torch.cat(ok).view(n_tasks, k).any(1).numpy()
    A, B = digits_to_int(a), digits_to_int(b)
    return [(A[i], B[i]) for i in np.flatnonzero(hit)]


def render(pairs, w, fmt):
    a = int_digits([p[0] for p in pairs], w)
    b = int_digits([p[1] for p in pairs], w)
    ids, p0 = encode(a, b, fmt)
    return torch.from_numpy(ids), p0


def fresh(rng, level, n, w, fmt):
    a, b = sample_operands(rng, level, n, w, split="train")
    ids, p0 = encode(a, b, fmt)
    return torch.from_numpy(ids), p0
