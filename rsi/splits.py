"""Seed streams. Each purpose draws tasks from its own seed *and* its own split of the task space
(``rsi.tasks``): rollouts and replay from ``train``, the curriculum and the gate from ``heldout``, reports
from ``test``. Seeds keep streams of one split apart (a new generation gets new tasks); splits keep
decisions and reports off anything the model trained on, by construction.
"""

from __future__ import annotations

from typing import Literal

from rsi.hashing import digest
from rsi.models import Split

Purpose = Literal["heldout", "test", "rollout", "replay", "base"]
SPLIT_OF_PURPOSE: dict[str, Split] = {"heldout": "heldout", "test": "test", "rollout": "train", "replay": "train",
                                      "base": "train"}


def stream_seed(purpose: Purpose, lineage_seed: int, generation: int = 0) -> int:
    """The task seed for ``purpose``; held-out and test tasks ignore the generation (one fixed set each)."""
    if purpose in ("heldout", "test"):
        generation = -1
    return int(digest(["rsi-stream", purpose, lineage_seed, generation])[:12], 16)
