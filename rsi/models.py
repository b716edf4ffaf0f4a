"""Domain models: what rsi stores and passes between stages. Frozen where the value is a fact."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from rsi.hashing import digest

Split = Literal["train", "heldout", "test"]
SPLITS: tuple[Split, ...] = ("train", "heldout", "test")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Task(Frozen):
    """One verifiable problem, deterministic from (family, split, seed, level, index)."""

    family: str
    family_version: str = "1"
    split: Split
    level: int = Field(ge=1)
    seed: int
    index: int = Field(ge=0)
    payload: dict[str, JsonValue]
    answer: JsonValue

    @property
    def id(self) -> str:
        return "task-" + digest(self.model_dump(mode="json"))[:24]


class ToolCall(Frozen):
    id: str
    name: str
    arguments: dict[str, JsonValue]


class Message(Frozen):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class ToolRecord(Frozen):
    """One tool call as the environment ran it (``rsi.substrate``): what was asked, what it returned, and the
    state's hash before and after, so the auditor can replay the episode and compare."""

    call_id: str
    name: str
    arguments: dict[str, JsonValue]
    result: JsonValue
    state_before: str
    state_after: str


class TokenCounts(Frozen):
    prompt: int = Field(ge=0)
    completion: int = Field(ge=0)


class Timings(Frozen):
    """Wall seconds spent producing the trajectory (queueing excluded)."""

    generate_s: float = Field(ge=0)
    tools_s: float = Field(default=0.0, ge=0)


class Trajectory(Frozen):
    """One attempt at one task under one pair: everything the auditor needs, nothing it must trust."""

    id: str
    task_id: str
    pair_id: str
    harness_id: str
    sample_index: int = Field(ge=0)
    seed: int
    messages: tuple[Message, ...]
    finish_reason: Literal["stop", "length", "error"] = "stop"
    tokens: TokenCounts
    timings: Timings
    tool_log: tuple[ToolRecord, ...] = Field((), description="every tool call of the episode, in order")
    created_at: datetime | None = None

    @classmethod
    def build(cls, **fields: Any) -> Trajectory:
        """A trajectory whose id is its content hash."""
        draft = cls(id="traj-", **fields)
        return draft.model_copy(update={"id": draft.content_id})

    @property
    def content_id(self) -> str:
        """The id this trajectory must carry: a hash of its content (not of its timings or storage time),
        so an edited trajectory is a new trajectory and never inherits an old verdict."""
        content = self.model_dump(mode="json", exclude={"id", "timings", "created_at"})
        if not content["tool_log"]:  # added later: a trajectory without tool calls keeps the id it always had
            del content["tool_log"]
        return trajectory_id(content)

    @property
    def completion(self) -> str:
        """Text of the last assistant message ('' when the model said nothing)."""
        for message in reversed(self.messages):
            if message.role == "assistant":
                return message.content
        return ""


def trajectory_id(content: dict[str, Any]) -> str:
    """``traj-`` + digest of a trajectory's content fields (everything but id, timings, created_at)."""
    return "traj-" + digest(content)[:24]


class RuleResult(Frozen):
    rule: str
    passed: bool
    detail: str = ""


class Verdict(Frozen):
    """The auditor's judgement of one trajectory under one contract version."""

    trajectory_id: str
    contract_version: str
    harness_hash: str
    rules: tuple[RuleResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rules)

    def failed_rules(self) -> list[str]:
        return [r.rule for r in self.rules if not r.passed]


class Pair(Frozen):
    """A model-harness pair: frozen base + optional LoRA adapter + harness version, content-addressed."""

    base_model_hash: str
    adapter_hash: str | None
    harness_id: str
    harness_hash: str

    @property
    def id(self) -> str:
        return "pair-" + digest(self.model_dump(mode="json"))[:24]


class LineageSpec(Frozen):
    """What a lineage is: a task family climbed under a harness from a base, with its knobs as data."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")
    family: str
    harness: str = Field(description="harness_versions/<family>/<version> directory, relative or absolute")
    base_model: str = "builtin"
    seed: int = 0
    warm_start: Literal["parent", "base"] = "parent"
    settings: dict[str, Any] = Field(default_factory=dict)
