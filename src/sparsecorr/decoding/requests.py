r"""A request of the continuous-batching scheduler: its sampling (`RequestParams`), its result
(`RequestOutput`) and its running state, with the checks run when it is submitted (a
``ValueError`` naming the field)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._checks import check_int, check_number, is_int
from .sampling import RowSampling

__all__ = ["Request", "RequestOutput", "RequestParams", "check_prompt"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestParams:
    """One request's sampling; ``__post_init__`` validates (a ValueError names the field).

    Attributes:
        max_tokens: tokens to decode at most (>= 1).
        temperature: 0 = greedy (log-probs then of the untempered model), as ``generate``.
        top_k: sample from the top-k support (None = off).
        top_p: nucleus in (0, 1] (None = off).
        logprobs: top-k log-probs recorded per token (0 = none; capped at the vocabulary).
        seed: a request-owned RNG: its tokens never depend on neighbours or arrival.
        stop_token_ids: tokens that end the request (None = the scheduler's ``eos_token_id``).
        ignore_eos: decode exactly ``max_tokens``.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    logprobs: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, low=1)
        check_number("temperature", self.temperature, low=0, why=" (0 = greedy)")
        check_int("top_k", self.top_k, low=1, allow_none=True, why=" (None = no truncation)")
        check_number("top_p", self.top_p, low=0, high=1, low_open=True, allow_none=True, why=" (1 = no truncation)")
        check_int("logprobs", self.logprobs, low=0, why=" (0 = none)")
        check_int("seed", self.seed, low=0, allow_none=True)
        stops = self.stop_token_ids
        if stops is not None:
            if not isinstance(stops, (list, tuple)) or not all(is_int(t) and t >= 0 for t in stops):
                raise ValueError(f"stop_token_ids: expected None or a tuple of token ids, got {stops!r}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """A finished request.

    Shapes:
        logprobs ``[T]`` float32 CPU (the sparse sampler's log-prob of each token);
        topk_logp ``[T, k]`` float32 CPU and topk_ids ``[T, k]`` long CPU, or None when
        ``params.logprobs == 0``.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: torch.Tensor
    topk_logp: torch.Tensor | None
    topk_ids: torch.Tensor | None
    finish_reason: str  # "eos" | "length" | "aborted" | "error"
    error: BaseException | None = None
    kv_kept: tuple[float, ...] = ()  # mean attended KV slots when each token was fed (0: not fed)


@dataclass(eq=False)
class Request:
    """A request's running state (host)."""

    id: str
    prompt: torch.Tensor  # CPU long [P]
    params: RequestParams
    stops: frozenset[int]
    samp: RowSampling
    fed: int = 0  # prompt tokens fed
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    top: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def output(self, reason: str, error: BaseException | None = None) -> RequestOutput:
        k = self.samp.logprobs
        tv = ti = None
        if k:
            tv = torch.stack([v for v, _ in self.top]) if self.top else torch.zeros(0, k)
            ti = torch.stack([i for _, i in self.top]) if self.top else torch.zeros(0, k, dtype=torch.long)
        kept = self.kept + [0.0] * (len(self.tokens) - len(self.kept))
        return RequestOutput(request_id=self.id, prompt_ids=tuple(self.prompt.tolist()), token_ids=tuple(self.tokens),
                             logprobs=torch.tensor(self.logps, dtype=torch.float32), topk_logp=tv, topk_ids=ti,
                             finish_reason=reason, error=error, kv_kept=tuple(kept))


def check_prompt(prompt_ids, vocab: int) -> torch.Tensor:
    """A request's prompt as a CPU long ``[P]`` (P >= 1, ids in ``[0, vocab)``)."""
    try:
        p = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"prompt_ids: expected a sequence of token ids, got {type(prompt_ids).__name__}") from exc
    if p.dim() != 1 or p.numel() == 0 or p.dtype.is_floating_point or p.dtype == torch.bool or p.is_complex():
        raise ValueError(f"prompt_ids: expected a non-empty 1-D sequence of int token ids, got shape "
                         f"{tuple(p.shape)} dtype {p.dtype}")
    lo, hi = int(p.min()), int(p.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompt_ids: expected token ids in [0, {vocab}), got values in [{lo}, {hi}]")
    return p.detach().to("cpu", torch.long)
