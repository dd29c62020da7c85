r"""The one seam between the decoding engine and Hugging Face ``transformers``.

Everything the engine needs from a model goes through this module, and each supported
transformers version is handled here and nowhere else. The other decoding modules call
`forward`, subclass `CacheBase`, read `model_spec` and enter `sparse_attention`; none of them
imports transformers.

| what the engine needs | transformers API wrapped here | verified |
|---|---|---|
| the cache object | a `transformers.cache_utils.Cache` subclass built with ``layers=[]``; the model calls ``update(key, value, layer_idx, cache_kwargs)`` (up to 5.23) or ``update(key, value, layer_idx, kwargs=...)`` (5.24) | 5.9.0 – 5.24.0 |
| the forward keyword | ``past_key_values=`` (up to 5.23), ``cache=`` (5.24, where the old name warns until 5.40): chosen from the forward's signature | 5.9.0 – 5.24.0 |
| the attention hook | ``AttentionInterface.register(name, fn)``, ``model.set_attn_implementation`` and ``config._attn_implementation``; ``fn(module, query, key, value, attention_mask, *, scaling, dropout, **kwargs)`` with ``module.layer_idx`` | 5.9.0 – 5.24.0 |
| positions | ``position_ids=`` ``[B, Q]``, true positions (RoPE after eviction) | 5.9.0 – 5.24.0 |
| config fields | ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``, ``vocab_size``; per attention module ``scaling``, ``sliding_window``, ``sinks``; ``attn_logit_softcapping`` | 5.9.0 – 5.24.0 |

`SUPPORTED` is the tested range (the ends are tested by ``make test-edges`` in CI). Its floor,
5.9.0, is what verl 0.9.1 pins: the engine's tests pass there (torch 2.11.0, ``make
test-lowest``), so the engine supports the stack instead of refusing it. Outside it,
`check_transformers` raises one `UnsupportedTransformersError` that names the installed and the
supported versions, before any model forward.

Attention variants the engine does not implement are refused up front by `model_spec` with a
``ValueError`` naming the setting (sliding windows, logit soft-capping, attention sinks), instead
of decoding with the wrong attention. A per-model attention ``scaling`` is supported.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = [
    "SUPPORTED",
    "TESTED",
    "CacheBase",
    "ModelSpec",
    "UnsupportedTransformersError",
    "cache_keyword",
    "check_transformers",
    "config_vocab_size",
    "eval_modules",
    "forward",
    "input_embeddings",
    "model_spec",
    "model_state",
    "register_attention",
    "sparse_attention",
]

#: the transformers versions sparsecorr's decoding supports (pyproject.toml and the Makefile's
#: TRANSFORMERS_RANGE say the same; tests/unit/test_versions.py checks they agree)
SUPPORTED = SpecifierSet(">=5.9,<6")
#: the versions CI has run the decoding tests on: the lowest supported and the lock's
TESTED = ("5.9.0", "5.24.0")


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is outside `SUPPORTED`."""


def check_transformers(version: str | None = None) -> str:
    """Return the installed transformers version, or raise if it is outside `SUPPORTED`.

    Raises:
        UnsupportedTransformersError: naming the installed version and the supported range.
    """
    version = transformers.__version__ if version is None else version
    if Version(version) not in SUPPORTED:
        raise UnsupportedTransformersError(
            f"sparsecorr's decoding supports transformers{SUPPORTED} (tested: {', '.join(TESTED)}); "
            f"transformers=={version} is installed. Install a supported version: "
            f"pip install 'transformers{SUPPORTED}'")
    return version


check_transformers()  # before the internals below are imported

from transformers import AttentionInterface  # noqa: E402
from transformers.cache_utils import Cache  # noqa: E402


