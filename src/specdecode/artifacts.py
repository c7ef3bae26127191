"""Trained artifacts: small safetensors files tied to the target they were trained for.

Every trainer (exit adapters, distilled draft models, heads) saves through :func:`save_artifact`
and every method loads through :func:`load_artifact`, so this module sits below both. A file holds the tensors plus three
metadata strings:

    specdecode.kind          what it is ("exit_adapters", "draft_model", ...)
    specdecode.fingerprint   ``runner.fingerprint()`` of the target it was trained against
    specdecode.config        JSON: the trainer's settings (shapes, layers, steps, data ...)

Large weight matrices may be stored in int8 with one float16 scale per row (``name`` int8 and
``name.int8_scale``; :func:`int8_rows`): artifacts shipped inside the package stay small, and
:func:`load_artifact` hands back float32 either way.

Loading checks the kind and the fingerprint: an artifact trained for another model is refused
with an error naming both fingerprints, because its tensors would load without complaint and
silently draft garbage (exact output, but slower than no draft at all).

``find_artifacts`` looks in the packaged ``specdecode/data/adapters`` folder and in the user
cache (``~/.cache/specdecode/artifacts``) for artifacts of one kind matching a fingerprint, so a
method can pick up a trained artifact without being told where it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdecode.errors import SpecDecodeError, require

FORMAT_VERSION = "1"
_KIND = "specdecode.kind"
_FINGERPRINT = "specdecode.fingerprint"
_CONFIG = "specdecode.config"
_VERSION = "specdecode.format_version"


@dataclass(frozen=True)
class Artifact:
    path: Path
    kind: str
    fingerprint: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def packaged_dir() -> Path:
    """Artifacts shipped inside the package (small, reproducible by a documented command)."""
    return Path(__file__).resolve().parent / "data" / "adapters"


def user_dir() -> Path:
    from specdecode.cache import cache_root

    return cache_root() / "artifacts"


#: suffix of the per-row scales of an int8-stored tensor
INT8_SCALE = ".int8_scale"


def int8_rows(tensors: dict[str, torch.Tensor], min_elements: int = 65536) -> dict[str, torch.Tensor]:
    """``tensors`` with every float matrix of ``min_elements`` or more stored as int8 rows with
    symmetric per-row float16 scales (a quarter of float32; the round trip keeps about two and a
    half significant digits, below what a draft's agreement notices)."""
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point() and t.dim() == 2 and t.numel() >= min_elements:
            scale = (t.float().abs().amax(1, keepdim=True) / 127).clamp_min(1e-12).half()
            out[name] = (t.float() / scale.float()).round().clamp(-127, 127).to(torch.int8)
            out[name + INT8_SCALE] = scale
        else:
            out[name] = t
    return out


def float_rows(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`int8_rows` (float32 matrices)."""
    return {name: (t.float() * tensors[name + INT8_SCALE].float()
                   if name + INT8_SCALE in tensors else t)
            for name, t in tensors.items() if not name.endswith(INT8_SCALE)}


def save_artifact(path: str | Path, tensors: dict[str, torch.Tensor], kind: str,
                  config: dict[str, Any], fingerprint: str) -> Path:
    """Write ``tensors`` with their metadata; the file appears atomically (tmp + rename)."""
    from safetensors.torch import save_file

    require(bool(tensors), "refusing to save an artifact with no tensors")
    require(bool(kind) and bool(fingerprint), "an artifact needs a kind and a target fingerprint")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {_KIND: kind, _FINGERPRINT: fingerprint, _VERSION: FORMAT_VERSION,
                _CONFIG: json.dumps(config, sort_keys=True)}
    # safetensors needs contiguous tensors that own their storage
    owned = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(owned, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path


def read_metadata(path: str | Path) -> tuple[str, str, dict[str, Any]]:
    """(kind, fingerprint, config) of an artifact, without loading its tensors."""
    from safetensors import safe_open

    path = Path(path)
    require(path.is_file(), f"artifact {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise SpecDecodeError(f"{path} is not a safetensors artifact: {exc}") from None
    missing = [k for k in (_KIND, _FINGERPRINT, _CONFIG) if k not in meta]
    require(not missing, f"{path} is not a specdecode artifact (its metadata lacks "
                         f"{', '.join(missing)}); re-create it with `specdecode train`")
    return meta[_KIND], meta[_FINGERPRINT], json.loads(meta[_CONFIG])


def load_artifact(path: str | Path, kind: str, fingerprint: str) -> Artifact:
    """Load an artifact of ``kind`` trained for the target with ``fingerprint``; refuse any
    other with an error that says what it was trained for."""
    from safetensors.torch import load_file

    path = Path(path)
    found_kind, found_fp, config = read_metadata(path)
    require(found_kind == kind,
            f"{path} holds a '{found_kind}' artifact, not '{kind}'; pass an artifact made by "
            f"the matching `specdecode train` command")
    require(found_fp == fingerprint,
            f"{path} was trained for another target model (fingerprint {found_fp!r}), not for "
            f"this one ({fingerprint!r}); train one for this model with `specdecode train`, or "
            f"load the model it was trained for")
    return Artifact(path, kind, found_fp, config, float_rows(load_file(str(path))))


def newest_artifact(kind: str, fingerprint: str, missing: str) -> Path:
    """The artifact a method's default name ('trained', 'auto', ...) stands for: the newest of
    ``kind`` for this target; refused with ``missing`` (how to make one) where there is none."""
    found = find_artifacts(kind, fingerprint)
    require(bool(found), missing)
    return found[0]


def find_artifacts(kind: str, fingerprint: str,
                   folders: tuple[Path, ...] | None = None) -> list[Path]:
    """Artifacts of ``kind`` trained for ``fingerprint``, user cache first, then packaged;
    newest first within a folder. Files for other targets are skipped, not refused."""
    found: list[Path] = []
    for folder in folders if folders is not None else (user_dir(), packaged_dir()):
        if not folder.is_dir():
            continue
        files = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime,
                       reverse=True)
        for path in files:
            try:
                found_kind, found_fp, _ = read_metadata(path)
            except SpecDecodeError:
                continue  # a foreign safetensors file in the folder is not ours to judge
            if found_kind == kind and found_fp == fingerprint:
                found.append(path)
    return found
