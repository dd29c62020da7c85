"""SparsePolicyLoss against OpenRLHF 0.11's real PolicyLoss (loaded via tests/openrlhf_shim.py)."""

import json
import sys

import pytest
import torch

from sparsecorr.correction import sparse_rl, tis
from tests.openrlhf_shim import load_openrlhf_loss_module, load_openrlhf_module, openrlhf_available

pytestmark = pytest.mark.skipif(not openrlhf_available(), reason="openrlhf not installed")

from sparsecorr_openrlhf import SparsePolicyLoss, use_sparsecorr  # noqa: E402
from sparsecorr_openrlhf import train_ppo_ray as launcher  # noqa: E402
from sparsecorr_openrlhf._version import check_openrlhf_version  # noqa: E402

SETTINGS = [
    ("off", "mask", "ratio", (0.5, 5.0)),
    ("token", "mask", "ratio", (0.5, 5.0)),
    ("token", "mask", "ratio", (0.8, 1.25)),
    ("token", "clip", "ratio", (0.8, 1.25)),
    ("seq", "mask", "ratio", (0.9, 1.1)),
    ("token", "mask", "binary_kl", (0.0, 0.01)),
    ("seq", "mask", "binary_kl", (0.0, 0.005)),
    ("token", "mask", "tv", (0.0, 0.05)),
    ("seq", "mask", "tv", (0.0, 0.03)),
]


def _batch(seed, b=6, t=32):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 3 - 0.01
    old = (rollout + torch.randn(b, t, generator=g) * 0.3).clamp(max=-1e-3)
    logp = old + torch.randn(b, t, generator=g) * 0.2
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = 0 if b > 2 else lengths[0]  # an empty row
    mask = torch.arange(t)[None] < lengths[:, None]
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    return logp, old, rollout, mask, adv


def _both(setting, **loss_kwargs):
    level, mode, gating, threshold = setting
    peer = load_openrlhf_loss_module().PolicyLoss(
        is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
        is_correction_threshold=threshold, **loss_kwargs)
    ours = SparsePolicyLoss(is_correction_level=level, is_correction_mode=mode,
                            is_correction_gating=gating, is_correction_threshold=threshold, **loss_kwargs)
    return peer, ours


