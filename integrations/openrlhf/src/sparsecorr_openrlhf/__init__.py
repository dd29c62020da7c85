"""sparsecorr inside OpenRLHF (0.11.x): measured and corrected sparse/quantized rollouts.

One line in an existing OpenRLHF setup::

    from sparsecorr_openrlhf import use_sparsecorr
    use_sparsecorr(actor_trainer, correction="sparse_rl")

or launch with ``python -m sparsecorr_openrlhf.train_ppo_ray ... --sparsecorr.correction sparse_rl``.
"""

from ._version import SUPPORTED_TEXT, check_openrlhf_version
from .hook import correction_from_spec, install, setup_worker, use_sparsecorr
from .loss import SparsePolicyLoss

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_TEXT",
    "SparsePolicyLoss",
    "check_openrlhf_version",
    "correction_from_spec",
    "install",
    "setup_worker",
    "use_sparsecorr",
]
