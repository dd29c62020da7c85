r"""What every KV policy shares: the interface, protection of sinks and the recent window, top-k.

A policy only *scores* (eviction) or *selects* (selection); this module turns scores into a
kept set. Eviction policies (StreamingLLM, SnapKV, R-KV) drop KV for good: the engine calls
[`compress`][sparsecorr.decoding.policies.compress] when a row's cache exceeds
``budget + buffer`` and keeps the ``budget`` best-scored tokens, always including the first
``sink`` tokens and the most recent ``window`` tokens. Selection policies (BlockTopK) keep the
whole cache and restrict which part of it each decode step attends to.

Shapes: keys ``[B, H_kv, S, D]`` (post-RoPE), queries ``[B, H_q, W, D]`` (the last W queries,
post-RoPE, ``H_q = H_kv · G``), valid ``[B, H_kv, S]`` bool, positions ``[B, H_kv, S]`` (true
absolute positions). In the engine ``B`` is ``n·B``: a compression event stacks the ``n``
layers it scores along the batch axis, layer-major, with no layer id (`KVPolicy.score`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..._checks import check_int as _check_int
from ..kernels import window_votes
from .state import PolicyState

__all__ = ["EvictionPolicy", "KVPolicy", "KeepSet", "check_int", "check_scores", "compress", "group_scores",
           "hook_name", "matmul_f32", "merge_rows", "row_capacity", "split_rows"]

Kind = Literal["dense", "eviction", "selection"]


def check_int(name: str, value: object, *, minimum: int) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum``
    (a policy field; `sparsecorr._checks.check_int`)."""
    _check_int(name, value, low=minimum)


