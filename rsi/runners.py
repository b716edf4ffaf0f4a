"""Where a lineage run's fan-out work runs: execute's rollouts, audit's verdicts, evaluation's held-out tasks.

``local`` runs it in the flow's process on the lineage run's backend. ``ray`` splits it by task into shards,
one Ray task each: a worker builds its own hf backend and harness from paths (cached per worker process, so
a shard does not reload the model) and returns trajectories, verdicts or outcomes; the stage stores them
exactly as it does for ``local``. Only the flow's process writes to the state DB.

Same seeds, same results, whatever the shard count: shards are merged back in the original order, tasks with
equal prompts stay in one shard in their original order (a sample's seed counts the prompt's earlier
occurrences in the call), and the hf backend computes each row's logits independently of the rest of its
call (``rsi.backends.hf``). ``tests/test_ray.py`` checks a lineage against the local runner byte for byte.

Ray runs on the cluster at ``RAY_ADDRESS``, else on the head ``ray start --head`` started on this machine
(its workers must import the same rsi: start it from the same environment, with the run's files on a shared
path); with neither, the runner starts a Ray instance in this process for the run and shuts it down, raylet
included, when the run closes. Plain ``ray.remote`` inside the stage rather than prefect-ray's
``RayTaskRunner``: that runner moves whole Prefect tasks to the workers, which would then need the state DB,
the lineage's lease and a Prefect API server of their own, and it would still run each stage as one task.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from rsi import plugins
from rsi.audit import audit
from rsi.errors import RuntimeFailure, UserError
from rsi.evaluate import LevelScore, evaluate, evaluation_tasks, level_scores, posable, solved
from rsi.hashing import digest
from rsi.pair import Responder

if TYPE_CHECKING:

    from rsi.backends.base import GenerationBackend, SamplingParams
    from rsi.hcp import Harness
    from rsi.models import Pair, Split, Task, Trajectory, Verdict
    from rsi.tasks import TaskFamily

log = logging.getLogger("rsi.runners")


class Runner(Protocol):
    """The work a stage fans out under a given harness, with the lineage run's family and base model."""

    def rollout(self, harness: Harness, tasks: Sequence[Task], pair_id: str, params: SamplingParams,
                adapter: str | None = None) -> tuple[list[Trajectory], list[Task]]:
        """Trajectories, and the tasks a plan's calls posed (``rsi.pair.Responder.run``)."""

    def audit(self, harness: Harness, trajectories: Sequence[Trajectory], tasks: Mapping[str, Task],
              pair: Pair | None) -> list[Verdict]: ...

    def evaluate(self, harness: Harness, pair_id: str, levels: Sequence[int], n: int, *, lineage_seed: int,
                 adapter: str | None, split: Split, agreement: bool = False) -> list[LevelScore]: ...

    def close(self) -> None: ...


def posed(responder: Responder, tasks: Sequence[Task], params: SamplingParams) -> tuple[list[Trajectory], list[Task]]:
    """The trajectories of ``tasks`` under the pair, and the tasks its plan's calls posed (none without a plan)."""
    run = responder.run(tasks, params)
    return run.trajectories, list(run.tasks.values())


class RunParts(Protocol):
    """What a runner reads of the lineage run it serves (``rsi.run.Run`` is one): its config's ``runner``,
    ``shards`` and ``backend``, and its base (``rsi.run.base.Base``: ``backend`` and ``dir``); the family is each
    harness's own."""

    config: Any
    base: Any


def family_of(harness: Harness) -> TaskFamily:
    """The family a harness poses tasks of (a lineage's proposer harness is another family's than its solver's)."""
    from rsi.tasks import get_family

    return get_family(harness.document.family)


def make_runner(run: RunParts) -> Runner:
    """The runner ``run.config.runner`` names (``rsi.plugins`` kind "runner": a class or factory taking the run;
    another package's by entry point in ``rsi.runners``); a ray runner is checked here and connects on first use."""
    return plugins.get("runner", run.config.runner)(run)


@plugins.plugin("runner", "local")
class LocalRunner:
    """Everything in this process, on the lineage run's backend (built on first use)."""

    def __init__(self, run: RunParts):
        self.run = run

    def rollout(self, harness: Harness, tasks: Sequence[Task], pair_id: str, params: SamplingParams,
                adapter: str | None = None) -> tuple[list[Trajectory], list[Task]]:
        return posed(Responder(harness, self.run.base.backend, pair_id, adapter, family_of(harness)), tasks, params)

    def audit(self, harness: Harness, trajectories: Sequence[Trajectory], tasks: Mapping[str, Task],
              pair: Pair | None) -> list[Verdict]:
        return [audit(t, tasks[t.task_id], harness, family_of(harness), pair) for t in trajectories]

    def evaluate(self, harness: Harness, pair_id: str, levels: Sequence[int], n: int, *, lineage_seed: int,
                 adapter: str | None, split: Split, agreement: bool = False) -> list[LevelScore]:
        return evaluate(Responder(harness, self.run.base.backend, pair_id, adapter, family_of(harness)), levels, n,
                        lineage_seed=lineage_seed, split=split, agreement=agreement)

    def close(self) -> None:
        pass  # the backend belongs to the lineage run


