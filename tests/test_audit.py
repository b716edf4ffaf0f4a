"""The auditor: a good trajectory passes every rule; each tampering fails exactly the rule it breaks;
no input that validates as the models makes it raise."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rsi.audit import RULES, audit, audit_jsonl
from rsi.hcp.plays import demonstration
from rsi.hcp import CONTRACT_RULES, Harness, HCPDocument, load_harness
from rsi.models import Message, Pair, Task, Timings, TokenCounts, ToolCall, ToolRecord, Trajectory
from rsi.parsers import PARSERS
from rsi.substrate import Session
from rsi.tasks import get_family
from rsi.tokens import BUILTIN, token_counter

from .conftest import REPO

V1 = load_harness(REPO / "harness_versions/addition/v1")
FAMILY = get_family("addition")
TASK = FAMILY.task("train", seed=7, level=4, index=3)
PROMPT_CHARS = 22  # '{a}+{b}=' with 10-digit operands


def variant(base: Harness, **sections: Any) -> Harness:
    """``base`` with some document sections updated (``tools`` replaced), validated like a loaded one."""
    raw = base.document.model_dump(mode="json")
    for name, values in sections.items():
        raw[name] = values if isinstance(values, list) else {**raw[name], **values}
    return Harness(base.path, HCPDocument.model_validate(raw), base.sources)


FULL = variant(V1, contract={"rules": list(CONTRACT_RULES)})  # v1 with every rule of the contract
ROOMY = variant(FULL, decoding={"max_new_tokens": 16}, limits={"max_completion_tokens": 16})
CALC = [{"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                        "required": ["expr"]}}]
TIGHT = variant(FULL, decoding={"max_new_tokens": 11})
# addition has no environment to replay calls on: its message-structure cases leave the replay rules out, and
# text_matches_calls (their calls are recorded with no text that writes them)
STRUCTURE_RULES = [r for r in CONTRACT_RULES if r not in ("results_replayed", "states_replayed", "text_matches_calls")]
TOOLS = variant(FULL, tools=CALC, limits={"max_steps": 3, "max_completion_tokens": 40},
                contract={"rules": STRUCTURE_RULES})
TEXT = variant(TOOLS, contract={"rules": [*STRUCTURE_RULES, "text_matches_calls"]})
SORT = load_harness(REPO / "harness_versions/sorting/v1")
SORT2 = load_harness(REPO / "harness_versions/sorting/v2")  # contract 3: each turn's text is its recorded call
SORTING = get_family("sorting")
SORT_TASK = SORTING.task("train", seed=7, level=3, index=0)
SWAP_1_TASK = SORTING.task("train", seed=7, level=2, index=4)  # its demonstration's first call is swap(1)


def pair_of(harness: Harness) -> Pair:
    return Pair(base_model_hash="b" * 64, adapter_hash=None, harness_id=harness.id, harness_hash=harness.hash)


def answer_text(value: int) -> str:
    return str(value)[::-1].ljust(11, "0")


def user(content: str | None = None) -> Message:
    return Message(role="user", content=V1.prompt(TASK.payload) if content is None else content)


def assistant(content: str, *calls: str) -> Message:
    return Message(role="assistant", content=content,
                   tool_calls=tuple(ToolCall(id=c, name="calc", arguments={"expr": "1+1"}) for c in calls))


def tool(call_id: str | None, content: str = "2") -> Message:
    return Message(role="tool", content=content, tool_call_id=call_id)


def good(reply: str | None = None, harness: Harness = FULL, **changes: Any) -> Trajectory:
    """A trajectory with an id that hashes its content and token counts as the hf backend reports them:
    <bos> + one token per prompt character; one per reply character, + the EOS when it stopped."""
    reply = answer_text(TASK.answer) if reply is None else reply
    finish = changes.get("finish_reason", "stop")
    fields = dict(
        task_id=TASK.id, pair_id=pair_of(harness).id, harness_id=harness.id, sample_index=0, seed=0,
        messages=(user(), assistant(reply)), finish_reason=finish,
        tokens=TokenCounts(prompt=1 + PROMPT_CHARS, completion=len(reply) + (finish == "stop")),
        timings=Timings(generate_s=0.01),
    )
    return Trajectory.build(**{**fields, **changes})


def episode(*turns: Message, harness: Harness = TOOLS) -> Trajectory:
    """A tool episode: completion tokens count each assistant message's text plus one EOS per turn."""
    completion = sum(len(m.content) + 1 for m in turns if m.role == "assistant")
    return good(harness=harness, messages=(user(), *turns), tokens=TokenCounts(prompt=23, completion=completion))


