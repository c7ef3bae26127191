"""Constraints on the output: grammars (JSON schema, regex, Lark/EBNF) and banned outputs, as
per-node token masks.

A :class:`ConstraintSpec` is what a request asks for (frozen; it travels inside
:class:`~specdecode.sampling.SamplingParams` as ``constraint``); :meth:`ConstraintSpec.start`
gives one generation its :class:`Constraint`, which follows the committed tokens and answers for
any draft path below them:

- ``allowed(path)``: the tokens the constraint permits after committed + ``path`` ([V] bool).
  The verifier masks the target's logits of each node with its own path's mask, so greedy
  takes the argmax of the masked logits and sampling draws from the masked, renormalised
  distribution: exactly what plain decoding under the same constraint does.
- ``permits(path, token)``: one token's verdict, read from the grammar's bitmask without
  building the [V] tensor (the greedy walk's fast path: when the unmasked argmax is allowed it
  is the masked argmax too).
- ``prune(draft)``: drops draft nodes the constraint rejects before the target sees them.
- ``forced()``: the one token allowed after the committed tokens, if only one is (a grammar's
  fixed key or brace): the engine commits it without a target forward (jump-forward). Only a
  single-token mask is forced: a grammar's forced *bytes* may be tokenized several ways, and
  committing the canonical tokenization would change what ``ar`` gives.

Grammars are compiled and matched by llguidance (Microsoft's Low-level Guidance; the grammar
engine behind OpenAI-style structured output in vLLM and SGLang), never by a parser of ours.
A banned output is a string (matched in the decoded bytes of the output, across token
boundaries) or a token sequence; a token that would complete one is masked, the general form of
vulnerability-constrained decoding's banned labels (Storhaug et al. 2023).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from specdecode.detokenize import special_ids
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError, require

#: JSON the grammar asks for: compact separators, as ``json.dumps(separators=(",", ":"))``;
#: flexible whitespace would let a small model pad forever
JSON_OPTIONS = {"whitespace_flexible": False}


class Vocabulary:
    """A tokenizer as the grammar engine and string bans see it: each token id's bytes, and
    llguidance's tokenizer over the model's ``vocab_size`` ids with ``eos_ids`` ending a
    finished grammar. Built once per tokenizer (about half a second) and shared by requests.

    ``tokenizer`` is a ``transformers`` fast tokenizer, or a list of token byte strings (ids in
    order; ``b""`` = a special token) for models without one (tests)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        import llguidance

        require(len(tokenizer) <= vocab_size,
                f"the tokenizer has {len(tokenizer)} tokens, more than the model's {vocab_size}")
        require(len(eos_ids) > 0, "a constrained generation needs an end-of-sequence token id")
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(int(e) for e in eos_ids)
        if isinstance(tokenizer, (list, tuple)):
            self._bytes = [bytes(t) for t in tokenizer]
        else:
            # each token's bytes from the tokenizer itself: llguidance's own reading of a
            # tokenizer.json misreads some decoders (a GGUF-converted byte-level BPE came out
            # with its raw "Ċ" for a newline, so a grammar let a raw newline into a JSON string)
            self._bytes = _token_bytes(tokenizer)
        self._bytes += [b""] * (vocab_size - len(self._bytes))  # ids the tokenizer never makes
        names = ([] if isinstance(tokenizer, (list, tuple))
                 else tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
        self.ll = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteTokens(self._bytes, self.eos_ids[0], names)),
            n_vocab=vocab_size, eos_token=list(self.eos_ids))

    def __reduce__(self):
        # llguidance's tokenizer does not pickle: a copy in another process (a Ray replica)
        # is built again from the tokenizer
        return (Vocabulary, (self._source, self.vocab_size, self.eos_ids))

    @property
    def token_bytes(self) -> list[bytes]:
        """Bytes each token adds to the decoded text (special tokens add none, as in a
        ``skip_special_tokens`` decode)."""
        return self._bytes


def _token_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes: byte-level BPE pieces mapped back through GPT-2's byte alphabet;
    other tokenizers by decoding each token after another one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteLevel" not in str(backend.pre_tokenizer):
        return _decoded_bytes(tokenizer)
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    alphabet = {c: b for b, c in bytes_to_unicode().items()}
    special = special_ids(tokenizer)
    out = []
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or piece is None:
            out.append(b"")
        elif all(c in alphabet for c in piece):
            out.append(bytes(alphabet[c] for c in piece))
        else:  # an added (non-special) token is stored as its text
            out.append(piece.encode("utf-8"))
    return out


def _decoded_bytes(tokenizer) -> list[bytes]:
    """Each token's bytes as it decodes after another token (so a leading-space marker reads
    as the space it stands for); special tokens get none."""
    special = special_ids(tokenizer)
    anchor = next(i for i in range(len(tokenizer)) if i not in special)
    base = tokenizer.decode([anchor])
    return [b"" if i in special else
            tokenizer.decode([anchor, i])[len(base):].encode("utf-8")
            for i in range(len(tokenizer))]


