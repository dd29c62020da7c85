"""One verl request (``prompt_ids``, ``sampling_params``) as what an engine call needs, and one
engine call over a batch of them.

verl's agent loop sends ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``repetition_penalty``
and ``logprobs`` (bool), and optionally ``max_tokens`` (or SGLang's ``max_new_tokens``),
``seed`` and ``ignore_eos``. Requests whose `SamplingKey` differs cannot share an engine call
(``generate`` takes one temperature, top-k, top-p, generator and stop set per batch);
``max_tokens`` and ``logprobs`` may differ inside one batch: the batch decodes up to the largest
``max_tokens`` and each row is cut at its own (the tokens before a row's cut do not depend on
where the cut is).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Completion", "EngineRequest", "SamplingKey", "parse_request", "run_batch"]

_KNOWN = frozenset({"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens",
                    "max_new_tokens", "seed", "ignore_eos"})


@dataclass(frozen=True)
class SamplingKey:
    """What requests must share to be decoded in one engine call.

    Attributes:
        temperature: 0 = greedy.
        top_k: None = off.
        top_p: None = off.
        seed: None = the server's own generator; else a generator seeded with it for the batch.
        ignore_eos: decode to ``max_tokens`` without stopping at EOS.
    """

    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    ignore_eos: bool


@dataclass(frozen=True)
class EngineRequest:
    """A validated request: ``prompt`` token ids, ``max_tokens`` to generate, its `SamplingKey`,
    and whether the caller wants the log-probs back."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    key: SamplingKey
    logprobs: bool


@dataclass(frozen=True)
class Completion:
    """One request's result: ``token_ids`` (EOS included when it was sampled), the sampler's
    ``log_probs`` of each, and ``finish_reason`` (``generate``'s: ``eos`` or ``length``)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str


def _number(name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"sampling_params.{name}: expected a finite number, got {value!r}")
    return float(value)


def _sampling_key(params: Mapping[str, Any]) -> SamplingKey:
    temperature = _number("temperature", params.get("temperature"), 1.0)
    if temperature < 0:
        raise ValueError(f"sampling_params.temperature: expected >= 0, got {temperature!r}")
    top_k = params.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise ValueError(f"sampling_params.top_k: expected an int (-1 or 0 = off), got {top_k!r}")
    top_p = _number("top_p", params.get("top_p"), 1.0)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"sampling_params.top_p: expected a number in (0, 1], got {top_p!r}")
    penalty = _number("repetition_penalty", params.get("repetition_penalty"), 1.0)
    if penalty != 1.0:
        raise ValueError(f"sampling_params.repetition_penalty: the sparsecorr engine samples without a "
                         f"repetition penalty, expected 1.0, got {penalty!r}")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"sampling_params.seed: expected an int or None, got {seed!r}")
    return SamplingKey(temperature=temperature, top_k=top_k if top_k and top_k > 0 else None,
                       top_p=None if top_p >= 1.0 else top_p, seed=seed,
                       ignore_eos=bool(params.get("ignore_eos", False)))


def parse_request(request_id: str, prompt_ids: Sequence[int] | torch.Tensor, sampling_params: Mapping[str, Any],
                  *, max_model_len: int, default_max_tokens: int, vocab_size: int) -> EngineRequest:
    """Validate one request against the engine's capacity and make it an `EngineRequest`.

    ``max_tokens`` (default ``default_max_tokens``) is clamped to ``[1, max_model_len -
    len(prompt_ids)]``, as verl's vLLM server does.

    Raises:
        ValueError: naming the field: an empty or over-long ``prompt_ids`` (no room for one new
            token within ``max_model_len``), a token id outside the vocabulary, an unsupported
            sampling parameter.
    """
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.reshape(-1).tolist()
    prompt = tuple(int(t) for t in prompt_ids)
    if not prompt:
        raise ValueError(f"prompt_ids: expected at least one token, got none (request {request_id!r})")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt_ids: expected at most {max_model_len - 1} tokens (rollout.max_model_len="
                         f"{max_model_len} leaves room for one new token), got {len(prompt)} "
                         f"(request {request_id!r})")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: expected token ids in [0, {vocab_size}), got {bad[:5]} "
                         f"(request {request_id!r})")
    if not isinstance(sampling_params, Mapping):
        raise ValueError(f"sampling_params: expected a dict, got {type(sampling_params).__name__}")
    unknown = sorted(set(sampling_params) - _KNOWN)
    if unknown:
        raise ValueError(f"sampling_params: the sparsecorr engine does not support {unknown}; expected "
                         f"some of {sorted(_KNOWN)}")
    if "max_tokens" in sampling_params and "max_new_tokens" in sampling_params:
        raise ValueError("sampling_params.max_tokens / max_new_tokens: expected one of them, got both")
    max_tokens = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError(f"sampling_params.max_tokens: expected an int, got {max_tokens!r}")
    max_tokens = max(1, min(max_tokens, max_model_len - len(prompt)))
    return EngineRequest(request_id=str(request_id), prompt=prompt, max_tokens=max_tokens,
                         key=_sampling_key(sampling_params), logprobs=bool(sampling_params.get("logprobs", False)))


def batch_inputs(requests: Sequence[EngineRequest]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt ids ``[B, P]`` and their attention mask (``generate`` takes either
    padding side)."""
    width = max(len(r.prompt) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros(len(requests), width, dtype=torch.long)
    for i, r in enumerate(requests):
        ids[i, :len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.long)
        mask[i, :len(r.prompt)] = 1
    return ids, mask


def run_batch(model, requests: Sequence[EngineRequest], *, generate_kwargs: dict[str, Any],
              eos_token_id: int | list[int] | None, generator: torch.Generator | None) -> list[Completion]:
    """One ``sparsecorr.decoding.generate`` call over ``requests`` (one `SamplingKey`), rows in
    the given order; each row cut at its own ``max_tokens``.

    ``generate_kwargs``: the engine options (``policy``, ``budget``, ``backend``,
    ``cuda_graph``, ``fused``, ``prefill_chunk``).
    """
    from sparsecorr.decoding import generate

    key = requests[0].key
    if any(r.key != key for r in requests):
        raise ValueError("requests: expected one sampling key per engine call, got several")
    ids, mask = batch_inputs(requests)
    out = generate(model, ids, mask, max_new_tokens=max(r.max_tokens for r in requests),
                   temperature=key.temperature, top_k=key.top_k, top_p=key.top_p, logprobs_topk=0,
                   eos_token_id=None if key.ignore_eos else eos_token_id, generator=generator,
                   **generate_kwargs)
    tokens, logp, lengths = out.tokens.tolist(), out.rollout_logp.tolist(), out.lengths.tolist()
    done = []
    for i, r in enumerate(requests):
        n = min(lengths[i], r.max_tokens)
        reason = out.finish_reason[i] if n == lengths[i] else "length"
        done.append(Completion(token_ids=tokens[i][:n], log_probs=logp[i][:n], finish_reason=reason))
    return done
