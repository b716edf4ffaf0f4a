"""Programs: a task is a small program of rsi's stack machine and an input; its answer is the machine's output.

The machine (rsi's own language, run by ``run`` below: no Python ``eval`` or ``exec``, every step counted):

- A program is tokens separated by single spaces, at most ``MAX_TOKENS``. A token is a literal ``0``..``99``
  (pushes it), ``x`` (pushes the input), an operation, or a jump.
- Operations on the stack (``a`` below ``b``, ``b`` on top): ``add`` ``sub`` ``mul`` push a+b, a-b, a*b;
  ``div`` ``mod`` push the floor quotient and the remainder (the divisor's sign), b = 0 an error; ``dup`` pushes
  b again, ``over`` pushes a, ``swap`` exchanges a and b, ``drop`` pops b.
- Jumps: ``jz:K`` pops b and, if b is 0, skips K tokens (K < 0 goes back); ``jmp:K`` skips K tokens always.
  K counts from the token after the jump; a jump must land inside the program or just past its end.
- The program ends when it runs past its last token; its output is the top of the stack.
- Bounds: at most ``MAX_STEPS`` tokens run, ``MAX_STACK`` values on the stack, every value within
  ±``BOUND``. A program that breaks one, reads an empty stack, divides by 0 or ends with an empty stack has no
  output: ``run`` names the error.

The machine touches nothing but its stack (it runs under the substrate's guard, ``rsi.substrate.sandboxed``:
file, network and process access raise). Level n: a program of n operations (jumps count) in its canonical
form (``canonical``: unreachable tokens and operations that change nothing removed, literal arithmetic folded),
so a program padded with dead code is as hard as the program without it. The split of a task is its canonical
program's (every input of one program falls in one split), so a program proposed for training is never a
held-out or test program rewritten.

This generator draws straight-line programs: an expression over ``x`` and literals 1..9, written postfix, every
operation with the input below it (never a constant subexpression, which ``canonical`` would fold), whose output
differs between some two inputs 0..9 (never a constant program); inputs 0..9.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, NamedTuple

from rsi.models import Task
from rsi.substrate import sandboxed
from rsi.tasks import Proposes, TaskFamily

MAX_TOKENS = 64
MAX_STEPS = 256
MAX_STACK = 16
BOUND = 9999
MAX_LITERAL = 99
BINARY = ("add", "sub", "mul", "div", "mod")
STACK = ("dup", "over", "swap", "drop")
JUMPS = ("jz", "jmp")
NEEDS = {**dict.fromkeys(BINARY, 2), "over": 2, "swap": 2, "dup": 1, "drop": 1, "jz": 1}  # values a token reads
MAX_LEVEL = 12


class ProgramError(ValueError):
    """A program that does not parse (a token the machine does not know, too long)."""


@dataclass(frozen=True)
class Outcome:
    """A run: the output (None when the program has none), the error that stopped it, the tokens run."""

    output: int | None
    error: str | None
    steps: int


def parse(program: str) -> list[str | int | tuple[str, int]]:
    """Tokens: literals as ints, jumps as (name, offset), the rest as names; ``ProgramError`` naming the first
    token the machine does not know."""
    if not isinstance(program, str) or not program.strip():
        raise ProgramError("a program is a non-empty string of tokens separated by spaces")
    words = program.split()
    if len(words) > MAX_TOKENS:
        raise ProgramError(f"{len(words)} tokens; a program has at most {MAX_TOKENS}")
    tokens: list[str | int | tuple[str, int]] = []
    for i, word in enumerate(words):
        name, _, offset = word.partition(":")
        if word.isdigit() and len(word) <= 2:
            tokens.append(int(word))
        elif word == "x" or word in BINARY or word in STACK:
            tokens.append(word)
        elif name in JUMPS and offset.lstrip("-").isdigit() and len(offset) <= 3:
            tokens.append((name, int(offset)))
        else:
            raise ProgramError(f"token {i + 1} {word!r}: expected a literal 0..{MAX_LITERAL}, x, one of "
                               f"{', '.join(BINARY + STACK)}, or jz:K / jmp:K")
    return tokens


def text(tokens: list[str | int | tuple[str, int]]) -> str:
    return " ".join(f"{t[0]}:{t[1]}" if isinstance(t, tuple) else str(t) for t in tokens)


def run(program: str, x: int) -> Outcome:
    """Run ``program`` on input ``x``; a program that does not parse is an ``Outcome`` with its error too."""
    try:
        tokens = parse(program)
    except ProgramError as exc:
        return Outcome(None, f"parse: {exc}", 0)
    with sandboxed("programs"):
        return _execute(tokens, x)


def _execute(tokens: list[str | int | tuple[str, int]], x: int, states: list[tuple[tuple[int, ...], int]] | None = None
             ) -> Outcome:
    """The run; ``states``, when given, gets the machine's state (stack, next token) after each operation or jump."""
    stack: list[int] = []
    pc = steps = 0
    while pc < len(tokens):
        if steps == MAX_STEPS:
            return Outcome(None, f"budget: more than {MAX_STEPS} steps", steps)
        token, pc, steps = tokens[pc], pc + 1, steps + 1
        need = 0 if isinstance(token, int) else NEEDS.get(token[0] if isinstance(token, tuple) else token, 0)
        if len(stack) < need:
            return Outcome(None, f"underflow: {text([token])} at step {steps} needs {need} value(s)", steps)
        if isinstance(token, tuple):
            name, offset = token
            if name == "jmp" or stack.pop() == 0:
                pc += offset
                if not 0 <= pc <= len(tokens):
                    return Outcome(None, f"jump: {name}:{offset} lands outside the program", steps)
            if states is not None:
                states.append((tuple(stack), pc))
            continue
        if isinstance(token, int) or token == "x":
            stack.append(x if token == "x" else token)
        elif token in BINARY:
            b, a = stack.pop(), stack.pop()
            if token in ("div", "mod") and b == 0:
                return Outcome(None, f"division: {token} by 0 at step {steps}", steps)
            stack.append({"add": a + b, "sub": a - b, "mul": a * b, "div": a // b if b else 0,
                          "mod": a % b if b else 0}[token])
        elif token == "dup":
            stack.append(stack[-1])
        elif token == "over":
            stack.append(stack[-2])
        elif token == "swap":
            stack[-1], stack[-2] = stack[-2], stack[-1]
        else:  # drop
            stack.pop()
        if stack and abs(stack[-1]) > BOUND:
            return Outcome(None, f"bound: a value beyond ±{BOUND} at step {steps}", steps)
        if len(stack) > MAX_STACK:
            return Outcome(None, f"stack: more than {MAX_STACK} values at step {steps}", steps)
        if states is not None and not (isinstance(token, int) or token == "x"):
            states.append((tuple(stack), pc))
    if not stack:
        return Outcome(None, "empty: the program ends with nothing on the stack", steps)
    if states is not None:
        states.append((tuple(stack), pc))  # the final stack
    return Outcome(stack[-1], None, steps)


