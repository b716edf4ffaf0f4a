"""rsi as a wheel: what a logged pair ships so that MLflow can install rsi where the checkout is not
(``rsi.mlmodel``). Built once per digest of rsi's sources, under the temp dir."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from importlib.metadata import distribution
from pathlib import Path


def rsi_wheel() -> Path:
    """A wheel of the rsi this process runs, in a folder named by its sources' digest (so another rsi is another
    model environment), built once per digest under the temp dir: from a checkout by pip (setuptools, as
    ``pip install .`` would), from an installed rsi by zipping its files again."""
    import rsi

    root = Path(rsi.__file__).resolve().parent.parent
    checkout = (root / "pyproject.toml").is_file() and (root / "flows").is_dir()
    files = _checkout_files(root) if checkout else _installed_files()
    digest = hashlib.sha256()
    for name, path in sorted(files.items()):
        digest.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    folder = Path(tempfile.gettempdir()) / "rsi-wheels" / f"rsi-{digest.hexdigest()[:16]}"
    built = sorted(folder.glob("rsi-*.whl"))
    if built:
        return built[0]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:  # built aside, then moved in whole
        out = Path(tmp) / folder.name
        out.mkdir()
        if checkout:
            _build(files, Path(tmp) / "src", out)
        else:
            _zip(files, out)
        try:
            out.rename(folder)
        except OSError:  # another process built the same sources meanwhile
            pass
    return next(folder.glob("rsi-*.whl"))


def _checkout_files(root: Path) -> dict[str, Path]:
    """What a wheel of the checkout is built from: pyproject.toml, the readme and the package folders."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    folders = {"rsi", *project["tool"]["setuptools"]["package-dir"].values()}
    files = {name: root / name for name in ("pyproject.toml", project["project"]["readme"])}
    for folder in folders:
        files |= {str(p.relative_to(root)): p for p in (root / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    return files


def _installed_files() -> dict[str, Path]:
    """An installed rsi's files as its wheel held them (not its scripts, which pip writes from the entry points)."""
    dist = distribution("rsi")
    skip = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    return {str(f): Path(f.locate()) for f in dist.files or ()
            if ".." not in f.parts and f.suffix != ".pyc" and "__pycache__" not in f.parts and f.name not in skip}


def _build(files: dict[str, Path], src: Path, out: Path) -> None:
    for name, path in files.items():  # a copy: a build writes build/ and *.egg-info beside the sources
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building rsi's wheel for the model failed:\n{done.stderr[-3000:]}")


def _zip(files: dict[str, Path], out: Path) -> None:
    info = next(name.split("/")[0] for name in files if name.endswith(".dist-info/METADATA"))
    record = []
    with zipfile.ZipFile(out / f"{info.removesuffix('.dist-info')}-py3-none-any.whl", "w",
                         zipfile.ZIP_DEFLATED) as whl:
        for name, path in sorted(files.items()):
            data = path.read_bytes()
            whl.writestr(name, data)
            sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={sha},{len(data)}")
        whl.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
