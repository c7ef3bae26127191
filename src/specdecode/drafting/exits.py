"""What the early-exit proposers share (``early_exit``: LayerSkip, Elhoushi et al., 2024;
``del``: DEL, Zarch et al., 2025): the checks on an exit layer, and DEL's cost model of
self-speculation in tokens per layer computed, which ``early_exit`` also uses to pick its fixed
exit layer from the adapters' measured agreement.
"""

from __future__ import annotations

from specdecode.errors import SpecDecodeError
from specdecode.models.capabilities import EarlyExit, check_layer


def check_exit_layer(runner, layer: int, what: str = "exit_layer") -> None:
    check_layer(layer, runner.num_layers, what)


def require_early_exit(runner, who: str) -> EarlyExit:
    """The runner's early exit, or an error that names ``who`` needs it."""
    try:
        return runner.early_exit
    except SpecDecodeError as exc:
        raise SpecDecodeError(f"{who} drafts with the target's early layers: {exc}") from None


#: cost model constants for SmolLM2-135M on a 2-core CPU, hf runner (docs/self-speculation.md):
#: its tied 49152 x 576 head reads as many weights as ~6 of its 30 layers (a one-token forward
#: is memory-bound), and a verify pass grows ~12% of a one-token forward per extra token
#: (measured: docs/self-speculation.md)
HEAD_COST = 6.0
VERIFY_TOKEN_COST = 0.12


def expected_tokens(alpha: float, depth: int) -> float:
    """Tokens one verify step commits for a chain of ``depth`` drafts each accepted with
    probability ``alpha``: 1 + alpha + ... + alpha^depth."""
    return float(sum(alpha ** i for i in range(depth + 1)))


def tokens_per_layer(alpha: float, layer: int, depth: int, num_layers: int,
                     head_cost: float = 0.0, verify_token_cost: float = 0.0,
                     round_cost: float = 0.0) -> float:
    """DEL's TPL with the CPU terms: the LM head, the verify pass's width and a fixed cost per
    round (the shadow tokens' head call); all 0 gives the paper's formula."""
    draft = depth * (layer + head_cost)
    verify = (num_layers + head_cost) * (1.0 + verify_token_cost * depth)
    return expected_tokens(alpha, depth) / (draft + verify + round_cost)


def best_fixed_layer(agreement: dict[int, float], num_layers: int, depth: int,
                     head_cost: float = HEAD_COST,
                     verify_token_cost: float = VERIFY_TOKEN_COST) -> int:
    """The exit layer with the highest TPL at a fixed draft length (``early_exit``'s auto)."""
    return max(agreement, key=lambda layer: tokens_per_layer(
        agreement[layer], layer, depth, num_layers, head_cost, verify_token_cost))
