"""The masked-diffusion forward over the native runner: block diffusion with a shared AR cache.

A block of ``block_size`` positions after the committed text starts as mask tokens; each
denoising step runs the whole block in one forward, every row seeing the committed rows (the KV
cache) and *every* row of its block (bidirectional inside the block: BD3-LM, Arriola et al.
2025, "Block Diffusion"), and returns logits for every position of the block. When the block is
fully committed its tokens are appended to the cache as ordinary causal rows.

Two choices, both from the AR-to-diffusion adaptation papers (DiffuGPT/DiffuLLaMA, Gong et al.
2024; Dream, Ye et al. 2025):

- **Shifted logits.** Position i is predicted by the row at position i - 1, as the AR model the
  dLLM is adapted from predicts its next token. Position 0 of a block is predicted by the last
  committed row, whose logits the prefill or the previous block's append already gave: so with
  one token per step, left to right, an untrained adaptation *is* the AR model.
- **Committed rows are causal.** A committed block's KV rows are the rows the AR forward writes
  for those tokens (each sees the ones before it), so the cache is an ordinary AR cache; only
  the block being denoised is bidirectional. (BD3-LM recomputes a finished block with
  bidirectional attention inside it; that would cost a pass per block and make the cache unlike
  the AR model's.)

The mask token is an id the model's vocabulary has and the text never uses (``mask_id``): the
tiny test models' last id; for SmolLM2 its unused ``<empty_output>`` (:func:`default_mask_id`).
Attention runs in the native kernels through :class:`AttentionPlan` key lists: a row lists its
block's slots, so the kernels need nothing new. Several *states* of one block (FreeDave's
drafts) run in one forward, each a copy of the block at scratch slots past the committed rows,
seeing only its own copy; the runner's rows are batch invariant, so a state's logits are
bitwise the same alone or beside others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.errors import require
from specdecode.models.kv_cache import AttentionPlan


def default_mask_id(tokenizer, vocab_size: int) -> int:
    """The tokenizer's mask token; else an added token no chat uses (SmolLM2's
    ``<empty_output>``); else the vocabulary's last id."""
    for candidate in (getattr(tokenizer, "mask_token_id", None),
                      (getattr(tokenizer, "get_vocab", dict)() or {}).get("<empty_output>")):
        if isinstance(candidate, int) and 0 <= candidate < vocab_size:
            return candidate
    return vocab_size - 1


