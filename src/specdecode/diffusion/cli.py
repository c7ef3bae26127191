"""``specdecode generate --diffusion POLICY``: decode the target run as a block-diffusion model
with one of the registered policies; and the policies' part of ``specdecode methods``."""

from __future__ import annotations

import argparse
import json

from specdecode.errors import require


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("diffusion decoding (docs/diffusion.md)")
    group.add_argument("--diffusion", default=None, metavar="POLICY",
                       help="decode as a block-diffusion model with this policy (`specdecode "
                            "methods` lists them); -c KEY=VALUE sets the policy's fields")
    group.add_argument("--block-size", type=int, default=None, metavar="N",
                       help="positions per diffusion block (default: the dLLM's, else 32)")
    group.add_argument("--mask-id", type=int, default=None, metavar="ID",
                       help="the mask token id (default: the dLLM's, else the tokenizer's mask "
                            "token, else SmolLM2's unused <empty_output>, else the last id)")
    group.add_argument("--dllm", default="auto", metavar="PATH",
                       help="the dLLM delta (`specdecode train dllm`), merged into fp32 weights "
                            "(--weights picks another format): 'auto' (default) the newest "
                            "trained for the model (the packaged one for SmolLM2), else the AR "
                            "model as it is; 'none' the AR model as it is; or a file")


def generate(args: argparse.Namespace, config: dict, options: dict, load_target) -> int:
    """The ``generate`` command's diffusion branch: ``config`` the policy's fields (-c),
    ``options`` the constraint keywords, ``load_target(args)`` (runner, tokenizer, eos ids)."""
    from specdecode.api import encode_prompt
    from specdecode.cli_options import load_diffusion_target, sampling_options
    from specdecode.constraints import Vocabulary, make_constraint
    from specdecode.diffusion.decode import DEFAULT_BLOCK_SIZE, diffuse
    from specdecode.diffusion.model import DiffusionModel
    from specdecode.diffusion.registry import get_policy
    from specdecode.sampling import SamplingParams

    info = get_policy(args.diffusion)
    policy = info.make(config)
    require(args.max_new_tokens > 0, f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    require(args.prompt.strip() != "", "the prompt is empty; give some text")
    require(args.method is None, "--diffusion decodes without a speculative method; drop --method")
    require(args.suffix is None, "--diffusion does not fill in a middle; drop --suffix")
    require(args.prompt_cache_file is None,
            "--diffusion keeps no prompt rows; drop --prompt-cache-file")
    sampling = SamplingParams(**sampling_options(args))
    require(sampling.greedy, "diffusion decoding is greedy here; drop --temperature")
    require(not sampling.adjusts_logits, "diffusion decoding takes no penalties or logit bias "
            "here; drop --repetition-penalty, --presence-penalty, --frequency-penalty and "
            "--logit-bias")
    require(sampling.logprobs is None and sampling.prompt_logprobs is None,
            "diffusion decoding reports no log-probabilities; drop --logprobs and "
            "--prompt-logprobs")
    asked = {k: v for k, v in options.items() if v}
    require(not asked or policy.follows_constraint,
            f"the {info.name} policy does not follow grammars or bans; use --diffusion cfg")
    require(bool(asked) or not policy.follows_constraint,
            f"the {info.name} policy needs a grammar: give --json-schema, --regex or --grammar")
    runner, tokenizer, eos, mask, block_size = load_diffusion_target(args, load_target)
    model = DiffusionModel(runner, mask)
    constraint = None
    if asked:
        spec = make_constraint(Vocabulary(tokenizer, runner.vocab_size, eos), **asked)
        constraint = spec.start() if spec is not None else None
    prompt = encode_prompt(tokenizer, args.prompt, not args.no_chat)
    result = diffuse(model, policy, prompt, args.max_new_tokens, eos,
                     block_size or DEFAULT_BLOCK_SIZE, constraint)
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.tokens, "policy": info.name,
                          "steps": result.steps, "forwards": result.forwards,
                          "steps_per_token": round(result.steps_per_token, 4),
                          "tokens_per_s": round(result.tokens_per_s, 3)}))
        return 0
    print(text)
    print(f"[{info.name}] {len(result.tokens)} tokens, {result.steps} denoising steps "
          f"({result.steps_per_token:.2f} a token), {result.tokens_per_s:.1f} tokens/s, mask id "
          f"{mask}")
    return 0


def print_policies() -> None:
    """The policies' section of ``specdecode methods``."""
    from specdecode.diffusion.registry import get_policy, policy_names

    print("diffusion policies (generate --diffusion POLICY: the target run as a block-diffusion "
          "model; see docs/diffusion.md)\n")
    for name in policy_names():
        info = get_policy(name)
        tag = ("  (reference)" if name == "one_per_step" else
               "  (exact: one_per_step's output)" if info.exact else "")
        print(f"{name}{tag}\n  {info.summary}\n  paper: {info.paper}")
        for field, value, help_text in info.defaults():
            print(f"    {field} = {value!r}    {help_text}")
        print()
