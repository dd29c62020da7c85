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

`model_spec` reads each layer's attention kind (full, or a sliding window: `ModelSpec.sliding`),
the logit soft cap and whether the modules carry learned sinks. What the engine does not
implement is refused up front with a ``ValueError`` naming the feature and the family (MLA's
latent KV, linear-attention / state-space layers, cross-attention, per-layer softmax scales),
instead of decoding with the wrong attention. A per-model attention ``scaling`` is supported.
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
    "attention_modules",
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
    ``[B, Hq, Q, D]``; the model's own mask is not used (the engine masks). A module with learned
    sinks (GPT-OSS's ``sinks`` parameter ``[Hq]``, natural-log logits) passes them as
    ``sinks=``, read from the module at every call (training updates them in place); a module
    without them calls ``attend`` with the five arguments only.
    """

    def hook(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        sinks = getattr(module, "sinks", None)
        out = attend(module.layer_idx, query, key, value, scale) if sinks is None else \
            attend(module.layer_idx, query, key, value, scale, sinks=sinks)
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


FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True)
class ModelSpec:
    """What the engine reads of a model's config and attention modules.

    ``sliding`` lists the layers that attend over a sliding window of ``window`` positions (the
    query's own included: HF's ``sliding_window_overlay`` keeps ``kv_idx > q_idx - window``,
    ``transformers/masking_utils.py``, identical in 5.9.0 and 5.24.0); every other layer is full
    causal attention. ``softcap``: the attention-logit soft cap (``cap · tanh(logits / cap)``,
    Gemma 2's ``attn_logit_softcapping``) or None; ``sinks``: the attention modules carry learned
    per-head sink logits (GPT-OSS's ``sinks`` parameter), read from the module at every call.
    """

    layers: int
    heads_q: int
    heads_kv: int
    head_dim: int
    hidden_size: int
    scaling: float  # softmax scale of every attention layer (head_dim ** -0.5 for Qwen3 / Llama)
    sliding: tuple[int, ...] = ()
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    @property
    def full(self) -> tuple[int, ...]:
        """The full-attention layers, ascending."""
        return tuple(i for i in range(self.layers) if i not in self.sliding)

    @property
    def layer_kinds(self) -> tuple[tuple[str, int | None], ...]:
        """``(kind, window)`` per layer: ``("full", None)`` or ``("sliding", window)``."""
        return tuple((SLIDING, self.window) if i in self.sliding else (FULL, None) for i in range(self.layers))


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """The self-attention module of each layer, by ``layer_idx`` (the engine reads a module's
    learned ``sinks`` at call time: training updates them in place)."""
    return {int(m.layer_idx): m for m in _attention_modules(model)}


_SUPPORTED = "full causal attention with one softmax scale, sliding-window layers, attention sinks and logit soft-capping"


def _refuse(setting: str, detail: str) -> None:
    raise ValueError(f"model: {setting} is not supported by sparsecorr's decoding ({detail}); supported are "
                     f"{_SUPPORTED} (Llama, Qwen, Mistral, Gemma, GPT-OSS and alike)")


#: attention-like layer types of ``config.layer_types`` the engine does not serve, by what they are
_FOREIGN_LAYERS = {"linear_attention": "linear-attention / state-space layers",
                   "mamba": "linear-attention / state-space layers",
                   "chunked_attention": "chunked attention layers", "conv": "convolution layers"}
#: module class names of layers without a softmax over a KV cache (gated DeltaNet, Mamba, ...)
_STATE_SPACE = ("Mamba", "DeltaNet", "LinearAttention", "Lightning", "Ssm", "SSM", "Rwkv", "RWKV")


def _family(cfg) -> str:
    return getattr(cfg, "model_type", None) or type(cfg).__name__


def _refuse_structure(model, cfg) -> None:
    """Refuse, before any forward, what has no per-layer softmax over a K/V cache of this shape:
    MLA's latent KV, linear-attention / state-space layers and cross-attention."""
    family = _family(cfg)
    if getattr(cfg, "kv_lora_rank", None) is not None:
        _refuse("multi-head latent attention (kv_lora_rank)",
                f"{family} caches a compressed latent KV of rank {cfg.kv_lora_rank}, not per-head keys and values")
    kinds = set(getattr(cfg, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        what = ", ".join(sorted({_FOREIGN_LAYERS.get(k, f"{k!r} layers") for k in kinds}))
        ssm = sorted({type(m).__name__ for m in model.modules() if any(t in type(m).__name__ for t in _STATE_SPACE)})
        _refuse(what, f"{family}'s config.layer_types lists {sorted(kinds)}" + (f": {', '.join(ssm)}" if ssm else ""))
    names = {type(m).__name__ for m in model.modules()}
    ssm = sorted(n for n in names if any(t in n for t in _STATE_SPACE))
    if ssm:
        _refuse("linear-attention / state-space layers", f"{family} has {', '.join(ssm)}")
    cross = sorted(n for n in names if "CrossAttention" in n)
    if cross or getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "cross_attention_layers", None):
        _refuse("cross-attention", f"{family} attends to an encoder or image states ({', '.join(cross) or 'config'})")


def _sliding_layers(cfg, modules: list[torch.nn.Module]) -> tuple[tuple[int, ...], int | None]:
    """The sliding-window layers and their window, from the conventions of transformers 5.9 –
    5.24: ``config.layer_types`` (``"sliding_attention"``; Gemma 2/3, GPT-OSS, EXAONE 4, Qwen2 /
    Qwen3 with ``use_sliding_window``: layers from ``max_window_layers`` on); without it,
    ``sliding_window_pattern`` (every ``pattern``-th layer full) or a ``sliding_window`` on the
    config (Mistral: every layer slides) unless ``use_sliding_window`` is False. A module's own
    ``sliding_window`` is not used to decide (EXAONE 4 sets it on its full layers too)."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        sliding = tuple(i for i, t in enumerate(types[:n]) if t == "sliding_attention")
    elif window is None or not getattr(cfg, "use_sliding_window", True):
        sliding = ()
    elif getattr(cfg, "sliding_window_pattern", None):
        pattern = int(cfg.sliding_window_pattern)
        sliding = tuple(i for i in range(n) if (i + 1) % pattern)
    else:
        sliding = tuple(range(n))
    if not sliding:
        return (), None
    windows = {getattr(m, "sliding_window", None) for m in modules if int(m.layer_idx) in sliding} - {None}
    windows |= {window} - {None}
    if len(windows) != 1:
        _refuse("sliding_window", f"sliding layers with windows {sorted(windows) or 'unset'}: one window expected")
    window = windows.pop()
    if not isinstance(window, int) or window < 1:
        _refuse("sliding_window", f"window {window!r}: expected an int >= 1")
    return sliding, window


def model_spec(model) -> ModelSpec:
    """The config fields the engine needs, after refusing attention it would compute wrongly.

    Raises:
        ValueError: before any forward, naming the feature and the family: multi-head latent
            attention (``kv_lora_rank``: DeepSeek-V2/V3), ``layer_types`` other than full and
            sliding attention (Qwen3-Next's ``linear_attention``), linear-attention / state-space
            modules (gated DeltaNet, Mamba), cross-attention (mllama, encoder-decoder models),
            sliding layers with different windows, or ``scaling`` differing between layers.
    """
    cfg = model.config
    _refuse_structure(model, cfg)
    heads = cfg.num_attention_heads
    modules = _attention_modules(model)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    sinks = any(getattr(m, "sinks", None) is not None for m in modules)
    sliding, window = _sliding_layers(cfg, modules)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scales = {float(m.scaling) for m in modules} or {head_dim ** -0.5}
    if len(scales) > 1:
        _refuse("scaling", f"{_family(cfg)} layers use different softmax scales {sorted(scales)}")
    return ModelSpec(layers=cfg.num_hidden_layers, heads_q=heads,
                     heads_kv=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
                     hidden_size=cfg.hidden_size, scaling=scales.pop(), sliding=sliding, window=window,
                     softcap=None if softcap is None else float(softcap), sinks=sinks)


def config_vocab_size(model) -> int:
    """The vocabulary size the config declares."""
    return int(model.config.vocab_size)
