"""sparsecorr-verl against verl 0.9.1's real code on CPU: the registered policy loss, the
driver-side rollout correction through verl's own call site, ``ppo_loss`` end to end, and the
loud plugin (verl's own entry-point loader, a changed hook signature).

verl is imported for real through tests/integration/verl/real_verl.py (verl installed with
``--no-deps`` plus its light deps tensordict / omegaconf / codetiming; Ray stood in for).
"""

from __future__ import annotations

import types

import pytest
import torch

from sparsecorr.correction import chain, sparse_rl, tis, veto
from sparsecorr.losses import PPOClip, sparse_grpo
from sparsecorr.mismatch import measure
from tests.integration.verl.real_verl import source_block, verl_source

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm")


def _actor_config(**kw):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    loss_mode = kw.pop("loss_mode", "sparsecorr")
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode), **kw)


def _batch(seed: int, b: int = 6, t: int = 10, spread: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 3 - 0.05
    old = rollout + torch.randn(b, t, generator=g) * spread
    logp = old + torch.randn(b, t, generator=g) * 0.3  # some ratios outside the clip range
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    lengths[-1] = 0  # one empty row
    mask = torch.arange(t)[None] < lengths[:, None]
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    return old, rollout, logp, mask, adv


# -- the policy loss ----------------------------------------------------------------------------

@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("global_info", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_sparsecorr_loss_equals_vanilla(verl, plugin, mode, global_info, with_weights):
    """No correction configured (or verl's own weights): loss, gradient and metrics equal
    verl's ``vanilla`` for each ``loss_agg_mode``, with and without verl's global normalisers."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    old, rollout, logp, mask, adv = _batch(1)
    cfg = _actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    if global_info:
        cfg.global_batch_info.update(dp_size=2, batch_num_tokens=int(mask.sum()) * 2 + 3,
                                     global_batch_size=13, loss_scale_factor=7)
    weights = (old - rollout).exp().clamp(max=2.0) if with_weights else None
    results = []
    for name in ("vanilla", "sparsecorr"):
        x = logp.clone().requires_grad_()
        loss, metrics = get_policy_loss_fn(name)(old, x, adv, mask, loss_agg_mode=mode, config=cfg,
                                                 rollout_is_weights=weights)
        loss.backward()
        results.append((loss.detach(), x.grad, {k: float(v) for k, v in metrics.items()}))
    (l0, g0, m0), (l1, g1, m1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
    assert m1.keys() == m0.keys()
    for k in m0:
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k


def test_sparsecorr_loss_rejects_bad_arguments(verl, plugin):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    old, _, logp, mask, adv = _batch(2)
    fn = get_policy_loss_fn("sparsecorr")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(old, logp, adv, mask, loss_agg_mode="token-median", config=_actor_config())
    with pytest.raises(ValueError, match="config"):
        fn(old, logp, adv, mask, loss_agg_mode="token-mean", config=None)


# -- the driver-side correction -----------------------------------------------------------------

def _rollout_corr_config(sparsecorr=None, **verl_keys):
    """``algorithm.rollout_correction`` as verl composes it: its own YAML group, then the
    ``sparsecorr`` key added, struct mode on (Hydra's)."""
    from omegaconf import OmegaConf

    base = OmegaConf.create(verl_source("trainer/config/algorithm/rollout_correction.yaml"))
    extra = dict(verl_keys)
    if sparsecorr is not None:
        extra["sparsecorr"] = sparsecorr
    cfg = OmegaConf.merge(base, extra)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _data_proto(old, rollout, mask, prompt_len: int = 3):
    from verl import DataProto

    b = old.shape[0]
    attention = torch.cat([torch.ones(b, prompt_len, dtype=torch.long), mask.long()], dim=1)
    return DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": rollout,
                                "response_mask": mask.float(), "attention_mask": attention})


def _run_verl_call_site(batch, rollout_corr_config):
    """Execute verl 0.9.1's own driver code (ray_trainer.py, RayPPOTrainer.fit) that reads the
    config and calls the rollout correction, as verl wrote it."""
    from omegaconf import OmegaConf

    text = verl_source("trainer/ppo/ray_trainer.py")
    read = source_block(text, "rollout_corr_config = self.config.algorithm.get(",
                        "bypass_recomputing_logprobs = rollout_corr_config and")
    call = source_block(text, "# Compute rollout correction: IS weights, rejection sampling",
                        "metrics.update(is_metrics)")
    config = OmegaConf.create({"algorithm": {"rollout_correction": rollout_corr_config}})
    scope = {"self": types.SimpleNamespace(config=config), "batch": batch, "metrics": {}}
    exec(compile(read + "\n" + call, "verl/trainer/ppo/ray_trainer.py", "exec"), scope)
    return scope["batch"], scope["metrics"]


@pytest.mark.parametrize("spec,correction", [
    ({"preset": "sparse_rl"}, sparse_rl()),
    ({"preset": "tis", "cap": 1.5}, tis(cap=1.5)),
    ({"chain": [{"preset": "tis", "cap": 2.0}, {"preset": "veto", "threshold": 1e-3}]},
     chain(tis(cap=2.0), veto(1e-3))),
])
def test_driver_correction_through_verl_call_site(verl, plugin, spec, correction):
    """verl's own call site, with ``algorithm.rollout_correction.sparsecorr`` set, writes the
    weights and the rejection sparse_grpo computes for the same correction; the loss the actor
    then computes equals sparse_grpo's own with that correction."""
    old, rollout, logp, mask, adv = _batch(3, spread=0.8)
    old[0, 1] = rollout[0, 1] - 12.0  # a vetoed token
    batch, metrics = _run_verl_call_site(_data_proto(old, rollout, mask), _rollout_corr_config(spec))
    ref_corr = correction(measure(old, rollout, mask))
    ref = sparse_grpo(logp, old, adv, mask, rollout_logp=rollout, correction=correction,
                      surrogate=PPOClip(clip_low=0.2, clip_high=0.2, dual_clip=3.0))
    assert torch.equal(batch.batch["response_mask"].bool(), ref.mask)
    assert batch.batch["response_mask"].dtype == torch.float32  # verl's dtype kept
    torch.testing.assert_close(batch.batch["rollout_is_weights"], ref_corr.weights)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    loss, _ = get_policy_loss_fn("sparsecorr")(
        old, logp, adv, batch.batch["response_mask"], loss_agg_mode="token-mean",
        config=_actor_config(), rollout_is_weights=batch.batch["rollout_is_weights"])
    torch.testing.assert_close(loss, ref.loss)
    assert all(isinstance(v, float) for v in metrics.values())
    for name in ("mismatch/kl_k3_mean", "mismatch/log_ratio_q05", "correction/kept_token_frac",
                 "mismatch/log_ratio_q05_bin0", "mismatch/bin0_tokens"):
        assert name in metrics, name
    assert metrics["mismatch/bin0_tokens"] == float(mask.sum())  # 3 + 10 positions < 2000


def test_without_sparsecorr_key_verl_runs_its_own(verl, plugin):
    """The wrapper is transparent: verl's own modes give what verl's unwrapped function gives."""
    from verl.trainer.ppo import rollout_corr_helper as rc

    old, rollout, _, mask, _ = _batch(4, spread=0.8)
    cfg = _rollout_corr_config(rollout_is="token", rollout_rs="token_k1",
                               rollout_rs_threshold="0.5_2.0")
    ours, m_ours = _run_verl_call_site(_data_proto(old, rollout, mask), cfg)
    original = rc.compute_rollout_correction_and_add_to_batch._sparsecorr_original
    theirs, m_theirs = original(_data_proto(old, rollout, mask), cfg)
    assert torch.equal(ours.batch["response_mask"], theirs.batch["response_mask"])
    torch.testing.assert_close(ours.batch["rollout_is_weights"], theirs.batch["rollout_is_weights"])
    assert m_ours.keys() == m_theirs.keys()


def test_driver_spec_refuses_double_correction_and_bypass(verl, plugin):
    old, rollout, _, mask, _ = _batch(5)
    with pytest.raises(ValueError, match="rollout_is"):
        _run_verl_call_site(_data_proto(old, rollout, mask),
                            _rollout_corr_config({"preset": "tis"}, rollout_is="token"))
    from sparsecorr_verl import driver_spec

    with pytest.raises(ValueError, match="bypass_mode"):
        driver_spec(_rollout_corr_config({"preset": "tis"}, bypass_mode=True))
    with pytest.raises(ValueError, match="preset"):
        driver_spec(_rollout_corr_config({"preset": "no_such_preset"}))
    with pytest.raises(ValueError, match="exactly one of 'preset' or 'chain'"):
        driver_spec(_rollout_corr_config({"cap": 2.0}))
    with pytest.raises(ValueError, match="n_bins"):
        driver_spec(_rollout_corr_config({"preset": "tis", "n_bins": -1}))


def test_tail_rejection_with_sampled_acceptance(verl, plugin):
    """Sparrow-style tail rejection on the sampled-token acceptance min(1, p/q): a sequence
    whose 5th-percentile acceptance is below tau leaves the loss; per-bin acceptance quantiles
    are logged."""
    old, rollout, _, mask, _ = _batch(6, spread=0.05)
    old[1, :4] = rollout[1, :4] - 3.0  # row 1: a bad tail
    spec = {"preset": "sparse_tail", "q": 0.05, "tau": 0.86, "acceptance": "sampled",
            "bin_size": 4, "n_bins": 4}
    batch, metrics = _run_verl_call_site(_data_proto(old, rollout, mask), _rollout_corr_config(spec))
    kept = batch.batch["response_mask"].bool()
    assert not kept[1].any() and kept[0].any()
    assert "mismatch/acceptance_q05_bin0" in metrics and "mismatch/bin3_tokens" in metrics


def _count_host_reads_from_the_glue(monkeypatch) -> dict[str, int]:
    """Count the tensor-to-host reads (``item``, ``tolist``, ``bool``, ``float``, ``int``)
    called from sparsecorr_verl's own files (the core library's CPU-only shortcuts, which it
    skips off the CPU, are not the glue's)."""
    import sys

    calls: dict[str, int] = {}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            if "sparsecorr_verl" in sys._getframe(1).f_code.co_filename:
                calls[_name] = calls.get(_name, 0) + 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


def test_metrics_leave_the_device_in_one_transfer(verl, plugin, monkeypatch):
    """A step's driver-side correction reads its metrics (moments, quantiles, per-bin
    quantiles: dozens) back with one ``tolist`` of one stacked tensor, never per metric."""
    old, rollout, _, mask, _ = _batch(7)
    batch, cfg = _data_proto(old, rollout, mask), _rollout_corr_config({"preset": "sparse_rl"})
    calls = _count_host_reads_from_the_glue(monkeypatch)
    _, metrics = _run_verl_call_site(batch, cfg)
    monkeypatch.undo()
    assert calls == {"tolist": 1}
    assert len(metrics) > 30


def test_policy_loss_reads_nothing_back(verl, plugin, monkeypatch):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    old, _, logp, mask, adv = _batch(9)
    fn, cfg = get_policy_loss_fn("sparsecorr"), _actor_config()
    calls = _count_host_reads_from_the_glue(monkeypatch)
    _, metrics = fn(old, logp, adv, mask, loss_agg_mode="seq-mean-token-mean", config=cfg,
                       rollout_is_weights=torch.ones_like(old))
    monkeypatch.undo()
    assert calls == {}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())