# --------------------------------------------------------------------------------------------------------
# ray: shards as Ray tasks; workers rebuild backend and harness from a WorkerSpec
# --------------------------------------------------------------------------------------------------------
class WorkerSpec(NamedTuple):
    """What a worker needs to rebuild the run's objects: paths and names, nothing live."""

    model_dir: str
    harness: str  # the hcp.toml
    harness_hash: str  # checked on load: a harness edited on disk mid-run is refused, not used
    family: str


@plugins.plugin("runner", "ray")
class RayRunner:
    """Shards on Ray: ``shards`` per stage (0: one per CPU of the cluster)."""

    def __init__(self, run: RunParts, shards: int | None = None):
        if importlib.util.find_spec("ray") is None:
            raise UserError("runner 'ray' needs Ray, which is not installed: pip install 'rsi[ray]'")
        if run.config.backend != "hf":
            raise UserError(f"runner 'ray' shards the hf backend over Ray workers; backend {run.config.backend!r} "
                            "batches on its own server: use --runner local with it")
        self.run, self.shards = run, run.config.shards if shards is None else shards
        self._started = False  # whether this runner called ray.init (and so must call ray.shutdown)

    def rollout(self, harness: Harness, tasks: Sequence[Task], pair_id: str, params: SamplingParams,
                adapter: str | None = None) -> tuple[list[Trajectory], list[Task]]:
        parts = self._split_by_prompt(harness, tasks)
        results = self._map(harness, _rollout_shard, [([tasks[i] for i in part], pair_id, params, adapter) for part in parts])
        if harness.document.plan is not None:  # calls per task vary: shards in order, each call once
            seen = {t.id: t for trajectories, _ in results for t in trajectories}
            return list(seen.values()), list({t.id: t for _, posed in results for t in posed}.values())
        per_task: list[list[Trajectory]] = [[] for _ in tasks]
        for part, (trajectories, _) in zip(parts, results, strict=True):
            if len(trajectories) != len(part) * params.n:
                raise RuntimeFailure(f"a rollout shard returned {len(trajectories)} trajectories for {len(part)} "
                                     f"tasks x {params.n} samples")
            for j, i in enumerate(part):
                per_task[i] = trajectories[j * params.n:(j + 1) * params.n]
        return [t for group in per_task for t in group], []

    def audit(self, harness: Harness, trajectories: Sequence[Trajectory], tasks: Mapping[str, Task],
              pair: Pair | None) -> list[Verdict]:
        count = self._count(len(trajectories))
        size = -(-len(trajectories) // count) if trajectories else 1
        chunks = [trajectories[i:i + size] for i in range(0, len(trajectories), size)]
        args = [(chunk, {t.task_id: tasks[t.task_id] for t in chunk}, pair) for chunk in chunks]
        return [v for verdicts in self._map(harness, _audit_shard, args) for v in verdicts]

    def evaluate(self, harness: Harness, pair_id: str, levels: Sequence[int], n: int, *, lineage_seed: int,
                 adapter: str | None, split: Split, agreement: bool = False) -> list[LevelScore]:
        if agreement:
            raise UserError("label-free scoring (labels = 'majority') runs on the local runner: --runner local")
        every, params = evaluation_tasks(harness, family_of(harness), levels, n, lineage_seed=lineage_seed,
                                         k=1, split=split)
        outcomes = {t.id: False for t in every}  # a task the harness cannot pose is not solved
        tasks = posable(harness, family_of(harness), every)
        parts = self._split_by_prompt(harness, tasks) if tasks else []
        for part in self._map(harness, _solve_shard, [([tasks[i] for i in p], pair_id, params, adapter) for p in parts]):
            outcomes |= part
        return level_scores(every, outcomes, levels, n, k=1)

    def close(self) -> None:
        if self._started:
            import ray

            ray.shutdown()  # stops the instance this runner started (raylet, GCS, workers), or disconnects
            self._started = False

    # -- shards -------------------------------------------------------------------------------------------
    def _split_by_prompt(self, harness: Harness, tasks: Sequence[Task]) -> list[list[int]]:
        """Task indices per shard: prompts dealt round-robin in order of first appearance (levels spread
        evenly), each shard's indices ascending, so equal prompts keep their order within one shard."""
        groups: dict[str, list[int]] = {}
        for i, task in enumerate(tasks):
            key = digest(task.payload) if harness.document.plan is not None else harness.prompt(task.payload)
            groups.setdefault(key, []).append(i)
        count = self._count(len(groups))
        parts: list[list[int]] = [[] for _ in range(count)]
        for g, indices in enumerate(groups.values()):
            parts[g % count] += indices
        return [sorted(p) for p in parts if p]

    def _count(self, items: int) -> int:
        self._connect()
        import ray

        wanted = self.shards or int(ray.cluster_resources().get("CPU", 1))
        return max(1, min(wanted, items))

    def _map(self, harness: Harness, fn: Callable[..., Any], args: list[tuple]) -> list[Any]:
        """``fn(spec, *a)`` for each ``a``, one Ray task each, results in the order of ``args``."""
        import ray

        spec, remote = self._spec(harness), _remote_shard()
        refs = [remote.remote(fn, spec, pickle.dumps(a, protocol=5)) for a in args]
        return [pickle.loads(result) for result in ray.get(refs)]

    def _spec(self, harness: Harness) -> WorkerSpec:
        run = self.run
        return WorkerSpec(model_dir=str(run.base.dir), harness=str(harness.path), harness_hash=harness.hash,
                          family=harness.document.family)

    def _connect(self) -> None:
        """Join ``RAY_ADDRESS`` or the head ``ray start`` left on this machine, else start one for this run."""
        import ray

        if ray.is_initialized():
            return  # connected before (by this runner, or by its caller, who then shuts it down)
        from ray._private.services import canonicalize_bootstrap_address

        quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
        try:
            address = canonicalize_bootstrap_address(None)  # RAY_ADDRESS, else /tmp/ray's current cluster
            if address is None:
                ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, **quiet)
                log.info("started a Ray instance for this run (%d CPUs)", os.cpu_count())
            else:  # address None: Ray resolves it again, and sends the local auth token to a head found so
                ray.init(**quiet)
                log.info("joined the Ray cluster at %s", address)
        except ConnectionError as exc:
            raise UserError(f"no Ray cluster answers ({exc}); start one with `ray start --head`, or unset "
                            "RAY_ADDRESS (and run `ray stop` if a stopped head left its address behind) so rsi "
                            "starts its own") from None
        self._started = True


