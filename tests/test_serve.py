"""Mixture-of-LoRA serving (``rsi.mol``): the specialist registry, the routers, and ``rsi serve`` answering the
official ``openai`` client over HTTP, on the tiny base with two real LoRA specialists (addition, sorting).

The specialists' lineages are state DB rows written here (a lineage, its harness, a pair, a promoted
generation) around adapters trained with ``rsi.train`` on the families' own answers, which takes seconds; the
cycle that would promote them is tested in test_cycle.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest

from .conftest import REPO
from .test_cycle import seed_home

if TYPE_CHECKING:
    from rsi.backends.base import Completion

ADDITION_LEVELS = (1, 2, 3)
SORTING_LEVELS = (1, 2)


def _train(base: Path, examples: list, out: Path, steps: int) -> Path:
    from rsi.select import Dataset
    from rsi.train import TrainSpec, train_adapter

    spec = TrainSpec(steps=steps, batch_size=16, warmup=4, lr=1e-2, lora_r=8, lora_alpha=16)
    train_adapter(base, None, Dataset(examples=tuple(examples)), spec, out, seed=0)
    return out


def addition_examples() -> list:
    from rsi.hcp import load_harness
    from rsi.parsers import digits_lsb
    from rsi.select import Example
    from rsi.tasks import get_family

    harness, family = load_harness("addition/v2"), get_family("addition")
    return [Example(trajectory_id=t.id, level=t.level, prompt=harness.prompt(t.payload),
                    completion=digits_lsb(t.answer, 11), source="frontier")
            for lvl in ADDITION_LEVELS for t in family.tasks("train", 11, lvl, 48)]


def sorting_examples() -> list:
    """The first turn of the expert's episodes: a list, then the call the expert makes first."""
    from rsi.hcp import load_harness
    from rsi.hcp.plays import demonstration
    from rsi.select import Example
    from rsi.tasks import get_family

    harness, family = load_harness("sorting/v1"), get_family("sorting")
    return [Example(trajectory_id=t.id, level=lvl, prompt=harness.prompt(t.payload),
                    completion=demonstration(harness, family, t).messages[1].content, source="frontier")
            for lvl in SORTING_LEVELS for t in family.tasks("train", 11, lvl, 48)]


STEPS = {"addition": (30, 60, 120, 240), "sorting": (40, 80, 160, 320)}


@pytest.fixture(scope="module")
def adapters(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real LoRA specialists on the tiny base, trained once for this module, each until it has learned what
    the tests probe: how far a few steps get depends on the CPU's float kernels (an AVX-512 Xeon's sorting
    specialist said "done" after 40 steps), so each trains again with twice the steps until some held-out
    prompt tells its replies from the base's (addition) or gets a tool call (sorting), and the module fails
    naming the steps tried when even the last count does not get there."""
    from rsi.backends import get_backend

    backend, root = get_backend("hf", model_dir=tiny_base), tmp_path_factory.mktemp("specialists")
    learned = {"addition": lambda out: find_addition_probes(backend, out),
               "sorting": lambda out: find_sorting_call(backend, out)}
    examples = {"addition": addition_examples, "sorting": sorting_examples}
    trained = {}
    for name, schedule in STEPS.items():
        for steps in schedule:
            out = _train(tiny_base, examples[name](), root / f"{name}-{steps}", steps)
            if learned[name](out):
                trained[name] = out
                break
        else:
            pytest.fail(f"the {name} specialist learned nothing the tests can probe after {schedule} steps: see "
                        "addition_probes and sorting_call in tests/test_serve.py")
    return trained


def promote(store, lineage: str, family: str, harness_ref: str, adapter: Path, base: Path, number: int = 1) -> None:
    """State DB rows of a lineage whose generation ``number`` is promoted with ``adapter`` on ``base``."""
    from rsi.basemodel import model_hash
    from rsi.run import load_config
    from rsi.hcp import load_harness
    from rsi.models import Pair
    from rsi.store.harnesses import lock_harness
    from rsi.store.schema import Generation, Lineage, PairRow
    from rsi.train import adapter_hash

    harness = load_harness(harness_ref)
    pair = Pair(base_model_hash=model_hash(base), adapter_hash=adapter_hash(adapter), harness_id=harness.id,
                harness_hash=harness.hash)
    with store.session() as s:
        lock_harness(s, harness)
        if s.get(Lineage, lineage) is None:
            s.add(Lineage(name=lineage, family=family, spec=load_config("tiny", family=family, lineage=lineage,
                                                                       harness=harness_ref).model_dump(mode="json")))
        if s.get(PairRow, pair.id) is None:
            s.add(PairRow(id=pair.id, lineage=lineage, base_model_hash=pair.base_model_hash,
                          adapter_hash=pair.adapter_hash, adapter_uri=str(adapter), harness_id=harness.id,
                          harness_hash=harness.hash))
        s.add(Generation(lineage=lineage, number=number, candidate_pair_id=pair.id, status="promoted"))


@pytest.fixture
def served(adapters: dict[str, Path], tiny_base: Path, rsi_home: Path):
    """A state DB (SQLite in RSI_HOME) with the addition and sorting specialists admitted and an ngram router."""
    from rsi.store import open_store

    store = admit_both(open_store(), adapters, tiny_base, rsi_home)
    yield store
    store.dispose()


def admit_both(store, adapters: dict[str, Path], tiny_base: Path, rsi_home: Path):
    from rsi.mol.registry import Registry, add_specialist
    from rsi.mol.routers import train_router

    seed_home(rsi_home, tiny_base)
    promote(store, "addition", "addition", "harness_versions/addition/v2", adapters["addition"], tiny_base)
    promote(store, "sorting", "sorting", "harness_versions/sorting/v1", adapters["sorting"], tiny_base)
    add_specialist(store, "addition", description="adds two numbers", levels=ADDITION_LEVELS)
    add_specialist(store, "sorting", description="sorts digits by swaps", levels=SORTING_LEVELS)
    train_router("ngram", Registry(store, rsi_home).champions(), rsi_home, per_level=16)
    return store


# ---- probes, chosen by what the specialists answer on this machine ----------------------------------------------
# The specialists train for seconds on a tiny base, and float kernels differ between CPUs, so which reply a given
# task gets differs between machines. A test that needs a reply telling the adapter from the base, or a tool call,
# asks the models directly which held-out task gives one, then checks that the proxy serves that reply.


def candidates(harness, levels: Sequence[int], per_level: int = 16) -> list[str]:
    """Held-out tasks of the harness's family at ``levels``, as the harness poses them."""
    from rsi.tasks import get_family

    family = get_family(harness.document.family)
    return [harness.prompt(t.payload) for lvl in levels for t in family.tasks("heldout", 3, lvl, per_level)]


def direct_replies(backend, prompts: list[str], params, adapter: Path | None = None) -> list[Completion]:
    return [row[0] for row in backend.generate(prompts, params, adapter=adapter and str(adapter))]


class AdditionProbe(NamedTuple):
    prompt: str
    reply: Completion  # the addition specialist's, decoded as the proxy decodes for its harness
    base: Completion  # the base's, as the proxy answers ``rsi/base``


def addition_probes(backend, adapter: Path) -> list[AdditionProbe]:
    """The held-out addition prompts on which the adapter's greedy reply is not the base's (decoded as the
    specialist is, or as the base is served), so a reply shows which model answered; fails when there is none."""
    probes = find_addition_probes(backend, adapter)
    if not probes:
        pytest.fail("no held-out prompt where the addition adapter and the base differ: the served fixture's "
                    "adapter did not learn; train it longer in `adapters` (tests/test_serve.py)")
    return probes


def find_addition_probes(backend, adapter: Path) -> list[AdditionProbe]:
    from rsi.backends.base import SamplingParams
    from rsi.hcp import load_harness
    from rsi.mol.proxy import ServeConfig, specialist_params

    harness = load_harness("addition/v2")
    prompts, params = candidates(harness, ADDITION_LEVELS), specialist_params(harness, None)
    served_base = SamplingParams(max_new_tokens=ServeConfig().max_tokens)
    rows = zip(prompts, direct_replies(backend, prompts, params, adapter), direct_replies(backend, prompts, params),
               direct_replies(backend, prompts, served_base))
    return [AdditionProbe(p, mine, base) for p, mine, same_params, base in rows
            if mine.text and mine.text not in (same_params.text, base.text)]


def sorting_call(backend, adapter: Path) -> tuple[str, str, dict]:
    """A held-out sorting prompt the specialist answers with a call to one of its harness's tools (as the proxy
    reads a reply), and that call: (prompt, tool, arguments); fails when it answers none with a call."""
    found = find_sorting_call(backend, adapter)
    if found is None:
        pytest.fail("no held-out prompt that the sorting specialist answers with a tool call: the served fixture's "
                    "adapter did not learn; train it longer in `adapters` (tests/test_serve.py)")
    return found


def find_sorting_call(backend, adapter: Path) -> tuple[str, str, dict] | None:
    from rsi.hcp import load_harness
    from rsi.hcp.syntax import parse_call
    from rsi.mol.proxy import specialist_params

    harness = load_harness("sorting/v1")
    prompts = candidates(harness, SORTING_LEVELS)
    for prompt, reply in zip(prompts, direct_replies(backend, prompts, specialist_params(harness, None), adapter)):
        call = parse_call(harness, reply.text) if reply.finish_reason == "stop" else None
        if call is not None and call[0] in harness.tool_schemas:
            return prompt, *call
    return None


