"""The checks every model family's tests run on a tiny random-weight model (test helpers, not
shipped: ``from model_checks import ...``): logits against ``transformers``' own forward, tree
rows bitwise equal to each row alone, greedy tokens equal to ``generate``, and every method
equal to ``ar``."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from specdecode import kernels
from specdecode.api import Decoder
from specdecode.draft import Draft
from specdecode.models.hf import HFRunner
from specdecode.models.llama import LlamaRunner

from conftest import alone_logits
from test_exactness import tiny_overrides

#: methods that draft with the target's own int4 copy: their target is a precise one (here the
#: transformers model, which the int4 copy is quantised from)
PRECISE_TARGET = ("quantized", "hierspec", "pearl")


def reference(model, ids) -> torch.Tensor:
    """transformers' logits of the last position of ``ids``, the whole sequence in one call
    (its own causal and sliding-window masks)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(got.argmax(), expected.argmax())
    relative = float((got - expected).abs().max() / expected.abs().max())
    assert relative < 1e-5, relative


def check_tree_logits(model, native: LlamaRunner, prompt: Sequence[int], tree: Draft,
                      root: int = 5) -> None:
    """The prompt's and every node's logits (``root`` then ``tree`` after the prompt) within
    1e-5 of transformers' forward of the node's whole sequence."""
    assert_close(native.prefill(list(prompt)).logits[0], reference(model, list(prompt)))
    logits = native.forward(root, tree).logits
    for node in range(-1, len(tree)):
        path = tree.path_to(node) if node >= 0 else []
        assert_close(logits[node + 1], reference(model, [*prompt, root] + [tree.tokens[i] for i in path]))


def check_rows_alone_bitwise(runner: LlamaRunner, prompt_length: int,
                             before_forward: Callable[[], None] = lambda: None) -> None:
    """Every row of a random 15-node tree after a random prompt bitwise equal to the same row
    computed alone, after its path's ancestors (``before_forward`` runs after the prefill)."""
    rng = random.Random(1)
    prompt = [rng.randrange(96) for _ in range(prompt_length)]
    draft = Draft(tuple(rng.randrange(96) for _ in range(15)), tuple(rng.randrange(-1, i) for i in range(15)))
    runner.prefill(prompt)
    before_forward()
    together = runner.forward(7, draft).logits
    runner.commit([])
    for node in [i for i in range(len(draft)) if not draft.children(i)]:
        path = draft.path_to(node)
        rows = alone_logits(runner, prompt, [7] + [draft.tokens[i] for i in path])
        for row, i in zip(rows, [-1] + path):
            assert torch.equal(row, together[i + 1]), (runner.weights, node, i)


def check_fused_experts(moe, hidden_size: int) -> None:
    """A MoE layer's fused experts kernel gives the bits of its torch loop, and each row alone
    the bits it has among the others."""
    assert moe.fused is not None
    h = torch.randn(13, hidden_size)
    chosen, weights = moe.picks(h)
    fused = moe.fused.forward(h, chosen, weights, kernels.isa())
    assert torch.equal(fused, moe._experts(h, chosen, weights))
    for r in range(len(h)):
        alone = moe.fused.forward(h[r:r + 1], chosen[r:r + 1], weights[r:r + 1], kernels.isa())
        assert torch.equal(alone, fused[r:r + 1]), r


def check_greedy_matches_generate(model, native: LlamaRunner, prompts: Sequence[Sequence[int]],
                                  new_tokens: int) -> None:
    """``ar``'s greedy tokens on the native runner equal transformers' ``generate``'s."""
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                 max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        ar = Decoder(native, None, "ar", eos_token_ids=[]).start(list(prompt), new_tokens).run()
        assert ar == out[0, len(prompt):].tolist(), prompt


def check_method_equals_ar(model, method: str, prompts: Sequence[Sequence[int]],
                           new_tokens: int) -> None:
    """``method``'s greedy tokens equal ``ar``'s on the int4 native runner of ``model`` (on the
    transformers model itself for methods that draft with its int4 copy)."""
    runner = HFRunner(model) if method in PRECISE_TARGET else LlamaRunner.from_transformers(model, "int4")
    decoder = Decoder(runner, None, method, eos_token_ids=[], **tiny_overrides(method, runner))
    for prompt in prompts:
        ar = Decoder(runner, None, "ar", eos_token_ids=[]).start(list(prompt), new_tokens).run()
        assert decoder.start(list(prompt), new_tokens).run() == ar, (method, prompt)
