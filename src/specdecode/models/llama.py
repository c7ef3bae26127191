"""Native runner for Llama-family models: a lean PyTorch forward with a static KV cache.

The architecture is LLaMA's (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation
Language Models"), as ``transformers``' ``modeling_llama`` computes it: RMSNorm, rotary position
embeddings with the checkpoint's rope settings, grouped-query attention, a SwiGLU MLP and a tied
or separate LM head. The static cache written at explicit positions follows gpt-fast
(pytorch-labs/gpt-fast, model.py); tree attention over a draft follows SpecInfer (Miao et al.
2023). What this file adds is *batch invariance*: a token's logits are bitwise the same whether
it is computed alone (``ar``), in a chain or in a 64-node tree, so every speculative method
reproduces this runner's ``ar`` exactly, not just up to rounding.

Where a forward's result could depend on the number of rows, it is made not to:

- matrix products: each weight format's kernel is row-invariant (see ``quant.py``; fp32 rows
  are padded to a multiple of 4 to keep MKL on one kernel);
- attention: the keys are split into chunks of ``CHUNK`` positions aligned to absolute
  position 0. Every (row, chunk) product is one fixed-shape GEMM, the softmax max is exact,
  chunk sums are added in a fixed pairwise tree of elementwise adds (``_sum_chunks``; ATen's
  ``sum`` is not row-invariant), and chunks past a row's position contribute exact zeros.
  A tree node sees its ancestors in the order ``ar`` will see them after the commit (their
  scores are gathered into that order and, in the chunks holding the tree, their values too),
  so the same numbers are added in the same order;
- SiLU is written as ``x / (1 + exp(-x))``: ATen's fused SiLU rounds differently in the
  vectorised body and the scalar tail of a tensor, so a row's result moved with the row count.

Defaults: int4 weights (``DEFAULT_WEIGHTS``: the fastest one-token forward of the four formats,
so the fastest ``ar`` and the fastest speculation where drafts are short; measured in
docs/native-runner.md), prompts prefilled through bf16 copies of the int4 weights
(``PREFILL_WEIGHTS``: every method prefills the same way, so exactness is untouched); ``CHUNK`` = 64 (GEMMs with a fixed inner size; larger chunks waste
more work on the last one); the cache holds ``max_context`` plus ``max_draft`` = 256 rows.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require
from specdecode.models.base import Runner
from specdecode.models.quant import INT4_GROUP, Int4Linear, check_format, make_linear, pad_rows

#: attention key chunk (positions); every attention GEMM has this inner size
CHUNK = 64
#: rows are padded to a multiple of this (row-invariant GEMMs: MKL sgemm, see quant.py)
ROW_MULTIPLE = 4
#: extra value columns: a column of ones (softmax denominator) and zeros to a multiple of 4
VALUE_PAD = 4
#: prefill runs prompts in blocks of this many rows (bounds the attention score buffer)
PREFILL_BLOCK = 128
#: ``extend`` (drafting) runs blocks of at least this many rows through the prefill layers
BULK_ROWS = 16
#: architectures (transformers ``model_type`` / GGUF ``general.architecture``) this runner runs
SUPPORTED = ("llama",)
#: weight format ``make_runner`` picks when none is asked for (see docs/native-runner.md)
DEFAULT_WEIGHTS = "int4"
#: weight format prompts are prefilled with, where it differs from the decode format: the int8
#: and int4 kernels' cost grows almost linearly with the rows (64 rows: 8-11x one row), bf16
#: GEMMs' far less (3x), so a 512-token prompt takes 1.08 s through int4 layers, 0.68 s through
#: bf16 ones (docs/native-runner.md)
PREFILL_WEIGHTS = {"int8": "bf16", "int4": "bf16"}
#: rope types whose frequencies do not depend on the sequence length
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_context: int
    tie_embeddings: bool

    @property
    def fits_int4(self) -> bool:
        """Whether every matrix's input size is a whole number of int4 groups."""
        inputs = (self.hidden_size, self.num_heads * self.head_dim, self.intermediate_size)
        return all(size % INT4_GROUP == 0 for size in inputs)

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        model_type = getattr(config, "model_type", "?")
        require(model_type in SUPPORTED,
                f"the native runner supports {', '.join(SUPPORTED)} models, not '{model_type}'; "
                "use the hf runner (--runner hf)")
        require(not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False),
                "the native runner has no attention or MLP biases; use --runner hf")
        act = getattr(config, "hidden_act", "silu")
        require(act == "silu", f"the native runner's MLP is SwiGLU, not '{act}'; use --runner hf")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_eps=float(config.rms_norm_eps),
            max_context=int(getattr(config, "max_position_embeddings", 2048)),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def runs(config) -> bool:
    """Whether the native runner runs a model of this transformers config."""
    try:
        LlamaShape.from_config(config)
        rope_frequencies(config)
    except SpecDecodeError:
        return False
    return True


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention scaling) from the checkpoint's rope
    settings, computed by ``transformers``' own rope initialisers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    require(kind in _STATIC_ROPE,
            f"rope type '{kind}' changes with the sequence length; the native runner supports "
            f"{', '.join(_STATIC_ROPE)}: use --runner hf")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(attention_scaling)


