"""The `Pruner` that `sparsecorr.decoding.generate` accepts (``pruner=...``).

ARRoL (Xu et al., ACL 2026, arXiv 2603.24840): every rollout is generated to a detection
length (512 tokens in the paper), the quality head scores the partial rollouts, a fraction
``keep_ratio`` (0.5) of each group survives, chosen to be correctness-balanced
(`sparsecorr.pruning.balanced_keep`), and only the survivors are decoded further; the
pruned rollouts stop there and their KV cache is freed.

The decoding engine drives the protocol: it reads ``detect_len``, ``layer`` and ``window``,
collects the hidden states of layer ``layer`` for the last ``window`` generated positions of
every row still active at ``detect_len`` tokens, and calls `Pruner.decide` once.
Pruned rollouts are reported by the `sparsecorr.decoding.RolloutBatch`
(``pruned``, ``pruned_at``) and left out of the loss and of the group statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._checks import check_choice, check_int, check_probability
from .head import QualityHead
from .keep import RULES, balanced_keep
from .trainer import QualityHeadTrainer

__all__ = ["Pruner"]


@dataclass
class Pruner:
    """Decide which partial rollouts continue past ``detect_len`` tokens.

    Args:
        head: a `QualityHeadTrainer` (its calibrated predictions are used, and no
            rollout is pruned until its cold start is over) or a bare `QualityHead`
            (sigmoid of its logits, always active).
        detect_len: generated tokens before the decision (ARRoL: 512; the issue's benchmark
            uses 1/8 of the maximum length).
        keep_ratio: fraction of each group kept (ARRoL: 0.5).
        target: target expected positive fraction for ``rule="target"`` (ARRoL: 0.5).
        rule: survival rule of `balanced_keep` (``"variance"`` by default).
        layer: which ``hidden_states`` entry the engine reports (-1 = last layer).
        window: trailing generated positions whose hidden states are reported.
        seed: seed for ``rule="random"``.

    Attributes:
        last_p_success: predicted P(correct) ``[B]`` of the last decision (for weighted voting).
        history: one dict per decision (kept fraction, mean prediction, whether it was active,
            ``nonfinite``: rows whose hidden states gave a non-finite prediction).

    A row whose hidden states hold NaN/inf gets the uninformative prediction 0.5 for the
    decision (counted in ``history[-1]["nonfinite"]``) instead of stopping the rollout batch.
    """

    head: QualityHead | QualityHeadTrainer
    detect_len: int = 512
    keep_ratio: float = 0.5
    target: float = 0.5
    rule: str = "variance"
    layer: int = -1
    window: int = 1
    seed: int = 0
    last_p_success: torch.Tensor | None = field(default=None, init=False, repr=False)
    history: list[dict] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.head, (QualityHead, QualityHeadTrainer)):
            raise ValueError(
                f"head: expected a QualityHead or QualityHeadTrainer, got {type(self.head).__name__}"
            )
        for name in ("detect_len", "window"):
            check_int(name, getattr(self, name), low=1)
        check_int("layer", self.layer)
        check_int("seed", self.seed)
        check_probability("keep_ratio", self.keep_ratio, open_low=True)
        check_probability("target", self.target)
        check_choice("rule", self.rule, RULES)
        self._gen = torch.Generator().manual_seed(self.seed)

    @property
    def active(self) -> bool:
        """False during the head's cold start (then every rollout is kept)."""
        return not isinstance(self.head, QualityHeadTrainer) or self.head.ready

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """P(correct) ``[B]`` for hidden states ``[B, W, H]``."""
        if isinstance(self.head, QualityHeadTrainer):
            return self.head.predict(hidden)
        with torch.no_grad():
            return torch.sigmoid(self.head(hidden))

    def decide(self, hidden: torch.Tensor, *, group_size: int | None) -> torch.Tensor:
        """Keep mask ``[B]`` for the rows whose hidden states are given.

        Shapes:
            hidden: ``[B, W, H]`` (B = whole groups of ``group_size`` rows) -> keep ``[B]`` bool.
        """
        if group_size is None:
            raise ValueError(
                "group_size: expected the number of rollouts per prompt (pass "
                "generate(..., group_size=G)), got None"
            )
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden: expected a [B, W, H] tensor, got {shape}")
        p = self.predict(hidden).detach().float().cpu()
        bad = ~torch.isfinite(p)
        p = torch.where(bad, 0.5, p)
        self.last_p_success = p
        if p.numel() == 0:
            keep = torch.zeros(0, dtype=torch.bool)
        elif not self.active:
            keep = torch.ones_like(p, dtype=torch.bool)
        else:
            keep = balanced_keep(
                p, group_size=group_size, keep_ratio=self.keep_ratio, target=self.target,
                rule=self.rule, generator=self._gen,
            )
        self.history.append({
            "active": self.active,
            "kept_frac": float(keep.float().mean()) if keep.numel() else float("nan"),
            "p_mean": float(p.mean()) if p.numel() else float("nan"),
            "p_kept_mean": float(p[keep].mean()) if keep.any() else float("nan"),
            "nonfinite": int(bad.sum()),
        })
        return keep.to(hidden.device)
