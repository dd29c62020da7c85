"""CORRECT: importance weights and rejection masks for sparse rollouts, composable, with presets.

A correction is any callable ``(CorrectionInputs) -> Correction``; build one from the presets
(``tis()``, ``sparse_rl()``, ``icepop()``, ``trl("token_truncate")`` ...), compose with
``chain(...)``, or pick one by name with ``get_preset("sparse_rl", cap=1.5)``.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Chain, Correction, CorrectionFn, CorrectionInputs, chain, finalize, prepare
from .masks import band_mask, divergence_mask, opsm_mask, tail_mask, veto_mask
from .peers import TRL_MODES, OpenRLHFCorrection, TRLCorrection, openrlhf, trl
from .presets import (
    OPSM,
    TIS,
    BandMask,
    BatchNormalized,
    Divergence,
    SequenceIS,
    TailReject,
    Veto,
    divergence,
    geo_rs,
    icepop,
    mis,
    opsm,
    sequence_is,
    sparrow,
    sparse_rl,
    sparse_tail,
    tis,
    veto,
)
from .weights import batch_normalize, sequence_is_weights, token_is_weights

#: preset name -> factory (``get_preset`` passes the numbers through as keyword arguments)
PRESETS: dict[str, Callable[..., CorrectionFn]] = {
    "tis": tis,
    "mis": mis,
    "icepop": icepop,
    "geo_rs": geo_rs,
    "sequence_is": sequence_is,
    "veto": veto,
    "divergence": divergence,
    "opsm": opsm,
    "sparse_rl": sparse_rl,
    "sparrow": sparrow,
    "sparse_tail": sparse_tail,
    "trl": trl,
    "openrlhf": openrlhf,
}


def get_preset(name: str, **numbers: object) -> CorrectionFn:
    """A preset by name, e.g. ``get_preset("tis", cap=3.0)`` or ``get_preset("trl:token_mask")``.

    ``"trl:MODE"`` is shorthand for ``trl(mode=MODE)``; ``"none"`` returns None (no correction).
    """
    if name == "none":
        return None  # type: ignore[return-value]
    if name.startswith("trl:"):
        return trl(mode=name.split(":", 1)[1], **numbers)  # type: ignore[arg-type]
    if name not in PRESETS:
        raise ValueError(f"name: expected one of {sorted(PRESETS)} (or 'trl:MODE', 'none'), got {name!r}")
    try:
        return PRESETS[name](**numbers)
    except TypeError as exc:
        raise ValueError(f"numbers: {name} does not take {sorted(numbers)}: {exc}") from None


__all__ = [
    "OPSM",
    "PRESETS",
    "TIS",
    "TRL_MODES",
    "BandMask",
    "BatchNormalized",
    "Chain",
    "Correction",
    "CorrectionFn",
    "CorrectionInputs",
    "Divergence",
    "OpenRLHFCorrection",
    "SequenceIS",
    "TRLCorrection",
    "TailReject",
    "Veto",
    "band_mask",
    "batch_normalize",
    "chain",
    "divergence",
    "divergence_mask",
    "finalize",
    "geo_rs",
    "get_preset",
    "icepop",
    "mis",
    "openrlhf",
    "opsm",
    "opsm_mask",
    "prepare",
    "sequence_is",
    "sequence_is_weights",
    "sparrow",
    "sparse_rl",
    "sparse_tail",
    "tail_mask",
    "tis",
    "token_is_weights",
    "trl",
    "veto",
    "veto_mask",
]
