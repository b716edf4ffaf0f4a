"""A real vLLM server (rsi.engine) and the openai backend against it: parity with hf, seeds, adapters, stop.

Needs the engine venv (``rsi.engine.install()``: ~3.5 GB, several minutes the first time, then reused from
``$RSI_ENGINE_VENV`` or ``~/.cache/rsi/engine-venv-*``). Run with ``pytest -m vllm tests/test_engine.py``.
After the venv exists the module takes about two minutes on 2 CPU cores (server start ~30 s).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(3600),  # the first run installs the engine venv
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the engine is managed on Linux only"),
]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from rsi import engine  # noqa: E402
from rsi.backends.base import GenerationBackend, SamplingParams  # noqa: E402
from rsi.backends.hf import HFBackend  # noqa: E402
from rsi.backends.openai import OpenAIBackend  # noqa: E402
from rsi.errors import RuntimeFailure, UserError  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=12)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=7)


def addition_prompts(n: int, seed: int = 0, width: int = 10) -> list[str]:
    """Reverse-addition prompts like '2100000000+5430000000=' at levels 1..6."""
    from rsi.task_generators.addition import format_example

    rng = random.Random(seed)
    out = []
    for i in range(n):
        level = 1 + i % 6
        low = 10 ** (level - 1) if level > 1 else 0
        out.append(format_example(rng.randrange(low, 10**level), rng.randrange(low, 10**level), width)[0])
    return out


def build_model(path: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama (d 128, 4 heads of 32) with rsi's char tokenizer, loadable by vLLM."""
    from rsi.basemodel import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    tokenizer = build_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger than default init: varied greedy outputs, few near-ties
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.3)
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    cfg_path = path / "tokenizer_config.json"  # the generic class name, for vLLM's older transformers
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg))
    return path


def build_adapter(model_dir: Path, path: Path, seed: int) -> Path:
    """A LoRA (r=8, all 7 projections) with random non-zero B, so it changes outputs."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    lora.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-assets")
    model = build_model(root / "model")
    return {"model": model, "one": build_adapter(model, root / "one", 1), "two": build_adapter(model, root / "two", 2)}


@pytest.fixture(scope="module")
def server(assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A vLLM server on the tiny model; a stale state file is planted first and must be replaced."""
    engine.install()
    home = tmp_path_factory.mktemp("engine-home")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (home / "engine").mkdir(parents=True)
    stale = engine.EngineState(
        pid=dead.pid, port=1, model=str(assets["model"]), started_at=time.time(), venv=str(engine.default_venv()),
        log_path="x", max_lora_rank=16, max_loras=2, max_model_len=128, dtype="float32",
    )
    engine.state_path(home).write_text(stale.model_dump_json())
    state = engine.start(assets["model"], home, max_loras=2, max_lora_rank=16, timeout_s=600)
    assert "stale" in state.note
    yield home, state
    engine.stop(home)


@pytest.fixture(scope="module")
def hf(assets: dict[str, Path]):
    backend = HFBackend(assets["model"], threads=2)
    yield backend
    backend.close()


def texts(results) -> list[str]:
    return [per_prompt[0].text for per_prompt in results]


def test_start_again_returns_the_running_server(server, assets) -> None:
    home, state = server
    again = engine.start(assets["model"], home)
    assert again.pid == state.pid and again.port == state.port
    assert "already running" in again.note
    assert json.loads(engine.state_path(home).read_text())["pid"] == state.pid
    other = build_model(assets["model"].parent / "other-model", seed=1)
    with pytest.raises(UserError, match="already running"):
        engine.start(other, home)
    assert engine.logs(home, 5).count("\n") <= 5 and engine.logs(home)


def test_greedy_parity_with_hf_base_and_adapter(server, hf, assets) -> None:
    home, state = server
    prompts = addition_prompts(200)
    with OpenAIBackend(state.base_url, tokenizer_dir=assets["model"], max_adapters=2) as api:
        assert isinstance(api, GenerationBackend)
        for adapter in (None, str(assets["one"])):
            ours, theirs = hf.generate(prompts, GREEDY, adapter=adapter), api.generate(prompts, GREEDY, adapter=adapter)
            same = [a[0].text == b[0].text for a, b in zip(ours, theirs, strict=True)]
            assert sum(same) >= 0.99 * len(prompts), f"adapter={adapter}: {sum(same)}/{len(prompts)} equal"
            for ok, a, b in zip(same, ours, theirs, strict=True):
                if ok:  # same text: same token counts and finish reason as the hf backend
                    assert (a[0].prompt_tokens, a[0].completion_tokens, a[0].finish_reason) == \
                           (b[0].prompt_tokens, b[0].completion_tokens, b[0].finish_reason)
        assert texts(api.generate(prompts[:50], GREEDY)) != texts(api.generate(prompts[:50], GREEDY, adapter=str(assets["one"])))
        repeated = api.generate(prompts[:3], GREEDY.model_copy(update={"n": 3}))
        assert all(len(r) == 3 and len({c.text for c in r}) == 1 for r in repeated)


