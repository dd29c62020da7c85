"""``algorithm.adv_estimator=sparsecorr_grpo`` against verl 0.9.1's own GRPO
(``core_algos.compute_grpo_outcome_advantage``) and through verl's own driver code
(``ray_trainer.py``: the rollout correction, then ``compute_advantage``).

verl is imported for real through tests/integration/verl/real_verl.py.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from tests.integration.verl.real_verl import source_block, verl_source

EPS = 1e-6


def _rewards(seed: int, uids: list[str], t: int = 7, *, binary: bool = False):
    """Outcome rewards on each row's last response token (as verl's reward managers write
    them), every row with at least one token."""
    g = torch.Generator().manual_seed(seed)
    b = len(uids)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    r = torch.randint(0, 2, (b,), generator=g).float() if binary else torch.randn(b, generator=g)
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = r
    return rewards, mask, np.array(uids, dtype=object)


# interleaved ids, unequal groups, one group of a single row (verl's own rule applies)
UIDS = ["p", "q", "p", "r", "q", "p", "s", "q", "p", "r", "q", "r"]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("binary", [False, True])
def test_equals_verl_grpo_when_nothing_is_vetoed(verl, plugin, norm, binary):
    """No row vetoed: every row's advantage (and return) is verl's GRPO's."""
    from verl.trainer.ppo import core_algos

    fn = core_algos.get_adv_estimator_fn("sparsecorr_grpo")
    for seed in range(4):
        rewards, mask, index = _rewards(seed, UIDS, binary=binary)
        ours, ours_ret = fn(token_level_rewards=rewards, response_mask=mask, index=index,
                            config={"norm_adv_by_std_in_grpo": norm})
        theirs, theirs_ret = core_algos.compute_grpo_outcome_advantage(
            rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours_ret, theirs_ret, rtol=1e-6, atol=1e-6)
        assert ours.dtype == theirs.dtype


def test_vetoed_rows_leave_the_group_statistics(verl, plugin):
    """By hand: group ``a`` has rewards 1, 0, 1 and a vetoed row of reward 5; its mean is 2/3
    and its (Bessel) std sqrt(1/3), the vetoed row gets 0. The kept rows equal verl's GRPO on the
    batch without the vetoed rows; verl's GRPO on the whole batch leaks the vetoed reward."""
    from verl.trainer.ppo import core_algos

    t = 3
    r = torch.tensor([1.0, 0.0, 1.0, 5.0, 2.0, -1.0])
    uid = np.array(["a", "a", "a", "a", "b", "b"], dtype=object)
    rewards = torch.zeros(6, t)
    rewards[:, -1] = r
    mask = torch.ones(6, t)
    mask[3] = 0  # rejected whole by the correction: every token out of the mask
    adv, _ = core_algos.get_adv_estimator_fn("sparsecorr_grpo")(
        token_level_rewards=rewards, response_mask=mask, index=uid, config=None)
    mean, std = 2.0 / 3.0, math.sqrt(1.0 / 3.0)
    hand = [(1 - mean) / (std + EPS), (0 - mean) / (std + EPS), (1 - mean) / (std + EPS), 0.0,
            (2 - 0.5) / (math.sqrt(4.5) + EPS), (-1 - 0.5) / (math.sqrt(4.5) + EPS)]
    torch.testing.assert_close(adv, torch.tensor(hand)[:, None] * mask, rtol=1e-6, atol=1e-6)
    kept = [0, 1, 2, 4, 5]
    subset, _ = core_algos.compute_grpo_outcome_advantage(rewards[kept].clone(), mask[kept], uid[kept])
    torch.testing.assert_close(adv[kept], subset, rtol=1e-6, atol=1e-6)
    leaky, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, uid)
    assert not torch.allclose(leaky[kept], subset, atol=1e-3)  # the leak this estimator removes


