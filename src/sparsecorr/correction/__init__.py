"""CORRECT: importance weights and rejection masks for sparse rollouts, composable, with presets.

A correction is a callable ``Mismatch -> Correction`` (the record comes from
``sparsecorr.mismatch.measure``). Build one with a factory (``tis()``, ``sparse_rl()``,
``icepop()``, ``trl(mode="token_truncate")`` ...), compose with ``chain(...)``, or pick one by
name with ``get_preset("sparse_rl", cap=1.5)``. The factories are the public way to build a
correction; the classes they return (``TIS``, ``BandMask``, ...) live in
``sparsecorr.correction.presets`` / ``.peers`` and are not constructed directly.

The pure functions (``token_is_weights``, ``band_mask``, ``veto_mask`` ...) compute the same
rules on a bare log-ratio tensor, for use outside a correction.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Correction, CorrectionFn, chain
from .factories import (
    batch_normalized,
    divergence,
    geo_rs,
    icepop,
    mis,
    openrlhf,
    opsm,
    sequence_is,
    sparrow,
    sparse_rl,
    sparse_tail,
    tis,
    trl,
    veto,
)
from .masks import band_mask, divergence_mask, opsm_mask, tail_mask, veto_mask
from .peers import OPENRLHF_GATINGS, TRL_MODES
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


def get_preset(name: str, **numbers: object) -> CorrectionFn | None:
    """A preset by name, e.g. ``get_preset("tis", cap=3.0)`` or
    ``get_preset("trl", mode="token_mask")``; ``"none"`` returns None (no correction).

    Raises:
        ValueError: an unknown name, or numbers the preset does not take or refuses.
    """
    if name == "none":
        if numbers:
            raise ValueError(f"numbers: expected none for 'none', got {sorted(numbers)}")
        return None
    if name not in PRESETS:
        raise ValueError(f"name: expected one of {sorted(PRESETS)} or 'none', got {name!r}")
    try:
        return PRESETS[name](**numbers)
    except TypeError as exc:
        raise ValueError(f"numbers: {name} does not take {sorted(numbers)}: {exc}") from None


__all__ = [
    "OPENRLHF_GATINGS",
    "PRESETS",
    "TRL_MODES",
    "Correction",
    "CorrectionFn",
    "band_mask",
    "batch_normalize",
    "batch_normalized",
    "chain",
    "divergence",
    "divergence_mask",
    "geo_rs",
    "get_preset",
    "icepop",
    "mis",
    "openrlhf",
    "opsm",
    "opsm_mask",
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
