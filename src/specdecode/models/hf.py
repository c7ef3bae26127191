"""Runner for any ``transformers`` causal LM: one forward over a whole draft tree.

The tree is passed as an explicit 4-D additive attention mask (each node sees the committed
prefix, the root, its ancestors and itself) with depth-based position ids. ``commit`` moves the
accepted path's KV rows into place in the ``DynamicCache`` and crops the rest, so rejected
branches cost nothing after the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.models.base import Runner


class HFRunner(Runner):
    name = "hf"

    def __init__(self, model):
        require(hasattr(model, "config") and hasattr(model, "forward"),
                f"expected a transformers causal LM, got {type(model).__name__}")
        self.model = model.eval()
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.num_layers = int(getattr(config, "num_hidden_layers", 0))
        self.dtype = next(model.parameters()).dtype
        self.cache = DynamicCache()
        self._len = 0
        self._pending = 0  # rows appended by the last forward, not yet committed

    @property
    def cache_len(self) -> int:
        return self._len

    def fingerprint(self) -> str:
        embed = self.model.get_input_embeddings().weight
        sample = embed[:: max(1, embed.shape[0] // 64), :8].double().sum().item()
        return f"hf:{self.model.config.model_type}:{self.vocab_size}:{self.num_layers}:{sample:.6e}"

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        self.cache = DynamicCache()
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1)
        self._len = len(ids)
        self._pending = 0
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def forward(self, root: int, draft: Draft) -> torch.Tensor:
        require(self._pending == 0, "runner.forward called twice without commit")
        n = len(draft) + 1
        past = self._len
        input_ids = torch.tensor([(root,) + draft.tokens], dtype=torch.long)
        position_ids = (past + draft.position_offsets()).unsqueeze(0)
        allowed = torch.ones(n, past + n, dtype=torch.bool)
        allowed[:, past:] = draft.ancestor_mask()
        mask = torch.zeros(1, 1, n, past + n, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                         past_key_values=self.cache, use_cache=True)
        self._pending = n
        return out.logits[0].float()

    @torch.inference_mode()  # the cache tensors were made in inference mode
    def commit(self, accepted: Sequence[int]) -> None:
        keep = len(accepted) + 1
        if list(accepted) != list(range(len(accepted))):
            # the accepted path is not the first rows: move its rows next to the root's
            rows = torch.tensor([self._len] + [self._len + 1 + i for i in accepted])
            for layer in self.cache.layers:
                layer.keys[:, :, self._len:self._len + keep] = layer.keys[:, :, rows]
                layer.values[:, :, self._len:self._len + keep] = layer.values[:, :, rows]
        self._len += keep
        self._pending = 0
        self.cache.crop(self._len)