class CacheBase(Cache):
    """A transformers ``Cache`` whose writes go to ``write(layer_idx, key, value)``.

    Subclasses implement ``write`` (returning the key/value the layer attends over) and
    ``seq_length``; this class takes every version's ``update`` call.
    """

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[])
        self.num_layers = num_layers

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def seq_length(self) -> int:
        raise NotImplementedError

    # 5.9-5.23: update(k, v, layer_idx, cache_kwargs); 5.24: update(k, v, layer_idx, kwargs=...)
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, **kwargs):
        return self.write(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length()

    def __len__(self) -> int:
        return self.num_layers


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """``cache`` where the class's forward takes it (5.24 on), else ``past_key_values`` (read
    once per model class: ``forward`` runs every decode step)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_keyword(model) -> str:
    """The forward's cache keyword for ``model`` (a peft wrapper: its base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_keyword(type(base))


def forward(model, *, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Cache,
            logits_to_keep: int | torch.Tensor = 0, output_hidden_states: bool = False):
    """One model forward over ``input_ids`` ``[B, Q]`` at ``position_ids`` ``[B, Q]`` into ``cache``
    (a peft wrapper passes the keyword through, so the model it wraps picks it)."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                 logits_to_keep=logits_to_keep, output_hidden_states=output_hidden_states,
                 **{cache_keyword(model): cache})


def register_attention(name: str, attend: Callable[..., torch.Tensor]) -> None:
    """Register ``attend(layer, query, key, value, scaling)`` as the attention called ``name``.

    ``attend`` gets the layer index, ``query`` ``[B, Hq, Q, D]``, the ``key`` / ``value`` that the
    cache's ``write`` returned ``[B, Hkv, S, D]`` and the layer's softmax scale, and returns
    ``[B, Hq, Q, D]``; the model's own mask is not used (the engine masks).
    """

    def hook(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = attend(module.layer_idx, query, key, value, scale)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, hook)


@contextlib.contextmanager
def sparse_attention(model, name: str) -> Iterator[None]:
    """Route the model's attention to the implementation ``name`` for the block, then restore it."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def input_embeddings(model) -> torch.nn.Module:
    """The model's input embedding module (a peft wrapper: its base model's), called with its
    forward hooks (a trainer's ``enable_input_require_grads`` hook, a dtype cast)."""
    return model.get_input_embeddings()


@contextlib.contextmanager
def eval_modules(model) -> Iterator[None]:
    """Every module of ``model`` in eval mode inside the block; each module's own ``training``
    flag restored after it, also when the block raises.

    In train mode a transformers 5.9 decoder layer with gradient checkpointing on drops the cache
    it is given (``GradientCheckpointingLayer``: "Caching is incompatible with gradient
    checkpointing"; 5.24 keeps it when gradients are off), so the engine's pool would not be
    written; in eval mode checkpointing is inactive (its flags untouched) and the layers run as
    at inference, on every supported version. The engine's attention has no dropout, so for the
    supported architectures eval mode changes nothing else.
    """
    modes = [(m, m.training) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, flag in modes:
            m.training = flag


def model_state(model) -> tuple:
    """What a compiled forward of ``model`` depends on beyond its weights' values, as a hashable
    key: the class, the parameters' dtype and device, the ids of every module's forward hooks
    and pre-hooks (a hook added or removed changes it) and the gradient-checkpointing flags."""
    param = next(model.parameters())
    modules = list(model.modules())
    hooks = tuple(sorted(k for m in modules for d in (m._forward_hooks, m._forward_pre_hooks) for k in d))
    checkpointing = tuple(bool(m.gradient_checkpointing) for m in modules if hasattr(m, "gradient_checkpointing"))
    return type(model), param.dtype, param.device, hooks, checkpointing


@dataclass(frozen=True)
class ModelSpec:
    """What the engine reads of a model's config and attention modules."""

    layers: int
    heads_q: int
    heads_kv: int
    head_dim: int
    hidden_size: int
    scaling: float  # softmax scale of every attention layer (head_dim ** -0.5 for Qwen3 / Llama)


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]


def _refuse(setting: str, detail: str) -> None:
    raise ValueError(
        f"model: {setting} is not supported by sparsecorr's decoding ({detail}); supported are "
        "full causal attention with one softmax scale (Qwen3, Llama and alike)")


def model_spec(model) -> ModelSpec:
    """The config fields the engine needs, after refusing attention it would compute wrongly.

    Raises:
        ValueError: naming ``sliding_window``, ``attn_logit_softcapping``, ``sinks`` or
            ``scaling`` (one scale per layer differing between layers) when the model uses it.
    """
    cfg = model.config
    heads = cfg.num_attention_heads
    modules = _attention_modules(model)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        _refuse("attn_logit_softcapping", f"attention logits are soft-capped at {softcap}")
    if any(getattr(m, "sinks", None) is not None for m in modules):
        _refuse("sinks", "attention has learned sink logits")
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    windows = {getattr(m, "sliding_window", None) for m in modules} - {None}
    if getattr(cfg, "use_sliding_window", True):  # Qwen2 / Qwen3 keep a window they do not use
        windows |= {getattr(cfg, "sliding_window", None)} - {None}
    if windows or "sliding_attention" in layer_types:
        _refuse("sliding_window", f"layers attend over a sliding window of {sorted(windows) or cfg.sliding_window}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scales = {float(m.scaling) for m in modules} or {head_dim ** -0.5}
    if len(scales) > 1:
        _refuse("scaling", f"layers use different softmax scales {sorted(scales)}")
    return ModelSpec(layers=cfg.num_hidden_layers, heads_q=heads,
                     heads_kv=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
                     hidden_size=cfg.hidden_size, scaling=scales.pop())


def config_vocab_size(model) -> int:
    """The vocabulary size the config declares."""
    return int(model.config.vocab_size)
