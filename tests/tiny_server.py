"""A tiny served model: a ~300-token BPE tokenizer with a chat template, a random Llama sized
for it, and a server over them on loopback, for the server tests (no download, no real model)."""

from __future__ import annotations

import string

import openai

from specdecode.models.hf import HFRunner
from specdecode.server import BackgroundServer
from specdecode.server.app import Server, Settings, create_app

from tiny_models import tiny_llama

MODEL = "tiny"
EOS = 2
CONTEXT = 256
BODY_LIMIT = 64 * 1024
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Hello world! How are you today? I am fine, thank you.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
]


def build_tokenizer(chat_template: str | None = None, special: tuple[str, ...] = ()):
    """A ~300-token BPE tokenizer with a chat template (``chat_template``, else a plain one
    without tools), trained in milliseconds, and ``special`` tokens after its pieces (such as
    Mistral's ``[TOOL_CALLS]``). Metaspace pieces over printable ASCII: any token sequence
    decodes to valid text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = [c for c in string.printable if c not in " \t\r\x0b\x0c"]
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=["<pad>", "<unk>", "<|im_end|>", "<|im_start|>"])
    tok.train_from_iterator(CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.add_tokens(list(special), special_tokens=True)
    assert fast.eos_token_id == EOS
    return fast


def tiny_served_model(tokenizer):
    return tiny_llama(vocab_size=len(tokenizer), hidden_size=32, max_positions=CONTEXT, seed=1)


def make_server(model, tokenizer, runners=None, parallel=2, memory=None, dllm=None,
                **settings):
    runners = runners or [HFRunner(model) for _ in range(parallel)]
    options = dict(model_id=MODEL, method="ngram", max_body_bytes=BODY_LIMIT)
    options.update(settings)
    server = Server(runners, tokenizer, [EOS], Settings(**options), memory, dllm=dllm)
    return BackgroundServer(create_app(server))


def openai_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