@lru_cache(maxsize=1)
def _remote_shard():
    import ray

    return ray.remote(num_cpus=1, max_retries=0)(_shard)


# What runs in a worker. Each builds what it needs once per worker process (Ray reuses its workers).
def _shard(fn: Callable[..., Any], spec: WorkerSpec, args: bytes) -> bytes:
    """One shard: ``fn(spec, *args)``. Arguments and result cross as pickled bytes: Ray's serializer took
    ~10x longer than pickle for pydantic models (6,656 verdicts: 2.8 s there and back, pickle 0.2 s)."""
    return pickle.dumps(fn(spec, *pickle.loads(args)), protocol=5)


@lru_cache(maxsize=8)  # the champion's harness and the candidates a harness search tries
def _harness(spec: WorkerSpec) -> tuple[Harness, TaskFamily]:
    from rsi.hcp import load_harness
    from rsi.tasks import get_family

    harness = load_harness(spec.harness)
    if harness.hash != spec.harness_hash:
        raise RuntimeFailure(f"{spec.harness} changed on disk during the run (hash {harness.hash[:12]}, the run "
                             f"started with {spec.harness_hash[:12]}); restore it or start a new run")
    return harness, get_family(spec.family)


@lru_cache(maxsize=2)
def _backend(model_dir: str) -> GenerationBackend:
    from rsi.backends import get_backend

    return get_backend("hf", model_dir=model_dir)


def _rollout_shard(spec: WorkerSpec, tasks: list[Task], pair_id: str, params: SamplingParams,
                   adapter: str | None) -> tuple[list[Trajectory], list[Task]]:
    harness, family = _harness(spec)
    return posed(Responder(harness, _backend(spec.model_dir), pair_id, adapter, family), tasks, params)


def _audit_shard(spec: WorkerSpec, trajectories: list[Trajectory], tasks: dict[str, Task],
                 pair: Pair | None) -> list[Verdict]:
    harness, family = _harness(spec)
    return [audit(t, tasks[t.task_id], harness, family, pair) for t in trajectories]


def _solve_shard(spec: WorkerSpec, tasks: list[Task], pair_id: str, params: SamplingParams,
                 adapter: str | None) -> dict[str, bool]:
    harness, family = _harness(spec)
    return solved(Responder(harness, _backend(spec.model_dir), pair_id, adapter, family), tasks, params)
