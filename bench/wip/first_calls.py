"""The first call a chat model writes for each of N test tasks of a tool harness, greedy: where a start adapter
(``python -m rsi.starts``) has learned the call's format but not where to call, this shows it (every first call
the same). Research script; prints, writes nothing.

    RSI_HOME=/tmp/home .venv/bin/python bench/wip/first_calls.py --harness harness_versions/sorting/smollm2-v1 \
        --adapter DIR [--level 1] [--n 8]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", required=True)
    parser.add_argument("--adapter", type=Path, default=None, help="a LoRA adapter on its base (none: the base)")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()

    from rsi.backends import SamplingParams
    from rsi.backends.hf import HFBackend
    from rsi.config import get_settings
    from rsi.hcp import load_harness
    from rsi.models import Message
    from rsi.tasks import get_family

    harness = load_harness(args.harness)
    family = get_family(harness.document.family)
    backend = HFBackend(harness.base_model_dir(get_settings().home))
    tasks = family.tasks("test", 0, args.level, args.n)
    conversations = [[Message(role=role, content=content) for role, content in harness.prompt_messages(t.payload)]
                     for t in tasks]
    params = SamplingParams(max_new_tokens=harness.document.decoding.max_new_tokens, temperature=0.0)
    replies = backend.chat(conversations, harness.chat_tools, params,
                           adapter=str(args.adapter) if args.adapter else None)
    firsts = []
    for task, (reply,) in zip(tasks, replies):
        call = reply.tool_calls[0] if reply.tool_calls else None
        firsts.append(f"{call.name}({call.arguments})" if call else repr(reply.text[:40]))
        print(task.payload, "->", firsts[-1])
    print(Counter(firsts).most_common())


if __name__ == "__main__":
    main()
