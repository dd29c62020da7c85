"""TRL ``GRPOTrainer`` integration for sparsecorr (``pip install sparsecorr-trl[trl]``)."""

from sparsecorr_trl.callback import SparseCorrCallback
from sparsecorr_trl.config import SparseCorrConfig
from sparsecorr_trl.loss import AGGREGATION_BY_LOSS_TYPE
from sparsecorr_trl.options import check_trl_version, validate_grpo_args
from sparsecorr_trl.trainer import SparseGRPOTrainer

__all__ = [
    "AGGREGATION_BY_LOSS_TYPE",
    "SparseCorrCallback",
    "SparseCorrConfig",
    "SparseGRPOTrainer",
    "check_trl_version",
    "validate_grpo_args",
]
