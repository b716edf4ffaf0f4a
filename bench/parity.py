"""Greedy parity of the vLLM server (openai backend) with the in-process hf backend.

Same base, same adapter, same 500 reverse-addition prompts (levels 1..10): counts identical completions,
identical token counts and finish reasons, and lists any difference. Prints a table and writes JSON.

    .venv/bin/python bench/parity.py --model .rsi/models/base-... [--adapter DIR] [--n 500]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import run_config, write_result  # noqa: E402 (after the path it needs)


def prompts(n: int) -> list[str]:
    from rsi.hcp import load_harness
    from rsi.tasks import get_family

    harness, family = load_harness(REPO / "harness_versions/addition/v2"), get_family("addition")
    return [harness.prompt(family.task("test", 7, 1 + i % 10, i).payload) for i in range(n)]


def compare(hf_out, vllm_out, texts) -> dict:
    same = [a[0].text == b[0].text for a, b in zip(hf_out, vllm_out)]
    counts = [(a[0].completion_tokens, a[0].finish_reason) == (b[0].completion_tokens, b[0].finish_reason)
              for a, b in zip(hf_out, vllm_out)]
    diffs = [{"prompt": p, "hf": a[0].text, "vllm": b[0].text}
             for p, a, b, s in zip(texts, hf_out, vllm_out, same) if not s]
    return {"n": len(same), "equal": sum(same), "counts_equal": sum(counts), "diffs": diffs[:20]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--adapter", type=Path)
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--out", default=str(REPO / "bench/results/parity.json"))
    args = parser.parse_args()

    from rsi import engine
    from rsi.backends.base import SamplingParams
    from rsi.backends.hf import HFBackend
    from rsi.backends.openai import OpenAIBackend

    texts = prompts(args.n)
    params = SamplingParams(max_new_tokens=12)
    home = Path(tempfile.mkdtemp(prefix="rsi-parity-"))
    started = time.perf_counter()
    state = engine.start(args.model, home)
    load_s = time.perf_counter() - started
    result = {"model": str(args.model), "adapter_dir": str(args.adapter) if args.adapter else None,
              "engine_load_s": load_s}  # the arms' results under "base" and "adapter"
    try:
        vllm, hf = OpenAIBackend(state.base_url, tokenizer_dir=args.model), HFBackend(args.model)
        for tag, adapter in (("base", None), ("adapter", args.adapter)):
            if tag == "adapter" and adapter is None:
                continue
            a = str(adapter) if adapter else None
            result[tag] = compare(hf.generate(texts, params, adapter=a), vllm.generate(texts, params, adapter=a), texts)
        vllm.close()
    finally:
        engine.stop(home)
    print(f"{'arm':<8} {'equal':>7} {'of':>5} {'counts equal':>13}   (greedy, vLLM float32 vs hf float32)")
    for tag in ("base", "adapter"):
        if tag in result:
            r = result[tag]
            print(f"{tag:<8} {r['equal']:>7} {r['n']:>5} {r['counts_equal']:>13}")
            for d in r["diffs"]:
                print(f"    differs: {d}")
    print(f"engine load {load_s:.1f} s")
    write_result(args.out, result, run_config(args))


if __name__ == "__main__":
    main()
