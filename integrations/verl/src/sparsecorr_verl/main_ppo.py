"""``python -m sparsecorr_verl.main_ppo <verl overrides>``: verl's ``main_ppo`` with sparsecorr.

Takes exactly the Hydra overrides of ``python -m verl.trainer.main_ppo``. It imports the plugin
first (so a broken plugin stops the launch with its error instead of a silent fallback), makes
sure every Ray worker loads it too (``VERL_USE_EXTERNAL_MODULES``), then runs verl's entry point.

Turn sparsecorr on with (``+`` because the keys are new to verl's schema)::

    actor_rollout_ref.rollout.calculate_log_probs=true
    actor_rollout_ref.actor.policy_loss.loss_mode=sparsecorr
    +algorithm.rollout_correction.sparsecorr.preset=sparse_rl
    +algorithm.rollout_correction.sparsecorr.cap=1.5          # the preset's numbers, optional
    +algorithm.rollout_correction.sparsecorr.acceptance=sampled
    '+algorithm.rollout_correction.sparsecorr.quantiles=[0.01,0.05,0.5]'
    +algorithm.rollout_correction.sparsecorr.bin_size=2000
    +algorithm.rollout_correction.sparsecorr.n_bins=16

Presets: sparse_rl, tis, icepop, mis, sparrow, sparse_tail, geo_rs, sequence_is, veto,
divergence, opsm, trl, openrlhf, none; or a ``chain`` list in a YAML file (docs: "verl").

Sparse rollouts from sparsecorr's decoding engine (``pip install 'sparsecorr-verl[rollout]'``)::

    actor_rollout_ref.rollout.name=sparsecorr
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    +actor_rollout_ref.rollout.engine_kwargs.sparsecorr.policy=rkv       # dense streaming_llm snapkv block_topk
    +actor_rollout_ref.rollout.engine_kwargs.sparsecorr.budget=2048      # or .schedule=<BudgetSchedule JSON>
    +actor_rollout_ref.rollout.engine_kwargs.sparsecorr.backend=auto     # torch flashinfer reference
    +actor_rollout_ref.rollout.engine_kwargs.sparsecorr.max_batch_size=256

A complete GRPO launcher: integrations/verl/examples/grpo_sparse_rollout.sh.
verl's own options: ``python -m verl.trainer.main_ppo --help`` (needs Ray and Hydra).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

PLUGIN_MODULE = "sparsecorr_verl.plugin"


def _export_to_workers() -> None:
    mods = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if PLUGIN_MODULE not in mods:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join([*mods, PLUGIN_MODULE])


def main(argv: Sequence[str] | None = None) -> None:
    """Print the help (``-h``/``--help``; imports neither verl nor Ray) or launch verl."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    import importlib

    importlib.import_module(PLUGIN_MODULE)  # raises (after a WARNING) when it cannot plug in
    _export_to_workers()
    sys.argv = ["verl.trainer.main_ppo", *argv]
    runpy.run_module("verl.trainer.main_ppo", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
