"""The hf backend on a tiny random Llama with a char tokenizer: batching, sampling, stops, LoRA switching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from rsi.backends import SamplingParams, get_backend  # noqa: E402
from rsi.backends.base import GenerationBackend  # noqa: E402
from rsi.backends.hf import HFBackend  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# <eos> first: with an all-zero lm_head every logit ties and argmax picks id 0, i.e. EOS.
SPECIALS = ["<eos>", "<pad>", "<bos>"]
CHARS = list("0123456789+=- abcdefghij")
PROMPTS = ["1+2=", "12+34=", "999+1=", "5=", "abc", "0+0=", "123456+654321=", "j-ih"]


def build_char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A character-level WordLevel tokenizer that prepends <bos> and decodes without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )


def build_tiny_llama(path: Path, *, layers: int = 2, hidden: int = 64, heads: int = 2, seed: int = 0) -> Path:
    """Save a random LlamaForCausalLM and its char tokenizer to path."""
    tokenizer = build_char_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=32,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    # Larger weights than the default init, so greedy outputs are varied rather than near-ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_adapter(model_dir: Path, path: Path, seed: int) -> Path:
    """Save a LoRA (r=8 on q_proj, v_proj) whose B matrices are random, so it changes outputs."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    lora.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return build_adapter(model_dir, root / "one", seed=1), build_adapter(model_dir, root / "two", seed=2)


@pytest.fixture(scope="module")
def backend(model_dir: Path):
    hf = HFBackend(model_dir, batch_size=4, threads=1)
    yield hf
    hf.close()


def texts(results) -> list[list[str]]:
    return [[c.text for c in per_prompt] for per_prompt in results]


GREEDY = SamplingParams(max_new_tokens=10)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=7)


def test_is_a_generation_backend_and_builds_by_name(backend: HFBackend, model_dir: Path) -> None:
    assert isinstance(backend, GenerationBackend)
    other = get_backend("hf", model_dir=model_dir, threads=1)
    assert texts(other.generate(PROMPTS[:2], GREEDY)) == texts(backend.generate(PROMPTS[:2], GREEDY))
    other.close()


def test_greedy_batched_equals_one_at_a_time(backend: HFBackend) -> None:
    batched = texts(backend.generate(PROMPTS, GREEDY))
    single = [texts(backend.generate([p], GREEDY))[0] for p in PROMPTS]
    assert batched == single
    assert len({t[0] for t in batched}) > 1  # the model is not degenerate


def test_greedy_n_repeats_the_one_answer(backend: HFBackend) -> None:
    results = backend.generate(PROMPTS[:2], GREEDY.model_copy(update={"n": 3}))
    assert [len(r) for r in results] == [3, 3]
    assert all(len(set(t)) == 1 for t in texts(results))


def test_sampling_is_seeded_and_independent_of_the_batch(backend: HFBackend) -> None:
    first = texts(backend.generate(PROMPTS, SAMPLED))
    assert first == texts(backend.generate(PROMPTS, SAMPLED))
    assert first != texts(backend.generate(PROMPTS, SAMPLED.model_copy(update={"seed": 8})))
    # A prompt's samples do not depend on its neighbours or position in the call.
    assert texts(backend.generate([PROMPTS[3]], SAMPLED))[0] == first[3]
    assert texts(backend.generate(PROMPTS[::-1], SAMPLED))[::-1] == first
    assert all(len(r) == 3 for r in first)
    assert sum(len(set(r)) for r in first) > len(PROMPTS)  # the n samples differ


def test_duplicate_prompts_get_distinct_samples(backend: HFBackend) -> None:
    a, b = texts(backend.generate([PROMPTS[1], PROMPTS[1]], SAMPLED))
    assert a != b


def test_tiny_top_p_is_greedy(backend: HFBackend) -> None:
    sampled = backend.generate(PROMPTS, SAMPLED.model_copy(update={"top_p": 1e-6, "n": 1}))
    assert texts(sampled) == texts(backend.generate(PROMPTS, GREEDY))


def test_max_new_tokens_gives_length_and_token_counts(backend: HFBackend) -> None:
    params = SamplingParams(max_new_tokens=5)
    for prompt, (c,) in zip(PROMPTS, backend.generate(PROMPTS, params), strict=True):
        assert c.prompt_tokens == len(prompt) + 1  # chars plus <bos>
        if c.finish_reason == "length":
            assert c.completion_tokens == 5
            assert len(c.text) <= 5  # a generated special token (<pad>, <bos>) leaves no text
        else:  # stopped at EOS, which is counted but not in the text
            assert c.completion_tokens == len(c.text) + 1
        assert c.generate_s > 0
    assert any(c.finish_reason == "length" for (c,) in backend.generate(PROMPTS, params))


def test_stop_strings_truncate(backend: HFBackend) -> None:
    long = SamplingParams(max_new_tokens=12)
    full = [c for (c,) in backend.generate(PROMPTS, long)]
    prompt, text = next((p, c.text) for p, c in zip(PROMPTS, full, strict=True) if len(c.text) >= 6)
    stop = text[3:5]
    (c,) = backend.generate([prompt], long.model_copy(update={"stop": ("zzz", stop)}))[0]
    assert c.finish_reason == "stop"
    assert c.text == text[: text.find(stop)]
    assert c.completion_tokens == text.find(stop) + len(stop)  # generation stopped as the stop string completed


