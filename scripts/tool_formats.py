"""Which tool-call format the server reads off each chat template (server/tools.py,
``check_template``): Hermes, bare JSON, XML, or the 400 a request with tools would get.

Give template files (``.jinja``, the text a GGUF file's ``tokenizer.chat_template`` holds) or
installed models by name; each is rendered under a small tokenizer, as the server renders the
model's own. A file named ``*tool_use.jinja`` is a model's ``tool_use`` template (Hermes 2 Pro's
and 3's: ``tokenizer.chat_template.tool_use`` in a GGUF file), taken beside a plain default, as
the server takes the pair:

    python scripts/tool_formats.py DIR/*.jinja
    python scripts/tool_formats.py --model qwen2.5-coder-0.5b

llama.cpp keeps the templates of many models for its tests, in its sources:
``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``, then
``vendor/llama.cpp/models/templates/`` inside the archive.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from specdecode.server.tools import ToolError, check_template


#: the default beside a ``tool_use`` template: ChatML without tools
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(template: str | dict) -> PreTrainedTokenizerFast:
    """A tokenizer of a few words carrying ``template`` (templates read only its special
    tokens' names, given here as Llama's and Qwen's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = template
    return tokenizer


def verdict(tokenizer) -> str:
    try:
        found = check_template(tokenizer)
    except ToolError as exc:
        return f"refused: {exc}"
    return found.name if found.xml else f"{found.name} (arguments under {found.arguments!r})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("templates", nargs="*", type=Path, help="chat template files")
    parser.add_argument("--model", action="append", default=[],
                        help="an installed model (its own tokenizer and template)")
    args = parser.parse_args()
    if not args.templates and not args.model:
        parser.error("give template files or --model NAME")
    verdicts = []
    for path in args.templates:
        template = path.read_text()
        if path.name.endswith("tool_use.jinja"):
            template = {"default": PLAIN, "tool_use": template}
        verdicts.append((path.name, verdict(with_template(template))))
    for name in args.model:
        from specdecode.models.loading import load_model

        verdicts.append((name, verdict(load_model(name).tokenizer)))
    width = max(len(name) for name, _ in verdicts)
    for name, said in verdicts:
        print(f"{name:{width}}  {said}")
    counts = Counter(said.split(" (")[0].split(":")[0] for _, said in verdicts)
    print(", ".join(f"{kind}: {n}" for kind, n in counts.most_common()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
