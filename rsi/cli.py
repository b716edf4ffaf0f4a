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
app.add_typer(config_app, name="config")
app.add_typer(db_app, name="db")
app.add_typer(harness_app, name="harness")

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


def main() -> None:
    """Entry point of the ``rsi`` script."""
    try:
        app()
    except RsiError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
