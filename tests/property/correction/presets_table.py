"""ONE table of every public correction preset: the shared property tests iterate over it.

Each row: a name, a factory of a loose and a strict variant (the strict one may only reject
more), an upper bound on the weights (None = unbounded), and whether the preset drops tokens
from the mask (peer presets carry rejection in the weight instead).
A new preset added here inherits every invariant test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sparsecorr.correction import (
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


@dataclass(frozen=True)
class Row:
    name: str
    loose: Callable
    strict: Callable
    bound: float | None
    needs_acceptance: bool = False
    needs_advantages: bool = False

    @property
    def preset(self) -> str:
        """The ``sparsecorr.correction.PRESETS`` name this row exercises."""
        for prefix, name in (("trl_", "trl"), ("openrlhf_", "openrlhf"), ("mis", "mis"),
                             ("seq_is", "sequence_is")):
            if self.name.startswith(prefix):
                return name
        return self.name


PRESETS = [
    Row("tis", lambda: tis(cap=2.0), lambda: tis(cap=1.5), 2.0),
    Row("sparrow", lambda: sparrow(), lambda: sparrow(cap=2.0), 3.0),
    Row("mis", lambda: mis(0.5, 2.0), lambda: mis(0.7, 1.5), 2.0),
    Row("mis_seq", lambda: mis(0.2, 5.0, level="sequence"), lambda: mis(0.5, 2.0, level="sequence"), 5.0),
    Row("mis_geo", lambda: mis(0.5, 2.0, level="geometric"), lambda: mis(0.8, 1.25, level="geometric"), 2.0),
    Row("icepop", lambda: icepop(), lambda: icepop(0.8, 2.0), 1.0),
    Row("geo_rs", lambda: geo_rs(0.5, 2.0), lambda: geo_rs(0.9, 1.1), 1.0),
    Row("veto", lambda: veto(1e-4), lambda: veto(1e-2), 1.0),
    Row("seq_is_geo", lambda: sequence_is("mean", cap=2.0), lambda: sequence_is("mean", cap=2.0), 2.0),
    Row("seq_is_prod", lambda: sequence_is("sum", cap=3.0), lambda: sequence_is("sum", cap=3.0), 3.0),
    Row("divergence", lambda: divergence(0.5), lambda: divergence(0.05), 1.0),
    Row("sparse_rl", lambda: sparse_rl(), lambda: sparse_rl(low=0.7, high=1.3, veto_threshold=1e-2), None),
    Row("sparse_tail", lambda: sparse_tail(tau=0.5), lambda: sparse_tail(tau=0.9), 2.0,
        needs_acceptance=True),
    Row("opsm", lambda: opsm(1.0), lambda: opsm(0.1), 1.0, needs_advantages=True),
    Row("trl_token_truncate", lambda: trl("token_truncate"), lambda: trl("token_truncate"), 3.0),
    Row("trl_token_mask", lambda: trl("token_mask", clip_min=0.2, clip_max=5.0),
        lambda: trl("token_mask", clip_min=0.5, clip_max=2.0), 5.0),
    Row("trl_sequence_truncate", lambda: trl("sequence_truncate"), lambda: trl("sequence_truncate"), 3.0),
    Row("trl_sequence_mask", lambda: trl("sequence_mask", clip_max=5.0),
        lambda: trl("sequence_mask", clip_max=2.0), 5.0),
    Row("openrlhf_token_mask", lambda: openrlhf("token", "mask"), lambda: openrlhf("token", "mask", "ratio", (0.8, 1.25)), 5.0),
    Row("openrlhf_token_clip", lambda: openrlhf("token", "clip"), lambda: openrlhf("token", "clip"), 5.0),
    Row("openrlhf_seq_mask", lambda: openrlhf("seq", "mask"), lambda: openrlhf("seq", "mask", "ratio", (0.9, 1.1)), None),
    Row("openrlhf_tv", lambda: openrlhf("token", "mask", "tv", (0.0, 0.2)),
        lambda: openrlhf("token", "mask", "tv", (0.0, 0.02)), None),
]