@dataclass(frozen=True)
class KVPolicy:
    """Base of every policy (frozen dataclasses): the declarations the engine reads and the
    `PolicyState` it runs (``state_type``, made per call by `new_state`). Eviction policies
    derive from `EvictionPolicy` and define `score`; a selection policy overrides the state's
    hooks (BlockTopK). The defaults are the dense policy's."""

    name: ClassVar[str] = "base"
    kind: ClassVar[Kind] = "dense"
    key_norms: ClassVar[bool] = False  # score takes the pool's key norms (``key_norms=``)
    #: the per-call state and hooks (`sparsecorr.decoding.policies.state.PolicyState`)
    state_type: ClassVar[type[PolicyState]] = PolicyState
    #: the pool keeps each slot's true position (heads keep different tokens after eviction)
    tracks_positions: ClassVar[bool] = False
    #: the budget is ignored (dense at every length)
    ignores_budget: ClassVar[bool] = False

    @property
    def evicts(self) -> bool:
        return self.kind == "eviction"

    @property
    def compress_in_prefill(self) -> bool:
        """Whether the engine runs `due` / compression between prefill chunks (True, the default:
        an eviction policy's prompt is compressed as it is read). False: the prompt is kept whole
        and the first compression is the first decode step past the trigger, as Sparse-RL's fork
        does (``RKV(variant="sparse_rl")``); the pool then holds the whole prompt (`row_capacity`)."""
        return True

    @property
    def pool_page_size(self) -> int:
        """Slots per page of the pool (a paged kernel's page; 16 unless the policy selects pages)."""
        return 16

    def new_state(self, pool, *, q_heads: int, table: torch.Tensor) -> PolicyState:
        """This policy's state for one call over ``pool`` (``table``: budget by context length)."""
        return self.state_type(self, pool, q_heads=q_heads, table=table)

    def due(self, count: torch.Tensor, ctx: torch.Tensor, *,
            budget_at: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Which rows must be compressed, holding ``count`` valid slots after ``ctx`` tokens (any
        shape, host; ``budget_at``: the budget by context length, -1 = dense), and their
        budgets; None: never (nothing is computed, the default: the policy does not evict)."""
        return None

    def capacity(self, table: torch.Tensor, *, longest: int, chunk: int) -> int:
        """Most slots a row can hold over contexts up to ``longest`` fed in chunks of ``chunk``
        (``table``: budget by context length): the whole context unless the policy evicts.

        The engine allocates this many slots per row (rounded up to whole pages of
        `pool_page_size`) once per call, and nothing grows the pool later: the answer must cover
        the most slots a row ever holds, before any compression that reduces it (an eviction
        policy: ``max budget + buffer + chunk``, `EvictionPolicy.capacity`). A forward or a
        compression event that needs more raises a ``ValueError`` naming the policy and the
        hook ``capacity`` (`sparsecorr.decoding.cache.SparseKVCache`)."""
        return longest

    def score(self, *, keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor,
              positions: torch.Tensor, query_valid: torch.Tensor | None = None) -> torch.Tensor:
        r"""Per-slot scores, higher = keep; `compress` keeps the ``budget`` best of each
        (row, KV head) and always the protected sink / recent slots.

        **What it receives.** A compression event scores *every layer in one call*: the layers
        are stacked along the batch axis, layer-major, so each tensor has ``n·B`` rows, row
        ``l·B + b`` being sequence ``b`` of the ``l``-th layer scored (``n = L`` layers; one
        layer at a time, ``n = 1``, when autograd is on). No layer id is passed: ``score``
        cannot tell layers apart and must not depend on the row index; layers differ only
        through their own keys and queries. A rule that reads only ``positions`` keeps the same
        set in every layer. Keyword arguments:

        - ``keys`` ``[n·B, H_kv, S, D]`` (post-RoPE, the pool's dtype), ``valid``
          ``[n·B, H_kv, S]`` bool, ``positions`` ``[n·B, H_kv, S]`` long (true positions);
        - ``queries`` ``[n·B, H_q, W, D]``: what the policy's state gives
          (`PolicyState.score_inputs`; the base state gives ``W = 0``);
        - ``query_valid`` ``[n·B, W]`` (only when the state gives it): which window queries are
          real; ``key_norms`` / ``unit_sum`` only for a policy with ``key_norms = True``.

        **What it returns.** A floating-point ``torch.Tensor`` of shape ``valid.shape``
        (``[n·B, H_kv, S]``), on the keys' device; checked once per `compress` call (host
        metadata, no sync): anything else raises a ``ValueError`` naming the policy and the hook
        ``score``. Scores of invalid slots are ignored. Scores of valid slots must be
        **finite**: that is not checked (it would sync the device), and torch's ``topk`` ranks
        NaN and +inf above every protected slot, while -inf ties with the invalid slots.
        Scores are read in float64 and **ties go to the more recent token**: the rank key is
        \(\mathrm{score} + 10^{-12}\cdot\mathrm{position}\) (keep \(|\mathrm{score}| \lesssim
        10^3\) for that term to survive float64 rounding).

        **It must be pure**: the same inputs give the same scores, with no random draws and no
        state across calls. Teacher forcing (`sparsecorr.decoding.teacher_forced_logprobs`)
        scores the same keys again and reproduces the decode only if the kept sets come out the
        same; a seeded generator inside ``score`` drew different sets in the replay and moved
        the log-probs by up to 0.15 nats. Randomness belongs in the inputs (e.g. a hash of
        ``positions``), or record the kept sets (``generate(record_keep=True)``) and replay them.
        """
        raise NotImplementedError(f"{type(self).__name__} does not score tokens")


@dataclass(frozen=True)
class EvictionPolicy(KVPolicy):
    """A policy that drops KV for good: when a row holds more than ``budget + buffer`` slots the
    engine keeps the ``budget`` best-scored (`compress`). Subclasses define ``sink``, ``window``
    and ``buffer`` fields and `score`.

    What ``budget`` bounds: the slots a row keeps after a compression. Between two compressions a
    row grows to ``budget + buffer`` slots, and the step that crosses it attends
    ``budget + buffer + 1`` (its own token included) before the compression after it; a prefill
    chunk of ``c`` tokens attends at most ``budget + buffer + c``. ``RolloutBatch.kv_kept``
    records what each step attended."""

    kind: ClassVar[Kind] = "eviction"
    tracks_positions: ClassVar[bool] = True

    def due(self, count, ctx, *, budget_at):
        """Rows past ``budget + buffer`` (a budget of -1: dense at that length, never due)."""
        budget = budget_at(ctx)
        return (budget >= 0) & (count > budget + self.buffer), budget

    def capacity(self, table: torch.Tensor, *, longest: int, chunk: int) -> int:
        """``max budget + buffer + max(chunk, 1)`` (a chunk is fed before compressing), at most
        the context; the whole context where some length is dense."""
        if bool((table[1:longest + 1] < 0).any()):
            return longest
        return min(longest, int(table[1:longest + 1].max()) + self.buffer + max(chunk, 1))


def row_capacity(policy: KVPolicy, table: torch.Tensor, *, longest: int, chunk: int,
                 prompt: int | None = None) -> int:
    """Slots to allocate per row: `KVPolicy.capacity`, and for a policy that keeps the prompt
    whole (``compress_in_prefill`` False) at least ``prompt + 1`` (the whole prompt plus the first
    decode token, whose step compresses it), capped by ``longest``: about
    ``min(longest, max(prompt + 1, budget + buffer + chunk))``. ``prompt``: the longest prompt
    (None: unknown, taken as ``longest - 1``: the whole context)."""
    cap = policy.capacity(table, longest=longest, chunk=chunk)
    if policy.compress_in_prefill:
        return cap
    whole = longest if prompt is None else prompt + 1
    return min(longest, max(cap, whole))


@dataclass(frozen=True)
class KeepSet:
    """Kept slots per (sequence, KV head), ascending (slot order is position order).

    Shapes:
        index: ``[B, H_kv, K]`` long; valid: ``[B, H_kv, K]`` bool.
    """

    index: torch.Tensor
    valid: torch.Tensor


@functools.cache
def _mixed_gemm(device_type: str) -> bool:
    """Whether the backend has a ``bf16/fp16 x bf16/fp16 -> fp32`` batched GEMM (``aten::bmm.dtype``:
    CUDA and meta have one; the CPU does not)."""
    key = torch._C._dispatch_key_for_device(device_type)
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::bmm.dtype", key)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r"""``a @ b`` accumulated and returned in float32, reading low-precision operands as they are.

    Two bf16 (or fp16) numbers multiply exactly in float32, so the result is the float32 product
    of the stored values, accumulated in float32 -- what ``a.float() @ b.float()`` computes --
    without a float32 copy of either operand where the backend has a mixed-precision GEMM
    (CUDA: ``torch.bmm(..., out_dtype=torch.float32)``). Elsewhere (CPU) the operands are upcast
    first: the same math, more traffic. Float32 operands (or mixed dtypes) take the plain path.

    Shapes:
        a ``[..., M, K]``, b ``[..., K, N]`` with the same leading dims -> ``[..., M, N]`` float32.
    """
    if a.dtype == torch.float32 or a.dtype != b.dtype or not _mixed_gemm(a.device.type):
        return a.float() @ b.float()
    lead, m, n = a.shape[:-2], a.shape[-2], b.shape[-1]
    out = torch.bmm(a.reshape(-1, m, a.shape[-1]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
    return out.reshape(*lead, m, n)


def split_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r"""Float32 rows ``x`` as rows in ``dtype`` whose sum is ``x``: \(x = x_{hi} + x_{lo}\) with
    \(x_{hi}\) = ``x`` rounded to ``dtype`` and \(x_{lo}\) the rounded remainder (relative error
    about \(2^{-17}\) for bf16), so a float32 vector can meet bf16 keys in a
    `matmul_f32` (add the two halves of the
    result with `merge_rows`). Float32 ``dtype``:
    ``x`` itself.

    Shapes:
        x ``[..., R, D]`` float32 -> ``[..., R, D]`` (float32) or ``[..., 2R, D]`` (hi rows, then lo).
    """
    if dtype == torch.float32:
        return x
    hi = x.to(dtype)
    return torch.cat([hi, (x - hi).to(dtype)], dim=-2)


def merge_rows(y: torch.Tensor, rows: int) -> torch.Tensor:
    """The product of `split_rows`' rows, merged
    back: ``[..., R or 2R, N]`` -> ``[..., R, N]``."""
    return y if y.shape[-2] == rows else y[..., :rows, :] + y[..., rows:, :]


def group_scores(queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                 query_valid: torch.Tensor | None = None) -> torch.Tensor:
    r"""Attention of the observation-window queries to the keys, summed over the window and
    averaged over the query heads of each KV group: ``[B, H_kv, S]`` (SnapKV's importance, Li et
    al., 2024).

    Softmax over valid keys only, in float32; window queries with ``query_valid`` False
    (``[B, W]``) do not vote. The logits are one
    `matmul_f32` of the keys as stored (no float32
    copy of the keys where the backend has a mixed-precision GEMM); only the ``[B, H_q, W, S]``
    logits are float32. Scores of invalid slots are unspecified (0 in any row with a valid key).

    Shapes:
        queries ``[B, H_q, W, D]``; keys ``[B, H_kv, S, D]``; valid ``[B, H_kv, S]`` bool.
    """
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    g = hq // hkv
    logits = matmul_f32(queries.reshape(b, hkv, g * w, d), keys.transpose(-1, -2))
    return window_votes(logits, valid, query_valid, group=g, scale=d**-0.5)


def _protected(policy: KVPolicy, valid: torch.Tensor, rank: torch.Tensor) -> torch.Tensor | None:
    """Slots that must be kept (before masking by ``valid``): the first ``sink`` and the last
    ``window`` valid slots, by ``rank`` (the running count of valid slots, 1-based); None if
    neither is asked for."""
    sink, recent = getattr(policy, "sink", 0), getattr(policy, "window", 0)
    parts = []
    if sink:
        parts.append(rank <= sink)
    if recent:
        parts.append(rank > rank[..., -1:] - recent)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] | parts[1]


def hook_name(policy: KVPolicy, hook: str) -> str:
    """``"ClassName(name='...').hook"``: how a contract error names a policy's hook."""
    return f"{type(policy).__name__}(name={policy.name!r}).{hook}"


def check_scores(policy: KVPolicy, scores: object, valid: torch.Tensor) -> None:
    """Raise a ``ValueError`` naming the policy and the hook ``score`` unless ``scores`` is a
    floating-point tensor of ``valid``'s shape on its device (`KVPolicy.score`'s contract; host
    metadata only, no sync)."""
    if (isinstance(scores, torch.Tensor) and scores.is_floating_point()
            and scores.shape == valid.shape and scores.device == valid.device):
        return
    got = (f"{scores.dtype} tensor of shape {tuple(scores.shape)} on {scores.device}"
           if isinstance(scores, torch.Tensor) else
           f"{type(scores).__module__}.{type(scores).__qualname__} of shape {getattr(scores, 'shape', '?')}")
    raise ValueError(f"{hook_name(policy, 'score')}: expected a floating-point torch.Tensor of shape "
                     f"{tuple(valid.shape)} ([L·B, H_kv, S]: the layers stacked along the batch, as "
                     f"valid) on {valid.device}, got a {got}")


def compress(policy: KVPolicy, *, keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor,
             positions: torch.Tensor, budget: int | torch.Tensor,
             query_valid: torch.Tensor | None = None, max_budget: int | None = None,
             key_norms: torch.Tensor | None = None, unit_sum: torch.Tensor | None = None) -> KeepSet:
    r"""Keep the ``budget`` best-scored valid slots of every (sequence, KV head).

    Sinks and the recent window always survive; invalid slots never do; equal scores are
    broken in favour of the more recent position. The budget is a hard cap: if it is smaller
    than ``sink + window``, the most recent protected tokens are the ones kept. ``budget`` may be a
    ``[B]`` tensor (one budget per sequence, e.g. from a schedule). ``query_valid`` (``[B, W]``)
    marks the real observation-window queries; it is passed to ``policy.score`` only when given.
    ``max_budget`` (the host-known maximum of ``budget``) lets a caller pass ``budget`` already on
    the device without a sync (the engine moves its budgets once per compression, not per layer).
    ``key_norms`` (``[B, H_kv, S]`` float32, \(\lVert k_j\rVert\) with float32 accumulation, as the
    engine keeps them beside the pool: `sparsecorr.decoding.policies.rkv.RKVState.add_key_norms`) is passed to
    ``policy.score`` only when given, and only policies with ``key_norms = True`` (R-KV) take it;
    so is ``unit_sum`` (``[B, H_kv, 1, D]`` float32, R-KV's sum of the valid unit keys as its
    state keeps it: `sparsecorr.decoding.policies.rkv.RKVState.sync_unit_sums`).

    **Slot order is position order**: the valid slots of a row must hold increasing positions
    (the engine's pool keeps this: compaction keeps the kept slots in position order and new
    tokens are written after them). So the sink / recent ranks are running counts of valid
    slots and the kept set is put in position order by sorting slot indices: no argsort of
    positions.

    Returns:
        `KeepSet` with ``K = min(max budget, S)`` columns: the kept slots ascending, then (where a
        row keeps fewer) entries set to the last slot with ``valid`` False.
    """
    b, _, s = valid.shape
    budgets = torch.as_tensor(budget).reshape(-1).long()
    top_budget = int(budgets.max()) if max_budget is None else max_budget  # no sync: host or given
    k = int(min(top_budget, s))
    budgets = budgets.to(valid.device, non_blocking=True).expand(b)
    extra = {} if query_valid is None else {"query_valid": query_valid}
    if key_norms is not None:
        extra["key_norms"] = key_norms
    if unit_sum is not None:
        extra["unit_sum"] = unit_sum
    scores = policy.score(keys=keys, queries=queries, valid=valid, positions=positions, **extra)
    check_scores(policy, scores, valid)
    # ties (frequent after max pooling) go to the more recent token, by true position, so the
    # kept set does not depend on where a row's tokens sit in the slot axis (padding, batching)
    key = torch.add(scores.double(), positions, alpha=1e-12)
    # protected slots outrank every score, and among themselves the most recent (the latest
    # slot: slot order is position order) wins (1e15 + slot is exact in float64)
    rank = valid.cumsum(-1)  # 1-based rank of each valid slot; its last entry: valid slots per row
    protected = _protected(policy, valid, rank)
    if protected is not None:
        key = torch.where(protected, torch.arange(1e15, 1e15 + s, dtype=torch.float64, device=key.device), key)
    key = torch.where(valid, key, -torch.inf)
    top = key.topk(k, dim=-1).indices  # [B, H, K]: valid slots (finite keys) first
    # the first min(budget, valid slots) entries are kept
    kept = torch.arange(k, device=valid.device) < torch.minimum(budgets[:, None, None], rank[..., -1:])
    # position order = slot order: sort the kept slots; dropped entries (set to the last slot) go last
    index = torch.where(kept, top, s - 1).sort(dim=-1).values
    return KeepSet(index=index, valid=kept)