def sort_episode(edit: Any = None, harness: Harness = SORT, task: Task = SORT_TASK) -> Trajectory:
    """The sorting family's demonstration of ``task`` as an episode recorded under ``harness`` (token counts as the
    hf backend reports them), after ``edit(messages, tool_log)`` changes it in place."""
    messages, log, _ = demonstration(harness, SORTING, task)
    if edit is not None:
        edit(messages, log)
    replies = [m.content for m in messages if m.role == "assistant"]
    return Trajectory.build(task_id=task.id, pair_id=pair_of(harness).id, harness_id=harness.id, sample_index=0,
                            seed=0, messages=tuple(messages), tool_log=tuple(log), timings=Timings(generate_s=0.01),
                            tokens=TokenCounts(prompt=1 + len(messages[0].content),
                                               completion=sum(len(r) + 1 for r in replies)))


def say_swap_2(messages: list[Message], log: list[ToolRecord]) -> None:
    """Issue 30's forged episode: the first turn's text says swap(2); its recorded call, the tool log, the tool
    message and so the replay all say swap(1) (SWAP_1_TASK's first call)."""
    assert messages[1].content == "swap(1)" and messages[1].tool_calls[0].arguments == {"i": 1}
    messages[1] = messages[1].model_copy(update={"content": "swap(2)"})


def forge_result(messages: list[Message], log: list[ToolRecord]) -> None:
    """The first call claims to have sorted the list: its tool message and logged result say so."""
    messages[2] = messages[2].model_copy(update={"content": "0123456>"})
    log[0] = log[0].model_copy(update={"result": "0123456"})


def edit_state(messages: list[Message], log: list[ToolRecord]) -> None:
    """The state was changed between the first and second call: the log shows another state there."""
    log[0] = log[0].model_copy(update={"state_after": "state-" + "0" * 24})
    log[1] = log[1].model_copy(update={"state_before": "state-" + "0" * 24})


def extra_call(name: str, arguments: dict[str, Any]) -> Any:
    """An extra first call, logged and answered as the environment answers it (an error, state unchanged)."""
    def edit(messages: list[Message], log: list[ToolRecord]) -> None:
        session = Session(SORTING.environment, SORT_TASK.payload, SORT.tool_schemas)
        record = session.call("call_0", name, arguments)
        text = f"{name}({','.join(json.dumps(v) for v in arguments.values())})"
        messages[1:1] = [Message(role="assistant", content=text,
                                 tool_calls=(ToolCall(id="call_0", name=name, arguments=arguments),)),
                         Message(role="tool", content=SORT.render_tool(SORT_TASK.payload, {}, record.result),
                                 tool_call_id="call_0")]
        log.insert(0, record)
    return edit


def failed(traj: Trajectory, task: Task = TASK, harness: Harness = FULL) -> list[str]:
    family = SORTING if harness.document.family == "sorting" else FAMILY
    return audit(traj, task, harness, family, pair_of(harness)).failed_rules()


def detail(traj: Trajectory, rule: str, harness: Harness = FULL, task: Task = TASK) -> str:
    verdict = audit(traj, task, harness, FAMILY, pair_of(harness))
    return next(r.detail for r in verdict.rules if r.rule == rule)


def test_every_rule_is_implemented_and_a_good_trajectory_passes_them() -> None:
    assert set(RULES) == set(CONTRACT_RULES)
    for harness in (V1, FULL):
        verdict = audit(good(harness=harness), TASK, harness, FAMILY, pair_of(harness))
        assert verdict.passed, verdict
        assert [r.rule for r in verdict.rules] == list(harness.document.contract.rules)
        assert verdict.contract_version == "1" and verdict.harness_hash == harness.hash
    assert good().tokens == TokenCounts(prompt=23, completion=12)  # what the real backend reports (slow test)


