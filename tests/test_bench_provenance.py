"""bench/provenance.py: every result JSON of bench/ says its commit, whether the code was clean, its config, machine."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from bench.provenance import provenance, write_result
from rsi.hashing import digest

REPO = Path(__file__).resolve().parent.parent
MACHINE_FIELDS = {"cpu_count", "torch", "transformers", "torch_threads", "threads_arg", "platform", "python",
                  "loadavg_1m"}
# JSON a bench script may write itself: data it reads back, not a result
NOT_RESULTS = {"bench/harness_research/ei.py": "pools.json, ei.py's and migrate.py's --pools input"}
READS_RESULTS = {"bench/readme.py": "reads results/*.json and writes README.md, no result of its own"}


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                    *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A tiny repository with one committed file under rsi/ and one under bench/results/."""
    for name in ("rsi/core.py", "bench/results/x.json"):
        (tmp_path / name).parent.mkdir(parents=True)
        (tmp_path / name).write_text("0\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_this_repo_gives_its_commit_the_config_digest_and_the_machine():
    got = provenance({"profile": "tiny", "out": Path("x")}, threads=3)
    assert re.fullmatch(r"[0-9a-f]{40}", got["commit"])
    assert isinstance(got["clean"], bool)
    assert got["config_digest"] == digest({"profile": "tiny", "out": "x"})  # a Path is digested by its text
    assert set(got["machine"]) == MACHINE_FIELDS and got["machine"]["threads_arg"] == 3
    assert datetime.fromisoformat(got["recorded_at"]).utcoffset().total_seconds() == 0
    assert provenance()["config_digest"] is None


def test_clean_until_code_changes_and_results_do_not_count(repo: Path):
    assert provenance(root=repo)["clean"] is True
    (repo / "bench/results/x.json").write_text("1\n")  # a result written by an earlier run is not code
    (repo / "notes.txt").write_text("outside the code paths\n")
    assert provenance(root=repo)["clean"] is True
    (repo / "rsi/core.py").write_text("1\n")
    dirty = provenance(root=repo)
    assert dirty["clean"] is False
    git(repo, "commit", "-q", "-am", "second")
    (repo / "rsi/new.py").write_text("")  # untracked code counts too
    assert provenance(root=repo)["clean"] is False
    assert re.fullmatch(r"[0-9a-f]{40}", dirty["commit"])


def test_no_repository_or_no_git_gives_no_commit_and_not_clean(tmp_path: Path, monkeypatch):
    assert (provenance(root=tmp_path)["commit"], provenance(root=tmp_path)["clean"]) == (None, False)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    got = provenance()
    assert (got["commit"], got["clean"]) == (None, False)


def test_write_result_adds_provenance_and_leaves_no_temporary_file(tmp_path: Path):
    out = tmp_path / "new" / "r.json"
    write_result(out, {"ratio": 1.5, "levels": {1: 0.5}}, config={"n": 2}, threads=1)
    written = json.loads(out.read_text())
    assert written["ratio"] == 1.5 and written["levels"] == {"1": 0.5}
    assert written["provenance"]["config_digest"] == digest({"n": 2})
    assert written["provenance"]["machine"]["threads_arg"] == 1
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]
    with pytest.raises(TypeError):  # a result that cannot be written leaves the last one whole
        write_result(out, {"ratio": object()})
    assert json.loads(out.read_text()) == written and [p.name for p in out.parent.iterdir()] == ["r.json"]


def test_every_bench_script_writes_its_results_through_write_result():
    sources = {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "bench").rglob("*.py"))}
    sources.pop("bench/provenance.py")
    writes_json = re.compile(r"json\.dump\(|write_text\(json\.dumps|open\([^)]*['\"]w")
    own = [name for name, src in sources.items() if writes_json.search(src) and name not in NOT_RESULTS]
    assert own == [], "write result JSON with bench/provenance.py's write_result, which adds its provenance"
    names_results = [name for name, src in sources.items() if re.search(r"[\"/]results[\"/]", src)]
    assert len(names_results) >= 11
    assert [name for name in names_results if "write_result(" not in sources[name] and name not in READS_RESULTS] == []
    research = {name: src for name, src in sources.items() if name.startswith("bench/harness_research/")}
    assert [name for name, src in research.items() if 'tag="start"' in src] == ["bench/harness_research/rw.py"], \
        "a research run's start record goes through rw.log_start, which adds its provenance"