def _run(loss_fn, logp, old, rollout, mask, adv, **kw):
    x = logp.clone().requires_grad_(True)
    out = loss_fn(x, old, adv, action_mask=mask.float() if "peer" in kw.pop("who") else mask,
                  rollout_log_probs=rollout, **kw)
    out[0].backward()
    return out, x.grad


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("dp", [None, (2, 123.0, 9.0)])
def test_loss_and_gradient_equal_openrlhf(setting, token_level_loss, dual_clip, dp):
    logp, old, rollout, mask, adv = _batch(0)
    peer, ours = _both(setting, token_level_loss=token_level_loss, dual_clip=dual_clip,
                       clip_eps_low=0.2, clip_eps_high=0.28)
    kw = {} if dp is None else dict(dp_size=dp[0], batch_num_tokens=dp[1], global_batch_size=dp[2])
    (p_loss, p_clip, p_kl, p_vkl, p_filter), p_grad = _run(peer, logp, old, rollout, mask, adv, who="peer", **kw)
    (o_loss, o_clip, o_kl, o_vkl, o_filter), o_grad = _run(ours, logp, old, rollout, mask, adv, who="ours", **kw)
    torch.testing.assert_close(o_loss, p_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o_grad, p_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(o_clip, p_clip)
    torch.testing.assert_close(o_kl, p_kl, rtol=1e-5, atol=1e-6)
    if setting[0] == "off":
        assert o_vkl is None and p_vkl is None
    else:
        torch.testing.assert_close(o_vkl, p_vkl, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o_filter.float(), p_filter.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_sharding_invariance_with_global_counts(token_level_loss):
    logp, old, rollout, mask, adv = _batch(1, b=8)
    # a correction without batch normalisation: sparse_rl() normalises per shard unless it is
    # given the data-parallel process group (sparse_rl(group=...))
    loss = SparsePolicyLoss(token_level_loss=token_level_loss, correction=tis(cap=2.0))
    n_tok, n_seq = float(mask.sum()), float(mask.any(-1).sum())
    whole = loss(logp, old, adv, mask, rollout, dp_size=1, batch_num_tokens=n_tok, global_batch_size=n_seq)[0]
    halves = [loss(logp[s], old[s], adv[s], mask[s], rollout[s], dp_size=2,
                   batch_num_tokens=n_tok, global_batch_size=n_seq)[0] for s in (slice(0, 4), slice(4, 8))]
    # DeepSpeed averages gradients over dp ranks: the mean of the shard losses is the whole
    torch.testing.assert_close((halves[0] + halves[1]) / 2, whole, rtol=1e-5, atol=1e-6)


def test_correction_without_rollout_logprobs_fails_loudly():
    logp, old, _, mask, adv = _batch(2)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        SparsePolicyLoss(correction="sparse_rl")(logp, old, adv, mask, None)


def test_use_sparsecorr_swaps_loss_and_routes_metrics_into_info():
    Experience = load_openrlhf_module("openrlhf.trainer.ppo_utils.experience").Experience
    peer = load_openrlhf_loss_module().PolicyLoss(clip_eps_low=0.1, clip_eps_high=0.3, token_level_loss=False)
    logp, old, rollout, mask, adv = _batch(3)

    class FakeTrainer:  # the two members OpenRLHF's ActorPPOTrainer exposes to the hook
        actor_loss_fn = peer

        def training_step(self, experience, kl_ctl, step):
            out = self.actor_loss_fn(logp, experience.action_log_probs, experience.advantages,
                                     action_mask=experience.action_mask,
                                     rollout_log_probs=experience.rollout_log_probs)
            return {"policy_loss": out[0].detach(), **experience.info}

    trainer = FakeTrainer()
    loss = use_sparsecorr(trainer, correction="sparse_rl")
    assert trainer.actor_loss_fn is loss
    assert (loss.clip_eps_low, loss.clip_eps_high, loss.token_level_loss) == (0.1, 0.3, False)
    exp = Experience(action_log_probs=old, rollout_log_probs=rollout, advantages=adv, action_mask=mask)
    status = trainer.training_step(exp, 0.0, 0)
    for key in ("mismatch/kl_k3_mean", "mismatch/log_ratio_q05", "correction/kept_token_frac",
                "correction/vetoed_seqs"):
        assert key in status and status[key].dim() == 0
    assert loss.info is None  # detached after the step


def test_launcher_parses_installs_and_runs_openrlhf(monkeypatch):
    calls = {}
    monkeypatch.setattr(launcher, "install", lambda spec: calls.setdefault("install", spec))
    monkeypatch.setattr(launcher, "_init_ray", lambda spec: calls.setdefault("ray", spec))

    def fake_run_module(name, run_name, alter_sys):
        calls["run"] = (name, run_name, list(sys.argv))

    monkeypatch.setattr(launcher.runpy, "run_module", fake_run_module)
    monkeypatch.delenv("SPARSECORR_OPENRLHF", raising=False)
    argv = ["--actor.model_name_or_path", "m", "--sparsecorr.correction", "sparse_rl",
            "--sparsecorr.cap", "1.3", "--algo.advantage.estimator", "group_norm"]
    launcher.main(argv)
    spec = calls["install"]
    assert spec["name"] == "sparse_rl" and spec["numbers"] == {"cap": 1.3}
    assert calls["run"][0] == "openrlhf.cli.train_ppo_ray" and calls["run"][1] == "__main__"
    assert calls["run"][2][1:] == ["--actor.model_name_or_path", "m", "--algo.advantage.estimator", "group_norm"]
    import os

    assert json.loads(os.environ["SPARSECORR_OPENRLHF"])["numbers"] == {"cap": 1.3}


def test_launcher_rejects_bad_correction():
    with pytest.raises(ValueError, match="name: expected one of"):
        launcher.parse_sparsecorr_args(["--sparsecorr.correction", "nope"])
    with pytest.raises(ValueError, match="numbers"):
        launcher.parse_sparsecorr_args(["--sparsecorr.correction", "veto", "--sparsecorr.cap", "2"])


def test_version_check_messages():
    assert check_openrlhf_version("0.11.2") == "0.11.2"
    with pytest.raises(ImportError, match=r">=0\.11,<0\.12"):
        check_openrlhf_version("0.10.4")


def test_one_optimizer_step_of_a_tiny_model_with_experience_fields():
    from sparsecorr.mismatch import token_logprobs
    from tests.models import tiny_model

    Experience = load_openrlhf_module("openrlhf.trainer.ppo_utils.experience").Experience
    torch.manual_seed(0)
    model = tiny_model("qwen3")
    model.train()
    b, prompt, resp = 4, 6, 10
    seqs = torch.randint(3, 128, (b, prompt + resp))
    action_mask = torch.ones(b, resp, dtype=torch.bool)
    action_mask[1, 7:] = False
    with torch.no_grad():
        old = token_logprobs(model(seqs).logits[:, prompt - 1:-1], seqs[:, prompt:])
    rollout = old + 0.1 * torch.randn_like(old)  # a sparse sampler's log-probs
    exp = Experience(sequences=seqs, action_mask=action_mask, action_log_probs=old,
                     rollout_log_probs=rollout, advantages=torch.randn(b, 1).expand(b, resp).clone())
    loss_fn = SparsePolicyLoss(correction=sparse_rl())
    loss_fn.info = exp.info
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    logp = token_logprobs(model(exp.sequences).logits[:, prompt - 1:-1], exp.sequences[:, prompt:])
    loss, *_ = loss_fn(logp, exp.action_log_probs, exp.advantages, exp.action_mask, exp.rollout_log_probs,
                       dp_size=1, batch_num_tokens=float(action_mask.sum()))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert "correction/ess" in exp.info and "mismatch/kl_k3_mean" in exp.info


@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_gspo_loss_gradient_and_metrics_equal_openrlhf(token_level_loss, dual_clip):
    """GSPO clips the sequence ratio; OpenRLHF's clip_ratio counts tokens whose *sequence*
    ratio was clipped (not the per-token ratio)."""
    logp, old, rollout, mask, adv = _batch(4, b=8)
    logp = old + torch.randn_like(old) * 0.4  # wide enough that sequence and token clips differ
    kw = dict(policy_loss_type="gspo", token_level_loss=token_level_loss, dual_clip=dual_clip,
              clip_eps_low=3e-4, clip_eps_high=4e-4)
    peer = load_openrlhf_loss_module().PolicyLoss(**kw)
    ours = SparsePolicyLoss(**kw)
    (p_loss, p_clip, p_kl, p_vkl, _), p_grad = _run(peer, logp, old, rollout, mask, adv, who="peer")
    (o_loss, o_clip, o_kl, o_vkl, _), o_grad = _run(ours, logp, old, rollout, mask, adv, who="ours")
    torch.testing.assert_close(o_loss, p_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o_grad, p_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(o_clip, p_clip)
    torch.testing.assert_close(o_kl, p_kl, rtol=1e-5, atol=1e-6)
    assert o_vkl is None and p_vkl is None
    # the metric really is the sequence one: per-token clipping would count a different fraction
    token_clip = SparsePolicyLoss(clip_eps_low=3e-4, clip_eps_high=4e-4, dual_clip=dual_clip)
    assert not torch.allclose(token_clip(logp, old, adv, mask, rollout)[1], p_clip)


def test_vllm_kl_masks_and_counts_a_minus_inf_rollout_logprob():
    logp, old, rollout, mask, adv = _batch(5)
    row, col = 1, 0
    assert mask[row, col]
    peer, ours = _both(("token", "mask", "ratio", (0.5, 5.0)))
    finite = ours(logp, old, adv, mask, rollout)[3]
    torch.testing.assert_close(finite, peer(logp, old, adv, mask.float(), rollout)[3])
    bad = rollout.clone()
    bad[row, col] = float("-inf")
    loss, _, _, vllm_kl, _ = ours(logp, old, adv, mask, bad)
    kept = mask.clone()
    kept[row, col] = False
    expected = torch.where(kept, rollout - old, 0.0).sum() / kept.sum()
    torch.testing.assert_close(vllm_kl, expected)  # the -inf token is left out, not -1e38
    assert torch.isfinite(loss) and abs(float(vllm_kl)) < 10
    assert float(ours.last_metrics["correction/nonfinite_count"]) == 1.0


def test_vllm_kl_is_openrlhfs_for_a_finite_logprob_beyond_the_log_ratio_clamp():
    """A finite rollout log-prob far below the old one (log-ratio beyond the record's ±20 clamp)
    moves ``vllm_kl`` as much as it moves OpenRLHF's: the unclamped masked mean (issue 35: the
    clamped record mean gave -0.625 where OpenRLHF gives -3.1e28)."""
    logp, old, rollout, mask, adv = _batch(5)
    row, col = 1, 0
    assert mask[row, col]
    far = rollout.clone()
    far[row, col] = -1e30  # finite: rollout_logp - old_logp = -1e30, far beyond -20
    peer, ours = _both(("token", "mask", "ratio", (0.5, 5.0)))
    p_vkl = peer(logp, old, adv, mask.float(), far)[3]
    o_vkl = ours(logp, old, adv, mask, far)[3]
    assert float(p_vkl) < -1e27  # OpenRLHF's value: about -1e30 / (number of tokens)
    torch.testing.assert_close(o_vkl, p_vkl, rtol=1e-5, atol=0.0)
    expected = torch.where(mask, far - old, 0.0).sum() / mask.sum()
    torch.testing.assert_close(o_vkl, expected, rtol=1e-5, atol=0.0)


def test_launcher_help_prints_flags_without_starting_ray(monkeypatch, capsys):
    def forbidden(*_a, **_k):
        raise AssertionError("--help must not install the hook or start Ray")

    monkeypatch.setattr(launcher, "install", forbidden)
    monkeypatch.setattr(launcher, "_init_ray", forbidden)
    shown = {}

    def fake_run_module(name, run_name, alter_sys):  # OpenRLHF's argparse: help, then exit 0
        shown["argv"] = list(sys.argv)
        raise SystemExit(0)

    monkeypatch.setattr(launcher.runpy, "run_module", fake_run_module)
    launcher.main(["--help", "--sparsecorr.correction", "sparse_rl"])
    out = capsys.readouterr().out
    assert "--sparsecorr.threshold" in out and "--sparsecorr.correction" in out
    assert shown["argv"] == ["openrlhf.cli.train_ppo_ray", "--help"]


def test_launcher_help_as_a_process_without_ray(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "sparsecorr_openrlhf.train_ppo_ray", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "--sparsecorr.correction" in proc.stdout
    assert "ray.init" not in proc.stderr and "Traceback" not in proc.stderr


def test_launcher_passes_a_preset_choice():
    spec, rest = launcher.parse_sparsecorr_args(
        ["--sparsecorr.correction", "trl", "--sparsecorr.mode", "token_mask", "--x", "1"])
    assert spec["numbers"] == {"mode": "token_mask"} and rest == ["--x", "1"]
    with pytest.raises(ValueError, match="mode"):
        launcher.parse_sparsecorr_args(["--sparsecorr.correction", "trl", "--sparsecorr.mode", "nope"])
