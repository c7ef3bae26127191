"""The project's small dLLM as ``deer``'s drafter (``-c drafter=dllm``): DEER's own setting, a
diffusion LM drafts a block, the AR target verifies it (Cheng et al., 2025, "DEER: Draft with
Diffusion, Verify with Autoregressive Models", arXiv 2512.15176).

The dLLM is the target adapted into a block-diffusion model by the LoRA delta of ``specdecode
train dllm`` (diffusion/dllm.py), merged into fp32 weights on the native runner. Its
:class:`DiffusionModel` session holds the committed context as causal rows, as the diffusion
decode loop holds its finished blocks. Each step ONE forward
(:meth:`DiffusionModel.extend_and_denoise`) appends the committed tokens it has not read (the
accepted ones and the bonus token; rejected ones are rewound first, as the draft models'
caches rewind theirs, drafting/caches.py) and denoises a block of ``width`` mask positions
after the root. Logits are shifted (block position i is predicted by row i - 1, position 0 by
the root's), so the block gives a distribution per position: the interface of deer's learned
drafter (heads/drafter.py ``BlockDraftLM``), whose chain and tree ``deer`` builds unchanged
(``Draft.probs`` at T > 0, so verification stays exact).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch

from specdecode.drafting.caches import DraftCache
from specdecode.errors import SpecDecodeError, require


def target_model(runner) -> torch.nn.Module:
    """The ``transformers`` model behind a target runner, whose weights the dLLM delta adapts:
    the hf runner's own, or for a native runner the file or folder it was loaded from."""
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import load_model

    if isinstance(runner, HFRunner):
        model = runner.model
        # the delta loads onto fp32 weights (``dllm_runner`` casts in place): never the target's
        return model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model)
    source = str(getattr(runner, "source", "") or "")
    if source.endswith(".gguf") or (source and Path(source).is_dir()):
        return load_model(source).model
    raise SpecDecodeError(f"the dLLM drafter needs the target's weights, and this "
                          f"{type(runner).__name__} was built from {source or 'tensors in memory'}"
                          "; load the target from its GGUF file or checkpoint folder, or run it "
                          "on the hf runner (--runner hf)")


def open_dllm(runner, spec: str, width: int, weights: str = "fp32") -> tuple[DllmBlockLM, str]:
    """The draft cache of the dLLM delta ``spec`` names ('auto' or a file) for ``runner``'s
    model, merged in ``weights`` (diffusion/dllm.py ``merged_runner``), drafting blocks of
    ``width``, and where the delta came from."""
    from specdecode.diffusion.dllm import dllm_runner, find_dllm
    from specdecode.diffusion.model import DiffusionModel
    from specdecode.models.loading import LoadedModel

    require(spec != "none", "drafter=dllm needs a dLLM delta: dllm='auto' or a file")
    loaded = LoadedModel(target_model(runner), None, str(getattr(runner, "source", "")))
    path = find_dllm(loaded, spec)
    require(path is not None, "drafter=dllm: no dLLM delta was trained for this target; make "
                              "one with `specdecode train dllm` (or name one with -c dllm=PATH)")
    merged, delta = dllm_runner(loaded, path, weights)
    require(merged.vocab_size == runner.vocab_size,
            f"the dLLM has {merged.vocab_size} tokens but the target {runner.vocab_size}")
    return DllmBlockLM(DiffusionModel(merged, int(delta.config["mask_id"])), width), str(path)


class DllmBlockLM(DraftCache):
    """The dLLM behind ``BlockDraftLM``'s interface: :meth:`catch_up` scores the whole block in
    one forward; a tree node at depth d is scored by block position d (the block does not read
    drafted tokens), so :meth:`feed` runs nothing. Logits are over the whole vocabulary."""

    head_ids = None

    def __init__(self, model, width: int):
        require(width > 0, f"the dLLM's block needs at least one position, got {width}")
        self.model = model
        self.width = width
        self.vocab_size = model.runner.vocab_size
        self.hidden_size = model.runner.shape.hidden_size
        #: the committed tokens in the dLLM's cache (the last one's row gave the block's anchor)
        self.tokens: list[int] = []
        self.reset()

    def reset(self) -> None:
        """A new request: no block. The cached tokens stay: :meth:`catch_up` keeps as many as
        the new context starts with (a repeated prompt is not read again)."""
        self.block: torch.Tensor | None = None
        self._clear_tree()

    def _clear_tree(self) -> None:
        self.tree_tokens: list[int] = []
        self.tree_depth: list[int] = []

    def catch_up(self, context: Sequence[int]) -> tuple[torch.Tensor, None]:
        """Read the committed tokens not read yet and denoise the block after the root (its
        last token): the logits [V] of block position 0. No feature: nothing reads one."""
        self._clear_tree()
        n = self._reusable(context)
        if n == 0 and len(context) > 1:
            self.model.prefill(context[:-1])  # the prompt's rows in the prefill's blocks
            n = len(context) - 1
        else:
            self.model.rewind(n)
        self.block = self.model.extend_and_denoise(context[n:], self.width)
        self.tokens = list(context)
        return self.block[0], None

    def block_logits(self) -> torch.Tensor:
        """The logits [width, V] of every block position after the root."""
        return self.block

    def feed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, None]:
        depths = [1 if p < 0 else self.tree_depth[p] + 1 for p in parents]
        self.tree_tokens.extend(tokens)
        self.tree_depth.extend(depths)
        return self.block[depths], None

    def prune(self, path_rows: Sequence[int]) -> None:
        """Drop the tree: the accepted tokens are read with the next step's block."""
        self._clear_tree()