def worked(payload: dict[str, Any]) -> str:
    """The run of a task written out, step by step (a worked answer, ``programs/v2``'s answer template): the
    program with the input in place of ``x``, then after each operation or jump the machine's state (the stack,
    bottom first, then the tokens still to run, ``x`` written as the input), states separated by ``" | "``; the
    last state is the final stack, its last value the output. ``"x 3 add 4 mul"`` on 5:
    ``"5 3 add 4 mul | 8 4 mul | 32"`` (a state that reads as the one before it is written once). Raises
    ``ProgramError`` for a program without an output."""
    tokens, x = parse(payload["program"]), payload["input"]
    states: list[tuple[tuple[int, ...], int]] = []
    outcome = _execute(tokens, x, states)
    if outcome.output is None:
        raise ProgramError(f"no output to work out: {outcome.error}")
    code = [x if t == "x" else t for t in tokens]
    written = [text(code), *(text([*stack, *code[pc:]]) for stack, pc in states)]
    return " | ".join(w for i, w in enumerate(written) if not i or w != written[i - 1])  # a state once


# ---- canonical form: what a program computes, without what changes nothing -------------------------------------

_NOTHING = ((int, "drop"), ("x", "drop"), ("dup", "drop"), ("over", "drop"), ("swap", "swap"), (0, "add"),
            (0, "sub"), (1, "mul"), (1, "div"))  # pairs of tokens that leave the stack as it was


@functools.lru_cache(maxsize=1 << 16)
def canonical(program: str) -> str:
    """``program`` without tokens no run can reach and without pairs that leave the stack as it was (``dup
    drop``, ``0 add``, ...), literal arithmetic folded (``2 3 add`` is ``5``), repeated to a fixed point. A
    program with jumps keeps its reachable tokens as they are (removing one would move the jumps' targets).
    Raises ``ProgramError`` when it does not parse."""
    tokens = parse(program)
    if any(isinstance(t, tuple) for t in tokens):
        return text([t for i, t in enumerate(tokens) if i in _reachable(tokens)])
    changed = True
    while changed:
        changed = False
        for i in range(len(tokens) - 1):
            pair = tokens[i:i + 2]
            if any(_same(a, pair[0]) and b == pair[1] for a, b in _NOTHING):
                del tokens[i:i + 2]
                changed = True
                break
            if i + 2 < len(tokens) and isinstance(pair[0], int) and isinstance(pair[1], int) and \
                    tokens[i + 2] in BINARY:
                folded = _execute(tokens[i:i + 3], 0).output
                if folded is not None and 0 <= folded <= MAX_LITERAL:
                    tokens[i:i + 3] = [folded]
                    changed = True
                    break
    return text(tokens)


