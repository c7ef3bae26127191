"""Fill in the middle: a code model writes what goes between a prefix and a suffix.

Code models trained to fill in the middle (Bavarian et al., 2022, "Efficient Training of
Language Models to Fill in the Middle", arXiv 2207.14255) read the prefix, the suffix and then
a tag after which they write the middle (the prefix-suffix-middle order), and end it with an
end token. The tags are tokens of the model's vocabulary, named by family:

- Qwen2.5-Coder, CodeGemma: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``
- StarCoder, StarCoder2, SantaCoder: ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``
- DeepSeek-Coder: ``<｜fim▁begin｜>``, ``<｜fim▁hole｜>``, ``<｜fim▁end｜>``

A repository-level prompt (llama.cpp's ``/infill`` with ``input_extra``) puts other files'
text before the prefix, each after the family's file separator and its name, the whole after a
repository tag: Qwen2.5-Coder's ``<|repo_name|>`` and ``<|file_sep|>``, StarCoder's
``<reponame>`` and ``<file_sep>`` (:data:`REPO_TAGS`); a family without them (DeepSeek-Coder)
gets each file after a plain-text snippet separator.

The middle ends with the end of text, or with a tag its training put after a file
(:data:`END_TAGS`; llama.cpp ends generation at them too): those of the vocabulary join the
model's own end-of-sequence ids for a fill-in-the-middle request: Qwen2.5-Coder-1.5B-Instruct
ends a middle with ``<|endoftext|>``, where its GGUF file names ``<|im_end|>`` (a chat turn's
end) its end of sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.detokenize import token_id
from specdecode.errors import SpecDecodeError, require

#: (prefix, suffix, middle) tags of each family, in the order they are looked for
TAGS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
        ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
        ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
#: (repository, file separator) tags of each family of :data:`TAGS`, where it has them
REPO_TAGS = (("<|repo_name|>", "<|file_sep|>"), ("<reponame>", "<file_sep>"), (None, None))
#: llama.cpp's names of the repository and of the file being edited in a repository-level
#: prompt, and its separator of files where the vocabulary has no file tag
REPO_NAME, FILE_NAME, SNIPPET = "myproject", "filename", "\n\n--- snippet ---\n\n"
#: tokens that end a middle where the vocabulary holds them (end of text, padding, the next
#: file or repository of a repository-level prompt)
END_TAGS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<fim_pad>",
            "<file_sep>", "<|file_separator|>", "<｜end▁of▁sentence｜>")


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tags and the tokens that end a middle."""

    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]
    #: the repository and file separator tags (None where the family has none)
    repo: int | None = None
    file: int | None = None

    def prompt(self, tokenizer, prefix: str | Sequence[int], suffix: str) -> list[int]:
        """The prompt that asks for the middle between ``prefix`` (text, or token ids as they
        are) and ``suffix`` (text)."""
        if isinstance(prefix, str):
            before = tokenizer.encode(prefix, add_special_tokens=False)
        else:
            before = list(prefix)
            require(all(isinstance(t, int) for t in before),
                    "the text before a middle is text or token ids, not chat messages")
        after = tokenizer.encode(suffix, add_special_tokens=False)
        return [self.prefix, *before, self.suffix, *after, self.middle]

    def in_repository(self, tokenizer, files: Sequence[tuple[str, str]], prefix: str,
                      suffix: str, typed: str = "", window: int | None = None,
                      files_budget: int | None = None) -> tuple[list[int], bool]:
        """The prompt for the middle between ``prefix`` (then ``typed``, encoded apart) and
        ``suffix`` of a file, after the text of other ``files`` ((name, text) pairs) of its
        repository, laid out as llama.cpp's ``/infill`` lays it out (the repository and the
        file edited named ``myproject`` and ``filename``), and whether it was cut to fit.

        Cut as llama.cpp cuts it: within a ``window`` of tokens (its batch), the prefix keeps
        its last three quarters and the suffix its first quarter less ``typed`` and two tags;
        the files' part keeps its last ``files_budget`` tokens (a budget that depends on the
        context and the answer's length only, so that the part a plugin's next request repeats
        stays a cached prefix)."""
        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False) if text else []

        ids = [self.repo, *encode(REPO_NAME + "\n")] if self.repo is not None else []
        for name, text in files:
            ids += ([self.file, *encode(name + "\n")] if self.file is not None
                    else encode(SNIPPET))
            ids += encode(text)
        if self.file is not None:
            ids += [self.file, *encode(FILE_NAME + "\n")]
        before, after, typed_ids = encode(prefix), encode(suffix), encode(typed)
        whole = len(ids) + len(before) + len(after)
        if window is not None:
            before = before[max(0, len(before) - 3 * window // 4):]
            after = after[:max(0, window // 4 - 2 - len(typed_ids))]
        if files_budget is not None:
            ids = ids[max(0, len(ids) - files_budget):]
        cut = len(ids) + len(before) + len(after) < whole
        return ids + [self.prefix, *before, *typed_ids, self.suffix, *after, self.middle], cut


def fim_tokens(tokenizer) -> FimTokens:
    """The tokenizer's tags (one token each) of the first family of :data:`TAGS` it holds;
    a :class:`SpecDecodeError` naming them when it holds none."""
    for tags, repo_tags in zip(TAGS, REPO_TAGS):
        ids = [token_id(tokenizer, tag) for tag in tags]
        if None not in ids:
            ends = tuple(i for i in (token_id(tokenizer, tag) for tag in END_TAGS)
                         if i is not None)
            repo, file = (None if tag is None else token_id(tokenizer, tag) for tag in repo_tags)
            return FimTokens(*ids, ends, repo, file)
    raise SpecDecodeError(
        "this model has no fill-in-the-middle tokens (it holds none of "
        + "; ".join(" ".join(tags) for tags in TAGS)
        + "), so it cannot fill in a middle; leave out the suffix, or use a code model trained "
          "for it (such as qwen2.5-coder-1.5b)")
