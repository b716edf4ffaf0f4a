"""How rsi's flows run in Prefect: rsi's log lines (logger ``rsi``) in the runs' Logs tab, or handed to a
callback (the CLI's live display, a test's list) instead of Prefect's console format; the retry policy of the
stages that call servers; a scheduled run's credentials, read from a Prefect Secret block."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any
from contextlib import contextmanager

from prefect.logging.handlers import APILogHandler
from prefect.tasks import exponential_backoff

from rsi import stop
from rsi.errors import RsiError, UserError
from rsi.run import CycleConfig

Events = Callable[[str], None]
SECRET_BLOCK = "RSI_SECRET_BLOCK"  # a scheduled run's environment variable: the Secret block of its credentials
_rsi_log = logging.getLogger("rsi")
_rsi_log.setLevel(logging.INFO)
if not any(isinstance(h, APILogHandler) for h in _rsi_log.handlers):
    _rsi_log.addHandler(APILogHandler())  # rsi's lines show in the flow and task runs' Logs tab


def _prompt_stop_in_flow_runs() -> None:
    """During a flow run Prefect's own SIGTERM handler replaces rsi's and hands the signal on only after reporting
    the crash; wrapped, a SIGTERM starts rsi's prompt stop first (``rsi.stop``)."""
    from prefect.utilities import engine

    handler = getattr(engine, "_prefect_sigterm_handler", None)
    if handler is None or getattr(handler, "rsi_stop", False):
        return

    def stopping(signum: int, frame: Any) -> None:
        stop.begin(signum)
        handler(signum, frame)

    stopping.rsi_stop = True
    engine._prefect_sigterm_handler = stopping


_prompt_stop_in_flow_runs()


class Progress(str):
    """A log line that reports a step of long work (``rsi.run.base.PROGRESS``): a terminal shows it as its live
    line, a pipe or a file is not sent it."""


class _Events(logging.Handler):
    """rsi's log lines, handed to a callback (the CLI's live display, a test's list); a step of long work as a
    ``Progress``."""

    def __init__(self, events: Events):
        super().__init__(logging.INFO)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.events(Progress(message) if getattr(record, "progress", False) else message)


@contextmanager
def forwarding(events: Events) -> Iterator[None]:
    """rsi's log lines go to ``events`` (and to the Prefect run), not also to Prefect's console format."""
    handler, propagate = _Events(events), _rsi_log.propagate
    _rsi_log.addHandler(handler)
    _rsi_log.propagate = False
    try:
        yield
    finally:
        _rsi_log.removeHandler(handler)
        _rsi_log.propagate = propagate


def _retry_unless_rsi_error(task, task_run, state) -> bool:
    """Retry what may be transient (a server call that failed), never rsi's own verdicts (lease lost, bad input)."""
    try:
        state.result()
    except RsiError:
        return False
    except Exception:  # noqa: BLE001 - anything else may pass on a second try
        return True
    return False


SERVER_RETRIES = {"retries": 3, "retry_delay_seconds": exponential_backoff(backoff_factor=5),
                  "retry_condition_fn": _retry_unless_rsi_error}


def flow_parameters(config: CycleConfig) -> dict[str, Any]:
    """``rsi-lineage``'s parameters for a config: the named fields, and the rest as overrides of no profile
    (the whole config, so the flow rebuilds exactly this one)."""
    rest = config.model_dump(mode="json", exclude={"family", "lineage", "harness"})
    return {"family": config.family, "lineage": config.lineage, "harness": config.harness, "profile": None,
            "overrides": rest}


def secret_environment() -> None:
    """In a scheduled run: the credentials ``rsi deploy`` kept in the Prefect Secret block named by
    ``RSI_SECRET_BLOCK``, into this process's environment (none named: nothing to do)."""
    name = os.environ.get(SECRET_BLOCK)
    if not name:
        return
    from prefect.blocks.system import Secret

    try:
        values = Secret.load(name).get()  # Prefect reads the JSON it was saved as back into a dict
        values = values if isinstance(values, dict) else json.loads(values)
    except ValueError as exc:
        raise UserError(f"the Prefect Secret block {name!r} that holds this deployment's credentials cannot be "
                        f"read ({exc}); run `rsi deploy` for the lineage again") from None
    os.environ.update({k: str(v) for k, v in values.items()})
