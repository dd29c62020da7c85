"""``SparseCorrConfig(sparse_max_num_seqs=...)``: a generation batch larger than the cap rolls out
through the continuous-batching scheduler (issue 50) and the training step completes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
import sparsecorr_trl.rollout as rollout_mod
from sparsecorr_trl import SparseCorrConfig

from tests.integration.trl.test_sparse_rollouts import _record_loss_inputs, _trainer


def test_a_generation_batch_larger_than_the_cap_completes(tmp_path, monkeypatch):
    metas, inner = [], rollout_mod.generate

    def spy(*a, **kw):
        out = inner(*a, **kw)
        metas.append((kw.get("max_num_seqs"), a[1].shape[0], out.meta.get("scheduler")))
        return out

    monkeypatch.setattr(rollout_mod, "generate", spy)
    cfg = SparseCorrConfig("sparse_rl", policy="rkv", policy_kwargs={"window": 2, "buffer": 2}, budget=4,
                           sparse_max_num_seqs=2)
    trainer = _trainer(tmp_path, cfg)
    seen = _record_loss_inputs(trainer)
    trainer.train()
    assert metas and all(cap == 2 and rows == 4 for cap, rows, _ in metas)
    assert all(s is not None and s["rows"] == 2 and s["max_resident"] <= 2 for _, _, s in metas)
    assert seen and all("sampling_per_token_logps" in s for s in seen)
    mask = seen[0]["completion_mask"].bool()
    assert bool(mask.any()) and bool(torch.isfinite(seen[0]["sampling_per_token_logps"][mask]).all())
    assert any("sparsecorr/rollout/tokens_per_s" in row for row in trainer.state.log_history)


@pytest.mark.parametrize("kwargs, match", [(dict(policy="rkv", budget=4, sparse_max_num_seqs=0), "sparse_max_num_seqs"),
                                           (dict(sparse_max_num_seqs=2), "sparse_max_num_seqs")])
def test_a_bad_cap_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseCorrConfig(**kwargs)
