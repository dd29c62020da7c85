import pytest
import torch

from sparsecorr.pruning import QualityHead, QualityHeadTrainer, binary_auc, fit_temperature


def _planted(n, dim, gen, w):
    x = torch.randn(n, dim, generator=gen)
    y = (torch.rand(n, generator=gen) < torch.sigmoid(4.0 * x @ w)).float()
    return x, y


def test_head_learns_planted_signal():
    gen = torch.Generator().manual_seed(0)
    dim = 32
    w = torch.randn(dim, generator=gen)
    w = w / w.norm()
    torch.manual_seed(0)
    trainer = QualityHeadTrainer(QualityHead(dim, hidden_sizes=(64,)), lr=3e-3, min_updates=5)
    for _ in range(30):
        x, y = _planted(64, dim, gen, w)
        metrics = trainer.update(x[:, None, :], y)
    x, y = _planted(2000, dim, gen, w)
    auc = float(binary_auc(trainer.predict(x), y))
    # Bayes AUC of this problem is ~0.89-0.92; the noise-free ranking target:
    auc_true = float(binary_auc(x @ w, (x @ w > 0).float()))
    assert auc_true == 1.0
    assert float(binary_auc(trainer.predict(x), (x @ w > 0).float())) > 0.9
    assert auc > 0.8
    assert trainer.ready and float(metrics["quality_head/ready"]) == 1.0


def test_cold_start_until_min_updates_and_auc():
    gen = torch.Generator().manual_seed(1)
    trainer = QualityHeadTrainer(QualityHead(8), min_updates=3, min_auc=0.6)
    assert not trainer.ready
    x = torch.randn(32, 8, generator=gen)
    noise = (torch.rand(32, generator=gen) < 0.5).float()  # labels independent of x
    for _ in range(3):
        trainer.update(x, noise)
    assert trainer.n_updates == 3
    assert not trainer.ready or trainer.recent_auc >= 0.6


def test_binary_auc_matches_pairwise_definition():
    gen = torch.Generator().manual_seed(2)
    s = (torch.rand(50, generator=gen) * 5).round()  # many ties
    y = torch.rand(50, generator=gen) < 0.4
    pos, neg = s[y], s[~y]
    pairwise = ((pos[:, None] > neg[None]).float() + 0.5 * (pos[:, None] == neg[None]).float())
    assert abs(float(binary_auc(s, y)) - float(pairwise.mean())) < 1e-6
    assert torch.isnan(binary_auc(s, torch.ones(50, dtype=torch.bool)))


def test_fit_temperature_recovers_known_temperature():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(20_000, generator=gen) * 4
    y = (torch.rand(20_000, generator=gen) < torch.sigmoid(z / 2.0)).float()
    assert abs(fit_temperature(z, y) - 2.0) < 0.15


def test_save_load_roundtrip(tmp_path):
    torch.manual_seed(0)
    head = QualityHead(16, hidden_sizes=(8, 4), pooling="mean")
    path = head.save(tmp_path / "head.safetensors", extra={"temperature": 1.5})
    loaded, extra = QualityHead.load(path)
    x = torch.randn(3, 5, 16)
    assert torch.equal(head(x), loaded(x))
    assert extra == {"temperature": 1.5} and loaded.pooling == "mean"


def test_load_rejects_other_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="config"):
        QualityHead.load(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="path"):
        QualityHead.load(tmp_path / "missing.safetensors")


def test_bad_inputs():
    head = QualityHead(8)
    with pytest.raises(ValueError, match="hidden: expected last dim 8"):
        head(torch.zeros(2, 3, 7))
    with pytest.raises(ValueError, match="pooling"):
        QualityHead(8, pooling="max")
    trainer = QualityHeadTrainer(head)
    with pytest.raises(ValueError, match="rewards"):
        trainer.update(torch.zeros(4, 8), torch.zeros(3))


def test_one_nan_hidden_state_does_not_poison_the_head_or_generate():
    """Issue #14: one NaN hidden state made the weights NaN forever, and generate(pruner=...)
    then crashed. Now the row is dropped and counted; the head keeps learning."""
    from sparsecorr.decoding import Dense, generate
    from sparsecorr.pruning import Pruner
    from tests.models import tiny_model

    gen = torch.Generator().manual_seed(4)
    dim = 64
    w = torch.randn(dim, generator=gen)
    torch.manual_seed(0)
    trainer = QualityHeadTrainer(QualityHead(dim, hidden_sizes=(16,)), lr=3e-3, min_updates=2, min_auc=0.0)
    for step in range(6):
        x = torch.randn(32, dim, generator=gen)
        y = (x @ w > 0).float()
        if step == 1:
            x[3, 5] = float("nan")  # a poisoned hidden state
            x[4, 0] = float("inf")
            y[7] = float("nan")  # and a poisoned reward
        metrics = trainer.update(x, y)
        if step == 1:
            assert float(metrics["quality_head/dropped"]) == 3
        assert all(bool(torch.isfinite(p).all()) for p in trainer.head.parameters())
    assert trainer.n_dropped == 3 and trainer.n_updates == 6 and trainer.ready
    x = torch.randn(500, dim, generator=gen)
    assert float(binary_auc(trainer.predict(x), (x @ w > 0).float())) > 0.75  # still learning
    # the trained head still prunes inside generate, even when a row's hidden state is NaN
    model = tiny_model("qwen3", hidden_size=dim)
    ids = torch.randint(3, 128, (2, 4), generator=gen).repeat_interleave(4, 0)
    pruner = Pruner(trainer, detect_len=3, keep_ratio=0.5)
    out = generate(model, ids, policy=Dense(), budget=None, max_new_tokens=6, pruner=pruner,
                   group_size=4, generator=torch.Generator().manual_seed(0))
    assert int(out.pruned.sum()) == 4
    keep = pruner.decide(torch.full((4, 1, dim), float("nan")), group_size=4)
    assert int(keep.sum()) == 2 and pruner.history[-1]["nonfinite"] == 4


def test_load_reports_truncated_and_tampered_files(tmp_path):
    import json

    from safetensors.torch import save_file

    head = QualityHead(8, hidden_sizes=(4,))
    path = head.save(tmp_path / "head.safetensors")
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"path: .*cut\.safetensors is not a readable safetensors file"):
        QualityHead.load(tmp_path / "cut.safetensors")
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    for config, match in (({"in_dim": 8, "hidden_sizes": [4], "pooling": "last"}, r"config\.dropout: missing"),
                          ({"in_dim": "8", "hidden_sizes": [4], "pooling": "last", "dropout": 0.0},
                           r"config\.in_dim: expected an int"),
                          ({"in_dim": 8, "hidden_sizes": [5], "pooling": "last", "dropout": 0.0},
                           "weights do not match the config")):
        save_file(state, str(tmp_path / "bad.safetensors"), metadata={"config": json.dumps(config)})
        with pytest.raises(ValueError, match=match):
            QualityHead.load(tmp_path / "bad.safetensors")
    state["net.1.weight"][0, 0] = float("nan")
    save_file(state, str(tmp_path / "nan.safetensors"), metadata={"config": json.dumps(head.config)})
    with pytest.raises(ValueError, match="non-finite weights"):
        QualityHead.load(tmp_path / "nan.safetensors")
