r"""The fused decode step: the captured step's model forward through ``torch.compile``.

A Qwen3 decode step in eager mode launches about 53 kernels per layer that are HF's own
(RMSNorm x4 = 32, rotary 10, GEMMs 7, SiLU·mul and residual adds 4, in an H100 profile),
and inside a CUDA graph each still costs ~2.5 µs. With ``fused`` on, the CUDA-graph
step (`sparsecorr.decoding.graphs`) runs the model's forward as compiled by inductor, so those
elementwise chains become a few generated kernels per layer; the GEMMs stay extern (cuBLAS /
mkldnn) calls.

What is compiled and what is not:

- **Compiled**: HF's forward from the input embeddings to the last position's logits (norms,
  rotary, projections, MLP, residuals, the final norm and the LM head), traced by dynamo with
  ``fullgraph=True`` and lowered by inductor **without** inductor's CUDA graphs
  (``triton.cudagraphs = False``): our `CudaGraphRunner` captures the compiled code as it
  captures the eager step.
- **Opaque**: the attention. The ``"sparsecorr"`` attention hook, when traced, calls the custom
  op ``sparsecorr::attend(query, key, value, layer, scaling)`` (`attend`), which dynamo and
  inductor do not look into: at run time it writes the layer's K/V into the pool and attends over
  the active cache exactly as the eager step does (``SparseKVCache.write`` then ``attend``). The
  cache the compiled forward sees is `PASS_CACHE`, which hands K/V through untouched and has a
  constant length, so no guard depends on the pool, the step or any per-step Python value.
- **Eager, inside the captured step**: the input embedding lookup (with its forward hooks), the
  step's mask and BlockTopK's selection plan (built before the compiled call, as in the unfused
  step), and the sampling after it (the model runner's step is the forward and the sampling:
  `sparsecorr.decoding.graphs._graph_step`); everything outside the captured step (compression,
  FlashInfer's ``plan``) stays eager too.

**Training hooks.** The model a trainer trains carries hooks on its input embeddings:
transformers' ``enable_input_require_grads`` (installed by TRL and peft with gradient
checkpointing) calls ``output.requires_grad_(True)``, which dynamo in torch 2.11 cannot trace
(``Unsupported Tensor.requires_grad_() call``); TRL may add a dtype cast there. The embedding
therefore runs eagerly, hooks included, and the compiled forward starts from its output
(``inputs_embeds``): nothing of the model is changed or has to be restored. Gradient
checkpointing is inactive because ``generate`` runs the model in eval mode
(`sparsecorr.decoding.hf.eval_modules`); a peft model is compiled through its wrapper.

When: the compiled function is made once per process (dynamo keeps its code per Python code
object); it compiles on the first call, which is the first captured step's warm-up (on the
capture stream), with the batch dimension marked dynamic, so one compile serves every batch
bucket above 1 (dynamo specialises a batch of 1: a second compile when the batch shrinks to 1).
A later ``generate`` with the same model reuses it. ``RolloutBatch.meta["fused"]`` says ``"on"``,
``"off"``, ``"failed: <error>"`` or ``"unused"`` (asked for, but no decode step was captured).

**A failed attempt** (compiling, or capturing the compiled code) costs one attempt per model
state and holds nothing: the engine warns once and runs the unfused step; the failure is
remembered for the model in its state (`fused_status`, `remember_failure`; the state is
`sparsecorr.decoding.hf.model_state`), so a later call with the same model and state runs the
unfused step at once and reports the same ``"failed: <error>"`` without a new warning; the
exception is not kept and its frames are cleared (`release`), since dynamo's ``Unsupported`` is
kept by a frame of its own traceback, a cycle through the frames that hold the call's KV pool.
"""

from __future__ import annotations

import sys
import traceback
import warnings
import weakref

import torch

from .cache import active
from .hf import CacheBase, cache_keyword, input_embeddings, model_state

__all__ = ["COMPILE_OPTIONS", "PASS_CACHE", "attend", "capture_fused", "compiled_forward", "decode_forward",
           "describe", "fused_forward", "fused_status", "release", "remember_failure"]

#: inductor without its own CUDA graphs (ours capture the compiled code)
COMPILE_OPTIONS = {"triton.cudagraphs": False}


