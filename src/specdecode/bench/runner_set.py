"""The runners ``bench --runners`` and ``bench --perplexity`` measure, built without holding a
large model in float32.

A GGUF file small enough that its float32 copy fits ``FLOAT_COPY_LIMIT`` (the default model:
0.5 GB) loads as ``generate`` loads it (``models/loading``: the ``hf`` runner, ``transformers``
generate, and every native weight format). A larger file (1B-8B: 7-32 GB in float32) never
goes through ``transformers``: the native runner reads it itself (``LlamaRunner.from_gguf``),
the tokenizer comes from the file's metadata, and only the formats asked for with
``--weights`` are built - by default the native default format (int4) alone, since fp32, bf16
and int8 are made from a float32 copy of the weights; the report says what was left out and
why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import require

#: the largest float32 copy of a model (bytes) built without being asked for
FLOAT_COPY_LIMIT = 2 * 2**30


@dataclass
class RunnerSet:
    #: "native int4" / "hf (fp32)" -> runner
    runners: dict
    tokenizer: object
    eos: list[int]
    #: the transformers model (the hf runner and transformers generate), None for large files
    hf_model: object | None = None
    gguf_path: Path | None = None
    #: BOS id where the vocabulary puts one in front of a text (llama-perplexity's rule)
    bos: int | None = None
    #: what was left out, and why
    notes: list[str] = field(default_factory=list)


def parse_formats(spec: str) -> list[str] | None:
    """``--weights`` as a comma-separated list of formats; None for ``auto``."""
    from specdecode.models.quant import WEIGHT_FORMATS

    if spec == "auto":
        return None
    formats = [f.strip() for f in spec.split(",") if f.strip()]
    unknown = [f for f in formats if f not in WEIGHT_FORMATS]
    require(formats and not unknown, f"--weights {spec!r}: give auto or a comma-separated list "
                                     f"of {', '.join(WEIGHT_FORMATS)}")
    return list(dict.fromkeys(formats))


def gguf_facts(path: Path) -> dict:
    """Parameter count, BOS rule and end-of-sequence ids of a GGUF file, from its header
    (memory-mapped, no tensor is read). The ids come from the file itself: ``transformers``'
    GGUF tokenizer conversion can name another token its eos (SmolLM2's file: <|im_start|>)."""
    import gguf

    reader = gguf.GGUFReader(path)

    def value(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    bos = value("tokenizer.ggml.bos_token_id")
    # end of sequence as llama.cpp reads it: eos, and eot where the file has another one
    eos = [int(t) for t in (value("tokenizer.ggml.eos_token_id"),
                            value("tokenizer.ggml.eot_token_id")) if t is not None]
    return {"parameters": sum(int(t.n_elements) for t in reader.tensors),
            "bos": int(bos) if value("tokenizer.ggml.add_bos_token") and bos is not None else None,
            "eos": list(dict.fromkeys(eos))}


def gguf_tokenizer(path: Path):
    """The file's tokenizer and chat template (``tokenizer.*`` metadata), without its weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_bos(tokenizer) -> int | None:
    """BOS id if the tokenizer puts one in front of a text."""
    ids = tokenizer("a")["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None and ids and ids[0] == bos else None


def build(model: str, weights: str, gguf_path: Path | None, with_hf: bool = True,
          say=print) -> RunnerSet:
    """The runners of ``model`` in the formats ``weights`` names (``auto``: every format where
    the float32 copy fits ``FLOAT_COPY_LIMIT``, else the default format)."""
    from specdecode.api import eos_ids
    from specdecode.models.llama import DEFAULT_WEIGHTS, LlamaRunner, runs
    from specdecode.models.loading import load_model, make_runner
    from specdecode.models.quant import WEIGHT_FORMATS

    formats = parse_formats(weights)
    facts = gguf_facts(gguf_path) if gguf_path is not None else None
    float_bytes = facts["parameters"] * 4 if facts else 0
    if facts is None or float_bytes <= FLOAT_COPY_LIMIT:
        loaded = load_model(model)
        native = runs(loaded.config)
        runners = {"hf (fp32)": make_runner(loaded, "hf")} if with_hf else {}
        if native:
            runners.update({f"native {fmt}": make_runner(loaded, "native", fmt)
                            for fmt in formats or WEIGHT_FORMATS})
        bos = facts["bos"] if facts else hf_bos(loaded.tokenizer)
        return RunnerSet(runners, loaded.tokenizer, eos_ids(loaded, loaded.tokenizer),
                         loaded.model if with_hf else None, gguf_path, bos)
    gb = float_bytes / 1e9
    notes = []
    if with_hf:
        notes.append(f"hf runner and transformers generate: left out, they hold the model's "
                     f"{facts['parameters'] / 1e9:.2f} B parameters in float32 ({gb:.1f} GB)")
    if formats is None:
        formats = [DEFAULT_WEIGHTS]
        others = [f for f in WEIGHT_FORMATS if f != DEFAULT_WEIGHTS]
        notes.append(f"native {', '.join(others)}: left out, built today from a float32 copy "
                     f"of the weights ({gb:.1f} GB); ask for them with --weights "
                     f"{DEFAULT_WEIGHTS},{','.join(others)}")
    for fmt in formats:
        if fmt != DEFAULT_WEIGHTS:
            say(f"native {fmt}: building it may hold a float32 copy of the weights ({gb:.1f} GB)")
    tokenizer = gguf_tokenizer(gguf_path)
    runners = {f"native {fmt}": LlamaRunner.from_gguf(gguf_path, fmt) for fmt in formats}
    return RunnerSet(runners, tokenizer, facts["eos"], None, gguf_path, facts["bos"], notes)
