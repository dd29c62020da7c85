r"""The driver-side rollout correction: any sparsecorr correction, configured in verl's YAML.

verl 0.9.1's trainer calls ``compute_rollout_correction_and_add_to_batch(batch,
rollout_corr_config)`` on the driver once per step, with ``rollout_corr_config =
config.algorithm.rollout_correction``, whenever that config exists, the batch carries
``rollout_log_probs`` (``actor_rollout_ref.rollout.calculate_log_probs=true``) and bypass mode
is off. verl has no registry for this step, so the plugin wraps that one function
(`sparsecorr_verl.plugin.install`): when ``rollout_corr_config.sparsecorr`` is set the wrapper
runs `rollout_correction` below, otherwise verl's own function, unchanged.

The key lives under verl's own group, ``algorithm.rollout_correction.sparsecorr``: verl never
converts that group to its ``RolloutCorrectionConfig`` dataclass on the driver (it reads it
with ``.get``), so the extra key needs no fork; on the command line it is a new key
(``+algorithm.rollout_correction.sparsecorr.preset=sparse_rl``). The spec:

``preset`` + the preset's keyword arguments, *or* ``chain`` (a list of such dicts), plus

- ``acceptance``: where the per-token acceptance comes from, for sparsity-aware tail rejection:
  a batch key (a sparse rollout server's exact \(\alpha_t\)), or ``sampled`` for the one-sample
  estimate \(\min(1, \pi_\text{old}/\pi_\text{rollout})\) of the sampled token (its
  expectation under the sampler is \(\alpha_t = \sum_v \min(p, q)\)); default none;
- ``batch_normalize: true``: wrap the whole correction in `batch_normalized` (mean kept weight
  1 over the batch; the driver holds the whole batch, so no process group is needed);
- ``quantiles`` (default ``[0.01, 0.05, 0.5]``), ``bin_size`` (default 2000 positions, as
  Sparrow) and ``n_bins`` (default 16): the log-ratio (and acceptance) quantiles, overall and
  per bin of absolute position (prompt length + response position).

It writes the correction's detached weights to ``rollout_is_weights``, its rejection into
``response_mask``, and returns sparsecorr's ``mismatch/*`` and ``correction/*`` metrics
(binned quantiles ``mismatch/log_ratio_q05_bin3``, token counts ``mismatch/bin3_tokens``) as
Python floats read back from the device in **one** transfer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparsecorr.correction import CorrectionFn, batch_normalized, chain, get_preset
from sparsecorr.mismatch import (
    binned_quantile,
    measure,
    mismatch_quantiles,
    mismatch_sums,
    quantile_name,
    reduce_metrics,
)

__all__ = ["SPEC_KEY", "DriverSpec", "correction_from_spec", "driver_spec", "rollout_correction"]

SPEC_KEY = "sparsecorr"
_OPTIONS = ("acceptance", "quantiles", "bin_size", "n_bins", "batch_normalize")
# verl's own correction keys: set together with a sparsecorr spec they would correct twice
_VERL_KEYS = ("rollout_is", "rollout_rs")


@dataclass(frozen=True)
class DriverSpec:
    """A parsed ``algorithm.rollout_correction.sparsecorr`` spec."""

    correction: CorrectionFn | None
    acceptance: str | None = None
    quantiles: tuple[float, ...] = (0.01, 0.05, 0.5)
    bin_size: int = 2000
    n_bins: int = 16


def _plain(x: Any) -> Any:
    """An OmegaConf ``DictConfig``/``ListConfig`` (or any mapping / list) as plain Python."""
    if isinstance(x, Mapping) or (hasattr(x, "items") and hasattr(x, "keys")):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, str | bytes):
        return [_plain(v) for v in x]
    return x


def correction_from_spec(spec: Mapping[str, Any]) -> CorrectionFn | None:
    """``{"preset": "sparse_rl", "cap": 1.5}`` or ``{"chain": [{"preset": "tis", "cap": 1.5},
    {"preset": "veto", "threshold": 1e-4}]}`` -> the correction (options in `_OPTIONS` are
    ignored here).

    Raises:
        ValueError: neither or both of ``preset`` / ``chain``, or a bad preset / number.
    """
    spec = _plain(spec)
    if not isinstance(spec, dict):
        raise ValueError(f"sparsecorr: expected a mapping with 'preset' or 'chain', got {spec!r}")
    args = {k: v for k, v in spec.items() if k not in _OPTIONS}
    if ("preset" in args) == ("chain" in args):
        raise ValueError(f"sparsecorr: expected exactly one of 'preset' or 'chain', got keys {sorted(args)}")
    if "chain" in args:
        items = args.pop("chain")
        if args:
            raise ValueError(f"sparsecorr.chain: expected no other keys beside it, got {sorted(args)}")
        if not isinstance(items, list) or not items:
            raise ValueError(f"sparsecorr.chain: expected a non-empty list of presets, got {items!r}")
        pieces = [correction_from_spec(item) for item in items]
        if any(p is None for p in pieces):
            raise ValueError("sparsecorr.chain: expected presets, got 'none' in the chain")
        return pieces[0] if len(pieces) == 1 else chain(*pieces)
    name = args.pop("preset")
    return get_preset(str(name), **args)


def driver_spec(rollout_corr_config: Any) -> DriverSpec | None:
    """The ``sparsecorr`` spec of verl's ``rollout_corr_config``, or None when it has none.

    Raises:
        ValueError: a bad spec, or verl's own ``rollout_is`` / ``rollout_rs`` set beside it
            (that would correct twice), or ``bypass_mode`` (the loss then never sees the weights).
    """
    if rollout_corr_config is None:
        return None
    raw = rollout_corr_config.get(SPEC_KEY, None)
    if raw is None:
        return None
    spec = _plain(raw)
    clash = [k for k in _VERL_KEYS if rollout_corr_config.get(k, None) is not None]
    if clash:
        raise ValueError(f"algorithm.rollout_correction: expected {clash} to be null when "
                         f"'{SPEC_KEY}' is set (it would correct twice), got "
                         f"{ {k: rollout_corr_config.get(k) for k in clash} }")
    if rollout_corr_config.get("bypass_mode", False):
        raise ValueError("algorithm.rollout_correction.bypass_mode: expected false with "
                         f"'{SPEC_KEY}' (the correction runs in decoupled mode), got true")
    if not isinstance(spec, dict):
        raise ValueError(f"algorithm.rollout_correction.{SPEC_KEY}: expected a mapping, got {spec!r}")
    qs = tuple(float(q) for q in spec.get("quantiles", (0.01, 0.05, 0.5)))
    if any(not 0.0 <= q <= 1.0 for q in qs):
        raise ValueError(f"{SPEC_KEY}.quantiles: expected levels in [0, 1], got {list(qs)}")
    bin_size, n_bins = spec.get("bin_size", 2000), spec.get("n_bins", 16)
    for key, v in (("bin_size", bin_size), ("n_bins", n_bins)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "bin_size" else 0):
            raise ValueError(f"{SPEC_KEY}.{key}: expected an int >= {1 if key == 'bin_size' else 0}, got {v!r}")
    acc = spec.get("acceptance", None)
    if acc is not None and not isinstance(acc, str):
        raise ValueError(f"{SPEC_KEY}.acceptance: expected a batch key or 'sampled', got {acc!r}")
    correction = correction_from_spec(spec)
    normalize = spec.get("batch_normalize", False)
    if not isinstance(normalize, bool):
        raise ValueError(f"{SPEC_KEY}.batch_normalize: expected true or false, got {normalize!r}")
    if normalize:
        if correction is None:
            raise ValueError(f"{SPEC_KEY}.batch_normalize: expected a correction to normalise, got preset 'none'")
        correction = batch_normalized(correction)
    return DriverSpec(correction=correction, acceptance=acc, quantiles=qs,
                      bin_size=bin_size, n_bins=n_bins)


def _acceptance(tensors: Any, spec: DriverSpec, old: torch.Tensor, rollout: torch.Tensor):
    if spec.acceptance is None:
        return None
    if spec.acceptance == "sampled":  # min(1, p/q) of the sampled token; NaN where non-finite
        return torch.exp(torch.clamp(old.float() - rollout.float(), max=0.0))
    if spec.acceptance not in tensors.keys():
        raise ValueError(f"{SPEC_KEY}.acceptance: expected the batch to carry "
                         f"{spec.acceptance!r}, got keys {sorted(tensors.keys())}")
    return tensors[spec.acceptance].float()


def _offsets(tensors: Any, t: int) -> torch.Tensor | None:
    """Each row's prompt length (left-padded prompt + response in ``attention_mask``)."""
    if "attention_mask" not in tensors.keys() or tensors["attention_mask"].shape[-1] <= t:
        return None
    return tensors["attention_mask"][:, :-t].sum(-1).long()