@torch.library.custom_op("sparsecorr::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write one layer's K/V into the active cache's pool (a sliding layer: its ring) and attend
    (opaque to the compiler).

    The pool, the step and the policy state it reads and writes are not arguments: they belong
    to the active cache (`sparsecorr.decoding.cache.active_cache`), as in the eager hook. The
    layer's learned sinks (GPT-OSS) are an argument: the module's parameter, read at run time.

    Shapes:
        query ``[B, Hq, Q, D]``; key, value ``[B, Hkv, Q, D]`` (this step's, after rotary);
        sinks ``[Hq]`` or None -> ``[B, Hq, Q, D]`` (contiguous).
    """
    cache = active()
    k, v = cache.write(layer, key, value)
    out = cache.attend(layer, query, k, v, scaling) if sinks is None else \
        cache.attend(layer, query, k, v, scaling, sinks=sinks)
    return out.contiguous()


@attend.register_fake
def _attend_fake(query, key, value, layer, scaling, sinks=None):
    return query.new_empty(query.shape)


class _PassCache(CacheBase):
    """The cache the compiled forward sees: hands each layer's K/V to the attention unchanged
    (the custom op does the write) and has a constant length (no per-step guard)."""

    def write(self, layer_idx, key, value):
        return key, value

    def seq_length(self) -> int:
        return 0


#: one instance for every call (dynamo guards on what it reads of it: nothing that changes)
PASS_CACHE = _PassCache(0)


def decode_forward(model, embeds: torch.Tensor, positions: torch.Tensor, cache: dict) -> torch.Tensor:
    """The last position's logits of one forward of the input embeddings ``embeds`` at
    ``positions`` (what is compiled; ``cache``: ``{keyword: PASS_CACHE}``, the keyword resolved
    outside, `hf.cache_keyword`).

    Shapes:
        embeds ``[B, 1, H]``, positions ``[B, 1]`` -> ``[B, V]``.
    """
    return model(inputs_embeds=embeds, position_ids=positions, use_cache=True, logits_to_keep=1, **cache).logits[:, -1]


_COMPILED = None


def compiled_forward():
    """``torch.compile(decode_forward)`` (inductor, full graph, no inductor CUDA graphs), made once."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(decode_forward, backend="inductor", fullgraph=True, dynamic=False,
                                  options=COMPILE_OPTIONS)
    return _COMPILED


#: compiled variants kept per process (dynamo's default, 8, counts every model shape and the
#: batch-1 specialisation together; past it a fullgraph compile raises and the step runs unfused)
RECOMPILE_LIMIT = 64


def fused_forward(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`decode_forward` compiled, for the active cache (its batch dimension dynamic). The input
    embedding runs eagerly first, with its forward hooks (a trainer's, see the module's
    *Training hooks*), and the compiled forward starts from its output.

    Shapes:
        ids, positions ``[B, 1]`` -> ``[B, V]``.
    """
    embeds = input_embeddings(model)(ids)
    torch._dynamo.maybe_mark_dynamic(embeds, 0)
    torch._dynamo.maybe_mark_dynamic(positions, 0)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return compiled_forward()(model, embeds, positions, {cache_keyword(model): PASS_CACHE})


def release(exc: BaseException, *, outer: BaseException | None = None) -> None:
    """Break the reference cycles ``exc`` may close through its frames, so what those frames
    hold (the step's pool, cache and runner) is freed by reference counting, without Python's
    cycle collector: dynamo's ``Unsupported`` is kept as a local of a frame of its own traceback
    (``torch._dynamo.eval_frame``'s ``compile_wrapper`` re-raises it), a cycle through every
    frame below it. Clears the frames of ``exc``'s traceback and of every exception chained to
    it (``__cause__``, ``__context__``) and drops the tracebacks; frames still running (the
    caller's) are left alone, and so is ``outer`` (the exception the caller was handling when
    the attempt began, ``sys.exc_info()[1]``: the chain's own context, not ours to clear) and
    what it chains to. For an exception that is handled, not re-raised."""
    todo, seen = [exc], {id(outer)}
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def describe(exc: BaseException) -> str:
    """``"<type>: <first line of the message, at most 200 characters>"``."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


#: fused-step failures per model: {model: {hf.model_state(model): "failed: <error>"}}
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused_status(model) -> str:
    """``"on"``, or the ``"failed: <error>"`` a fused attempt met for ``model`` in its current
    state (`hf.model_state`: dtype, device, hooks, gradient checkpointing), so a later call runs
    the unfused step at once instead of paying the failed compile again."""
    return _FAILED.get(model, {}).get(model_state(model), "on")


def remember_failure(model, status: str) -> None:
    """Record ``status`` (``"failed: ..."``) for ``model`` in its current state (see
    `fused_status`); the record goes with the model."""
    _FAILED.setdefault(model, {})[model_state(model)] = status


def capture_fused(make, *, fused: str):
    """``(make(True), "on")`` when ``fused`` is ``"on"`` and the fused step compiles and captures;
    otherwise ``(make(False), fused)``, after one ``RuntimeWarning`` and with ``fused`` =
    ``"failed: <error>"`` when the fused attempt raised (the runners undo a warm-up step's
    writes even when it raises part way, so the unfused capture starts from the same state).
    The failed attempt's exception is `release`d and not kept: nothing of the attempt outlives
    this call."""
    if fused == "on":
        outer = sys.exc_info()[1]
        try:
            return make(True), "on"
        except Exception as exc:
            fused = f"failed: {describe(exc)}"
            release(exc, outer=outer)
        warnings.warn(f"fused: compiling or capturing the fused decode step failed, running it unfused ({fused[8:]})",
                      RuntimeWarning, stacklevel=3)
    return make(False), fused
