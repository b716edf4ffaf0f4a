"""A person's session with ``rsi serve`` in plain words: are the questions people ask answered right by the
specialists, and does chit-chat stay off them?

``--turns`` turns (2,000 by default) through the official ``openai`` client, model ``rsi/auto``, each a new
conversation of one user message, mixed: additions of levels 1-6 (half), lists of 7 digits to sort (a quarter),
chit-chat (a quarter). Each task is a **test**-split task of its family (no decision of any lineage saw it),
asked through one of the templates below, which are kept apart from the reader's own tests: a template marked
``held_out`` has no phrasing in ``tests/test_views.py`` (``tests/test_traffic.py`` checks it, and that they are
at least a third). A task's reply counts right only when it says the family's right answer in the view's words
(``12 + 34 = 46``, ``sorted: 1 1 2 3 4 5 9``); a refusal counts wrong. A chit-chat turn counts right when no
specialist answers it (the reply's model is ``rsi/base``).

Then the base is swapped in for every specialist's adapter (the proxy's registry serves each champion's harness
on the bare base: ``--swapped``, this script's own child) and the same task turns are asked again; the baseline in
the same run is the base run directly under each harness on the same tasks (greedy, batched, no proxy), its
answer said in the view's words (``rsi.mol.views.said``). They must agree task by task, word for word: the
proxy's answer is the model's, not the task's stored answer.

Data: an RSI home whose addition and sorting lineages are admitted as specialists (``rsi specialists add``) and
whose router is trained (``rsi router train``); a key is made for the session and revoked at its end. Run:

    RSI_HOME=/tmp/home .venv/bin/python bench/traffic.py [--turns 2000] [--seed 0] [--clients 1] [--out JSON]

It writes ``bench/results/traffic.json``.
"""

from __future__ import annotations

import argparse
import random
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from provenance import machine_info, run_config, write_result
from serve import proxy

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "traffic.json"
ADDITION_LEVELS = (1, 2, 3, 4, 5, 6)


@dataclass(frozen=True)
class Template:
    """A way a person asks: ``{a}``/``{b}`` (an addition's operands) or ``{spaced}``/``{commas}``/``{listed}``/
    ``{joined}`` (a list's digits: "3 1 4", "3,1,4", "3, 1, 4", "314"); ``held_out``: no phrasing of it is among the
    reader's tests; ``fresh``: held out and written before the reader was last changed, without a run of the
    reader on it (commit 'bench/traffic.py: fresh held-out templates' comes before the reader's change), so the
    session measures how the reader generalizes, not what it was fitted to."""

    text: str
    held_out: bool = False
    fresh: bool = False

    def ask(self, payload: dict[str, Any]) -> str:
        if "items" in payload:
            digits = [str(d) for d in payload["items"]]
            return self.text.format(spaced=" ".join(digits), commas=",".join(digits), listed=", ".join(digits),
                                    joined="".join(digits))
        return self.text.format(**payload)


ADDITION = [Template(t) for t in (
    "{a}+{b}", "{a} + {b} =", "what is {a} plus {b}?", "What's {a}+{b}?", "how much is {a} plus {b}?",
    "Calculate {a} + {b}.", "add {a} and {b}", "Could you please add {a} to {b}?", "What is the sum of {a} and {b}?",
    "{a} and {b} added together", "hi, what is {a} plus {b}? thanks", "{a} + {b} equals what?",
    "can you tell me what {a} plus {b} is?")] + [Template(t, held_out=True) for t in (
    "Please compute the sum of {a} and {b}.", "What do you get when you add {a} and {b}?", "{a} plus {b} is?",
    "what does {a} + {b} equal?", "tell me the answer to {a} + {b}", "{a} plus {b} equals?",
    "what's the total of {a} and {b}?", "Hey, quick question: what is {a} + {b}?", "please work out {a} plus {b}")] + [
    Template(t, held_out=True, fresh=True) for t in (
        "what do {a} and {b} add up to?", "could you add up {a} and {b} for me?", "sum {a} and {b}", "I need {a} plus {b}",
        "what is the result of {a} + {b}?", "how much do {a} and {b} make?", "{a} + {b}, what's that?",
        "Add these: {a} and {b}", "what would {a} plus {b} be?", "add {a} to {b} and tell me the result")]
SORTING = [Template(t) for t in (
    "sort {spaced}", "Sort {commas} please", "put {spaced} in order", "sort: {joined}", "order these numbers: {spaced}",
    "[{listed}] sorted", "arrange {spaced} in ascending order")] + [Template(t, held_out=True) for t in (
    "could you arrange these: {listed}", "sort these digits: {listed}", "please put these in order: {spaced}",
    "{spaced} sorted please")] + [Template(t, held_out=True, fresh=True) for t in (
        "sort the numbers {spaced}", "can you sort this list: {commas}?", "order {listed} from smallest to largest",
        "I need {spaced} sorted")]
