"""Start adapters: a pretrained chat base taught a tool harness's turn from the family's expert episodes, so that
its lineage has passes of its own to learn from.

A lineage learns only from its own verified runs. The built-in base learns each family's turn when it is built
(``rsi.basemodel`` trains it on the expert's episodes); a pretrained chat base is frozen and may never write a
passing episode: SmolLM2-135M-Instruct under ``sorting/smollm2-v1`` writes prose or sorted lists, never a call in
the Hermes format its harness reads (``rsi eval --harness sorting/smollm2-v1 --levels 1-2 --n 8 --k 8``: pass@8 0
at both levels). The start adapter is the same lesson as a LoRA on that base: the expert's episodes of train-split
tasks, played under the harness (each call run on the family's environment, its result rendered by the harness's
tool template, the final state verified), each call written as the chat model writes it
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what ``rsi.chat.parse_tool_calls`` reads back),
trained with the profile's ``train`` spec. A lineage then starts from it: ``rsi run FAMILY --profile P --set
start_adapter=OUT``.

No lineage run, evaluation or serving process imports this module (``bench/provenance.OUTSIDE``); it runs as
``python -m rsi.starts`` (``make serve-smollm2`` calls it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rsi.errors import UserError
from rsi.models import Message


def hermes(message: Message) -> Message:
    """An expert's assistant turn with its calls written in the Hermes format (its text otherwise as it is)."""
    if not message.tool_calls:
        return message
    text = "".join("<tool_call>" + json.dumps({"name": c.name, "arguments": c.arguments}) + "</tool_call>"
                   for c in message.tool_calls)
    return message.model_copy(update={"content": text})


def episode(harness, family, task) -> tuple[list[Message], list]:
    """The expert's episode of ``task`` under the chat ``harness`` (``rsi.hcp.plays.demonstration``: run on the
    family's environment, the final state verified), its calls written as the chat model writes them; each
    call's text is checked to read back (``rsi.chat.parse_tool_calls``) as the call the episode ran."""
    from rsi.chat import parse_tool_calls
    from rsi.hcp.plays import demonstration

    played = demonstration(harness, family, task)
    messages = [hermes(m) for m in played.messages]
    for m in messages:
        read = [(c.name, c.arguments) for c in parse_tool_calls(m.content)] if m.role == "assistant" else []
        if read != [(c.name, c.arguments) for c in m.tool_calls]:
            raise UserError(f"the call text {m.content!r} does not read back as its calls")
    return messages, list(played.tool_log)


def examples(harness, levels: list[int], tasks: int, seed: int) -> list:
    """Per level, the expert's episodes of ``tasks`` distinct train-split tasks under the chat ``harness``, as
    training examples (the assistant turns trained, as ``rsi.pair.text.training_parts`` makes them)."""
    from rsi.pair.text import chat_format, training_parts
    from rsi.select import Example
    from rsi.tasks import get_family

    family, chat, out = get_family(harness.document.family), chat_format(harness), []
    for level in levels:
        if not family.min_level <= level <= family.max_level:
            raise UserError(f"--levels: family {family.name!r} has levels {family.min_level}-{family.max_level}")
        for task in family.tasks("train", seed, level, tasks):
            prompt, completion, turns = training_parts(episode(harness, family, task)[0], chat)
            out.append(Example(trajectory_id=f"expert:{task.id}", level=level, prompt=prompt, completion=completion,
                               source="frontier", turns=turns, chat=True))
    return out


def build(profile: str | None, sets: list[str], out: Path, levels: list[int], tasks: int) -> dict:
    """Train the start adapter of ``profile``'s harness into ``out`` (atomically); returns what it did."""
    from rsi.config import get_settings
    from rsi.hcp import load_harness
    from rsi.run import load_config, parse_sets
    from rsi.select import Dataset
    from rsi.train import train_adapter

    config = load_config(profile, **parse_sets(sets))
    harness = load_harness(config.harness)
    if not harness.chat or not harness.document.tools:
        raise UserError(f"{harness.path}: a start adapter teaches a chat-mode harness's tool calls; this harness is "
                        f"{harness.document.prompt.mode} mode with {len(harness.document.tools)} tools")
    base = harness.base_model_dir(get_settings().home)
    if base is None:
        raise UserError(f"{harness.path}: model.base is 'builtin'; the built-in base learns the expert's episodes "
                        "when it is built (`rsi base build`), it needs no start adapter")
    data = examples(harness, levels, tasks, config.seed)
    result = train_adapter(base, None, Dataset(examples=tuple(data)), config.train, out, seed=config.seed,
                           on_step=lambda step, loss, lr: print(f"step {step}: loss {loss:.4f}", file=sys.stderr))
    return {"adapter": str(out), "harness": harness.id, "base": str(base), "levels": levels, "examples": len(data),
            "steps": result.steps, "first_loss": result.first_loss, "final_loss": result.final_loss}


def main(argv: list[str] | None = None) -> int:
    from rsi.cli import parse_levels

    parser = argparse.ArgumentParser(prog="python -m rsi.starts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="the lineage's profile (its harness, base and train spec)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, as `rsi run --set`")
    parser.add_argument("--out", type=Path, required=True, help="the adapter directory to write")
    parser.add_argument("--levels", default="1-3", help="levels of the expert's episodes (default 1-3)")
    parser.add_argument("--tasks", type=int, default=128, help="distinct train tasks a level (default 128)")
    parser.add_argument("--force", action="store_true", help="train again where OUT already holds an adapter")
    args = parser.parse_args(argv)
    try:
        if (args.out / "adapter_config.json").is_file() and not args.force:
            print(f"{args.out}: a start adapter is there already (--force trains it again)")
            return 0
        if args.tasks < 1:
            raise UserError(f"--tasks {args.tasks}: give at least 1")
        print(json.dumps(build(args.profile, args.sets, args.out, parse_levels(args.levels), args.tasks)))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