@dataclass(frozen=True)
class Q4Weight:
    """A 4-bit weight as a GGUF file holds it (Q4_0/Q4_1): w = scale * codes + minimum, with
    ``codes`` [out, in] in 0..15 and ``scale``, ``minimum`` [out, in / 32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        # the same float32 operations as gguf's dequantisation (product, then sum)
        q = self.codes.float().reshape(*self.scale.shape, -1)
        return (self.scale[..., None] * q + self.minimum[..., None]).reshape(self.codes.shape)

    @staticmethod
    def cat(parts: Sequence[Q4Weight]) -> Q4Weight:
        return Q4Weight(*(torch.cat([getattr(p, f) for p in parts])
                          for f in ("codes", "scale", "minimum")))


def _dense(tensors: dict, name: str) -> torch.Tensor:
    value = tensors[name]
    return (value.dequantize() if isinstance(value, Q4Weight) else value).float()


def _fused(parts: list, weights: str):
    """One linear layer for several weights sharing an input (q/k/v, gate/up): one kernel call."""
    if weights == "int4" and all(isinstance(p, Q4Weight) for p in parts):
        q4 = Q4Weight.cat(parts)
        return Int4Linear(q4.codes, q4.scale, q4.minimum)
    dense = [p.dequantize() if isinstance(p, Q4Weight) else p.float() for p in parts]
    return make_linear(torch.cat(dense), weights)


def _scaled(weight, factor: float):
    """``weight`` times ``factor`` (exact for a power of two, such as 1/sqrt(64))."""
    if isinstance(weight, Q4Weight):
        return Q4Weight(weight.codes, weight.scale * factor, weight.minimum * factor)
    return weight.float() * factor


def _sum_chunks(parts: torch.Tensor) -> torch.Tensor:
    """The sum over the first dimension as a pairwise tree of elementwise adds.

    ATen's ``sum(0)`` orders the additions differently in its vectorised body and its tail, so
    an element's sum depended on where it sat in the tensor, that is on how many rows shared
    the forward. Here every element is added in the same tree, and all-zero chunks at the end
    (a row's chunks past its position) leave every sum unchanged, x + 0 being x."""
    while parts.shape[0] > 1:
        n = parts.shape[0]
        pairs = parts[0:n - 1:2] + parts[1:n:2]
        parts = torch.cat([pairs, parts[n - 1:]]) if n % 2 else pairs
    return parts[0]


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: object
    o: object
    mlp_norm: torch.Tensor
    gate_up: object
    down: object


@dataclass
class _Plan:
    """How one forward's rows attend: built once, used by every layer."""

    rows: int           # query rows of each head's GEMMs: G m padded to ROW_MULTIPLE
    chunks: int         # key chunks holding the prefix and every new row
    blocked: torch.Tensor        # [rows, chunks' C] True where a row may not attend
    gather: torch.Tensor | None  # [KH, rows, chunks' C] key slot of each column (trees)
    tail_start: int = 0          # first chunk holding tree rows (trees)
    tail_slots: tuple | None = None  # (chunk, offset) [rows, tail C]: value slots (trees)


class LlamaRunner(Runner):
    """Llama forward with a static KV cache, tree attention and a choice of weight formats."""

    name = "native"
    supports_early_exit = True

    def __init__(self, config, tensors: dict, weights: str = "fp32", max_draft: int = 256,
                 source: str = ""):
        """``config``: a transformers ``LlamaConfig``; ``tensors``: Hugging Face parameter names
        -> float tensors or :class:`Q4Weight` (4-bit GGUF tensors, used as they are by int4)."""
        check_format(weights)
        shape = LlamaShape.from_config(config)
        self.shape = shape
        self.weights = weights
        self.source = source
        self.vocab_size = shape.vocab_size
        self.max_context = shape.max_context
        self.num_layers = shape.num_layers

        missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in tensors]
        require(not missing, f"checkpoint lacks {', '.join(missing)}: not a Llama checkpoint")
        self.embed = _dense(tensors, "model.embed_tokens.weight").contiguous()  # [V, H]
        require(tuple(self.embed.shape) == (shape.vocab_size, shape.hidden_size),
                f"embedding is {tuple(self.embed.shape)}, config says "
                f"({shape.vocab_size}, {shape.hidden_size})")
        self.final_norm = _dense(tensors, "model.norm.weight")
        head = "model.embed_tokens.weight" if shape.tie_embeddings else "lm_head.weight"
        if head not in tensors:  # checkpoints that tie the head without saying so
            head = "model.embed_tokens.weight"
        self.head, self.layers = self._linears(tensors, head, weights)
        # prompts go through PREFILL_WEIGHTS where the decode format's kernel costs more per
        # row for many rows (every prefill is the same computation, so exactness holds)
        bulk = PREFILL_WEIGHTS.get(weights, weights)
        self.prefill_weights = bulk
        self.prefill_head, self.prefill_layers = (
            (self.head, self.layers) if bulk == weights else self._linears(tensors, head, bulk))

        inv_freq, attention_scaling = rope_frequencies(config)
        require(inv_freq.numel() * 2 == shape.head_dim,
                f"rope has {inv_freq.numel() * 2} dimensions but heads have {shape.head_dim}; "
                "partial rotary embeddings need --runner hf")
        self.capacity = -(-(shape.max_context + max_draft) // CHUNK) * CHUNK
        freqs = torch.arange(self.capacity, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
        # q * cos + rotate_half(q) * sin with rotate_half(q) = (-q2, q1), as transformers
        # computes it, is q * (c, c) + (q2, q1) * (-s, s)
        self.cos = torch.cat([cos, cos], -1)[:, None, :]  # [capacity, 1, D]
        self.sin = torch.cat([-sin, sin], -1)[:, None, :]
        self._new_cache()

    def _new_cache(self) -> None:
        """An empty KV cache and decoding state of this runner's own."""
        shape = self.shape
        self.captured = {}
        self._capture: tuple[int, ...] = ()
        self._exit_rows = 0  # rows exit_forward wrote into the first layers this step
        self._exit_layer = 0
        kh, d = shape.num_kv_heads, shape.head_dim
        # Keys head-major, [layer, kv head, slot, D]: one score GEMM per head over all slots.
        # Values chunk-major, [layer, chunk, kv head, position in chunk, D + VALUE_PAD]: one
        # GEMM per (chunk, head), each operand contiguous. Empty, not zeros: untouched pages
        # cost no memory; _prepare() initialises chunks before first use (values must be
        # finite: a masked key still multiplies its value by 0).
        self.k_cache = torch.empty(shape.num_layers, kh, self.capacity, d)
        # values carry a column of ones: the softmax denominator comes out of the same GEMM;
        # and three of zeros: MKL takes other kernels for widths 5-7 and 9-11 (tiny models)
        self.v_cache = torch.empty(shape.num_layers, self.capacity // CHUNK, kh, CHUNK,
                                   d + VALUE_PAD)
        self._ready = 0  # chunks initialised
        self._len = 0
        self._pending = 0

    def _linears(self, tensors: dict, head: str, weights: str) -> tuple[object, list[_Layer]]:
        """The LM head and the layers with their matrices in format ``weights``."""
        shape = self.shape
        scale = shape.head_dim ** -0.5
        layers = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            try:
                layers.append(_Layer(
                    attn_norm=_dense(tensors, p + "input_layernorm.weight"),
                    # the attention scale 1/sqrt(D) folded into the query projection
                    qkv=_fused([_scaled(tensors[p + "self_attn.q_proj.weight"], scale)]
                               + [tensors[p + f"self_attn.{x}_proj.weight"] for x in "kv"],
                               weights),
                    o=_fused([tensors[p + "self_attn.o_proj.weight"]], weights),
                    mlp_norm=_dense(tensors, p + "post_attention_layernorm.weight"),
                    gate_up=_fused([tensors[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")],
                                   weights),
                    down=_fused([tensors[p + "mlp.down_proj.weight"]], weights),
                ))
            except KeyError as exc:
                raise SpecDecodeError(f"checkpoint lacks {exc.args[0]}: not a Llama checkpoint "
                                      "of the configured size") from None
        return _fused([tensors[head]], weights), layers

    # ---- constructors ---------------------------------------------------------------------

    @classmethod
    def from_transformers(cls, model, weights: str = "fp32", **kwargs) -> LlamaRunner:
        """From a loaded ``transformers`` Llama model (its weights are copied as float32)."""
        require(hasattr(model, "config") and hasattr(model, "state_dict"),
                f"expected a transformers causal LM, got {type(model).__name__}")
        LlamaShape.from_config(model.config)  # reject other architectures before copying
        tensors = {k: v.detach().float() for k, v in model.state_dict().items()}
        return cls(model.config, tensors, weights, source=type(model).__name__, **kwargs)

    @classmethod
    def from_safetensors(cls, path, weights: str = "fp32", **kwargs) -> LlamaRunner:
        """From a Hugging Face checkpoint folder (config.json + *.safetensors)."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        require(path.is_dir() and (path / "config.json").is_file() and bool(files),
                f"{path} is not a Hugging Face checkpoint folder (config.json + *.safetensors)")
        try:
            config = AutoConfig.from_pretrained(path)
            tensors = {}
            for file in files:
                tensors.update(load_file(file))
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            raise SpecDecodeError(f"cannot read checkpoint {path}: {exc}") from None
        return cls(config, tensors, weights, source=str(path), **kwargs)

    @classmethod
    def from_gguf(cls, path, weights: str = "fp32", **kwargs) -> LlamaRunner:
        """From a GGUF file read directly (4-bit tensors stay 4-bit for int4 weights)."""
        from specdecode.models.gguf_reader import read_gguf

        config, tensors = read_gguf(path)
        return cls(config, tensors, weights, source=str(path), **kwargs)

    def replica(self) -> LlamaRunner:
        twin = copy.copy(self)  # weights, rope tables: shared, read-only
        twin._new_cache()
        return twin

    # ---- the runner protocol --------------------------------------------------------------

    @property
    def cache_len(self) -> int:
        return self._len

    def fingerprint(self) -> str:
        # The same string the hf runner gives for the same weights: artifacts trained against
        # one runner serve the other (the embedding table is float32 in every weight format).
        embed = self.embed
        sample = embed[:: max(1, embed.shape[0] // 64), :8].double().sum().item()
        return f"hf:llama:{self.vocab_size}:{self.num_layers}:{sample:.6e}"

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        ids = list(ids)
        require(0 < len(ids) <= self.max_context,
                f"prefill needs 1..{self.max_context} tokens, got {len(ids)}")
        self._len = 0
        self._pending = 0
        self._exit_rows = 0
        return self._logits(self._append(ids, bulk_rows=1)[-1][-1:], self.prefill_head)[0]

    @torch.inference_mode()
    def forward(self, root: int, draft: Draft) -> torch.Tensor:
        require(self._pending == 0, "runner.forward called twice without commit")
        n = len(draft) + 1
        require(self._len + n <= self.capacity,
                f"the cache holds {self.capacity} rows; {self._len} are used and this draft "
                f"needs {n}: give a smaller draft or a larger max_draft")
        depths = (0,) + draft.depths
        self._exit_rows = 0  # the full pass overwrites the draft pass's rows
        hidden = self._forward((root,) + draft.tokens, depths, None if draft.is_chain else draft,
                               self._len, capture=self._capture)
        self._pending = n
        return self._logits(hidden)

    @torch.inference_mode()
    def commit(self, accepted: Sequence[int]) -> None:
        keep = len(accepted) + 1
        require(0 < keep <= self._pending,
                f"commit of {keep} rows after a forward of {self._pending}")
        if list(accepted) != list(range(len(accepted))):
            # the accepted path is not the first rows: move its rows next to the root's
            src = torch.tensor([self._len] + [self._len + 1 + i for i in accepted])
            dst = torch.arange(self._len, self._len + keep)
            self.k_cache[:, :, dst] = self.k_cache[:, :, src]
            v = self.v_cache
            v[:, dst // CHUNK, :, dst % CHUNK] = v[:, src // CHUNK, :, src % CHUNK]
        self._len += keep
        self._pending = 0

    # ---- early exit: shared KV, the draft pass's rows are overwritten by the verify pass ----

    @torch.inference_mode()
    def exit_forward(self, tokens: Sequence[int], exit_layer: int) -> torch.Tensor:
        self._check_exit_pass(exit_layer)
        start = self._len + self._exit_rows
        require(start + len(tokens) <= self.capacity,
                f"the cache holds {self.capacity} rows; the draft pass would need more")
        hidden = self._forward(list(tokens), tuple(range(len(tokens))), None, start,
                               stop=exit_layer)
        self._exit_rows += len(tokens)
        self._exit_layer = exit_layer
        return hidden

    def exit_norm(self, hidden: torch.Tensor, adapter=None) -> torch.Tensor:
        return self._norm(hidden.float(), self.final_norm) if adapter is None else adapter(hidden)

    @torch.inference_mode()
    def lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head(normed.to(self.head.in_dtype)).float()

    def capture_hidden(self, layers: Sequence[int]) -> None:
        for layer in layers:
            self._check_exit_layer(layer)
        self._capture = tuple(layers)
        self.captured = {}

    # ---- drafting for another runner (draft_model): the cache holds every token read -------

    @torch.inference_mode()
    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to the cache as read tokens and return their hidden states after
        the final norm [n, H], float32. For a runner that drafts: nothing it computes needs to
        match another pass bit for bit, so blocks of ``BULK_ROWS`` or more (a prompt) take the
        prefill layers."""
        tokens = list(tokens)
        require(self._pending == 0 and self._exit_rows == 0,
                "extend called between forward and commit")
        require(self._len + len(tokens) <= self.capacity,
                f"the cache holds {self.capacity} rows; {self._len} are used and "
                f"{len(tokens)} more do not fit")
        return self._norm(torch.cat(self._append(tokens, BULK_ROWS)), self.final_norm)

    def _append(self, tokens: list[int], bulk_rows: int) -> list[torch.Tensor]:
        """Run ``tokens`` as a chain after the cache, in blocks of ``PREFILL_BLOCK``, and keep
        them; blocks of ``bulk_rows`` rows or more take the prefill layers. Each block's last
        layer hidden states."""
        hidden = []
        for start in range(0, len(tokens), PREFILL_BLOCK):
            block = tokens[start:start + PREFILL_BLOCK]
            hidden.append(self._forward(block, tuple(range(len(block))), None, self._len,
                                        prefill=len(block) >= bulk_rows))
            self._len += len(block)
        return hidden

    def rewind(self, length: int) -> None:
        """Forget every cached token from position ``length`` on."""
        require(self._pending == 0 and 0 <= length <= self._len,
                f"cannot rewind a cache of {self._len} tokens to {length}")
        self._len = length
        self._exit_rows = 0

    # ---- the model ------------------------------------------------------------------------

    def _logits(self, hidden: torch.Tensor, head=None) -> torch.Tensor:
        head = head or self.head
        return head(self._norm(hidden, self.final_norm, head.in_dtype)).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # transformers' LlamaRMSNorm, operation for operation; the result in the dtype the
        # next matrix kernel takes
        return F.rms_norm(x, weight.shape, weight, self.shape.rms_eps).to(dtype)

    def _forward(self, tokens: Sequence[int], depths: Sequence[int], tree: Draft | None,
                 past: int, stop: int | None = None, capture: tuple[int, ...] = (),
                 prefill: bool = False) -> torch.Tensor:
        """Run ``tokens`` (row i at position ``past + depths[i]``) through the first ``stop``
        layers (all by default), writing their KV rows at slots ``past + i``. ``tree`` is the
        draft when the rows are not a chain; layers in ``capture`` keep their output in
        :attr:`captured`; ``prefill`` runs the prompt formats' layers. Returns the last layer's
        hidden states [n, hidden], float32."""
        s = self.shape
        n = len(tokens)
        layers, head = (self.prefill_layers, self.prefill_head) if prefill else (self.layers, self.head)
        multiple = head.row_multiple
        m = -(-n // multiple) * multiple  # rows through the layers
        positions = torch.zeros(m, dtype=torch.long)  # padding rows sit at position 0
        positions[:n] = past + torch.tensor(depths, dtype=torch.long)
        plan = self._plan(n, past, positions, tree)
        x = pad_rows(self.embed[torch.tensor(tokens)], multiple)  # [m, H] float32
        cos, sin = self.cos[positions], self.sin[positions]  # [m, 1, D]
        heads, kv_heads, d = s.num_heads, s.num_kv_heads, s.head_dim
        rotated = heads + kv_heads
        slots = torch.arange(past, past + n)
        chunk, offset = slots // CHUNK, slots % CHUNK
        if capture:
            self.captured = {}
        for i, layer in enumerate(layers[:stop]):
            qkv = layer.qkv(self._norm(x, layer.attn_norm, layer.qkv.in_dtype))
            qk = qkv[:, :rotated * d].view(m, rotated, d)  # q already scaled by 1/sqrt(D)
            swapped = qk.view(m, rotated, 2, d // 2).flip(2).view(m, rotated, d)
            qk = qk * cos + swapped * sin  # rotary embedding, [m, heads + kv heads, D]
            self.k_cache[i, :, past:past + n] = qk[:n, heads:].transpose(0, 1)
            self.v_cache[i][chunk, :, offset, :d] = qkv[:n, rotated * d:].view(n, kv_heads, d).float()
            x = x + layer.o(self._attend(qk[:, :heads], i, plan, layer.o.in_dtype))
            gate, up = layer.gate_up(self._norm(x, layer.mlp_norm, layer.gate_up.in_dtype)
                                     ).float().chunk(2, -1)  # [m, I] each
            x = x + layer.down((gate * up / (1 + torch.exp(-gate))).to(layer.down.in_dtype))
            if i + 1 in capture:
                self.captured[i + 1] = x[:n].clone()
        return x[:n]

    def _prepare(self, chunks: int) -> None:
        """Initialise cache chunks up to ``chunks`` (finite keys and values, value column 1)."""
        if chunks > self._ready:
            new = slice(self._ready, chunks)
            self.k_cache[:, :, self._ready * CHUNK:chunks * CHUNK] = 0
            self.v_cache[:, new] = 0
            self.v_cache[:, new, :, :, self.shape.head_dim] = 1
            self._ready = chunks

    def _plan(self, n: int, past: int, positions: torch.Tensor, tree: Draft | None) -> _Plan:
        s = self.shape
        groups = s.num_heads // s.num_kv_heads
        m = len(positions)  # rows through the layers (padding rows: position 0)
        rows = -(-groups * m // ROW_MULTIPLE) * ROW_MULTIPLE  # query rows of each head's GEMMs
        chunks = -(-(past + n) // CHUNK)  # chunks holding the prefix and every new row
        self._prepare(chunks)
        # query rows are (group, row) pairs, group-major; rows past G m pad the GEMMs and,
        # like the forward's padding rows, see slot 0 only
        limit = torch.zeros(rows, dtype=torch.long)
        limit[:groups * m] = positions.masked_fill(torch.arange(m) >= n, 0).repeat(groups)
        if tree is None:
            return _Plan(rows, chunks, torch.arange(chunks * CHUNK) > limit[:, None], None)
        # Ancestor order: row r's key for position past + j sits in the slot of its ancestor
        # at depth j (root: row 0). Columns past a row's own position are blocked anyway.
        virtual = -(-(past + max(tree.depths) + 1) // CHUNK)
        slots = torch.arange(virtual * CHUNK).clamp_max(past).repeat(m, 1)
        for r in range(1, n):
            path = tree.path_to(r - 1)
            slots[r, past + 1:past + 1 + len(path)] = past + 1 + torch.tensor(path)
        gather = torch.zeros(rows, virtual * CHUNK, dtype=torch.long)
        gather[:groups * m] = slots.repeat(groups, 1)
        start = past // CHUNK
        tail = slots[:, start * CHUNK:]
        return _Plan(rows, chunks, torch.arange(virtual * CHUNK) > limit[:, None],
                     gather.expand(s.num_kv_heads, -1, -1), start, (tail // CHUNK, tail % CHUNK))

    def _attend(self, q: torch.Tensor, layer: int, plan: _Plan,
                dtype: torch.dtype) -> torch.Tensor:
        """Attention of ``q`` [m, heads, D] over the cache (see the module docstring); the
        result [m, heads * D] in ``dtype``."""
        s = self.shape
        kh, d, rows, m = s.num_kv_heads, s.head_dim, plan.rows, q.shape[0]
        g = s.num_heads // kh
        qg = q.new_zeros(kh, rows, d)
        qg[:, :g * m] = q.reshape(m, kh, g, d).permute(1, 2, 0, 3).reshape(kh, g * m, d)
        scores = qg @ self.k_cache[layer, :, :plan.chunks * CHUNK].transpose(1, 2)  # [KH, rows, L]
        if plan.gather is not None:
            scores = scores.gather(2, plan.gather)  # ancestor order
        scores.masked_fill_(plan.blocked, float("-inf"))
        p = (scores - scores.amax(-1, keepdim=True)).exp_()
        chunks = p.shape[-1] // CHUNK
        p = p.view(kh, rows, chunks, CHUNK).permute(2, 0, 1, 3)  # [chunks, KH, rows, C]
        values = self.v_cache[layer]  # [all chunks, KH, C, D + VALUE_PAD]
        if plan.gather is None:
            out = p @ values[:chunks]  # [chunks, KH, rows, D + VALUE_PAD]
        else:
            t0 = plan.tail_start
            head = p[:t0] @ values[:t0]
            # chunks holding tree rows: each row with its own values, in ancestor order; the
            # G query rows of one row form one GEMM, padded to 4 rows like every other
            tail = chunks - t0
            pt = p[t0:, :, :g * m].reshape(tail, kh, g, m, CHUNK).permute(1, 3, 0, 2, 4)
            gp = -(-g // ROW_MULTIPLE) * ROW_MULTIPLE
            if gp != g:
                pt = torch.cat([pt, pt.new_zeros(kh, m, tail, gp - g, CHUNK)], 3)
            chunk, offset = plan.tail_slots  # [m, tail C]
            vt = values[chunk, :, offset].permute(2, 0, 1, 3).reshape(kh, m, tail, CHUNK, -1)
            out = (pt @ vt)[:, :, :, :g]  # [KH, m, tail, G, D + VALUE_PAD]
            out = out.permute(2, 0, 3, 1, 4).reshape(tail, kh, g * m, -1)
            if rows > g * m:
                out = torch.cat([out, out.new_zeros(tail, kh, rows - g * m, out.shape[-1])], 2)
            out = torch.cat([head, out])
        out = _sum_chunks(out)  # [KH, rows, D + VALUE_PAD]
        out = (out[:, :g * m, :d] / out[:, :g * m, d:d + 1]).view(kh, g, m, d)
        return out.permute(2, 0, 1, 3).to(dtype).reshape(m, kh * g * d)