WRONG_TASK = TASK.model_copy(update={"answer": TASK.answer + 1})
CASES = {
    # ids_consistent
    "task_id": (good(task_id="task-elsewhere"), TASK, FULL, ["ids_consistent"]),
    "harness_id": (good(harness_id="addition/v0"), TASK, FULL, ["ids_consistent"]),
    "pair_id": (good(pair_id="pair-forged"), TASK, FULL, ["ids_consistent"]),
    "task-tampered": (good(answer_text(TASK.answer + 1), task_id=WRONG_TASK.id), WRONG_TASK, FULL, ["ids_consistent"]),
    "task-other-split": (good(task_id=TASK.model_copy(update={"split": "test"}).id),
                         TASK.model_copy(update={"split": "test"}), FULL, ["ids_consistent"]),
    "task-level-unknown": (good(task_id=TASK.model_copy(update={"level": 999}).id),
                           TASK.model_copy(update={"level": 999}), FULL, ["ids_consistent"]),
    "edited-keeps-id": (good().model_copy(update={"sample_index": 5}), TASK, FULL, ["ids_consistent"]),
    # prompt_rendered
    "prompt": (good(messages=(user("1+1="), assistant(answer_text(TASK.answer))), tokens=TokenCounts(prompt=5, completion=12)),
               TASK, FULL, ["prompt_rendered"]),
    # messages_allowed
    # (the extra message is prompt text too: 34 tokens, over max_prompt_tokens 32)
    "extra-user-message": (good(messages=(user(), user(answer_text(TASK.answer)), assistant(answer_text(TASK.answer)))),
                           TASK, FULL, ["messages_allowed", "limits"]),
    "system-after-prompt": (good(messages=(user(), Message(role="system", content="x"), assistant(answer_text(TASK.answer))),
                                 tokens=TokenCounts(prompt=1 + PROMPT_CHARS + 1, completion=12)),
                            TASK, FULL, ["messages_allowed"]),
    "tool-answers-no-call": (good(messages=(user(), tool("c9", answer_text(TASK.answer)), assistant(answer_text(TASK.answer)))),
                             TASK, FULL, ["messages_allowed"]),
    "no-reply": (good(messages=(user(),), tokens=TokenCounts(prompt=23, completion=1)), TASK, FULL,
                 ["messages_allowed", "limits", "answer_format", "answer_correct"]),
    "two-replies": (good(messages=(user(), assistant("first try"), assistant(answer_text(TASK.answer)))),
                    TASK, FULL, ["messages_allowed", "limits"]),  # limits: 2 steps, and the recount differs
    "unanswered-call": (episode(assistant("", "c1"), assistant(answer_text(TASK.answer))), TASK, TOOLS, ["messages_allowed"]),
    "duplicate-call-ids": (episode(assistant("", "c1", "c1"), tool("c1"), tool("c1"), assistant(answer_text(TASK.answer))),
                           TASK, TOOLS, ["messages_allowed"]),
    "call-id-reused": (episode(assistant("", "c1"), tool("c1"), assistant("", "c1"), tool("c1"),
                               assistant(answer_text(TASK.answer))), TASK, TOOLS, ["messages_allowed"]),
    "answers-earlier-turn": (episode(assistant("", "c1"), tool("c1"), assistant("", "c2"), tool("c1"),
                                     assistant(answer_text(TASK.answer))), TASK, TOOLS, ["messages_allowed"]),
    "ends-on-tool": (episode(assistant(answer_text(TASK.answer), "c1"), tool("c1")), TASK, TOOLS, ["messages_allowed"]),
    "too-many-steps": (episode(*[m for c in ("c1", "c2", "c3") for m in (assistant("", c), tool(c))],
                               assistant(answer_text(TASK.answer))), TASK, TOOLS, ["messages_allowed", "limits"]),
    # limits: the auditor recounts; a recorded count that disagrees fails
    "completion-tokens": (good(tokens=TokenCounts(prompt=23, completion=99)), TASK, FULL, ["limits"]),
    "completion-understated": (good(tokens=TokenCounts(prompt=23, completion=11)), TASK, FULL, ["limits"]),
    "prompt-tokens": (good(tokens=TokenCounts(prompt=22, completion=12)), TASK, FULL, ["limits"]),
    "error": (good(finish_reason="error", tokens=TokenCounts(prompt=23, completion=11)), TASK, FULL, ["limits", "stopped"]),
    # stopped
    "cut-by-length": (good(finish_reason="length"), TASK, FULL, ["stopped"]),
    "forged-stop": (good(harness=TIGHT), TASK, TIGHT, ["stopped"]),  # 11 digits + EOS cannot fit in 11 tokens
    # tools_allowed
    "tool-not-allowed": (good(messages=(user(), Message(role="assistant", content=answer_text(TASK.answer),
                          tool_calls=(ToolCall(id="c1", name="shell", arguments={"cmd": "ls"}),)))),
                         TASK, FULL, ["messages_allowed", "tools_allowed", "results_replayed"]),
    "tool-not-exposed": (sort_episode(extra_call("shuffle", {})), SORT_TASK, SORT, ["tools_allowed"]),
    "tool-arguments-outside-schema": (sort_episode(extra_call("swap", {"i": 9})), SORT_TASK, SORT,
                                      ["tools_allowed"]),
    # results_replayed, states_replayed (the auditor replays the calls on the family's environment)
    "forged-tool-result": (sort_episode(forge_result), SORT_TASK, SORT, ["results_replayed"]),
    "edited-state": (sort_episode(edit_state), SORT_TASK, SORT, ["states_replayed"]),
    # text_matches_calls (training reads the text: it must write the call the replay ran)
    "text-says-another-call": (sort_episode(say_swap_2, SORT2, SWAP_1_TASK), SWAP_1_TASK, SORT2,
                               ["text_matches_calls"]),
    "tool-arguments": (episode(Message(role="assistant", content="", tool_calls=(ToolCall(id="c", name="calc", arguments={"expr": 3}),)),
                               tool("c"), assistant(answer_text(TASK.answer))), TASK, TOOLS, ["tools_allowed"]),
    # answer_format, no_extra_content, answer_correct
    "unparsable": (good("12ab"), TASK, FULL, ["answer_format", "answer_correct"]),
    "extra": (good(answer_text(TASK.answer) + "7", harness=ROOMY), TASK, ROOMY, ["no_extra_content"]),
    "wrong": (good(answer_text(TASK.answer + 10)), TASK, FULL, ["answer_correct"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tampering_fails_its_rule(case: str) -> None:
    traj, task, harness, rules = CASES[case]
    assert failed(traj, task, harness) == rules


def test_each_rule_has_a_tampering_case() -> None:
    assert {rule for *_, rules in CASES.values() for rule in rules} == set(CONTRACT_RULES)
    alone = {rules[0] for *_, rules in CASES.values() if len(rules) == 1}
    assert alone == set(CONTRACT_RULES) - {"answer_format"}  # an unparsable answer is never a correct one


def test_good_tool_episode_passes() -> None:
    traj = episode(assistant("", "c1", "c2"), tool("c2"), tool("c1"), assistant(answer_text(TASK.answer)))
    assert failed(traj, harness=TOOLS) == []


def test_details_name_both_numbers() -> None:
    assert "recorded 99 completion tokens, counted 12" in detail(good(tokens=TokenCounts(prompt=23, completion=99)), "limits")
    assert "recorded 22 prompt tokens, counted 23" in detail(good(tokens=TokenCounts(prompt=22, completion=12)), "limits")
    tight = variant(FULL, limits={"max_prompt_tokens": 22})
    assert "23 prompt tokens > max_prompt_tokens 22" in detail(good(harness=tight), "limits", tight)
    assert "12 tokens > max_new_tokens 11" in detail(good(harness=TIGHT), "stopped", TIGHT)
    assert "edited after recording" in detail(good().model_copy(update={"seed": 1}), "ids_consistent")


def test_system_prompt_is_part_of_the_prompt() -> None:
    raw = FULL.document.model_dump(mode="json")
    raw["prompt"]["system_template"] = "templates/system.j2"
    harness = Harness(FULL.path, HCPDocument.model_validate(raw), {**FULL.sources, "templates/system.j2": "Add. "})
    system = Message(role="system", content="Add. ")
    ok = good(harness=harness, messages=(system, user(), assistant(answer_text(TASK.answer))),
              tokens=TokenCounts(prompt=1 + 5 + PROMPT_CHARS, completion=12))
    assert failed(ok, harness=harness) == []
    assert failed(good(harness=harness), harness=harness) == ["prompt_rendered", "messages_allowed"]  # no system


def test_stop_strings_count_and_end_a_reply() -> None:
    harness = variant(ROOMY, decoding={"stop": ["\n\n"]})
    # the backend cut the stop string from the text but generated it: 11 + 2 tokens
    assert failed(good(harness=harness, tokens=TokenCounts(prompt=23, completion=13)), harness=harness) == []
    assert failed(good(harness=harness), harness=harness) == []  # ended on EOS instead: 11 + 1
    assert "stopped" in failed(good(answer_text(TASK.answer) + "\n\n", harness=harness), harness=harness)


def test_stop_not_required() -> None:
    harness = variant(FULL, answer={"require_stop": False})
    assert failed(good(harness=harness, finish_reason="length", tokens=TokenCounts(prompt=23, completion=11)),
                  harness=harness) == []


@pytest.mark.parametrize("digits", ["٠١٢٣٤٥٦٧٨٩", "⁰¹²³⁴⁵⁶⁷⁸⁹", "０１２３４５６７８９"], ids=["arabic-indic", "superscript", "fullwidth"])
def test_non_ascii_digits_fail_the_format(digits: str) -> None:
    text = answer_text(TASK.answer).translate(str.maketrans("0123456789", digits))
    assert failed(good(text)) == ["answer_format", "answer_correct"]


def test_a_rule_that_cannot_judge_fails_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(text: str, width: int) -> Any:
        raise ValueError("boom")

    monkeypatch.setitem(PARSERS, "reversed_digits", PARSERS["reversed_digits"]._replace(fn=explode))
    verdict = audit(good(), TASK, FULL, FAMILY, pair_of(FULL))
    assert verdict.failed_rules() == ["answer_format", "answer_correct"]
    assert "raised ValueError: boom" in verdict.rules[list(CONTRACT_RULES).index("answer_format")].detail
    monkeypatch.undo()

    nowhere = variant(FULL, model={"base": "/nonexistent/model"})
    assert failed(good(harness=nowhere), harness=nowhere) == ["limits", "stopped"]
    assert "cannot judge: UserError" in detail(good(harness=nowhere), "limits", nowhere)

    def verify(task: Task, answer: Any) -> bool:
        raise TypeError("verifier bug")

    broken = dataclasses.replace(FAMILY, verify=verify)
    assert audit(good(), TASK, FULL, broken, pair_of(FULL)).failed_rules() == ["answer_correct"]


def test_unrenderable_task_fails_prompt_not_audit() -> None:
    task = TASK.model_copy(update={"payload": {"a": "x", "b": [1]}})
    assert set(failed(good(task_id=task.id), task)) == {"ids_consistent", "prompt_rendered"}


def _random_text(rng: random.Random) -> str:
    alphabet = "0123456789+=- ab\n<eos><bos>٣²３😀\u2028\x00"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))


def _random_message(rng: random.Random) -> Message:
    calls = tuple(ToolCall(id=rng.choice("ab"), name=rng.choice(["calc", "x"]), arguments={"expr": rng.choice([1, "2", None])})
                  for _ in range(rng.randrange(0, 3)))
    return Message(role=rng.choice(["system", "user", "assistant", "tool"]), content=_random_text(rng),
                   tool_calls=calls, tool_call_id=rng.choice([None, "a", "b"]))


def test_audit_never_raises_on_model_valid_input() -> None:
    rng = random.Random(0)
    payloads = [TASK.payload, {}, {"a": -5, "b": 10**30}, {"a": None}, {"a": "٣", "b": 1.5}]
    for _ in range(300):
        task = TASK.model_copy(update={"payload": rng.choice(payloads), "level": rng.choice([1, 4, 100, 10**6]),
                                       "answer": rng.choice([TASK.answer, "x", None, [1]])})
        traj = Trajectory(id=rng.choice(["traj-x", "[/bold]"]), task_id=task.id, pair_id="p", harness_id=FULL.id,
                          sample_index=0, seed=0, messages=tuple(_random_message(rng) for _ in range(rng.randrange(0, 6))),
                          finish_reason=rng.choice(["stop", "length", "error"]),
                          tokens=TokenCounts(prompt=rng.randrange(50), completion=rng.randrange(50)),
                          timings=Timings(generate_s=0))
        harness = rng.choice([FULL, TOOLS, TEXT, V1])
        verdict = audit(traj, task, harness, FAMILY, rng.choice([None, pair_of(harness)]))
        assert [r.rule for r in verdict.rules] == list(harness.document.contract.rules)


STRINGS = ["", "0", "1234567890+0987654321=", "<eos>", "a<bos>b<unk>c", "<<pad>>", "<eos", "<EOS>", "x\ny\tz\r\n",
           "é٣²３😀", "e\u0301", "\u2028", "  ", "{\"a\": [1]}", "<bo<bos>s>", "~" * 50]


def test_builtin_counter_equals_the_real_tokenizer() -> None:
    from rsi.basemodel import build_tokenizer

    tokenizer = build_tokenizer()
    for text in STRINGS:
        assert BUILTIN.prompt(text) == len(tokenizer(text)["input_ids"]), text
        assert BUILTIN.text(text) == len(tokenizer(text, add_special_tokens=False)["input_ids"]), text


def test_directory_counter_loads_the_saved_tokenizer(tmp_path: Path) -> None:
    from rsi.basemodel import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path / "model")
    counter = token_counter("model", root=tmp_path)
    assert [counter.prompt(t) for t in STRINGS] == [BUILTIN.prompt(t) for t in STRINGS]
    assert [counter.text(t) for t in STRINGS] == [BUILTIN.text(t) for t in STRINGS]


