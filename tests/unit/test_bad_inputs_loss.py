"""The bad-input table for the loss path (issue #14): the mismatch record and its metrics, every
correction, the losses. Same harness as ``test_bad_inputs.py`` (``tests/bad_inputs.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from sparsecorr import correction as C
from sparsecorr import losses as L
from sparsecorr import mismatch as M
from tests.bad_inputs import CLASSES, Row, check_row, missing_rows, refused, result

NAN, INF = float("nan"), float("inf")

#: public names that must have at least one row, by module
COVERED: dict[str, set[str]] = {
    "sparsecorr.mismatch": {"measure", "mismatch_metrics", "log_ratio", "kl_k1", "kl_k2", "kl_k3",
                            "chi2", "sequence_log_ratio", "effective_sample_size"},
    "sparsecorr.correction": (set(C.PRESETS) | {"Correction", "chain", "get_preset",
                                                "batch_normalized", "token_is_weights",
                                                "sequence_is_weights", "batch_normalize", "band_mask",
                                                "veto_mask", "divergence_mask", "tail_mask", "opsm_mask"}),
    "sparsecorr.losses": {"sparse_grpo", "Aggregation", "KLPenalty", "PPOClip", "GSPO", "CISPO", "SAPO",
                          "group_advantages", "distill_sparse_loss", "aggregate", "aggregation_coefficients",
                          "kl_from_logits", "topk_kl", "sparse_kl_k3"},
}


def _lp(b=3, t=5, seed=0):
    return -torch.rand(b, t, generator=torch.Generator().manual_seed(seed)) * 3


def _mask(b=3, t=5, fill=True):
    return torch.full((b, t), fill, dtype=torch.bool)


def _poke(x, value, index=(0, 1)):
    x = x.clone()
    x[index] = value
    return x


def _mm(**kw):
    return M.measure(_lp(), _lp(seed=1), _mask(), **kw)


def _finite(out) -> bool:
    return bool(torch.isfinite(out.loss)) and all(bool(v.isfinite()) or "_q" in k or k.endswith(("min", "max"))
                                                   for k, v in out.metrics.items())


def _record_rows() -> list[Row]:
    old, roll, m = _lp(), _lp(seed=1), _mask()
    rows = [
        refused("measure", "shape", lambda: M.measure(old, roll[:, :2], m), "rollout_logp"),
        refused("measure", "shape", lambda: M.measure(old[0], roll[0], m[0]), "old_logp"),
        refused("measure", "dtype", lambda: M.measure(old, roll, m.float()), "mask"),
        refused("measure", "dtype", lambda: M.measure(old.long(), roll, m), "old_logp"),
        refused("measure", "shape", lambda: M.measure(old, roll, m, advantages=torch.zeros(7)), "advantages"),
        refused("measure", "shape", lambda: M.measure(old, roll, m, acceptance=torch.zeros(3, 2)), "acceptance"),
        result("measure", "nan", lambda: M.measure(_poke(old, NAN), roll, m),
               lambda r: int(r.nonfinite) == 1 and not r.valid[0, 1] and r.log_ratio[0, 1] == 0, "counted"),
        result("measure", "inf", lambda: M.measure(old, _poke(roll, -INF), m),
               lambda r: int(r.nonfinite) == 1 and bool(torch.isfinite(r.log_ratio).all()), "counted"),
        result("measure", "empty", lambda: M.measure(old[:0], roll[:0], m[:0]),
               lambda r: r.log_ratio.shape == (0, 5) and int(r.tokens) == 0, "B=0"),
        result("measure", "all_masked", lambda: M.measure(old, roll, _mask(fill=False)),
               lambda r: int(r.tokens) == 0 and int(r.nonfinite) == 0, "no tokens"),
        refused("mismatch_metrics", "range", lambda: M.mismatch_metrics(old, roll, m, level="most"), "level"),
        refused("mismatch_metrics", "shape", lambda: M.mismatch_metrics(old, roll), "rollout_logp, mask"),
        refused("mismatch_metrics", "range", lambda: M.mismatch_metrics(old, roll, m, quantiles=[1.5]), "q"),
        refused("mismatch_metrics", "shape", lambda: M.mismatch_metrics(_mm(), roll, m), "rollout_logp"),
        result("mismatch_metrics", "nan", lambda: M.mismatch_metrics(_poke(old, NAN), roll, m),
               lambda r: r["mismatch/nonfinite_count"] == 1 and bool(r["mismatch/kl_k3_mean"].isfinite()),
               "counted, finite means"),
        result("mismatch_metrics", "empty", lambda: M.mismatch_metrics(old[:, :0], roll[:, :0], m[:, :0]),
               lambda r: r["mismatch/tokens"] == 0 and r["mismatch/kl_k3_mean"] == 0, "T=0"),
        result("mismatch_metrics", "all_masked", lambda: M.mismatch_metrics(old, roll, _mask(fill=False)),
               lambda r: r["mismatch/tokens"] == 0 and r["mismatch/ratio_min"].isnan(), "NaN extremes"),
    ]
    for name in ("log_ratio", "kl_k1", "kl_k2", "kl_k3", "chi2"):
        fn = getattr(M, name)
        rows += [
            refused(name, "shape", lambda fn=fn: fn(old, roll[:, :2], m), "rollout_logp"),
            refused(name, "dtype", lambda fn=fn: fn(old, roll, m.long()), "mask"),
            result(name, "nan", lambda fn=fn: fn(_poke(old, NAN), roll, m),
                   lambda r: r[0, 1] == 0 and bool(torch.isfinite(r).all()), "0 there"),
            result(name, "empty", lambda fn=fn: fn(old[:0], roll[:0], m[:0]), lambda r: r.shape == (0, 5), "B=0"),
        ]
    lr = M.log_ratio(old, roll, m)
    rows += [
        refused("sequence_log_ratio", "range", lambda: M.sequence_log_ratio(lr, m, reduce="prod"), "reduce"),
        refused("sequence_log_ratio", "shape", lambda: M.sequence_log_ratio(lr[0], m[0]), "log_ratio"),
        result("sequence_log_ratio", "all_masked", lambda: M.sequence_log_ratio(lr, _mask(fill=False), reduce="mean"),
               lambda r: r.tolist() == [0.0, 0.0, 0.0], "0 for empty rows"),
        refused("effective_sample_size", "dtype", lambda: M.effective_sample_size(lr, m.float()), "mask"),
        result("effective_sample_size", "all_masked", lambda: M.effective_sample_size(lr.exp(), _mask(fill=False)),
               lambda r: bool(r.isnan()), "NaN when no entry"),
    ]
    return rows


def _correction_rows() -> list[Row]:
    mm = _mm()
    g = torch.Generator().manual_seed(3)
    acc_mm = _mm(acceptance=torch.rand(3, 5, generator=g))
    adv_mm = _mm(advantages=torch.randn(3, generator=g))
    factory_rows = [  # (preset, numbers, the argument the error names)
        ("tis", dict(cap=NAN), "cap"), ("tis", dict(cap=-1.0), "cap"), ("tis", dict(cap=1.0, floor=2.0), "cap"),
        ("mis", dict(low=2.0, high=1.0), "low"), ("mis", dict(low=NAN), "low"), ("mis", dict(level="seq"), "level"),
        ("icepop", dict(low=-0.5), "low"), ("icepop", dict(low=INF, high=INF), "low"),
        ("geo_rs", dict(low=1.0, high=0.5), "low"),
        ("sequence_is", dict(reduce="prod"), "reduce"), ("sequence_is", dict(cap=0.0), "cap"),
        ("veto", dict(threshold=0.0), "threshold"), ("veto", dict(threshold=NAN), "threshold"),
        ("divergence", dict(threshold=-1.0), "threshold"), ("divergence", dict(threshold=0.1, estimator="k1"),
                                                            "estimator"),
        ("divergence", dict(threshold=0.1, reduce="p90"), "reduce"),
        ("opsm", dict(delta=NAN), "delta"), ("opsm", dict(delta=-0.1), "delta"),
        ("sparse_rl", dict(cap=0.0), "cap"), ("sparse_rl", dict(low=1.5, high=0.5), "low"),
        ("sparse_rl", dict(veto_threshold=INF), "veto_threshold"),
        ("sparrow", dict(cap=NAN), "cap"),
        ("sparse_tail", dict(q=1.5), "q"), ("sparse_tail", dict(tau=-0.1), "tau"), ("sparse_tail", dict(tau=NAN), "tau"),
        ("trl", dict(mode="token"), "mode"), ("trl", dict(clip_max=-1.0), "clip_max"),
        ("trl", dict(clip_max=NAN), "clip_max"), ("trl", dict(mode="token_truncate", clip_min=5.0, clip_max=1.0),
                                                  "clip_min"),
        ("openrlhf", dict(threshold=(5.0, 0.5)), r"threshold\[0\]"),
        ("openrlhf", dict(gating="tv", threshold=(0.5, 1.0)), r"threshold\[0\]"),
        ("openrlhf", dict(threshold=(0.5,)), "threshold"), ("openrlhf", dict(level="sentence"), "level"),
    ]
    rows = [refused(name, "range", lambda name=name, kw=kw: C.PRESETS[name](**kw), arg,
                    note=",".join(f"{k}={v}" for k, v in kw.items())) for name, kw, arg in factory_rows]
    for name in C.PRESETS:
        factory = C.PRESETS[name]
        if name in ("geo_rs", "divergence", "opsm"):
            make = {"geo_rs": lambda: C.geo_rs(0.5, 2.0), "divergence": lambda: C.divergence(0.5),
                    "opsm": lambda: C.opsm(0.1)}[name]
        else:
            make = factory
        record = acc_mm if name == "sparse_tail" else (adv_mm if name == "opsm" else mm)
        rows.append(result(name, "empty", lambda make=make, record=record: make()(_empty_like(record)),
                           lambda c: c.mask.shape == (0, 5) and float(c.metrics["correction/kept_token_frac"]) == 0,
                           "B=0"))
        rows.append(result(name, "nan", lambda make=make, record=record: make()(_nan_record(record)),
                           lambda c: not c.mask[0, 1] and int(c.metrics["correction/nonfinite_count"]) == 1,
                           "dropped, counted"))
    rows += [
        refused("sparse_tail", "shape", lambda: C.sparse_tail()(mm), "acceptance", "record without acceptance"),
        refused("opsm", "shape", lambda: C.opsm(0.1)(mm), "advantages", "record without advantages"),
        refused("Correction", "dtype", lambda: C.Correction(mask=torch.ones(2, 2)), "mask"),
        refused("Correction", "shape", lambda: C.Correction(mask=_mask(), token_weights=torch.ones(3, 4)),
                "token_weights"),
        refused("Correction", "shape", lambda: C.Correction(mask=_mask(), scale=torch.ones(2)), "scale"),
        refused("Correction", "shape", lambda: C.Correction(mask=_mask()).reweight(torch.ones(2)), "factor"),
        refused("chain", "range", lambda: C.chain(), "corrections"),
        refused("chain", "dtype", lambda: C.chain(C.tis(), 3.0), r"corrections\[1\]"),
        refused("chain", "dtype", lambda: C.chain(lambda mm: mm.mask)(mm), "corrections"),
        refused("get_preset", "range", lambda: C.get_preset("trl:token_mask"), "name"),
        refused("get_preset", "range", lambda: C.get_preset("veto", cap=2.0), "numbers"),
        refused("get_preset", "range", lambda: C.get_preset("none", cap=2.0), "numbers"),
        refused("batch_normalized", "dtype", lambda: C.batch_normalized(3.0), "inner"),
        result("batch_normalized", "all_masked", lambda: C.batch_normalized(C.tis())(
            M.measure(_lp(), _lp(seed=1), _mask(fill=False))),
            lambda c: float(c.metrics["correction/weight_mean"]) == 0 and not c.mask.any(), "nothing kept"),
    ]
    lr, m = M.log_ratio(_lp(), _lp(seed=1), _mask()), _mask()
    rows += [
        refused("token_is_weights", "range", lambda: C.token_is_weights(lr, m, cap=0.5, floor=1.0), "cap"),
        refused("token_is_weights", "dtype", lambda: C.token_is_weights(lr, m.float()), "mask"),
        refused("sequence_is_weights", "range", lambda: C.sequence_is_weights(lr, m, reduce="max"), "reduce"),
        refused("batch_normalize", "shape", lambda: C.batch_normalize(lr, m[:, :2]), "mask"),
        result("batch_normalize", "all_masked", lambda: C.batch_normalize(lr.exp(), _mask(fill=False)),
               lambda r: bool((r == 0).all()), "zeros"),
        refused("band_mask", "range", lambda: C.band_mask(lr, m, low=2.0, high=1.0), "low"),
        refused("band_mask", "range", lambda: C.band_mask(lr, m, low=0.5, high=2.0, level="row"), "level"),
        refused("veto_mask", "range", lambda: C.veto_mask(lr, m, threshold=0.0), "threshold"),
        refused("divergence_mask", "range", lambda: C.divergence_mask(lr, lr, m, threshold=-1.0), "threshold"),
        refused("tail_mask", "range", lambda: C.tail_mask(lr.exp(), m, tau=2.0), "tau"),
        refused("opsm_mask", "shape", lambda: C.opsm_mask(lr, m, torch.zeros(4), delta=0.1), "advantages"),
    ]
    return rows


def _empty_like(mm):
    acc = None if mm.acceptance is None else mm.acceptance[:0]
    adv = None if mm.advantages is None else mm.advantages[:0]
    return M.measure(mm.old_logp[:0], mm.rollout_logp[:0], mm.mask[:0], acceptance=acc, advantages=adv)


def _nan_record(mm):
    return M.measure(_poke(mm.old_logp, NAN), mm.rollout_logp, mm.mask, acceptance=mm.acceptance,
                     advantages=mm.advantages)


def _loss_rows() -> list[Row]:
    lp, old, roll, ref, m = _lp(), _lp(seed=1), _lp(seed=2), _lp(seed=3), _mask()
    adv = torch.tensor([1.0, -1.0, 0.5])

    def grpo(**kw):
        args = dict(logp=lp, old_logp=old, advantages=adv, mask=m)
        args.update({k: kw.pop(k) for k in list(kw) if k in args})
        return L.sparse_grpo(**args, **kw)

    rows = [
        refused("sparse_grpo", "shape", lambda: grpo(old_logp=old[:, :2]), "old_logp"),
        refused("sparse_grpo", "shape", lambda: grpo(advantages=torch.zeros(4)), "advantages"),
        refused("sparse_grpo", "dtype", lambda: grpo(mask=m.float()), "mask"),
        refused("sparse_grpo", "dtype", lambda: grpo(logp=lp.long()), "logp"),
        refused("sparse_grpo", "shape", lambda: grpo(mismatch=M.measure(old[:2], roll[:2], m[:2])), "mismatch"),
        refused("sparse_grpo", "range", lambda: grpo(correction=C.tis()), "rollout_logp"),
        refused("sparse_grpo", "range", lambda: grpo(rollout_logp=roll, mismatch=_mm()), "mismatch, rollout_logp"),
        refused("sparse_grpo", "dtype", lambda: grpo(rollout_logp=roll, correction=3.0), "correction"),
        refused("sparse_grpo", "range", lambda: grpo(surrogate="ppo2"), "surrogate"),
        refused("sparse_grpo", "range", lambda: grpo(aggregation="mean"), "aggregation"),
        refused("sparse_grpo", "range", lambda: grpo(kl=0.1), "ref_logp"),
        refused("sparse_grpo", "range", lambda: grpo(kl=NAN, ref_logp=ref), "kl"),
        refused("sparse_grpo", "range", lambda: grpo(metrics="all"), "metrics"),
        result("sparse_grpo", "nan", lambda: grpo(logp=_poke(lp, NAN), ref_logp=_poke(ref, INF, (1, 1)), kl=0.1,
                                                  rollout_logp=_poke(roll, NAN, (2, 2)), correction=C.sparse_rl(),
                                                  advantages=torch.tensor([1.0, -1.0, NAN])),
               _finite, "masked and counted"),
        result("sparse_grpo", "inf", lambda: grpo(old_logp=_poke(old, -INF)),
               lambda o: _finite(o) and o.metrics["loss/nonfinite_tokens"] == 1, "masked and counted"),
        result("sparse_grpo", "empty", lambda: grpo(logp=lp[:0], old_logp=old[:0], advantages=adv[:0], mask=m[:0]),
               lambda o: float(o.loss) == 0 and o.metrics["loss/tokens"] == 0, "zero loss"),
        result("sparse_grpo", "all_masked", lambda: grpo(mask=_mask(fill=False), rollout_logp=roll,
                                                         correction=C.sparse_rl()),
               lambda o: float(o.loss) == 0 and _finite(o), "zero loss, finite metrics"),
        refused("Aggregation", "range", lambda: L.Aggregation("token-mean", num_tokens=NAN), "num_tokens"),
        refused("Aggregation", "range", lambda: L.Aggregation("seq-mean-token-mean", num_sequences=-2), "num_sequences"),
        refused("Aggregation", "shape", lambda: L.Aggregation("token-mean", num_tokens=torch.ones(2)), "num_tokens"),
        refused("Aggregation", "range", lambda: L.Aggregation("seq-mean-token-sum-norm", norm_length=INF), "norm_length"),
        refused("Aggregation", "range", lambda: L.Aggregation("sum"), "aggregation"),
        refused("KLPenalty", "range", lambda: L.KLPenalty(-0.1), "kl"),
        refused("KLPenalty", "range", lambda: L.KLPenalty(INF), "kl"),
        refused("PPOClip", "range", lambda: L.PPOClip(clip_low=1.0), "clip_low"),
        refused("PPOClip", "range", lambda: L.PPOClip(clip_high=NAN), "clip_high"),
        refused("PPOClip", "range", lambda: L.PPOClip(dual_clip=1.0), "dual_clip"),
        refused("GSPO", "range", lambda: L.GSPO(clip_low=-1e-4), "clip_low"),
        refused("GSPO", "range", lambda: L.GSPO(dual_clip=INF), "dual_clip"),
        refused("CISPO", "range", lambda: L.CISPO(cap=0.0), "cap"),
        refused("SAPO", "range", lambda: L.SAPO(temperature_neg=NAN), "temperature_neg"),
        refused("group_advantages", "range", lambda: L.group_advantages(torch.ones(6), group_size=4), "group_size"),
        refused("group_advantages", "dtype", lambda: L.group_advantages(torch.ones(4, dtype=torch.long), group_size=2),
                "rewards"),
        refused("group_advantages", "range", lambda: L.group_advantages(torch.ones(4), group_size=2, normalize="z"),
                "normalize"),
        result("group_advantages", "nan", lambda: L.group_advantages(torch.tensor([1.0, NAN, 0.0, 1.0]), group_size=4),
               lambda a: bool(a[1].isnan()) and bool(torch.isfinite(a[[0, 2, 3]]).all()), "only that row NaN"),
        result("group_advantages", "empty", lambda: L.group_advantages(torch.zeros(0), group_size=4),
               lambda a: a.shape == (0,), "B=0"),
        result("group_advantages", "all_masked", lambda: L.group_advantages(
            torch.ones(4), group_size=2, valid=torch.zeros(4, dtype=torch.bool)), lambda a: bool((a == 0).all()),
            "all invalid: zeros"),
        refused("distill_sparse_loss", "range", lambda: L.distill_sparse_loss(lp, roll, old, adv, m, kl_weight=-1.0),
                "kl_weight"),
        refused("distill_sparse_loss", "shape", lambda: L.distill_sparse_loss(lp, roll[:, :2], old, adv, m),
                "rollout_logp"),
        result("distill_sparse_loss", "nan", lambda: L.distill_sparse_loss(lp, _poke(roll, NAN), old, adv, m),
               lambda o: bool(torch.isfinite(o.loss)) and o.metrics["distill/nonfinite"] == 1, "dropped, counted"),
        result("distill_sparse_loss", "empty", lambda: L.distill_sparse_loss(lp[:0], roll[:0], old[:0], adv[:0], m[:0]),
               lambda o: float(o.loss) == 0, "zero loss"),
        refused("aggregate", "dtype", lambda: L.aggregate(lp, m.float()), "mask"),
        refused("aggregate", "range", lambda: L.aggregate(lp, m, num_tokens=NAN), "num_tokens"),
        result("aggregate", "nan", lambda: L.aggregate(_poke(lp, NAN), _poke(m, False)),
               lambda r: bool(torch.isfinite(r)), "masked NaN ignored"),
        refused("aggregation_coefficients", "range", lambda: L.aggregation_coefficients(m, mode="x"), "aggregation"),
        refused("aggregation_coefficients", "range",
                lambda: L.aggregation_coefficients(m, mode="seq-mean-token-sum-norm", norm_length=0), "norm_length"),
    ]
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(4))
    rows += [
        refused("kl_from_logits", "shape", lambda: L.kl_from_logits(logits, logits[:, :2], _mask(2, 3)), r"\w+"),
        refused("kl_from_logits", "dtype", lambda: L.kl_from_logits(logits, logits, _mask(2, 3).float()), "mask"),
        refused("topk_kl", "range", lambda: L.topk_kl(logits, logits, _mask(2, 3), direction="both"), "direction"),
        result("sparse_kl_k3", "nan", lambda: L.sparse_kl_k3(_poke(lp, NAN), old, m),
               lambda r: r[0, 1] == 0 and bool(torch.isfinite(r).all()), "0 there"),
        refused("sparse_kl_k3", "shape", lambda: L.sparse_kl_k3(lp, old[:, :2], m), r"\w+"),
    ]
    return rows


ALL_ROWS = _record_rows() + _correction_rows() + _loss_rows()


@pytest.mark.parametrize("row", ALL_ROWS, ids=[r.id for r in ALL_ROWS])
def test_bad_input(row: Row) -> None:
    check_row(row)


def test_every_covered_public_name_has_rows() -> None:
    assert not missing_rows(ALL_ROWS, COVERED)


def test_rows_span_the_bad_input_classes() -> None:
    assert {r.kind for r in ALL_ROWS} >= set(CLASSES) - {"file"}
    assert math.isfinite(len(ALL_ROWS))
