"""TRAIN: losses for sparse rollouts.

``sparse_grpo`` (decoupled three-policy PPO/GRPO/GSPO with a correction), group advantages
(GRPO, Dr. GRPO), the four aggregation modes, and DistillSparse (`sparsecorr.losses.distill`).
"""

from .advantages import group_advantages
from .aggregation import AGGREGATIONS, Aggregation, aggregate, aggregation_coefficients
from .distill import (
    adapter_parameters,
    dense_mode,
    distill_sparse_loss,
    kl_from_logits,
    sparse_adapter,
    sparse_kl_k3,
    topk_kl,
)
from .grpo import METRIC_LEVELS, KLPenalty, sparse_grpo
from .output import LossOutput
from .surrogate import CISPO, GSPO, SAPO, SURROGATES, VESPO, PPOClip

__all__ = [
    "AGGREGATIONS",
    "CISPO",
    "GSPO",
    "METRIC_LEVELS",
    "SAPO",
    "SURROGATES",
    "VESPO",
    "Aggregation",
    "KLPenalty",
    "LossOutput",
    "PPOClip",
    "adapter_parameters",
    "aggregate",
    "aggregation_coefficients",
    "dense_mode",
    "distill_sparse_loss",
    "group_advantages",
    "kl_from_logits",
    "sparse_adapter",
    "sparse_grpo",
    "sparse_kl_k3",
    "topk_kl",
]
