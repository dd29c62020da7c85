"""SparseGRPOTrainer generating with sparsecorr.decoding (no vLLM), its controller and DistillSparse."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
from datasets import Dataset
from sparsecorr_trl import SparseCorrCallback, SparseCorrConfig, SparseGRPOTrainer
from trl import GRPOConfig

from sparsecorr.decoding import StreamingLLM, teacher_forced_logprobs
from sparsecorr.losses import adapter_parameters, dense_mode
from sparsecorr.schedules import BudgetSchedule
from tests.integration.trl.test_trainer import _tokenizer
from tests.models import tiny_model


def _reward(completions, **kwargs):
    """Distinct characters per completion: varies within a group, so advantages are non-zero."""
    return [float(len(set(c))) for c in completions]


def _args(tmp_path, **overrides):
    cfg = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
               max_completion_length=8, max_steps=2, logging_steps=1, report_to=[],
               use_cpu=True, bf16=False, seed=0, save_strategy="no", learning_rate=1e-3,
               loss_type="grpo")
    cfg.update(overrides)
    return GRPOConfig(**cfg)


def _trainer(tmp_path, config, callbacks=None, **overrides):
    torch.manual_seed(0)
    data = Dataset.from_dict({"prompt": ["abc =", "xyz =", "key 12 =", "q ="] * 2})
    model = tiny_model("qwen3", vocab_size=64).train()
    return SparseGRPOTrainer(model=model, reward_funcs=_reward, args=_args(tmp_path, **overrides),
                             train_dataset=data, processing_class=_tokenizer(),
                             callbacks=callbacks, sparsecorr_config=config)


def _record_loss_inputs(trainer):
    seen = []
    inner = trainer._compute_loss

    def wrapped(model, inputs):
        seen.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return inner(model, inputs)

    trainer._compute_loss = wrapped
    return seen


def test_sparse_generation_feeds_rollout_logp_into_the_corrected_loss(tmp_path):
    cfg = SparseCorrConfig("sparse_rl", policy="streaming_llm", policy_kwargs={"sink": 1},
                           budget=4)
    trainer = _trainer(tmp_path, cfg)
    seen = _record_loss_inputs(trainer)
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    for key in ("sparsecorr/rollout/tokens_per_s", "sparsecorr/rollout/peak_kv_bytes",
                "sparsecorr/rollout/mean_budget", "sparsecorr/mismatch/log_ratio_mean"):
        assert any(k.startswith(key) for k in logged), (key, sorted(logged))
    assert seen and all("sampling_per_token_logps" in s for s in seen)
    batch = seen[0]
    mask = batch["completion_mask"].bool()
    roll = batch["sampling_per_token_logps"]
    assert bool((roll[mask] <= 0).all()) and bool(torch.isfinite(roll[mask]).all())
    # the recorded log-probs are the sparse sampler's own: teacher forcing reproduces them
    # (the first optimizer step has not happened yet when the first batch is generated)
    model = tiny_model("qwen3", vocab_size=64)
    again = teacher_forced_logprobs(model, batch["prompt_ids"], batch["completion_ids"],
                                    policy=StreamingLLM(sink=1), budget=4,
                                    attention_mask=batch["prompt_mask"], response_mask=mask,
                                    temperature=trainer.temperature)
    torch.testing.assert_close(again.rollout_logp[mask], roll[mask], atol=1e-4, rtol=0)
    # completions stop at EOS (kept, as TRL's generate path keeps it) or at the length limit
    eos = trainer.eos_token_ids[0]
    for ids, m in zip(batch["completion_ids"], mask):
        toks = ids[m].tolist()
        assert eos not in toks[:-1]


def test_schedule_controller_is_added_and_fed(tmp_path):
    path = BudgetSchedule(bin_size=4, budgets=(2, 4, None)).save(tmp_path / "schedule.json")
    cfg = SparseCorrConfig(policy="streaming_llm", policy_kwargs={"sink": 1}, schedule=str(path),
                           controller=True, controller_candidates=(2, 4, 8))
    trainer = _trainer(tmp_path, cfg)
    (cb,) = trainer._callbacks()
    assert cb.controller.candidates == [2, 4, 8] and cb.controller.tau == cfg.tau
    cb.controller.min_tokens = 1
    fed = []
    observe = cb.observe
    cb.observe = lambda acc, mask, offset=None: (fed.append(offset), observe(acc, mask, offset))
    trainer.train()
    assert fed and all(o is not None and o.dim() == 1 for o in fed)
    assert cb.controller.steps == 2
    assert trainer.sparsecorr_live_budget is cb.schedule
    logged = {k for row in trainer.state.log_history for k in row}
    assert "sparsecorr/schedule/bin_0" in logged
    tails = {k: v for row in trainer.state.log_history for k, v in row.items()
             if k.startswith("sparsecorr/tail/bin_")}
    assert tails and all(0.0 <= v <= 1.0 for v in tails.values())


def test_live_schedule_reaches_the_sampler(tmp_path):
    cfg = SparseCorrConfig(policy="streaming_llm", budget=4)
    trainer = _trainer(tmp_path, cfg, callbacks=[SparseCorrCallback(
        __import__("sparsecorr.schedules", fromlist=["TailController"]).TailController(
            BudgetSchedule(bin_size=64, budgets=(3,)), [3, 6]))])
    got = []
    import sparsecorr_trl.trainer as mod

    real = mod.sparse_rollouts
    mod.sparse_rollouts = lambda *a, **k: (got.append(k["budget"]), real(*a, **k))[1]
    try:
        trainer.train()
    finally:
        mod.sparse_rollouts = real
    assert got and all(isinstance(b, BudgetSchedule) and b.budgets == (3,) for b in got)


@pytest.mark.parametrize("overrides, match", [
    (dict(use_vllm=True), "use_vllm"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(min_p=0.1), "min_p"),
])
def test_generation_settings_the_sampler_cannot_honour_are_rejected(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, SparseCorrConfig(policy="streaming_llm", budget=4), **overrides)


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="streaming_llm"), "budget"),
    (dict(policy="streaming_llm", budget=4, schedule="x.json"), "budget/schedule"),
    (dict(budget=4), "policy"),
    (dict(policy="streaming_llm", budget=4, controller=True), "controller"),
    (dict(distill=True), "distill"),
    (dict(policy="nope", budget=4), "^policy: "),
    (dict(policy="streaming_llm", schedule="/nonexistent.json"), "schedule"),
    (dict(policy="streaming_llm", budget=0), "budget"),
    (dict(correction="nope"), "nope"),
])
def test_invalid_config_combinations_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseCorrConfig(**kwargs)


def test_distill_sparse_trains_the_adapter_and_keeps_learner_dense(tmp_path):
    cfg = SparseCorrConfig(policy="streaming_llm", policy_kwargs={"sink": 1}, budget=4,
                           distill=True, distill_rank=4, distill_lr=1e-2)
    trainer = _trainer(tmp_path, cfg)
    model = trainer.accelerator.unwrap_model(trainer.model)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().max()) == 0 for p in lora_b)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainer.train()
    assert any(float(p.abs().max()) > 0 for p in lora_b), "the adapter was not updated"
    assert any(not torch.equal(base[n], p) for n, p in model.named_parameters() if n in base)
    logged = {k for row in trainer.state.log_history for k in row}
    assert {"sparsecorr/distill/kl_k3_mean", "sparsecorr/distill/loss"} <= logged
    # every learner forward runs the dense model: the adapter is off inside the trainer's
    # log-prob computation, on outside it (the sparse sampler)
    ids = torch.randint(4, 40, (2, 9))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        got, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, 5)
        with dense_mode(model):
            dense = model(input_ids=ids).logits[:, -6:-1].float() / trainer.temperature
        sparse = model(input_ids=ids).logits[:, -6:-1].float() / trainer.temperature
    tgt = ids[:, -5:, None]
    want = dense.log_softmax(-1).gather(-1, tgt).squeeze(-1)
    other = sparse.log_softmax(-1).gather(-1, tgt).squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got, other, atol=1e-5)
    assert all(p.grad is None for p in adapter_parameters(model))


def test_distill_rejects_a_reference_model_setting(tmp_path):
    cfg = SparseCorrConfig(policy="streaming_llm", budget=4, distill=True)
    with pytest.raises(ValueError, match="beta"):
        _trainer(tmp_path, cfg, beta=0.1)


@pytest.mark.slow  # ~25 s idle (50 s loaded); the adapter's training path stays in the default run through
# test_distill_sparse_trains_the_adapter_and_keeps_learner_dense
def test_adapter_step_lowers_the_sparse_dense_k3_on_a_batch():
    """With zero advantages the adapter loss is lambda * k3: repeated steps on one batch must
    bring the sparse sampler (StreamingLLM, budget 4) + adapter closer to the dense model."""
    from sparsecorr_trl.distill import AdapterStep

    from sparsecorr.decoding import Dense, generate
    from sparsecorr.losses import sparse_adapter

    torch.manual_seed(0)
    model = sparse_adapter(tiny_model("qwen3", vocab_size=64), r=4)
    prompts = torch.randint(4, 60, (4, 6), generator=torch.Generator().manual_seed(1))
    policy = StreamingLLM(sink=1)
    with torch.no_grad():
        batch = generate(model, prompts, policy=policy, budget=4, max_new_tokens=12,
                         generator=torch.Generator().manual_seed(2))
        with dense_mode(model):
            dense = teacher_forced_logprobs(model, prompts, batch.tokens, policy=Dense(),
                                            budget=None, response_mask=batch.mask)
    step = AdapterStep(model, lr=5e-3, kl_weight=1.0)
    kw = dict(prompt_ids=prompts, prompt_mask=torch.ones_like(prompts),
              completion_ids=batch.tokens, completion_mask=batch.mask.long(),
              rollout_logp=batch.rollout_logp, dense_logp=dense.rollout_logp,
              advantages=torch.zeros(4), policy=policy, budget=4, sampling={},
              clip_low=0.2, clip_high=0.2, aggregation="token-mean")
    k3 = [step(model, **kw)["distill/kl_k3_mean"] for _ in range(30)]
    assert k3[0] > 0 and k3[-1] < 0.5 * k3[0], k3
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert all(p.grad is None for p in base)
