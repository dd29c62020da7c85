"""One OpenRLHF ``generate(prompt_token_ids, sampling_params)`` as a scheduler request, and its
result in the shape OpenRLHF's executors read.

OpenRLHF 0.11.2's ``SamplesGenerator._dispatch_prompts_to_vllm``
(``openrlhf/trainer/ppo_utils/samples_generator.py``) builds one vLLM ``SamplingParams`` with
``temperature``, ``top_p``, ``top_k`` (-1 = off), ``max_tokens`` (None: the executor fills it),
``min_tokens`` (default 1), ``skip_special_tokens`` and ``logprobs`` (1 when a rollout
correction is on, else None); its executors (``openrlhf/utils/agent.py``) deep-copy it and
set ``max_tokens``. `parse_sampling` reads those and the other vLLM fields a user's executor
may set (``seed``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``), and
refuses, by name, every field the sparse sampler cannot honour (penalties, ``min_p``, stop
strings, ``n > 1``, logit processors, prompt log-probs, structured outputs...).

``min_tokens``: vLLM masks the stop tokens until ``min_tokens`` tokens are out. The sparse
sampler has no such mask; ``min_tokens <= 1`` (OpenRLHF's default, 1) is accepted and not
enforced (a response may be one stop token; its log-prob is recorded as sampled, so the
correction stays exact), a larger one is refused.

The result (`ActorOutput`) mirrors vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``
(``vllm/outputs.py``, ``vllm/logprobs.py``): ``outputs[0].token_ids`` (a list, the stop token
included as vLLM does), ``.text``, ``.finish_reason`` (``stop`` | ``length`` | ``abort``) and
``.logprobs``, one ``{token_id: Logprob}`` per token holding the sampled token with the sparse
sampler's log-prob and the top-``logprobs`` tokens.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparsecorr.decoding import RequestOutput, RequestParams

__all__ = ["ActorOutput", "ActorRequest", "CompletionOutput", "Logprob", "as_output", "parse_sampling"]

#: vLLM ``SamplingParams`` fields the sparse sampler cannot honour, with the value that means "off"
_OFF: dict[str, Any] = {
    "n": 1, "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "stop": None, "bad_words": None, "logits_processors": None, "prompt_logprobs": None,
    "logit_bias": None, "allowed_token_ids": None, "guided_decoding": None, "structured_outputs": None,
    "truncate_prompt_tokens": None,
}
_FINISH = {"eos": "stop", "length": "length", "aborted": "abort"}  # scheduler -> vLLM
_WARNED: set[str] = set()
logger = logging.getLogger("sparsecorr_openrlhf")


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's ``Logprob``: a token's log-prob, its rank (None when not among the top-k), and its
    decoded text (None: not decoded)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """vLLM's ``CompletionOutput`` (the fields its executors and users read)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | None = None


