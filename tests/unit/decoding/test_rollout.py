"""RolloutBatch files: one atomic safetensors file, every field checked on load (issue #14)."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save as st_save

from sparsecorr.decoding import RKV, RolloutBatch, generate
from sparsecorr.decoding.rollout import FORMAT
from tests.models import tiny_model


@pytest.fixture(scope="module")
def batch():
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(7))
    return generate(model, ids, policy=RKV(window=4, buffer=4), budget=8, max_new_tokens=6, eos_token_id=2,
                    generator=torch.Generator().manual_seed(0), logprobs_topk=4)


def _tensors(b):
    return {k: getattr(b, k).contiguous() for k in ("tokens", "mask", "lengths", "prompt_lengths", "rollout_logp",
                                                   "topk_logp", "topk_ids", "budget", "kv_kept", "pruned",
                                                   "pruned_at")}


def _write(path, tensors, meta):
    path.write_bytes(st_save(tensors, metadata=meta))


def _meta(b, **over):
    m = {"format": FORMAT, "dims": json.dumps({"B": 3, "T": 6, "k": 4}), "finish_reason": json.dumps(list(b.finish_reason)),
         "peak_kv_bytes": str(b.peak_kv_bytes), "meta": json.dumps(b.meta)}
    m.update(over)
    return m


def test_roundtrip_is_one_file(batch, tmp_path):
    path = batch.save(tmp_path / "b.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.safetensors"]
    back = RolloutBatch.load(path)
    for name in _tensors(batch):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert back.finish_reason == batch.finish_reason and back.meta == batch.meta
    assert back.peak_kv_bytes == batch.peak_kv_bytes


def test_a_crash_while_saving_leaves_the_previous_batch(batch, tmp_path, monkeypatch):
    path = batch.save(tmp_path / "b.safetensors")
    other = RolloutBatch(**{**_tensors(batch), "tokens": batch.tokens + 1}, finish_reason=batch.finish_reason,
                         peak_kv_bytes=1, meta={"x": 1})

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        other.save(path)
    monkeypatch.undo()
    back = RolloutBatch.load(path)  # the old batch, whole: tensors and metadata agree
    assert torch.equal(back.tokens, batch.tokens) and back.meta == batch.meta
    assert [p.name for p in tmp_path.iterdir()] == ["b.safetensors"]  # no temporary left behind


def _tampered(b):
    t = _tensors(b)
    return [
        ("shape", {**t, "tokens": t["tokens"].T.contiguous()}, _meta(b), "tokens"),
        ("shape", {**t, "rollout_logp": t["rollout_logp"][:, :-1].contiguous()}, _meta(b), "rollout_logp"),
        ("dtype", {**t, "rollout_logp": t["rollout_logp"].double()}, _meta(b), "dtype"),
        ("dtype", {**t, "mask": t["mask"].long()}, _meta(b), "mask"),
        ("missing", {k: v for k, v in t.items() if k != "budget"}, _meta(b), "budget"),
        ("extra", {**t, "x": torch.zeros(1)}, _meta(b), "unexpected"),
        ("mask", {**t, "mask": ~t["mask"]}, _meta(b), "mask does not match"),
        ("lengths", {**t, "lengths": t["lengths"] + 100}, _meta(b), "lengths"),
        ("format", t, _meta(b, format="other/1"), "format"),
        ("reasons", t, _meta(b, finish_reason=json.dumps(["eos"])), "finish reasons"),
        ("reasons", t, _meta(b, finish_reason=json.dumps(["done"] * 3)), "finish_reason"),
        ("peak", t, _meta(b, peak_kv_bytes="-5"), "peak_kv_bytes"),
        ("meta", t, _meta(b, meta="[1, 2]"), "meta"),
        ("json", t, _meta(b, meta="{not json"), "unreadable"),
        ("dims", t, _meta(b, dims=json.dumps({"B": 6, "T": 3, "k": 4})), "tokens"),
        ("dims", t, _meta(b, dims="[3]"), "dims"),
    ]


@pytest.mark.parametrize("case", range(16))
def test_tampered_files_are_refused_with_the_path(batch, tmp_path, case):
    what, tensors, meta, needle = _tampered(batch)[case]
    path = tmp_path / f"{what}.safetensors"
    _write(path, tensors, meta)
    with pytest.raises(ValueError, match=r"^path: ") as err:
        RolloutBatch.load(path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_truncated_and_foreign_files(batch, tmp_path):
    path = batch.save(tmp_path / "b.safetensors")
    data = path.read_bytes()
    for cut in (4, 100, len(data) - 7):
        (tmp_path / "t.safetensors").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="not a complete safetensors file") as err:
            RolloutBatch.load(tmp_path / "t.safetensors")
        assert str(tmp_path / "t.safetensors") in str(err.value)
    (tmp_path / "j.safetensors").write_text('{"a": 1}')
    with pytest.raises(ValueError, match=r"^path: "):
        RolloutBatch.load(tmp_path / "j.safetensors")
    with pytest.raises(ValueError, match="no such file"):
        RolloutBatch.load(tmp_path / "missing.safetensors")
    header_len = struct.unpack("<Q", data[:8])[0]
    assert FORMAT in data[8:8 + header_len].decode()


def test_legacy_two_file_format_is_read_and_checked(batch, tmp_path):
    path = tmp_path / "old.safetensors"
    path.write_bytes(st_save(_tensors(batch)))
    side = tmp_path / "old.safetensors.json"
    side.write_text(json.dumps({"finish_reason": list(batch.finish_reason), "peak_kv_bytes": batch.peak_kv_bytes,
                                "meta": batch.meta, "format": "sparsecorr.RolloutBatch/1"}))
    assert torch.equal(RolloutBatch.load(path).tokens, batch.tokens)
    side.write_text(json.dumps({"finish_reason": ["eos"], "peak_kv_bytes": 0, "meta": {},
                                "format": "sparsecorr.RolloutBatch/1"}))  # a sidecar from another batch
    with pytest.raises(ValueError, match="finish reasons"):
        RolloutBatch.load(path)
    side.write_text(json.dumps({"finish_reason": list(batch.finish_reason), "format": "something/3"}))
    with pytest.raises(ValueError, match="sidecar"):
        RolloutBatch.load(path)