def test_a_result_of_a_lineage_goes_stale_by_its_code_not_by_the_serving_layer(repo: Path):
    from bench.provenance import changed_since

    (repo / "rsi/mol").mkdir()
    (repo / "rsi/mol/proxy.py").write_text("0\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "serving")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "rsi/mol/proxy.py").write_text("1\n")
    assert changed_since(first, "bench/x.py", repo, serving=False) == []
    assert changed_since(first, "bench/x.py", repo) == ["rsi/mol/proxy.py"]
    (repo / "rsi/core.py").write_text("1\n")
    assert changed_since(first, "bench/x.py", repo, serving=False) == ["rsi/core.py"]


def test_code_no_run_loads_leaves_every_result_current_but_one_that_names_it(repo: Path):
    from bench.provenance import OUTSIDE, changed_since

    (repo / OUTSIDE[0]).write_text("0\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "outside")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / OUTSIDE[0]).write_text("1\n")
    assert changed_since(first, "bench/x.py", repo) == []
    assert changed_since(first, "bench/x.py", repo, also=(OUTSIDE[0],)) == [OUTSIDE[0]]


def test_a_result_goes_stale_by_the_family_modules_its_runs_load(repo: Path):
    from bench.provenance import changed_since

    (repo / "task_generators").mkdir()
    for name in ("__init__", "addition", "programs"):
        (repo / f"task_generators/{name}.py").write_text("0\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "families")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "task_generators/programs.py").write_text("1\n")
    assert changed_since(first, "bench/x.py", repo, families=("addition",)) == []
    assert changed_since(first, "bench/x.py", repo) == ["task_generators/programs.py"]  # no families: every one
    assert changed_since(first, "bench/x.py", repo, families=("addition", "programs")) == [
        "task_generators/programs.py"]
    for name in ("addition", "__init__"):  # the family's own module, and what every family's import runs
        (repo / f"task_generators/{name}.py").write_text("1\n")
        assert f"task_generators/{name}.py" in changed_since(first, "bench/x.py", repo, families=("addition",))


def test_a_result_goes_stale_by_the_profiles_its_runs_use(repo: Path):
    from bench.provenance import PROFILES_FILE, changed_since

    profiles = repo / PROFILES_FILE
    profiles.parent.mkdir(parents=True, exist_ok=True)
    profiles.write_text('[a]\nsteps = 1\n\n[b]\nextends = "a"\nseed = 2\n\n[c]\nsteps = 3\n')
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "profiles")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    def stale(text: str, *names: str) -> bool:
        profiles.write_text(text)
        return changed_since(first, "bench/x.py", repo, profiles=names or None) == [PROFILES_FILE]

    other = '# a comment\n[a]\nsteps = 1\n\n[b]\nextends = "a"\nseed = 2\n\n[c]\nsteps = 4\n'
    assert not stale(other, "a", "b") and stale(other, "c") and stale(other)  # no profiles named: the whole file
    inherited = '[a]\nsteps = 5\n\n[b]\nextends = "a"\nseed = 2\n\n[c]\nsteps = 3\n'
    assert stale(inherited, "b") and not stale(inherited, "c")  # b extends a: a's change is b's
    assert stale('[a]\nsteps = 1\n\n[b]\nseed = 2\n\n[c]\nsteps = 3\n', "b")  # b no longer extends a
    assert stale("[a\n", "c")  # a file that does not parse counts as changed


def test_a_result_goes_stale_by_the_make_rules_it_runs(repo: Path):
    from bench.provenance import MAKEFILE, changed_since

    makefile = repo / MAKEFILE
    rules = "V ?= 1\n\n.PHONY: a\na: b\n\techo a\n\n# b's comment\nb:\n\techo b\n"
    makefile.write_text(rules)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "make")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    def stale(text: str, *targets: str) -> bool:
        makefile.write_text(text)
        return changed_since(first, "bench/x.py", repo, also=(MAKEFILE,), make_targets=targets or None) == [MAKEFILE]

    other = rules + "\n.PHONY: c\nc: X ?= 2\nc: a\n\techo $(X)\n"  # a rule of its own, with its variable
    assert not stale(other, "a") and stale(other, "c") and stale(other)  # no targets named: the whole file
    assert stale(rules.replace("echo b", "echo B"), "a", "b") and not stale(rules.replace("echo b", "echo B"), "a")
    assert stale(rules.replace("V ?= 1", "V ?= 2"), "a")  # a variable outside any rule counts for every one
    assert stale(rules.replace("\techo a", "\techo A"), "a")


# runs ``python -m rsi ARGS`` and writes, at exit, every module the process loaded (Python's import trace, -X
# importtime, misses modules loaded through importlib: the entry points plugins load, families among them)
LOADED = ("import atexit, runpy, sys\n"
          "out = sys.argv.pop(1)\n"
          "atexit.register(lambda: open(out, 'w').write('\\n'.join(sorted(sys.modules))))\n"
          "sys.argv[0] = 'rsi'\n"
          "runpy.run_module('rsi', run_name='__main__', alter_sys=True)\n")


@pytest.mark.slow
def test_a_lineage_run_and_its_evaluation_load_no_serving_layer_and_no_other_family(tiny_base, rsi_home, tmp_path):
    """What lets a lineage's result ignore changes to the serving layer (``bench.provenance.SERVING``), to code no
    run loads (``OUTSIDE``) and to the modules of families it does not run (``changed_since``'s ``families``):
    ``rsi run`` and ``rsi eval`` of an addition lineage load no module under the serving layer or outside, and of
    ``rsi.task_generators`` only the package and addition's module (the modules in ``sys.modules`` when each
    process exits)."""
    import os
    import sys

    from bench.provenance import OUTSIDE, SERVING

    from .test_cycle import seed_home

    seed_home(rsi_home, tiny_base)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"RSI_HOME": str(rsi_home)}
    serving = tuple(path.removesuffix(".py").replace("/", ".") for path in SERVING + OUTSIDE)
    for k, command in enumerate((["run", "addition", "--profile", "tiny", "--generations", "1"],
                                 ["eval", "--profile", "tiny", "--levels", "1-2", "--n", "8"])):
        out = tmp_path / f"modules-{k}.txt"
        done = subprocess.run([sys.executable, "-c", LOADED, str(out), *command], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        loaded = set(out.read_text().split())
        assert "rsi.evaluate" in loaded  # the list is there
        assert not [m for m in loaded if m.startswith(serving)], sorted(m for m in loaded if m.startswith(serving))
        families = sorted(m for m in loaded if m.startswith("rsi.task_generators"))
        assert families == ["rsi.task_generators", "rsi.task_generators.addition"], families
