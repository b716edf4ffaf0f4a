"""A client session against ``rsi serve`` on real lineage champions, with the official ``openai`` client: does
the proxy serve each champion as its lineage evaluates it?

Per specialist, held-out tasks of the ``test`` split (no decision of any lineage saw them) at each level, asked
as a person would ask them (the user message the champion's harness writes, model ``rsi/auto``): an
answer-family question is one request; a tool family's task is a whole episode over the API, the client running
each tool call on its own copy of the environment (``rsi.substrate``) and sending the result back with the
conversation id, until the specialist gives its final reply or the harness's step limit. The baseline, in the
same run: the champion evaluated directly (``rsi.evaluate.solved``, greedy, its own harness, no proxy) on the
same tasks. It prints, per specialist and level, the share routed to the right specialist and the share solved
through the proxy and directly.

Then the rest of a session: one question streamed (the chunks' text equals the plain reply), a wrong key
(401), and a restart: a tool episode begun on one proxy is continued on a new one from the stored
conversation (the client sends only the tool result and the conversation id).

Data: an RSI home whose specialists are admitted and whose ngram router is trained (``rsi specialists add``,
``rsi router train``). The session makes an API key and revokes it at the end. Run:

    RSI_HOME=/tmp/acc-home .venv/bin/python bench/serve_session.py [--n 8] [--out JSON]

It writes ``bench/results/serve-session.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from provenance import machine_info, run_config, write_result
from serve import proxy

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "serve-session.json"


def levels_of(champion: Any, family: Any) -> list[int]:
    """The levels the specialist was admitted with (its routing levels) at which its harness writes a task as
    one message (a plan's long tasks have no one-message form)."""
    from rsi.errors import UserError
    from rsi.mol.routers import user_text

    out = []
    for level in champion.specialist.levels:
        try:
            user_text(champion.harness, family.task("test", 0, level, 0).payload)
        except UserError:
            continue
        out.append(level)
    return out


def ask(client: Any, task: Any, champion: Any, family: Any, conversation: str | None = None,
        first: Any = None) -> tuple[bool, str, str | None]:
    """One task through the proxy: (solved, who answered the first turn, conversation id). A tool episode runs
    its calls on the client's own environment; ``first`` continues one whose first reply came already."""
    from rsi.hcp.syntax import parse_reply
    from rsi.substrate import Session

    from rsi.mol.routers import user_text

    harness = champion.harness
    messages = [{"role": "user", "content": user_text(harness, task.payload)}]
    reply = first or client.chat.completions.create(model="rsi/auto", messages=messages,
                                                    extra_body={"conversation_id": conversation} if conversation else None)
    who, conversation = reply.model.removeprefix("rsi/"), reply.model_extra["conversation_id"]
    if not harness.document.tools:
        text = reply.choices[0].message.content or ""
        if harness.document.plan is not None:  # the plan's composed answer, as a value
            value = int(text) if text.isdigit() else None
        else:
            parsed = parse_reply(text, harness.document.answer)
            value = parsed.value if parsed.ok and not parsed.extra else None
        return value is not None and family.verify(task, value), who, conversation
    session = Session(family.environment, task.payload, harness.tool_schemas)
    for _ in range(harness.document.limits.max_steps):
        calls = reply.choices[0].message.tool_calls or []
        if not calls:
            parsed = parse_reply(reply.choices[0].message.content or "", harness.document.answer)
            return family.verify(task, {"state": session.state, "answer": parsed.value}), who, conversation
        call = calls[0]
        record = session.call(call.id, call.function.name, json.loads(call.function.arguments))
        reply = client.chat.completions.create(
            model="rsi/auto", extra_body={"conversation_id": conversation},
            messages=[{"role": "tool", "tool_call_id": call.id, "content": str(record.result)}])
    return False, who, conversation


def direct(champions: dict[str, Any], tasks: dict[str, list]) -> dict[str, dict[str, bool]]:
    """The baseline: each champion on its tasks, evaluated as its lineage is (greedy, no proxy)."""
    from rsi.backends import get_backend
    from rsi.evaluate import solved
    from rsi.pair import Responder, sampling_params

    out = {}
    for name, champion in champions.items():
        backend = get_backend("hf", model_dir=champion.base_dir)
        try:
            pair = Responder(champion.harness, backend, champion.pair_id, champion.adapter_dir)
            out[name] = solved(pair, tasks[name], sampling_params(champion.harness, seed=0, greedy=True))
        finally:
            backend.close()
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="test tasks per specialist and level")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    import httpx
    import openai

    from rsi.config import get_settings
    from rsi.mol.registry import Registry
    from rsi.mol.state import create_key, revoke_key
    from rsi.store import open_store
    from rsi.tasks import get_family

    store = open_store()
    champions = Registry(store, get_settings().home).champions()
    if len(champions) < 2:
        sys.exit(f"{len(champions)} specialist(s) with a champion in RSI_HOME={get_settings().home}: admit at least "
                 "two (`rsi specialists add LINEAGE`) and train the router (`rsi router train`)")
    families = {n: get_family(c.harness.document.family) for n, c in champions.items()}
    tasks = {n: [t for lvl in levels_of(c, families[n]) for t in families[n].tasks("test", 0, lvl, args.n)]
             for n, c in champions.items()}
    baseline = direct(champions, tasks)
    key_name = f"serve-session-{uuid.uuid4().hex[:8]}"
    key = create_key(store, key_name)
    rows, checks = [], {}
    try:
        with proxy("hf") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
            for name, champion in champions.items():
                for task in tasks[name]:
                    ok, who, _ = ask(client, task, champion, families[name])
                    rows.append({"specialist": name, "level": task.level, "task": task.id, "routed": who,
                                 "solved": ok, "direct": baseline[name][task.id]})
            name = next(n for n, c in champions.items() if not c.harness.document.tools)
            question = champions[name].harness.prompt(tasks[name][-1].payload)
            plain = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": question}])
            chunks = list(client.chat.completions.create(model="rsi/auto", stream=True,
                                                         messages=[{"role": "user", "content": question}]))
            checks["stream"] = {"specialist": name, "chunks": len(chunks),
                                "same_text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                                == plain.choices[0].message.content}
            wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer rsi-wrong"})
            checks["wrong_key"] = {"status": wrong.status_code, "type": wrong.json()["error"]["type"]}
            tool_name = next((n for n, c in champions.items() if c.harness.document.tools), None)
            if tool_name is not None:  # an episode's first turn on this proxy
                task = max(tasks[tool_name], key=lambda t: t.level)
                first = client.chat.completions.create(
                    model="rsi/auto", messages=[{"role": "user", "content": champions[tool_name].harness.prompt(task.payload)}])
        if tool_name is not None:
            with proxy("hf") as url:  # a new proxy: the rest of the episode from the stored conversation
                client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
                ok, who, conversation = ask(client, task, champions[tool_name], families[tool_name], first=first)
                checks["restart"] = {"specialist": tool_name, "level": task.level, "routed": who, "solved": ok,
                                     "direct": baseline[tool_name][task.id],
                                     "first_turn_tool_calls": len(first.choices[0].message.tool_calls or [])}
    finally:
        revoke_key(store, key_name)
    table = summarize(rows)
    print_table(table, checks)
    report = {"command": "python bench/serve_session.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "specialists": {n: {"lineage": c.specialist.lineage, "generation": c.generation, "harness": c.harness.id,
                                  "base": str(c.base_dir)} for n, c in champions.items()},
              "per_level": table, "checks": checks, "requests": rows, "machine": machine_info(None)}
    write_result(args.out, report, run_config(args))
    return report


def summarize(rows: list[dict]) -> list[dict]:
    by: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        by.setdefault((r["specialist"], r["level"]), []).append(r)
    return [{"specialist": s, "level": lvl, "n": len(rs), "routed": sum(r["routed"] == s for r in rs) / len(rs),
             "solved_proxy": sum(r["solved"] for r in rs) / len(rs), "solved_direct": sum(r["direct"] for r in rs) / len(rs)}
            for (s, lvl), rs in sorted(by.items())]


def print_table(table: list[dict], checks: dict) -> None:
    print("| specialist | level | n | routed right | solved via proxy | solved directly |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['specialist']} | {r['level']} | {r['n']} | {r['routed']:.3f} | {r['solved_proxy']:.3f} "
              f"| {r['solved_direct']:.3f} |")
    print()
    for name, check in checks.items():
        print(f"{name}: {json.dumps(check)}")


if __name__ == "__main__":
    main()
