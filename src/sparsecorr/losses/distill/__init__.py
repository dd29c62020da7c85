"""DistillSparse and distillation losses: sampled-token k3, full-vocabulary and top-k KL, the
sparse LoRA adapter and the dense-mode switch (Sparrow, Zhou et al. 2026, arXiv 2606.08446)."""

from .adapter import adapter_parameters, dense_mode, sparse_adapter
from .k3 import distill_sparse_loss, sparse_kl_k3, topk_kl
from .logits_kl import kl_from_logits

__all__ = [
    "adapter_parameters",
    "dense_mode",
    "distill_sparse_loss",
    "kl_from_logits",
    "sparse_adapter",
    "sparse_kl_k3",
    "topk_kl",
]