def test_registry_resolves_champions_and_follows_promotions(db_url, adapters, tiny_base, rsi_home) -> None:
    """Specialists are rows; the champion comes from the state DB and a new promotion is seen without a new
    Registry; bad names are user errors naming the fix. Keys verify by hash and stop at revocation."""
    from sqlalchemy import text

    from rsi.errors import UserError
    from rsi.mol import state
    from rsi.mol.registry import Registry, add_specialist, list_specialists, remove_specialist
    from rsi.store import open_store

    seed_home(rsi_home, tiny_base)
    store = open_store(db_url)
    with pytest.raises(UserError, match="lineage 'addition' is not in the state DB"):
        add_specialist(store, "addition")
    promote(store, "addition", "addition", "harness_versions/addition/v2", adapters["addition"], tiny_base)
    add_specialist(store, "addition", description="adds")
    with pytest.raises(UserError, match="exists already"):
        add_specialist(store, "addition")
    with pytest.raises(UserError, match="specialist name"):
        add_specialist(store, "addition", name="Bad Name")
    registry = Registry(store, rsi_home)
    first = registry.champions()["addition"]
    assert (first.generation, first.adapter_dir, first.harness.id) == (1, adapters["addition"], "addition/v2")
    promote(store, "addition", "addition", "harness_versions/addition/v2", adapters["sorting"], tiny_base, number=2)
    second = registry.champions()["addition"]
    assert (second.generation, second.adapter_dir) == (2, adapters["sorting"])
    assert [s.name for s in list_specialists(store)] == ["addition"]
    with pytest.raises(UserError, match="reserved"):
        add_specialist(store, "addition", name="base")
    promote(store, "sorting", "sorting", "harness_versions/sorting/v1", adapters["sorting"], tiny_base)
    add_specialist(store, "sorting")
    with store.session() as s:  # its champion's base was rebuilt: another hash than the pair's
        s.execute(text("UPDATE rsi_pairs SET base_model_hash = 'rebuilt' WHERE lineage = 'sorting'"))
    assert list(registry.champions()) == ["addition"] and list(registry.broken()) == ["sorting"]
    remove_specialist(store, "sorting")
    remove_specialist(store, "addition")
    assert registry.champions() == {}
    with pytest.raises(UserError, match="no specialist 'addition'"):
        remove_specialist(store, "addition")

    key = state.create_key(store, "alice")
    assert state.key_owner(store, key) == "alice" and state.key_owner(store, key + "x") is None
    assert key not in str(state.list_keys(store))
    state.revoke_key(store, "alice")
    assert state.key_owner(store, key) is None
    conv = state.new_conversation(store, "alice")
    state.append_messages(store, conv, [({"role": "user", "content": "hi"}, None)])
    state.append_messages(store, conv, [({"role": "assistant", "content": "yo"}, "addition")])
    assert state.conversation_messages(store, conv, "alice") == [
        ({"role": "user", "content": "hi"}, None), ({"role": "assistant", "content": "yo"}, "addition")]
    with pytest.raises(LookupError):
        state.conversation_messages(store, conv, "bob")  # another key's conversation is not found

    # a specialist private to a key: only an active one; a broken one is named to its key only
    with pytest.raises(UserError, match=r"--key 'nobody': no active API key .*`rsi keys create nobody`"):
        add_specialist(store, "sorting", name="sorting-nobody", owner_key="nobody")
    with pytest.raises(UserError, match="'alice'.*it is revoked: create another with `rsi keys create NAME`"):
        add_specialist(store, "sorting", name="sorting-alice", owner_key="alice")
    state.create_key(store, "carol")
    add_specialist(store, "sorting", name="sorting-carol", owner_key="carol")  # its base is still 'rebuilt'
    assert [(s.name, s.owner_key) for s in list_specialists(store)] == [("sorting-carol", "carol")]
    assert registry.champions() == {} and registry.broken() == {}
    assert list(registry.broken("carol")) == ["sorting-carol"]
    add_specialist(store, "addition", owner_key="carol")
    assert registry.champions()["addition"].specialist.owner_key == "carol"
    remove_specialist(store, "addition")
    add_specialist(store, "addition")  # public now, its champion the same generation: not the one cached for carol
    assert registry.champions()["addition"].specialist.owner_key is None
    store.dispose()


def test_routers_on_the_heldout_routing_set(served, rsi_home, monkeypatch) -> None:
    """The ngram router separates the families on held-out tasks it never saw (macro-F1 >= 0.98) and sends
    small talk to the base; the route adapter picks by log P(name) and is as good on this pair of families, once
    trained enough: how far 30 steps get depends on the CPU's float kernels, so it trains longer on more tasks
    until the held-out routing is clear, and fails when even 120 steps on 32 tasks a level do not get there."""
    from rsi.mol.evaluation import evaluate_router
    from rsi.mol.routers import LoraRouter, decide, load_router, routing_examples, train_router
    from rsi.mol.registry import Registry

    champions = Registry(served, rsi_home).champions()
    train = {e.task_id for e in routing_examples(champions, "train", 16)}
    heldout = routing_examples(champions, "heldout", 8)
    assert heldout and not train & {e.task_id for e in heldout}
    report = evaluate_router(served, rsi_home, "ngram", 8, 0.5, answers=False)
    assert report.macro_f1 >= 0.98 and report.n == len(heldout), report.confusion
    assert sum(report.confusion["addition"].values()) == sum(e.specialist == "addition" for e in heldout)
    ngram = load_router("ngram", rsi_home)
    assert decide(ngram, "hello, how are you today?", list(champions), 0.5).specialist is None

    tried = []
    for steps, per_level in ((30, 8), (60, 16), (120, 32)):
        monkeypatch.setattr(LoraRouter, "steps", steps)
        manifest = train_router("lora", champions, rsi_home, per_level=per_level)
        assert manifest["names"] == ["addition", "sorting"] and len(manifest["digest"]) == 64
        lora = evaluate_router(served, rsi_home, "lora", 8, 0.5, answers=False)
        tried.append(f"{steps} steps on {per_level} tasks a level: macro-F1 {lora.macro_f1:.2f}, {lora.confusion}")
        if lora.macro_f1 >= 0.98:
            break
    else:
        pytest.fail("the route adapter does not route the held-out set: it did not learn, or routing does not read "
                    "what it learned (LoraRouter.probabilities); " + "; ".join(tried))


