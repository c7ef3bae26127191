"""Incremental detokenization (specdecode/detokenize.py): after every step, exactly the text
one decode of all the tokens gives, on SmolLM2's byte-level BPE and on a SentencePiece-style
tokenizer, with the decoded head moving forward so a step decodes a bounded tail."""

import random

from specdecode.detokenize import SETTLE, IncrementalText, special_ids

from tiny_server import build_tokenizer

#: text that meets what a piecewise decode gets wrong: characters of several bytes split
#: across tokens, the cleanup of spaces before punctuation and contractions, newlines
HARD_TEXT = ("Café 北京 🙂 . I do n't know , is n't it ? Yes ! 'tis  \n\n  déjà-vu — “quoted” "
             "naïve résumé 日本語のテキスト 👩‍👩‍👧 ... end .")


def tokens_of(tokenizer, seed: int, length: int = 600) -> list[int]:
    """The hard text's tokens between random runs of random tokens (special ones included):
    partial characters and odd joins at every boundary."""
    rng = random.Random(seed)
    text = tokenizer(HARD_TEXT, add_special_tokens=False)["input_ids"]
    special, vocab = list(tokenizer.all_special_ids), len(tokenizer)  # len() costs ~30 ms
    out: list[int] = []
    while len(out) < length:
        out += text if rng.random() < 0.5 else []
        out += [rng.choice(special) if rng.random() < 0.1 else rng.randrange(vocab)
                for _ in range(rng.randint(1, 30))]
    return out


def decode_in_steps(tokenizer, tokens: list[int], seed: int, kept=()) -> IncrementalText:
    """Feeds ``tokens`` 1-4 at a time, checking the text after each step (``kept``: special
    tokens whose text stays, as a decode of the tokens without the other special ones)."""
    rng, text, n = random.Random(seed), IncrementalText(tokenizer, kept), 0
    dropped = special_ids(tokenizer) - set(kept)
    while n < len(tokens):
        n = min(len(tokens), n + rng.randint(1, 4))
        whole = (tokenizer.decode([t for t in tokens[:n] if t not in dropped])
                 if kept else tokenizer.decode(tokens[:n], skip_special_tokens=True))
        assert text.text(tokens[:n]) == whole
    return text


def test_byte_level_bpe_text_is_the_whole_decode_at_every_step(real_model):
    tokenizer = real_model.tokenizer
    for seed in range(4):
        tokens = tokens_of(tokenizer, seed)
        text = decode_in_steps(tokenizer, tokens, seed)
        assert text.settled >= len(tokens) - 3 * SETTLE  # a step decodes its last tokens only


def test_sentencepiece_style_text_is_the_whole_decode_at_every_step(tokenizer):
    """The tiny served model's tokenizer (Metaspace: a word's first piece carries its space,
    stripped where it begins the text), whose head can move only at a word's inner pieces."""
    for seed in range(4):
        decode_in_steps(tokenizer, tokens_of(tokenizer, seed), seed)


def test_kept_special_tokens_stay_in_the_text_and_the_others_go():
    """A tool-call format's tags that are special tokens (Mistral's ``[TOOL_CALLS]``) stay in
    the text the server parses; the end-of-sequence and other special tokens go, as ever."""
    tokenizer = build_tokenizer(special=("[TOOL_CALLS]", "[ARGS]"))
    calls, args = tokenizer.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    for seed in range(4):
        tokens = tokens_of(tokenizer, seed)
        rng = random.Random(seed)
        for _ in range(20):
            tokens.insert(rng.randrange(len(tokens)), rng.choice([calls, args]))
        decode_in_steps(tokenizer, tokens, seed, kept=[calls])
        text = IncrementalText(tokenizer, [calls]).text(tokens)
        assert "[TOOL_CALLS]" in text and "[ARGS]" not in text and "<|im_end|>" not in text
        assert "[TOOL_CALLS]" not in IncrementalText(tokenizer).text(tokens)
