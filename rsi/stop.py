"""A prompt stop: what the first Ctrl-C or SIGTERM starts (``rsi.cli``'s handler, and Prefect's own SIGTERM handler
during a flow run, which ``rsi.flows.runtime`` wraps). A terminal's Ctrl-C reaches the embedded Prefect server too
(one process group), so from then on a call to the Prefect API is not retried: the crash report and the last log
lines reach a live API at once and are dropped for a gone one, instead of a minute of retries. Unwinding (finally
blocks release the lineage's lease; the stage left is resumable) gets ``GRACE_S``; then, or at a second signal, the
process stops what it started and exits."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

GRACE_S = 8.0
stopped: list[int] = []  # the first stop signal's number, once one came


def begin(signum: int) -> None:
    """The first stop signal: Prefect calls fail at once, and the process exits within ``GRACE_S`` whatever
    unwinding still waits on; a second signal exits at once."""
    if stopped:
        _exit(signum)
    stopped.append(signum)
    if "prefect.settings" in sys.modules:
        from prefect.settings import get_current_settings

        get_current_settings().client.max_retries = 0
    threading.Thread(target=_exit_after_grace, args=(signum,), daemon=True, name="rsi-stop").start()


def _exit_after_grace(signum: int) -> None:
    time.sleep(GRACE_S)
    print(f"stopped ({signal.Signals(signum).name}): unwinding did not end within {GRACE_S:.0f} s; the lineage's "
          "stage is left to resume", file=sys.stderr, flush=True)
    _exit(signum)


def _exit(signum: int) -> None:
    """Stop this process's children (the embedded Prefect server, an engine process) and exit 128 + signum."""
    for child in children():
        try:
            os.kill(child, signal.SIGTERM)
        except OSError:
            pass
    os._exit(128 + signum)


def children() -> list[int]:
    """This process's children (from /proc; none where there is no /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found
