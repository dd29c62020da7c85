r"""Online training of the quality head (ARRoL §3): BCE, replay buffer, cold start, calibration.

Each RL step ends with the final 0/1 rewards of the rollouts whose detection-point hidden
states were recorded. `QualityHeadTrainer.update` then

1. **evaluates before it trains** (prequential evaluation): the head scores the new batch it
   has never seen, and those held-out scores go into a window of recent predictions from
   which the AUC and the calibration are computed honestly;
2. appends the batch to a replay buffer (oldest examples dropped first);
3. takes a few AdamW steps of binary cross-entropy on mini-batches drawn from the buffer.

**Cold start.** ARRoL starts pruning after ~20 steps. `QualityHeadTrainer.ready` is
True once ``min_updates`` updates were made *and* the held-out AUC over the recent window is
at least ``min_auc``; a `sparsecorr.pruning.Pruner` keeps every rollout until then.

**Non-finite inputs.** A row whose pooled hidden state or reward is NaN/inf (or whose logit
under the current head is non-finite, e.g. from a value near the float32 limit) is dropped
before it reaches the buffer and counted (``quality_head/dropped``, `n_dropped`); an
optimizer step whose loss or gradient is non-finite is skipped (`n_skipped_steps`). The
head's weights therefore never become non-finite, and one bad hidden state cannot poison it.

**Calibration: temperature scaling** (Guo et al., 2017). The predicted probability is
\(\sigma(z / T)\) with a single temperature \(T > 0\) fitted by minimising the negative
log-likelihood of the held-out recent window. ARRoL reports calibrating its head without
giving the method; temperature scaling is our documented choice because it never changes the
ranking (the AUC) and is stable on a few hundred examples.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn.functional as F

from .._checks import check_int, check_number, check_positive, check_probability
from .._modes import eval_mode
from .head import QualityHead

__all__ = ["QualityHeadTrainer", "binary_auc", "fit_temperature"]


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ROC AUC by the Mann–Whitney statistic (ties get average ranks); NaN without both classes.

    Pairs whose score or label is NaN/inf are left out (so the AUC is that of the valid pairs;
    NaN when none of one class is left). Labels are read as ``label > 0.5``.

    Shapes:
        scores, labels: ``[N]`` (any shape with N elements) -> 0-d float32.
    """
    s, y = _valid_pairs(scores, labels, "scores")
    y = y > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return torch.tensor(float("nan"))
    order = s.argsort()
    sorted_s = s[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float32)
    uniq, inverse = torch.unique(sorted_s, return_inverse=True)
    # average rank of each tie block
    sums = torch.zeros(uniq.numel()).index_add_(0, inverse, torch.arange(1, s.numel() + 1).float())
    counts = torch.zeros(uniq.numel()).index_add_(0, inverse, torch.ones(s.numel()))
    avg = (sums / counts)[inverse]
    ranks[order] = avg
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def _valid_pairs(x: torch.Tensor, labels: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened float32 ``(x, labels)`` with the non-finite pairs removed; shapes checked."""
    for arg, t in ((name, x), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if x.numel() != labels.numel():
        raise ValueError(f"labels: expected {x.numel()} entries (one per {name[:-1]}), got {labels.numel()}")
    xs, ys = x.detach().float().reshape(-1), labels.detach().float().reshape(-1)
    ok = torch.isfinite(xs) & torch.isfinite(ys)
    return xs[ok], ys[ok]


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, *, iters: int = 100) -> float:
    """Temperature \\(T\\) minimising the NLL of ``sigmoid(logits / T)`` (clamped to [0.05, 20]).

    Non-finite pairs are left out; with no pair left, or a non-finite fit, ``T = 1``.
    """
    check_int("iters", iters, low=1)
    z, y = _valid_pairs(logits, labels, "logits")
    y = (y > 0.5).float()
    if z.numel() == 0:
        return 1.0
    log_t = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.5, max_iter=iters, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(z / log_t.exp(), y)
        loss.backward()
        return loss

    opt.step(closure)
    t = float(log_t.detach().exp().clamp(0.05, 20.0))
    return t if math.isfinite(t) else 1.0


class QualityHeadTrainer:
    """Online trainer for a `QualityHead` (see the module docstring for the procedure).

    Args:
        head: the head to train (updated in place).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        buffer_size: replay buffer capacity (examples).
        batch_size: mini-batch size drawn from the buffer.
        steps_per_update: optimizer steps per call to `update`.
        min_updates: cold start: updates before the head may prune (ARRoL: ~20 steps).
        min_auc: cold start: held-out AUC needed before the head may prune.
        holdout: size of the recent held-out window used for AUC and calibration.
        calibrate: fit the temperature after each update.
        seed: seed of the mini-batch sampler.
    """

    def __init__(
        self,
        head: QualityHead,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        buffer_size: int = 4096,
        batch_size: int = 256,
        steps_per_update: int = 4,
        min_updates: int = 20,
        min_auc: float = 0.6,
        holdout: int = 512,
        calibrate: bool = True,
        seed: int = 0,
    ) -> None:
        if not isinstance(head, QualityHead):
            raise ValueError(f"head: expected a QualityHead, got {type(head).__name__}")
        check_positive("lr", lr)
        check_number("weight_decay", weight_decay, low=0)
        check_probability("min_auc", min_auc)
        for name, v in (("buffer_size", buffer_size), ("batch_size", batch_size),
                        ("steps_per_update", steps_per_update), ("holdout", holdout)):
            check_int(name, v, low=1)
        check_int("min_updates", min_updates, low=0)
        check_int("seed", seed)
        self.head = head
        self.opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
        self.batch_size, self.steps_per_update = batch_size, steps_per_update
        self.min_updates, self.min_auc, self.calibrate = min_updates, min_auc, calibrate
        self._features: deque[torch.Tensor] = deque(maxlen=buffer_size)
        self._labels: deque[float] = deque(maxlen=buffer_size)
        self._recent_logits: deque[float] = deque(maxlen=holdout)
        self._recent_labels: deque[float] = deque(maxlen=holdout)
        self._gen = torch.Generator().manual_seed(seed)
        self.n_updates = 0
        #: rows dropped so far because their hidden state, reward or logit was not finite
        self.n_dropped = 0
        #: optimizer steps skipped because the loss or a gradient was not finite
        self.n_skipped_steps = 0
        self.temperature = 1.0

    @property
    def recent_auc(self) -> float:
        """AUC of the held-out (evaluated-before-training) recent window; NaN if one class."""
        if not self._recent_labels:
            return float("nan")
        return float(binary_auc(torch.tensor(list(self._recent_logits)),
                                torch.tensor(list(self._recent_labels))))

    @property
    def ready(self) -> bool:
        """True when the cold start is over: enough updates and a good enough held-out AUC."""
        auc = self.recent_auc
        return self.n_updates >= self.min_updates and auc == auc and auc >= self.min_auc

    @torch.no_grad()
    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Calibrated P(correct) ``[B]`` for hidden states ``[B, W, H]`` or ``[B, H]``."""
        with eval_mode(self.head):
            return torch.sigmoid(self.head(hidden) / self.temperature)

    def update(self, hidden: torch.Tensor, rewards: torch.Tensor) -> dict[str, torch.Tensor]:
        """One online update from detection-point hidden states and final rewards.

        Args:
            hidden: ``[B, W, H]`` or ``[B, H]`` hidden states recorded at detection time.
            rewards: ``[B]`` final rewards; > 0.5 counts as correct (0/1 rewards of RLVR).

        Rows with a non-finite hidden state, reward or held-out logit are dropped and counted
        (module docstring); an update left with no row trains on the buffer as it is and does
        not count towards the cold start.

        Returns:
            metrics: ``quality_head/loss``, ``quality_head/auc_recent``,
            ``quality_head/temperature``, ``quality_head/ready``, ``quality_head/buffer``,
            ``quality_head/dropped`` (rows dropped by this update).
        """
        features = self.head.pool(hidden).detach().cpu()
        if not isinstance(rewards, torch.Tensor) or rewards.shape != (features.shape[0],):
            got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards)
            raise ValueError(f"rewards: expected shape ({features.shape[0]},), got {got}")
        if rewards.dtype == torch.bool or rewards.is_complex():
            raise ValueError(f"rewards: expected real numbers, got dtype {rewards.dtype}")
        r = rewards.detach().float().cpu()
        self.head.eval()
        with torch.no_grad():  # prequential: score before training on it
            held_out = self.head.logits_from_features(features)
        keep = torch.isfinite(features).all(-1) & torch.isfinite(r) & torch.isfinite(held_out)
        dropped = int((~keep).sum())
        self.n_dropped += dropped
        features, held_out = features[keep], held_out[keep]
        labels = (r[keep] > 0.5).float()
        self._recent_logits.extend(held_out.tolist())
        self._recent_labels.extend(labels.tolist())
        self._features.extend(features.unbind(0))
        self._labels.extend(labels.tolist())
        loss = self._train_steps() if self._labels else torch.zeros(())
        if labels.numel():
            self.n_updates += 1
        if self.calibrate and len(set(self._recent_labels)) == 2:
            self.temperature = fit_temperature(torch.tensor(list(self._recent_logits)),
                                               torch.tensor(list(self._recent_labels)))
        return {
            "quality_head/loss": loss,
            "quality_head/auc_recent": torch.tensor(self.recent_auc),
            "quality_head/temperature": torch.tensor(self.temperature),
            "quality_head/ready": torch.tensor(float(self.ready)),
            "quality_head/buffer": torch.tensor(float(len(self._labels))),
            "quality_head/dropped": torch.tensor(float(dropped)),
        }

    def _train_steps(self) -> torch.Tensor:
        x_all = torch.stack(list(self._features))
        y_all = torch.tensor(list(self._labels))
        self.head.train()
        loss = torch.zeros(())
        for _ in range(self.steps_per_update):
            idx = torch.randint(0, len(y_all), (min(self.batch_size, len(y_all)),),
                                generator=self._gen)
            logits = self.head.logits_from_features(x_all[idx])
            loss = F.binary_cross_entropy_with_logits(logits, y_all[idx])
            self.opt.zero_grad()
            loss.backward()
            grads = [p.grad for p in self.head.parameters() if p.grad is not None]
            if not torch.isfinite(loss) or not all(bool(torch.isfinite(g).all()) for g in grads):
                self.n_skipped_steps += 1  # never let a non-finite step reach the weights
                self.opt.zero_grad()
                continue
            self.opt.step()
        self.head.eval()
        return loss.detach()

    def save(self, path: str) -> None:
        """Save the head with the trainer's temperature and update count (safetensors)."""
        self.head.save(path, extra={"temperature": self.temperature, "n_updates": self.n_updates})
