"""Where models run and in what precision: one setting for the trainer, the hf backend and the base build.

``auto`` is CUDA when torch sees a GPU, else the CPU; asking for CUDA on a machine without one, or for a
precision the device cannot compute in, is a ``UserError`` naming the setting and the fix. On the CPU at the
defaults (fp32) nothing is moved or cast, so results are bit-identical to code that never asked.
torch is imported inside the functions: importing rsi stays cheap.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal

from rsi.errors import UserError

Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16", "fp16"]


def resolve_device(device: str, setting: str = "train.device") -> str:
    """``cpu`` or ``cuda`` for a ``Device`` setting; ``setting`` names it in the error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{setting} 'cuda': CUDA is not available on this machine (torch.cuda.is_available() is "
                        f"False); use cpu or auto (rsi run --device cpu, or --set {setting}=cpu), or run on a machine "
                        "with an NVIDIA GPU and a CUDA build of torch")
    if device not in ("cpu", "cuda"):
        raise UserError(f"{setting} {device!r}: expected auto, cpu or cuda")
    return device


def autocast_dtype(precision: str, device: str, setting: str = "train.precision"):
    """The torch dtype to autocast to on ``device`` (a resolved one), None for fp32 (no autocast)."""
    import torch

    if precision == "fp32":
        return None
    if precision == "fp16" and device != "cuda":
        raise UserError(f"{setting} 'fp16' needs a CUDA device (this run trains on {device}); use bf16 or fp32 "
                        f"(--set {setting}=bf16)")
    if precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"{setting} 'bf16': this GPU cannot compute in bfloat16; use fp16 or fp32 "
                        f"(--set {setting}=fp16)")
    if precision not in ("bf16", "fp16"):
        raise UserError(f"{setting} {precision!r}: expected fp32, bf16 or fp16")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast(device: str, dtype) -> AbstractContextManager:
    """Mixed precision for the forward pass (weights and optimizer stay fp32); nothing at all for fp32."""
    import torch

    return nullcontext() if dtype is None else torch.autocast(device_type=device, dtype=dtype)
