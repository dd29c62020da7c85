"""The DistillSparse LoRA adapter: active in the sparse sampler, off for the dense model.

Sparrow's DistillSparse (Zhou et al. 2026, arXiv 2606.08446) trains a LoRA adapter
\\(\\varphi\\) (alpha 16, all linear layers; the rank is not stated, r = 16 here) that is active
only when the model runs as the sparse sampler. The dense recompute of ``old_logp`` and the
dense PPO update of \\(\\theta\\) run with the adapter disabled (`dense_mode`). Built on
`peft <https://github.com/huggingface/peft>`_ (an optional dependency, imported lazily).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["adapter_parameters", "dense_mode", "sparse_adapter"]

ADAPTER_NAME = "sparse"


def _peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError("sparse_adapter needs peft: pip install 'sparsecorr[peft]'") from err
    return peft


def sparse_adapter(
    model: torch.nn.Module,
    *,
    r: int = 16,
    alpha: int = 16,
    target_modules: str | list[str] = "all-linear",
    dropout: float = 0.0,
    freeze_base: bool = False,
) -> torch.nn.Module:
    """Wrap ``model`` in a peft ``PeftModel`` with a LoRA adapter named ``"sparse"``.

    LoRA's B matrix starts at zero, so the wrapped model initially computes exactly the base
    model. peft freezes the base weights; with ``freeze_base=False`` (default) their
    ``requires_grad`` flags are restored, so the same object serves the dense update of
    \\(\\theta\\) (inside `dense_mode`) and the adapter update (optimise
    `adapter_parameters` only, which is DistillSparse's "freeze \\(\\theta\\)").

    Args:
        model: a Hugging Face causal LM (or any module peft can wrap).
        r: LoRA rank (not stated in the paper).
        alpha: LoRA alpha (paper: 16).
        target_modules: peft's selector (paper: all linear layers, ``"all-linear"``).
        dropout: LoRA dropout.
        freeze_base: keep peft's frozen base weights.

    Returns:
        the ``PeftModel``; use it as the model everywhere afterwards.
    """
    peft = _peft()
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"r: expected an int >= 1, got {r!r}")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"alpha: expected a number > 0, got {alpha!r}")
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                             lora_dropout=dropout, task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    if not freeze_base:
        for name, p in model.named_parameters():
            if "lora_" not in name and trainable.get(name.replace("base_layer.", ""), False):
                p.requires_grad_(True)
    return wrapped


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The LoRA parameters of the sparse adapter (what the DistillSparse step optimises)."""
    return [p for name, p in model.named_parameters() if "lora_" in name]


@contextmanager
def dense_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run ``model`` as the dense model: the sparse adapter is disabled inside the block.

    Use it for the dense recompute of ``old_logp`` and for the dense PPO update of
    \\(\\theta\\); outside the block the adapter is active (the sparse sampler). Nested use is
    fine; the adapter is re-enabled on exit even if the block raises.

    Raises:
        ValueError: if ``model`` has no peft adapter (wrap it with `sparse_adapter`).
    """
    if not hasattr(model, "disable_adapter"):
        raise ValueError(f"model: expected a peft model from sparse_adapter(...), got "
                         f"{type(model).__name__} (no disable_adapter())")
    with model.disable_adapter():
        yield model
