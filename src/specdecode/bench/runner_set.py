"""The runners ``bench --runners`` and ``bench --perplexity`` measure, built without holding a
large model in float32.

Every model loads as ``generate`` loads it (``models/loading``: ``load_model``, which reads a
GGUF file's header and tokenizer only, then ``make_runner`` per weight format): the native
runner reads the file itself, one tensor at a time, so no format holds a float32 copy of the
model (int4 and int8 keep the file's blocks, bf16 and fp32 dequantise tensor by tensor into
their own layers). What ``FLOAT_COPY_LIMIT`` bounds is the ``transformers`` model: the ``hf``
runner and ``transformers`` generate build it with every weight in float32, so a GGUF file
whose float32 copy exceeds it (1B-8B: 7-32 GB) leaves them out, and ``--weights auto`` then
builds the native default format (int4) alone; the report says what was left out and why.
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
    from specdecode.models.llama import DEFAULT_WEIGHTS
    from specdecode.models.native_shape import runs
    from specdecode.models.loading import load_model, make_runner
    from specdecode.models.quant import WEIGHT_FORMATS

    formats = parse_formats(weights)
    facts = gguf_facts(gguf_path) if gguf_path is not None else None
    float_bytes = facts["parameters"] * 4 if facts else 0
    small = facts is None or float_bytes <= FLOAT_COPY_LIMIT
    loaded = load_model(model)  # a GGUF file: its header and tokenizer, no weights yet
    runners, notes = {}, []
    if with_hf and small:
        runners["hf (fp32)"] = make_runner(loaded, "hf")
    elif with_hf:
        notes.append(f"hf runner and transformers generate: left out, they hold the model's "
                     f"{facts['parameters'] / 1e9:.2f} B parameters in float32 "
                     f"({float_bytes / 1e9:.1f} GB)")
    if not (loaded.config is not None and runs(loaded.config)):
        notes.append("native runner: left out, it does not run this architecture")
        formats = []
    elif formats is None and not small:
        formats = [DEFAULT_WEIGHTS]
        others = [f for f in WEIGHT_FORMATS if f != DEFAULT_WEIGHTS]
        notes.append(f"native {', '.join(others)}: left out by --weights auto for a file this "
                     f"large ({_holds(gguf_path, others)}); ask for them with --weights "
                     f"{DEFAULT_WEIGHTS},{','.join(others)}")
    for fmt in formats or WEIGHT_FORMATS:
        if not small and fmt != DEFAULT_WEIGHTS:
            say(f"native {_holds(gguf_path, [fmt])}")
        runners[f"native {fmt}"] = make_runner(loaded, "native", fmt)
    bos = facts["bos"] if facts else hf_bos(loaded.tokenizer)
    # a file's own end-of-sequence ids where transformers generate is left out (see gguf_facts)
    eos = eos_ids(loaded, loaded.tokenizer) if small else facts["eos"]
    return RunnerSet(runners, loaded.tokenizer, eos, loaded.model if with_hf and small else None,
                     gguf_path, bos, notes)


#: how the native runner builds each format from a GGUF file (models/weights.py)
_HOW_BUILT = {"int4": "the file's 4-bit blocks kept, no float copy",
              "int8": "block int8 from the file's blocks, no float copy",
              "bf16": "dequantised one tensor at a time",
              "fp32": "dequantised one tensor at a time"}


def _holds(path: Path, formats: list[str]) -> str:
    """What the native runner holds of ``path`` in each format, and how it gets there."""
    from specdecode.models.gguf_reader import GGUFFile
    from specdecode.models.weights import gb, resident_bytes

    file = GGUFFile(path)
    return ", ".join(f"{fmt}: {_HOW_BUILT[fmt]}, holds {gb(resident_bytes(file, fmt))}"
                     for fmt in formats)
