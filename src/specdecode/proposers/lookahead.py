"""Lookahead decoding: Jacobi trajectories leave n-grams in a pool, and the pool's n-grams that
start with the last committed token are verified in the same forward (Fu, Bailis, Stoica, Zhang,
2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding", ICML 2024,
arXiv 2402.02057; code hao-ai-lab/LookaheadDecoding, ``lade/decoding.py``).

Three parameters: window W (positions decoded in parallel), n-gram size N (the window keeps the
last N - 1 Jacobi iterations), guess set G (n-grams kept per first token, least recently seen
dropped first). One forward carries two branches:

- the **lookahead branch**, a 2-D window: a base row of guesses and N - 2 levels above it, each
  level one Jacobi iteration newer, W columns each. Column 0 of the base row is the root.
- the **verification branch**: up to G n-grams from the pool whose first token is the root,
  each a chain of its N - 1 following tokens.

After the forward, the newest level's predictions close one n-gram per column, read up the
column's diagonal: ``(base[i], level_1[i], ..., level_{N-2}[i], prediction[i])``; it joins the
pool under its first token. The window then moves on by one position (the reference's
``ALWAYS_FWD_ONE``, whatever was accepted): level 1 without its column 0 becomes the base row
after the new root, every level drops one down, the predictions become the top level. The first
N - 2 steps fill the levels (the base row starts W + N - 3 long and every row loses its first
column each step, so all rows are W wide when the window is full; the reference does the same).
The base row starts as tokens copied from the prompt at random, as in the reference, from a
generator seeded per request so the drafts are a deterministic function of the request.

**How the 2-D window maps onto the Draft tree.** The reference's mask lets the token at level l,
column i see the base row up to column i and its own column below it (the figure in its
README). That is exactly a tree: the base row is a chain from the root, and each column i hangs
a chain ``level_1[i] -> ... -> level_{N-2}[i]`` under base column i (the root for i = 0). A
node's ancestors are then precisely what the reference's mask shows it, and its depth (our
position offset) is i + l, the reference's position id. So the window costs the same rows as in
the reference and needs no other mask. The verification branch is a prefix tree of the chosen
n-grams (the reference verifies each n-gram as its own chain; merging shared prefixes gives the
same longest match with fewer rows). All paths go through one trie, so a window node whose path
equals a candidate's prefix is one row serving both. Candidates come first in node order, so
where a candidate and the window share a first token the verifier walks the candidate.

Our addition, ``pool_from_context`` (the reference's ``POOL_FROM_PROMPT`` option, off by
default there): every n-gram of the prompt and of the committed output also joins the pool, which
makes the verification branch a prompt-lookup drafter as well. Measured on the dev half; see
docs/parallel-decoding.md. The pool stays on the proposer across requests (a server slot keeps
its proposer), like Token Recycling's matrix.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from specdecode.draft import Draft
from specdecode.errors import require
from specdecode.proposer import Feedback, Proposer, target_argmax
from specdecode.registry import param, register

#: bounds on the window and n-gram size: the window alone costs (W - 1) + W (N - 2) rows
MAX_WINDOW = 32
MAX_NGRAM = 16


class NgramPool:
    """n-grams by first token: ``pool[t]`` = up to ``guesses`` continuations (N - 1 tokens each)
    seen after t, least recently seen first, dropped first when full (the reference's LRU)."""

    def __init__(self, guesses: int):
        self.guesses = guesses
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, first: int, rest: tuple[int, ...]) -> None:
        if self.guesses == 0:
            return
        entries = self.table.setdefault(first, OrderedDict())
        entries[rest] = None
        entries.move_to_end(rest)
        if len(entries) > self.guesses:
            entries.popitem(last=False)

    def add_text(self, tokens, n: int) -> None:
        """Every n-gram of ``tokens``."""
        for start in range(len(tokens) - n + 1):
            self.add(int(tokens[start]), tuple(int(t) for t in tokens[start + 1:start + n]))

    def candidates(self, first: int) -> list[tuple[int, ...]]:
        """The continuations after ``first``, most recently seen first."""
        return list(reversed(self.table.get(first, ())))


@dataclass(frozen=True)
class LookaheadConfig:
    window: int = param(1, "W, future positions decoded in parallel by the lookahead branch "
                           "(reference README: 7 on GPUs; every row costs on this CPU's runner, "
                           "and W = 1 was fastest on the dev half, W = 4 accepted most: "
                           "docs/parallel-decoding.md)", bounds=(1, 32))
    ngram: int = param(3, "N, n-gram size: the window keeps N - 1 Jacobi iterations and drafts "
                          "N - 1 tokens per candidate (reference README: 5; 3 was fastest here)",
                       bounds=(3, 16))
    guesses: int = param(2, "G, n-grams kept per first token and verified per step (reference "
                            "README: 7; 2 was fastest here)", bounds=(0, 64))
    pool_from_context: bool = param(True, "also pool every n-gram of the prompt and of the "
                                          "output (the reference's POOL_FROM_PROMPT; on here: it "
                                          "raised tau on the dev half)")

    def __post_init__(self):
        require(isinstance(self.window, int) and 1 <= self.window <= MAX_WINDOW,
                f"window must be an integer in 1..{MAX_WINDOW}, got {self.window!r}")
        require(isinstance(self.ngram, int) and 3 <= self.ngram <= MAX_NGRAM,
                f"ngram must be an integer in 3..{MAX_NGRAM} (the window needs at least one level "
                f"above its base row), got {self.ngram!r}")
        require(isinstance(self.guesses, int) and self.guesses >= 0,
                f"guesses must be an integer >= 0 (0 = no verification branch), "
                f"got {self.guesses!r}")


