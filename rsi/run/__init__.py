"""A lineage run: its config (profiles as data), its context (serializable) and live objects, the lease, the
stage ledger's results and the scores. The stages themselves read top to bottom in ``flows/cycle.py``."""

from rsi.run.config import (
    PROFILES, CycleConfig, HarnessSearchSpec, deep_merge, latest_harness, load_config, parse_sets, profile_for,
    starting_harness,
)
from rsi.run.context import Run, RunContext, open_run
from rsi.run.lease import holding_lease, keep_alive
from rsi.run.results import (
    Audited, Champion, Discovered, Executed, GenerationSummary, HarnessCandidate, Judged, Registered, Searched,
    Selected, Trained, read_result,
)

__all__ = [
    "PROFILES", "Audited", "Champion", "CycleConfig", "Discovered", "Executed", "GenerationSummary",
    "HarnessCandidate", "HarnessSearchSpec", "Judged", "Registered", "Run", "RunContext", "Searched", "Selected",
    "Trained", "deep_merge", "holding_lease", "keep_alive", "latest_harness", "load_config", "open_run",
    "parse_sets", "profile_for", "read_result", "starting_harness",
]