def _same(pattern: Any, token: Any) -> bool:
    return isinstance(token, int) if pattern is int else token == pattern and type(token) is type(pattern)


def _reachable(tokens: list[str | int | tuple[str, int]]) -> set[int]:
    """Indices some path from the first token reaches (both ways of every jz)."""
    seen, todo = set(), [0]
    while todo:
        i = todo.pop()
        if i in seen or not 0 <= i < len(tokens):
            continue
        seen.add(i)
        token = tokens[i]
        if isinstance(token, tuple):
            todo.append(i + 1 + token[1])
            if token[0] == "jz":
                todo.append(i + 1)
        else:
            todo.append(i + 1)
    return seen


def level_of(payload: dict[str, Any]) -> int:
    """Operations (jumps included) of the canonical program."""
    return sum(not isinstance(t, int) and t != "x" for t in parse(canonical(payload["program"])))


def split_key(payload: dict[str, Any]) -> str:
    """The canonical program: every input of a program, and every rewriting of it, in one split."""
    return canonical(payload["program"])


# ---- the human-written generator: held-out and test suites, and the `generator` proposer's training tasks -----

def _expression(rng: random.Random, ops: int) -> list[str | int]:
    """A postfix expression with ``ops`` operations whose every subexpression depends on x."""
    if ops == 0:
        return ["x"]
    left = rng.randrange(ops)
    a, b = _expression(rng, left), _expression(rng, ops - 1 - left)
    op = rng.choices(BINARY, weights=(4, 4, 2, 1, 1))[0]
    if rng.random() < 0.5:  # one side a literal instead of a subexpression: the program stays one chain
        b = [rng.randint(2 if op in ("div", "mod", "mul") else 1, 9)]
        if rng.random() < 0.5 and op in ("add", "mul"):
            a, b = b, a
    return [*a, *b, op]


def depends_on_input(program: str, inputs: range = range(10)) -> bool:
    """Whether the program's output differs between some two of ``inputs`` (a constant program does not)."""
    return len({run(program, x).output for x in inputs} - {None}) > 1


def make(rng: random.Random, level: int) -> tuple[dict[str, Any], int]:
    while True:
        program, x = text(_expression(rng, level)), rng.randint(0, 9)
        outcome = run(program, x)
        if outcome.output is not None and level_of({"program": program}) == level and depends_on_input(program):
            return {"program": program, "input": x}, outcome.output


def solve(payload: dict[str, Any]) -> int | None:
    return run(payload["program"], payload["input"]).output


def verify(task: Task, answer: Any) -> bool:
    """The output (an int), or the run written out (a str, ``programs/v3``'s answer): right only when it is
    ``worked`` of the task, every state of it: a run that goes wrong and ends on the right output by chance is
    wrong (``programs/v2`` reads only the last value and counts it right; ``bench/wip/programs_passes.py``)."""
    if isinstance(answer, str):
        try:
            return answer == worked(task.payload)
        except ProgramError:
            return False
    return isinstance(answer, int) and not isinstance(answer, bool) and answer == task.answer


# ---- proposals: a program and an input the model writes, judged rule by rule ------------------------------------

PROPOSAL = re.compile(r"(?P<program>[^;]+?) ; x=(?P<input>-?[0-9]{1,2})")
PROPOSAL_RULES = ("proposal_format", "proposal_terminates", "proposal_bounded", "proposal_runs",
                  "proposal_deterministic", "proposal_depends_on_input", "proposal_novel", "proposal_in_train")


class Judged(NamedTuple):
    """A proposal's verdict: each rule's result in ``PROPOSAL_RULES`` order ((rule, passed, detail)), and for a
    proposal that reads as one, its payload, canonical program and level."""

    rules: tuple[tuple[str, bool, str], ...]
    payload: dict[str, Any] | None = None
    canonical: str | None = None
    level: int | None = None

    @property
    def accepted(self) -> bool:
        return all(passed for _, passed, _ in self.rules)

    @property
    def rejected_by(self) -> str | None:
        """The first rule it fails."""
        return next((rule for rule, passed, _ in self.rules if not passed), None)


def judge_proposal(text: str, seen: Collection[str] = ()) -> Judged:
    """Judge a proposal ``PROGRAM ; x=N`` (what a proposer writes: a program and an input -99..99): it parses,
    terminates within the step budget, stays within the value and stack bounds, has an output, gives the same output
    on a second run, gives another output for some of 4 more inputs (0..9, the generator's, drawn from a stream
    seeded by its canonical program), its canonical program is not in ``seen`` (canonical programs proposed before)
    and falls in the train split (never a held-out or test program rewritten). A rule that cannot be judged (the
    proposal did not parse) fails with that reason."""
    judged = _judge(text)
    if judged.canonical is None or judged.canonical not in seen:
        return judged
    novel = ("proposal_novel", False, f"proposed before: {judged.canonical!r}")
    return judged._replace(rules=tuple(novel if r[0] == "proposal_novel" else r for r in judged.rules))


