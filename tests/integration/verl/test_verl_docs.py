"""The YAML on docs/integrations/verl.md is what the plugin reads: each block parses with
verl's config library and gives the correction the page says it does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sparsecorr.correction import sparse_rl, sparse_tail
from sparsecorr.mismatch import measure
from tests.integration.verl.test_verl_plugin import _batch, _data_proto, _run_verl_call_site

PAGE = Path(__file__).resolve().parents[3] / "docs" / "integrations" / "verl.md"


def _yaml_blocks():
    return re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), flags=re.S)


def _rollout_corr_config(block: str):
    from omegaconf import OmegaConf

    from tests.integration.verl.real_verl import verl_source

    base = OmegaConf.create({"algorithm": {"rollout_correction": OmegaConf.create(
        verl_source("trainer/config/algorithm/rollout_correction.yaml"))}})
    return OmegaConf.merge(base, OmegaConf.create(block)).algorithm.rollout_correction


def test_the_page_has_the_three_recipes():
    assert len(_yaml_blocks()) == 3


@pytest.mark.parametrize("index", [0, 1])
def test_sparse_rl_yaml_is_sparse_rl(plugin, index):
    """Both Sparse-RL blocks (the preset, the spelled-out chain) give ``sparse_rl()``'s
    weights and rejection through verl's call site."""
    old, rollout, _, mask, _ = _batch(11, spread=0.6)
    old[2, 0] = rollout[2, 0] - 11.0  # vetoed
    batch, _ = _run_verl_call_site(_data_proto(old, rollout, mask),
                                   _rollout_corr_config(_yaml_blocks()[index]))
    ref = sparse_rl()(measure(old, rollout, mask))
    assert torch.equal(batch.batch["response_mask"].bool(), ref.mask)
    torch.testing.assert_close(batch.batch["rollout_is_weights"], ref.weights)


def test_sparrow_tail_yaml(plugin):
    old, rollout, _, mask, _ = _batch(12, spread=0.05)
    old[0, :3] = rollout[0, :3] - 2.0
    batch, metrics = _run_verl_call_site(_data_proto(old, rollout, mask),
                                         _rollout_corr_config(_yaml_blocks()[2]))
    acc = torch.exp(torch.clamp(old - rollout, max=0.0))
    ref = sparse_tail(q=0.05, tau=0.86, cap=2.0)(measure(old, rollout, mask, acceptance=acc))
    assert torch.equal(batch.batch["response_mask"].bool(), ref.mask)
    assert not ref.mask[0].any()
    torch.testing.assert_close(batch.batch["rollout_is_weights"], ref.weights)
    assert "mismatch/acceptance_q05_bin0" in metrics and "mismatch/log_ratio_q05_bin15" in metrics
