"""A generation's Prefect artifacts: its accuracy table, gain decomposition, failure attribution, a markdown
summary, one passed episode turn by turn, a link to its MLflow model version, the lineage's improvement plot and
the pair's proposals."""

from __future__ import annotations

import base64
from collections.abc import Callable

from prefect.artifacts import create_image_artifact, create_link_artifact, create_markdown_artifact
from prefect.artifacts import create_progress_artifact
from prefect.artifacts import create_table_artifact, update_progress_artifact

from rsi.attribution import table as attribution_table
from rsi.lineage.record import improvement_plot, version_url
from rsi.models import Trajectory
from rsi.lineage import LineageRegistry
from rsi.run import GenerationSummary
from rsi.run.results import Proposed
from rsi.store.ledger import Ledger
from rsi.store.records import load_attribution, longest_passed


def progress(description: str, stages: int) -> Callable[[int, str], None]:
    """A progress artifact of the running flow, and the callback that moves it as stage ``i`` of ``stages`` ends."""
    artifact = create_progress_artifact(0.0, description=description)
    return lambda i, _: update_progress_artifact(artifact, 100.0 * i / stages)


def publish(summary: GenerationSummary, lineage: str, ledger: Ledger, registry: LineageRegistry) -> None:
    number = summary.generation
    key = f"{artifact_key(lineage)}-gen-{number}"
    table = [{"level": int(lvl), "parent": summary.parent[lvl], "candidate": summary.candidate[lvl]}
             for lvl in summary.candidate]
    table.append({"level": "gate", "parent": summary.gate, "candidate": f"p={summary.p_value:.3g}"})
    table.append({"level": "counts", "parent": f"tasks {summary.tasks}, trajectories {summary.trajectories}",
                  "candidate": f"passed {summary.passed}, selected {summary.selected}"})
    create_table_artifact(table, key=key, description=f"generation {number}: accuracy per level")
    if summary.gains.get("test"):
        create_table_artifact(summary.gains["test"], key=f"{key}-gains", description=(
            f"generation {number}: the candidate's gain over its parent on the test split, split into weights (new "
            "adapter, old harness), harness (old adapter, new harness) and their interaction, beside the base under "
            "the candidate's harness (no training anywhere); 95 % intervals"))
    generation_id = ledger.generation(number).id
    with ledger.store.session() as s:
        blame = load_attribution(s, generation_id)
        episode = longest_passed(s, generation_id)
    if blame:
        create_table_artifact(attribution_table(blame), key=f"{key}-attribution",
                              description=f"generation {number}: failed and unposed tasks by cause and owner "
                                          "(model, harness, task)")
    pass_at = ", ".join(f"level {lvl}: pass@1 {v['pass@1']:.2f} pass@k {v['pass@k']:.2f}"
                        for lvl, v in summary.pass_at.items() if v)
    create_markdown_artifact(
        f"## {lineage} generation {number}: **{summary.gate}**\n\n"
        f"- targets: levels {', '.join(summary.targets)} ({pass_at})\n"
        f"- tasks {summary.tasks}, trajectories {summary.trajectories}, passed audit {summary.passed}, "
        f"selected {summary.selected}\n- gate: {'; '.join(summary.reasons)}\n"
        f"- MLflow version {summary.version}\n", key=f"{key}-summary")
    if episode is not None:
        create_markdown_artifact(episode_markdown(episode), key=f"{key}-episode",
                                 description=f"generation {number}: one passed episode, turn by turn")
    create_link_artifact(version_url(registry, summary.version), key=f"{key}-version",
                         link_text=f"{registry.name} version {summary.version} ({summary.gate})",
                         description="the candidate's model version in the MLflow registry")
    publish_improvement(lineage, registry, number)


def publish_improvement(lineage: str, registry: LineageRegistry, number: int) -> None:
    """The lineage's improvement plot as its MLflow run holds it, as the image artifact ``<lineage>-improvement``
    (a new version of it each generation), inline (a data URL): the UI needs no route to MLflow's artifacts."""
    plot = improvement_plot(registry)
    if plot is not None:
        create_image_artifact(f"data:image/png;base64,{base64.b64encode(plot).decode()}",
                              key=f"{artifact_key(lineage)}-improvement",
                              description=f"{lineage}: accuracy per level of each generation's candidate, up to "
                                          f"generation {number} (the plot on the lineage's MLflow run)")


def artifact_key(lineage: str) -> str:
    """The lineage's name as Prefect allows a key (lowercase letters, digits and dashes)."""
    return lineage.replace("_", "-").replace(".", "-").lower()


def publish_proposals(lineage: str, number: int, proposed: Proposed | None) -> None:
    """A generation's proposals, accepted and rejected (with the rule that rejected them), as a table artifact;
    nothing where the generator drew the tasks, or outside a Prefect run (``bench/cycle.py``'s direct calls)."""
    from prefect.context import TaskRunContext

    if proposed is None or TaskRunContext.get() is None:
        return
    rows = [{"proposal": p.text, "verdict": p.rejected_by or "accepted", "detail": p.detail, "level": p.level}
            for p in proposed.proposals]
    key = f"{lineage}-gen-{number}-proposals".replace("_", "-").replace(".", "-").lower()
    create_table_artifact(rows, key=key, description=(
        f"generation {number}: {len(proposed.task_ids)} of {len(rows)} proposals accepted; rejected by rule: "
        f"{proposed.rejected_by_rule}"))


def episode_markdown(trajectory: Trajectory) -> str:
    """A trajectory's messages in order, each tool call with its result and the state hash after it."""
    records = {r.call_id: r for r in trajectory.tool_log}
    cell = lambda text: "`" + text.replace("|", "\\|").replace("`", "'").replace("\n", " ") + "`"  # noqa: E731
    lines = [f"### {trajectory.id} (task {trajectory.task_id}, sample {trajectory.sample_index})", "",
             "| # | role | content | tool call | state after |", "|---|---|---|---|---|"]
    for i, m in enumerate(trajectory.messages):
        call = "; ".join(f"{c.name}({c.arguments})" for c in m.tool_calls)
        state = records[m.tool_call_id].state_after if m.tool_call_id in records else ""
        lines.append(f"| {i} | {m.role} | {cell(m.content)} | {call} | {state} |")
    return "\n".join(lines) + "\n"
