"""Execute tasks under a model-harness pair: render prompts, generate, record trajectories."""

from __future__ import annotations

from collections.abc import Sequence

from rsi.backends.base import GenerationBackend, SamplingParams
from rsi.hcp import Harness
from rsi.models import Message, Task, Timings, TokenCounts, Trajectory


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
    """One trajectory per (task, sample): the harness's prompt messages, then the reply. The model's input
    is their concatenation (completion mode). Ids are content hashes; sampling is seeded, so a rerun
    yields the same trajectories and ids."""
    rendered = [harness.prompt_messages(t.payload) for t in tasks]
    prompts = ["".join(content for _, content in messages) for messages in rendered]
    outputs = backend.generate(prompts, params, adapter=adapter)
    trajectories = []
    for task, messages, samples in zip(tasks, rendered, outputs, strict=True):
        prompt_messages = tuple(Message(role=role, content=content) for role, content in messages)
        for index, c in enumerate(samples):
            trajectories.append(
                Trajectory.build(
                    task_id=task.id,
                    pair_id=pair_id,
                    harness_id=harness.id,
                    sample_index=index,
                    seed=params.seed,
                    messages=(*prompt_messages, Message(role="assistant", content=c.text)),
                    finish_reason=c.finish_reason,
                    tokens=TokenCounts(prompt=c.prompt_tokens, completion=c.completion_tokens),
                    timings=Timings(generate_s=c.generate_s),
                )
            )
    return trajectories
