"""Diffusion decoding policies: name -> policy class + its frozen config dataclass.

A policy decides, each denoising step, which masked positions of the block to commit. Each is
one file in ``specdecode/diffusion/policies/`` decorated with :func:`register_policy`; the CLI
(``generate --diffusion``, ``methods``) and the ParallelBench script read this registry. The
policies are kept apart from the speculative methods' registry: they decode a diffusion model,
not the target, and only ``freedave`` is exact (to ``one_per_step``, not to ``ar``).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError
from specdecode.registry import Method


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    policy: type
    config: type
    paper: str
    summary: str
    #: output identical to ``one_per_step`` by construction (FreeDave's verification)
    exact: bool = False

    def _as_method(self) -> Method:
        return Method(self.name, self.policy, self.config, self.paper, self.summary)

    def make_config(self, overrides: dict | None = None):
        """The frozen config, unknown fields rejected with the list of known ones."""
        return self._as_method().make_config(overrides)

    def defaults(self) -> list[tuple[str, object, str]]:
        return self._as_method().defaults()

    def make(self, overrides: dict | None = None):
        """A policy object with this config."""
        return self.policy(self.make_config(overrides))


_POLICIES: dict[str, PolicyInfo] = {}
_loaded = False


def register_policy(name: str, config: type, paper: str, summary: str, exact: bool = False):
    """Class decorator: ``@register_policy("threshold", ThresholdConfig, paper=..., summary=...)``."""

    def wrap(cls):
        if name in _POLICIES:
            raise RuntimeError(f"diffusion policy {name!r} registered twice")
        cls.policy_name = name
        _POLICIES[name] = PolicyInfo(name, cls, config, paper, summary, exact)
        return cls

    return wrap


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    import specdecode.diffusion.policies as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _loaded = True


def policy_names() -> list[str]:
    """Every policy, the reference first."""
    _load_all()
    return sorted(_POLICIES, key=lambda n: (n != "one_per_step", n))


def get_policy(name: str) -> PolicyInfo:
    _load_all()
    if name not in _POLICIES:
        raise SpecDecodeError(f"unknown diffusion policy {name!r}; known policies: "
                              f"{', '.join(policy_names())}")
    return _POLICIES[name]