def test_vetoes_on_random_batches_match_verl_without_them(verl, plugin):
    """Random vetoes: the kept rows' advantages are verl's GRPO on the kept rows alone (groups
    left with at least two kept rows), vetoed rows get 0, a group left with one kept row gives it 0."""
    from verl.trainer.ppo import core_algos

    fn = core_algos.get_adv_estimator_fn("sparsecorr_grpo")
    uids = [u for u in "abcdefgh" for _ in range(4)]
    for seed in range(5):
        rewards, mask, index = _rewards(seed, uids)
        g = torch.Generator().manual_seed(100 + seed)
        vetoed = torch.rand(len(uids), generator=g) < 0.3
        mask[vetoed] = 0
        adv, _ = fn(token_level_rewards=rewards, response_mask=mask, index=index)
        assert torch.equal(adv[vetoed], torch.zeros_like(adv[vetoed]))
        kept = (~vetoed).nonzero().squeeze(1)
        counts = {u: sum(1 for i in kept.tolist() if index[i] == u) for u in set(uids)}
        multi = [i for i in kept.tolist() if counts[index[i]] >= 2]
        lone = [i for i in kept.tolist() if counts[index[i]] == 1]
        ref, _ = core_algos.compute_grpo_outcome_advantage(rewards[multi].clone(), mask[multi], index[multi])
        torch.testing.assert_close(adv[multi], ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(adv[lone], torch.zeros_like(adv[lone]))


def _run_verl_driver(batch, *, estimator: str, rollout_corr_config: dict):
    """verl 0.9.1's own driver code, as verl wrote it: the rollout correction's call site in
    ``RayPPOTrainer.fit`` and then ``ray_trainer.compute_advantage`` (the registry branch)."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    text = verl_source("trainer/ppo/ray_trainer.py")
    read = source_block(text, "rollout_corr_config = self.config.algorithm.get(",
                        "bypass_recomputing_logprobs = rollout_corr_config and")
    call = source_block(text, "# Compute rollout correction: IS weights, rejection sampling",
                        "metrics.update(is_metrics)")
    define = source_block(text, "def compute_advantage(", "    return data")
    config = OmegaConf.create({"algorithm": {"rollout_correction": rollout_corr_config,
                                             "adv_estimator": estimator, "norm_adv_by_std_in_grpo": True}})
    scope = {"self": types.SimpleNamespace(config=config), "batch": batch, "metrics": {},
             "DataProto": DataProto, "AdvantageEstimator": AdvantageEstimator, "core_algos": core_algos,
             "AlgoConfig": AlgoConfig, "Optional": __import__("typing").Optional, "np": np, "torch": torch,
             "compute_response_mask": None}
    exec(compile(define + "\n" + read + "\n" + call, "verl/trainer/ppo/ray_trainer.py", "exec"), scope)
    out = scope["compute_advantage"](scope["batch"], adv_estimator=config.algorithm.adv_estimator,
                                     norm_adv_by_std_in_grpo=True, config=config.algorithm)
    return out


def test_through_verl_driver_after_the_correction(verl, plugin):
    """verl's driver: the sparsecorr correction vetoes rows whole (``veto`` on one token each),
    then verl's ``compute_advantage`` with ``adv_estimator=sparsecorr_grpo`` leaves them out:
    their advantage is 0 and the others equal verl's GRPO on the kept rows alone."""
    from verl import DataProto
    from verl.trainer.ppo import core_algos

    uids = [u for u in "abc" for _ in range(4)]
    rewards, mask, index = _rewards(7, uids)
    b, t = rewards.shape
    g = torch.Generator().manual_seed(7)
    rollout = -torch.rand(b, t, generator=g) - 0.1
    old = rollout + torch.randn(b, t, generator=g) * 0.05
    vetoed = torch.tensor([1, 6, 7])
    old[vetoed, 0] = rollout[vetoed, 0] - 12.0  # ratio e^-12: under veto's 1e-4 threshold
    attention = torch.cat([torch.ones(b, 2), mask], dim=1).long()
    batch = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                 "attention_mask": attention, "token_level_rewards": rewards},
                                non_tensors={"uid": index})
    spec = {"rollout_is": None, "rollout_rs": None, "bypass_mode": False,
            "sparsecorr": {"preset": "veto", "threshold": 1e-4}}
    out = _run_verl_driver(batch, estimator="sparsecorr_grpo", rollout_corr_config=spec)
    adv = out.batch["advantages"]
    assert torch.equal(out.batch["response_mask"][vetoed], torch.zeros(len(vetoed), t))
    assert torch.equal(adv[vetoed], torch.zeros(len(vetoed), t))
    kept = [i for i in range(b) if i not in vetoed.tolist()]
    ref, _ = core_algos.compute_grpo_outcome_advantage(rewards[kept].clone(), mask[kept], index[kept])
    torch.testing.assert_close(adv[kept], ref, rtol=1e-6, atol=1e-6)


def test_registration_and_arguments(verl, plugin):
    """The plugin registers the estimator and `uninstall` removes it; no ``index`` is refused."""
    from sparsecorr_verl import ADV_ESTIMATOR, compute_sparsecorr_grpo_advantage
    from verl.trainer.ppo import core_algos

    assert core_algos.get_adv_estimator_fn(ADV_ESTIMATOR) is compute_sparsecorr_grpo_advantage
    plugin.uninstall()
    assert ADV_ESTIMATOR not in core_algos.ADV_ESTIMATOR_REGISTRY
    plugin.install()
    assert core_algos.get_adv_estimator_fn(ADV_ESTIMATOR) is compute_sparsecorr_grpo_advantage
    rewards, mask, _ = _rewards(0, ["a", "a"])
    with pytest.raises(ValueError, match="index"):
        compute_sparsecorr_grpo_advantage(rewards, mask, None)
    with pytest.raises(ValueError, match="response_mask"):
        compute_sparsecorr_grpo_advantage(rewards, mask[:, :-1], np.array(["a", "a"], dtype=object))
