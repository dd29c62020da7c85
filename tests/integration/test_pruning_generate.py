"""ARRoL pruning inside sparsecorr.decoding.generate, on a tiny model (CPU, seeded)."""

import pytest
import torch

from sparsecorr.correction import sparse_rl
from sparsecorr.decoding import RKV, Dense, generate, teacher_forced_logprobs
from sparsecorr.losses import group_advantages, sparse_grpo
from sparsecorr.mismatch import token_logprobs
from sparsecorr.pruning import Pruner, QualityHead, QualityHeadTrainer, binary_auc
from tests.models import tiny_model


def test_pruned_rows_stop_at_detect_len_and_leave_the_loss():
    model = tiny_model("qwen3")
    g = 4
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0)).repeat_interleave(g, 0)
    torch.manual_seed(0)
    pruner = Pruner(QualityHead(model.config.hidden_size, hidden_sizes=(8,)), detect_len=6,
                    keep_ratio=0.5, window=2)
    out = generate(model, ids, policy=RKV(window=4, buffer=4), budget=8, max_new_tokens=20,
                   generator=torch.Generator().manual_seed(1), pruner=pruner, group_size=g)
    assert out.pruned.reshape(2, g).sum(1).tolist() == [2, 2]
    assert (out.pruned_at[out.pruned] == 6).all() and (out.pruned_at[~out.pruned] == -1).all()
    assert (out.lengths[out.pruned] == 6).all() and (out.lengths[~out.pruned] == 20).all()
    assert not out.mask[out.pruned].any()  # excluded from the loss by default
    assert [out.finish_reason[i] for i in range(8) if out.pruned[i]] == ["pruned"] * 4
    # survivors were decoded by the same path: teacher forcing reproduces them
    tf = teacher_forced_logprobs(model, ids, out.tokens, policy=RKV(window=4, buffer=4), budget=8)
    keep = out.mask
    torch.testing.assert_close(tf.rollout_logp[keep], out.rollout_logp[keep], atol=1e-6, rtol=0)
    # a pruned, sparse, corrected batch flows into sparse_grpo
    rewards = torch.rand(8).round()
    adv = group_advantages(rewards, group_size=g, valid=~out.pruned)
    assert (adv[out.pruned] == 0).all()
    full = torch.cat([ids, out.tokens], 1)
    logits = model(full).logits[:, ids.shape[1] - 1:-1]
    logp = token_logprobs(logits, out.tokens)
    loss = sparse_grpo(logp, logp.detach(), adv, out.mask, rollout_logp=out.rollout_logp,
                       correction=sparse_rl())
    loss.loss.backward()
    assert torch.isfinite(loss.loss)


def test_pruning_saves_generated_tokens():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (4, 4), generator=torch.Generator().manual_seed(2)).repeat_interleave(4, 0)
    pruner = Pruner(QualityHead(model.config.hidden_size), detect_len=4, keep_ratio=0.5)
    pruned = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=32, pruner=pruner,
                      group_size=4, generator=torch.Generator().manual_seed(0))
    full = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=32,
                    generator=torch.Generator().manual_seed(0))
    ratio = full.lengths.sum() / pruned.lengths.sum()
    assert ratio >= 1.5  # keep 0.5, detect at 1/8 of the length: 32 / (16 + 2) = 1.78


@pytest.mark.slow  # ~10-16 s; tests/unit/pruning/test_head.py trains the head in the default suite
def test_head_beats_chance_on_real_hidden_states():
    """Rewards defined by the model's own continuation (does token 7 appear after the
    detection point?) are predictable from the detection-point hidden state."""
    model = tiny_model("qwen3", vocab_size=32, hidden_size=64)
    torch.manual_seed(0)
    feats, labels = [], []
    for step in range(12):
        ids = torch.randint(3, 32, (32, 6), generator=torch.Generator().manual_seed(step))
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1][:, -1].detach()
        nxt = torch.softmax(out.logits[:, -1], -1)
        labels.append((nxt[:, 7] > nxt[:, 7].median()).float())  # a verifiable property
        feats.append(h)
    trainer = QualityHeadTrainer(QualityHead(64, hidden_sizes=(32,)), lr=3e-3, min_updates=4, min_auc=0.55)
    for x, y in zip(feats[:10], labels[:10]):
        trainer.update(x, y)
    auc = float(binary_auc(trainer.predict(torch.cat(feats[10:])), torch.cat(labels[10:])))
    assert auc > 0.6, auc


def test_pruner_sees_the_hidden_states_of_the_detection_window():
    """decide() receives the last-layer hidden states of generated tokens
    detect_len - window ... detect_len - 1, as a full forward pass computes them."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (4, 5), generator=torch.Generator().manual_seed(3))
    seen = {}

    class Recorder:
        detect_len, layer, window = 6, -1, 3

        def decide(self, hidden, *, group_size):
            seen["hidden"] = hidden.clone()
            return torch.tensor([True, False, True, False])

    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=10, temperature=0,
                   pruner=Recorder(), group_size=2)
    with torch.no_grad():
        full = model(torch.cat([ids, out.tokens[:, :6]], 1), output_hidden_states=True)
    expected = full.hidden_states[-1][:, 5 + 3:5 + 6]  # generated tokens 3, 4, 5
    torch.testing.assert_close(seen["hidden"], expected, atol=1e-5, rtol=1e-5)
    assert out.pruned.tolist() == [False, True, False, True]
    assert out.lengths.tolist() == [10, 6, 10, 6]
