"""A pair answers: ``Responder`` is the one place where a model-harness pair turns messages into its reply.

Everything that makes a pair answer goes through it: the cycle's execution and evaluation (``run``: many tasks,
as episodes or by the harness's plan), the Mixture-of-LoRA proxy (``respond``: one user turn, its tool calls
parsed, or a task the user poses in the harness's own format answered by its plan), and the MLflow pyfunc
model. A new harness feature is one edit here.

An episode starts with the harness's prompt messages. Each turn the model writes an assistant message; a turn
that is a tool call (in the harness's ``[tool_calls] syntax``; in chat mode the calls the backend read in the
model's own format) is run on the episode's environment (``rsi.substrate``) and answered by a tool message (the
harness's ``prompt.tool_template``); a turn that is not a call is the final reply and ends the episode, as does a
reply cut by length or the harness's step limit. A harness without tools makes one-step episodes: the prompt and
one reply.

Many episodes advance together: each turn, the next turn of every live episode is one backend batch. The first
turn is the same call the single-turn rollout always made (``params.n`` samples per task), so a one-step
episode's trajectory is what it was; later turns continue each sample from its own transcript (the backend
seeds a row from its text, so a sample's path is a function of its own history). What the model reads is
``rsi.pair.text``'s transcript (completion mode) or the messages through its chat template (chat mode).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rsi.backends.base import Completion, GenerationBackend, SamplingParams
from rsi.errors import UserError
from rsi.hcp import Harness
from rsi.hcp.syntax import parse_call
from rsi.models import Message, Task, Timings, TokenCounts, ToolCall, Trajectory
from rsi.pair.plans import PlanPath, run_plans
from rsi.pair.text import EOS_TEXT, transcript
from rsi.substrate import Session, result_text
from rsi.tasks import TaskFamily, get_family

CallIds = Callable[[int, int], str]  # (index of the call in its turn, calls in the turn) -> the call's id


def sampling_params(harness: Harness, *, seed: int, greedy: bool = False, samples: int | None = None) -> SamplingParams:
    """The harness's decoding settings as backend parameters; ``greedy`` is one deterministic sample."""
    dec = harness.document.decoding
    return SamplingParams(
        max_new_tokens=dec.max_new_tokens,
        temperature=0.0 if greedy else dec.temperature,
        top_p=1.0 if greedy else dec.top_p,
        n=1 if greedy else (samples or dec.samples),
        seed=seed,
        stop=dec.stop,
    )


class Reply(NamedTuple):
    """One turn of the pair: the assistant message (its tool calls parsed) and what it cost."""

    message: Message
    finish_reason: str  # "stop", "length", or "tool_calls" when the message makes calls
    prompt_tokens: int
    completion_tokens: int


class Run(NamedTuple):
    """What ``Responder.run`` made: the trajectories, the tasks a plan's calls posed (by id; none without a
    plan, where each trajectory is one of the tasks) and, with a plan, each run's path and composed answer."""

    trajectories: list[Trajectory]
    tasks: dict[str, Task]
    paths: list[PlanPath]