def test_importing_and_auditing_needs_no_torch() -> None:
    code = ("import sys; from tests.test_audit import FULL, good, failed; assert failed(good()) == []; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


def test_jsonl_audit_reports_malformed_lines_and_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    record = lambda traj: json.dumps({"trajectory": traj.model_dump(mode="json"), "task": TASK.model_dump(mode="json")})
    path.write_text("\n".join([record(good(harness=V1)), "{not json", record(good("1", harness=V1)),
                               json.dumps({"trajectory": {"id": "t"}, "task": {}}), "", record(good(harness=V1, seed=4))]))
    results = audit_jsonl(path, V1)
    assert [r.line for r in results] == [1, 2, 3, 4, 6]
    assert [r.verdict.passed if r.verdict else None for r in results] == [True, None, False, None, True]
    assert "JSON" in results[1].error and "trajectory" in results[3].error
    assert all(r.storable for r in results if r.record)


# ---- the CLI on a file mixing every class of bad line -------------------------------------------------

def full_harness_dir(tmp_path: Path) -> Path:
    """A copy of v1 whose contract lists every rule."""
    shutil.copytree(REPO / "harness_versions/addition/v1", tmp_path / "h")
    toml = tmp_path / "h/hcp.toml"
    lines = [f"rules = {json.dumps(list(CONTRACT_RULES))}" if line.startswith("rules =") else line
             for line in toml.read_text().splitlines()]
    toml.write_text("\n".join(lines) + "\n")
    return tmp_path / "h"


def bad_lines(harness: Harness) -> dict[str, str]:
    """Line label -> JSONL line; only "good" passes."""
    ans = answer_text(TASK.answer)
    as_digits = lambda table: ans.translate(str.maketrans("0123456789", table))  # noqa: E731

    def line(traj: Trajectory, task: Task = TASK, **json_kw: Any) -> str:
        record = {"trajectory": traj.model_dump(mode="json"), "task": task.model_dump(mode="json"),
                  "pair": pair_of(harness).model_dump(mode="json")}
        return json.dumps(record, **json_kw)

    g = lambda reply=None, **kw: good(reply, harness=harness, **kw)  # noqa: E731
    return {
        "good": line(g()),
        "extra-user-message": line(g(messages=(user(), user(ans), assistant(ans)))),
        "tool-answers-no-call": line(g(messages=(user(), tool("c1", ans), assistant(ans)))),
        "arabic-indic": line(g(as_digits("٠١٢٣٤٥٦٧٨٩")), ensure_ascii=False),
        "superscript": line(g(as_digits("⁰¹²³⁴⁵⁶⁷⁸⁹"))),
        "fullwidth": line(g(as_digits("０１２３４５６７８９") + "\u2028"), ensure_ascii=False),
        "forged-tokens": line(g(tokens=TokenCounts(prompt=23, completion=5))),
        "forged-stop": line(g(ans + "7", tokens=TokenCounts(prompt=23, completion=13))),
        "cut-reply": line(g(ans[:5] + "1234567", finish_reason="length")),
        "edited-keeps-id": line(g().model_copy(update={"messages": (user(), assistant(answer_text(TASK.answer + 1)))})),
        "wrong-answer": line(g(answer_text(TASK.answer + 1))),
        "extra-content": line(g(ans + "\n")),
        "tampered-task": line(g(answer_text(TASK.answer + 1), task_id=WRONG_TASK.id), WRONG_TASK),
        "markup-id": line(g().model_copy(update={"id": "[/bold]"})),
        "malformed-json": '{"trajectory": ',
        "json-list": "[1, 2, 3]",
        "json-null": "null",
        "json-wrong-record": json.dumps({"trajectory": 1, "task": "x"}),
    }


def run_audit(path: Path, harness_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rsi", "audit", "--file", str(path), "--harness", str(harness_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ), timeout=180)


def test_audit_cli_fails_every_bad_line_and_never_crashes(tmp_path: Path) -> None:
    harness_dir = full_harness_dir(tmp_path)
    lines = bad_lines(load_harness(harness_dir))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines.values()) + "\n", encoding="utf-8")

    result = run_audit(path, harness_dir, "--no-store", "--json")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    outcomes = {label: json.loads(out) for label, out in zip(lines, result.stdout.splitlines(), strict=True)}
    assert [o["line"] for o in outcomes.values()] == list(range(1, len(lines) + 1))
    assert outcomes.pop("good")["passed"] is True
    for label, o in outcomes.items():
        assert (o["passed"] is False and set(o["failed_rules"]) <= set(CONTRACT_RULES) and o["failed_rules"]) or (
            o["passed"] is None and o["error"]), (label, o)
    expect = {"extra-user-message": "messages_allowed", "tool-answers-no-call": "messages_allowed",
              "arabic-indic": "answer_format", "superscript": "answer_format", "fullwidth": "answer_format",
              "forged-tokens": "limits", "forged-stop": "stopped", "cut-reply": "stopped",
              "edited-keeps-id": "ids_consistent", "wrong-answer": "answer_correct",
              "extra-content": "no_extra_content", "tampered-task": "ids_consistent", "markup-id": "ids_consistent"}
    for label, rule in expect.items():
        assert rule in outcomes[label]["failed_rules"], (label, outcomes[label])
    assert f"{len(expect) + 1} audited: 1 passed, {len(expect)} failed; 4 malformed line(s)" in result.stderr