class Server:
    """``rsi.mol.proxy`` under uvicorn in a thread, on a free loopback port."""

    def __init__(self, store, home: Path, **config) -> None:
        import uvicorn

        from rsi.mol.proxy import ServeConfig, create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = create_app(ServeConfig(**config), store, home)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_proxy_answers_the_openai_client(served, adapters, tiny_base, rsi_home) -> None:
    """The official client against a running proxy: routing by content, the reply of the routed adapter, tool
    calls and stickiness, streaming, auth, OpenAI error bodies, rate limits, and a conversation continued from
    the state DB after a restart."""
    import json

    import httpx
    import openai

    from rsi.backends import get_backend
    from rsi.mol.state import create_key

    key = create_key(served, "tester")
    direct = get_backend("hf", model_dir=tiny_base)
    add = addition_probes(direct, adapters["addition"])[0]  # a reply that shows which model answered
    expected_sum = add.reply.text
    sort_prompt, tool, arguments = sorting_call(direct, adapters["sorting"])

    with Server(served, rsi_home, burst=19, rate=0.01) as url:  # 19 authorized requests before the 429 below
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert {m.id for m in client.models.list()} == {"rsi/auto", "rsi/addition", "rsi/sorting", "rsi/base"}
        raw = client.chat.completions.with_raw_response.create(
            model="rsi/auto", messages=[{"role": "user", "content": add.prompt}])
        reply = raw.parse()
        assert reply.model == "rsi/addition" and raw.headers["x-rsi-specialist"] == "addition"
        assert [p.split(";")[0] for p in raw.headers["server-timing"].split(", ")] == ["auth", "prepare", "engine", "store"]
        answered = reply.choices[0]
        assert (answered.message.content, answered.finish_reason) == (expected_sum, add.reply.finish_reason)
        conversation = raw.headers["x-rsi-conversation-id"]
        assert reply.model_extra["conversation_id"] == conversation

        call = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": sort_prompt}])
        assert call.model == "rsi/sorting" and call.choices[0].finish_reason == "tool_calls"
        made = [(c.function.name, json.loads(c.function.arguments)) for c in call.choices[0].message.tool_calls]
        assert made == [(tool, arguments)]  # the call the specialist makes

        chunks = list(client.chat.completions.create(
            model="rsi/auto", stream=True, messages=[{"role": "user", "content": add.prompt}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_sum
        assert chunks[-1].choices[0].finish_reason == add.reply.finish_reason
        assert {c.model for c in chunks} == {"rsi/addition"}
        streamed = list(client.chat.completions.create(  # a tool call streamed, then the usage chunk
            model="rsi/auto", stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": sort_prompt}]))
        deltas = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in deltas] == [(tool, arguments)]
        assert deltas[0].id.startswith("call_sorting_")
        assert streamed[-2].choices[0].finish_reason == "tool_calls"
        assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens > 0
        stop = expected_sum[len(expected_sum) // 2:][:2]
        cut = client.chat.completions.create(model="rsi/auto", stop=[stop], temperature=None, top_p=None,
                                             messages=[{"role": "user", "content": add.prompt}])
        assert cut.choices[0].message.content == expected_sum[:expected_sum.index(stop)]

        forced = client.chat.completions.create(model="rsi/base", messages=[{"role": "user", "content": add.prompt}])
        assert forced.model == "rsi/base" and forced.choices[0].message.content == add.base.text
        small_talk = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": "hello!"}])
        assert small_talk.model == "rsi/base"

        with pytest.raises(openai.AuthenticationError) as denied:
            openai.OpenAI(base_url=f"{url}/v1", api_key="rsi-wrong", max_retries=0).models.list()
        assert denied.value.status_code == 401 and denied.value.body["type"] == "authentication_error"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="rsi/nope", messages=[{"role": "user", "content": "1+1="}])
        for body in ({"model": "rsi/auto"}, {"model": "rsi/auto", "messages": "hi"},
                     {"model": "rsi/auto", "messages": [{"role": "robot", "content": "x"}]},
                     {"model": "rsi/auto", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
                     {"model": "rsi/auto", "messages": [{"role": "user", "content": "1" * 9000}]},
                     {"model": "rsi/auto", "messages": [{"role": "user", "content": "1+1="}], "conversation_id": "x\u0000"},
                     {"model": "rsi/base", "messages": [{"role": "tool", "tool_call_id": "call_1", "content": "1"}]}):
            bad = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
        call = {"id": "call_sorting_1", "type": "function", "function": {"name": "swap", "arguments": "[1]"}}
        bad = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
            "model": "rsi/auto", "messages": [{"role": "user", "content": "sort"}, {"role": "assistant", "tool_calls": [call]},
                                              {"role": "tool", "tool_call_id": "call_sorting_1", "content": "ok"}]})
        assert bad.status_code == 400 and "function.arguments must be a JSON object string" in bad.json()["error"]["message"]
        garbled = httpx.post(f"{url}/v1/chat/completions", content=b"{not json",
                             headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        assert garbled.status_code == 400 and "not valid JSON" in garbled.json()["error"]["message"]
        anonymous = httpx.post(f"{url}/v1/chat/completions", content=b"{not json")  # the key is checked first
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
        huge = httpx.post(f"{url}/v1/chat/completions", content=b" " * (2 << 20),
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
        for i in range(3):  # made-up paths share one metric series
            assert httpx.get(f"{url}/nope{i}").status_code == 404
        wrong_method = httpx.get(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"})
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "405"
        metrics = httpx.get(f"{url}/metrics").text
        counted = {line.split('status="')[1][:3]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith('rsi_serve_requests_total{path="/v1/chat/completions"')}
        assert counted["413"] >= 1 and counted["401"] >= 1 and counted["400"] >= 7 and counted["200"] >= 3, counted
        assert 'rsi_serve_routed_turns_total{router="ngram",specialist="addition"} 3.0' in metrics
        assert 'rsi_serve_requests_total{path="other",status="404"} 3.0' in metrics and "/nope" not in metrics
        with pytest.raises(openai.RateLimitError) as limited:  # the burst is spent, and it refills at 0.01/s
            for _ in range(6):
                client.models.list()
        assert limited.value.body["code"] == "rate_limit_exceeded" and int(limited.value.response.headers["retry-after"]) >= 1

    # a new proxy on the same state DB: the client sends only the tool result and the conversation id; the
    # stored history says which call it answers, so it goes back to the specialist that made the call
    with Server(served, rsi_home) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        first = client.chat.completions.with_raw_response.create(
            model="rsi/auto", messages=[{"role": "user", "content": sort_prompt}]).parse()
        conv, made = first.model_extra["conversation_id"], first.choices[0].message.tool_calls[0]
    with Server(served, rsi_home) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        result = client.chat.completions.create(
            model="rsi/auto", extra_body={"conversation_id": conv},
            messages=[{"role": "tool", "tool_call_id": made.id, "content": "1234567"}])
        assert result.model == "rsi/sorting" and result.model_extra["rsi"]["router"] == "sticky"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="rsi/auto", extra_body={"conversation_id": "conv-" + "0" * 32},
                                           messages=[{"role": "user", "content": "1+1="}])


def test_a_private_specialist_is_seen_and_answered_for_its_key_only(served, rsi_home) -> None:
    """`rsi specialists add --key alice`: a specialist over the addition lineage private to key alice, which the
    router is trained on and whose view reads additions like the public one's. Of 200 requests from key bob, in new
    conversations and in one of his own, none reaches it or names it: its model name gets the 404 of a name that
    does not exist, `rsi/auto` never routes to it (own-format prompts of its levels, plain-words additions, small
    talk), a tool result whose call id names it gets the 400 of a call no specialist made, and alice's conversation
    with it is not bob's to continue. Alice sees it in /v1/models and reaches it by name."""
    import httpx
    from sqlalchemy import select

    from rsi.hcp import load_harness
    from rsi.mol.registry import Registry, add_specialist
    from rsi.mol.routers import train_router
    from rsi.mol.state import create_key
    from rsi.store.schema import ConversationMessageRow, ConversationRow
    from rsi.tasks import get_family

    private = "addition-alice"
    alice, bob = create_key(served, "alice"), create_key(served, "bob")
    add_specialist(served, "addition", name=private, levels=(4, 5, 6), owner_key="alice")
    train_router("ngram", Registry(served, rsi_home).champions(), rsi_home, per_level=16)  # it knows all three
    harness, family = load_harness("addition/v2"), get_family("addition")
    tasks = [t for lvl in (1, 2, 3, 4, 5, 6) for t in family.tasks("heldout", 5, lvl, 4)]
    asked = [harness.prompt(t.payload) for t in tasks] + [f"what is {t.payload['a']} plus {t.payload['b']}?"
                                                          for t in tasks]
    asked += ["hello!"]  # the base's refusal lists what each specialist it may use reads
    forged = f"call_{private}_0123456789ab"

    def tool_result(call_id: str) -> list[dict]:
        call = {"id": call_id, "type": "function", "function": {"name": "add", "arguments": "{}"}}
        return [{"role": "user", "content": asked[0]}, {"role": "assistant", "content": "1", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": "2"}]

    with Server(served, rsi_home, rate=1e6, burst=1_000_000) as url, httpx.Client(base_url=url, timeout=60) as http:
        def post(key: str, body: dict, **headers: str) -> httpx.Response:
            return http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}", **headers})

        def models(key: str) -> set[str]:
            return {m["id"] for m in http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]}

        assert models(alice) == {"rsi/auto", "rsi/addition", f"rsi/{private}", "rsi/sorting", "rsi/base"}
        assert models(bob) == {"rsi/auto", "rsi/addition", "rsi/sorting", "rsi/base"}
        assert private not in http.get("/health").text  # no key there: public specialists only
        own = post(alice, {"model": f"rsi/{private}", "messages": [{"role": "user", "content": "what is 12 plus 34?"}]})
        assert own.status_code == 200 and own.json()["model"] == f"rsi/{private}", own.text
        metrics = http.get("/metrics").text  # read without a key: the private specialist's turn counted, not named
        assert private not in metrics and 'specialist="private"' in metrics, metrics[-2000:]
        conversation = own.json()["conversation_id"]
        # what bob gets where nothing exists, to compare with what he gets for alice's specialist
        no_model = post(bob, {"model": "rsi/nosuch", "messages": [{"role": "user", "content": asked[0]}]}).json()
        no_call = post(bob, {"model": "rsi/auto", "messages": tool_result("call_nosuch_0123456789ab")}).json()
        mine = post(bob, {"model": "rsi/auto", "messages": [{"role": "user", "content": "hello!"}]}).json()

        for i in range(200):  # each text once a kind, every level's half in bob's stored conversation
            kind, text = i % 4, asked[i // 4 % len(asked)]
            in_mine = {"conversation_id": mine["conversation_id"]} if i % 8 >= 4 else {}  # stored: no warm path
            asks = [{"role": "user", "content": text}]
            if kind == 0:  # by name
                reply = post(bob, {"model": f"rsi/{private}", "messages": asks} | in_mine)
                assert reply.status_code == 404
                assert reply.json() == {"error": {**no_model["error"], "message": no_model["error"]["message"]
                                                  .replace("rsi/nosuch", f"rsi/{private}")}}
            elif kind == 1:  # routed
                reply = post(bob, {"model": "rsi/auto", "messages": asks} | in_mine)
                assert reply.status_code == 200, reply.text
                assert reply.json()["model"] in ("rsi/addition", "rsi/base"), (text, reply.json()["rsi"])
            elif kind == 2:  # a tool result whose call id names it
                reply = post(bob, {"model": "rsi/auto", "messages": tool_result(forged)} | in_mine)
                assert reply.status_code == 400
                assert reply.json() == {"error": {**no_call["error"], "message": no_call["error"]["message"]
                                                  .replace("call_nosuch_", f"call_{private}_")}}
            else:  # alice's conversation, by the body's field or the header
                where = {"conversation_id": conversation} if in_mine else {}
                reply = post(bob, {"model": "rsi/auto", "messages": asks} | where,
                             **({} if where else {"X-RSI-Conversation-Id": conversation}))
                assert reply.status_code == 404 and reply.json()["error"]["code"] == "conversation_not_found"
            said = reply.text.replace(f"rsi/{private}", "").replace(forged, "") + str(reply.headers)
            assert private not in said, (kind, text, reply.text)
    with served.session() as s:  # every turn it answered is in a conversation of alice's
        answered_for = s.scalars(select(ConversationRow.api_key).join(
            ConversationMessageRow, ConversationMessageRow.conversation_id == ConversationRow.id)
            .where(ConversationMessageRow.specialist == private)).all()
    assert answered_for == ["alice"]


def test_proxy_keeps_conversations_on_each_state_db(db_url, adapters, tiny_base, rsi_home) -> None:
    """The proxy on SQLite and on PostgreSQL: concurrent new conversations, and a tool episode continued from
    its stored history with only the tool result and the conversation id; every turn stored in order."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from rsi.backends import get_backend
    from rsi.hcp import load_harness
    from rsi.mol.state import conversation_messages, create_key
    from rsi.store import open_store
    from rsi.tasks import get_family

    store = admit_both(open_store(db_url), adapters, tiny_base, rsi_home)
    key = create_key(store, "db-tester")
    addition = load_harness("addition/v2")
    questions = [addition.prompt(t.payload) for t in get_family("addition").tasks("heldout", 9, 2, 4)]
    sort_prompt, tool, _ = sorting_call(get_backend("hf", model_dir=tiny_base), adapters["sorting"])
    with Server(store, rsi_home, burst=100) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

        def ask(question: str) -> str:
            return client.chat.completions.create(
                model="rsi/auto", messages=[{"role": "user", "content": question}]).model_extra["conversation_id"]

        with ThreadPoolExecutor(4) as pool:
            started = list(pool.map(ask, questions))
        assert len(set(started)) == 4 and all(len(conversation_messages(store, c, "db-tester")) == 2 for c in started)
        call = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": sort_prompt}])
        assert call.choices[0].finish_reason == "tool_calls", call.choices[0]
        conversation, made = call.model_extra["conversation_id"], call.choices[0].message.tool_calls[0]
        assert made.function.name == tool
        result = client.chat.completions.create(model="rsi/auto", extra_body={"conversation_id": conversation},
                                                messages=[{"role": "tool", "tool_call_id": made.id, "content": "0123456"}])
        assert result.model == "rsi/sorting" and result.model_extra["rsi"]["router"] == "sticky"
    stored = conversation_messages(store, conversation, "db-tester")
    assert [m["role"] for m, _ in stored] == ["user", "assistant", "tool", "assistant"]
    assert [who for _, who in stored] == [None, "sorting", None, "sorting"]
    assert stored[1][0]["tool_calls"][0]["id"] == made.id
    store.dispose()


def _rsi(*args: str) -> "subprocess.CompletedProcess[str]":
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "rsi", *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)


def test_cli_specialists_keys_and_router_eval(served, rsi_home) -> None:
    """The commands as a person runs them: user errors exit 2 naming the fix, no traceback; `rsi router eval`
    reports the confusion matrix, macro-F1, latency and answer accuracy against the oracle."""
    import json

    missing = _rsi("specialists", "add", "nosuch")
    assert missing.returncode == 2 and "run `rsi run` first" in missing.stderr and "Traceback" not in missing.stderr
    listed = _rsi("specialists", "list")
    assert listed.returncode == 0 and "addition" in listed.stdout and "generation 1" in listed.stdout
    key = _rsi("keys", "create", "cli")
    assert key.returncode == 0 and key.stdout.strip().startswith("rsi-")
    again = _rsi("keys", "create", "cli")
    assert again.returncode == 2 and "exists already" in again.stderr
    pruned = _rsi("conversations", "prune", "--older-than", "30", "--dry-run")
    assert pruned.returncode == 0 and "0 conversation(s) with no message since" in pruned.stdout, pruned.stderr
    negative = _rsi("conversations", "prune", "--older-than", "-1")
    assert negative.returncode == 2 and "Traceback" not in negative.stderr
    unknown = _rsi("router", "train", "--kind", "svm")
    assert unknown.returncode == 2 and "known routers: lora, ngram" in unknown.stderr
    report = _rsi("router", "eval", "--kind", "ngram", "--per-level", "4", "--json")
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["macro_f1"] >= 0.98 and data["labels"] == ["addition", "sorting", "base"]
    for name in ("addition", "sorting"):  # routed as the oracle routes, so the answers are the oracle's
        acc = data["answer_accuracy"][name]
        assert acc["n"] > 0 and acc["routed"] == acc["oracle"]


def test_cli_admits_a_specialist_private_to_a_key(served) -> None:
    """`rsi specialists add --key NAME`: a key name that does not exist exits 2 naming `rsi keys create`, with no
    traceback and nothing admitted; with the key made, the specialist is admitted and `rsi specialists list` names
    its key (and "every key" for a public one)."""
    from rsi.mol.state import create_key

    unknown = _rsi("specialists", "add", "addition", "--name", "addition-dave", "--key", "dave")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "--key 'dave'" in unknown.stderr and "`rsi keys create dave`" in unknown.stderr, unknown.stderr
    create_key(served, "dave")
    added = _rsi("specialists", "add", "addition", "--name", "addition-dave", "--key", "dave")
    assert added.returncode == 0 and "private to key dave" in added.stdout, added.stderr
    listed = _rsi("specialists", "list")
    rows = {cells[1].strip(): cells for line in listed.stdout.splitlines() if len(cells := line.split("│")) > 2}
    assert set(rows) == {"addition", "addition-dave", "sorting"}, listed.stdout
    assert "dave" in rows["addition-dave"][6] and "every key" in rows["addition"][6]


def test_eval_lineage_uses_the_lineage_base(served, rsi_home) -> None:
    """`rsi eval --lineage` scores the champion on the base its lineage recorded (here the tiny profile's), not
    on its family's default profile's base, which would be built for it and give another model's accuracy."""
    bases = sorted(p.name for p in (rsi_home / "models").iterdir())
    done = _rsi("eval", "--lineage", "addition", "--levels", "1-2", "--n", "8")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "addition/v2" in done.stdout and sorted(p.name for p in (rsi_home / "models").iterdir()) == bases


def test_concurrent_appends_to_one_conversation(db_url) -> None:
    """Workers appending to one conversation at once all succeed: each turn is stored once, in some order, at
    positions 0..n-1 (the (conversation, position) conflict is retried, not a 500)."""
    from rsi.mol import state
    from rsi.store import open_store

    store = open_store(db_url)
    conv = state.new_conversation(store, "alice")
    barrier, failures = threading.Barrier(8), []

    def worker(w: int) -> None:
        barrier.wait()
        for k in range(4):
            try:
                state.append_messages(store, conv, [({"role": "user", "content": f"{w}.{k}"}, None),
                                                    ({"role": "assistant", "content": f"re {w}.{k}"}, "addition")])
            except Exception as exc:
                failures.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:2]
    stored = [m["content"] for m, _ in state.conversation_messages(store, conv, "alice")]
    assert sorted(stored[0::2]) == sorted(f"{w}.{k}" for w in range(8) for k in range(4))
    assert stored[1::2] == [f"re {q}" for q in stored[0::2]]  # each turn's two messages stay together
    store.dispose()


def test_conversation_writer_commits_turns_together_and_alone_when_refused(db_url) -> None:
    """Turns waiting together are committed in one transaction (appends to one conversation in order); a batch
    with a turn the database refuses (a conversation id that exists) is written again turn by turn: that turn's
    future fails, every other turn is stored."""
    from sqlalchemy.exc import IntegrityError

    from rsi.mol import state
    from rsi.store import open_store

    from sqlalchemy import event

    store = open_store(db_url)
    taken = state.new_conversation(store, "alice")
    writer = state.ConversationWriter(store)
    commits: list[int] = []
    event.listen(store.engine, "commit", lambda conn: commits.append(1))
    fresh = [state.new_conversation_id() for _ in range(3)]
    with writer._ready:  # the writer thread waits until all are queued: one batch
        started = [writer.start(c, "alice", [({"role": "user", "content": c}, None)]) for c in fresh]
        appended = [writer.append(fresh[0], [({"role": "assistant", "content": f"re {k}"}, "addition")])
                    for k in range(2)]
    for future in started + appended:
        assert future.result(timeout=30) is None
    assert len(commits) == 1
    with writer._ready:
        appended.append(writer.append(fresh[0], [({"role": "assistant", "content": "re 2"}, "addition")]))
        refused = writer.start(taken, "alice", [({"role": "user", "content": "again"}, None)])
    assert appended[-1].result(timeout=30) is None
    with pytest.raises(IntegrityError):
        refused.result(timeout=30)
    assert [m["content"] for m, _ in state.conversation_messages(store, fresh[0], "alice")] == [
        fresh[0], "re 0", "re 1", "re 2"]
    assert all(len(state.conversation_messages(store, c, "alice")) == 1 for c in fresh[1:])
    assert state.conversation_messages(store, taken, "alice") == []
    writer.close()  # its thread ends and its connection is closed
    assert not writer._thread.is_alive() and writer._conn is None
    store.dispose()


def test_idle_conversations_are_pruned(db_url) -> None:
    """Retention: a conversation with no message since the cutoff goes, with its messages, batch after batch;
    one with a recent message, or started after the cutoff, stays whole; a dry run deletes nothing."""
    from datetime import timedelta

    from sqlalchemy import func, select, update

    from rsi.mol import state
    from rsi.store import open_store
    from rsi.store.schema import ConversationMessageRow as M, ConversationRow as C, utcnow

    store = open_store(db_url)
    turn = [({"role": "user", "content": "hi"}, None), ({"role": "assistant", "content": "hello"}, "addition")]
    names = ("idle", "idle_too", "answered_lately", "new", "empty")
    ids = {name: state.new_conversation_id() for name in names}
    for name in names[:-1]:
        state.start_conversation(store, ids[name], "alice", turn)
    state.start_conversation(store, ids["empty"], "alice", [])
    old = utcnow() - timedelta(days=40)
    with store.engine.begin() as conn:
        for name in ("idle", "idle_too", "answered_lately", "empty"):
            conn.execute(update(C).where(C.id == ids[name]).values(created_at=old))
            conn.execute(update(M).where(M.conversation_id == ids[name]).values(created_at=old))
    state.append_messages(store, ids["answered_lately"], [({"role": "user", "content": "again"}, None)])
    cutoff = utcnow() - timedelta(days=30)
    assert state.prune_conversations(store, cutoff, dry_run=True) == 3
    assert len(state.conversation_messages(store, ids["idle"], "alice")) == 2
    assert state.prune_conversations(store, cutoff, batch=2) == 3
    for name in ("idle", "idle_too", "empty"):
        with pytest.raises(LookupError):
            state.conversation_messages(store, ids[name], "alice")
    assert len(state.conversation_messages(store, ids["answered_lately"], "alice")) == 3
    assert len(state.conversation_messages(store, ids["new"], "alice")) == 2
    with store.engine.connect() as conn:  # no message left behind
        assert conn.scalar(select(func.count()).select_from(M)) == 5
    assert state.prune_conversations(store, cutoff) == 0
    with pytest.raises(LookupError):  # a turn for a conversation pruned since it began: not retried
        state.append_messages(store, ids["idle"], [({"role": "user", "content": "late"}, None)], attempts=1000)
    writer = state.ConversationWriter(store)
    with pytest.raises(LookupError):
        writer.append(ids["idle_too"], [({"role": "user", "content": "late"}, None)]).result(timeout=30)
    writer.close()
    store.dispose()


def test_batching_merges_calls_of_equal_settings_and_isolates_a_failing_one() -> None:
    """``rsi.mol.batching``, which the engine process and ``Batcher`` both use, with a fake backend that records
    its calls (the grouping logic, not a model): the oldest call and every later one of equal mode, adapter and
    sampling go in one backend call, each getting its own rows back; a sampled call whose prompt is already in
    the batch waits for the next one; a batch the backend refuses is decoded call by call, so only the bad call
    fails."""
    from rsi.backends.base import SamplingParams
    from rsi.mol.batching import Call, decode, take

    from .fakes import FakeModel

    def reversed_unless_bad(prompt: str, k: int) -> str:  # the FAKE model's reply: the prompt reversed
        if prompt == "bad":
            raise ValueError("cannot decode 'bad'")
        return prompt[::-1]

    greedy, sampled = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=1.0)
    waiting = [Call("generate", ["ab"], greedy, None), Call("generate", ["cd"], greedy, "lora"),
               Call("generate", ["ef", "gh"], greedy, None), Call("chat", [[]], greedy, None),
               Call("generate", ["ij"], sampled, None), Call("generate", ["ij"], sampled, None)]
    batch, rest = take(waiting)
    assert batch == [waiting[0], waiting[2]] and rest == [waiting[1], waiting[3], waiting[4], waiting[5]]
    backend = FakeModel(reversed_unless_bad)
    decode(backend, batch)
    assert backend.prompts == [["ab", "ef", "gh"]]
    assert [[c.text for c in row] for row in waiting[2].result.result()] == [["fe"], ["hg"]]
    assert take(rest[2:]) == ([waiting[4]], [waiting[5]])  # the same prompt sampled twice: two streams
    calls = [Call("generate", [p], greedy, None) for p in ("xy", "bad", "zw")]
    backend.prompts.clear()
    decode(backend, calls)
    assert backend.prompts == [["xy", "bad", "zw"], ["xy"], ["bad"], ["zw"]]
    assert calls[0].result.result()[0][0].text == "yx" and calls[2].result.result()[0][0].text == "wz"
    with pytest.raises(ValueError, match="'bad'"):
        calls[1].result.result()


def test_rate_limits_are_shared_by_workers(db_url) -> None:
    """Two proxy workers (two connection pools on one state DB) draw from one bucket per key: a burst of 3 is
    3 requests in all, not 3 each, also when their requests race; another key has its own bucket."""
    from rsi.mol.state import RateLimits
    from rsi.store import open_store

    stores = [open_store(db_url), open_store(db_url)]
    workers = [RateLimits(s, rate=0.001, burst=3) for s in stores]
    granted: list[bool] = []
    barrier = threading.Barrier(6)

    def worker(i: int) -> None:
        barrier.wait()
        granted.append(workers[i % 2].take("alice") == 0.0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 6 and sum(granted) == 3  # every request answered, three let through
    wait = workers[0].take("alice")
    assert wait > 100  # a token comes back after 1/rate seconds
    assert workers[1].take("bob") == 0.0
    for s in stores:
        s.dispose()


def test_rate_limit_leases_are_renewed_off_the_request_path(db_url) -> None:
    """A key in steady use at a leasing rate spends its worker's lease without the DB, and the lease is renewed
    by the worker's renewal thread before it runs out: after the first request's lease, no request's thread
    touches the DB; the DB bucket lost exactly the leased tokens."""
    from sqlalchemy import event

    from rsi.mol.state import RateLimits
    from rsi.store import open_store
    from rsi.store.schema import RateLimitRow

    store = open_store(db_url)
    limits = RateLimits(store, rate=1e-6, burst=1000)  # no refill during the test
    limits.lease, limits.LEASE_S = 100, 3600.0  # leases of 100 tokens that do not expire here
    statements: list[str] = []
    updates: list[str] = []
    event.listen(store.engine, "before_cursor_execute",
                 lambda conn, cursor, sql, *args: (statements.append(threading.current_thread().name),
                                                   sql.startswith("UPDATE") and updates.append(sql)))
    assert limits.take("alice") == 0.0
    assert statements and "rsi-rate-lease" not in " ".join(statements)
    first = len(statements)
    for _ in range(300):
        assert limits.take_leased("alice")  # never spent: renewed when three quarters spent
        while limits._renewing:
            time.sleep(0.001)
    assert len(statements) > first and all(name.startswith("rsi-rate-lease") for name in statements[first:])
    with store.session() as s:
        left = s.get(RateLimitRow, "alice").tokens
    renewals = round((1000 - 100 - left) / 100)
    assert left == pytest.approx(1000 - 100 * (1 + renewals), abs=0.01) and renewals >= 3
    spent, before = 301, len(updates)
    while limits.take_leased("alice"):  # the bucket runs dry: the last renewal finds it short of a lease
        spent += 1
        while limits._renewing:
            time.sleep(0.001)
    assert spent == 1000  # every token taken from the bucket was spent: none dropped at a renewal
    assert len(updates) - before <= 1000 // 100 - 1 - renewals + 1  # a short bucket is not asked on every request
    store.dispose()


def test_a_burst_of_first_requests_gets_the_whole_burst(db_url) -> None:
    """With leases of 5 and a burst of 20 (a rate of 5/s leases 5), 16 requests of one key arriving at once each
    find no lease and go to the DB; the leases they take are pooled, not overwritten, so all 16 go through, then
    the 4 tokens left, and the next request waits for the refill."""
    from rsi.mol.state import RateLimits
    from rsi.store import open_store

    store = open_store(db_url)
    assert RateLimits(store, rate=5.0, burst=20).lease == 5
    limits = RateLimits(store, rate=1e-6, burst=20)  # no refill during the test
    limits.lease = 5
    barrier = threading.Barrier(16)
    granted: list[bool] = []

    def request() -> None:
        barrier.wait()
        granted.append(limits.take("alice") == 0.0)

    threads = [threading.Thread(target=request) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert granted == [True] * 16
    assert [limits.take("alice") == 0.0 for _ in range(4)] == [True] * 4
    assert limits.take("alice") > 0  # the burst is spent
    store.dispose()


def test_chat_specialist_sees_other_turns_as_a_summary(served, rsi_home) -> None:
    """A chat-mode specialist that a client drives with its own tools reads its own turns, led by its harness's
    system prompt, and, for each run of turns another specialist (or the base) answered, one summary line before
    the next user message; never the other adapters' replies. No chat-mode base is available here, so the
    backend is a fake that records what the specialist is shown."""
    from rsi.hcp import load_harness
    from rsi.models import Message
    from rsi.mol.proxy import ChatRequest, ServeConfig, Service
    from rsi.mol.registry import Champion, Specialist
    from rsi.mol.routers import Route

    from .fakes import FakeModel

    service = Service(ServeConfig(), served, rsi_home)
    fake = service._backends[rsi_home / "fake-chat-base"] = FakeModel(lambda conversation, k: "fake reply")
    harness = load_harness("harness_versions/sorting/smollm2-v1")
    chatty = Champion(Specialist(name="chatty", lineage="chatty"), 1, "pair-fake", rsi_home / "fake-adapter",
                      harness, rsi_home / "fake-chat-base")
    turns = [("q1", "addition"), ("q2", "addition"), ("q3", "chatty"), ("q4", "base")]
    messages, specialists = [], []
    for question, who in turns:
        messages += [Message(role="user", content=question), Message(role="assistant", content=f"{who} says")]
        specialists += [None, who]
    messages.append(Message(role="user", content="q5"))
    specialists.append(None)
    route = Route(specialist="chatty", confidence=1.0, scores={}, router="override", reason="model name")
    request = ChatRequest(model="rsi/chatty", messages=[m.model_dump() for m in messages],
                          tools=[{"type": "function", "function": schema["function"]}
                                 for schema in harness.chat_tools])
    reply, finish, _, _ = service.answer(route, {"chatty": chatty}, messages, request, specialists)
    assert (reply.content, finish) == ("fake reply", "stop")
    assert [(m.role, m.content) for m in fake.prompts[0][0]] == [
        ("system", harness.render("system_template", {})),
        ("user", "[earlier: addition answered 2 turns]\nq3"), ("assistant", "chatty says"),
        ("user", "[earlier: base answered 1 turn]\nq5")]


def test_a_chat_specialist_answers_a_person_under_its_harness(served, rsi_home) -> None:
    """A chat-mode specialist reads a person's message through its family's view as any specialist: its model is
    shown the harness's prompt of the task (system prompt and user template), never the message as written, and
    the person gets the answer the harness's parser reads from the reply, in plain words; a message no view
    reads never reaches it (``rsi/auto``: the chat base answers; by name: a 400 ``no_task``). The backend is a
    fake that records what it is sent and replies as the harness's format asks."""
    from rsi.hcp import load_harness
    from rsi.models import Message
    from rsi.mol.proxy import ApiError, ChatRequest, ServeConfig, Service
    from rsi.mol.registry import Champion, Specialist

    from .fakes import FakeModel

    service = Service(ServeConfig(), served, rsi_home)
    fake = service._backends[rsi_home / "fake-chat-base"] = FakeModel(
        lambda conversation, k: "The answer is 47." if conversation[0].role == "system" else "hello to you")
    harness = load_harness("harness_versions/addition/smollm2-v1")
    chatty = Champion(Specialist(name="chatty", lineage="chatty"), 1, "pair-fake", rsi_home / "fake-adapter",
                      harness, rsi_home / "fake-chat-base")
    champions = {"chatty": chatty}

    def ask(text: str, model: str) -> Message:
        messages = [Message(role="user", content=text)]
        request = ChatRequest(model=model, messages=[m.model_dump() for m in messages])
        route = service.choose(model, messages, [None], champions)
        return service.answer(route, champions, messages, request, [None])[0]

    assert ask("what is 12 plus 34?", "rsi/auto").content == "12 + 34 = 47"  # the model's sum, not the task's
    assert [(m.role, m.content) for m in fake.prompts[-1][0]] == [
        (role, content) for role, content in harness.prompt_messages({"a": 12, "b": 34})]
    assert ask("how are you?", "rsi/auto").content == "hello to you"
    assert [(m.role, m.content) for m in fake.prompts[-1][0]] == [("user", "how are you?")]
    with pytest.raises(ApiError) as refused:
        ask("how are you?", "rsi/chatty")
    assert (refused.value.status, refused.value.code) == (400, "no_task")
    assert fake.calls == 2


def test_a_chat_base_answers_what_no_specialist_reads_through_its_chat_template(served, rsi_home) -> None:
    """Where the specialists' base is a chat model (their harnesses are chat-mode), a turn routed to no specialist
    goes to that base as a conversation (its chat template), its own earlier turns kept and the specialists' turns
    summarized, never as raw completion text. The backend is a fake that records what it is sent."""
    from rsi.hcp import load_harness
    from rsi.models import Message
    from rsi.mol.proxy import ChatRequest, ServeConfig, Service
    from rsi.mol.registry import Champion, Specialist
    from rsi.mol.routers import Route

    from .fakes import FakeModel

    service = Service(ServeConfig(), served, rsi_home)
    fake = service._backends[rsi_home / "fake-chat-base"] = FakeModel(lambda conversation, k: "hello to you")
    chatty = Champion(Specialist(name="chatty", lineage="chatty"), 1, "pair-fake", rsi_home / "fake-adapter",
                      load_harness("harness_versions/addition/smollm2-v1"), rsi_home / "fake-chat-base")
    messages = [Message(role="user", content="what is 2+2?"), Message(role="assistant", content="The answer is 4."),
                Message(role="user", content="hi"), Message(role="assistant", content="hello"),
                Message(role="user", content="how are you?")]
    specialists = [None, "chatty", None, "base", None]
    route = Route(specialist=None, confidence=0.2, scores={}, router="ngram", reason="below the threshold")
    request = ChatRequest(model="rsi/auto", messages=[m.model_dump() for m in messages])
    reply, finish, _, _ = service.answer(route, {"chatty": chatty}, messages, request, specialists)
    assert (reply.content, finish) == ("hello to you", "stop")
    assert [(m.role, m.content) for m in fake.prompts[0][0]] == [
        ("user", "[earlier: chatty answered 1 turn]\nhi"), ("assistant", "hello"), ("user", "how are you?")]


def test_plan_specialist_answers_by_running_its_plan(served, adapters, tiny_base, rsi_home, tmp_path) -> None:
    """A champion whose harness has a plan (the demo's lineage adopts ``digit_chunks``) answers a message that
    poses a task in its format as its lineage is evaluated: the plan's calls, composed; the reply is the
    composed answer the pair's ``run`` gives on the same backend. A task in plain words is read by the family's
    view and answered the same way, said back in words; a message that poses no task is refused."""
    from rsi.backends import get_backend
    from rsi.hcp import load_harness
    from rsi.models import Message
    from rsi.mol.proxy import ApiError, ChatRequest, ServeConfig, Service, specialist_params
    from rsi.mol.routers import Route
    from rsi.mol.views import VIEWS, answer
    from rsi.pair import Responder
    from rsi.task_generators.addition import formats as addition_formats
    from rsi.store.harnesses import write_harness_dir
    from rsi.tasks import get_family

    proposal = addition_formats(load_harness("addition/v2"), {"chunk": [1]})[0]
    write_harness_dir(tmp_path / "chunks1", proposal.document, proposal.sources)
    promote(served, "addition", "addition", str(tmp_path / "chunks1"), adapters["addition"], tiny_base, number=2)
    service = Service(ServeConfig(), served, rsi_home)
    try:
        champion = service.champions()["addition"]
        harness, family = champion.harness, get_family("addition")
        assert harness.document.plan is not None and champion.generation == 2
        task = family.tasks("heldout", 7, 3, 1)[0]
        question = harness.prompt(task.payload)
        messages = [Message(role="user", content=question)]
        params = specialist_params(harness, None)
        direct = get_backend("hf", model_dir=tiny_base)
        pair = Responder(harness, direct, champion.pair_id, adapters["addition"], family)
        assert pair.posed(Message(role="user", content=question)).payload == task.payload
        assert pair.posed(Message(role="user", content=question[::-1])) is None  # renders otherwise
        run = pair.run([task], params)
        assert len(run.trajectories) >= 3  # a 3-digit addition in 1-digit parts
        route = Route(specialist="addition", confidence=1.0, scores={}, router="override", reason="model name")
        request = ChatRequest(model="rsi/addition", messages=[{"role": "user", "content": question}])
        reply, finish, prompt_tokens, _ = service.answer(route, service.champions(), messages, request, [None])
        composed = run.paths[0].answer
        assert reply.content == ("" if composed is None else str(composed)) and finish == "stop"
        assert prompt_tokens == sum(t.tokens.prompt for t in run.trajectories)
        # not in the harness's format, but a task in plain words: the view reads it, the plan answers it
        other = [Message(role="user", content="1+2")]
        plainly = answer(VIEWS["addition"], pair, family.derive({"a": 1, "b": 2}), params).message.content
        request = ChatRequest(model="rsi/addition", messages=[{"role": "user", "content": "1+2"}])
        assert service.answer(route, service.champions(), other, request, [None])[0].content == plainly
        assert plainly.startswith("1 + 2 = ")
        with pytest.raises(ApiError) as refused:  # no task at all: never the specialist's raw format
            service.answer(route, service.champions(), [Message(role="user", content="hello")],
                           ChatRequest(model="rsi/addition", messages=[{"role": "user", "content": "hello"}]), [None])
        assert refused.value.status == 400 and refused.value.code == "no_task"
    finally:
        service.close()


def test_service_loads_every_champions_base_in_the_background(served, rsi_home) -> None:
    """A turn goes the warm way (routed and sent on the event loop) only when every champion's base is loaded;
    ``warm`` sends the missing ones to load in the background, once, so a specialist no request reached yet
    does not keep every request off it."""
    from rsi.mol.proxy import ServeConfig, Service

    service = Service(ServeConfig(), served, rsi_home)
    try:
        champions = service.champions()
        assert service.warm() is None and service.warm() is None  # nothing loaded yet: sent to load, once
        assert len(service._loading) == 1
        deadline = time.monotonic() + 120
        while service.champions() and service.warm() is None:  # champions are remembered for a while only
            assert time.monotonic() < deadline, "the base was not loaded in the background"
            time.sleep(0.1)
        assert service.warm() == champions and set(service._backends) == {c.base_dir for c in champions.values()}
    finally:
        service.close()


def test_engine_process_answers_like_the_backend_and_fails_calls_when_it_dies(tiny_base) -> None:
    """The proxy's hf engine in its own process (``rsi.mol.process``): the backend's replies, its errors as
    themselves; a killed child fails the call in flight and every later one with its exit code, never a hang."""
    import os
    import signal

    from rsi.backends import get_backend
    from rsi.backends.base import SamplingParams
    from rsi.errors import UserError
    from rsi.mol.process import EngineProcess

    engine = EngineProcess("hf", model_dir=tiny_base)
    params = SamplingParams(max_new_tokens=8)
    prompts = ["12+34=", "5+6="]
    direct = get_backend("hf", model_dir=tiny_base).generate(prompts, params)
    same = ("text", "finish_reason", "prompt_tokens", "completion_tokens")
    assert [[c.model_dump(include=set(same)) for c in row] for row in engine.generate(prompts, params)] == [
        [c.model_dump(include=set(same)) for c in row] for row in direct]
    with pytest.raises(UserError, match="no LoRA adapter"):
        engine.generate(prompts, params, adapter=str(tiny_base / "nope"))
    in_flight = engine.submit("generate", [f"{i}+{i}=" for i in range(256)], SamplingParams(max_new_tokens=64), None)
    os.kill(engine._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"exited \(code -9\)"):
        in_flight.result(timeout=60)
    with pytest.raises(RuntimeError, match=r"exited \(code -9\)"):
        engine.generate(prompts, params)
    engine.close()


def test_rsi_serve_command_answers_concurrent_clients_and_stops_on_sigterm(served, adapters, tiny_base) -> None:
    """`rsi serve` as a person starts it: concurrent first requests (one base loaded once, their decoding
    batched) each get the reply the routed adapter gives that prompt alone; SIGTERM stops it cleanly."""
    import os
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from rsi.backends import get_backend
    from rsi.mol.state import create_key

    key = create_key(served, "cli-serve")
    # prompts the adapter answers otherwise than the base, each with another reply: so a reply given to the wrong
    # request, or by the base, shows
    by_reply: dict[str, str] = {}
    for probe in addition_probes(get_backend("hf", model_dir=tiny_base), adapters["addition"]):
        by_reply.setdefault(probe.reply.text, probe.prompt)
    if len(by_reply) < 2:
        pytest.fail(f"the addition adapter gives one reply ({list(by_reply)}) to every prompt where it differs from "
                    "the base: the served fixture's adapter did not learn; train it longer in `adapters`")
    expected, prompts = list(by_reply)[:6], list(by_reply.values())[:6]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "rsi", "serve", "--port", str(port)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "rsi serve did not answer /health"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)

        def ask(prompt: str) -> str:
            reply = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": prompt}])
            assert reply.model == "rsi/addition"
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, prompts)) == expected
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode in (0, 128 + signal.SIGTERM) and "Traceback" not in stderr, stderr
    assert "serving on" in stdout
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first run installs the engine venv
def test_proxy_over_the_vllm_engine(served, adapters, tiny_base, rsi_home) -> None:
    """``--engine openai``: the proxy starts rsi's vLLM engine on the champions' base, loads each routed
    specialist's adapter at run time, and answers as the ``hf`` engine does (greedy); the engine it started stops
    with it. Run with ``pytest -m vllm tests/test_serve.py`` (needs ``rsi engine install``)."""
    import json

    import httpx  # noqa: F401 (imported here first: the proxy's engine thread importing it while the openai client
    import openai  # reads it races, 'partially initialized module httpx')

    from rsi import engine
    from rsi.backends import get_backend
    from rsi.mol.state import create_key

    engine.install()
    key = create_key(served, "vllm-tester")
    hf = get_backend("hf", model_dir=tiny_base)
    probes = addition_probes(hf, adapters["addition"])[:4]  # replies that show which model answered
    add_prompts, expected = [p.prompt for p in probes], [p.reply.text for p in probes]
    sort_prompt, tool, arguments = sorting_call(hf, adapters["sorting"])

    with Server(served, rsi_home, engine="openai") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        replies = [client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": p}])
                   for p in add_prompts]
        assert {r.model for r in replies} == {"rsi/addition"}
        assert [r.choices[0].message.content for r in replies] == expected
        call = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": sort_prompt}])
        assert call.model == "rsi/sorting" and call.choices[0].finish_reason == "tool_calls"
        made = call.choices[0].message.tool_calls[0].function
        assert (made.name, json.loads(made.arguments)) == (tool, arguments)
        forced = client.chat.completions.create(model="rsi/base", messages=[{"role": "user", "content": add_prompts[0]}])
        assert forced.choices[0].message.content == probes[0].base.text
        # streamed: the engine's text as it decodes it, a piece a token (the char model: a token a character), where
        # a finished reply goes out in pieces of 4; the same text and usage, the turn stored once it is done
        for name, prompt, text in (("rsi/base", add_prompts[0], probes[0].base.text),
                                   ("rsi/addition", add_prompts[1], expected[1])):
            chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                                         stream=True, stream_options={"include_usage": True}))
            pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
            assert "".join(pieces) == text and len(pieces) == len(text) > 1, (name, pieces)
            assert chunks[-1].usage.completion_tokens in (len(text), len(text) + 1)  # + the EOS, when it stopped
            stored = state_messages(served, chunks[0].model_extra["conversation_id"], "vllm-tester")
            assert [m["content"] for m in stored] == [prompt, text]
        state = engine.status(rsi_home)
        assert state["healthy"] and Path(state["model"]).name == tiny_base.name  # the champions' base
        assert len({a["name"] for a in state["adapters"]}) == 2  # both specialists, loaded at run time
    assert not engine.status(rsi_home)["running"]  # the proxy started the engine, so it stopped it


def state_messages(store, conversation_id: str, key_name: str) -> list[dict]:
    from rsi.mol import state

    return [m for m, _ in state.conversation_messages(store, conversation_id, key_name)]


class SlowEngine:
    """A stand-in for rsi's vLLM engine (a fake, for the proxy's side of a stream only): an OpenAI-compatible
    ``/v1/completions`` that streams a digit every 20 ms, 5,000 of them, and records how many it sent and whether
    its client went away before the end. (rsi's real engine, vLLM, aborts a request whose client goes away; on
    the built-in model it writes the 128 tokens its context holds in a third of a second, before any client could
    go away, so it cannot show the proxy closing its side.)"""

    def __init__(self) -> None:
        import asyncio

        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        self.sent, self.gone, self.bodies = 0, threading.Event(), []

        async def completions(request):
            self.bodies.append(await request.json())

            async def pieces():
                try:
                    for _ in range(5000):
                        self.sent += 1
                        yield 'data: {"choices": [{"index": 0, "text": "7", "finish_reason": null}]}\n\n'
                        await asyncio.sleep(0.02)
                    yield "data: [DONE]\n\n"
                except BaseException:  # cancelled: the client went away
                    self.gone.set()
                    raise

            return StreamingResponse(pieces(), media_type="text/event-stream")

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> SlowEngine:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_a_client_gone_mid_stream_closes_the_engine_request(served, tiny_base, rsi_home, monkeypatch) -> None:
    """``stream: true`` on the openai engine: the proxy passes the engine's pieces through as they come (the first
    ones reach the client while the engine is still writing), and a client that goes away closes the engine's
    request within a piece or two, not 5,000 pieces later; the turn is not stored (only finished replies are)."""
    import json

    import httpx

    from rsi import engine
    from rsi.mol.state import create_key

    key = create_key(served, "streamer")
    with SlowEngine() as slow:
        state = engine.EngineState(pid=os.getpid(), port=slow.port, model=str(tiny_base), started_at=time.time(),
                                   venv="", log_path="", max_lora_rank=8, max_loras=2, max_model_len=128,
                                   dtype="float32", note="already running")
        monkeypatch.setattr(engine, "start", lambda *args, **kwargs: state)
        with Server(served, rsi_home, engine="openai") as url:
            body = {"model": "rsi/base", "messages": [{"role": "user", "content": "12+34="}], "stream": True,
                    "max_tokens": 5000}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {key}"}) as response:
                events = (json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: "))
                conversation = next(events)["conversation_id"]
                assert [next(events)["choices"][0]["delta"]["content"] for _ in range(3)] == ["7", "7", "7"]
                assert not slow.gone.is_set() and slow.sent < 5000  # passed through while the engine writes
            assert slow.gone.wait(10), "the engine's request stayed open after its client went away"
            assert slow.sent < 1000
            assert slow.bodies[0]["stream"] and slow.bodies[0]["prompt"] == "12+34="
            with pytest.raises(LookupError):
                state_messages(served, conversation, "streamer")


def test_a_person_asks_in_plain_words_and_gets_the_pairs_answer_back_in_plain_words(served, adapters, tiny_base,
                                                                                     rsi_home) -> None:
    """A message that is not the harness's own prompt: the family's view reads the task from it ("what is 12 plus
    34?"), the champion pair answers it under its harness (the model sees only the harness's prompt; a tool family
    runs its episode on the environment), and the reply says the pair's answer in plain words: the same words the
    pair gives when posed the task directly, whatever the task's right answer is. A message no view reads goes to
    the base under rsi/auto, and is refused when it names a specialist."""
    import httpx
    import openai

    from rsi.backends import get_backend
    from rsi.hcp import load_harness
    from rsi.mol.proxy import specialist_params
    from rsi.mol.state import create_key
    from rsi.mol.views import VIEWS, answer, posed_task
    from rsi.pair import Responder
    from rsi.tasks import get_family

    direct = get_backend("hf", model_dir=tiny_base)

    def expected(family: str, harness: str, text: str) -> str:  # the pair posed the task directly
        h, f = load_harness(harness), get_family(family)
        pair = Responder(h, direct, "direct", str(adapters[family]), f)
        task = posed_task(VIEWS[family], pair, text)
        return answer(VIEWS[family], pair, task, specialist_params(h, None)).message.content

    key = create_key(served, "person")
    added = expected("addition", "addition/v2", "12 + 34")
    assert added.startswith("12 + 34 = ")
    sorted_ = expected("sorting", "sorting/v1", "sort 3 1 4 1 5 9 2")
    with Server(served, rsi_home) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        for question in ("what is 12 plus 34?", "12 + 34", "Could you add 12 and 34, please?", "12+34="):
            reply = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": question}])
            assert (reply.model, reply.model_extra["rsi"]["router"]) == ("rsi/addition", "view"), question
            assert reply.choices[0].message.content == added, question
        reply = client.chat.completions.create(model="rsi/auto",
                                               messages=[{"role": "user", "content": "sort 3 1 4 1 5 9 2 please"}])
        assert reply.model == "rsi/sorting" and reply.choices[0].message.content == sorted_
        assert sorted_.startswith("sorted: ") or "no answer" in sorted_
        for chat in ("hello!", "what is the capital of France?", "1+2+3"):
            reply = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": chat}])
            assert reply.model == "rsi/base", chat
            # the built-in base is no chat model: a refusal that says what the specialists read, not its digits
            assert reply.choices[0].message.content.startswith("No specialist here reads a task"), chat
            assert "what is 12 plus 34?') (rsi/addition)" in reply.choices[0].message.content
        headers = {"Authorization": f"Bearer {key}"}
        refused = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
            "model": "rsi/addition", "messages": [{"role": "user", "content": "tell me a joke"}]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_task"
        assert "two whole numbers" in refused.json()["error"]["message"]
        refused = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={  # a tool family: the same
            "model": "rsi/sorting", "messages": [{"role": "user", "content": "sort these words: pear fig"}]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_task"
        too_long = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
            "model": "rsi/addition", "messages": [{"role": "user", "content": "what is 123456789012 plus 1?"}]})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "task_not_posable"
        swap = {"type": "function", "function": {"name": "swap", "parameters": {"type": "object"}}}
        for model, tools, field in (("rsi/sorting", [swap, {"type": "function", "function": {"name": "rm"}}],
                                     "tools[1].function.name"), ("rsi/addition", [swap], "tools[0].function.name"),
                                    ("rsi/base", [swap], "tools")):
            offered = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
                "model": model, "tools": tools, "messages": [{"role": "user", "content": "sort 3 1 4 1 5 9 2"}]})
            assert offered.status_code == 400 and offered.json()["error"]["param"] == field, offered.json()
        other = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={  # no specialist answers it
            "model": "gpt-4-other-tenant", "messages": [{"role": "user", "content": "12 + 34"}]})
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        deep = b'{"model": "rsi/auto", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        nested = httpx.post(f"{url}/v1/chat/completions", content=deep,
                            headers=headers | {"Content-Type": "application/json"})
        assert nested.status_code == 400 and "too deeply" in nested.json()["error"]["message"]


