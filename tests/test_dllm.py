"""The small dLLM's delta and trainer (diffusion/dllm.py, training/dllm.py) on a tiny random
Llama: the masked-diffusion loss falls, a resumed run continues its checkpoint exactly, and the
delta merged for the native runner gives the logits the torch reference gives, in the layout
the runner decodes."""

from __future__ import annotations

import random

import pytest
import torch

from specdecode.diffusion.dllm import DiffusionDelta, diffusion_batch, merged_runner
from specdecode.diffusion.model import DiffusionModel
from specdecode.errors import SpecDecodeError
from specdecode.training.dllm import _step_batch, train
from specdecode.training.runs import Checkpoint

from tiny_models import tiny_llama

MASK = 95
SETTINGS = {"rank": 4, "block_size": 4, "batch": 2, "lr": 1e-2, "mask_id": MASK, "seed": 0}
DATA = [(list(range(3, 20)), 7), (list(range(10, 31)), 12), ([5, 9, 4, 8, 7, 6, 5, 4, 3], 3)]


def frozen_llama():
    return tiny_llama().requires_grad_(False)


def attached(model) -> DiffusionDelta:
    delta = DiffusionDelta(model, SETTINGS["rank"])
    delta.attach(model)
    return delta


def test_one_training_step_lowers_the_masked_diffusion_loss(tmp_path):
    from specdecode.diffusion.dllm import masked_diffusion_loss

    model = frozen_llama()
    delta = attached(model)
    batch = _step_batch(DATA, SETTINGS, 0)  # the batch the trainer's first step draws
    with torch.no_grad():
        before = float(masked_diffusion_loss(model, batch))
    state = train(model, delta, DATA, SETTINGS, Checkpoint(tmp_path / "c.pt", False), 1, 1)
    with torch.no_grad():
        after = float(masked_diffusion_loss(model, batch))
    assert state["step"] == 1 and state["losses"][0] == pytest.approx(before, rel=1e-5)
    assert after < before


def test_resume_continues_from_the_checkpoint(tmp_path):
    straight_model = frozen_llama()
    straight = attached(straight_model)
    train(straight_model, straight, DATA, SETTINGS, Checkpoint(tmp_path / "a.pt", False), 3, 10)
    first_model = frozen_llama()
    train(first_model, attached(first_model), DATA, SETTINGS, Checkpoint(tmp_path / "b.pt", False),
          2, 1)
    with pytest.raises(SpecDecodeError, match="--resume"):
        Checkpoint(tmp_path / "b.pt", False)
    resumed_model = frozen_llama()
    resumed = attached(resumed_model)
    state = train(resumed_model, resumed, DATA, SETTINGS, Checkpoint(tmp_path / "b.pt", True), 3, 1)
    assert state["step"] == 3 and len(state["losses"]) == 3
    for name, param in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], param)
    assert any(p.abs().sum() > 0 for p in straight.up.values())  # it did train


def random_delta(model, seed: int = 3) -> DiffusionDelta:
    delta = DiffusionDelta(model, 4)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in delta.up.values():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return delta


@torch.no_grad()
def test_merged_delta_changes_the_runners_logits_as_the_torch_reference():
    model = frozen_llama()
    ids = DATA[1][0]
    base = model(torch.tensor([ids])).logits[0, -1]
    delta = random_delta(model)
    handles = delta.attach(model)
    reference = model(torch.tensor([ids])).logits[0, -1]
    for handle in handles:
        handle.remove()
    native = merged_runner(model, delta).prefill(ids).logits[-1]
    torch.testing.assert_close(native, reference, atol=1e-4, rtol=1e-4)
    assert (reference - base).abs().max() > 0.1  # the delta changed them


@torch.no_grad()
def test_training_layout_is_the_runners_denoising_forward():
    """The trainer's noisy rows are the rows ``DiffusionModel.denoise`` computes: position 0 by
    the last committed row, position i by block row i - 1, the block bidirectional."""
    model = frozen_llama()
    delta = random_delta(model)
    prompt, block = [4, 9, 17, 3, 30, 22], [41, 7, 60, 13]
    batch = diffusion_batch([(prompt + block, len(prompt))], len(block), MASK, random.Random(1))
    noisy = batch.input_ids[0, -len(block):].tolist()
    assert MASK in noisy
    handles = delta.attach(model)
    hidden = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                         attention_mask=batch.attention).last_hidden_state[0]
    for handle in handles:
        handle.remove()
    length = len(prompt) + len(block)
    rows = torch.cat([hidden[len(prompt) - 1:len(prompt)], hidden[length:length + 3]])
    expected = model.lm_head(rows)
    dllm = DiffusionModel(merged_runner(model, delta), MASK)
    dllm.prefill(prompt)
    torch.testing.assert_close(dllm.denoise(noisy), expected, atol=1e-4, rtol=1e-4)


def test_saved_delta_loads_and_refuses_another_target(tmp_path):
    model = frozen_llama()
    delta = random_delta(model)
    path = delta.save(tmp_path / "d.safetensors", "tiny")
    loaded = DiffusionDelta.load(path, model, "tiny")
    for key, param in delta.up.items():
        torch.testing.assert_close(loaded.up[key], param.half().float())
    with pytest.raises(SpecDecodeError, match="tiny"):
        DiffusionDelta.load(path, model, "another")


def test_bad_batches_name_the_problem():
    with pytest.raises(SpecDecodeError, match="non-empty answer"):
        diffusion_batch([([1, 2, 3], 3)], 4, MASK, random.Random(0))
    with pytest.raises(SpecDecodeError, match="block_size"):
        diffusion_batch(DATA, 0, MASK, random.Random(0))


@torch.no_grad()
def test_dllm_runner_merges_a_saved_delta_and_refuses_a_missing_file(tmp_path):
    from types import SimpleNamespace

    from specdecode.diffusion.dllm import dllm_runner
    from specdecode.models.hf import HFRunner

    model = frozen_llama()
    delta = random_delta(model)
    path = delta.save(tmp_path / "d.safetensors", HFRunner(model).fingerprint())
    runner, loaded_delta = dllm_runner(SimpleNamespace(model=model), path)
    ids = DATA[0][0]
    expected = merged_runner(model, DiffusionDelta.load(path, model, HFRunner(model).fingerprint())
                             ).prefill(ids).logits
    assert torch.equal(runner.prefill(ids).logits, expected) and loaded_delta.rank == 4
    with pytest.raises(SpecDecodeError, match="train dllm"):
        dllm_runner(SimpleNamespace(model=model), tmp_path / "missing.safetensors")


def test_find_dllm_names_a_file_none_or_the_newest_for_the_model(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from specdecode.diffusion import dllm
    from specdecode.models.hf import HFRunner
    from specdecode import artifacts

    model = frozen_llama()
    loaded = SimpleNamespace(model=model)
    monkeypatch.setattr(artifacts, "user_dir", lambda: tmp_path)
    assert dllm.find_dllm(loaded, "auto") is None and dllm.find_dllm(loaded, "none") is None
    path = random_delta(model).save(tmp_path / "d.safetensors", HFRunner(model).fingerprint())
    assert dllm.find_dllm(loaded, "auto") == path == dllm.find_dllm(loaded, str(path))
    with pytest.raises(SpecDecodeError, match="'auto', 'none'"):
        dllm.find_dllm(loaded, str(tmp_path / "missing.safetensors"))
