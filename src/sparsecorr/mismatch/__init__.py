"""MEASURE: per-token mismatch between the sparse sampler and the dense model.

Log-probs from logits (chunked, no float32 copy of the whole vocabulary), per-token
log-ratios and KL estimators, acceptance rates (exact and top-k), exact quantiles (global, per
row, per position bin), streaming mergeable sketches, and a one-call summary with stable metric
names, over one process or many.
"""

from .acceptance import acceptance_rate, acceptance_rate_topk
from .logprobs import (
    token_logprobs,
    token_logprobs_and_entropy,
    topk_logprobs,
    truncate_logits,
    truncated_token_logprobs,
)
from .metrics import (
    chi2,
    effective_sample_size,
    kl_k1,
    kl_k2,
    kl_k3,
    log_ratio,
    sequence_log_ratio,
)
from .plan import MetricPlan
from .quantiles import binned_quantile, masked_quantile
from .record import LOG_RATIO_CLAMP, Mismatch, measure
from .reduce import reduce_metrics
from .sketch import BinnedQuantileSketch, QuantileSketch
from .summary import (
    add_mismatch_metrics,
    as_metrics,
    mismatch_metrics,
    mismatch_quantiles,
    mismatch_sums,
    quantile_name,
)

__all__ = [
    "LOG_RATIO_CLAMP",
    "BinnedQuantileSketch",
    "MetricPlan",
    "Mismatch",
    "QuantileSketch",
    "acceptance_rate",
    "acceptance_rate_topk",
    "add_mismatch_metrics",
    "as_metrics",
    "binned_quantile",
    "chi2",
    "effective_sample_size",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "log_ratio",
    "masked_quantile",
    "measure",
    "mismatch_metrics",
    "mismatch_quantiles",
    "mismatch_sums",
    "quantile_name",
    "reduce_metrics",
    "sequence_log_ratio",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "topk_logprobs",
    "truncate_logits",
    "truncated_token_logprobs",
]
