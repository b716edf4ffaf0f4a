"""The CLI as a person uses it: real subprocesses, exit codes 0 / 1 / 2, no tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO


def rsi(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rsi", *args], capture_output=True, text=True, cwd=REPO,
        env={**os.environ, **(env or {})}, timeout=120,
    )


def test_help_lists_commands() -> None:
    result = rsi("--help")
    assert result.returncode == 0
    for command in ("config", "db", "harness"):
        assert command in result.stdout


def test_config_show_json(rsi_home: Path) -> None:
    env = {"RSI_DATABASE_URL": "postgresql://alice:s3cret@db.example:5432/rsi"}
    result = rsi("config", "show", "--json", env=env)
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout)
    assert set(values) == {"home", "database_url", "mlflow_tracking_uri", "prefect_home", "prefect_api_url",
                           "engine_url", "engine_api_key"}
    assert values["home"] == str(rsi_home)
    assert values["database_url"] == "postgresql+psycopg://alice:***@db.example:5432/rsi"
    assert values["mlflow_tracking_uri"] == f"sqlite:///{rsi_home / 'mlflow.db'}"
    assert values["prefect_home"] == str(rsi_home / "prefect")
    table = rsi("config", "show", env=env)
    assert table.returncode == 0 and "s3cret" not in table.stdout and "alice" in table.stdout


def test_prefect_api_comes_from_rsi_env_or_the_active_profile_and_leaves_prefect_home_alone(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('active = "server"\n[profiles.server]\nPREFECT_API_URL = "http://127.0.0.1:4200/api"\n'
                        '[profiles.cloud]\nPREFECT_API_URL = "https://api.prefect.cloud/api/accounts/a/workspaces/w"\n'
                        '[profiles.ephemeral]\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    code = ("import os, json; from rsi.config import get_settings; s = get_settings(); import rsi.flows.cycle; "
            "print(json.dumps([s.resolved()['prefect_api_url'], os.environ.get('PREFECT_HOME'), "
            "os.environ.get('PREFECT_API_URL')]))")

    def seen(**env: str) -> list:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                                env={**clean, "PREFECT_PROFILES_PATH": str(profiles), **env}, timeout=120)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.splitlines()[-1])

    server, cloud = "http://127.0.0.1:4200/api", "https://api.prefect.cloud/api/accounts/a/workspaces/w"
    assert seen() == [server, None, server]  # the profiles file's active profile
    assert seen(PREFECT_PROFILE="cloud") == [cloud, None, cloud]
    assert seen(PREFECT_API_URL="http://h:1/api") == ["http://h:1/api", None, "http://h:1/api"]
    assert seen(RSI_PREFECT_API_URL="http://r:2/api", PREFECT_API_URL="http://h:1/api")[0] == "http://r:2/api"
    ephemeral = seen(PREFECT_PROFILE="ephemeral")
    assert ephemeral[0].startswith("ephemeral") and ephemeral[1] == str(Path(os.environ["RSI_HOME"]) / "prefect")


def test_config_defaults(rsi_home: Path) -> None:
    values = json.loads(rsi("config", "show", "--json").stdout)
    assert values["database_url"] == f"sqlite:///{rsi_home / 'rsi.db'}"


def test_db_commands(db_url: str) -> None:
    env = {"RSI_DATABASE_URL": db_url}
    up = rsi("db", "upgrade", env=env)
    assert up.returncode == 0, up.stderr
    newest = max(p.name[:4] for p in (REPO / "migrations" / "versions").glob("[0-9]*.py"))  # the last migration
    assert f"at revision {newest}" in up.stdout
    assert "up to date" in rsi("db", "current", env=env).stdout
    down = rsi("db", "downgrade", "base", env=env)
    assert down.returncode == 0 and "at revision base" in down.stdout, down.stderr
    assert "behind" in rsi("db", "current", env=env).stdout
    assert rsi("db", "upgrade", env=env).returncode == 0


def test_db_bad_input_and_unreachable_server() -> None:
    bad = rsi("db", "current", env={"RSI_DATABASE_URL": "notadb://x"})
    assert bad.returncode == 2 and "RSI_DATABASE_URL" in bad.stderr and "Traceback" not in bad.stderr
    down = rsi("db", "current", env={"RSI_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"})
    assert down.returncode == 1 and "cannot connect" in down.stderr and "Traceback" not in down.stderr
    rev = rsi("db", "downgrade", "nope")
    assert rev.returncode == 2 and "nope" in rev.stderr and "Traceback" not in rev.stderr


def test_harness_validate_exit_codes(tmp_path: Path) -> None:
    good = rsi("harness", "validate", "harness_versions/addition/v2")
    assert good.returncode == 0 and "valid" in good.stdout and "addition/v2" in good.stdout

    unknown = tmp_path / "unknown"
    shutil.copytree(REPO / "harness_versions/addition/v2", unknown)
    toml = unknown / "hcp.toml"
    toml.write_text(toml.read_text().replace("[limits]", "[limits]\nmax_stepz = 3"))
    result = rsi("harness", "validate", str(unknown))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(toml) in result.stderr and "limits.max_stepz" in result.stderr

    undefined = tmp_path / "undefined"
    shutil.copytree(REPO / "harness_versions/addition/v1", undefined)
    (undefined / "templates/prompt.j2").write_text("{{ task.a }}+{{ second }}=\n")
    result = rsi("harness", "validate", str(undefined / "hcp.toml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "prompt.j2" in result.stderr and "prompt.template" in result.stderr and "'second'" in result.stderr
    assert "[prompt.vars]" in result.stderr  # messages are printed as text, not as console markup


def test_bad_cli_arguments_exit_2() -> None:
    assert rsi("harness", "validate").returncode == 2
    assert rsi("no-such-command").returncode == 2


@pytest.mark.parametrize("module", ["rsi", "rsi.cli", "rsi.hcp", "rsi.store", "rsi.models"])
def test_import_is_light(module: str) -> None:
    """Importing rsi (or listing its plug-ins) must not pull in torch, transformers or mlflow."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers', 'mlflow', 'prefect', 'vllm') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    heavy = [line for line in result.stderr.splitlines() if line.rstrip().split("|")[-1].strip().split(".")[0] in ("torch", "transformers", "mlflow")]
    assert heavy == []
