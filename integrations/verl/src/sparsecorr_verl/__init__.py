"""sparsecorr inside verl (0.9.1): the policy loss, the rollout correction and the metrics.

Installed, the distribution registers the entry point ``sparsecorr`` in verl's ``verl.plugins``
group, so ``import verl`` loads `sparsecorr_verl.plugin` in every process. Then, in verl's YAML::

    actor_rollout_ref.actor.policy_loss.loss_mode: sparsecorr
    algorithm.rollout_correction.sparsecorr: {preset: sparse_rl}
    algorithm.adv_estimator: sparsecorr_grpo   # vetoed rows leave the GRPO group statistics

or launch with ``python -m sparsecorr_verl.main_ppo <verl overrides>``. With Ray installed
(verl's requirement) the plugin also registers the rollout backend
``actor_rollout_ref.rollout.name=sparsecorr`` (`sparsecorr_verl.rollout`): verl's rollouts
served by sparsecorr's sparse decoding engine. Importing this package does not import verl;
importing ``sparsecorr_verl.plugin`` does, and installs the plugin.
"""

from .advantage import ADV_ESTIMATOR, compute_sparsecorr_grpo_advantage
from .check import TESTED_VERL, VerlMismatchError, check_verl, verl_problems
from .correction import SPEC_KEY, DriverSpec, correction_from_spec, driver_spec, rollout_correction
from .loss import LOSS_MODE, aggregation_for, sparsecorr_policy_loss

__version__ = "0.1.0"

__all__ = [
    "ADV_ESTIMATOR",
    "LOSS_MODE",
    "SPEC_KEY",
    "TESTED_VERL",
    "DriverSpec",
    "VerlMismatchError",
    "aggregation_for",
    "check_verl",
    "compute_sparsecorr_grpo_advantage",
    "correction_from_spec",
    "driver_spec",
    "rollout_correction",
    "sparsecorr_policy_loss",
    "verl_problems",
]
