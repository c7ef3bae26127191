"""Runner for any ``transformers`` causal LM: one forward over a whole draft tree.

The tree is passed as an explicit 4-D additive attention mask (each node sees the committed
prefix, the root, its ancestors and itself) with depth-based position ids. ``commit`` moves the
accepted path's KV rows into place in the ``DynamicCache`` and crops the rest, so rejected
branches cost nothing after the step.

Early exit (Llama-layout models, :class:`HFExit`): a chain runs draft tokens through the first
layers with the model's own modules, writing their KV rows into those layers of the same cache;
closing the chain crops them, so verification is always the plain full forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.models.base import NOTHING, ForwardOutput, Needs, Runner
from specdecode.models.capabilities import EarlyExit, Tables
from specdecode.models.kv_cache import DynamicKVCache


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
        self.kv = DynamicKVCache()

    def replica(self) -> HFRunner:
        return HFRunner(self.model)

    @property
    def cache_len(self) -> int:
        return self.kv.length

    @property
    def pending_rows(self) -> int:
        return self.kv.pending

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes

    @property
    def cache(self):
        """The model's ``DynamicCache`` (what its layers read and append to)."""
        return self.kv.model_cache

    def fingerprint(self) -> str:
        embed = self.model.get_input_embeddings().weight
        sample = embed[:: max(1, embed.shape[0] // 64), :8].double().sum().item()
        return f"hf:{self.model.config.model_type}:{self.vocab_size}:{self.num_layers}:{sample:.6e}"

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int], needs: Needs = NOTHING) -> ForwardOutput:
        self._check_needs(needs)
        self.kv.reset()
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1, output_hidden_states=_wants_hidden(needs))
        self.kv.append(len(ids))
        return _output(out, needs)

    @torch.inference_mode()
    def forward(self, root: int, draft: Draft, needs: Needs = NOTHING) -> ForwardOutput:
        self._check_needs(needs)
        n = len(draft) + 1
        self.kv.begin_forward(n)
        past = self.kv.length
        input_ids = torch.tensor([(root,) + draft.tokens], dtype=torch.long)
        position_ids = (past + draft.position_offsets()).unsqueeze(0)
        allowed = torch.ones(n, past + n, dtype=torch.bool)
        allowed[:, past:] = draft.ancestor_mask()
        mask = torch.zeros(1, 1, n, past + n, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                         past_key_values=self.cache, use_cache=True,
                         output_hidden_states=_wants_hidden(needs))
        self.kv.pending = n
        return _output(out, needs)

    def commit(self, accepted: Sequence[int]) -> None:
        self.kv.commit(accepted)

    # ---- what some methods read of the target (models/capabilities.py) ---------------------

    @property
    def early_exit(self) -> HFExit:
        require(self.model.config.model_type in _EARLY_EXIT_TYPES and all(
                    hasattr(getattr(self.model, "model", None), a)
                    for a in ("embed_tokens", "layers", "norm", "rotary_emb")),
                f"early exit needs a Llama-layout model ({', '.join(sorted(_EARLY_EXIT_TYPES))}); "
                f"this one is '{self.model.config.model_type}'")
        return HFExit(self)

    @property
    def tables(self) -> HFTables:
        return HFTables(self.model)


class HFExit(EarlyExit):
    """Early exit with the model's own modules: a chain writes its KV rows into the first
    layers of the runner's ``DynamicCache``, cropped when the chain closes."""

    def __init__(self, runner: HFRunner):
        self.runner = runner
        self.num_layers = runner.num_layers

    @property
    def pending_rows(self) -> int:
        return self.runner.pending_rows

    def drop_chain(self) -> None:
        self.runner.kv.drop_uncommitted()

    @torch.inference_mode()
    def run_chain(self, tokens: list[int], layer: int, offset: int) -> torch.Tensor:
        runner = self.runner
        inner = runner.model.model
        n = len(tokens)
        start = runner.kv.length + offset
        hidden = inner.embed_tokens(torch.tensor([list(tokens)], dtype=torch.long))  # [1, n, H]
        positions = torch.arange(start, start + n)
        rope = inner.rotary_emb(hidden, positions.unsqueeze(0))
        mask = None  # one new token attends to everything before it
        if n > 1:  # a chain: causal over the new rows
            mask = torch.zeros(1, 1, n, start + n, dtype=runner.dtype)
            mask[..., start:] = torch.full((n, n), torch.finfo(runner.dtype).min).triu(1)
        for block in inner.layers[:layer]:
            hidden = block(hidden, attention_mask=mask, position_ids=positions.unsqueeze(0),
                           past_key_values=runner.cache, use_cache=True, cache_position=positions,
                           position_embeddings=rope)
            if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                hidden = hidden[0]
        return hidden[0]

    @torch.inference_mode()
    def norm(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        return self.runner.model.model.norm(hidden) if adapter is None else adapter(hidden)

    @torch.inference_mode()
    def head(self, normed: torch.Tensor) -> torch.Tensor:
        return self.runner.model.get_output_embeddings()(normed).float()


class HFTables(Tables):
    def __init__(self, model):
        self.model = model

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()

    def output_embeddings(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach()


#: model types whose decoder stack is embed_tokens -> layers(position_embeddings=rope) -> norm
_EARLY_EXIT_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _wants_hidden(needs: Needs) -> bool:
    return needs.final_hidden or bool(needs.layers)


def _output(out, needs: Needs) -> ForwardOutput:
    """A ForwardOutput from a transformers output: ``hidden_states[l]`` is layer l's output
    (index 0: the embeddings; the last one is after the final norm)."""
    final = out.hidden_states[-1][0].float() if needs.final_hidden else None
    layers = {layer: out.hidden_states[layer][0] for layer in needs.layers}
    return ForwardOutput(out.logits[0].float(), final, layers)