class DiffusionModel:
    """A native :class:`~specdecode.models.llama.LlamaRunner` run as a block-diffusion model.
    Counts its forwards (``forwards``; a prefill or an append counts one)."""

    def __init__(self, runner, mask_id: int):
        require(hasattr(runner, "layer_loop"),
                f"diffusion decoding needs the native runner (--runner native), got "
                f"{getattr(runner, 'name', type(runner).__name__)}")
        require(0 <= mask_id < runner.vocab_size,
                f"mask_id {mask_id} is outside the vocabulary (0..{runner.vocab_size - 1})")
        self.runner = runner
        self.loop = runner.layer_loop
        self.mask_id = mask_id
        self.forwards = 0
        #: logits [V] of the last committed row: the prediction for the next block's position 0
        self._anchor: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Committed positions (prompt and output)."""
        return self.runner.cache.length

    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int]) -> None:
        """Start a sequence: the prompt's rows, causal, as the AR model writes them."""
        self._anchor = self.runner.prefill(list(prompt)).logits[-1].float()
        self.forwards += 1

    @torch.inference_mode()
    def append(self, tokens: Sequence[int]) -> None:
        """Commit a finished block: its rows join the cache as causal rows."""
        hidden, _ = self.loop.append(tokens, bulk_rows=10**9)[-1]
        self._anchor = self.loop.logits(hidden[-1:])[0]
        self.forwards += 1

    def rewind(self, length: int) -> None:
        """Forget the committed positions from ``length`` on (a drafter's rejected tokens); the
        next :meth:`extend_and_denoise` appends from there and gives the anchor again."""
        self.runner.cache.rewind(length)
        self._anchor = None

    @torch.inference_mode()
    def extend_and_denoise(self, tokens: Sequence[int], width: int) -> torch.Tensor:
        """:meth:`append` ``tokens`` and :meth:`denoise` a block of ``width`` mask positions
        after them, in one forward (a drafter's step: the committed tokens it has not read, then
        its block): ``tokens``' rows are causal and committed, the block's see them and each
        other and are dropped. Logits [width, V], shifted (position 0: the last token's row)."""
        tokens = list(tokens)
        require(width > 0, f"the block needs at least one position, got {width}")
        require(bool(tokens) or self._anchor is not None,
                "prefill a prompt (or give tokens) before denoising")
        n, past = len(tokens), self.length
        rows = n + width
        self.runner.cache.check_room(rows, f"{n} tokens and a block of {width}")
        slots = past + torch.arange(rows)
        keys = slots.to(torch.int32).expand(rows, rows).contiguous()
        # a token's row sees the ones up to it; a block row sees every row of the forward
        lengths = torch.cat([torch.arange(1, n + 1), torch.full((width,), rows)]).to(torch.int32)
        hidden, _ = self.loop.run(tokens + [self.mask_id] * width,
                                    AttentionPlan(past, slots, slots, keys, lengths))
        self.runner.cache.append(n)
        self.runner.cache.drop_uncommitted()
        self.forwards += 1
        # shifted: the last token's row predicts position 0, block row i - 1 position i
        first = max(n - 1, 0)
        logits = self.loop.logits(hidden[first:n + width - 1])
        if n:
            self._anchor = logits[0]
            return logits
        return torch.cat([self._anchor[None], logits])

    def denoise(self, block: Sequence[int]) -> torch.Tensor:
        """Logits [B, V] of every position of ``block`` (mask ids where not committed)."""
        return self.denoise_states([block])[0]

    @torch.inference_mode()
    def denoise_states(self, states: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Logits [B, V] per state, every state one version of the current block, in one
        forward: state s's rows sit at scratch slots ``length + s B ..`` and see the committed
        rows and their own state's rows."""
        require(self._anchor is not None, "prefill a prompt before denoising")
        sizes = {len(state) for state in states}
        require(len(sizes) == 1 and 0 not in sizes, "every state is one non-empty block")
        width, past = sizes.pop(), self.length
        count = len(states)
        self.runner.cache.check_room(count * width, f"{count} block states of {width}")
        offsets = torch.arange(width)
        slots = past + torch.arange(count * width)  # [S B]
        keys = (past + (torch.arange(count) * width)[:, None, None] + offsets[None, None, :]
                ).expand(count, width, width).reshape(count * width, width).to(torch.int32)
        plan = AttentionPlan(past, (past + offsets).repeat(count), slots, keys.contiguous(),
                             torch.full((count * width,), width, dtype=torch.int32))
        tokens = [token for state in states for token in state]
        hidden, _ = self.loop.run(tokens, plan)  # [S B, H]
        self.runner.cache.drop_uncommitted()
        self.forwards += 1
        rows = self.loop.logits(hidden).view(count, width, -1)
        # shifted: position i's logits are row i - 1's; position 0's the last committed row's
        anchor = self._anchor.expand(count, 1, -1)
        return list(torch.cat([anchor, rows[:, :-1]], 1).unbind(0))

    @torch.inference_mode()
    def denoise_rows(self, block: Sequence[int], rows: Sequence[int], see: int
                     ) -> tuple[torch.Tensor, list[int]]:
        """Window-Diffusion's partial step: recompute only the block rows ``rows`` (offsets),
        each seeing the committed rows and the block's first ``see`` slots, whose other rows
        keep the keys and values an earlier step of this block wrote there (a cache, stale by
        design); rows at ``see`` and after are neither run nor seen. Logits [B, V] (zeros
        where not computed) and the positions they were computed for (0: the last committed
        row's; i: row i - 1's)."""
        require(self._anchor is not None, "prefill a prompt before denoising")
        rows = sorted(rows)
        require(bool(rows) and 0 <= rows[0] and rows[-1] < see <= len(block),
                f"rows {rows} must lie inside the first {see} of {len(block)} positions")
        past = self.length
        at = past + torch.tensor(rows)
        keys = (past + torch.arange(see, dtype=torch.int32)).expand(len(rows), see).contiguous()
        plan = AttentionPlan(past, at, at, keys, torch.full((len(rows),), see, dtype=torch.int32))
        hidden, _ = self.loop.run([block[i] for i in rows], plan)  # [n, H]
        self.runner.cache.drop_uncommitted()
        self.forwards += 1
        out = self.loop.logits(hidden)  # [n, V]
        logits = torch.zeros(len(block), out.shape[-1])
        logits[0] = self._anchor
        computed = [0]
        for j, row in enumerate(rows):
            if row + 1 < len(block):
                logits[row + 1] = out[j]
                computed.append(row + 1)
        return logits, sorted(set(computed))