def test_audit_cli_stores_into_rsi_home(tmp_path: Path, rsi_home: Path) -> None:
    harness_dir = full_harness_dir(tmp_path)
    lines = bad_lines(load_harness(harness_dir))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines.values()) + "\n", encoding="utf-8")
    result = run_audit(path, harness_dir)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "14 audited: 1 passed, 13 failed; 4 malformed line(s)" in result.stdout
    # the edited trajectory and the one with a markup id do not hash their content: not stored
    assert "stored 12 new verdict(s) under contract 1; 2 trajectory(ies)" in result.stdout
    again = run_audit(path, harness_dir)
    assert "stored 0 new verdict(s)" in again.stdout  # idempotent: same contract, same trajectories

    from sqlalchemy import func, select

    from rsi.store import open_store
    from rsi.store.schema import VerdictRow

    assert rsi_home.is_dir()
    store = open_store()
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(VerdictRow)) == 12
        assert s.scalar(select(func.count()).select_from(VerdictRow).where(VerdictRow.passed)) == 1
    store.dispose()


# ---- the recount equals what the real backend reports ---------------------------------------------------

@pytest.mark.slow
def test_counted_tokens_equal_the_hf_backend(tiny_base: Path) -> None:
    """Real generations of the tiny base, recorded by the real executor: the auditor's recount equals the
    backend's counts -- ended on EOS, on a stop string, or cut by length. Sampling at T=1 sometimes draws
    <bos> or <unk> mid-reply, which decoding drops from the text: the recount is then short and the
    trajectory fails ``limits`` (the text is not what was generated); only that kind of miss is allowed."""
    from rsi.backends import get_backend
    from rsi.pair import Responder, sampling_params

    backend = get_backend("hf", model_dir=tiny_base)  # the tiny profile's base, built once per session
    tasks = {t.id: t for t in FAMILY.tasks("train", 0, 2, 12) + FAMILY.tasks("train", 0, 4, 12)}
    short = variant(FULL, decoding={"max_new_tokens": 5}, limits={"max_completion_tokens": 5})
    stops = variant(ROOMY, decoding={"stop": ["00", "9"]})
    seen, misses, total = set(), 0, 0
    for harness in (FULL, short, stops):
        for greedy in (True, False):
            params = sampling_params(harness, seed=3, samples=4, greedy=greedy)
            for traj in Responder(harness, backend, pair_of(harness).id).episodes(list(tasks.values()), params):
                verdict = audit(traj, tasks[traj.task_id], harness, FAMILY, pair_of(harness))
                limits = next(r for r in verdict.rules if r.rule == "limits")
                assert traj.tokens.prompt == BUILTIN.prompt(traj.messages[0].content)
                assert limits.passed or (not greedy and traj.tokens.completion > BUILTIN.text(traj.completion) + 1 - (
                    traj.finish_reason == "length")), (traj.completion, traj.finish_reason, traj.tokens, limits)
                assert {"ids_consistent", "messages_allowed"}.isdisjoint(verdict.failed_rules()), verdict
                if traj.finish_reason == "stop":
                    assert "stopped" not in verdict.failed_rules(), verdict
                seen.add((traj.finish_reason, traj.tokens.completion - len(traj.completion)))
                misses, total = misses + (not limits.passed), total + 1
    backend.close()
    assert {("stop", 1), ("stop", 2), ("length", 0)} <= seen  # EOS, the stop string '00', cut by length
    assert misses <= 0.05 * total, (misses, total)


