"""Prefect flows of rsi: the cycle stage by stage (``rsi-cycle``) and generations of it (``rsi-lineage``).

Importing the package sets what Prefect reads when it is imported: rsi's server or the ephemeral API in
RSI_HOME, quiet logging, no telemetry."""

import os
import warnings

from rsi.config import get_settings

get_settings().configure_prefect()  # a configured server or profile, else the ephemeral API in RSI_HOME
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry; it also locks SQLite
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # rsi logs outside a run: no warning
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# PEFT 0.21 calls an attribute transformers 5 renamed; harmless, and it would print once per adapter load.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
