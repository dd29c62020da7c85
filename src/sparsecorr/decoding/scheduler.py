r"""A continuous-batching scheduler over one `Engine`: requests join and leave a running batch.

The scheduler drives one [`Engine`][sparsecorr.decoding.engine.Engine] at a FIXED batch of
``plan.rows`` slots (plus one never-fed *pristine* row): free slots are fed ``real = 0`` (their
tokens go to the scratch page), so every forward has one batch size. Each `step`:

1. **admit** waiting requests into free slots: the slot's pool row and policy state are reset
   by copying the pristine row into it (`Engine.take_rows`, an index such as
   ``[0, 1, P, 3, P]``), so no policy needs a reset hook;
2. **one forward**: a prefill chunk of ``prefill_chunk`` tokens for the rows still reading their
   prompt (``real = chunk``, every other row ``real = 0``: decoding rows wait one forward), else
   one token for every decoding row; ``compress_due`` after it, as ``generate`` does;
3. **sample** each row with its own request's parameters (`sample_rows`);
4. **retire** the rows that sampled a stop token or reached ``max_tokens`` at once: their slot
   is free for the next step.

A seeded request owns a ``torch.Generator`` seeded with its seed and draws its own noise, so its
tokens do not depend on who shares its steps or when it arrived (and neither do its log-probs,
up to the parity tests' tolerances: a row's arithmetic does not read its neighbours).

The memory plan (`plan_memory`) sizes ``plan.rows`` from ``max_num_seqs``, ``max_kv_bytes`` or
the device's free memory and one row's bytes (pool + policy state at the policy's capacity at
``max_model_len``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .policies import KVPolicy

__all__ = ["MemoryPlan", "RequestOutput", "RequestParams", "Scheduler"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestParams:
    """One request's sampling; ``__post_init__`` validates (a ValueError names the field).

    Attributes:
        max_tokens: tokens to decode at most (>= 1).
        temperature: 0 = greedy (log-probs then of the untempered model), as ``generate``.
        top_k: sample from the top-k support (None = off).
        top_p: nucleus in (0, 1] (None = off).
        logprobs: top-k log-probs recorded per token (0 = none).
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


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """How many rows fit.

    Attributes:
        rows: most rows resident at once.
        row_bytes: KV pool + policy-state bytes of one row.
        capacity: KV slots per row (``KVPolicy.capacity`` at ``max_model_len``).
        bytes_allowed: the byte bound used (None: only ``max_num_seqs`` bounded it).
        source: ``"max_num_seqs"`` | ``"max_kv_bytes"`` | ``"free memory"``.
    """

    rows: int
    row_bytes: int
    capacity: int
    bytes_allowed: int | None
    source: str


class Scheduler:
    """Continuous batching over one engine (NOT thread-safe: one thread calls it).

    Args:
        model: the Hugging Face causal LM.
        policy: the KV policy; budget: as ``generate``'s.
        max_model_len: most tokens (prompt + response) of one request; sizes each row.
        backend, cuda_graph, fused, prefill_chunk: as ``generate``'s.
        max_num_seqs: most rows resident at once (None = the memory plan decides).
        max_kv_bytes: bytes the pool and policy state may take (None = free device memory).
        eos_token_id: default stop tokens (a request's ``stop_token_ids`` overrides).
        generator: the RNG of unseeded sampling requests.
    """

    def __init__(self, model: PreTrainedModel, *, policy: KVPolicy, budget, max_model_len: int,
                 backend: str = "auto", cuda_graph: bool = False, fused: bool | None = None,
                 prefill_chunk: int = 512, max_num_seqs: int | None = None, max_kv_bytes: int | None = None,
                 eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None) -> None:
        raise NotImplementedError

    plan: MemoryPlan

    def add_request(self, request_id: str, prompt_ids, params: RequestParams) -> None:
        """Queue a request. Validated at once: an empty or over-long prompt (prompt +
        ``max_tokens`` > ``max_model_len``), a duplicate id or bad params raise a ValueError
        naming the field; nothing else is affected."""
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        """One iteration: admit, one forward, sample per row, retire. Returns the requests that
        finished in it. An exception inside the forward fails only that forward's rows
        (``finish_reason="error"``, ``error=exc``); the scheduler stays usable."""
        raise NotImplementedError

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request: its partial tokens, ``"aborted"`` (None if unknown)."""
        raise NotImplementedError

    def abort_all(self) -> list[RequestOutput]:
        """Abort every waiting and running request."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    @property
    def num_running(self) -> int:
        raise NotImplementedError

    @property
    def num_waiting(self) -> int:
        raise NotImplementedError

    max_resident: int  # high-water mark of rows resident
    peak_kv_bytes: int

    def release(self) -> None:
        """Free the pool, graphs and backend buffers (no request may be running; waiting ones are
        kept); the next `step` allocates again."""
        raise NotImplementedError

    def close(self) -> None:
        """`release` and drop everything: nothing of the engine stays alive."""
        raise NotImplementedError
