"""``rsi.pair.Responder.respond``: one turn of a pair after a conversation's view, as the proxy asks for it (the
proxy's own tests run it on real specialists; here a FAKE model scripts the replies)."""

from __future__ import annotations

from rsi.backends.base import SamplingParams
from rsi.hcp import load_harness
from rsi.models import Message
from rsi.pair import Responder
from rsi.proposers import propose
from rsi.tasks import get_family

from .fakes import FakeModel, adder

PARAMS = SamplingParams(max_new_tokens=12)


def ids(j: int, n: int) -> str:
    return f"call_test_{j}_of_{n}"


def test_a_tool_call_turn_comes_back_as_a_message_with_its_call() -> None:
    sort = load_harness("sorting/v1")
    question = Message(role="user", content=sort.prompt(get_family("sorting").task("test", 0, 2, 0).payload))
    reply = Responder(sort, FakeModel(lambda prompt, k: "swap(3)"), "pair-x").respond([question], PARAMS, ids)
    assert reply.finish_reason == "tool_calls" and reply.message.content == "swap(3)"
    assert [(c.id, c.name, c.arguments) for c in reply.message.tool_calls] == [("call_test_0_of_1", "swap", {"i": 3})]
    done = Responder(sort, FakeModel(lambda prompt, k: "done"), "pair-x").respond([question], PARAMS, ids)
    assert done.finish_reason == "stop" and done.message.tool_calls == ()


def test_a_plan_harness_answers_a_posed_task_by_its_plan_and_anything_else_in_one_call(tmp_path) -> None:
    from rsi.store.harnesses import write_harness_dir

    (proposal,) = propose(load_harness("addition/v2"), ["addition"], {"chunk": [2]})
    write_harness_dir(tmp_path / "chunks2", proposal.document, proposal.sources)
    chunks = load_harness(tmp_path / "chunks2")
    task = get_family("addition").task("test", 0, 7, 0)
    model = FakeModel(adder())
    reply = Responder(chunks, model, "pair-x").respond([Message(role="user", content=chunks.prompt(task.payload))],
                                                       PARAMS, ids)
    assert reply.message.content == str(task.answer) and reply.finish_reason == "stop"
    assert model.calls == 1 and len(model.prompts[0]) > 1  # one round of the plan's calls, in one batch
    other = Responder(chunks, FakeModel(lambda prompt, k: "hello"), "pair-x").respond(
        [Message(role="user", content="12+34=")], PARAMS, ids)
    assert other.message.content == "hello" and other.prompt_tokens == 1 + len("12+34=")
