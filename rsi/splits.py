"""Seed streams. Each purpose draws tasks from its own seed, so held-out tasks never share a stream
with tasks used for pretraining, sampling or training (Lee et al.'s code evaluates on the seed of its
self-training questions; rsi cannot)."""

from __future__ import annotations

from typing import Literal

from rsi.hashing import digest

Purpose = Literal["heldout", "rollout", "base"]


def stream_seed(purpose: Purpose, lineage_seed: int, generation: int = 0) -> int:
    """The task seed for ``purpose``; held-out tasks ignore the generation (one fixed set per lineage)."""
    if purpose == "heldout":
        generation = -1
    return int(digest(["rsi-stream", purpose, lineage_seed, generation])[:12], 16)