@functools.lru_cache(maxsize=1 << 14)
def _judge(text: str) -> Judged:
    """``judge_proposal`` with nothing seen before (each rule runs the program once: the auditor asks per rule)."""
    match = PROPOSAL.fullmatch(text.strip())
    try:
        canon = canonical(match["program"]) if match else None
    except ProgramError as exc:
        canon, problem = None, str(exc)
    else:
        problem = "" if match else "expected 'PROGRAM ; x=N' (N an integer -99..99)"
    if canon is None:
        return Judged((("proposal_format", False, problem),
                       *((rule, False, "cannot judge: no program") for rule in PROPOSAL_RULES[1:])))
    payload = {"program": match["program"], "input": int(match["input"])}
    first, second = run(payload["program"], payload["input"]), run(payload["program"], payload["input"])
    # the run's error names the rule it breaks: the step budget, the bounds, else the program has no output
    broken = {"budget": "proposal_terminates", "bound": "proposal_bounded", "stack": "proposal_bounded"}.get(
        (first.error or "").partition(":")[0], "proposal_runs") if first.error else None
    rng = random.Random(canon)
    others = {run(payload["program"], rng.randint(0, 9)).output for _ in range(4)}  # the generator's inputs
    rules = (("proposal_format", True, ""),
             *((rule, rule != broken, first.error if rule == broken else "")
               for rule in ("proposal_terminates", "proposal_bounded", "proposal_runs")),
             ("proposal_deterministic", first == second, "" if first == second else f"{first} then {second}"),
             ("proposal_depends_on_input", len(others - {None, first.output}) > 0,
              "" if others - {None, first.output} else "the same output (or none) on 4 other inputs"),
             ("proposal_novel", True, ""),
             ("proposal_in_train", family.split_of(payload) == "train",
              f"its canonical program is a {family.split_of(payload)} program"
              if family.split_of(payload) != "train" else ""))
    level = level_of(payload) if first.output is not None else None
    return Judged(rules, payload, canon, level)


family = TaskFamily(
    name="programs",
    version="1",
    description="The output of a stack-machine program on an input (rsi's own language); level n = n operations.",
    make=make,
    verify=verify,
    min_level=1,
    max_level=MAX_LEVEL,
    split_key=split_key,
    solve=solve,
    level_of=level_of,
    filters={"worked": worked},
)


# ---- the proposer's family: write a program and an input; judged by the rules above -----------------------------
#
# A task asks for a program of ``ops`` operations (``slot`` tells the prompts apart; the prompt shows only ``ops``).
# Its answer is one reference proposal, a train-split program of the generator's and an input (what the base
# model learns the proposer's role from); any proposal that passes the rules is as right. Novelty is the stage's
# to judge (``proposal_novel`` needs the lineage's earlier proposals): the contract judges the others.

CONTRACT_RULES = tuple(rule for rule in PROPOSAL_RULES if rule != "proposal_novel")


def make_proposal(rng: random.Random, level: int) -> tuple[dict[str, Any], str]:
    while True:
        payload, _ = make(rng, level)
        text = f"{payload['program']} ; x={payload['input']}"
        if _judge(text).accepted:  # a train-split program whose output differs on the judge's other inputs
            return {"ops": level, "slot": rng.randrange(1 << 30)}, text


def _rule(name: str):
    def check(task: Task, answer: Any) -> tuple[bool, str]:
        _, passed, detail = next(r for r in judge_proposal(str(answer)).rules if r[0] == name)
        return passed, detail

    check.__doc__ = f"The proposal passes {name} (``judge_proposal``)."
    return check


proposals = TaskFamily(
    name="program_proposals",
    version="1",
    description="Propose a stack-machine program and an input (the programs lineage's proposer role); judged by "
                "the executor's rules, not against one answer.",
    make=make_proposal,
    verify=lambda task, answer: isinstance(answer, str) and all(
        passed for rule, passed, _ in judge_proposal(answer).rules if rule in CONTRACT_RULES),
    min_level=1,
    max_level=MAX_LEVEL,
    level_of=lambda payload: payload["ops"],
    rules={rule: _rule(rule) for rule in CONTRACT_RULES},
    proposes=Proposes("programs", lambda answer: judge_proposal(answer).payload,
                      answers=lambda asked, answer: {**asked, "ops": _judge(answer).level}),
)
