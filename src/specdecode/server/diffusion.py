"""Diffusion policies behind the server's ``method`` field (docs/diffusion.md): a request names
``"specdecode": {"method": "diffusion:POLICY", "allow_lossy": true, "config": {...}}`` (or the
model alias ``MODEL+diffusion:POLICY``) and is decoded by the dLLM with that policy.

The dLLM is chosen when the server starts (``specdecode serve --dllm auto|PATH``), never by a
request: a delta is a file the server would open (the server's rule for artifacts).
Without one the policies are refused with that fix. A policy's output is the dLLM's, not the
AR model's: the server runs it as a lossy method (its own decode loop, a block a step beside
the packed forward, streamed a block at a time), so a request must opt in with
``allow_lossy``. Diffusion decoding here is greedy and unconstrained: sampling, penalties,
constraints and log-probabilities are refused with a 400 naming the field. ``cfg`` (it needs
its own grammar path) and ``learn2pd`` (its filter is a file) are not served.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdecode import registry
from specdecode.errors import SpecDecodeError
from specdecode.lossy.base import LossyMethod
from specdecode.sampling import SamplingParams
from specdecode.server.protocol import DIFFUSION_PREFIX as PREFIX
from specdecode.server.protocol import ApiError

#: policies the server does not serve, and why
NOT_SERVED = {"cfg": "it constrains through a grammar path of its own (use response_format "
                     "with an exact method)",
              "learn2pd": "its filter is a file the server would open"}


def is_diffusion(name: str | None) -> bool:
    return bool(name) and name.startswith(PREFIX)


def served_policies() -> list[str]:
    from specdecode.diffusion.registry import policy_names

    return [PREFIX + name for name in policy_names() if name not in NOT_SERVED]


@dataclass
class Dllm:
    """The model diffusion requests decode, fixed at start-up: the dLLM's native runner, its
    mask id and block size, and one diffusion model (KV cache replica) per server slot."""

    runner: Any
    mask_id: int
    block_size: int
    source: str
    _models: dict = field(default_factory=dict)

    def model_for(self, slot_runner):
        """The slot's diffusion model: a slot decodes one sequence at a time, so its replica
        is never shared by two."""
        from specdecode.diffusion.model import DiffusionModel

        key = id(slot_runner)
        if key not in self._models:
            runner = self.runner.replica() if self._models else self.runner
            self._models[key] = DiffusionModel(runner, self.mask_id)
        return self._models[key]


def served_method(name: str) -> registry.Method:
    """The registry's method, or a served policy as a lossy method named ``diffusion:POLICY``
    (unknown and unserved policies refused with a :class:`SpecDecodeError`)."""
    if not is_diffusion(name):
        return registry.get(name)
    from specdecode.diffusion.registry import get_policy

    policy = name[len(PREFIX):]
    info = get_policy(policy)
    if policy in NOT_SERVED:
        raise SpecDecodeError(f"the server does not serve the diffusion policy '{policy}': "
                              f"{NOT_SERVED[policy]}; served: {', '.join(served_policies())}")
    return registry.Method(name, PolicyDecoding, info.config, info.paper, info.summary,
                           lossy=True)


def check_request(name: str, dllm: Dllm | None, sampling: dict[str, Any]) -> None:
    """Refuse what a diffusion request cannot have, with a 400 naming the field and the fix."""
    if dllm is None:
        raise ApiError(400, f"this server serves no dLLM, so method '{name}' cannot run; start "
                            "it with `specdecode serve --dllm auto` (or --dllm PATH)",
                       param="specdecode.method")
    options = dict(sampling)
    for key, param, what in (("constraint", "response_format", "constraints (response_format, "
                                                               "bans, regex, grammar)"),
                             ("logprobs", "logprobs", "log-probabilities"),
                             ("prompt_logprobs", "echo", "prompt log-probabilities")):
        if options.pop(key, None) is not None:
            raise ApiError(400, f"diffusion decoding ('{name}') takes no {what} here; leave "
                                f"out {param}", param=param)
    params = SamplingParams(**options)
    if not params.greedy or params.adjusts_logits:
        raise ApiError(400, f"diffusion decoding ('{name}') is greedy here: leave temperature "
                            "at 0 and the penalties and logit_bias unset", param="temperature")


class PolicyDecoding(LossyMethod):
    """One slot's decoding with one policy and config on the server's dLLM; each yielded chunk
    is a committed block's kept tokens."""

    def __init__(self, config, runner, dllm: Dllm, name: str):
        from specdecode.diffusion.registry import get_policy

        super().__init__(config, runner)
        self.method_name = name
        self.info = get_policy(name[len(PREFIX):])
        self.dllm = dllm
        self.model = dllm.model_for(runner)

    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling,
               eos: frozenset[int], stats) -> Iterator[list[int]]:
        from specdecode.diffusion.decode import DiffusionResult, diffuse_blocks

        result = DiffusionResult([])
        for kept in diffuse_blocks(self.model, self.info.policy(self.config), prompt_ids,
                                   max_new_tokens, sorted(eos), self.dllm.block_size, None,
                                   result):
            stats.target_forwards = result.forwards
            stats.accepted_lengths = list(result.commits)
            yield kept


def make_factory(make_proposer, dllm: Dllm | None):
    """The scheduler's proposer factory: a policy's decoding for ``diffusion:`` names, the
    ``make_proposer`` given for every other method."""

    def make(name: str, config, runner):
        if is_diffusion(name):
            return PolicyDecoding(config, runner, dllm, name)
        return make_proposer(name, config, runner)

    return make