#: llguidance's mark of a special token's bytes: this byte (never in UTF-8 text), then its name
SPECIAL_MARK = b"\xff"


class _ByteTokens:
    """llguidance's tokenizer protocol over a plain list of token bytes, encoding by greedy
    longest match. A special token (no bytes) is given to llguidance as its mark and its name
    (``names``, else ``[id]``): as no bytes, llguidance's masks let the special tokens a
    grammar does not name through wherever text may go on (an empty string continues any
    text), and the grammar then failed on the token it had allowed."""

    bos_token_id = None

    def __init__(self, tokens: list[bytes], eos: int, names: Sequence[str | None] = ()):
        self.tokens = [t or SPECIAL_MARK + ((names[i] if i < len(names) else None)
                                            or f"[{i}]").encode("utf-8")
                       for i, t in enumerate(tokens)]
        self.eos_token_id = eos
        self.special_token_ids = [i for i, t in enumerate(tokens) if not t]
        self._longest = max(len(t) for t in tokens)
        self._ids = {t: i for i, t in reversed(list(enumerate(tokens))) if t}

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, str):  # llguidance passes text when its bytes probe failed
            text = text.encode("utf-8")
        ids, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                if text[i:i + n] in self._ids:
                    ids.append(self._ids[text[i:i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"byte {text[i:i + 1]!r} has no token")
        return ids


@dataclass(frozen=True, eq=False)
class ConstraintSpec:
    """What one request constrains: an llguidance grammar (compiled, checked) and banned
    outputs. Build it with :func:`make_constraint`."""

    vocabulary: Vocabulary
    #: llguidance grammar (the JSON form of ``LLMatcher.grammar_from_*``); None = no grammar
    grammar: str | None = None
    #: token sequences that must never appear in the output
    banned_sequences: tuple[tuple[int, ...], ...] = ()
    #: UTF-8 strings that must never appear in the decoded output
    banned_strings: tuple[bytes, ...] = ()
    #: for messages: what was asked ("json_schema", "regex", "grammar", "json_object", "ban")
    kinds: tuple[str, ...] = ()
    #: commit forced tokens without a target forward; False sends each through the verifier
    #: like any other token (the same tokens; for measuring what jump-forward saves)
    jump_forward: bool = True
    _tables: dict = field(default_factory=dict, repr=False)

    def start(self) -> Constraint:
        """The state of one generation, before any output token."""
        return Constraint(self)

    def completing(self, ban: bytes, k: int) -> torch.Tensor:
        """[V] bool: tokens whose bytes hold ``ban[k:]`` from their start (k > 0), or hold the
        whole of ``ban`` anywhere (k = 0). Computed once per ban and split."""
        key = (ban, k)
        if key not in self._tables:
            part = ban[k:]
            test = (lambda t: t.startswith(part)) if k else (lambda t: part in t)
            self._tables[key] = torch.tensor([test(t) for t in self.vocabulary.token_bytes])
        return self._tables[key]


def make_constraint(vocabulary: Vocabulary, *, json_schema: Any = None, regex: str | None = None,
                    grammar: str | None = None, json_object: bool = False,
                    banned: Sequence[str | Sequence[int]] = (),
                    jump_forward: bool = True) -> ConstraintSpec | None:
    """A checked :class:`ConstraintSpec` (None when nothing is constrained). At most one of
    ``json_schema`` (a dict or its JSON text), ``regex``, ``grammar`` (Lark, or GBNF/EBNF with
    ``::=`` rules) and ``json_object`` (any JSON object). Raises :class:`SpecDecodeError`
    carrying llguidance's own message for a grammar it cannot compile."""
    import llguidance

    asked = [name for name, value in (("json_schema", json_schema), ("regex", regex),
                                      ("grammar", grammar), ("json_object", json_object))
             if value not in (None, False)]
    require(len(asked) <= 1, f"give at most one of json_schema, regex, grammar and json_object; "
                             f"got {', '.join(asked)}")
    compiled = None
    if json_object:
        json_schema = {"type": "object"}
    if json_schema is not None:
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except ValueError as exc:
                raise SpecDecodeError(f"the JSON schema is not valid JSON: {exc}") from None
        require(isinstance(json_schema, dict),
                f"a JSON schema must be a JSON object, got {type(json_schema).__name__}")
        try:
            compiled = llguidance.LLMatcher.grammar_from_json_schema(json_schema,
                                                                     defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise SpecDecodeError(f"invalid JSON schema: {exc}") from None
    elif regex is not None:
        require(isinstance(regex, str) and regex != "", "regex must be a non-empty string")
        compiled = llguidance.LLMatcher.grammar_from_regex(regex)
    elif grammar is not None:
        require(isinstance(grammar, str) and grammar.strip() != "",
                "grammar must be a non-empty Lark or EBNF text")
        if "::=" in grammar:  # GBNF (llama.cpp's EBNF): llguidance converts it to Lark
            try:
                grammar = llguidance.gbnf_to_lark.gbnf_to_lark(grammar)
            except Exception as exc:  # its converter's own parse errors
                raise SpecDecodeError(f"invalid EBNF grammar: {exc}") from None
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    if compiled is not None:
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled,
                                                                             vocabulary.ll)
        if error:
            raise SpecDecodeError(f"invalid {asked[0].replace('_', ' ')}: {messages[0]}")
    strings, sequences = _split_bans(banned, vocabulary.vocab_size)
    if compiled is None and not strings and not sequences:
        return None
    return ConstraintSpec(vocabulary, compiled, sequences, strings,
                          tuple(asked) + (("ban",) if banned else ()), jump_forward=jump_forward)


def _split_bans(banned, vocab_size: int) -> tuple[tuple[bytes, ...], tuple[tuple[int, ...], ...]]:
    require(not isinstance(banned, (str, bytes)),
            "banned takes a list of strings and token-id lists, not one string")
    strings: list[bytes] = []
    sequences: list[tuple[int, ...]] = []
    for item in banned:
        if isinstance(item, str):
            require(item != "", "a banned string must not be empty")
            strings.append(item.encode("utf-8"))
        else:
            ids = tuple(item)
            require(len(ids) > 0 and all(isinstance(t, int) and not isinstance(t, bool)
                                         and 0 <= t < vocab_size for t in ids),
                    f"a banned token sequence must be a non-empty list of token ids in "
                    f"0..{vocab_size - 1}, got {item!r}")
            sequences.append(ids)
    return tuple(strings), tuple(sequences)


class Constraint:
    """One generation's constraint state: follows the committed output (:meth:`commit`) and
    answers for draft paths below it. Masks are cached per path until the next commit."""

    def __init__(self, spec: ConstraintSpec):
        import llguidance

        self.spec = spec
        self.vocab_size = spec.vocabulary.vocab_size
        self.matcher = None
        if spec.grammar is not None:
            self.matcher = llguidance.LLMatcher(spec.vocabulary.ll, spec.grammar, log_level=0)
            if self.matcher.is_error():  # validated when built; kept as a guard
                raise SpecDecodeError(f"the grammar cannot start: {self.matcher.get_error()}")
        self._longest_ban = max((len(s) for s in spec.banned_strings), default=0)
        self._longest_seq = max((len(s) for s in spec.banned_sequences), default=0)
        self.output: list[int] = []
        #: the end of the output's decoded bytes, as long as the longest banned string needs
        self._tail = b""
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._bitmasks: dict[tuple[int, ...], bytes] = {}

    # ---- the committed output ---------------------------------------------------------------

    def commit(self, tokens: Sequence[int]) -> None:
        """``tokens`` joined the output (end-of-sequence tokens are not fed to the grammar:
        they end the generation)."""
        if not tokens:
            return
        self._masks.clear()
        self._bitmasks.clear()
        eos = self.spec.vocabulary.eos_ids
        for token in tokens:
            if token in eos:
                break
            if self.matcher is not None:
                require(self.matcher.consume_token(token),
                        f"token {token} breaks the grammar: {self.matcher.get_error()}")
            self.output.append(token)
            self._tail = self._extend(self._tail, token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more: the generation stops here."""
        return self.matcher is not None and self.matcher.is_stopped()

    def forced(self) -> int | None:
        """The only token allowed after the committed output, if exactly one is."""
        allowed = self.allowed(())
        if int(allowed.sum()) != 1:
            return None
        return int(allowed.nonzero()[0, 0])

    # ---- draft paths below it ---------------------------------------------------------------

    def allowed(self, path: Sequence[int]) -> torch.Tensor:
        """[V] bool: tokens permitted after the committed output then ``path`` (a path the
        constraint permits, as every node of a pruned draft is)."""
        key = tuple(path)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._grammar_mask(key) if self.matcher is not None else \
                torch.ones(self.vocab_size, dtype=torch.bool)
            if self.spec.banned_strings or self.spec.banned_sequences:
                mask = mask & ~self._banned_mask(key)
            self._masks[key] = mask
        return mask

    def permits(self, path: Sequence[int], token: int) -> bool:
        key = tuple(path)
        if key in self._masks:
            return bool(self._masks[key][token])
        return self._grammar_permits(key, token) and not self._bans(key, token)

    def prune(self, draft: Draft, keep_rejected_leaves: bool = False) -> Draft:
        """``draft`` without the nodes the constraint rejects and their descendants.

        ``keep_rejected_leaves`` keeps a rejected node as a leaf (its descendants still go):
        a draft with proposer probabilities needs it, since recursive rejection sampling must
        see every drawn sibling (rejecting one updates the residual the next is tested on)."""
        if len(draft) == 0:
            return draft
        keep: list[int] = []
        matcher = self.matcher
        # depth first, each node's token fed to the grammar once (a path is the stack)
        stack: list[tuple[int, bool]] = [(c, True) for c in reversed(draft.children(-1))]
        path: list[int] = []
        while stack:
            node, entering = stack.pop()
            if not entering:  # leaving a kept node: back to its parent's state
                path.pop()
                if matcher is not None:
                    matcher.rollback(1)
                continue
            token = draft.tokens[node]
            key = tuple(path)
            ok = self._grammar_permits(key, token, here=True) and not self._bans(key, token)
            if ok or keep_rejected_leaves:
                keep.append(node)
            if ok:
                if matcher is not None:
                    require(matcher.consume_token(token), matcher.get_error())
                path.append(token)
                stack.append((node, False))
                stack.extend((c, True) for c in reversed(draft.children(node)))
        keep.sort()
        if len(keep) == len(draft):
            return draft
        index = {-1: -1}
        for new, old in enumerate(keep):
            index[old] = new
        return Draft(tuple(draft.tokens[i] for i in keep),
                     tuple(index[draft.parents[i]] for i in keep),
                     None if draft.probs is None else draft.probs[keep], draft.score)

    # ---- the two kinds ----------------------------------------------------------------------

    def _bits(self, path: tuple[int, ...], here: bool = False) -> bytes:
        """llguidance's token bitmask after committed + ``path`` (bit t of byte t // 8 = token
        t), cached; ``here``: the matcher already stands there (a depth-first walk)."""
        bits = self._bitmasks.get(path)
        if bits is None:
            matcher = self.matcher
            move = bool(path) and not here
            require(matcher.consume_tokens(list(path)) if move else True,
                    f"draft path {list(path)} breaks the grammar; prune the draft first")
            bits = matcher.compute_bitmask()
            if matcher.is_error():
                raise SpecDecodeError(f"the grammar engine failed: {matcher.get_error()[:500]}")
            if move:
                matcher.rollback(len(path))
            self._bitmasks[path] = bits
        return bits

    def _grammar_permits(self, path: tuple[int, ...], token: int, here: bool = False) -> bool:
        # the mask, not llguidance's validate_tokens: that one also passes tokenizations the
        # mask leaves out (a forced '":"' spelt '":' + '"'), and the mask is what ar follows
        if self.matcher is None:
            return True
        return bool(self._bits(path, here)[token >> 3] >> (token & 7) & 1)

    def _grammar_mask(self, path: tuple[int, ...]) -> torch.Tensor:
        bits = np.frombuffer(self._bits(path), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size]
        return torch.from_numpy(allowed.astype(bool))

    def _extend(self, tail: bytes, token: int) -> bytes:
        """``tail`` then ``token``'s bytes, cut to the bytes a banned string could still use."""
        keep = self._longest_ban - 1
        return (tail + self.spec.vocabulary.token_bytes[token])[-keep:] if keep > 0 else b""

    def _context(self, path: tuple[int, ...]) -> tuple[list[int], bytes]:
        """(the last output tokens, the output's last bytes) after the committed output + path."""
        tokens = (self.output[-self._longest_seq:] if self._longest_seq else []) + list(path)
        tail = self._tail
        for token in path:
            tail = self._extend(tail, token)
        return tokens, tail

    def _bans(self, path: tuple[int, ...], token: int) -> bool:
        """Would ``token`` after committed + ``path`` complete a banned output?"""
        tokens, tail = self._context(path)
        for seq in self.spec.banned_sequences:
            if seq[-1] == token and _ends_with(tokens, seq[:-1]):
                return True
        text = tail + self.spec.vocabulary.token_bytes[token]
        return any(ban in text for ban in self.spec.banned_strings)

    def _banned_mask(self, path: tuple[int, ...]) -> torch.Tensor:
        tokens, tail = self._context(path)
        banned = torch.zeros(self.vocab_size, dtype=torch.bool)
        for seq in self.spec.banned_sequences:
            if _ends_with(tokens, seq[:-1]):
                banned[seq[-1]] = True
        for ban in self.spec.banned_strings:
            banned |= self.spec.completing(ban, 0)
            for k in range(1, len(ban)):
                if tail.endswith(ban[:k]):
                    banned |= self.spec.completing(ban, k)
        return banned


def _ends_with(tokens: list[int], prefix: tuple[int, ...]) -> bool:
    return len(tokens) >= len(prefix) and tuple(tokens[len(tokens) - len(prefix):]) == prefix
