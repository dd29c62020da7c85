r"""The sparse sampler's state in TRL checkpoints, so a resumed run reproduces an uninterrupted one.

``transformers.Trainer`` checkpoints the global RNGs (``rng_state[_i].pth``) but not the
``torch.Generator`` the sparse sampler draws from, nor the DistillSparse adapter's optimizer.
``SparseGRPOTrainer`` writes them beside the RNG file of each process, with safetensors
(atomically), and reads them back where the ``Trainer`` restores its RNGs:

- ``sparsecorr_sampler[_i].safetensors``: ``generator`` (the byte state of the sampler's
  generator) and, with ``distill=True``, the adapter optimizer's tensors
  (``adapter.<param index>.<name>``) with its hyperparameters as JSON metadata.

With ``distill=True`` the model TRL trains is a PEFT model, and ``Trainer`` saves only the
adapter of a PEFT model: the dense policy \(\theta\), which DistillSparse trains too, would be
lost from every checkpoint and from ``save_model``. ``SparseGRPOTrainer`` therefore also writes
the whole model (policy and adapter) as ``sparsecorr_policy.safetensors`` and restores it on
resume (`save_policy`, `load_policy`).

The controller's state is written by ``SparseCorrCallback`` (``sparsecorr_controller.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from sparsecorr._io import atomic_write_bytes

__all__ = ["POLICY_FILE", "load_policy", "load_sampler_state", "sampler_file", "save_policy",
           "save_sampler_state"]

POLICY_FILE = "sparsecorr_policy.safetensors"


def save_policy(directory: str | Path, model: torch.nn.Module) -> Path:
    """Write every parameter and buffer of ``model`` to ``<directory>/sparsecorr_policy.safetensors``."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    return atomic_write_bytes(Path(directory) / POLICY_FILE, save(state))


def load_policy(directory: str | Path, model: torch.nn.Module) -> bool:
    """Load what `save_policy` wrote (all keys must match); False when absent."""
    path = Path(directory) / POLICY_FILE
    if not path.is_file():
        return False
    model.load_state_dict(load_file(str(path)), strict=True)
    return True


def sampler_file(directory: str | Path, process_index: int, world_size: int) -> Path:
    """``<directory>/sparsecorr_sampler[_<i>].safetensors`` (suffixed with more than one process)."""
    name = "sparsecorr_sampler.safetensors" if world_size <= 1 else \
        f"sparsecorr_sampler_{process_index}.safetensors"
    return Path(directory) / name


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    state = optimizer.state_dict()
    tensors = {f"adapter.{i}.{k}": torch.as_tensor(v).detach().cpu().contiguous()
               for i, s in state["state"].items() for k, v in s.items()}
    return tensors, {"adapter_param_groups": json.dumps(state["param_groups"])}


def save_sampler_state(path: Path, generator: torch.Generator,
                       optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write the generator (and the adapter optimizer) state to ``path``."""
    tensors = {"generator": generator.get_state()}
    metadata = {}
    if optimizer is not None:
        extra, metadata = _optimizer_tensors(optimizer)
        tensors.update(extra)
    return atomic_write_bytes(path, save(tensors, metadata=metadata))


def load_sampler_state(path: Path, generator: torch.Generator,
                       optimizer: torch.optim.Optimizer | None = None) -> bool:
    """Restore what `save_sampler_state` wrote; False (nothing changed) when absent."""
    if not path.is_file():
        return False
    tensors = load_file(str(path))
    generator.set_state(tensors["generator"])
    if optimizer is not None and any(k.startswith("adapter.") for k in tensors):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            groups = json.loads(f.metadata()["adapter_param_groups"])
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("adapter."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return True