def test_eos_stops_and_is_counted(model_dir: Path) -> None:
    hf = HFBackend(model_dir, threads=1)
    with torch.no_grad():
        hf.model.lm_head.weight.zero_()  # all logits tie, argmax picks id 0 = <eos>
    for (c,) in hf.generate(PROMPTS[:2], GREEDY):
        assert (c.text, c.completion_tokens, c.finish_reason) == ("", 1, "stop")
    hf.close()


def test_lora_adapters_switch_without_reloading(backend: HFBackend, adapters: tuple[Path, Path]) -> None:
    one, two = (str(a) for a in adapters)
    base = texts(backend.generate(PROMPTS, GREEDY))
    with_one = texts(backend.generate(PROMPTS, GREEDY, adapter=one))
    with_two = texts(backend.generate(PROMPTS, GREEDY, adapter=two))
    assert with_one != base and with_two != base and with_one != with_two
    model = backend.model
    assert texts(backend.generate(PROMPTS, GREEDY)) == base
    assert texts(backend.generate(PROMPTS, GREEDY, adapter=one)) == with_one
    assert texts(backend.generate(PROMPTS, GREEDY, adapter=two)) == with_two
    assert backend.model is model  # switched in place, never reloaded
    backend.unload_adapter(one)
    backend.unload_adapter(two)
    assert texts(backend.generate(PROMPTS, GREEDY)) == base
    assert texts(backend.generate(PROMPTS, GREEDY, adapter=one)) == with_one


def test_adapter_lru_evicts_oldest(backend: HFBackend, adapters: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import rsi.backends.hf as hf_module

    monkeypatch.setattr(hf_module, "MAX_LOADED_ADAPTERS", 1)
    one, two = (str(a) for a in adapters)
    expected = texts(backend.generate(PROMPTS[:2], GREEDY, adapter=one))
    backend.generate(PROMPTS[:2], GREEDY, adapter=two)
    assert len(backend._adapters) == 1
    assert texts(backend.generate(PROMPTS[:2], GREEDY, adapter=one)) == expected


def test_bad_paths_say_what_is_missing(tmp_path: Path, backend: HFBackend) -> None:
    from rsi.errors import UserError

    with pytest.raises(UserError, match="config.json"):
        HFBackend(tmp_path)
    with pytest.raises(UserError, match="adapter_config.json"):
        backend.generate(PROMPTS[:1], GREEDY, adapter=str(tmp_path))


def test_same_samples_in_a_fresh_process(backend: HFBackend, model_dir: Path) -> None:
    script = (
        "import json, sys; from rsi.backends.hf import HFBackend; from rsi.backends import SamplingParams; "
        f"hf = HFBackend({str(model_dir)!r}, batch_size=4, threads=1); "
        f"p = SamplingParams.model_validate_json({SAMPLED.model_dump_json()!r}); "
        f"print(json.dumps([[c.text for c in r] for r in hf.generate({PROMPTS!r}, p)]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == texts(backend.generate(PROMPTS, SAMPLED))



def test_a_rows_logits_do_not_depend_on_the_rest_of_its_call(model_dir: Path, adapters: tuple[Path, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What lets a runner split a call into shards (rsi.runners): each row's logits are bit-identical in the
    whole call, in shards of it and at other batch sizes, whatever torch's thread count outside the call. Rows
    are keyed by their sampling seed; the prompts differ in length; batch size 2 and 3 put 1-3 rows in a
    forward pass, where CPU matmuls would take another kernel without the backend's filler rows."""
    import rsi.backends.hf as hf

    seen: dict[int, list[bytes]] = {}
    pick = hf._pick

    def recording(logits_B_V, params, generators):
        for row, g in zip(logits_B_V, generators, strict=True):
            seen.setdefault(g.initial_seed(), []).append(row.numpy().tobytes())
        return pick(logits_B_V, params, generators)

    monkeypatch.setattr(hf, "_pick", recording)
    prompts = PROMPTS * 2  # repeats: their seeds count earlier occurrences, so a prompt's copies share a shard
    some, rest = [p for p in prompts if p in PROMPTS[:3]], [p for p in prompts if p not in PROMPTS[:3]]
    runs = []
    torch.set_num_threads(2)
    try:
        for batch_size, shards in ((256, [prompts]), (2, [prompts]), (3, [rest, some])):
            seen.clear()
            backend = HFBackend(model_dir, batch_size=batch_size)
            outputs = {}
            for shard in shards:
                for i, (prompt, samples) in enumerate(zip(shard, texts(backend.generate(shard, SAMPLED,
                                                                                         adapter=str(adapters[0]))))):
                    outputs[prompt, shard[:i].count(prompt)] = samples
            runs.append((outputs, {seed: logits for seed, logits in seen.items() if seed}))  # 0: filler rows
            backend.close()
            assert torch.get_num_threads() == 2  # the call's one thread was restored
    finally:
        torch.set_num_threads(1)
    (texts_0, logits_0), others = runs[0], runs[1:]
    assert len(logits_0) == len(prompts) * SAMPLED.n
    for outputs, logits in others:
        assert outputs == texts_0 and logits.keys() == logits_0.keys()
        for seed, steps in logits.items():  # finished rows may stay as fillers: compare the steps they ran for
            n = min(len(steps), len(logits_0[seed]))
            assert steps[:n] == logits_0[seed][:n]
