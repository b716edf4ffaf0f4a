"""Serving load: latency and requests/s of ``rsi serve`` against the engine it wraps, with 1, 8 and 32 clients.

Each client is a thread that sends ``--per-client`` requests one after another (bounded loopback load), and the
arms below take turns ``--rounds`` times at each client count, their latencies pooled, more rounds where
fewer would make under 768 requests an arm (1 client: 96 rounds of 8 requests; this VM's speed drifts from one
second to the next, and short rounds put the drift on both arms alike); every
request is a real chat completion: an addition question in the specialist's harness format (one level, so the
prompts have equal token length), model ``rsi/auto``, greedy, routed by the ngram router to the specialist.
The arms per engine and client count, measured in the same run, taking turns:

- ``proxy``: ``rsi serve`` started as a subprocess on a free loopback port, driven over HTTP (one keep-alive
  connection per client: ``Connection``, a lean HTTP/1.1 client; ``--client http.client`` for the standard
  library's);
- ``direct``, the baseline: the engine as the proxy runs it, called without the proxy, with the same prompts,
  sampling and adapter and the same number of client threads: per request the engine calls the proxy makes
  (``generate([prompt], ...)``, or the plan's calls when the champion's harness has a plan:
  ``rsi.mol.proxy.plan_answer``). For ``hf``, the ``HFBackend`` in a process of its own behind the dynamic
  batcher (``rsi.mol.process.EngineProcess``, as ``rsi serve`` starts it), so proxy/direct is what the proxy
  adds (HTTP, auth, rate limit, routing, conversation writes), not what batching gives; for ``vllm`` (the proxy
  with ``--engine openai``), the same calls to the vLLM server's own ``/v1/completions`` over HTTP;
- ``inprocess`` (``hf`` only): the ``HFBackend`` behind the same batcher in this process, no process boundary;
  proxy/inprocess adds the engine process's pipe hop and its sharing of the cores with the proxy;
- ``proxy-harvest``: the proxy again (the same server, connections of its own) while the traffic harvest runs
  beside it: a process of its own (this script's ``--harvester``) harvests the specialist's lineage from every
  turn stored so far (``rsi.mol.harvest.harvest``, as ``rsi run --from-traffic`` reads it: the state DB's
  conversations read and each turn judged), pass after pass; it is paused (SIGSTOP) while the other arms run.

It prints p50/p99 latency, requests/s and errors per arm, the proxy's own median time per stage (its replies'
``Server-Timing``: auth, prepare, engine, store), and the proxy over baseline ratios (p50, p99 latency;
requests/s), and writes them to ``bench/results/serve.json``. Beside the ratio of pooled p50s, ``p50 paired``
is the median over rounds of the proxy's p50 over the baseline's in the same round (arms measured seconds
apart, so the machine's drift from one round to the next cancels). The acceptance bound: no errors at 32
clients and proxy p50 <= 1.15x direct p50 (pooled), the harvest running or not.

Data: an RSI home with a promoted ``addition`` lineage (``make demo`` makes one in ./.rsi; or a copy of one).
The bench admits ``addition`` as a specialist and trains the ngram router there when they are missing, and
creates an API key for the run (revoked at the end). Run:

    RSI_HOME=/tmp/mol-home .venv/bin/python bench/serve.py [--engines hf,vllm] [--clients 1,8,32]
        [--per-client 8] [--level 4] [--client lean|http.client] [--out JSON]

``vllm`` needs the engine venv (``rsi engine install``); the bench starts the engine in RSI_HOME and stops it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from provenance import machine_info, run_config, write_result

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "serve.json"
SPECIALIST = "addition"
MIN_REQUESTS = 768  # requests per arm and client count at least: few clients run more rounds


@dataclass
class Arm:
    """One arm at one concurrency: latencies of the requests that succeeded, errors, wall time."""

    engine: str
    arm: str
    clients: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_ms: dict[str, float] = field(default_factory=dict)  # proxy arm: median ms per stage (Server-Timing)
    round_p50_ms: list[float] = field(default_factory=list)  # p50 of each round, in order

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


# ---- data ------------------------------------------------------------------------------------------------


def prepare() -> tuple[object, object, str, str]:
    """(store, champion, key name, key) of the home: the specialist admitted and the ngram router trained when
    missing; a home without a promoted addition lineage is an error that says what to run."""
    from rsi.config import get_settings
    from rsi.mol.registry import Registry, add_specialist
    from rsi.mol.routers import MANIFEST, router_dir, train_router
    from rsi.mol.state import create_key
    from rsi.store import open_store
    from rsi.store.schema import Generation

    home = get_settings().home
    store = open_store()
    registry = Registry(store, home)
    if SPECIALIST not in registry.champions():
        with store.session() as s:
            promoted = s.query(Generation).filter_by(lineage=SPECIALIST, status="promoted").first() is not None
        if not promoted:
            sys.exit(f"no promoted {SPECIALIST!r} lineage in RSI_HOME={home}: run `make demo` first (or point RSI_HOME "
                     "at a copy of a home that has one)")
        add_specialist(store, SPECIALIST, description="adds two numbers", levels=(1, 2, 3, 4, 5, 6, 7, 8))
    champions = registry.champions()
    manifest = router_dir(home, "ngram") / MANIFEST
    if not manifest.is_file() or json.loads(manifest.read_text())["names"] != sorted(champions):
        train_router("ngram", champions, home, per_level=32)
    name = f"bench-serve-{uuid.uuid4().hex[:8]}"
    return store, champions[SPECIALIST], name, create_key(store, name)


def questions(champion, level: int, count: int) -> list[str]:
    """Held-out addition questions at one level, as the specialist's harness writes them."""
    from rsi.mol.routers import user_text
    from rsi.tasks import get_family

    family = get_family(champion.harness.document.family)
    return [user_text(champion.harness, t.payload) for t in family.tasks("heldout", 0, level, count)]


