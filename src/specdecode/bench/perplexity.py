"""``specdecode bench --perplexity``: the native runner's perplexity on a text, computed as
llama.cpp's ``llama-perplexity`` computes it, beside ``llama-perplexity`` on the same file.

llama-perplexity's rule (tools/perplexity/perplexity.cpp, ``perplexity()``, the default path
without ``--ppl-stride``), followed step for step:

1. the whole text is tokenized once, with the vocabulary's BOS in front where the file says
   ``tokenizer.ggml.add_bos_token``;
2. it is cut into ``len(tokens) // n_ctx`` windows of ``n_ctx`` tokens (``-c``, default 512;
   ``--chunks`` keeps the first N), each evaluated from an empty cache, its first token
   replaced by BOS where the vocabulary adds one;
3. only the second half of each window is scored: with ``first = n_ctx // 2``, the logits at
   positions ``first .. n_ctx - 2`` against the tokens at ``first + 1 .. n_ctx - 1``
   (``n_ctx - 1 - first`` tokens a window), so every scored token has at least half a window
   of context;
4. perplexity = exp(mean negative log-likelihood), the log-softmax with the maximum logit
   taken out and the sum of exponentials in double precision.

Here a window's first half is the runner's prefill and the scored half goes through verify
forwards of at most ``FORWARD_ROWS`` rows (a root and a chain draft whose every node is
committed), the path speculation uses. The tokens come from our tokenizer (the GGUF file's
vocabulary through ``transformers``), written back as text for ``llama-perplexity -f``; the
report gives both sides' window counts, which differ if the two tokenizers split the text
differently.

Default text: the articles of the summarization questions of the packaged Spec-Bench dev half
(their ``Summarize:`` instruction dropped), joined by blank lines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdecode.questions import Question
from specdecode.draft import Draft
from specdecode.errors import require

#: llama-perplexity's default context (-c)
PPL_CONTEXT = 512
#: rows per verify forward while scoring a window's second half
FORWARD_ROWS = 64
#: the default text: Spec-Bench's summarization articles, without their instruction
ARTICLE_TASK = "summarization"
_INSTRUCTION = "Summarize:"


def article_texts(questions: Sequence[Question]) -> list[str]:
    """The summarization questions' articles, without their instruction."""
    texts = [q.turns[0].removeprefix(_INSTRUCTION).strip() for q in questions
             if q.task == ARTICLE_TASK]
    require(texts, f"the question file has no {ARTICLE_TASK} questions to take a text from; "
                   "give one with --text FILE")
    return texts


def articles(questions: Sequence[Question]) -> str:
    """The summarization questions' articles, joined by blank lines."""
    return "\n\n".join(article_texts(questions)) + "\n"


def tokenize(tokenizer, text: str, bos: int | None) -> list[int]:
    """The text's tokens as ``common_tokenize(ctx, text, add_special=true)`` gives them: no
    special tokens but a leading BOS when the vocabulary adds one (``bos`` not None)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ([bos] if bos is not None else []) + ids


def windows(tokens: Sequence[int], n_ctx: int, chunks: int | None = None) -> list[list[int]]:
    require(n_ctx >= 4 and n_ctx % 2 == 0, f"the perplexity context must be an even number of "
                                           f"at least 4 tokens, got {n_ctx}")
    require(len(tokens) >= 2 * n_ctx,
            f"the text has {len(tokens)} tokens; a context of {n_ctx} needs at least "
            f"{2 * n_ctx} (as llama-perplexity does): give a longer text or a smaller --context")
    count = len(tokens) // n_ctx
    if chunks is not None:
        require(chunks > 0, f"--chunks must be positive, got {chunks}")
        count = min(count, chunks)
    return [list(tokens[i * n_ctx:(i + 1) * n_ctx]) for i in range(count)]


def window_nll(runner, window: Sequence[int], bos: int | None) -> tuple[float, int]:
    """(sum of negative log-likelihoods, tokens scored) of one window's second half."""
    w = list(window)
    if bos is not None:
        w[0] = bos
    n, first = len(w), len(w) // 2
    runner.prefill(w[:first])
    nll, pos = 0.0, first
    while pos < n - 1:
        rows = min(FORWARD_ROWS, n - 1 - pos)
        # rows for positions pos .. pos + rows - 1, predicting the tokens one further on
        logits = runner.forward(w[pos], Draft.chain(w[pos + 1:pos + rows])).logits  # [rows, V]
        targets = torch.tensor(w[pos + 1:pos + rows + 1])
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll -= logp[torch.arange(rows), targets].sum().item()
        runner.commit(list(range(rows - 1)))
        pos += rows
    return nll, n - 1 - first


def perplexity(runner, tokens: Sequence[int], n_ctx: int, bos: int | None,
               chunks: int | None = None, progress=None) -> dict:
    """``{"perplexity", "windows", "tokens_scored", "nll"}`` of ``runner`` on ``tokens``."""
    require(n_ctx <= runner.max_context,
            f"--context {n_ctx} is longer than the model's context ({runner.max_context})")
    total, count = 0.0, 0
    parts = windows(tokens, n_ctx, chunks)
    for i, window in enumerate(parts):
        nll, scored = window_nll(runner, window, bos)
        total += nll
        count += scored
        if progress is not None:
            progress(f"window {i + 1}/{len(parts)}: perplexity so far {math.exp(total / count):.4f}")
    return {"perplexity": math.exp(total / count), "windows": len(parts),
            "tokens_scored": count, "nll": total / count}