class Responder:
    """A model-harness pair: the harness, the backend serving its base, the adapter (None: the base alone) and
    the pair's id that its trajectories carry."""

    def __init__(self, harness: Harness, backend: GenerationBackend, pair_id: str = "",
                 adapter: str | Path | None = None, family: TaskFamily | None = None, eos: str = EOS_TEXT):
        self.harness, self.backend, self.pair_id = harness, backend, pair_id
        self.adapter = None if adapter is None else str(adapter)
        self.eos = eos
        self._family = family

    @property
    def family(self) -> TaskFamily:
        if self._family is None:
            self._family = get_family(self.harness.document.family)
        return self._family

    # ---- one turn ----------------------------------------------------------------------------------------

    def request(self, conversations: Sequence[Sequence[Message]]) -> tuple[str, list[Any]]:
        """What the backend is asked for these conversations: ("chat", the messages), which the model's chat
        template writes, or ("generate", their transcripts) in completion mode."""
        if self.harness.chat:
            return "chat", [list(m) for m in conversations]
        return "generate", [transcript(m, self.eos) for m in conversations]

    def ask(self, conversations: Sequence[Sequence[Message]], params: SamplingParams) -> list[list[Completion]]:
        """One backend batch: ``params.n`` completions of each conversation's next assistant turn."""
        mode, items = self.request(conversations)
        if mode == "chat":
            return self.backend.chat(items, self.harness.chat_tools, params, adapter=self.adapter)
        return self.backend.generate(items, params, adapter=self.adapter)

    def calls(self, completion: Completion) -> list[tuple[str, dict[str, Any]]]:
        """The tool calls a turn makes: none from a harness without tools or a reply cut by length; in chat mode
        those the backend read from the model's own format, else the one the text writes in the harness's
        syntax."""
        if not self.harness.document.tools or completion.finish_reason != "stop":
            return []
        if self.harness.chat:
            return [(c.name, c.arguments) for c in completion.tool_calls]
        call = parse_call(self.harness, completion.text)
        return [] if call is None else [call]

    def message(self, completion: Completion, call_id: CallIds) -> Message:
        """The assistant message of a completion, its calls (if it makes any) named by ``call_id``."""
        calls = self.calls(completion)
        return Message(role="assistant", content=completion.text, tool_calls=tuple(
            ToolCall(id=call_id(j, len(calls)), name=name, arguments=arguments)
            for j, (name, arguments) in enumerate(calls)))

    def respond(self, messages: Sequence[Message], params: SamplingParams, call_id: CallIds) -> Reply:
        """The pair's next turn after ``messages`` (a view the harness's model reads: its prompt, or a user's
        message and what followed it). A plan harness answers a last user message that poses a task in its own
        format by its plan, call after call (``answer_task``)."""
        task = self.posed(messages[-1]) if self.harness.document.plan is not None else None
        if task is not None:
            return self.answer_task(task, params)
        return self.reply(self.ask([messages], params.model_copy(update={"n": 1}))[0][0], call_id)

    def reply(self, completion: Completion, call_id: CallIds) -> Reply:
        message = self.message(completion, call_id)
        finish = "tool_calls" if message.tool_calls else completion.finish_reason
        return Reply(message, finish, completion.prompt_tokens, completion.completion_tokens)

    def posed(self, message: Message) -> Task | None:
        """The task a user message poses in the harness's own format (a payload the family reads from it that the
        harness renders back to exactly that text), or None."""
        family = self.family
        if message.role != "user" or family.read is None:
            return None
        for payload in family.read(message.content):
            try:
                if self.harness.prompt(payload) == message.content:
                    return family.derive(payload)
            except UserError:
                continue
        return None

    def answer_task(self, task: Task, params: SamplingParams) -> Reply:
        """One task answered by the harness's plan: its calls, each answered by the pair, composed as the plan
        composes them; the composed answer written by the harness's answer template, else as the value itself (an
        addition's sum in decimal); empty when a call gave no answer. Tokens: all the calls'."""
        run = self.run([task], params.model_copy(update={"n": 1}))
        answer = run.paths[0].answer
        if answer is None:
            content = ""
        elif self.harness.document.answer.template:
            content = self.harness.render_answer(task.payload, answer)
        else:
            content = str(answer)
        return Reply(Message(role="assistant", content=content), "stop",
                     sum(t.tokens.prompt for t in run.trajectories), sum(t.tokens.completion for t in run.trajectories))

    # ---- many tasks ---------------------------------------------------------------------------------------

    def run(self, tasks: Sequence[Task], params: SamplingParams) -> Run:
        """``params.n`` samples of each task: episodes under the harness, or, with a plan, its programs (each call a
        one-step episode). Seeded: the same tasks, params and adapter give the same trajectories and ids."""
        if self.harness.document.plan is None:
            return Run(self.episodes(tasks, params), {}, [])
        done = run_plans(tasks, self.harness, self.family, self.episodes, params)
        return Run(done.trajectories, done.tasks, done.paths)

    def episodes(self, tasks: Sequence[Task], params: SamplingParams) -> list[Trajectory]:
        """``params.n`` episodes per task under the harness, advanced together; one trajectory each, in task then
        sample order."""
        doc = self.harness.document
        episodes: list[_Episode] = []
        for task in tasks:
            prompt = [Message(role=role, content=content) for role, content in self.harness.prompt_messages(task.payload)]
            for k in range(params.n):
                session = Session(self.family.environment, task.payload, self.harness.tool_schemas) if doc.tools else None
                episodes.append(_Episode(task, k, list(prompt), session))
        if not episodes:
            return []
        first = self.ask([episodes[i * params.n].messages for i in range(len(tasks))], params)  # n samples a task
        for episode, completion in zip(episodes, [c for samples in first for c in samples], strict=True):
            episode.prompt_tokens = completion.prompt_tokens
            self._take_turn(episode, completion)
        one = params.model_copy(update={"n": 1})
        while live := [e for e in episodes if not e.done]:
            for episode, samples in zip(live, self.ask([e.messages for e in live], one), strict=True):
                self._take_turn(episode, samples[0])
        return [self._trajectory(e, params.seed) for e in episodes]

    def _take_turn(self, episode: _Episode, completion: Completion) -> None:
        """Record one assistant turn; run its calls, if it makes any, and answer each."""
        episode.steps += 1
        episode.completion_tokens += completion.completion_tokens
        episode.generate_s += completion.generate_s
        episode.finish = completion.finish_reason
        step = episode.steps
        message = self.message(completion, lambda j, n: f"call_{step}" if n == 1 else f"call_{step}_{j}")
        episode.messages.append(message)
        if not message.tool_calls:
            episode.done = True
            return
        for call in message.tool_calls:
            started = time.perf_counter()
            record = episode.session.call(call.id, call.name, call.arguments)
            episode.tools_s += time.perf_counter() - started
            content = self.harness.render_tool(episode.task.payload, {"name": call.name, "arguments": call.arguments},
                                               result_text(record.result))
            episode.messages.append(Message(role="tool", content=content, tool_call_id=call.id))
        episode.done = episode.steps >= self.harness.document.limits.max_steps

    def _trajectory(self, e: _Episode, seed: int) -> Trajectory:
        return Trajectory.build(
            task_id=e.task.id, pair_id=self.pair_id, harness_id=self.harness.id, sample_index=e.sample, seed=seed,
            messages=tuple(e.messages), finish_reason=e.finish,
            tokens=TokenCounts(prompt=e.prompt_tokens, completion=e.completion_tokens),
            timings=Timings(generate_s=e.generate_s, tools_s=e.tools_s),
            tool_log=tuple(e.session.records) if e.session is not None else (),
        )


@dataclass
class _Episode:
    task: Task
    sample: int
    messages: list[Message]
    session: Session | None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0
    finish: str = "stop"
    done: bool = False
    steps: int = 0
