"""One verl request (``prompt_ids``, ``sampling_params``) as what the scheduler needs.

verl's agent loop sends ``temperature``, ``top_p``, ``top_k`` (-1 = off), ``repetition_penalty``
and ``logprobs`` (bool), and optionally ``max_tokens`` (or SGLang's ``max_new_tokens``),
``seed``, ``ignore_eos`` and ``stop_token_ids`` (verl's tool agent loop adds its tool parser's
stop tokens; they stop a request besides EOS, as in vLLM). Each request carries its own sampling into the running batch
(`sparsecorr.decoding.RequestParams`): requests with different parameters share steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparsecorr.decoding import RequestParams

__all__ = ["EngineRequest", "parse_request", "request_params"]

_KNOWN = frozenset({"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens",
                    "max_new_tokens", "seed", "ignore_eos", "stop_token_ids"})


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    """A validated request: ``prompt`` token ids, its per-request ``params`` (``max_tokens``
    clamped to the room left in ``max_model_len``), and whether the caller wants the
    log-probs back."""

    request_id: str
    prompt: tuple[int, ...]
    params: RequestParams
    logprobs: bool


def _number(name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"sampling_params.{name}: expected a finite number, got {value!r}")
    return float(value)


def request_params(params: Mapping[str, Any], *, max_tokens: int, eos_token_ids: tuple[int, ...] = ()) -> RequestParams:
    """verl's ``sampling_params`` (already checked for unknown keys) as `RequestParams`.

    ``stop_token_ids`` stop the request besides ``eos_token_ids`` (vLLM's meaning); with
    ``ignore_eos`` no token stops it (the scheduler's ``ignore_eos``: exactly ``max_tokens``).

    Raises:
        ValueError: naming the field (``sampling_params.<name>``): a temperature < 0, a top_k
            that is not an int, a top_p outside (0, 1], a repetition penalty other than 1, a
            seed that is not an int.
    """
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
    extra_stops = params.get("stop_token_ids")
    stops = None
    if extra_stops:
        if not isinstance(extra_stops, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in extra_stops):
            raise ValueError(f"sampling_params.stop_token_ids: expected a list of token ids, got {extra_stops!r}")
        stops = tuple(sorted({*eos_token_ids, *extra_stops}))
    try:
        return RequestParams(max_tokens=max_tokens, temperature=temperature,
                             top_k=top_k if top_k and top_k > 0 else None,
                             top_p=None if top_p >= 1.0 else top_p, seed=seed, stop_token_ids=stops,
                             ignore_eos=bool(params.get("ignore_eos", False)))
    except ValueError as exc:  # the scheduler's own check, named as verl's field
        raise ValueError(f"sampling_params.{exc}") from exc


def parse_request(request_id: str, prompt_ids: Sequence[int] | torch.Tensor, sampling_params: Mapping[str, Any],
                  *, max_model_len: int, default_max_tokens: int, vocab_size: int,
                  eos_token_ids: tuple[int, ...] = ()) -> EngineRequest:
    """Validate one request against the engine's capacity and make it an `EngineRequest`.

    ``max_tokens`` (default ``default_max_tokens``) is clamped to ``[1, max_model_len -
    len(prompt_ids)]``, as verl's vLLM server does. ``eos_token_ids``: the model's stop tokens
    (kept when a request adds ``stop_token_ids``).

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
    return EngineRequest(request_id=str(request_id), prompt=prompt,
                         params=request_params(sampling_params, max_tokens=max_tokens, eos_token_ids=eos_token_ids),
                         logprobs=bool(sampling_params.get("logprobs", False)))
