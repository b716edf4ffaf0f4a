"""The README's measured numbers, written from the result JSONs of ``bench/results``.

Every number the README reports from a measurement lives between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->``, and this script writes that block from ``bench/results/NAME.json``. A result is
shown only when it is current: its JSON records the commit it was made on, the tree was clean then, and none of
the code it measures (``rsi/``, ``flows/``, ``task_generators/`` and its bench script; the serving layer
``rsi/mol`` only for the serving results, ``SERVES``) has changed since.
Otherwise the block says why it is not shown and the command that measures it again.
``tests/test_readme_results.py`` fails when the README differs from what this writes, when a block shows
numbers of a result that is not current, and when a measured-looking number stands outside the blocks.

    .venv/bin/python bench/readme.py            # rewrite the blocks in README.md
    .venv/bin/python bench/readme.py --check    # exit 1 (naming the blocks) where README.md differs
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import changed_since  # noqa: E402 (after the path it needs)

BLOCK = re.compile(r"<!-- results:(?P<name>[a-z0-9_-]+) -->\n(?P<body>.*?)<!-- /results:(?P=name) -->", re.S)


def interval(iv: dict[str, Any], signed: bool = False) -> str:
    mean = f"{iv['mean']:+.3f}" if signed else f"{iv['mean']:.3f}"
    if iv.get("low") is None:
        return f"{mean} (one cell: no interval)"
    low, high = (f"{iv['low']:+.3f}", f"{iv['high']:+.3f}") if signed else (f"{iv['low']:.3f}", f"{iv['high']:.3f}")
    return f"{mean} [{low}, {high}]"


def ablation(result: dict[str, Any]) -> str:
    """The arms' test accuracy (mean over levels and per level), CPU-seconds, and the claimed differences."""
    s = result["summary"]
    arms, levels = s["arms"], s["levels"]
    cells = len(result["cells"])
    shared = result["shared_overrides"]
    lines = [f"`{result['command']}` ({result['profile']} profile, {shared.get('generations')} generations per "
             f"loop arm; base seeds {result['base_seeds']} x lineage seeds {result['lineage_seeds']} = {cells} cells; "
             f"greedy on the **test** split, levels {levels[0]}-{levels[-1]}, n = "
             f"{max(v['n'] for v in result['cells'][0]['arms']['full']['test']['levels'].values())} a level "
             "(fewer where the split holds fewer); "
             f"{result['interval']}):", "",
             "| arm | differs from full in | test accuracy, mean over levels | loop CPU-s per cell | test CPU-s |",
             "|---|---|---|---|---|"]
    for arm in arms:
        diff = result["cells"][0]["arms"][arm]["config_diff"]
        named = ", ".join(f"`{k}` {v[1]}" for k, v in diff.items()) or "nothing"
        cpu = s["cpu_s_per_cell"][arm]
        lines.append(f"| {arm} | {named} | {interval(s['mean_over_levels'][arm])} | {cpu['loop_cpu_s']:.0f} | "
                     f"{cpu['test_cpu_s']:.0f} |")
    skipped = {a: why for c in result["cells"] for a, why in c["skipped"].items()}
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{a} ({why})" for a, why in skipped.items()) + "."]
    lines += ["", "| level | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for lvl in levels:
        lines.append(f"| {lvl} | " + " | ".join(f"{s['per_level'][a][str(lvl)]['mean']:.3f}" for a in arms) + " |")
    best = s["best_single_component"]
    claim = s["differences"][f"full - {best}"]
    zero = claim["low"] <= 0 <= claim["high"] if claim["low"] is not None else abs(claim["mean"]) < 0.0005
    if best in ("weights", "harness", "base+harness"):
        lines += ["", f"**full minus the best single-component arm ({best}): {interval(claim, signed=True)}**"
                  + (" — zero: on this evidence the loop's combination of weights and harness adds nothing over "
                     f"{best} alone." if zero else ".")]
    else:  # no harness search: full changes the weights only, and its reference is the untrained pair
        lines += ["", f"**full minus {best} (no single-component arm ran: without a harness search `full` trains "
                  f"weights only): {interval(claim, signed=True)}**"
                  + (" — zero: on this evidence the trained pair is not told apart from the untrained one."
                     if zero else ".")]
    others = [f"full - {a}: {interval(iv, signed=True)}" for name, iv in s["differences"].items()
              if name != f"full - {best}" for a in [name.removeprefix("full - ")] if name.startswith("full - ")]
    lines.append("Also: " + "; ".join(others) + f"; upper_bound - full: "
                 f"{interval(s['differences']['upper_bound - full'], signed=True)}.")
    shares = [f"{arm} {c['arms'][arm]['test']['plan_calls_in_train_split']:.2f} "
              f"(b{c['base_seed']} s{c['lineage_seed']})"
              for c in result["cells"] for arm in arms if c["arms"][arm]["test"].get("plan_calls_in_train_split")]
    if shares:
        lines.append("Final pairs with a plan harness, share of their test-task calls whose problem lies in the "
                     "train split: " + ", ".join(shares) + ".")
    return "\n".join(lines) + "\n"


def demo(result: dict[str, Any]) -> str:
    """The demo's run: wall time, each generation's line, the final four-column test table."""
    lines = [f"`{result['command']}` on a fresh clone ({result['machine']}): {result['wall']} wall, rc "
             f"{result['rc']}; the log is `bench/results/demo-addition.log`.", ""]
    lines += [f"- {g}" for g in result["generations"]]
    lines += ["", "The last table, test split, mean over levels " + result["levels"] + ":", "",
              "| pair | mean accuracy |", "|---|---|"]
    lines += [f"| {name} | {acc:.3f} |" for name, acc in result["final"].items()]
    gains = result["gains"]
    lines += ["", "Per level, the harness's gain (the base under the champion's harness minus under the starting one) "
              "and the weights' gain (the champion minus the base under the champion's harness):", "",
              "| level | " + " | ".join(gains) + " |", "|---" * (len(gains) + 1) + "|",
              "| harness | " + " | ".join(f"{g['harness']:+.2f}" for g in gains.values()) + " |",
              "| weights | " + " | ".join(f"{g['weights']:+.2f}" for g in gains.values()) + " |"]
    if result.get("archive"):
        lines += ["", "The candidate harnesses its searches drew from the champion's failures, each under the harness "
                  "it was drawn from (`rsi harness archive addition` after the demo):", "", "```", *result["archive"],
                  "```"]
    return "\n".join(lines) + "\n"


def harness_repair(result: dict[str, Any]) -> str:
    """Per fault: the validator's verdict, the drop it causes, the repair (edits, gates, CPU-s) and whether it
    counts as repaired; then the tallies of the issue's faults and of the unseen ones."""
    c = result["criteria"]
    lines = [f"`{result['command']}` (greedy, **test** split; a fault counts where it lowers some level by at least "
             f"{c['drop']}; repaired: adopted, every level within {c['within']} of the working harness, tokens per "
             f"task within {c['tokens_ratio']}x, 0 training steps):", "",
             "| fault | field = value | refused by the validator | max drop | adopted edits | full gates | CPU-s | "
             "accuracy, repaired vs working (mean) | tokens/task, repaired vs working | repaired |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("form"):
            lines.append(f"| {r['fault']} | `{r['harness']}` `{r['field']}` = `{_cell(r['value'])}` | for its form "
                         "(not run) | - | - | - | - | - | - | no |")
            continue
        edits = "; ".join(f"{step['operator']}: " + ", ".join(_change(k, v) for k, v in step["changed"].items())
                          for step in r["steps"]) or "none"
        after, working = r.get("repaired_scores"), r["working"]
        acc = f"{_mean(after['accuracy']):.3f} vs {_mean(working['accuracy']):.3f}" if after else "-"
        tokens = f"{after['tokens_per_task']:.1f} vs {working['tokens_per_task']:.1f}" if after else "-"
        lines.append(f"| {r['fault']} | `{r['harness']}` `{r['field']}` = `{_cell(r['value'])}` | "
                     f"{'yes' if r['refused'] else 'no'} | {r['max_drop']:.2f} | {edits} | {r['gates']} | "
                     f"{r['cpu_s']:.0f} | {acc} | {tokens} | {'**yes**' if r['repaired'] else 'no'} |")
    for name, t in result["summary"].items():
        which = {"issue": "the issue's eight faults (1-8)", "unseen": "the faults beyond the issue's list that no "
                 "operator was written or extended for", "developed_on": "the faults beyond the list that an "
                 "operator was extended for after it failed here"}[name]
        skipped = [f"{n['fault']} (refused for its form)" if n["form"] else f"{n['fault']} (drop {n['max_drop']:.2f})"
                   for n in t["not_counted"]]
        lines += ["", f"Of {which}: **{t['repaired']} of {t['counted']} that count repaired**"
                  + (f"; not counted: {', '.join(skipped)}" if skipped else "") + "."]
    return "\n".join(lines) + "\n"


def selfplay(result: dict[str, Any]) -> str:
    """Per arm: what its config changes, test accuracy at the CPU budget, executed level growth and rejections;
    the claimed differences; then each lineage's generations."""
    s = result["summary"]
    built = (f"one base built in {result['base_cpu_s']:.0f} CPU-s" if result["base_cpu_s"] >= 60 else
             "one base, found cached (its build not counted here)")
    lines = [f"`{result['command']}` ({result['profile']} profile; lineage seeds {result['seeds']}, {built}; "
             "each arm's loop stops at the first generation ending past "
             f"{result['budget_cpu_s']:.0f} CPU-s of its process tree, and the champion counted is the last whose "
             f"generation ended within it; greedy on one fixed **test** suite, levels {result['levels'][0]}-"
             f"{result['levels'][-1]}, n = {result['eval_n']} a level; {result['interval']}). The untrained base "
             f"scores {interval(s['base'])}.", "",
             "| arm | differs from self in | test accuracy at the budget, mean over levels | "
             "executed level growth (first generation to last) | proposals rejected, by rule |",
             "|---|---|---|---|---|"]
    for arm in s["arms"]:
        diff = next(c for c in result["cells"] if c["arm"] == arm)["config_diff"]
        named = ", ".join(f"`{k}` {v[1]}" for k, v in diff.items()) or "nothing"
        rejected = ", ".join(f"{rule} {n}" for rule, n in sorted(s["rejected_by_rule"].get(arm, {}).items())) or "-"
        lines.append(f"| {arm} | {named} | {interval(s['at_budget'][arm])} | "
                     f"{interval(s['executed_level_growth'][arm], signed=True)} | {rejected} |")
    lines += [""] + [f"- **{name}**, paired by seed: {interval(iv, signed=True)}"
                     for name, iv in s["differences"].items()]
    lines += ["", "Each lineage, generation by generation: test mean over levels (mean level of the tasks it executed "
              "at the curriculum's levels), loop CPU-s at the generation's end; the gate's verdict or why it stopped:",
              ""]
    for c in result["cells"]:
        steps = [f"{_mean(g['test']):.3f}" + (f" ({g['executed']['mean_level']:.2f})"
                                             if g.get("executed", {}).get("mean_level") is not None else "")
                 + (f" at {g['loop_cpu_s']:.0f} s, {g.get('gate') or g.get('stopped')}" if g["generation"] else "")
                 + (f"; `rsi run` stops here: {g['done']}" if g.get("done") else "")
                 for g in c["generations"]]
        lines.append(f"- {c['arm']} seed {c['seed']}: " + " → ".join(steps))
    return "\n".join(lines) + "\n"


def traffic(result: dict[str, Any]) -> str:
    """A person's session in plain words: right answers per family (seen and held-out templates), chit-chat kept
    off the specialists, and the base swapped in against its direct evaluation."""
    s, swapped = result["summary"], result["base_swapped"]
    held = sum(t["held_out"] for ts in result["templates"].values() for t in ts)
    templates = sum(len(ts) for ts in result["templates"].values())
    specialists = ", ".join(f"{n} (lineage {v['lineage']}, generation {v['generation']}, harness {v['harness']})"
                            for n, v in result["specialists"].items())
    lines = [f"`{result['command']}`: {sum(s[k]['n'] for k in ('addition', 'sorting', 'chat'))} turns through the "
             f"`openai` client, model `rsi/auto`, on {specialists}; {templates} templates, {held} of them held out of "
             "the reader's tests; tasks from the **test** split. A task is right when the reply says the right "
             "answer in the view's words (a refusal is wrong).", "",
             "| asked | turns | right | on seen templates | on held-out templates | on fresh held-out ones | not "
             "read by a view |", "|---|---|---|---|---|---|---|"]
    for family in ("addition", "sorting"):
        f = s[family]
        fresh = f.get("fresh") or {}
        on_fresh = f"{fresh['right']:.3f} (n {fresh['n']})" if fresh.get("n") else "none asked"
        lines.append(f"| {family} | {f['n']} | {f['right']:.3f} | {f['seen']['right']:.3f} | "
                     f"{f['held_out']['right']:.3f} | {on_fresh} | {f['refused']} |")
    lines += [f"| chit-chat | {s['chat']['n']} | kept off the specialists: {s['chat']['right']:.3f} "
              f"({s['chat']['to_specialist']} reached one) | | | | |", "",
              *[f"{family.capitalize()} per level: " + ", ".join(f"L{lvl} {v['right']:.3f} (n {v['n']})"
                                                                 for lvl, v in s[family]["per_level"].items()) + "."
                for family in ("addition", "sorting")], "",
              f"With the bare base swapped in for every adapter, **{swapped['agree']} of {swapped['read']}** task "
              "turns the views read were told, word for word, what the base answers when run directly under the same "
              f"harness (right: {swapped['proxy_right']} through the proxy, {swapped['direct_right']} directly)."]
    return "\n".join(lines) + "\n"


def traffic_generation(result: dict[str, Any]) -> str:
    """One generation on served turns only against an ordinary generation of equal steps from the same parent:
    test-split accuracy per level, the lowest unmastered level marked, and what forged turns gave."""
    acc, lowest, arms, session = result["test_accuracy"], result["lowest_unmastered"], result["arms"], result["session"]
    lines = [f"`{result['command']}`: the parent is generation {result['parent']['generation']} of the sorting "
             f"lineage (harness {result['parent']['harness']}); {session['turns']} plain-words turns on train-split "
             f"lists ({session['right']} answered right), {session['forged']} forged turns (claimed answers and "
             f"tool results in the client's history; {session['forged_refused']} more refused by the proxy) and "
             f"{session['tampered']} stored records edited afterwards. Test split, greedy, {result['n']} tasks a "
             "level.",
             "", "| level | parent | traffic-fed generation | ordinary generation |", "|---|---|---|---|"]
    for lvl, parent in acc["parent"].items():
        mark = " (lowest unmastered)" if str(lvl) == str(lowest) else ""
        lines.append(f"| {lvl}{mark} | {parent:.3f} | {acc['traffic'][lvl]:.3f} | {acc['ordinary'][lvl]:.3f} |")
    at = lambda a: a.get("examples_per_level", {}).get("frontier", {}).get(str(lowest), 0)  # noqa: E731
    lines += ["", *[f"{arm.capitalize()}: gate {a['status']}, {a['examples']} training examples ({at(a)} at "
                    f"L{lowest}), {a['steps']} steps." for arm, a in arms.items()],
              f"Gain at the lowest unmastered level (L{lowest}, the first under the profile's mastery "
              f"{result['mastery']} on the test split): traffic-fed "
              f"{result['gain']['traffic'][str(lowest)]:+.3f}, ordinary {result['gain']['ordinary'][str(lowest)]:+.3f};"
              f" worst change at another level: traffic-fed {result['worst_other_drop']['traffic']:+.3f}, ordinary "
              f"{result['worst_other_drop']['ordinary']:+.3f}. Training examples from forged or edited turns: "
              f"**{result['examples_from_forged_or_tampered']}**."]
    return "\n".join(lines) + "\n"


def serve_session(result: dict[str, Any]) -> str:
    """Each specialist's test tasks asked through ``rsi serve``: routed right, solved through the proxy and solved
    directly, per level; then the stream, wrong-key and restart checks."""
    specs = result["specialists"]
    one_base = len({s["base"] for s in specs.values()}) == 1
    lines = [f"`{result['command']}`: " + "; ".join(
                 f"{name}, lineage {s['lineage']} generation {s['generation']} under {s['harness']}"
                 for name, s in specs.items()) + (" (one base)." if one_base else "."), "",
             "| specialist | level | n | routed right | solved through the proxy | solved directly |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['specialist']} | {r['level']} | {r['n']} | {r['routed']:.3f} | {r['solved_proxy']:.3f} | "
              f"{r['solved_direct']:.3f} |" for r in result["per_level"]]
    checks, yes = result["checks"], lambda b: "yes" if b else "no"  # noqa: E731
    lines += ["", f"Streamed, the same text as the plain reply: {yes(checks['stream']['same_text'])}; a wrong key: "
              f"HTTP {checks['wrong_key']['status']}; a tool episode (level {checks['restart']['level']}) restarted "
              f"on a new proxy: routed to {checks['restart']['routed']}, solved {yes(checks['restart']['solved'])} "
              f"(directly: {yes(checks['restart']['direct'])})."]
    return "\n".join(lines) + "\n"


def train(result: dict[str, Any]) -> str:
    """The loop and TRL on the same verified samples: speed, losses and held-out accuracy beside the base's."""
    data, levels = result["data"], [str(level) for level in result["levels"]]
    lines = [f"`{result['profile']}` generation 1's data: {data['examples']} examples ({data['frontier']} frontier at "
             f"levels {data['frontier_levels']}, {data['replay']} replay at {data['replay_levels']}) from "
             f"{data['samples']} samples of the base, {data['passed']} passed the audit; {result['spec']['steps']} "
             f"steps of batch {result['spec']['batch_size']}, best of {result['repeat']} runs an arm; held-out greedy "
             f"accuracy, {result['eval_n']} tasks a level.", "",
             "| trainer | wall s | tokens/s | CPU s | first loss | final loss | "
             + " | ".join(f"L{level}" for level in levels) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(levels),
             "| base (no training) | | | | | | " + " | ".join(f"{data['base'][level]:.3f}" for level in levels) + " |"]
    for name, arm in result["arms"].items():
        accuracy = " | ".join(f"{arm['heldout'][level]:.3f}" for level in levels)
        lines.append(f"| {name} | {arm['wall_s']:.1f} | {arm['tokens_per_s']:.0f} | {arm['cpu_s']:.1f} | "
                     f"{arm['first_loss']:.4f} | {arm['final_loss']:.4f} | {accuracy} |")
    ratio = result["trl_over_loop"]
    lines += ["", f"TRL / loop: tokens/s {ratio['tokens_per_s']:.3f}, wall {ratio['wall_s']:.3f}."]
    return "\n".join(lines) + "\n"


def shards(result: dict[str, Any]) -> str:
    """Execute, audit and evaluation of one generation: the local runner against Ray at 1..N shards."""
    lines = [f"`{result['profile']}` generation 1: {result['tasks']} tasks x {result['samples']} samples, evaluation "
             f"of {len(result['eval_levels'])} levels x {result['eval_n']}; fastest of {result['repeat']} passes an "
             f"arm, {result['cpus']} CPUs, Ray {result['ray']} (start {result['ray_start_s']:.1f} s and worker warm-up "
             f"{result['warm_up_s']:.1f} s not counted).", "",
             "| arm | execute s | audit s | evaluate s | total s | / local | outputs = local |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['arm']} | {row['execute']:.2f} | {row['audit']:.2f} | {row['evaluate']:.2f} | "
                     f"{row['total']:.2f} | {row['ratio']:.2f} | {'yes' if row['identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def episodes(result: dict[str, Any]) -> str:
    """Sorting episodes per second per engine, and the hf backend against ``model.generate``."""
    single = result["single_turn"]
    lines = [f"{result['tasks_per_level']} test tasks at each of levels {result['levels']}, greedy episodes.", "",
             "| engine | episodes | turns | seconds | episodes/s | turns/s | solved | / hf | audit ms/episode |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in result["episodes"]:
        lines.append(f"| {e['engine']} | {e['episodes']} | {e['turns']} | {e['seconds']:.2f} | "
                     f"{e['episodes_per_s']:.1f} | {e['turns_per_s']:.1f} | {e['solved']} | {e['over_hf']:.2f} | "
                     f"{e['audit_ms_per_episode']:.2f} |")
    lines += ["", f"One batch of {single['prompts']} single-turn prompts: the hf backend "
              f"{single['backend']['tokens_per_s']:.0f} tokens/s, `model.generate` "
              f"{single['generate']['tokens_per_s']:.0f} (backend / generate {single['backend_over_generate']:.2f}x; "
              f"{single['same_text']}/{single['prompts']} identical texts)."]
    return "\n".join(lines) + "\n"


def generation(result: dict[str, Any]) -> str:
    """New tokens per second of each engine, batched and one prompt at a time."""
    lines = [f"Model `{Path(result['model']).name}`, greedy, {result['params']['max_new_tokens']} new tokens at most.",
             "", "| engine | mode | prompts | new tokens | seconds | tokens/s |", "|---|---|---|---|---|---|"]
    for arm in result["arms"]:
        lines.append(f"| {arm['engine']} | {arm['mode']} | {arm['prompts']} | {arm['new_tokens']} | "
                     f"{arm['seconds']:.2f} | {arm['tokens_per_s']:.0f} |")
    lines += ["", "Batched / one at a time: " + ", ".join(
        f"{engine} {ratio:.1f}x" for engine, ratio in result["batched_over_sequential"].items()) + "; batched over hf: "
        + (", ".join(f"{engine} {ratio:.2f}x" for engine, ratio in result["batched_over_hf"].items()) or "-") + "."]
    return "\n".join(lines) + "\n"


def parity(result: dict[str, Any]) -> str:
    """Greedy completions of the vLLM server against the hf backend's, per arm."""
    lines = [f"Model `{Path(result['model']).name}`; vLLM's engine loaded in {result['engine_load_s']:.1f} s.", "",
             "| arm | identical completions | of | identical token counts |", "|---|---|---|---|"]
    for arm in ("base", "adapter"):
        if isinstance(result.get(arm), dict):
            r = result[arm]
            lines.append(f"| {arm} | {r['equal']} | {r['n']} | {r['counts_equal']} |")
    return "\n".join(lines) + "\n"


def cycle(result: dict[str, Any]) -> str:
    """Seconds per stage of one generation as the Prefect flow and as direct calls."""
    flow, direct = result["flow"], result["direct"]
    lines = [f"`{result['profile']}` generation 1, fastest of {result['repeat']} runs an arm, {result['cpus']} CPUs.",
             "", "| stage | flow s | direct s | flow / direct |", "|---|---|---|---|"]
    for stage, seconds in flow["stages"].items():
        lines.append(f"| {stage} | {seconds:.2f} | {direct['stages'][stage]:.2f} | "
                     f"{seconds / direct['stages'][stage]:.2f} |")
    lines += [f"| total | {flow['total']:.2f} | {direct['total']:.2f} | {result['overhead_ratio']:.3f} |", "",
              f"The flow's wall time with the Prefect API's start-up: {result['flow_wall_with_startup']:.1f} s."]
    return "\n".join(lines) + "\n"


def smollm2(result: dict[str, Any]) -> str:
    """One generation on SmolLM2-135M-Instruct: test-split accuracy per level before and after, paired."""
    gen, seconds = result["generation"], result["seconds"]
    lines = [f"Base `{result['base']}` under `{result['harness']}`, {result['split']} split, {result['decoding']}, "
             f"up to {result['n_per_level']} tasks a level (the same tasks before and after).", "",
             "| level | n | before | after |", "|---|---|---|---|"]
    for level, row in result["levels"].items():
        lines.append(f"| {level} | {row['n']} | {row['before']:.3f} ({row['before_correct']}) | "
                     f"{row['after']:.3f} ({row['after_correct']}) |")
    gate = "promoted" if gen["promoted"] else "rejected"
    lines += ["", f"Generation 1: {gen['trained_examples']} examples, {gen['steps']} steps (loss "
              f"{gen['first_loss']:.4f} -> {gen['final_loss']:.4f}, {gen['train_s']:.0f} s), gate {gate}; the "
              f"generation took {seconds['run_generation']:.0f} s, the evaluation before and after "
              f"{seconds['evaluate_before_and_after']:.0f} s."]
    return "\n".join(lines) + "\n"


def programs_base(result: dict[str, Any]) -> str:
    """The programs base built three ways: test accuracy per level and the build's CPU-seconds."""
    levels = result["levels"]
    lines = [f"Test split, greedy, {result['n']} tasks a level (the selfplay suite).", "",
             "| base | build CPU-s | " + " | ".join(f"L{lv}" for lv in levels) + " | mean |",
             "|---|---|" + "---|" * (len(levels) + 1)]
    for arm in result["arms"]:
        what = f"`{arm['harness']}`" + (f", padded 0-{arm['rewrites']} no-op pairs" if arm["rewrites"] else "")
        lines.append(f"| {what} | {arm['build_cpu_s']:.0f} | " +
                     " | ".join(f"{arm['test'][str(lv)]:.2f}" for lv in levels) + f" | {arm['mean']:.3f} |")
    return "\n".join(lines) + "\n"


def serve(result: dict[str, Any]) -> str:
    """Latency through the proxy against the engine alone, per client count; the harvest beside it."""
    spec = result["specialist"]
    lines = [f"Specialist `{spec['name']}` (generation {spec['generation']}, harness `{spec['harness']}`), addition "
             f"questions of level {result['level']} through `rsi/auto`, greedy; each client {result['per_client']} "
             f"requests a round, the arms taking turns, at least {result['rounds']} rounds.", "",
             "| engine | clients | arm | requests | errors | p50 ms | p99 ms | req/s |",
             "|---|---|---|---|---|---|---|---|"]
    for a in result["arms"]:
        lines.append(f"| {a['engine']} | {a['clients']} | {a['arm']} | {a['requests']} | {a['errors']} | "
                     f"{a['p50_ms']:.1f} | {a['p99_ms']:.1f} | {a['requests_per_s']:.1f} |")
    lines += ["", "| engine | clients | arm | over | p50 | p50 paired | p99 | req/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["proxy_over"]:
        lines.append(f"| {r['engine']} | {r['clients']} | {r.get('arm', 'proxy')} | {r['baseline']} | {r['p50']:.2f}x "
                     f"| {r['p50_paired']:.2f}x | {r['p99']:.2f}x | {r['requests_per_s']:.2f}x |")
    for engine, h in (result.get("harvester") or {}).items():
        if h:
            lines += ["", f"The harvester ({engine}): {h['passes']} passes over the stored turns, {h['turns_read']:,} "
                      f"turns read, in its {h['seconds_running']:.0f} s running (during `proxy-harvest` only)."]
    return "\n".join(lines) + "\n"


def _change(field: str, before_after: list[Any]) -> str:
    if field.startswith("templates/"):
        return f"`{field}` `{_cell(before_after[0])}` → `{_cell(before_after[1])}`"
    return f"`{field}` {_cell(before_after[0])} → {_cell(before_after[1])}"


def _cell(value: Any) -> str:
    """A value as a table cell shows it: JSON (a template's text as it is), a pipe escaped (it would end the cell)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", "\\n")


def _mean(accuracy: dict[str, float]) -> float:
    return sum(accuracy.values()) / len(accuracy)


# block name -> (its bench script, how its numbers are written; None: no renderer yet, the block shows status)
RESULTS: dict[str, tuple[str, Callable[[dict[str, Any]], str] | None]] = {
    "demo-addition": ("bench/demo.py", demo),
    "ablation-addition": ("bench/ablation.py", ablation),
    "ablation-sorting": ("bench/ablation.py", ablation),
    "harness_repair": ("bench/harness_repair.py", harness_repair),
    "selfplay": ("bench/selfplay.py", selfplay),
    "programs-base": ("bench/programs_base.py", programs_base),
    "train": ("bench/train.py", train),
    "shards": ("bench/shards.py", shards),
    "episodes": ("bench/episodes.py", episodes),
    "generation": ("bench/generation.py", generation),
    "parity": ("bench/parity.py", parity),
    "cycle": ("bench/cycle.py", cycle),
    "smollm2": ("bench/smollm2.py", smollm2),
    "serve": ("bench/serve.py", serve),
    "serve-session": ("bench/serve_session.py", serve_session),
    "serve-session-joint": ("bench/serve_session.py", serve_session),
    "traffic": ("bench/traffic.py", traffic),
    "traffic-smollm2": ("bench/traffic.py", traffic),
    "traffic_generation": ("bench/traffic_generation.py", traffic_generation),
}
# what else a result depends on: make demo's recipe; the SmolLM2 sorting lineage's start adapter (rsi.starts) and
# the make target that builds both SmolLM2 lineages
ALSO: dict[str, tuple[str, ...]] = {"demo-addition": ("Makefile",), "traffic-smollm2": ("rsi/starts.py", "Makefile")}
# the Makefile rules a result runs (its other rules' paragraphs do not count)
MAKE_TARGETS: dict[str, tuple[str, ...]] = {"demo-addition": ("demo", "setup", "$(STAMP)"),
                                            "traffic-smollm2": ("serve-smollm2", "setup", "$(STAMP)")}
# the family modules (task_generators/<name>.py) each result's runs load; a result not named here: every one
FAMILIES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("demo-addition", "ablation-addition", "train", "shards", "generation", "parity", "cycle",
                     "smollm2"), ("addition",)),
    "ablation-sorting": ("sorting",),
    **dict.fromkeys(("harness_repair", "episodes", "serve", "serve-session", "serve-session-joint", "traffic",
                     "traffic-smollm2", "traffic_generation"), ("addition", "sorting")),
}
# the profiles (rsi/run/profiles.toml) each result's runs use; a result not named here: the whole file
PROFILES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("demo-addition", "ablation-addition", "train", "shards", "cycle", "parity"), ("demo",)),
    "generation": (),  # its model is built in the script, its harness fixed: it reads no profile
    **dict.fromkeys(("ablation-sorting", "episodes"), ("sorting",)),
    **dict.fromkeys(("harness_repair", "serve", "serve-session", "traffic"), ("demo", "sorting")),
    **dict.fromkeys(("selfplay", "programs-base"), ("programs",)),
    "smollm2": ("smollm2",),
    "traffic-smollm2": ("smollm2", "smollm2-sorting"),
    "serve-session-joint": ("mol-addition", "mol-sorting"),
    "traffic_generation": ("sorting", "mol-sorting"),
}
# results that measure the serving layer (SERVING)
SERVES = {"serve", "serve-session", "serve-session-joint", "traffic", "traffic-smollm2", "traffic_generation"}


def staleness(name: str, root: Path = REPO) -> str | None:
    """Why ``bench/results/<name>.json`` may not be shown (None: it is current)."""
    script, _ = RESULTS[name]
    path = root / "bench/results" / f"{name}.json"
    if not path.exists():
        return f"`bench/results/{name}.json` does not exist"
    prov = json.loads(path.read_text()).get("provenance") or {}
    commit = prov.get("commit")
    if not commit:
        return f"`bench/results/{name}.json` records no commit (made before results recorded theirs)"
    if not prov.get("clean"):
        return f"`bench/results/{name}.json` was made on {commit[:10]} with uncommitted code"
    changed = changed_since(commit, script, root, ALSO.get(name, ()), serving=name in SERVES,
                            families=FAMILIES.get(name), profiles=PROFILES.get(name),
                            make_targets=MAKE_TARGETS.get(name))
    if changed is None:
        return f"`bench/results/{name}.json`'s commit {commit[:10]} is not in this clone's history (a shallow clone?)"
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        return f"`bench/results/{name}.json` was measured on {commit[:10]}; since then {shown} changed"
    return None


def render(name: str, root: Path = REPO) -> str:
    """The block's text: the result written out, or why it is not shown and how to measure it again."""
    script, write = RESULTS[name]
    why = staleness(name, root)
    if why is None and write is not None:
        result = json.loads((root / "bench/results" / f"{name}.json").read_text())
        return write(result) + f"\n(measured on commit {result['provenance']['commit'][:10]})\n"
    if why is None:
        return (f"`bench/results/{name}.json` is current (`{script}`); the README does not write its numbers yet "
                "(no renderer in `bench/readme.py`).\n")
    return (f"*Not shown: {why}. Measure it again: `.venv/bin/python {script}`, then "
            "`.venv/bin/python bench/readme.py`.*\n")


def rewrite(text: str, root: Path = REPO) -> str:
    def block(m: re.Match) -> str:
        name = m["name"]
        if name not in RESULTS:
            raise SystemExit(f"README.md has a results block {name!r} that bench/readme.py does not know; known: "
                             f"{', '.join(RESULTS)}")
        return f"<!-- results:{name} -->\n{render(name, root)}<!-- /results:{name} -->"

    return BLOCK.sub(block, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 where README.md differs")
    args = parser.parse_args()
    readme = REPO / "README.md"
    text = readme.read_text()
    new = rewrite(text)
    if args.check:
        differ = [m["name"] for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new), strict=True) if m[0] != n[0]]
        if differ:
            raise SystemExit(f"README.md's results blocks {differ} differ from the JSONs: run bench/readme.py")
        print("README.md's results blocks match the JSONs")
        return
    readme.write_text(new)
    print(f"wrote {len(BLOCK.findall(new))} results blocks into {readme}")


if __name__ == "__main__":
    main()
