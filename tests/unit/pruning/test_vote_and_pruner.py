import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsecorr.pruning import (
    Pruner,
    QualityHead,
    QualityHeadTrainer,
    majority_vote,
    weighted_vote,
)


@given(st.lists(st.sampled_from(["a", "b", "c", None]), min_size=0, max_size=12))
def test_weighted_vote_with_equal_weights_is_majority(answers):
    assert weighted_vote(answers, [0.7] * len(answers)) == majority_vote(answers)


def test_votes_hand_worked_and_ties():
    assert majority_vote(["x", "y", "y", "x", "z"]) == "x"  # tie x/y: first occurrence
    assert weighted_vote(["x", "y", "y"], [0.9, 0.3, 0.3]) == "x"
    assert weighted_vote([None, None], [1, 1]) is None
    assert weighted_vote(["x", "y"], torch.tensor([0.1, 0.2])) == "y"


def test_vote_errors():
    with pytest.raises(ValueError, match="weights"):
        weighted_vote(["a"], [1.0, 2.0])
    with pytest.raises(ValueError, match="weights"):
        weighted_vote(["a"], [float("nan")])


def test_pruner_keeps_all_during_cold_start_then_prunes():
    torch.manual_seed(0)
    trainer = QualityHeadTrainer(QualityHead(8), min_updates=2, min_auc=0.0)
    pruner = Pruner(trainer, detect_len=4, keep_ratio=0.5)
    hidden = torch.randn(8, 1, 8)
    assert pruner.decide(hidden, group_size=4).all()
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(16, 8, generator=gen)
        trainer.update(x, (x[:, 0] > 0).float())
    keep = pruner.decide(hidden, group_size=4)
    assert keep.reshape(2, 4).sum(1).tolist() == [2, 2]
    assert pruner.last_p_success.shape == (8,)
    assert [h["active"] for h in pruner.history] == [False, True]


def test_pruner_validation():
    with pytest.raises(ValueError, match="head"):
        Pruner(object())
    with pytest.raises(ValueError, match="detect_len"):
        Pruner(QualityHead(4), detect_len=0)
    with pytest.raises(ValueError, match="group_size"):
        Pruner(QualityHead(4)).decide(torch.zeros(2, 1, 4), group_size=None)