# ---- load ------------------------------------------------------------------------------------------------


def load(send: Callable[[int, str], None], prompts: Sequence[str], clients: int, per_client: int, first: int = 0
         ) -> tuple[list[float], list[str], float]:
    """``clients`` threads, each sending ``per_client`` requests in a row, the prompts from ``first`` on: (latencies
    of the requests that succeeded, errors of those that raised, wall seconds)."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    gate = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        gate.wait()
        for k in range(per_client):
            prompt = prompts[(first + c * per_client + k) % len(prompts)]
            started = time.perf_counter()
            try:
                send(c, prompt)
            except Exception as exc:  # counted and reported, not fatal: the bench measures errors
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            with lock:
                latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    gate.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return latencies, errors, time.perf_counter() - started


def measure(engine: str, arm: str, send: Callable[[int, str], None], prompts: Sequence[str], clients: int,
            per_client: int, rounds: list[tuple[list[float], list[str], float]]) -> Arm:
    """One more round of ``load`` into ``rounds``, and the arm over all its rounds so far."""
    rounds.append(load(send, prompts, clients, per_client, len(rounds) * clients * per_client))
    latencies = [x for r in rounds for x in r[0]]
    errors = [e for r in rounds for e in r[1]]
    if rounds[-1][1]:
        print(f"{engine} {arm} x{clients}: {len(rounds[-1][1])} errors, first: {rounds[-1][1][0]}", file=sys.stderr)
    ms = sorted(1000 * x for x in latencies) or [float("nan")]
    return Arm(engine, arm, clients, clients * per_client * len(rounds), len(errors), sum(r[2] for r in rounds),
               statistics.median(ms), ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
               round_p50_ms=[1000 * statistics.median(r[0]) if r[0] else float("nan") for r in rounds])


class Connection:
    """One keep-alive HTTP/1.1 connection of the load generator: a request is one ``sendall`` of its head and
    body, a response is read as its status line, its headers (a dict, lower-case names) and a Content-Length
    body -- lean, as ``wrk``-style generators are, so the latency measured is the server's, not a client
    library's (``http.client`` sends the head and the body as two writes and parses headers with ``email``;
    ``--client http.client`` measures the proxy through it instead). Reconnects when the server closed the
    connection while it was idle (between rounds); such a request is sent once more."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.sock: socket.socket | None = None

    def request(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of one POST."""
        for attempt in (1, 2):
            reused = self.sock is not None
            try:
                return self._exchange(path, headers, body)
            except (BrokenPipeError, ConnectionResetError):  # http.client's RemoteDisconnected is one too
                self.close()
                if not reused or attempt == 2:  # only a connection that was idle may have been closed by the server
                    raise
            except (OSError, http.client.HTTPException):
                self.close()
                raise
        raise AssertionError("unreachable")

    def _exchange(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.sock is None:
            self.sock = socket.create_connection(self.address, timeout=120)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.reader = self.sock.makefile("rb")
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {self.address[0]}:{self.address[1]}\r\n{head}"
                           f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body)
        status_line = self.reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection")
        got = {}
        while (line := self.reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            got[name.strip().lower()] = value.strip()
        data = self.reader.read(int(got.get("content-length", 0)))
        if got.get("connection", "").lower() == "close":
            self.close()
        return int(status_line.split()[1]), got, data

    def close(self) -> None:
        if self.sock is not None:
            self.reader.close()
            self.sock.close()
            self.sock = None


class StdlibConnection(Connection):
    """``Connection`` on the standard library's ``http.client`` (``--client http.client``)."""

    def _exchange(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.sock is None:
            self.sock = http.client.HTTPConnection(*self.address, timeout=120)
        self.sock.request("POST", path, body=body, headers=headers)
        r = self.sock.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


CLIENTS = {"lean": Connection, "http.client": StdlibConnection}


def proxy_sender(url: str, key: str, clients: int, stages: list[dict[str, float]], client: str = "lean"
                 ) -> Callable[[int, str], None]:
    """A chat completion through the proxy, on the client's keep-alive connection (``CLIENTS[client]``); a
    reply not 200, or not from the specialist, is an error. Each reply's ``Server-Timing`` (ms per stage in
    the proxy) is appended to ``stages``."""
    host, _, port = url.removeprefix("http://").partition(":")
    pool = [CLIENTS[client](host, int(port)) for _ in range(clients)]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def send(c: int, prompt: str) -> None:
        body = json.dumps({"model": "rsi/auto", "messages": [{"role": "user", "content": prompt}]}).encode()
        status, got, text = pool[c].request("/v1/chat/completions", headers, body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {text[:200]!r}")
        if got.get("x-rsi-specialist") != SPECIALIST:
            raise RuntimeError(f"routed to {got.get('x-rsi-specialist')!r}, not {SPECIALIST!r}")
        json.loads(text)
        stages.append({name.strip(): float(dur) for name, _, dur in
                       (part.partition(";dur=") for part in got["server-timing"].split(","))})

    return send


@contextmanager
def proxy(engine: str, program: Sequence[str] | None = None) -> Iterator[str]:
    """``rsi serve`` in a subprocess on a free loopback port (no practical rate limit), stopped by SIGTERM;
    ``program``: what runs ``serve ARGS`` instead of ``python -m rsi``."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [*(program or [sys.executable, "-m", "rsi"]), "serve", "--port", str(port), "--engine", engine, "--rate", "1e6",
           "--burst", "1000000"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                sys.exit(f"`rsi serve` exited with code {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                sys.exit("`rsi serve` did not answer /health within 300 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


class Harvester:
    """The harvest as a process of its own (``--harvester``), paused but while ``running()``; ``report()``: its
    passes and the turns they read, once stopped."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--harvester"], env=env, cwd=REPO,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":  # its first pass done: imports and caches paid
            sys.exit(f"the harvester exited with code {self.proc.wait()} before its first pass")
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.seconds = 0.0

    @contextmanager
    def running(self) -> Iterator[None]:
        os.kill(self.proc.pid, signal.SIGCONT)
        started = time.perf_counter()
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.seconds += time.perf_counter() - started

    def stop(self) -> dict:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=300)
        return json.loads(out.strip().splitlines()[-1]) | {"seconds_running": self.seconds}


def harvester() -> None:
    """``--harvester``: harvest the specialist's lineage from every stored turn, pass after pass, until SIGTERM;
    prints 'ready' after the first pass and, at the end, its passes and the turns they read (JSON)."""
    from rsi.config import get_settings
    from rsi.mol.harvest import harvest
    from rsi.mol.registry import Registry
    from rsi.store import open_store

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    store = open_store()
    champion = Registry(store, get_settings().home).champions()[SPECIALIST]
    passes = turns = 0
    while not stop.is_set():
        got = harvest(store, champion.harness, champion.pair_id, [champion.specialist])
        passes, turns = passes + 1, turns + len(got.passed) + len(got.failed) + sum(got.skipped.values())
        if passes == 1:
            print("ready", flush=True)
    print(json.dumps({"passes": passes - 1, "turns_read": turns}), flush=True)  # the first pass: before the arms


# ---- engines: the baseline arms ------------------------------------------------------------------------------


def engine_sender(champion, backend, params) -> Callable[[int, str], None]:
    """A request's engine work as the proxy does it, without the proxy: the plan's calls when the champion's
    harness has a plan (``rsi.pair.Responder.answer_task``), else one ``generate`` of the prompt."""
    from rsi.models import Message
    from rsi.pair import Responder

    adapter = str(champion.adapter_dir)
    pair = Responder(champion.harness, backend, champion.pair_id, adapter)
    plan = champion.harness.document.plan is not None

    def send(c: int, prompt: str) -> None:
        task = pair.posed(Message(role="user", content=prompt)) if plan else None
        if task is not None:
            pair.answer_task(task, params)
        else:
            backend.generate([prompt], params, adapter=adapter)

    return send


@contextmanager
def direct_hf(champion, params, inprocess: bool = False) -> Iterator[Callable[[int, str], None]]:
    """The engine as ``rsi serve`` runs it: an ``HFBackend`` in a process of its own behind the dynamic batcher
    (``rsi.mol.process.EngineProcess``), driven from this process; ``inprocess``: the ``HFBackend`` behind the
    same batcher in this process, no process boundary at all."""
    from rsi.backends.hf import HFBackend
    from rsi.mol.batching import Batcher
    from rsi.mol.process import EngineProcess

    backend = Batcher(HFBackend(champion.base_dir)) if inprocess else EngineProcess("hf", model_dir=champion.base_dir)
    try:
        yield engine_sender(champion, backend, params)
    finally:
        backend.close()


@contextmanager
def direct_vllm(champion, params) -> Iterator[Callable[[int, str], None]]:
    """rsi's vLLM engine over its own HTTP API (rsi's openai backend: ``/v1/completions``, the specialist's adapter
    loaded at runtime); the proxy with ``--engine openai`` finds the same engine running and uses it."""
    from rsi import engine
    from rsi.backends.openai import OpenAIBackend
    from rsi.config import get_settings

    state = engine.start(champion.base_dir, get_settings().home)
    backend = OpenAIBackend(state.base_url, tokenizer_dir=champion.base_dir)
    try:
        yield engine_sender(champion, backend, params)
    finally:
        backend.close()
        if "already running" not in (state.note or ""):
            engine.stop(get_settings().home)


def run_engine(engine: str, champion, key: str, prompts: list[str], clients: list[int], per_client: int,
               rounds: int, client: str = "lean", harvest: bool = True) -> tuple[list[Arm], dict | None]:
    """Every arm at each client count, in turn, ``rounds`` times or more (the machine's speed drifts); and what
    the harvester did (None without the harvest arm)."""
    from rsi.mol.proxy import specialist_params

    params = specialist_params(champion.harness, None)
    baselines = ({"direct": direct_hf, "inprocess": partial(direct_hf, inprocess=True)} if engine == "hf"
                 else {"direct": direct_vllm})
    arms, harvester = [], None
    with ExitStack() as stack:
        senders = {name: stack.enter_context(make(champion, params)) for name, make in baselines.items()}
        url = stack.enter_context(proxy("hf" if engine == "hf" else "openai"))
        stages: dict[str, list[dict[str, float]]] = {"proxy": [], "proxy-harvest": []}
        senders["proxy"] = proxy_sender(url, key, max(clients), stages["proxy"], client)
        if harvest:
            senders["proxy-harvest"] = proxy_sender(url, key, max(clients), stages["proxy-harvest"], client)
        for send in senders.values():  # warm-up: adapters loaded, first-call costs paid
            load(send, prompts, 4, 2)
        report: dict = {}
        if harvest:  # after the warm-up: it has turns to read
            harvester = Harvester()
            stack.callback(lambda: report.update(harvester.stop()))
        for n in clients:
            done: dict[str, list] = {name: [] for name in senders}
            for kept in stages.values():
                kept.clear()
            # few clients run more rounds, not longer ones: the arms take turns every few seconds at most
            for _ in range(max(rounds, -(-MIN_REQUESTS // (n * per_client)))):
                last = {}
                for name, send in senders.items():
                    with harvester.running() if name == "proxy-harvest" else nullcontext():
                        last[name] = measure(engine, name, send, prompts, n, per_client, done[name])
            for name, kept in stages.items():
                if name in last and kept:
                    last[name].server_ms = {k: statistics.median(t[k] for t in kept) for k in kept[0]}
            arms += last.values()
    return arms, report if harvest else None


# ---- report ----------------------------------------------------------------------------------------------


def ratios(arms: list[Arm]) -> list[dict]:
    """Proxy over each baseline arm per engine and client count: p50 and p99 latency, requests/s."""
    by = {(a.engine, a.arm, a.clients): a for a in arms}
    out = []
    for (engine, arm, n), p in by.items():
        if not arm.startswith("proxy"):
            continue
        for d in (a for a in arms if a.engine == engine and a.clients == n and not a.arm.startswith("proxy")):
            paired = statistics.median(x / y for x, y in zip(p.round_p50_ms, d.round_p50_ms, strict=True))
            out.append({"engine": engine, "clients": n, "arm": arm, "baseline": d.arm, "p50": p.p50_ms / d.p50_ms,
                        "p50_paired": paired, "p99": p.p99_ms / d.p99_ms,
                        "requests_per_s": p.requests_per_s / d.requests_per_s, "proxy_errors": p.errors})
    return out


def print_table(arms: list[Arm], rows: list[dict]) -> None:
    print("| engine | clients | arm | requests | errors | p50 ms | p99 ms | req/s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for a in arms:
        print(f"| {a.engine} | {a.clients} | {a.arm} | {a.requests} | {a.errors} | {a.p50_ms:.1f} | {a.p99_ms:.1f} "
              f"| {a.requests_per_s:.1f} |")
    print()
    stages = [a for a in arms if a.server_ms]
    if stages:
        names = list(stages[0].server_ms)
        print("| engine | clients | arm | " + " | ".join(f"{n} ms (p50)" for n in names) + " |")
        print("|---|---:|---|" + "---:|" * len(names))
        for a in stages:
            print(f"| {a.engine} | {a.clients} | {a.arm} | " + " | ".join(f"{a.server_ms[n]:.2f}" for n in names)
                  + " |")
        print()
    print("| engine | clients | arm | over | p50 | p50 paired | p99 | req/s |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['clients']} | {r['arm']} | {r['baseline']} | {r['p50']:.2f}x "
              f"| {r['p50_paired']:.2f}x | {r['p99']:.2f}x | {r['requests_per_s']:.2f}x |")


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf", help="comma-separated, of hf and vllm")
    parser.add_argument("--clients", default="1,8,32", help="comma-separated concurrent client counts")
    parser.add_argument("--per-client", type=int, default=8, help="requests each client sends per round")
    parser.add_argument("--rounds", type=int, default=6, help=f"times each arm runs, alternating, pooled (more "
                        f"where fewer would make under {MIN_REQUESTS} requests)")
    parser.add_argument("--level", type=int, default=4, help="addition level of the questions")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="lean",
                        help="the load generator's HTTP client (proxy arm)")
    parser.add_argument("--no-harvest", dest="harvest", action="store_false",
                        help="leave out the proxy-harvest arm")
    parser.add_argument("--harvester", action="store_true", help=argparse.SUPPRESS)  # the bench's own child
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.harvester:
        harvester()
        return {}

    from rsi.mol.state import revoke_key

    clients = [int(c) for c in args.clients.split(",")]
    store, champion, key_name, key = prepare()
    prompts = questions(champion, args.level, max(max(clients) * args.per_client, 64))
    arms: list[Arm] = []
    harvested = {}
    try:
        for engine in args.engines.split(","):
            got, harvested[engine.strip()] = run_engine(engine.strip(), champion, key, prompts, clients,
                                                        args.per_client, args.rounds, args.client, args.harvest)
            arms += got
    finally:
        revoke_key(store, key_name)
    rows = ratios(arms)
    print_table(arms, rows)
    report = {
        "command": "python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "specialist": {"name": SPECIALIST, "generation": champion.generation, "harness": champion.harness.id,
                       "base": str(champion.base_dir)},
        "level": args.level, "per_client": args.per_client, "rounds": args.rounds, "client": args.client,
        "arms": [asdict(a) | {"requests_per_s": a.requests_per_s} for a in arms],
        "proxy_over": rows,
        "harvester": harvested,  # per engine: its passes, the turns they read, its seconds running (None: no arm)
        "machine": machine_info(None),
    }
    write_result(args.out, report, run_config(args))
    return report


if __name__ == "__main__":
    main()