def _binned(name: str, x, valid, spec: DriverSpec, offset) -> dict[str, torch.Tensor]:
    values, counts = binned_quantile(x, valid, list(spec.quantiles), bin_size=spec.bin_size,
                                     offset=offset, n_bins=spec.n_bins)
    out = {}
    for k in range(spec.n_bins):
        for j, q in enumerate(spec.quantiles):
            out[f"mismatch/{name}_{quantile_name(q)}_bin{k}"] = values[k, j]
        if name == "log_ratio":
            out[f"mismatch/bin{k}_tokens"] = counts[k].float()
    return out


def to_host(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors -> Python floats in one device-to-host transfer (NaN stays NaN)."""
    if not metrics:
        return {}
    names = list(metrics)
    values = torch.stack([metrics[k].detach().float().reshape(()) for k in names]).tolist()
    return dict(zip(names, values))


def rollout_correction(batch: Any, spec: DriverSpec) -> tuple[Any, dict[str, float]]:
    """Apply ``spec`` to a verl ``DataProto`` in place of verl's rollout correction.

    Reads ``old_log_probs`` (``old_logp``), ``rollout_log_probs`` (``rollout_logp``),
    ``response_mask``; writes ``response_mask`` (the correction's rejection, verl's dtype) and
    ``rollout_is_weights`` (detached float32, 0 outside the mask).

    Returns:
        ``(batch, metrics)`` as verl's function does; metrics are floats.

    Shapes:
        every batch tensor ``[B, T]``.
    """
    tensors = batch.batch
    old, rollout = tensors["old_log_probs"], tensors["rollout_log_probs"]
    mask_in = tensors["response_mask"]
    mm = measure(old, rollout, mask_in.bool(), acceptance=_acceptance(tensors, spec, old, rollout))
    corr = spec.correction(mm) if spec.correction is not None else None
    with torch.no_grad():
        sums = mismatch_sums(mm, full=True)
        if corr is not None:
            sums.update(corr.metric_sums(full=True))
        metrics = reduce_metrics(sums)
        metrics.update(mismatch_quantiles(mm, spec.quantiles))
        offset = _offsets(tensors, old.shape[-1])
        metrics.update(_binned("log_ratio", mm.log_ratio, mm.valid, spec, offset))
        if mm.acceptance is not None:
            acc = mm.acceptance.float()
            ok = mm.valid & torch.isfinite(acc)
            metrics.update(_binned("acceptance", torch.where(ok, acc, 0.0), ok, spec, offset))
    if corr is not None:
        tensors["response_mask"] = corr.mask.to(mask_in.dtype)
        tensors["rollout_is_weights"] = corr.weights.detach()
    return batch, to_host(metrics)
