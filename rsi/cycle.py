"""Moved: a lineage run's config, results and lease live in ``rsi.run`` (config, context, results, lease) and
``rsi.store`` (ledger, leases). The names stay importable from here for code written before the move."""

from rsi.errors import RuntimeFailure, UserError
from rsi.run.config import (
    PROFILES, CycleConfig, HarnessSearchSpec, Labels, deep_merge, latest_harness, load_config, parse_sets, profile_for,
)
from rsi.run.lease import holding_lease, keep_alive
from rsi.run.results import (
    STAGE_RESULTS, Audited, Champion, Discovered, Executed, HarnessCandidate, Judged, Registered, Searched, Selected,
    StageResult, Trained, read_result,
)
from rsi.store.leases import LeaseHeld, acquire_lease, heartbeat, release_lease
from rsi.store.ledger import fault_point

__all__ = [
    "PROFILES", "STAGE_RESULTS", "Audited", "Champion", "CycleConfig", "Discovered", "Executed", "HarnessCandidate",
    "HarnessSearchSpec", "Judged", "Labels", "LeaseHeld", "Registered", "RuntimeFailure", "Searched", "Selected",
    "StageResult", "Trained", "UserError", "acquire_lease", "deep_merge", "fault_point", "heartbeat", "holding_lease",
    "keep_alive", "latest_harness", "load_config", "parse_sets", "profile_for", "read_result", "release_lease",
]