class _Trie:
    """Paths of tokens from the root merged into one Draft, within a node and depth budget."""

    def __init__(self, max_depth: int, max_nodes: int):
        self.max_depth, self.max_nodes = max_depth, max_nodes
        self.index: dict[tuple[int, ...], int] = {}
        self.tokens: list[int] = []
        self.parents: list[int] = []

    def add(self, path: tuple[int, ...]) -> int | None:
        """The node of ``path`` (adding it and its missing prefixes), None if over budget."""
        node = self.index.get(path)
        if node is not None or not path:
            return node
        parent = self.add(path[:-1]) if len(path) > 1 else -1
        if parent is None or len(path) > self.max_depth or len(self.tokens) >= self.max_nodes:
            return None
        self.index[path] = len(self.tokens)
        self.tokens.append(path[-1])
        self.parents.append(parent)
        return self.index[path]

    def draft(self) -> Draft:
        return Draft(tuple(self.tokens), tuple(self.parents))


@register("lookahead", LookaheadConfig,
          paper="Lookahead decoding (Fu et al., ICML 2024, arXiv 2402.02057)",
          summary="a 2-D Jacobi window generates n-grams into a pool; pooled n-grams starting "
                  "with the last token are verified in the same forward")
class LookaheadProposer(Proposer):
    samples_drafts = False  # n-gram lookups
    def __init__(self, config: LookaheadConfig, runner):
        super().__init__(config, runner)
        #: kept across requests
        self.pool = NgramPool(config.guesses)
        #: the base row after the root (column i + 1 of the window is base[i])
        self.base: list[int] = []
        #: levels above the base row, oldest first, each with one token per column
        self.levels: list[list[int]] = []
        self._rng = random.Random(0)
        self._prompt_len = 0
        #: what the last draft held, for observe(): its root, and the logits row of each
        #: column's top window cell (None = cut by the budget)
        self._root = -1
        self._top_rows: list[int | None] = []

    def start(self, prompt):
        config = self.config
        self._prompt_len = len(prompt)
        self._rng = random.Random(len(prompt))
        self.base = [int(self._rng.choice(prompt)) for _ in range(config.window + config.ngram - 3)]
        self.levels = []
        if config.pool_from_context:
            self.pool.add_text(prompt, config.ngram)

    @property
    def full(self) -> bool:
        return len(self.levels) == self.config.ngram - 2

    def propose(self, context, budget):
        if not self.base and not self.levels:
            self.start(context)  # used without start(): begin from this context
        root = int(context[-1])
        trie = _Trie(budget.max_depth, budget.max_nodes)
        # verification branch first: where it shares a first token with the window, the
        # verifier walks it
        for rest in self.pool.candidates(root):
            trie.add(rest)
        # lookahead branch: the base row is a chain; column i's levels hang under base column i
        columns = [()] + [tuple(self.base[:i]) for i in range(1, len(self.base) + 1)]
        top = [trie.add(columns[i] + tuple(row[i] for row in self.levels))
               for i in range(len(columns))]
        # the logits row of each top cell: the root's is row 0, node j's is row j + 1
        self._root = root
        self._top_rows = [0 if i == 0 and not self.levels else None if node is None else node + 1
                          for i, node in enumerate(top)]
        self._draft = trie.draft()
        return self._draft

    def observe(self, feedback: Feedback) -> None:
        if feedback.prefill:  # learns from verify steps only
            return
        config = self.config
        if config.pool_from_context and feedback.tokens:
            # the n-grams that end in the newly committed tokens
            text = list(feedback.context[-(config.ngram - 1):]) + list(feedback.tokens)
            self.pool.add_text(text, config.ngram)
        if not self._top_rows or int(feedback.context[-1]) != self._root:
            return  # not the draft we made: nothing to learn about the window
        n = len(feedback.draft)
        if feedback.draft.tokens != self._draft.tokens[:n] or \
                feedback.draft.parents != self._draft.parents[:n]:
            return  # the engine changed it (a constraint pruned it): its rows are not ours
        # rows the engine cut off the end (a node cap) keep their old tokens, as budget cuts do
        rows = [None if r is not None and r > n else r for r in self._top_rows]
        predicted = iter(target_argmax(feedback, [r for r in rows if r is not None],
                                       self.sampling, self._prompt_len))
        # a top cell the budget cut keeps its old token: a stale but harmless guess
        old = self.levels[-1] if self.levels else [self._root] + self.base
        out = [token if row is None else next(predicted) for row, token in zip(rows, old)]
        if self.full:
            # column i's n-gram runs up its diagonal and ends in the new prediction
            for i, first in enumerate([self._root] + self.base):
                if rows[i] is not None:
                    self.pool.add(first, tuple(row[i] for row in self.levels) + (out[i],))
            # move on one position: level 1 after the new root is the base row
            self.base = self.levels[0][1:]
            self.levels = self.levels[1:] + [out]
        else:
            # filling the levels: every row loses its first column as the window moves on
            self.base = self.base[1:]
            self.levels = [row[1:] for row in self.levels] + [out[1:]]
        self._top_rows = []
