"""The ``rsi`` command line. A user's mistake exits 2, a runtime failure 1, and neither shows a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from rsi.errors import RsiError

app = typer.Typer(
    help="Recursive self-improvement of model-harness pairs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Resolved settings (RSI_* environment variables).", no_args_is_help=True)
db_app = typer.Typer(help="The state DB schema (Alembic migrations, own version table).", no_args_is_help=True)
harness_app = typer.Typer(help="Harness versions (HCP documents).", no_args_is_help=True)
tasks_app = typer.Typer(help="Task families (plug-ins in the entry-point group rsi.task_generators).", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(db_app, name="db")
app.add_typer(harness_app, name="harness")
app.add_typer(tasks_app, name="tasks")

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


@config_app.command("show")
def config_show(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Print the settings in effect, passwords masked."""
    from rsi.config import get_settings

    values = get_settings().resolved()
    if as_json:
        print(json.dumps(values, indent=2))
        return
    table = Table("setting", "value", title="rsi settings")
    for key, value in values.items():
        table.add_row(key, value)
    out.print(table)


def _store(migrate: bool = False):
    from rsi.store import open_store

    return open_store(migrate=migrate)


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="target revision")) -> None:
    """Migrate the state DB up to REVISION (default: head)."""
    store = _store()
    store.upgrade(revision)
    out.print(f"state DB {store.engine.url!r} at revision {store.current()}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="target revision, or 'base' to drop every rsi table")) -> None:
    """Migrate the state DB down to REVISION."""
    store = _store()
    store.downgrade(revision)
    out.print(f"state DB {store.engine.url!r} at revision {store.current() or 'base'}")


@db_app.command("current")
def db_current() -> None:
    """Print the state DB's revision and the newest one this rsi knows."""
    store = _store()
    current, head = store.current(), store.head()
    state = "up to date" if current == head else "behind: run `rsi db upgrade`"
    out.print(f"current {current or 'base'}, head {head} ({state})")


@harness_app.command("validate")
def harness_validate(path: Path = typer.Argument(..., help="a hcp.toml or the directory that holds it")) -> None:
    """Validate an HCP document and its templates; exit 2 naming the file and field if it is invalid."""
    from rsi.hcp import load_harness

    harness = load_harness(path)
    doc = harness.document
    out.print(
        f"[green]valid[/green] {harness.path}: {harness.id} (hcp {doc.hcp_version}, contract {doc.contract.version}), "
        f"family {doc.family}, parser {doc.answer.parser}, {len(harness.sources)} template(s), "
        f"{len(doc.tools)} tool(s), hash {harness.hash[:16]}"
    )


@tasks_app.command("list")
def tasks_list() -> None:
    """List the installed task families."""
    from rsi.tasks import family_names, get_family

    for name in family_names():
        family = get_family(name)
        out.print(f"{name} (version {family.version}): {family.description}")


@tasks_app.command("sample")
def tasks_sample(
    family: str = typer.Argument(..., help="task family name"),
    level: int = typer.Option(..., "--level", min=1, help="difficulty level"),
    n: int = typer.Option(5, "-n", min=1, help="how many tasks"),
    seed: int = typer.Option(0, "--seed", help="seed of the task stream"),
) -> None:
    """Print tasks as JSON lines; the same (seed, level, index) always gives the same task."""
    from rsi.tasks import get_family

    for task in get_family(family).tasks(seed, level, n):
        print(json.dumps({"id": task.id, **task.model_dump(mode="json")}))


@app.command("audit")
def audit_cmd(
    file: Path = typer.Option(..., "--file", help="JSONL: one {trajectory, task, pair?} object per line"),
    harness_path: Path = typer.Option(..., "--harness", help="the harness version the trajectories claim"),
    store: bool = typer.Option(True, "--store/--no-store", help="persist tasks, trajectories and verdicts"),
) -> None:
    """Audit trajectories produced anywhere against a harness's contract and print a summary."""
    from collections import Counter

    from rsi.audit import audit_jsonl
    from rsi.hcp import load_harness

    harness = load_harness(harness_path)
    results, records = audit_jsonl(file, harness)
    verdicts = [r.verdict for r in results if r.verdict is not None]
    bad_lines = [r for r in results if r.error]
    table = Table("line", "trajectory", "verdict", "failed rules", title=f"audit of {file} under {harness.id}")
    for r in results:
        if r.verdict is None:
            table.add_row(str(r.line), "-", "[yellow]malformed[/yellow]", r.error)
        else:
            ok = "[green]pass[/green]" if r.verdict.passed else "[red]fail[/red]"
            table.add_row(str(r.line), r.verdict.trajectory_id, ok, ", ".join(r.verdict.failed_rules()))
    out.print(table)
    failures = Counter(rule for v in verdicts for rule in v.failed_rules())
    passed = sum(v.passed for v in verdicts)
    out.print(
        f"{len(verdicts)} audited: {passed} passed, {len(verdicts) - passed} failed; {len(bad_lines)} malformed line(s)"
        + (f"; failures by rule: {dict(failures)}" if failures else "")
    )
    if store and verdicts:
        from rsi.store import open_store
        from rsi.store.records import put_tasks, put_trajectories, put_verdicts

        with open_store().session() as session:
            put_tasks(session, [r.task for r in records])
            put_trajectories(session, [r.trajectory for r in records])
            stored = put_verdicts(session, verdicts)
        out.print(f"stored {stored} new verdict(s) under contract {harness.contract_version}")
    if bad_lines:
        raise typer.Exit(2)


def main() -> None:
    """Entry point of the ``rsi`` script."""
    try:
        app()
    except RsiError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
