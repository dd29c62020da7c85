"""Parity matrix: ``SparseGRPOTrainer`` with sparsecorr off (no correction, TRL's generation) is
stock ``trl.GRPOTrainer`` 1.16.

Each cell trains both trainers for 3 steps on the same tiny Qwen3, seed, data and config, and
compares every value stock TRL logs (loss, grad norm, ``entropy``, ``kl``, ``clip_ratio/*``,
``policy_loss``, ``entropy_coef``, rewards ...) and the final parameters (``parity.py``).
Options that act independently of each other are not crossed: every loss type runs every
accumulation schedule; each KL variant, ``mask_truncated_completions`` and each loss option runs
with every loss type it interacts with, under the schedule where it matters (``num_iterations=2``
makes the PPO ratio move away from 1 inside a generation batch).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
from sparsecorr_trl import AGGREGATION_BY_LOSS_TYPE, SparseCorrConfig, SparseGRPOTrainer
from sparsecorr_trl.options import PARITY
from trl import GRPOConfig

from tests.integration.trl import parity

LOSS_TYPES = sorted(AGGREGATION_BY_LOSS_TYPE)

SCHEDULES = {
    "ga1": {},
    "ga2": {"gradient_accumulation_steps": 2},
    "spg4": {"steps_per_generation": 4},
    "iter2": {"num_iterations": 2},
}

#: a moving ratio: small clip range, two iterations per generation, a larger step
MOVING = {"num_iterations": 2, "epsilon": 0.02, "learning_rate": 1.0}

OPTIONS = {
    "beta_bias": {**MOVING, "beta": 0.5, "use_bias_correction_kl": True},
    "beta_plain": {**MOVING, "beta": 0.5, "use_bias_correction_kl": False},
    "mask_truncated": {"gradient_accumulation_steps": 2, "mask_truncated_completions": True},
    "delta": {**MOVING, "delta": 1.03},
    "epsilon_high": {**MOVING, "epsilon_high": 0.05},
    "opsm": {**MOVING, "off_policy_mask_threshold": 1e-3},
    "entropy_quantile": {"gradient_accumulation_steps": 2, "top_entropy_quantile": 0.3},
    "entropy_coef": {"gradient_accumulation_steps": 2, "entropy_coef": 0.05},
    "adaptive_entropy": {"gradient_accumulation_steps": 2, "entropy_coef": 0.05,
                         "use_adaptive_entropy": True, "entropy_target": 5.0,
                         "entropy_coef_delta": 0.02, "entropy_coef_min": 0.01,
                         "entropy_coef_max": 0.07},
    "sequence_ratio": {**MOVING, "importance_sampling_level": "sequence"},
    # GSPO's bias-corrected KL multiplies k3 by the sequence ratio (KLPenalty reads it from GSPO)
    "sequence_ratio_beta_bias": {**MOVING, "importance_sampling_level": "sequence", "beta": 0.5,
                                 "use_bias_correction_kl": True},
}

#: options of TRL's reward and reference-model code (sparsecorr leaves them to TRL), one cell each
OTHER = {
    "generation_batch": {"generation_batch_size": 8},
    "scale_batch": {"scale_rewards": "batch", "gradient_accumulation_steps": 2},
    "normalize_then_sum": {"multi_objective_aggregation": "normalize_then_sum"},
    "sync_ref": {"beta": 0.5, "sync_ref_model": True, "ref_model_sync_steps": 1,
                 "ref_model_mixup_alpha": 0.5, "num_iterations": 2},
    "completion_length": {"max_completion_length": 9},
    "sapo_temperatures": {**MOVING, "loss_type": "sapo", "sapo_temperature_pos": 2.0,
                          "sapo_temperature_neg": 0.5},
    # VESPO (one class and one registry row in sparsecorr): TRL's real gamma-weight code
    "vespo_gamma": {**MOVING, "loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5,
                    "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5},
    "vespo_beta_bias": {**MOVING, "loss_type": "vespo", "beta": 0.5, "use_bias_correction_kl": True},
}


def _check(tmp_path, **overrides) -> None:
    ref = parity.run(out=tmp_path / "trl", **overrides)
    got = parity.run(SparseGRPOTrainer, out=tmp_path / "ours",
                     sparsecorr_config=SparseCorrConfig(correction=None), **overrides)
    parity.assert_parity(ref, got)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types_by_schedule(tmp_path, loss_type, schedule):
    _check(tmp_path, loss_type=loss_type, **SCHEDULES[schedule])


#: (loss type, option) pairs TRL runs that SparseGRPOTrainer rejects (sparsecorr_trl.options)
REJECTED = {(loss, option) for loss in ("cispo", "sapo", "vespo")
            for option in ("sequence_ratio", "sequence_ratio_beta_bias")}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_options_by_loss_type(tmp_path, loss_type, option):
    if (loss_type, option) in REJECTED:
        with pytest.raises(ValueError, match="importance_sampling_level"):
            parity.run(SparseGRPOTrainer, out=tmp_path, loss_type=loss_type,
                       sparsecorr_config=SparseCorrConfig(correction=None), **OPTIONS[option])
        return
    _check(tmp_path, loss_type=loss_type, **OPTIONS[option])


@pytest.mark.parametrize("cell", sorted(OTHER))
def test_other_options(tmp_path, cell):
    _check(tmp_path, **{"loss_type": "dapo", **OTHER[cell]})


@pytest.mark.parametrize("coef", [None, 0.2])
def test_moe_load_balancing_loss(tmp_path, coef):
    """A tiny Qwen3-MoE: TRL adds the router's load-balancing loss (``aux_loss``), with the
    model's coefficient or ``router_aux_loss_coef``."""
    ref = parity.run(out=tmp_path / "trl", model_kwargs={"moe": True}, loss_type="dapo",
                     num_iterations=2, router_aux_loss_coef=coef)
    got = parity.run(SparseGRPOTrainer, out=tmp_path / "ours", model_kwargs={"moe": True},
                     loss_type="dapo", num_iterations=2, router_aux_loss_coef=coef,
                     sparsecorr_config=SparseCorrConfig(correction=None))
    assert all("aux_loss" in row for row in ref.rows)
    parity.assert_parity(ref, got)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_changes_stock_trl(tmp_path, option):
    """The matrix can fail: each option, alone, changes what stock TRL trains."""
    overrides = dict(OPTIONS[option])
    base = {k: v for k, v in overrides.items()
            if k in MOVING or k == "gradient_accumulation_steps"}
    on = parity.run(out=tmp_path / "on", loss_type="dapo", **overrides)
    off = parity.run(out=tmp_path / "off", loss_type="dapo", **base)
    with pytest.raises(AssertionError):
        parity.assert_parity(off, on)


def test_every_parity_option_is_in_the_matrix():
    """Each option ``sparsecorr_trl.options.PARITY`` claims is set to a non-default value in a cell."""
    defaults = GRPOConfig(**{**parity.BASE, "output_dir": "/tmp/unused"})
    cells = [*SCHEDULES.values(), *OPTIONS.values(), *OTHER.values(), {"loss_type": "grpo"},
             {"router_aux_loss_coef": 0.2}]
    for name in PARITY:
        values = [c[name] for c in cells if name in c]
        assert any(v != getattr(defaults, name) for v in values), name
