"""Views: how a person's plain message poses a family's task, and how the pair's answer is said back to them.

A specialist's harness speaks a format of its own (``2100000000+4300000000=`` under addition/v2); a person writes
"what is 12 plus 34?". A view reads such a message into the family's payload (or refuses it: ``None``), the
serving proxy poses that task to the champion pair under its own harness (plan, tool episode and all: the model
sees only harness-rendered prompts), and the view says the pair's answer in plain words. The answer is the
model's: the harness's parser reads the value from its reply, or, for a tool family, the state its calls left
(replayed on the family's environment); nothing is taken from the task's stored answer.

A view belongs to the family, not to each harness: once the harness's parser has read it, the pair's answer is
the family's value under any harness. ``VIEWS`` holds the built-in families' (a family without one is served only
in its harness's own format).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rsi.errors import UserError



@dataclass(frozen=True)
class View:
    """``read``: a message -> the payload it poses, or None; ``say``: (payload, the pair's answer) -> a reply."""

    read: Callable[[str], dict[str, Any] | None]
    say: Callable[[dict[str, Any], Any], str]
    asks: str  # what the family reads, for a refusal: "an addition of two whole numbers ('12 + 34')"


# ---- reading ------------------------------------------------------------------------------------------------------

_HEAD = re.compile(r"^(?:hey|hi|hello|ok|okay|so|please|pls|kindly|quick question|(?:can|could|would|will) you"
                   r"(?: please)?|i(?:'d| would) like you to|tell me|help me(?: with)?)[,:!]?\s+")
_TAIL = re.compile(r"(?:[\s,]+(?:please|pls|thanks|thank you|for me|quickly|now)|\s*[?.!]+)\s*$")
NUMBER = r"(\d{1,60})"


def _core(text: str) -> str:
    """The message lower-cased, whitespace collapsed, greetings, requests and thanks around it taken off."""
    core, before = re.sub(r"\s+", " ", text.strip().lower()), None
    while core != before:
        before, core = core, _TAIL.sub("", _HEAD.sub("", core)).strip()
    return core


_SUMS = [re.compile(p) for p in (
    rf"^(?:what(?:'s| is)|whats|how much is|compute|calculate|evaluate|work out|solve|find)?\s*{NUMBER}\s*"
    rf"(?:\+|plus|and)\s*{NUMBER}(?:\s*=\s*\??)?(?:\s*(?:equals|is|makes)(?: what)?)?$",
    rf"^(?:what(?:'s| is)|whats|find|compute|calculate|give me|tell me)?\s*(?:the )?(?:sum|total) of {NUMBER} "
    rf"(?:and|plus|\+) {NUMBER}$",
    rf"^add(?: up| together)? {NUMBER} (?:and|to|with|\+|plus) {NUMBER}$",
    rf"^(?:what do you get (?:if|when) you )?add {NUMBER} (?:and|to) {NUMBER}$",
    rf"^{NUMBER} and {NUMBER} (?:added(?: together| up)?|summed|together)$",
    rf"^what(?:'s| is) {NUMBER} added to {NUMBER}$",
    rf"^(?:what|how much) {NUMBER} (?:\+|plus) {NUMBER} (?:is|makes|equals|gives)$",
    rf"^(?:if you )?(?:have|had) {NUMBER} (?:\w+ )?and (?:get|got|add|added) {NUMBER}(?: more)?,? how many"
    rf"(?: \w+)?(?: do you have| in total| altogether)?$",
)]


# The words a request to add or to sort may hold besides its numbers, its operator and its verb: asking, wanting,
# politeness and the words around a result. A message with any other word (a story, another question, another
# operation) is not read: a refusal costs a person a rephrasing, a misreading a wrong answer.
_ASKING = frozenset("""
    a an the this that these those it its it's that's them what what's whats which how much many is are was be
    would will could can do does did you your me my i i'd i'm we us let let's please pls kindly just quickly now
    tell give get show say find work out figure know need want like to of for and then so ok okay hey hi hello
    thanks thank quick question result answer value number numbers here there""".split())
_ADDING = frozenset("""
    add adding added up together sum summed total equal equals equal? make makes gives come comes plus""".split())
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[a-z]+(?:'[a-z]+)?|[^\sa-z\d]")
_CONNECTORS = {("+",), ("plus",), ("and",), ("to",), ("with",), ("added", "to"), ("plus", "and")}


def _general_sum(core: str) -> dict[str, Any] | None:
    """Two whole numbers joined by a word or sign of adding ("+", "plus", "and", "to", "added to"), every other
    word one of asking or adding, no other sign than "=", "?" or a comma; None otherwise."""
    tokens = _TOKEN.findall(core)
    numbers = [i for i, t in enumerate(tokens) if t[0].isdigit()]
    if len(numbers) != 2 or any(not tokens[i].isdigit() or len(tokens[i]) > 60 for i in numbers):
        return None  # not two operands, or a decimal point / digit grouping in one
    first, second = numbers
    between = tuple(t for t in tokens[first + 1:second] if t != ",")
    if between not in _CONNECTORS or (between in {("to",), ("with",)} and "add" not in tokens[:first]):
        return None
    rest = tokens[:first] + tokens[second + 1:]
    if any(t not in _ASKING and t not in _ADDING and t not in ("=", "?", ",", ":") for t in rest):
        return None
    if "+" not in between and "plus" not in between and not _ADDING & set(rest) - {"equal", "equals"}:
        return None  # "12 and 34" alone asks nothing about adding them
    return {"a": int(tokens[first]), "b": int(tokens[second])}


def read_sum(text: str) -> dict[str, Any] | None:
    """Two whole numbers added, in the ways a person asks it ("12+34", "what is 12 plus 34?", "add 12 and 34",
    "the sum of 12 and 34", "what do 12 and 34 add up to?"); None for anything else (a third operand, a sign, a
    decimal point, a word that neither asks nor adds)."""
    core = _core(text)
    for pattern in _SUMS:
        if (match := pattern.match(core)) is not None:
            a, b = match.groups()
            return {"a": int(a), "b": int(b)}
    return _general_sum(core)


def say_sum(payload: dict[str, Any], answer: Any) -> str:
    return f"{payload['a']} + {payload['b']} = {answer}"




_SORT_VERB = (r"(?:sort|order|arrange|put|rank|reorder|sort out)(?: the)?(?: following)?(?: (?:list|digits|numbers"
              r"|items))?(?: of)?(?: these(?: (?:digits|numbers))?)?")
_SORTS = [re.compile(p) for p in (
    rf"^{_SORT_VERB}\s*:?\s*\[?(?P<items>[\d ,;]+?)\]?(?:\s+(?:in (?:ascending |increasing )?order|ascending|"
    r"from (?:smallest|lowest) to (?:largest|highest)|smallest first|in order|from low to high))?$",
    r"^\[?(?P<items>[\d ,;]+?)\]?\s*(?:,|:|-)?\s*(?:sorted|in order|sort (?:them|it|this)|sort|ascending)$",
    r"^(?:what is|what's|give me) \[?(?P<items>[\d ,;]+?)\]? (?:sorted|in (?:ascending )?order)$",
)]
SORT_LENGTH = 7  # the sorting family's lists: 7 digits (task_generators/sorting.py)


_SORTING = frozenset("""
    sort sorted sorting order ordered reorder arrange arranged put rank list digits digit items in into ascending
    increasing from smallest lowest least largest highest biggest greatest low high small big first last up
    following by size""".split())
_VERBS = frozenset("sort sorted sorting order ordered reorder arrange arranged rank ascending increasing".split())


def _general_list(core: str) -> dict[str, Any] | None:
    """Seven single digits (spaced, with commas, in brackets, or written as one 7-digit number) and a word of
    sorting, every other word one of asking or sorting; None otherwise."""
    tokens = _TOKEN.findall(core)
    digits = [d for t in tokens if t[0].isdigit() for d in t.split(",")]  # "3,1,4" reads as one token
    if len(digits) == 1 and digits[0].isdigit():
        digits = list(digits[0])
    if len(digits) != SORT_LENGTH or any(len(d) != 1 for d in digits):
        return None
    words = [t for t in tokens if t[0].isalpha()]
    if not _VERBS & set(words) or any(w not in _ASKING and w not in _SORTING for w in words):
        return None
    if any(t not in ("[", "]", "(", ")", ",", ";", ":", "?", ".", "!") for t in tokens if not t[0].isalnum()):
        return None  # a sign: "-3" is not a digit to sort
    return {"items": [int(d) for d in digits]}


def read_list(text: str) -> dict[str, Any] | None:
    """A list of digits to sort, as a person asks it ("sort 3 1 2 5 4 7 6", "put 3,1,2,5,4,7,6 in order please",
    "sort: 3142576", "can you sort this list: 3,1,2,5,4,7,6?"); None for anything else, and for a list the family
    does not pose (not 7 digits 0-9)."""
    core = _core(text)
    for pattern in _SORTS:
        if (match := pattern.match(core)) is not None:
            raw = match.group("items").strip()
            parts = [p for p in re.split(r"[ ,;]+", raw) if p]
            digits = list(parts[0]) if len(parts) == 1 else parts
            if len(digits) == SORT_LENGTH and all(len(d) == 1 and d.isdigit() for d in digits):
                return {"items": [int(d) for d in digits]}
            return None
    return _general_list(core)


def say_list(payload: dict[str, Any], outcome: Any) -> str:
    """The list as the pair's calls left it (the family's outcome: the replayed final state)."""
    return "sorted: " + " ".join(map(str, outcome["state"]["items"]))


VIEWS: dict[str, View] = {
    "addition": View(read_sum, say_sum, "an addition of two whole numbers ('12 + 34', 'what is 12 plus 34?')"),
    "sorting": View(read_list, say_list, "a list of 7 digits to sort ('sort 3 1 4 1 5 9 2')"),
}


# ---- the harness's own format -------------------------------------------------------------------------------------


def knows_own(champion: Any) -> bool:
    """Whether the champion's family can tell its harness's own prompt from other text (it reads payloads from a
    prompt: ``TaskFamily.read``); where it cannot, a message no view reads still goes to the specialist as it is."""
    from rsi.tasks import get_family

    return get_family(champion.harness.document.family).read is not None


def own_prompt(champion: Any, text: str | None) -> bool:
    """Whether ``text`` is exactly a prompt the champion's harness renders (its own format: the pair answers it as
    it is, and a client that speaks it keeps doing so)."""
    from rsi.tasks import get_family

    family = get_family(champion.harness.document.family)
    for payload in family.read(text or "") if family.read is not None else ():
        try:
            if champion.harness.prompt(payload) == text:
                return True
        except UserError:
            continue
    return False


# ---- answering ----------------------------------------------------------------------------------------------------


def said(view: View, pair: Any, tasks: list[Any], run: Any) -> dict[str, str]:
    """Per task id: what a person is told of the pair's answer in a run of one sample a task
    (``Responder.run``). The answer is the model's: a plan's composed answer, else the value the harness's parser
    reads from the reply, or, for a tool family, the state its calls left (replayed on the family's environment),
    said in the view's words; where there is none, a sentence saying so."""
    from rsi.audit import Case

    by_id = {t.id: t for t in tasks}
    if pair.harness.document.plan is not None:
        values = {path.task_id: path.answer for path in run.paths}
    else:
        cases = [Case(t, by_id[t.task_id], pair.harness, pair.family, None) for t in run.trajectories]
        values = {c.task.id: c.outcome() if c.parsed.ok else None for c in cases}
    return {i: view.say(by_id[i].payload, value) if value is not None else
            f"the {pair.family.name} specialist gave no answer its harness could read" for i, value in values.items()}


def posed_task(view: View, pair: Any, text: str) -> Any:
    """The family's task the message poses under this view, or None; an ``ApiError``-worthy ``UserError`` where
    the message poses a task the specialist's harness cannot pose (a level beyond its format)."""
    from rsi.hcp.plays import poses

    from rsi.models import Task
    from rsi.tasks import DERIVED_SEED

    payload = view.read(text)
    if payload is None:
        return None
    family = pair.family
    level = family.level_of(payload)
    # (the task's stored answer is the family's where it can solve any payload; the reply never reads it)
    task = Task(family=family.name, family_version=family.version, split=family.split_of(payload),
                level=max(level, 1), seed=DERIVED_SEED, index=0, payload=payload,
                answer=family.solve(payload) if family.solve is not None else None)
    if not family.min_level <= level <= family.max_level or not poses(pair.harness, family, task):
        raise UserError(f"the {family.name} specialist cannot pose this task (level {level}) under its harness "
                        f"{pair.harness.id}")
    return task


def answer(view: View, pair: Any, task: Any, params: Any) -> Any:
    """The pair's answer to ``task`` under its harness (one greedy sample: a plan's calls, a tool episode, or one
    reply), said back in plain words: a ``Reply`` with every call's tokens. Where the harness's parser reads no
    answer (or a plan's call gave none), the reply says so."""
    return answered(view, pair, task, params)[0]


def answered(view: View, pair: Any, task: Any, params: Any) -> tuple[Any, dict[str, Any]]:
    """``answer``'s reply, and the record of how the pair made it, which the proxy stores with the reply (never
    sends it): the pair, its harness and the trajectories of the run (the model's own messages and tool log
    under the harness; ``rsi.mol.harvest`` audits them again, against the task it derives from the message)."""
    from rsi.models import Message
    from rsi.pair import Reply

    run = pair.run([task], params.model_copy(update={"n": 1}))
    reply = Reply(Message(role="assistant", content=said(view, pair, [task], run)[task.id]), "stop",
                  sum(t.tokens.prompt for t in run.trajectories), sum(t.tokens.completion for t in run.trajectories))
    record = {"pair": pair.pair_id, "harness": pair.harness.hash, "plan": pair.harness.document.plan is not None,
              "trajectories": [t.model_dump(mode="json") for t in run.trajectories]}
    return reply, record