# ---- text_matches_calls: what training reads of a turn is the call the replay ran (issue 30) ------------------

def test_a_turn_that_says_another_call_than_it_records_fails_contract_3_and_passed_contract_2() -> None:
    """Issue 30's episode: the text says swap(2), the recorded call, tool log and replay say swap(1), its id
    recomputed. Under sorting/v1 (contract 2) it passes every rule; under sorting/v2 (contract 3) it fails
    text_matches_calls, naming the turn; a re-audit of the v1 trajectory under v2 fails that rule alone, and
    its verdict under v1 stays what it was."""
    old = sort_episode(say_swap_2, SORT, SWAP_1_TASK)
    before = audit(old, SWAP_1_TASK, SORT, SORTING, pair_of(SORT))
    assert before.passed and before.contract_version == "2"
    new = sort_episode(say_swap_2, SORT2, SWAP_1_TASK)
    verdict = audit(new, SWAP_1_TASK, SORT2, SORTING, pair_of(SORT2))
    assert verdict.contract_version == "3" and verdict.failed_rules() == ["text_matches_calls"]
    assert next(r.detail for r in verdict.rules if r.rule == "text_matches_calls") == (
        'message 1: the text \'swap(2)\' writes swap{"i": 2}, the turn records swap{"i": 1}')
    reaudit = audit(old, SWAP_1_TASK, SORT2, SORTING, pair_of(SORT), recorded=SORT)
    assert reaudit.failed_rules() == ["text_matches_calls"]
    assert audit(old, SWAP_1_TASK, SORT, SORTING, pair_of(SORT)) == before


