"""Budget controllers: how much to speculate each verify step.

The engine asks the controller for a :class:`Budget` before every proposal and caps it by the
tokens left and the room left in the context; the proposer may draft less. Controllers learn from
:meth:`Controller.observe`, never from the loop itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    #: deepest draft node allowed (tokens that can be accepted in one step)
    max_depth: int
    #: most draft nodes in one verify step (tree size)
    max_nodes: int

    def capped(self, max_depth: int) -> Budget:
        return Budget(min(self.max_depth, max_depth), self.max_nodes)


class Controller:
    """Fixed budget: the proposer's own limits decide (the default for model-free proposers)."""

    def __init__(self, max_depth: int = 64, max_nodes: int = 128):
        self.fixed = Budget(max_depth, max_nodes)

    def budget(self) -> Budget:
        return self.fixed

    def observe(self, draft_size: int, accepted: int) -> None:
        """Feedback after each verify step; the fixed controller ignores it."""
