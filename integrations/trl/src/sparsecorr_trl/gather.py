"""The policy as the sparse sampler reads it: full parameters and no training hooks, for one
whole rollout.

`rollout_model` is the context ``SparseGRPOTrainer`` generates in. It gathers the sharded
parameters **once per rollout**, around the whole ``generate`` call, and hands the sampler the
unwrapped model with plain, full tensors that stay put for every prefill and decode step (the
CUDA graphs and the fused step capture them):

- DeepSpeed ZeRO-3: ``deepspeed.zero.GatheredParameters`` over every parameter, with ZeRO-3's
  forward hooks removed while it is open, exactly as TRL's own generation does
  (``trl.models.utils.unwrap_model_for_generation`` with ``ds3_gather_for_generation=True``).
- FSDP v1: ``FullyShardedDataParallel.summon_full_params`` over the whole tree (``recurse=True``,
  no write-back), and each inner ``FullyShardedDataParallel`` unit forwards straight to its
  wrapped module, so no unit all-gathers or frees its parameters per forward. (TRL summons the
  root unit only, ``recurse=False``, and lets the inner units gather at every forward.)
- FSDP v2 (``fully_shard``): ``FSDPModule.unshard()`` on every FSDP module, their forward hooks
  set aside while the rollout runs (otherwise each module's pre- and post-forward hooks would run,
  and, with ``reshard_after_forward``, free and all-gather every layer at every decode step), then
  the hooks put back in place and ``reshard()``.

`training_hooks_off` is the other half, as TRL's ``disable_gradient_checkpointing``: gradient
checkpointing is switched off and the input embeddings' require-grads forward hooks
(transformers' ``enable_input_require_grads``, PEFT's) are set aside for the rollout, then the
same flags and hook objects are put back (re-enabling through ``gradient_checkpointing_enable``,
as TRL does, would register one more hook per rollout and leave the old ones in place).
Dynamo cannot trace the hook's ``requires_grad_()`` on every torch in range, and a rollout under
``torch.no_grad()`` needs neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["full_parameters", "rollout_model", "training_hooks_off"]


def _input_grad_hooks(model: nn.Module) -> list[tuple[dict, int]]:
    """``(hook dict, key)`` of every forward hook that makes an input embedding's output require
    grad: transformers' ``enable_input_require_grads`` and PEFT's (each call of the former
    registers one more and forgets the last, so a prepared model may carry several)."""
    found = []
    for m in model.modules():
        embed = m.get_input_embeddings() if hasattr(m, "get_input_embeddings") else None
        if isinstance(embed, nn.Module):
            found += [(embed._forward_hooks, k) for k, hook in embed._forward_hooks.items()
                      if "require_grad" in getattr(hook, "__qualname__", "")]
    return list({(id(d), k): (d, k) for d, k in found}.values())


@contextlib.contextmanager
def training_hooks_off(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` without gradient checkpointing and without input-require-grads hooks; the same
    flags and the same hook objects come back, in their places, on exit whatever happens."""
    checkpointed = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in checkpointed:
        m.gradient_checkpointing = False
    try:
        with _hooks_set_aside(_input_grad_hooks(model)):
            yield model
    finally:
        for m in checkpointed:
            m.gradient_checkpointing = True


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _handle_keys(handle) -> list[tuple[dict, int]]:
    """``(hook dict, key)`` behind one FSDP2 hook handle (a group's is a multi-handle)."""
    handles = list(getattr(handle, "handles", (handle,)))
    return [(h.hooks_dict_ref(), h.id) for h in handles if h.hooks_dict_ref() is not None]


@contextlib.contextmanager
def _hooks_set_aside(keys: list[tuple[dict, int]]) -> Iterator[None]:
    """Take the hooks at ``keys`` out of their modules' hook dicts, and put them back at the same
    place in the order on exit (hooks registered meanwhile stay, after them)."""
    taken = []
    for hooks, key in keys:
        if key in hooks:
            taken.append((hooks, list(hooks), key, hooks.pop(key)))
    try:
        yield
    finally:
        for hooks, order, key, hook in reversed(taken):
            hooks[key] = hook
            for k in [k for k in order if k in hooks] + [k for k in list(hooks) if k not in order]:
                hooks.move_to_end(k)


@contextlib.contextmanager
def _fsdp2_unsharded(model: nn.Module, modules: list[nn.Module]) -> Iterator[None]:
    states = [m._get_fsdp_state() for m in modules]
    if modules[0] is model and states[0]._is_root is None:
        # before the first forward FSDP's root lazy init (shared state, streams) has not run,
        # and unshard needs it; the first training forward finds it done, as after any forward
        states[0]._lazy_init()
    hooks = [k for s in states for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle")
             for k in _handle_keys(getattr(s, name))]
    unsharded = []
    try:
        for m in modules:
            m.unshard()
            unsharded.append(m)
        with _hooks_set_aside(hooks):
            yield
    finally:
        for m in unsharded:
            m.reshard()


@contextlib.contextmanager
def _fsdp1_summoned(wrapped: nn.Module) -> Iterator[None]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = [m for m in wrapped.modules() if isinstance(m, FSDP)]
    with FSDP.summon_full_params(wrapped, recurse=True, writeback=False):
        for unit in units:  # forward straight to the wrapped module: no per-forward gather
            unit.forward = unit._fsdp_wrapped_module.__call__
        try:
            yield
        finally:
            for unit in units:
                del unit.forward


@contextlib.contextmanager
def full_parameters(wrapped: nn.Module, accelerator, *, gather_zero3: bool = True
                    ) -> Iterator[nn.Module]:
    """The unwrapped model with every parameter full and local for the whole block.

    Args:
        wrapped: the trainer's ``model_wrapped`` (the DeepSpeed engine, the FSDP v1 root, or the
            model itself under FSDP v2 and without sharding).
        accelerator: the trainer's ``accelerate.Accelerator``.
        gather_zero3: TRL's ``ds3_gather_for_generation``; ``False`` under ZeRO-3 is refused
            (``sparsecorr_trl.options``) and raises here.

    Raises:
        ValueError: ZeRO-3 with ``gather_zero3=False``.
    """
    from trl.distributed import DistributedBackend

    backend = DistributedBackend(accelerator)
    model = accelerator.unwrap_model(wrapped)
    if backend.is_zero3:
        if not gather_zero3:
            raise ValueError("ds3_gather_for_generation: expected True with a sparse policy (the "
                             "sampler needs the full parameters for the whole rollout), got False")
        import deepspeed
        from trl.models.utils import add_hooks, remove_hooks

        with deepspeed.zero.GatheredParameters(list(wrapped.parameters())):
            remove_hooks(wrapped)
            try:
                yield model
            finally:
                add_hooks(wrapped)
    elif backend.fsdp_version == 1:
        with _fsdp1_summoned(wrapped):
            yield model
    else:
        modules = _fsdp2_modules(model)
        with _fsdp2_unsharded(model, modules) if modules else contextlib.nullcontext():
            yield model


@contextlib.contextmanager
def rollout_model(trainer) -> Iterator[nn.Module]:
    """The policy ``trainer`` (a ``GRPOTrainer``) samples from: `full_parameters` of its
    wrapped model, with `training_hooks_off`."""
    with full_parameters(trainer.model_wrapped, trainer.accelerator,
                         gather_zero3=bool(getattr(trainer.args, "ds3_gather_for_generation", True))
                         ) as model, training_hooks_off(model):
        yield model