def test_genuine_episodes_pass_contract_3() -> None:
    for task in (SORT_TASK, SWAP_1_TASK):
        traj = sort_episode(None, SORT2, task)
        assert failed(traj, task, SORT2) == [], task.id


def written(text: str) -> Any:
    """An edit: the first turn's text becomes ``text``; its recorded call (swap(1)), log and replay stay."""
    def edit(messages: list[Message], log: list[ToolRecord]) -> None:
        messages[1] = messages[1].model_copy(update={"content": text})
    return edit


@pytest.mark.parametrize(("text", "detail"), [
    ("swap(1.0)", 'writes swap{"i": 1.0}, the turn records swap{"i": 1}'),  # equal in Python, not in the text
    ("swap(true)", 'writes swap{"i": true}, the turn records swap{"i": 1}'),
    ("swap(1,1)", 'writes swap{"_0": 1, "i": 1}, the turn records swap{"i": 1}'),
    ("done", 'writes no call, the turn records swap{"i": 1}'),
    ("swap(1)swap(1)", 'writes no call, the turn records swap{"i": 1}'),
    ("", 'writes no call, the turn records swap{"i": 1}'),
    ("swap( 1)", "is not its call as the harness writes it, 'swap(1)'"),
    ("swap(1)\n", "is not its call as the harness writes it, 'swap(1)'"),
])
def test_a_turn_whose_text_is_not_exactly_its_recorded_call_fails(text: str, detail: str) -> None:
    traj = sort_episode(written(text), SORT2, SWAP_1_TASK)
    verdict = audit(traj, SWAP_1_TASK, SORT2, SORTING, pair_of(SORT2))
    assert "text_matches_calls" in verdict.failed_rules()
    got = next(r.detail for r in verdict.rules if r.rule == "text_matches_calls")
    assert got.startswith(f"message 1: the text {text!r} ") and got.endswith(detail), got


