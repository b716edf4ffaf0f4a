"""Execute tasks under a model-harness pair: render prompts, generate, record trajectories."""

from __future__ import annotations

from collections.abc import Sequence

from rsi.backends.base import GenerationBackend, SamplingParams
from rsi.episodes import run_episodes
from rsi.hcp import Harness
from rsi.models import Task, Trajectory


def sampling_params(harness: Harness, *, seed: int, greedy: bool = False, samples: int | None = None) -> SamplingParams:
    """The harness's decoding settings as backend parameters; ``greedy`` is one deterministic sample."""
    dec = harness.document.decoding
    return SamplingParams(
        max_new_tokens=dec.max_new_tokens,
        temperature=0.0 if greedy else dec.temperature,
        top_p=1.0 if greedy else dec.top_p,
        n=1 if greedy else (samples or dec.samples),
        seed=seed,
        stop=dec.stop,
    )


def rollout(
    tasks: Sequence[Task],
    harness: Harness,
    backend: GenerationBackend,
    pair_id: str,
    params: SamplingParams,
    adapter: str | None = None,
) -> list[Trajectory]:
    """One trajectory per (task, sample): an episode under the harness (``rsi.episodes``); without tools, the
    prompt messages and one reply, the model's input being their concatenation (completion mode). Ids are
    content hashes; sampling is seeded, so a rerun yields the same trajectories and ids."""
    return run_episodes(tasks, harness, backend, pair_id, params, adapter=adapter)
