"""Diffusion decoding policies: name -> policy class + its frozen config dataclass.

A policy decides, each denoising step, which masked positions of the block to commit. Each is
one file in ``specdecode/diffusion/policies/`` decorated with :func:`register_policy`; the CLI
(``generate --diffusion``, ``methods``) and the ParallelBench script read this registry. The
policies are kept apart from the speculative methods' registry: they decode a diffusion model,
not the target, and only ``freedave`` is exact (to ``one_per_step``, not to ``ar``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.registry import Entry, Registry


@dataclass(frozen=True)
class PolicyInfo(Entry):
    #: output identical to ``one_per_step`` by construction (FreeDave's verification)
    exact: bool = False

    @property
    def policy(self) -> type:
        return self.cls

    def make(self, overrides: dict | None = None):
        """A policy object with this config."""
        return self.cls(self.make_config(overrides))


_POLICIES = Registry("diffusion policy", "policies", PolicyInfo,
                     ("specdecode.diffusion.policies",), first="one_per_step",
                     attribute="policy_name")


def register_policy(name: str, config: type, paper: str, summary: str, exact: bool = False):
    """Class decorator: ``@register_policy("threshold", ThresholdConfig, paper=..., summary=...)``."""
    return _POLICIES.register(name, config, paper, summary, exact=exact)


def policy_names() -> list[str]:
    """Every policy, the reference first."""
    return _POLICIES.names()


def get_policy(name: str) -> PolicyInfo:
    return _POLICIES.get(name)
