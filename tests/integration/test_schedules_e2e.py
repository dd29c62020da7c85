"""calibrate -> fit_schedule -> generate on a tiny model (CPU, seeded).

The tiny model's attention is sharpened (its query norm scaled) so that dropping context
matters; StreamingLLM then loses acceptance as the context outgrows the budget. The fitted
schedule keeps the tail acceptance of *fresh* rollouts at or above tau in every bin, while a
constant budget of the schedule's mean size does not. The fit uses a small safety margin over
tau (tau + 0.01): the calibration's 5th percentiles come from a finite sample.
"""

import warnings

import pytest
import torch

from sparsecorr.decoding import Dense, StreamingLLM, generate, teacher_forced_logprobs
from sparsecorr.mismatch import acceptance_rate_topk, binned_quantile
from sparsecorr.schedules import calibrate, fit_schedule
from tests.models import tiny_model

BIN, BINS, NEW, TAU, MARGIN = 16, 5, 76, 0.93, 0.01


def _model():
    model = tiny_model("qwen3", vocab_size=64, num_layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(6.0)
    return model


def _fresh_tails(model, policy, budget, seed):
    prompts = torch.randint(3, 64, (16, 4), generator=torch.Generator().manual_seed(seed))
    prompts = prompts.repeat_interleave(2, 0)
    out = generate(model, prompts, policy=policy, budget=budget, max_new_tokens=NEW,
                   logprobs_topk=64, generator=torch.Generator().manual_seed(seed))
    dense = teacher_forced_logprobs(model, prompts, out.tokens, policy=Dense(), budget=None,
                                    logprobs_topk=64)
    acc = acceptance_rate_topk(out.topk_logp, out.topk_ids, dense.topk_logp, dense.topk_ids)
    return binned_quantile(acc, out.mask, 0.05, bin_size=BIN, offset=out.prompt_lengths, n_bins=BINS)


@pytest.mark.slow  # ~50-80 s on 2 cores; the demo's quick run calibrates and fits in the default suite
def test_fitted_schedule_keeps_tail_above_tau_and_constant_mean_does_not(tmp_path):
    model, policy = _model(), StreamingLLM(sink=1)
    prompts = torch.randint(3, 64, (16, 4), generator=torch.Generator().manual_seed(0))
    table = calibrate(model, prompts, policy=policy, budgets=[4, 8, 16, 32, 48], bin_size=BIN,
                      n_bins=BINS, q=0.05, max_new_tokens=NEW, samples_per_prompt=2,
                      logprobs_topk=64, seed=0, out=tmp_path)
    assert (tmp_path / "calibration.json").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dense fallback bins are allowed
        schedule = fit_schedule(table, tau=TAU + MARGIN)
    budgets = schedule.budgets
    assert list(budgets) == sorted(budgets, key=lambda b: 10**9 if b is None else b)  # monotone
    assert budgets[0] is not None and budgets[0] < 48  # it does save KV early on
    tails, counts = _fresh_tails(model, policy, schedule, seed=1)
    enough = counts >= 100
    assert enough.all()
    assert (tails[enough] >= TAU).all(), (budgets, tails)
    sizes = [NEW + 4 if b is None else b for b in budgets]
    mean = round(sum(sizes) / len(sizes))
    const_tails, _ = _fresh_tails(model, policy, mean, seed=1)
    assert (const_tails < TAU).any(), (mean, const_tails)


def test_calibrate_resumes_after_done_budgets(tmp_path, monkeypatch):
    model, policy = _model(), StreamingLLM(sink=1)
    prompts = torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(0))
    first = calibrate(model, prompts, policy=policy, budgets=[4, 8], bin_size=BIN, n_bins=2,
                      max_new_tokens=12, logprobs_topk=64, out=tmp_path)
    calls = []
    import sparsecorr.decoding as dec

    real = dec.generate
    monkeypatch.setattr(dec, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = calibrate(model, prompts, policy=policy, budgets=[4, 8], bin_size=BIN, n_bins=2,
                      max_new_tokens=12, logprobs_topk=64, out=tmp_path)
    assert calls == []  # nothing left to do
    torch.testing.assert_close(again.values, first.values, equal_nan=True)
