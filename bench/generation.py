"""Generation throughput: new tokens/s of each engine, batched (one call) vs one prompt at a time.

Run: ``python bench/generation.py [--model DIR] [--prompts 256] [--max-new-tokens 12] [--out JSON]``.
Without ``--model`` a random ~1M-parameter Llama (4 layers, d=128, 4 heads of 32, char tokenizer) is built
in a temporary directory; the numbers then measure the engine, not answer quality.

``--engines hf,vllm`` adds a vLLM server (``rsi engine``, its own venv) behind the openai backend, on the
same prompts and ``--adapter``, and prints its tokens/s over the hf backend's. Another engine is one more
entry in ``ENGINES``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from provenance import machine_info, run_config, write_result

from rsi.backends import GenerationBackend, SamplingParams

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "generation.json"
SEQUENTIAL_PROMPTS = 32  # the one-at-a-time arm times this many prompts; tokens/s is comparable anyway


def _hf(model_dir: Path, threads: int | None) -> GenerationBackend:
    from rsi.backends.hf import HFBackend

    return HFBackend(model_dir, threads=threads)


class _VLLM:
    """A vLLM server started for the bench in its own RSI home (stopped on close), behind the openai backend."""

    def __init__(self, model_dir: Path, threads: int | None):
        from rsi import engine
        from rsi.backends.openai import OpenAIBackend

        self.home = Path(tempfile.mkdtemp(prefix="rsi-bench-vllm-"))
        state = engine.start(model_dir, self.home)
        self.backend = OpenAIBackend(state.base_url, tokenizer_dir=model_dir)

    def generate(self, prompts, params, adapter=None):
        return self.backend.generate(prompts, params, adapter=adapter)

    def close(self) -> None:
        from rsi import engine

        self.backend.close()
        engine.stop(self.home)


# name -> factory from (model dir, threads) to a backend
ENGINES: dict[str, Callable[[Path, int | None], GenerationBackend]] = {"hf": _hf, "vllm": _VLLM}


@dataclass(frozen=True)
class ArmResult:
    """One engine in one mode: how many prompts and new tokens, in how many seconds."""

    engine: str
    mode: str
    prompts: int
    new_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds


def addition_prompts(count: int, width: int = 10, seed: int = 0) -> list[str]:
    """Reverse-addition prompts such as ``2100000000+5430000000=`` (least significant digit first)."""
    rng = random.Random(seed)
    digits = lambda: "".join(rng.choice("0123456789") for _ in range(width))  # noqa: E731
    return [f"{digits()}+{digits()}=" for _ in range(count)]


def build_random_llama(path: Path) -> Path:
    """Save a random ~1M-parameter LlamaForCausalLM with a char tokenizer (digits, + =, specials)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", *"0123456789+="])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
        bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    # EOS logit fixed at 0 while others vary: a random model then almost never stops early, so arms do equal work.
    with torch.no_grad():
        model.lm_head.weight[vocab["<eos>"]] = 0.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def measure(backend: GenerationBackend, prompts: Sequence[str], params: SamplingParams, batched: bool,
            adapter: str | None = None) -> tuple[int, float]:
    """New tokens and wall seconds for the prompts, in one call or one call per prompt."""
    started = time.perf_counter()
    calls = [prompts] if batched else [[p] for p in prompts]
    results = [c for call in calls for per_prompt in backend.generate(call, params, adapter=adapter) for c in per_prompt]
    return sum(c.completion_tokens for c in results), time.perf_counter() - started


def run_engine(name: str, backend: GenerationBackend, prompts: list[str], params: SamplingParams,
               adapter: str | None = None) -> list[ArmResult]:
    """Both modes for one engine, after a warm-up call (which also loads the adapter)."""
    backend.generate(prompts[:8], params, adapter=adapter)
    sequential = prompts[:SEQUENTIAL_PROMPTS]
    arms = []
    for mode, subset in (("batched", prompts), ("sequential", sequential)):
        tokens, seconds = measure(backend, subset, params, batched=mode == "batched", adapter=adapter)
        arms.append(ArmResult(name, mode, len(subset), tokens, seconds))
    return arms


def print_table(arms: list[ArmResult]) -> None:
    """Plain table: one line per engine and mode, plus batched/sequential per engine."""
    print(f"{'engine':<10}{'mode':<12}{'prompts':>8}{'new tok':>9}{'seconds':>9}{'tok/s':>10}")
    for arm in arms:
        print(f"{arm.engine:<10}{arm.mode:<12}{arm.prompts:>8}{arm.new_tokens:>9}{arm.seconds:>9.2f}{arm.tokens_per_s:>10.0f}")
    for engine, ratio in ratios(arms).items():
        print(f"{engine}: batched/sequential = {ratio:.1f}x")
    for engine, ratio in versus_hf(arms).items():
        print(f"{engine} / hf, batched tokens/s = {ratio:.2f}x")


def ratios(arms: list[ArmResult]) -> dict[str, float]:
    by_key = {(a.engine, a.mode): a.tokens_per_s for a in arms}
    return {e: by_key[(e, "batched")] / by_key[(e, "sequential")] for e, m in by_key if m == "batched"}


def versus_hf(arms: list[ArmResult]) -> dict[str, float]:
    """Each other engine's batched tokens/s over the hf backend's, same prompts and adapter."""
    batched = {a.engine: a.tokens_per_s for a in arms if a.mode == "batched"}
    return {e: tps / batched["hf"] for e, tps in batched.items() if e != "hf" and "hf" in batched}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a saved causal LM directory (default: a random ~1M-param Llama)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--adapter", type=Path, help="a LoRA adapter directory to generate with (all engines)")
    parser.add_argument("--engines", default="hf", help=f"comma-separated, of {', '.join(ENGINES)} (vllm needs "
                        "`rsi engine install`)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = addition_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or build_random_llama(Path(scratch) / "random-llama")
        arms = []
        for name in args.engines.split(","):
            backend = ENGINES[name.strip()](model_dir, args.threads)
            try:
                arms += run_engine(name.strip(), backend, prompts, params, str(args.adapter) if args.adapter else None)
            finally:
                backend.close()
    print_table(arms)
    report = {
        "model": str(args.model) if args.model else "random Llama 4L d128 4x32 heads (built)",
        "params": params.model_dump(),
        "arms": [asdict(a) | {"tokens_per_s": a.tokens_per_s} for a in arms],
        "adapter": str(args.adapter) if args.adapter else None,
        "batched_over_sequential": ratios(arms),
        "batched_over_hf": versus_hf(arms),
        "machine": machine_info(args.threads),
    }
    write_result(args.out, report, run_config(args), args.threads)
    return report


if __name__ == "__main__":
    main()
