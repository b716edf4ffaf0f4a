"""Evaluation: exact-match accuracy per level on held-out tasks, with Wilson 95 % intervals.

A sample counts as correct only if the auditor passes it (format, no extra content, right answer),
so evaluation and the selection signal use one definition of "correct".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from rsi.audit import audit
from rsi.backends.base import SamplingParams
from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.hcp.plays import poses
from rsi.models import Split, Task
from rsi.pair import Responder, sampling_params
from rsi.splits import stream_seed
from rsi.tasks import TaskFamily


class LevelScore(BaseModel):
    model_config = ConfigDict(frozen=True)

    level: int
    n: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float
    decoding: str = "greedy"
    outcomes: tuple[bool, ...] = Field(default=(), repr=False, description="per held-out task, by index")
    exhaustive: bool = Field(False, description="the tasks are every task of the split at this level (fewer than "
                             "asked for exist), so the accuracy is exact, not an estimate from a sample")


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (sound near 0 and 1, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def score(level: int, outcomes: list[bool], decoding: str = "greedy", exhaustive: bool = False) -> LevelScore:
    n, correct = len(outcomes), sum(outcomes)
    accuracy = correct / n if n else 0.0
    low, high = (accuracy, accuracy) if exhaustive else wilson(correct, n)
    return LevelScore(level=level, n=n, correct=correct, accuracy=accuracy, ci_low=low, ci_high=high,
                      decoding=decoding, outcomes=tuple(outcomes), exhaustive=exhaustive)


def expressible(harness: Harness, family: TaskFamily, level: int) -> bool:
    """Whether the harness can pose tasks of ``level`` (a fixed-width format has a ceiling; a plan poses a
    long task as calls within it)."""
    return poses(harness, family, family.task("train", 0, level, 0))


def posable(harness: Harness, family: TaskFamily, tasks: Sequence[Task]) -> list[Task]:
    """The tasks the harness can pose, in order (a fixed-width format cannot pose the longer ones)."""
    return [task for task in tasks if poses(harness, family, task)]


def evaluate(responder: Responder, levels: Sequence[int], n: int, *, lineage_seed: int = 0, k: int = 1,
             split: Split = "heldout", agreement: bool = False) -> list[LevelScore]:
    """The pair's greedy accuracy (k=1) or pass@k at the harness's temperature, per level, on up to ``n``
    distinct tasks of ``split`` (``heldout`` decides, ``test`` only reports; fewer when the split holds fewer).
    ``agreement``: LABEL-FREE, the share of tasks on which the pair agrees with itself (``agreed``)."""
    harness, family = responder.harness, responder.family
    if agreement:
        tasks, params = evaluation_tasks(harness, family, levels, n, lineage_seed=lineage_seed,
                                         k=harness.document.decoding.samples, split=split)
        return level_scores(tasks, agreed(responder, tasks, params), levels, n, k=1, decoding="agreement")
    tasks, params = evaluation_tasks(harness, family, levels, n, lineage_seed=lineage_seed, k=k, split=split)
    return level_scores(tasks, solved(responder, tasks, params), levels, n, k)


def evaluation_tasks(harness: Harness, family: TaskFamily, levels: Sequence[int], n: int, *, lineage_seed: int,
                     k: int, split: Split) -> tuple[list[Task], SamplingParams]:
    """The tasks an evaluation poses, level by level, and how it decodes them."""
    if split == "train":
        raise UserError("evaluation reads the heldout or test split; train tasks are what the model learns from")
    seed = stream_seed(split, lineage_seed)
    params = sampling_params(harness, seed=seed, greedy=k == 1, samples=k)
    return [t for level in levels for t in family.tasks(split, seed, level, n)], params


def solved(responder: Responder, tasks: Sequence[Task], params: SamplingParams) -> dict[str, bool]:
    """Per task id: whether at least one of its samples passes the audit; a task the harness cannot pose is
    not solved. Tasks are independent, so a runner may solve them in shards and merge the answers."""
    harness, family = responder.harness, responder.family
    out = {t.id: False for t in tasks}
    tasks = posable(harness, family, tasks)
    if harness.document.plan is not None:
        return out | solved_by_plan(responder, tasks, params)
    by_task = {t.id: t for t in tasks}
    for traj in responder.episodes(tasks, params):
        ok = audit(traj, by_task[traj.task_id], harness, family).passed
        out[traj.task_id] = out.get(traj.task_id, False) or ok
    return out


def solved_by_plan(responder: Responder, tasks: Sequence[Task], params: SamplingParams) -> dict[str, bool]:
    """Per task id: whether a run of the harness's plan composed an answer the family accepts, every call of
    that run passing its own audit (so a right answer reached through a malformed call does not count)."""
    harness, family = responder.harness, responder.family
    done = responder.run(tasks, params)
    passed = {t.id: audit(t, done.tasks[t.task_id], harness, family).passed for t in done.trajectories}
    by_id = {t.id: t for t in tasks}
    out = {t.id: False for t in tasks}
    for path in done.paths:
        ok = family.verify(by_id[path.task_id], path.answer) and all(passed[c] for c in path.calls)
        out[path.task_id] = out[path.task_id] or ok
    return out


def agreed(responder: Responder, tasks: Sequence[Task], params: SamplingParams) -> dict[str, bool]:
    """LABEL-FREE: per task id, whether more than half of its ``params.n`` samples give one same answer
    (parsed under the harness's answer format with nothing after it; under a plan, the answers its runs
    compose). No verifier, no true answer: what a loop without labels can measure of itself."""
    harness = responder.harness
    out = {t.id: False for t in tasks}
    tasks = posable(harness, responder.family, tasks)
    if harness.document.plan is not None:
        answers = [(p.task_id, p.answer) for p in responder.run(tasks, params).paths if p.answer is not None]
    else:
        answers = [(t.task_id, value) for t in responder.episodes(tasks, params)
                   if (value := answer_of(harness, t.completion)) is not None]
    for task_id, answer in majority_answers(answers, params.n).items():
        out[task_id] = answer is not None
    return out


def answer_of(harness: Harness, completion: str) -> object | None:
    """The value a reply gives under the harness's answer format, None where it does not parse cleanly."""
    from rsi.parsers import get_parser

    spec = harness.document.answer
    parsed = get_parser(spec.parser)(completion, **spec.params)
    return parsed.value if parsed.ok and not parsed.extra else None


def majority_answers(answers: Sequence[tuple[str, object]], samples: int) -> dict[str, object]:
    """Per task id, the answer more than half of its ``samples`` samples give (tasks with none left out)."""
    counts: dict[str, Counter] = {}
    for task_id, answer in answers:
        counts.setdefault(task_id, Counter())[repr(answer)] += 1
    out = {}
    for task_id, count in counts.items():
        key, votes = count.most_common(1)[0]
        if 2 * votes > samples:
            out[task_id] = next(a for t, a in answers if t == task_id and repr(a) == key)
    return out


def level_scores(tasks: Sequence[Task], solved: dict[str, bool], levels: Sequence[int], n: int,
                 k: int, decoding: str | None = None) -> list[LevelScore]:
    decoding = decoding or ("greedy" if k == 1 else f"pass@{k}")
    scores = []
    for level in levels:
        outcomes = [solved[t.id] for t in tasks if t.level == level]
        scores.append(score(level, outcomes, decoding, exhaustive=len(outcomes) < n))
    return scores