@pytest.mark.slow
def test_the_traffic_session_answers_in_plain_words_as_the_model_does(served, rsi_home, tmp_path) -> None:
    """bench/traffic.py end to end on the tiny specialists: a short mixed session through `rsi serve`; chit-chat
    never reaches a specialist, and with the bare base swapped in for the adapters every task the view read gets
    the base's own answer, task by task (the proxy says what the model answered, never the task's stored answer:
    the tiny base gets some right and some wrong)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("bench_traffic", REPO / "bench" / "traffic.py")
    traffic = sys.modules["bench_traffic"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(traffic)
    report = traffic.main(["--turns", "60", "--per-level", "4", "--out", str(tmp_path / "traffic.json")])
    summary, swapped = report["summary"], report["base_swapped"]
    assert summary["chat"]["n"] > 0 and summary["chat"]["to_specialist"] == 0
    assert summary["addition"]["n"] + summary["sorting"]["n"] + summary["chat"]["n"] == 60
    assert swapped["read"] > 10 and swapped["disagreeing"] == [] and swapped["agree"] == swapped["read"]
    assert 0 < swapped["direct_right"] < swapped["read"], "the tiny base should get some right and some wrong"
    assert (tmp_path / "traffic.json").is_file()


def _mutants(seed: int, n: int) -> list[bytes]:
    """``n`` malformed chat requests drawn with ``seed``: valid bodies with a node replaced by a value of another
    type or an extreme one, a key dropped or made up, a list emptied or wrapped, or the JSON text cut, a byte
    flipped, made invalid UTF-8 or nested deep."""
    import copy
    import json
    import random

    rng = random.Random(seed)
    call = {"id": "call_1", "type": "function", "function": {"name": "swap", "arguments": "{\"i\": 1}"}}
    valid = [
        {"model": "rsi/auto", "messages": [{"role": "user", "content": "12+34"}]},
        {"model": "rsi/addition", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "what is 2 plus 3?"}], "max_tokens": 8},
        {"model": "rsi/sorting", "messages": [{"role": "user", "content": "3141592>"},
                                              {"role": "assistant", "content": None, "tool_calls": [call]},
                                              {"role": "tool", "tool_call_id": "call_1", "content": "3411592>"}],
         "tools": [{"type": "function", "function": {"name": "swap", "parameters": {"type": "object"}}}]},
        {"model": "rsi/base", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9, "seed": 3,
         "stop": ["\n"], "n": 1, "conversation_id": "conv-x"},
    ]
    extremes = [None, True, False, 0, -1, 2**63, -(2**63), 10**40, 1e308, -1e-308, float("nan"), float("inf"), "",
                "x" * 5000, "\u0000", "\ud800", "rsi/", [], {}, [[]], [{}], {"": None}, [None] * 50]

    def nodes(value: object, path: tuple = ()) -> list[tuple]:
        out = [path]
        if isinstance(value, dict):
            for k, v in value.items():
                out += nodes(v, (*path, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                out += nodes(v, (*path, i))
        return out

    def at(value: object, path: tuple) -> object:
        for p in path:
            value = value[p]
        return value

    out = []
    while len(out) < n:
        body = copy.deepcopy(rng.choice(valid))
        kind = rng.randrange(8)
        path = rng.choice(nodes(body)[1:])
        parent, last = at(body, path[:-1]), path[-1]
        if kind <= 2:
            parent[last] = copy.deepcopy(rng.choice(extremes))
        elif kind == 3 and isinstance(parent, dict):
            del parent[last]
        elif kind == 3:
            parent[last] = [parent[last]]
        elif kind == 4:
            target = parent if isinstance(parent, dict) else body
            target[rng.choice(["role", "content", "tool_calls", "name", "extra", "messages", "model"])] = \
                copy.deepcopy(rng.choice(extremes))
        text = json.dumps(body, allow_nan=True, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        if kind == 5:
            text = text[:rng.randrange(len(text))]
        elif kind == 6:
            i = rng.randrange(len(text))
            text = text[:i] + bytes([rng.randrange(256)]) + text[i + 1:]
        elif kind == 7:
            depth = rng.choice([10, 1000, 100_000])
            text = text.replace(b'"12+34"', b"[" * depth + b"]" * depth, 1) if b'"12+34"' in text else \
                b"{\"a\": " * depth + b"1" + b"}" * depth
        out.append(text)
    return out


def test_a_thousand_malformed_bodies_get_client_errors_never_a_server_error(served, rsi_home) -> None:
    """A seeded fuzz of 1,200 malformed requests against the proxy on real specialists: none gets a 5xx; every
    4xx is an OpenAI error body naming what was wrong; a request the fuzz left valid is answered (200)."""
    import httpx

    from rsi.mol.state import create_key

    key = create_key(served, "fuzzer")
    statuses: dict[int, int] = {}
    with Server(served, rsi_home, rate=1e6, burst=1_000_000) as url, httpx.Client(timeout=120) as client:
        for body in _mutants(seed=7, n=1200):
            response = client.post(f"{url}/v1/chat/completions", content=body, headers={
                "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (body[:300], response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["message"] and error["type"], response.text[:300]
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 900, statuses


def test_served_turns_are_harvested_only_as_the_proxy_wrote_them_and_the_auditor_passes_them(served, rsi_home) -> None:
    """rsi.mol.harvest on real traffic: plain-words turns of both specialists through the proxy. A turn is judged
    only where the proxy wrote its reply (its record: the model's own trajectory), against the task derived again
    from the message; it passes exactly when the reply said the right answer; test-split tasks, turns in the
    harness's own format and everything a client wrote (claimed answers, a made-up record) are not harvested, and a
    record edited in the state DB (a tool result changed) fails the audit."""
    import openai
    from sqlalchemy import select

    from rsi.mol.harvest import harvest
    from rsi.mol.proxy import RECORD
    from rsi.mol.registry import Registry
    from rsi.mol.state import create_key
    from rsi.store.schema import ConversationMessageRow
    from rsi.tasks import get_family

    champions = Registry(served, rsi_home).champions()
    sorting, addition = get_family("sorting"), get_family("addition")
    asked = {"sorting": [(t, "sort " + " ".join(map(str, t.payload["items"])) + " please", t.split)
                         for split in ("train", "test") for lvl in (1, 2) for t in sorting.tasks(split, 5, lvl, 6)],
             "addition": [(t, f"what is {t.payload['a']} plus {t.payload['b']}?", t.split)
                          for split in ("train", "test") for lvl in (1, 2, 3) for t in addition.tasks(split, 5, lvl, 4)]}
    right: dict[str, set[str]] = {"sorting": set(), "addition": set()}
    key = create_key(served, "person")
    with Server(served, rsi_home, rate=1e6, burst=1_000_000) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        for name, turns in asked.items():
            for task, text, split in turns:
                reply = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": text}])
                assert reply.model == f"rsi/{name}"
                said = reply.choices[0].message.content
                ok = said == (f"sorted: {' '.join(map(str, sorted(task.payload['items'])))}" if name == "sorting"
                              else f"{task.payload['a']} + {task.payload['b']} = {task.payload['a'] + task.payload['b']}")
                if ok and split == "train":
                    right[name].add(reply.model_extra["conversation_id"])
        own = champions["addition"].harness.prompt(asked["addition"][0][0].payload)  # its own format: no record
        client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": own}])
        for name, turns in asked.items():  # forged: a client's history claims answers (one with a made-up record)
            for task, text, split in turns[:3]:
                client.chat.completions.create(model="rsi/auto", messages=[
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": "sorted: 1 2 3" if name == "sorting" else "= 99",
                     RECORD: {"plan": False, "harness": champions[name].harness.hash, "trajectories": []}},
                    {"role": "user", "content": "thanks!"}])
    def harvest_of(name: str, **options):
        champion = champions[name]
        return harvest(served, champion.harness, champion.pair_id, [champion.specialist], **options)

    for name in ("sorting", "addition"):
        got = harvest_of(name)
        trains = sum(split == "train" for _, _, split in asked[name])
        assert len(got.passed) + len(got.failed) == trains, (name, got.skipped)
        assert all(h.task.split == "train" and h.trajectory.task_id == h.task.id for h in got.passed + got.failed)
        assert got.skipped["task in the test split"] == len(asked[name]) - trains
        assert harvest_of(name, exclude_keys=["person"]).passed == []
        # a turn passes exactly when its reply said the right answer
        assert {h.conversation_id for h in got.passed} == right[name], name
    got = harvest_of("addition")
    assert got.passed
    assert got.skipped["no record (answered in the harness's own format)"] == 1
    # a record edited in the state DB: a passed turn's answer changed to the right one of another task
    victim = got.passed[0]
    with served.session() as s:
        row = s.scalars(select(ConversationMessageRow).where(
            ConversationMessageRow.conversation_id == victim.conversation_id,
            ConversationMessageRow.position == victim.position)).one()
        message = dict(row.message)
        trajectory = dict(message[RECORD]["trajectories"][0])
        trajectory["messages"] = [*trajectory["messages"][:-1], {**trajectory["messages"][-1], "content": "0="}]
        message[RECORD] = {**message[RECORD], "trajectories": [trajectory]}
        row.message = message
    again = harvest_of("addition")
    assert victim.conversation_id in {h.conversation_id for h in again.failed}
    assert len(again.passed) == len(got.passed) - 1


def test_a_generation_learns_from_served_turns_as_audited_and_forgets_them_when_pruned(
        adapters, tiny_base, rsi_home, prefect_api) -> None:
    """`rsi run --from-traffic` (proposer.source traffic) end to end: a lineage started from the addition adapter
    serves as a specialist before any promotion; people ask it through the proxy; one generation harvests what
    was served. Its discover stage holds exactly the turns of keys that did not opt out, on train-split tasks;
    execute rolls nothing out (the stored trajectories are the model's recorded replies, each naming its
    conversation); the dataset holds exactly the turns whose reply said the right answer; claimed answers in a
    client's history and a record edited in the state DB give no example; pruning the conversations deletes the
    harvested trajectories."""
    from datetime import datetime, timedelta, timezone

    import openai
    from sqlalchemy import select

    from rsi.mol.proxy import RECORD
    from rsi.mol.registry import Registry, add_specialist
    from rsi.mol.routers import train_router
    from rsi.mol.state import create_key, prune_conversations, set_harvest
    from rsi.store import open_store
    from rsi.store.schema import ConversationMessageRow, ConversationRow, DatasetItem, StageRun, TrajectoryRow
    from rsi.tasks import get_family

    from .test_cycle import run_tiny

    seed_home(rsi_home, tiny_base)
    lineage = {"lineage": "adder", "family": "addition", "harness": "addition/v2",
               "start_adapter": str(adapters["addition"]), "proposer": {"source": "traffic"},
               "selection": {"replay_generations": 0}}
    summaries, _ = run_tiny(1, **lineage)  # nothing served yet, and no specialist
    assert "no served turn to harvest" in (summaries[0].stopped or ""), summaries[0]
    store = open_store()
    add_specialist(store, "adder", name="adder", description="adds two numbers", levels=ADDITION_LEVELS)
    train_router("ngram", Registry(store, rsi_home).champions(), rsi_home, per_level=16)
    person, quiet = create_key(store, "person"), create_key(store, "quiet")
    set_harvest(store, "quiet", False)
    family = get_family("addition")
    asked = [t for split in ("train", "test") for lvl in (1, 2, 3) for t in family.tasks(split, 5, lvl, 5)]
    right: set[str] = set()
    with Server(store, rsi_home, rate=1e6, burst=1_000_000) as url:
        clients = {key: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) for key in (person, quiet)}
        for task in asked:
            for key, client in clients.items():
                reply = client.chat.completions.create(model="rsi/adder", messages=[
                    {"role": "user", "content": f"what is {task.payload['a']} plus {task.payload['b']}?"}])
                said = f"{task.payload['a']} + {task.payload['b']} = {task.payload['a'] + task.payload['b']}"
                if key == person and task.split == "train" and reply.choices[0].message.content == said:
                    right.add(reply.model_extra["conversation_id"])
        for task in asked[:5]:  # claimed right answers in a client's history, one with a made-up record
            clients[person].chat.completions.create(model="rsi/auto", messages=[
                {"role": "user", "content": f"what is {task.payload['a']} plus {task.payload['b']}?"},
                {"role": "assistant", "content": f"= {task.payload['a'] + task.payload['b']}",
                 RECORD: {"plan": False, "harness": "x", "trajectories": []}},
                {"role": "user", "content": "thanks!"}])
    assert right, "the adapter answered no train-split question right: nothing to check the dataset against"
    edited = sorted(right)[0]  # a right turn's record edited after the fact: its reply now wrong
    with store.session() as s:
        row = s.scalars(select(ConversationMessageRow).where(ConversationMessageRow.conversation_id == edited,
                                                             ConversationMessageRow.position == 1)).one()
        message = dict(row.message)
        trajectory = dict(message[RECORD]["trajectories"][0])
        trajectory["messages"] = [*trajectory["messages"][:-1], {**trajectory["messages"][-1], "content": "0="}]
        row.message = {**message, RECORD: {**message[RECORD], "trajectories": [trajectory]}}

    summaries, _ = run_tiny(1, **lineage)  # generation 1 again: discover harvests what was served since
    assert summaries[0].stopped is None and summaries[0].gate in ("promoted", "rejected"), summaries[0]
    with store.session() as s:
        # in run order: the second run's discover (what was served) replaces the first's (nothing yet)
        stage = {r.stage: r.result for r in s.scalars(select(StageRun).where(StageRun.status == "done")
                                                       .order_by(StageRun.id))}
        turns = stage["discover"]["traffic"]["turns"]
        stored = {r.id: r.conversation_id for r in s.scalars(select(TrajectoryRow).where(
            TrajectoryRow.id.in_([t["trajectory_id"] for t in turns])))}
        items = set(s.scalars(select(DatasetItem.trajectory_id).where(
            DatasetItem.dataset_digest == stage["select"]["digest"])))
        people = {s.get(ConversationRow, t["conversation_id"]).api_key for t in turns}
    trains = sum(t.split == "train" for t in asked)
    assert people == {"person"} and len(turns) <= trains and {t["level"] for t in turns} <= {1, 2, 3}
    assert stage["execute"]["ids"] == [t["trajectory_id"] for t in turns]  # nothing rolled out
    assert stored == {t["trajectory_id"]: t["conversation_id"] for t in turns}
    by_conversation = {t["conversation_id"]: t["trajectory_id"] for t in turns}
    assert items == {by_conversation[c] for c in right - {edited}}, (len(items), len(right))

    prune_conversations(store, datetime.now(timezone.utc) + timedelta(days=1))
    with store.session() as s:
        assert s.scalars(select(TrajectoryRow).where(TrajectoryRow.id.in_(list(stored)))).all() == []
    store.dispose()


def test_rsi_run_from_traffic_with_nothing_served_says_why_and_exits_0(tiny_base, rsi_home) -> None:
    """The CLI before any traffic: the generation stops naming why (no specialist, nothing served), the lineage has
    no version yet, and that is not an error; --from-traffic with another --proposer is one (exit 2)."""
    seed_home(rsi_home, tiny_base)
    run = ["run", "addition", "--profile", "tiny", "--from-traffic", "--generations", "1"]
    done = _rsi(*run)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no served turn to harvest" in done.stdout and "has no version yet" in done.stdout, done.stdout[-2000:]
    both = _rsi(*run, "--proposer", "self")
    assert both.returncode == 2 and "give one" in both.stderr and "Traceback" not in both.stderr, both.stderr