def test_a_final_reply_that_writes_a_call_fails() -> None:
    def say_swap(messages: list[Message], log: list[ToolRecord]) -> None:
        messages[-1] = messages[-1].model_copy(update={"content": "swap(0)"})

    traj = sort_episode(say_swap, SORT2, SWAP_1_TASK)
    assert failed(traj, SWAP_1_TASK, SORT2) == ["text_matches_calls", "answer_format", "answer_correct"]
    verdict = audit(traj, SWAP_1_TASK, SORT2, SORTING, pair_of(SORT2))
    assert next(r.detail for r in verdict.rules if r.rule == "text_matches_calls") == (
        'message 5: the text \'swap(0)\' writes swap{"i": 0}, the turn records no call')


def test_chat_mode_text_writes_the_recorded_calls_in_the_models_format() -> None:
    """In chat mode the text is read as the hf backend reads it (Hermes blocks); training reads the text, so a
    call recorded without its block in the text (an OpenAI server's structured call) fails as well."""
    from rsi.audit import Case, judge

    raw = SORT2.document.model_dump(mode="json")
    raw["prompt"]["mode"], raw["tool_calls"] = "chat", None
    chat = Harness(SORT2.path, HCPDocument.model_validate(raw), SORT2.sources)
    hermes = '<tool_call>{{"name": "swap", "arguments": {{"i": {}}}}}</tool_call>'.format

    def judged(first: str) -> Any:
        def edit(messages: list[Message], log: list[ToolRecord]) -> None:
            for k, m in enumerate(messages):
                if m.tool_calls:
                    text = first if k == 1 else hermes(m.tool_calls[0].arguments["i"])
                    messages[k] = m.model_copy(update={"content": text})

        traj = sort_episode(edit, SORT2, SWAP_1_TASK)
        return judge("text_matches_calls", Case(traj, SWAP_1_TASK, chat, SORTING, None))

    assert judged(hermes(1)).passed and judged(f"Swapping. {hermes(1)}").passed
    assert judged(hermes(2)).detail.endswith('writes swap{"i": 2}, the turn records swap{"i": 1}')
    assert judged("").detail.endswith('writes no call, the turn records swap{"i": 1}')
    assert not judged("swap(1)").passed
