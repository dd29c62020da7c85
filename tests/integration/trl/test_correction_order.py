"""The correction runs in the generate-and-score step (``sparsecorr_trl.score``): rollouts it
rejects whole leave their group's statistics, ``sparse_tail`` reads the acceptance the trainer
computes (top-k 1 - TV, the statistic calibration measures) and rejects what it should, and
the controller is fed the same acceptance."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from sparsecorr_trl import SparseCorrCallback, SparseCorrConfig, SparseGRPOTrainer
from sparsecorr_trl.advantages import trl_advantages

from sparsecorr.correction import Correction, sparse_tail
from sparsecorr.decoding import Dense, StreamingLLM, teacher_forced_logprobs
from sparsecorr.mismatch import acceptance_rate_topk, masked_quantile
from sparsecorr.schedules import BudgetSchedule, TailController
from tests.integration.trl import parity


class Recording(SparseGRPOTrainer):
    """Keeps every scored generation batch and its rewards (all processes)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        gen = {"out": dict(out), "rewards": self._sparsecorr_rewards.clone(),
               "trl": getattr(self, "_trl_before_score", None)}
        self.generations = [*getattr(self, "generations", []), gen]
        return out


@pytest.fixture(autouse=True)
def _keep_trls_output(monkeypatch):
    """Record TRL's advantages and token count before ``score_rollouts`` changes them."""
    import sparsecorr_trl.trainer as mod

    real = mod.score_rollouts

    def recording(trainer, out, **kwargs):
        trainer._trl_before_score = {"advantages": out["advantages"].clone(),
                                     "num_items": out["num_items_in_batch"].clone()}
        return real(trainer, out, **kwargs)

    monkeypatch.setattr(mod, "score_rollouts", recording)


class VetoFirstOfEachGroup:
    """Rejects the first rollout of every group of 4 (as a veto rejects a sequence whole)."""

    def __call__(self, mm):
        keep = torch.ones(mm.shape[0], dtype=torch.bool)
        keep[::4] = False
        return Correction(mask=mm.valid & keep[:, None], source=mm)


def _by_hand(rewards: torch.Tensor, valid: torch.Tensor, g: int = 4) -> torch.Tensor:
    """GRPO advantages over each group's valid members (Bessel std, TRL's 1e-4), 0 elsewhere."""
    out = torch.zeros_like(rewards)
    for s in range(0, rewards.numel(), g):
        r, v = rewards[s:s + g], valid[s:s + g]
        mean, std = r[v].mean(), r[v].std()
        out[s:s + g] = torch.where(v, (r - mean) / (std + 1e-4), 0.0)
    return out


def test_vetoed_rollouts_leave_their_group_statistics(tmp_path):
    cfg = SparseCorrConfig(VetoFirstOfEachGroup(), policy="dense")
    run = parity.run(Recording, out=tmp_path, sparsecorr_config=cfg, loss_type="dapo")
    for gen in run.trainer.generations:
        rewards = gen["rewards"][:, 0]
        valid = torch.ones_like(rewards, dtype=torch.bool)
        valid[::4] = False
        got = gen["out"]["advantages"]
        torch.testing.assert_close(got, _by_hand(rewards, valid), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got, gen["trl"]["advantages"])  # TRL's kept them in
        assert float(gen["out"]["num_items_in_batch"]) == float(gen["out"]["sparsecorr_mask"].sum())
        assert float(gen["out"]["num_items_in_batch"]) < float(gen["trl"]["num_items"])
    assert all(row["sparsecorr/advantages/regrouped_seqs"] == 1.0 for row in run.rows)


def _two_rewards(completions, **kwargs):
    """A second reward that declines (None) every third completion."""
    return [None if i % 3 == 0 else float(c.count("a")) for i, c in enumerate(completions)]


@pytest.mark.parametrize("scale, aggregation", [
    ("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("none", "sum_then_normalize"),
    ("group", "normalize_then_sum"),
])
def test_advantages_without_a_veto_are_trls_bit_for_bit(tmp_path, scale, aggregation):
    run = parity.run(Recording, out=tmp_path, sparsecorr_config=SparseCorrConfig(correction=None),
                     scale_rewards=scale, multi_objective_aggregation=aggregation,
                     reward_weights=[1.0, 0.5], max_steps=2, gradient_accumulation_steps=2,
                     trainer_kwargs={"reward_funcs": [parity.reward, _two_rewards]})
    trainer = run.trainer
    for gen in trainer.generations:  # no correction: the batch holds TRL's own advantages
        assert torch.isnan(gen["rewards"][:, 1]).any()
        ours = trl_advantages(gen["rewards"], trainer.reward_weights, num_generations=4,
                              scale_rewards=scale, multi_objective_aggregation=aggregation)
        assert torch.equal(ours, gen["out"]["advantages"])


def test_sparse_tail_through_the_trainer_rejects_rows_below_tau(tmp_path, monkeypatch):
    import sparsecorr_trl.score as score

    seen = []
    real = score.acceptance
    monkeypatch.setattr(score, "acceptance", lambda *a: seen.append(real(*a)) or seen[-1])
    fed = []
    cb = SparseCorrCallback(TailController(BudgetSchedule(bin_size=64, budgets=(2,)), [2, 4]))
    cb.observe = lambda acc, mask, offset=None: fed.append(acc)
    cfg = SparseCorrConfig(sparse_tail(q=0.05, tau=0.86), policy="streaming_llm",
                           policy_kwargs={"sink": 1}, budget=2, acceptance_topk=64)
    run = parity.run(Recording, out=tmp_path, sparsecorr_config=cfg, max_completion_length=10,
                     loss_type="dapo", trainer_kwargs={"callbacks": [cb]})
    gens = run.trainer.generations
    assert len(seen) == len(gens) == len(fed) == 3
    kept_rows = rejected_rows = 0
    for acc, gen, fed_acc in zip(seen, gens, fed, strict=True):
        out = gen["out"]
        valid = out["completion_mask"].bool()
        tail = masked_quantile(acc, valid, 0.05, dim=1)
        assert torch.equal(out["sparsecorr_mask"].any(1), tail >= 0.86)
        assert fed_acc is acc  # the controller reads the same acceptance
        kept_rows += int((tail >= 0.86).sum())
        rejected_rows += int((tail < 0.86).sum())
    assert kept_rows and rejected_rows, (kept_rows, rejected_rows)
    logged = [row["sparsecorr/correction/tail_rejected_seqs"] for row in run.rows]
    assert sum(logged) == rejected_rows
    # the trainer's acceptance is calibration's statistic: top-k 1 - TV between the sparse
    # sampler and the dense model, recomputed by teacher forcing (first batch: initial weights)
    out = gens[0]["out"]
    model, mask = parity.model().eval(), out["completion_mask"].bool()
    kw = dict(attention_mask=out["prompt_mask"], response_mask=mask, logprobs_topk=64)
    sparse = teacher_forced_logprobs(model, out["prompt_ids"], out["completion_ids"],
                                     policy=StreamingLLM(sink=1), budget=2, **kw)
    dense = teacher_forced_logprobs(model, out["prompt_ids"], out["completion_ids"],
                                    policy=Dense(), budget=None, **kw)
    want = acceptance_rate_topk(dense.topk_logp, dense.topk_ids, sparse.topk_logp, sparse.topk_ids)
    torch.testing.assert_close(seen[0][mask], want[mask], atol=1e-4, rtol=0)
