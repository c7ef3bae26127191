"""Learn2PD (Bao, Chen, Xu, Shang 2025, arXiv 2509.25188): a learned filter decides which
positions to commit. Each step every masked position's confidence features go through a tiny
MLP trained to predict whether the position's argmax is already its final token
(``diffusion/learn2pd_filter.py``); positions scoring at least ``threshold`` commit, the most
confident alone when none does. With end-of-text prediction (EoTP), once an end-of-sequence
token is committed the rest of the block is filled with it (the output ends there).

Default filter: the one shipped for the default dLLM (SmolLM2-135M with its packaged
delta, ``data/adapters/smollm2-learn2pd-filter.pt``). Its features are a position's confidences,
not the model's states, so it runs on any dLLM; one trained on a dLLM's own trajectories
(``specdecode train learn2pd``) fits that dLLM better."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.artifacts import packaged_dir
from specdecode.diffusion.learn2pd_filter import features, load_filter
from specdecode.diffusion.registry import register_policy
from specdecode.diffusion.step import Policy, StepView
from specdecode.registry import param

#: the filter trained on the default dLLM's trajectories (data/SOURCES.md)
SHIPPED_FILTER = "smollm2-learn2pd-filter.pt"


@dataclass(frozen=True)
class Learn2PDConfig:
    filter: str = param("", "the trained filter file (`specdecode train learn2pd` writes one); "
                            "empty: the one shipped for the default dLLM")
    threshold: float = param(0.5, "filter probability at which a position commits")
    end_of_text: bool = param(True, "EoTP: fill the block after a committed end of sequence")


@register_policy("learn2pd", Learn2PDConfig, paper="Learn2PD (Bao et al., arXiv 2509.25188)",
                 summary="a tiny learned filter picks the positions whose prediction is final")
class Learn2PD(Policy):
    def __init__(self, config):
        super().__init__(config)
        self.net = load_filter(config.filter or packaged_dir() / SHIPPED_FILTER)

    @torch.inference_mode()
    def choose(self, view: StepView) -> dict[int, int]:
        score = torch.sigmoid(self.net(features(view)).squeeze(-1))  # [B]
        chosen = [i for i in view.masked if float(score[i]) >= self.config.threshold]
        commits = view.commit(chosen or [view.most_confident()])
        ends = [i for i, t in commits.items() if t in view.eos_ids]
        if self.config.end_of_text and ends:
            commits.update({i: commits[min(ends)] for i in view.masked if i > min(ends)})
        return commits