CHAT = ["hello!", "how are you today?", "What's the capital of France?", "tell me a joke", "thanks, that's all",
        "what is 12?", "1+2+3", "what is 7 times 8?", "sort my life out", "who wrote Hamlet?",
        "what's the weather like?", "can you help me with my homework?", "12 - 5", "what time is it?",
        "good morning", "I have 3 cats", "write me a poem about numbers", "what is the square root of 16?",
        "is 17 prime?", "sort these words: banana apple cherry", "goodbye", "what's 2 to the power of 10?",
        "explain LoRA in one sentence", "how many days are in a week?", "order a pizza for me",
        "add milk to my shopping list", "what is 3.5 plus 1.2?", "what's -4 + 6?", "1, 2, 3, go!", "who are you?"]
FAMILIES = {"addition": ADDITION, "sorting": SORTING}


def right_words(family: str, payload: dict[str, Any]) -> str:
    """The reply that says the family's right answer, in the view's words."""
    from rsi.mol.views import VIEWS

    if family == "addition":
        return VIEWS["addition"].say(payload, payload["a"] + payload["b"])
    return VIEWS["sorting"].say(payload, {"state": {"items": sorted(payload["items"])}})


def script(turns: int, seed: int, per_level: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The session's turns, in order: (kind, template, task) drawn with ``seed``; tasks from the test split, each
    level's in index order. Also the tasks asked, by id."""
    from rsi.tasks import get_family

    rng = random.Random(seed)
    pools = {("addition", lvl): get_family("addition").tasks("test", 0, lvl, per_level) for lvl in ADDITION_LEVELS}
    sorting = get_family("sorting")
    pools |= {("sorting", lvl): sorting.tasks("test", 0, lvl, per_level)
              for lvl in range(sorting.min_level, sorting.max_level + 1)}
    used: dict[tuple[str, int], int] = {}
    out, asked = [], {}
    for i in range(turns):
        kind = rng.choices(["addition", "sorting", "chat"], weights=[2, 1, 1])[0]
        if kind == "chat":
            out.append({"turn": i, "kind": kind, "template": None, "held_out": None, "text": rng.choice(CHAT)})
            continue
        levels = sorted(lvl for family, lvl in pools if family == kind)
        level = levels[i % len(levels)] if kind == "addition" else rng.choice(levels)
        pool = pools[(kind, level)]
        task = pool[used.get((kind, level), 0) % len(pool)]
        used[(kind, level)] = used.get((kind, level), 0) + 1
        asked[task.id] = task
        template = rng.choice(FAMILIES[kind])
        out.append({"turn": i, "kind": kind, "level": level, "task": task.id, "payload": task.payload,
                    "template": template.text, "held_out": template.held_out, "fresh": template.fresh,
                    "text": template.ask(task.payload)})
    return out, asked


def ask_all(url: str, key: str, turns: list[dict[str, Any]], clients: int = 1) -> list[dict[str, Any]]:
    """Each turn as a new conversation, asked by ``clients`` clients at once (the engine batches concurrent
    requests to one base); what answered it and whether the reply is right, in the turns' order."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)

    def ask(t: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = client.chat.completions.create(model="rsi/auto", messages=[{"role": "user", "content": t["text"]}])
            model, content = reply.model, reply.choices[0].message.content or ""
            router = (reply.model_extra.get("rsi") or {}).get("router")
        except openai.APIStatusError as exc:  # a 4xx is an answer too: a refusal, counted wrong
            model, content, router = None, f"HTTP {exc.status_code}: {exc.message}", None
        right = model == "rsi/base" if t["kind"] == "chat" else content == right_words(t["kind"], t["payload"])
        return {**{k: v for k, v in t.items() if k != "payload"}, "model": model, "router": router,
                "reply": content, "right": right}

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(ask, turns))


def share(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"n": len(rows), "right": sum(r["right"] for r in rows) / len(rows) if rows else None}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tasks = [r for r in rows if r["kind"] != "chat"]
    out: dict[str, Any] = {"chat": share([r for r in rows if r["kind"] == "chat"]) | {
        "to_specialist": sum(r["model"] not in ("rsi/base", None) for r in rows if r["kind"] == "chat")}}
    for family in FAMILIES:
        mine = [r for r in tasks if r["kind"] == family]
        out[family] = share(mine) | {
            "refused": sum(r["model"] is None or r["router"] != "view" for r in mine),
            "held_out": share([r for r in mine if r["held_out"]]),
            "fresh": share([r for r in mine if r.get("fresh")]),
            "seen": share([r for r in mine if not r["held_out"]]),
            "per_level": {lvl: share([r for r in mine if r["level"] == lvl])
                          for lvl in sorted({r["level"] for r in mine})},
            "per_template": {t: share([r for r in mine if r["template"] == t]) for t in sorted({r["template"]
                                                                                              for r in mine})}}
    return out


def base_direct(champions: dict[str, Any], tasks: dict[str, Any]) -> dict[str, str]:
    """The baseline of the swapped arm: the bare base under each champion's harness on the session's tasks, run
    directly (greedy, batched, no proxy) and its answer said as the view says it (``rsi.mol.views.said``: the
    model's answer, never the task's stored one): task id -> what a person would be told."""
    from rsi.backends import get_backend
    from rsi.evaluate import posable
    from rsi.mol.views import VIEWS, said
    from rsi.pair import Responder, sampling_params
    from rsi.tasks import get_family

    out: dict[str, str] = {}
    for champion in champions.values():
        family = get_family(champion.harness.document.family)
        mine = posable(champion.harness, family, [t for t in tasks.values() if t.family == family.name])
        backend = get_backend("hf", model_dir=champion.base_dir)
        try:
            pair = Responder(champion.harness, backend, "base", None, family)
            run = pair.run(mine, sampling_params(champion.harness, seed=0, greedy=True))
            out |= said(VIEWS[family.name], pair, mine, run)
        finally:
            backend.close()
    return out


def serve_swapped(argv: list[str]) -> None:
    """The child: ``rsi serve`` with the registry's champions given no adapter (the base swapped in)."""
    import dataclasses

    import rsi.mol.registry
    from rsi.cli import app
    from rsi.mol.registry import Registry

    class Swapped(Registry):
        def champions(self) -> dict[str, Any]:
            return {n: dataclasses.replace(c, adapter_dir=None) for n, c in super().champions().items()}

    rsi.mol.registry.Registry = Swapped  # what the proxy's Service looks up when it starts
    app(argv, prog_name="rsi")


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0, help="draws the session's kinds, levels and templates")
    parser.add_argument("--per-level", type=int, default=64, help="distinct test tasks a level, asked in turn")
    parser.add_argument("--clients", type=int, default=1, help="turns asked at once, each a client of its own "
                        "(a SmolLM2 session: a sorting turn is a tool episode of ~36 s on 2 cores)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error(f"--clients {args.clients}: give 1 or more")

    from rsi.config import get_settings
    from rsi.mol.registry import Registry
    from rsi.mol.state import create_key, revoke_key
    from rsi.store import open_store

    store = open_store()
    champions = Registry(store, get_settings().home).champions()
    families = {c.harness.document.family: n for n, c in champions.items()}
    if not set(FAMILIES) <= set(families):
        sys.exit(f"RSI_HOME={get_settings().home} serves {sorted(families) or 'no family'}: admit an addition and a "
                 "sorting lineage (`rsi specialists add LINEAGE`) and train the router (`rsi router train`)")
    turns, tasks = script(args.turns, args.seed, args.per_level)
    key_name = f"traffic-{uuid.uuid4().hex[:8]}"
    key = create_key(store, key_name)
    try:
        with proxy("hf") as url:
            rows = ask_all(url, key, turns, args.clients)
        asked = [t for t in turns if t["kind"] != "chat"]
        with proxy("hf", [sys.executable, str(Path(__file__).resolve()), "--swapped"]) as url:  # bare base
            swapped = ask_all(url, key, asked, args.clients)
    finally:
        revoke_key(store, key_name)
    direct = base_direct(champions, tasks)
    read = [(s, direct[s["task"]], right_words(s["kind"], tasks[s["task"]].payload))
            for s in swapped if s["router"] == "view"]
    agree = {"turns": len(swapped), "read": len(read), "agree": sum(s["reply"] == d for s, d, _ in read),
             "proxy_right": sum(s["right"] for s, _, _ in read), "direct_right": sum(d == w for _, d, w in read),
             "disagreeing": [{"turn": s["turn"], "proxy": s["reply"], "direct": d} for s, d, _ in read
                             if s["reply"] != d]}
    summary = summarize(rows)
    addition = [r for r in rows if r["kind"] == "addition"]
    print_table(summary, agree, len(addition))
    report = {"command": "python bench/traffic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "specialists": {n: {"lineage": c.specialist.lineage, "generation": c.generation, "harness": c.harness.id}
                              for n, c in champions.items()},
              "templates": {f: [{"text": t.text, "held_out": t.held_out, "fresh": t.fresh} for t in ts]
                            for f, ts in FAMILIES.items()},
              "summary": summary, "base_swapped": agree, "turns": rows, "swapped_turns": swapped,
              "machine": machine_info(None)}
    write_result(args.out, report, run_config(args))
    return report


def print_table(summary: dict[str, Any], agree: dict[str, Any], n_addition: int) -> None:
    print("| asked | turns | right | seen templates | held-out templates | refused |")
    print("|---|---:|---:|---:|---:|---:|")
    for family in FAMILIES:
        s = summary[family]
        print(f"| {family} | {s['n']} | {s['right']:.3f} | {s['seen']['right']:.3f} | {s['held_out']['right']:.3f} | "
              f"{s['refused']} |")
    chat = summary["chat"]
    print(f"| chit-chat | {chat['n']} | {chat['right']:.3f} (to a specialist: {chat['to_specialist']}) | | | |")
    print("\naddition per level: " + ", ".join(f"L{lvl} {s['right']:.3f} ({s['n']})"
                                              for lvl, s in summary["addition"]["per_level"].items()))
    print(f"base swapped in: {agree['agree']} of {agree['read']} read turns agree with the base's direct evaluation "
          f"(proxy right {agree['proxy_right']}, direct right {agree['direct_right']})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--swapped"]:
        serve_swapped(sys.argv[2:])
    else:
        main()
