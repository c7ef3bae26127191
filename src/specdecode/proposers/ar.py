"""Plain autoregressive decoding: the reference decoder, an always-empty draft.

It runs through the same engine and runner as every speculative method, so each method is
compared token for token against exactly the computation it claims to reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.draft import Draft
from specdecode.proposer import Proposer
from specdecode.registry import register


@dataclass(frozen=True)
class ArConfig:
    """No settings: one target forward per token."""


@register("ar", ArConfig, paper="plain autoregressive decoding (the reference)",
          summary="one token per target forward; every method is tested against it")
class Autoregressive(Proposer):
    samples_drafts = False  # it drafts nothing
    def propose(self, context, budget):
        return Draft.empty()