@dataclass(slots=True)
class ActorOutput:
    """vLLM's ``RequestOutput`` of one finished request."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorRequest:
    """A validated request (what ``sparsecorr.decoding.EngineDriver.submit`` takes) and what the
    answer needs: the number of top log-probs (None: no log-probs) and the detokenizer flag."""

    request_id: str
    prompt: tuple[int, ...]
    params: RequestParams
    logprobs: int | None
    skip_special_tokens: bool = True
    detokenize: bool = True


def _get(sp: Any, name: str, default: Any = None) -> Any:
    if isinstance(sp, Mapping):
        return sp.get(name, default)
    return getattr(sp, name, default)


def _refused(name: str, value: Any, off: Any) -> bool:
    if value is None or value == off or (name == "best_of" and value == 1):
        return False
    if isinstance(value, (list, tuple, dict, set)) and not value:
        return False
    return not (isinstance(value, float) and isinstance(off, float) and math.isclose(value, off))


def parse_sampling(request_id: str, prompt_token_ids: Sequence[int], sampling_params: Any, *, max_model_len: int,
                   vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> ActorRequest:
    """A vLLM ``SamplingParams`` (or a mapping of its fields) and a prompt as an `ActorRequest`.

    ``max_tokens`` None (vLLM's "until the context is full" under OpenRLHF's dynamic length)
    becomes ``max_model_len - len(prompt)``; a larger one is clamped to it (a row never holds
    more than ``max_model_len`` tokens). ``stop_token_ids`` stop a request besides EOS (vLLM's
    meaning); ``ignore_eos`` decodes exactly ``max_tokens``.

    Raises:
        ValueError: naming the field: an empty or over-long prompt, a token id outside the
            vocabulary, a field the sparse sampler cannot honour, a bad value.
    """
    prompt = tuple(int(t) for t in prompt_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids: expected at least one token, got none")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt_token_ids: expected at most {max_model_len - 1} tokens (max_model_len="
                         f"{max_model_len} leaves room for one new token), got {len(prompt)}")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids: expected token ids in [0, {vocab_size}), got {bad[:5]}")
    for name, off in _OFF.items():
        value = _get(sampling_params, name, off)
        if _refused(name, value, off):
            raise ValueError(f"sampling_params.{name}: the sparse sampler cannot honour it, expected {off!r}, "
                             f"got {value!r}")
    min_tokens = _get(sampling_params, "min_tokens", 0) or 0
    if min_tokens > 1:
        raise ValueError(f"sampling_params.min_tokens: the sparse sampler does not mask stop tokens, expected "
                         f"0 or 1, got {min_tokens!r}")
    if min_tokens == 1 and "min_tokens" not in _WARNED:
        _WARNED.add("min_tokens")
        logger.warning("sampling_params.min_tokens=1: the sparse sampler does not mask stop tokens, so a "
                       "response may be one stop token (its log-prob is recorded as sampled); warned once")
    room = max_model_len - len(prompt)
    max_tokens = _get(sampling_params, "max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"sampling_params.max_tokens: expected None or an int >= 1, got {max_tokens!r}")
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    top_k = _get(sampling_params, "top_k", 0)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise ValueError(f"sampling_params.top_k: expected an int (-1 or 0 = off), got {top_k!r}")
    top_p = _get(sampling_params, "top_p", 1.0)
    logprobs = _get(sampling_params, "logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < -1):
        raise ValueError(f"sampling_params.logprobs: expected None or an int >= 0, got {logprobs!r}")
    if logprobs == -1:  # vLLM: the whole vocabulary
        logprobs = vocab_size
    extra = _get(sampling_params, "stop_token_ids") or ()
    if not isinstance(extra, (list, tuple, set)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in extra):
        raise ValueError(f"sampling_params.stop_token_ids: expected a list of token ids, got {extra!r}")
    stops = tuple(sorted({*eos_token_ids, *extra})) if extra else None
    try:
        params = RequestParams(max_tokens=max_tokens, temperature=float(_get(sampling_params, "temperature", 1.0)),
                               top_k=top_k if top_k and top_k > 0 else None,
                               top_p=None if top_p is None or top_p >= 1.0 else float(top_p),
                               logprobs=logprobs or 0, seed=_get(sampling_params, "seed"), stop_token_ids=stops,
                               ignore_eos=bool(_get(sampling_params, "ignore_eos", False)))
    except (TypeError, ValueError) as exc:  # the scheduler's own check, named as vLLM's field
        raise ValueError(f"sampling_params.{exc}") from None
    return ActorRequest(request_id=str(request_id), prompt=prompt, params=params, logprobs=logprobs,
                        skip_special_tokens=bool(_get(sampling_params, "skip_special_tokens", True)),
                        detokenize=bool(_get(sampling_params, "detokenize", True)))


def as_output(request: ActorRequest, out: RequestOutput, *, tokenizer: Any = None) -> ActorOutput:
    """The scheduler's `RequestOutput` as vLLM's ``RequestOutput`` (see the module docstring).

    Raises:
        RuntimeError: the engine step that decoded this request failed (only its rows fail).
    """
    if out.finish_reason == "error":
        raise RuntimeError(f"request {request.request_id!r}: the sparse engine's step failed: {out.error!r}") \
            from out.error
    tokens = [int(t) for t in out.token_ids]
    lps = out.logprobs.tolist()
    per_token = None
    if request.logprobs is not None:
        per_token = []
        k = 0 if out.topk_ids is None else min(request.logprobs, out.topk_ids.shape[1])
        top_ids = out.topk_ids[:, :k].tolist() if k else [[] for _ in tokens]
        top_lps = out.topk_logp[:, :k].tolist() if k else [[] for _ in tokens]
        for tok, lp, ids, vals in zip(tokens, lps, top_ids, top_lps, strict=True):
            entry = {int(i): Logprob(logprob=float(v), rank=r + 1) for r, (i, v) in enumerate(zip(ids, vals))}
            rank = entry[tok].rank if tok in entry else None
            entry[tok] = Logprob(logprob=float(lp), rank=rank)  # the sampler's own log-prob of the sampled token
            per_token.append(entry)
    text = ""
    if tokenizer is not None and tokens and request.detokenize:
        text = tokenizer.decode(tokens, skip_special_tokens=request.skip_special_tokens)
    reason = _FINISH[out.finish_reason]
    stop = tokens[-1] if reason == "stop" and tokens and tokens[-1] in (request.params.stop_token_ids or ()) else None
    done = CompletionOutput(index=0, text=text, token_ids=tokens, cumulative_logprob=float(sum(lps)) if lps else 0.0,
                            logprobs=per_token, finish_reason=reason, stop_reason=stop)
    return ActorOutput(request_id=request.request_id, prompt_token_ids=list(request.prompt), outputs=[done])
