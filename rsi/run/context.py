"""A lineage run: ``RunContext``, the serializable part (config, where state lives, the lease it writes under),
and ``Run``, the live objects built from it (store, ledger, harnesses, base model, runner, registry).

A stage takes the ``Run`` of its process and ids; any process rebuilds the same ``Run`` from the context's JSON
(``flows/stage.py`` runs one stage that way), so nothing is looked up in a module global."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from rsi.config import Settings
from rsi.errors import UserError
from rsi.hcp import Harness, load_harness
from rsi.models import Pair
from rsi.run.base import Base
from rsi.run.config import CycleConfig
from rsi.run.data import TrainingData
from rsi.run.judge import Judge
from rsi.run.proposals import Proposer
from rsi.run.register import Registrar
from rsi.run.harnesses import Harnesses
from rsi.run.results import STAGE_RESULTS, Champion, read_result
from rsi.run.scores import Scores
from rsi.run.screen import Screen
from rsi.run.training import Training
from rsi.store import Store, open_store
from rsi.store.leases import Fence
from rsi.store.ledger import Ledger
from rsi.tasks import get_family

SECRETS = {"engine_api_key"}  # read from the environment of each process, never written into a context
URLS = ("database_url", "mlflow_tracking_uri", "prefect_api_url")  # left out too where they carry a password


class RunContext(BaseModel):
    """What a stage needs besides ids to run in any process: the lineage's config, the settings in effect (no
    secrets) and the lease holder and fencing token its writes go under (None: not leased yet)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: CycleConfig
    settings: dict[str, Any]
    holder: str | None = None
    token: int | None = None

    @classmethod
    def of(cls, config: CycleConfig, settings: Settings) -> RunContext:
        """The context of ``config`` under ``settings``, without secrets: an API key, or a URL with a password,
        is read from the environment of the process that runs the stage (a flow's parameters are stored and
        shown by Prefect)."""
        values = settings.model_dump(mode="json", exclude=SECRETS)
        return cls(config=config, settings={k: v for k, v in values.items()
                                            if not (k in URLS and v and urlsplit(v).password)})

    def leased(self, fence: Fence) -> RunContext:
        """This context writing under ``fence``'s holder and token."""
        return self.model_copy(update={"holder": fence.holder, "token": fence.token})


class Run:
    """The live objects of one lineage run, built from its context (never stored in it) and closed with it."""

    def __init__(self, context: RunContext, store: Store | None = None):
        config, settings = context.config, Settings(**context.settings)
        self.context, self.config, self.settings = context, config, settings
        self.store = store or open_store(settings.db_url)
        self.fence = Fence(self.store, config.lineage, context.holder, context.token)
        self.family = get_family(config.family)
        start = load_harness(config.harness)  # the harness the lineage starts under
        if start.document.family != self.family.name:
            raise UserError(f"harness {start.id} is for family {start.document.family!r}, not {self.family.name!r}")
        refuse_unsupported(start)
        self.harnesses = Harnesses(self.store, settings.home, start, self.family, config.curriculum)
        self.ledger = Ledger(self.fence, config.digest, read_result, STAGE_RESULTS)
        self.base = Base(config, settings, start)
        from rsi.lineage import LineageRegistry
        from rsi.runners import make_runner

        self.registry = LineageRegistry(settings, config.lineage)
        self.runner = make_runner(self)  # where execute, audit and evaluation run (rsi.runners)
        self.scores = Scores(config, self.fence, self.runner, self.harnesses)
        search = config.harness_search
        self.screen = Screen(self.runner, self.family, config.seed, search.screen_n, search.probe_samples)
        self.proposer = Proposer(config, self.family, self.ledger, self.runner, self.pair)  # where tasks come from
        self.data = TrainingData(self.ledger, self.harnesses, self.family)
        self.judge = Judge(config, self.ledger, self.scores, self.harnesses, self.family, self.pair,
                           self.champions)
        self.training = Training(config, self.fence, self.registry, self.base)
        self.registrar = Registrar(self.registry, self.ledger, self.harnesses, self.base, self.judge)
        self.ledger.ensure_lineage(start, config.family, config.model_dump(mode="json"))

    def pair(self, adapter_hash: str | None, harness: Harness | None = None) -> Pair:
        """The pair of this run's base, ``adapter_hash`` and ``harness`` (default: the lineage's first)."""
        harness = harness or self.harnesses.start
        return Pair(base_model_hash=self.base.hash, adapter_hash=adapter_hash, harness_id=harness.id,
                    harness_hash=harness.hash)

    def champion(self, number: int) -> Champion:
        """The pair generation ``number`` starts from: the latest promoted candidate before it, else the start."""
        return champion_before(self.ledger, start_pair(self.config.start_adapter, self.pair), number,
                               self.config.start_adapter)

    def champions(self) -> list[str]:
        """The start pair and every promoted candidate, in lineage order."""
        return champion_pairs(self.ledger, start_pair(self.config.start_adapter, self.pair).id)

    def close(self) -> None:
        self.runner.close()
        self.base.close()
        self.store.dispose()


def start_pair(adapter: str | None, pair: Callable[[str | None], Pair]) -> Pair:
    """The base with the lineage's ``start_adapter`` (none: the bare base) under its first harness (``pair``: the
    run's, adapter hash -> pair)."""
    if adapter is None:
        return pair(None)
    from rsi.train import adapter_hash

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise UserError(f"start_adapter {adapter}: no adapter_config.json there; give the directory of a LoRA "
                        "adapter trained on this base (a lineage's champion: `rsi lineage show`)")
    return pair(adapter_hash(Path(adapter)))


def champion_before(ledger: Ledger, base: Pair, number: int, adapter_dir: str | None = None) -> Champion:
    """The latest promoted candidate of a generation before ``number``, else the ``base`` pair (with
    ``adapter_dir``, the lineage's start adapter, where it has one)."""
    for row in reversed(ledger.finished()):
        if row.number < number and row.status == "promoted":
            # a finished generation has both results: register commits them with its status
            registered, trained = ledger.result(row, "register"), ledger.result(row, "train")
            pair = ledger.load_pair(row.candidate_pair_id)
            return Champion(pair_id=row.candidate_pair_id, adapter_dir=trained.adapter_dir,
                            version=registered.version, generation=row.number, harness_id=pair.harness_id,
                            harness_hash=pair.harness_hash)
    ledger.save_pair(base, adapter_dir, None)
    return Champion(pair_id=base.id, adapter_dir=adapter_dir, version="start" if adapter_dir else "base", generation=0,
                    harness_id=base.harness_id, harness_hash=base.harness_hash)


def champion_pairs(ledger: Ledger, base_id: str) -> list[str]:
    """The base pair and every promoted candidate, in lineage order."""
    return [base_id] + [g.candidate_pair_id for g in ledger.finished() if g.status == "promoted"]


def refuse_unsupported(harness: Harness) -> None:
    """Harness fields the cycle cannot honour yet are refused, never silently ignored."""
    model = harness.document.model
    if model.adapter != "lineage":
        raise UserError(f"{harness.path}: field 'model.adapter': rsi run trains the lineage's adapters, so it needs "
                        f"adapter = \"lineage\" (got {model.adapter!r})")


@contextmanager
def open_run(context: RunContext) -> Iterator[Run]:
    """The live run of ``context`` in this process, closed at the end."""
    run = Run(context)
    try:
        yield run
    finally:
        run.close()
