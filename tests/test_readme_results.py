"""The README's measured numbers are the result files' (bench/readme.py): the blocks are what the JSONs write, a
block shows numbers only of a result measured on a clean commit whose measured code has not changed since, and no
measured-looking number stands outside the blocks."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# numbers outside the blocks that are settings, sizes or names, not measurements (each with where it comes from)
SETTINGS = {
    "0.04": "the gate's margin", "0.05": "the gate's alpha", "0.1": "gate margin / min_lr_ratio settings",
    "0.15": "vLLM's gpu_memory_utilization on CPU", "0.35": "the sorting base's mistakes setting",
    "0.2": "a base recipe's mistakes setting", "1.0": "versions: hcp 1.0, temperature 1.0", "3.11": "Python",
    "1.5": "a harness's temperature setting", "0.98": "the route adapter's macro-F1 target",
    "0.9": "a setting's value", "0.5": "frontier_fraction", "0.8": "a setting's value",
    "0.95": "the demo profile's curriculum mastery",
    "95 %": "the intervals' confidence level", "134.5": "SmolLM2-135M's parameter count in millions (its config)",
}


def _readme():
    spec = importlib.util.spec_from_file_location("bench_readme", REPO / "bench/readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_blocks_are_what_the_result_files_write():
    readme = _readme()
    text = (REPO / "README.md").read_text()
    names = [m["name"] for m in readme.BLOCK.finditer(text)]
    assert set(readme.RESULTS) <= set(names), sorted(set(readme.RESULTS) - set(names))  # every result has its block
    for m in readme.BLOCK.finditer(text):
        assert m["body"] == readme.render(m["name"]), f"README block {m['name']!r} differs: run bench/readme.py"


def test_a_block_shows_numbers_only_of_a_current_result():
    readme = _readme()
    for m in readme.BLOCK.finditer((REPO / "README.md").read_text()):
        if not m["body"].startswith("*Not shown"):
            assert readme.staleness(m["name"]) is None, m["name"]


def measured_looking(text: str) -> list[str]:
    """Decimals, percentages, ratios, durations and rates: what a measurement writes (versions left out)."""
    found = re.findall(r"(?<![\w.\-/])\d+\.\d+(?![\w.])|\d+(?:\.\d+)? ?%|(?<![\w.])\d+(?:\.\d+)?x(?!\w)"
                       r"|\d+ min \d+ s|\d+(?:\.\d+)? ms\b|[\d,]+ tokens/s|[\d,.]+ CPU-s", text)
    return [f for f in found if f not in SETTINGS]


def test_no_measured_number_outside_the_blocks():
    readme = _readme()
    outside = readme.BLOCK.sub("", (REPO / "README.md").read_text())
    outside = re.sub(r"```.*?```", "", outside, flags=re.S)  # commands, not measurements
    assert measured_looking(outside) == []


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "-c",
                           "commit.gpgsign=false", *args], check=True, capture_output=True, text=True).stdout.strip()


def test_a_result_is_shown_only_while_its_commit_is_clean_and_its_code_unchanged(tmp_path: Path):
    """In a repository of its own: a result of a clean commit is written out; a README number edited by hand, a
    JSON without commit, one of a dirty tree, or code changed after the commit each make the check fail."""
    readme = _readme()
    for folder in ("rsi", "bench/results", "flows"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "rsi/core.py").write_text("x = 1\n")
    (tmp_path / "bench/demo.py").write_text("# the bench\n")
    (tmp_path / "Makefile").write_text("demo:\n\trsi run addition\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "code")
    result = {"command": "make demo", "machine": "m", "wall": "1 min 2 s", "rc": 0, "levels": "1-2",
              "generations": ["generation 1: promoted (p=0.01)"], "final": {"champion": 0.875},
              "gains": {"1": {"weights": 0.5, "harness": 0.25}}}

    def measured(clean: bool = True, commit: str | None = "HEAD") -> None:
        prov = {"commit": git(tmp_path, "rev-parse", commit) if commit else None, "clean": clean}
        (tmp_path / "bench/results/demo-addition.json").write_text(json.dumps(result | {"provenance": prov}))

    measured()
    block = readme.render("demo-addition", tmp_path)
    assert "| champion | 0.875 |" in block and "+0.50" in block
    text = f"intro\n<!-- results:demo-addition -->\n{block}<!-- /results:demo-addition -->\n"
    assert readme.rewrite(text, tmp_path) == text
    edited = text.replace("0.875", "0.876")
    assert readme.rewrite(edited, tmp_path) != edited  # a number edited by hand is caught

    measured(commit=None)
    assert "records no commit" in readme.staleness("demo-addition", tmp_path)
    measured(clean=False)
    assert "uncommitted code" in readme.staleness("demo-addition", tmp_path)
    measured()
    (tmp_path / "Makefile").write_text("demo:\n\trsi run addition --set curriculum.mastery=0.95\n")
    git(tmp_path, "commit", "-q", "-am", "change the demo's recipe")
    assert "Makefile changed" in readme.staleness("demo-addition", tmp_path)  # make demo's recipe is measured too
    measured()
    (tmp_path / "rsi/core.py").write_text("x = 2\n")
    git(tmp_path, "commit", "-q", "-am", "change the measured code")
    assert "rsi/core.py changed" in readme.staleness("demo-addition", tmp_path)
    shown = readme.rewrite(text, tmp_path)
    assert shown != text and "0.875" not in shown and "Not shown" in shown


@pytest.mark.parametrize("line, found", [
    ("the champion scores 0.954 on level 16", ["0.954"]),
    ("ray took 0.65x the local wall time; 24 min 55 s", ["0.65x", "24 min 55 s"]),
    ("gate margin 0.04, hcp 1.0, mlflow 3.17.2, level 11", []),
])
def test_the_scan_finds_measurements_and_passes_settings(line, found):
    assert measured_looking(line) == found