def test_token_counts_stop_strings_and_eos(server, hf, assets) -> None:
    _, state = server
    with OpenAIBackend(state.base_url, tokenizer_dir=assets["model"], batch_size=4) as api:
        prompts = addition_prompts(12, seed=3)
        full = [c for (c,) in api.generate(prompts, GREEDY)]
        prompt, text = next((p, c.text) for p, c in zip(prompts, full, strict=True) if len(c.text) >= 6)
        stop = text[3:5]
        params = GREEDY.model_copy(update={"stop": ("zzz", stop)})
        (c,) = api.generate([prompt], params)[0]
        (h,) = hf.generate([prompt], params)[0]
        assert (c.text, c.finish_reason) == (text[: text.find(stop)], "stop")
        assert c.completion_tokens == h.completion_tokens
        assert c.prompt_tokens == len(prompt) + 1  # chars plus <bos>


def test_seeded_sampling_is_reproducible(server) -> None:
    _, state = server
    prompts = addition_prompts(16, seed=1)
    with OpenAIBackend(state.base_url, batch_size=5, concurrency=3) as api:
        first = [[c.text for c in r] for r in api.generate(prompts, SAMPLED)]
        assert first == [[c.text for c in r] for r in api.generate(prompts, SAMPLED)]
        assert first != [[c.text for c in r] for r in api.generate(prompts, SAMPLED.model_copy(update={"seed": 8}))]
        assert all(len(r) == 3 for r in first) and sum(len(set(r)) for r in first) > len(prompts)
        # A prompt's samples do not depend on its neighbours in the call.
        assert [c.text for c in api.generate([prompts[5]], SAMPLED)[0]] == first[5]
        a, b = api.generate([prompts[0], prompts[0]], SAMPLED)  # repeated prompts sample independently
        assert [c.text for c in a] == first[0] and [c.text for c in a] != [c.text for c in b]


def test_adapters_load_under_content_names_and_evict(server, assets) -> None:
    home, state = server
    from rsi.train import adapter_hash

    one, two = str(assets["one"]), str(assets["two"])
    prompts = addition_prompts(8, seed=2)
    api = OpenAIBackend(state.base_url, max_adapters=1)
    name_one, name_two = api.adapter_name(one), api.adapter_name(two)
    assert name_one == "rsi-" + adapter_hash(assets["one"])[:16] and name_one != name_two
    with_one = texts(api.generate(prompts, GREEDY, adapter=one))
    info = engine.status(home)
    assert info["running"] and info["healthy"] and info["pid"] == state.pid
    assert name_one in [a["name"] for a in info["adapters"]] and "base" in info["models"]
    with_two = texts(api.generate(prompts, GREEDY, adapter=two))
    assert with_one != with_two
    listed = engine.status(home)["models"]
    assert name_two in listed and name_one not in listed  # evicted: the server unloaded it
    assert list(api.loaded_adapters()) == [name_two]
    assert texts(api.generate(prompts, GREEDY, adapter=one)) == with_one  # loaded again on demand
    # The server lost the adapter behind the backend's back (e.g. a restart): it is loaded again, once.
    other = OpenAIBackend(state.base_url)
    other._post("/unload_lora_adapter", {"lora_name": name_one})
    assert texts(api.generate(prompts, GREEDY, adapter=one)) == with_one
    other.close()
    api.close()
    assert not [a for a in engine.status(home)["adapters"] if a["name"] in (name_one, name_two)]


def test_bad_requests_and_unreachable_server(server, tmp_path) -> None:
    _, state = server
    with OpenAIBackend(state.base_url, retries=0) as api:
        with pytest.raises(UserError, match="rejected"):
            api.generate(["1+1="], SamplingParams(max_new_tokens=1000))  # longer than --max-model-len
        with pytest.raises(UserError, match="adapter_config.json"):
            api.generate(["1+1="], GREEDY, adapter=str(tmp_path))
    port = engine._free_port()
    with OpenAIBackend(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01) as dead:
        with pytest.raises(RuntimeFailure, match="did not answer"):
            dead.generate(["1+1="], GREEDY)


def test_failed_start_reports_the_log(assets, tmp_path) -> None:
    with pytest.raises(UserError, match="config.json"):
        engine.start(tmp_path / "nowhere", tmp_path)
    with pytest.raises(RuntimeFailure, match="(?s)exited with code.*no-such-flag"):
        engine.start(assets["model"], tmp_path, extra_args=("--no-such-flag",), timeout_s=300)
    assert not engine.state_path(tmp_path).exists()


def test_stop_leaves_no_process(server) -> None:
    home, state = server
    assert engine.stop(home)
    assert not engine.state_path(home).exists()
    assert engine.status(home)["running"] is False
    found = subprocess.run(["pgrep", "-f", "--", f"--port {state.port}"], capture_output=True, text=True).stdout.split()
    assert [p for p in found if _running(int(p))] == []
    group = subprocess.run(["pgrep", "-g", str(state.pid)], capture_output=True, text=True).stdout.split()
    assert [p for p in group if _running(int(p))] == []  # an exited worker may wait a moment for init to reap it
    assert engine.stop(home) is False  # nothing left to stop


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX" and pid != os.getpid()