# -- ppo_loss end to end ------------------------------------------------------------------------

def _actor_data(old, adv, mask, response_mask, weights, prompt_len=4):
    """The actor's micro-batch in verl's layout: padded prompts/responses, ``attention_mask``
    (the generated tokens, ``mask``), the driver's ``response_mask`` / ``rollout_is_weights``,
    and ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` as non-tensor data, with
    ``batch_num_tokens`` counted from ``response_mask`` as verl's engines count ``loss_mask``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    b, t = old.shape
    attention = torch.cat([torch.ones(b, prompt_len, dtype=torch.long), mask.long()], dim=1)
    data = TensorDict({"prompts": torch.ones(b, prompt_len, dtype=torch.long),
                       "responses": torch.ones(b, t, dtype=torch.long),
                       "attention_mask": attention, "response_mask": response_mask,
                       "old_log_probs": old, "advantages": adv, "rollout_is_weights": weights},
                      batch_size=[b])
    tu.assign_non_tensor_data(data, "dp_size", 1)
    tu.assign_non_tensor_data(data, "batch_num_tokens", int(response_mask.sum()))
    tu.assign_non_tensor_data(data, "global_batch_size", b)
    return data


def _unpadded(logp, mask, prompt_len=4):
    """The model's log-probs in verl's no-padding layout (one flat row of prompt + response
    tokens per sequence, shifted left by one, as ``no_padding_2_padding`` slices them)."""
    lengths = mask.sum(-1)
    flat, pieces = [], []
    for i in range(logp.shape[0]):
        n = int(lengths[i])
        row = [torch.zeros(prompt_len - 1), logp[i, :n], torch.zeros(1)]
        pieces.append(torch.cat(row))
    flat = torch.cat(pieces)
    return flat


def test_ppo_loss_end_to_end_with_sparsecorr(verl, plugin):
    """verl's ``ppo_loss`` (verl/workers/utils/losses.py) with ``loss_mode="sparsecorr"`` on
    the driver's output: the same loss and gradient as sparse_grpo with the correction."""
    from verl.workers.utils.losses import ppo_loss

    old, rollout, logp, mask, adv = _batch(8, spread=0.8)
    mask[-1, :3] = True  # ppo_loss needs a non-empty response per row
    batch, _ = _run_verl_call_site(_data_proto(old, rollout, mask),
                                   _rollout_corr_config({"preset": "sparse_rl"}))
    data = _actor_data(old, adv, mask, batch.batch["response_mask"], batch.batch["rollout_is_weights"])
    flat = _unpadded(logp, mask).requires_grad_()
    cfg = _actor_config()
    loss, metrics = ppo_loss(cfg, {"log_probs": flat}, data)
    loss.backward()
    x = logp.clone().requires_grad_()
    ref = sparse_grpo(x, old, adv, mask, rollout_logp=rollout, correction=sparse_rl(),
                      surrogate=PPOClip(clip_low=0.2, clip_high=0.2, dual_clip=3.0),
                      aggregation="token-mean")
    torch.testing.assert_close(loss, ref.loss)
    ref.loss.backward()
    grad = torch.cat([torch.cat([torch.zeros(3), x.grad[i, :int(n)], torch.zeros(1)])
                      for i, n in enumerate(mask.sum(-1))])
    torch.testing.assert_close(flat.grad, grad)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/pg_loss"} <= set(metrics)
