r"""ARRoL's quality head: a small MLP predicting whether a partial rollout will end correct.

ARRoL (Xu et al., ACL 2026, arXiv 2603.24840, §3) reads the policy's hidden state at the
detection point of a partial rollout and predicts \(P(\text{final reward} = 1)\). The head is
tiny next to the policy (one hidden layer of 256 by default), so scoring costs nothing
compared with decoding.

Which layer and which positions are read is the pruner's job (``Pruner.layer``,
``Pruner.window``); the head pools the ``[B, W, H]`` window it is given: ``"last"`` takes the
last position (W may be 1), ``"mean"`` averages the window. The paper's exact pooling is not
published; ``"last"`` is the default.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from .._checks import check_choice, check_int, check_number
from .._checks import field as json_field
from .._io import atomic_write_bytes

__all__ = ["POOLINGS", "QualityHead"]

POOLINGS = ("last", "mean")


class QualityHead(nn.Module):
    """MLP on pooled hidden states -> logit of P(rollout ends correct).

    Args:
        in_dim: hidden size H of the policy.
        hidden_sizes: widths of the hidden layers (``()`` gives logistic regression).
        pooling: ``"last"`` (last position of the window) or ``"mean"`` (window mean).
        dropout: dropout between layers during training.

    Shapes:
        hidden: ``[B, W, H]`` or ``[B, H]`` -> logits ``[B]`` (float32).
    """

    def __init__(
        self,
        in_dim: int,
        *,
        hidden_sizes: Sequence[int] = (256,),
        pooling: str = "last",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_int("in_dim", in_dim, low=1)
        check_choice("pooling", pooling, POOLINGS)
        if isinstance(hidden_sizes, (str, bytes)) or not isinstance(hidden_sizes, Sequence):
            raise ValueError(f"hidden_sizes: expected a sequence of positive ints, got {hidden_sizes!r}")
        for i, h in enumerate(hidden_sizes):
            check_int(f"hidden_sizes[{i}]", h, low=1)
        check_number("dropout", dropout, low=0, high=1, high_open=True)
        self.config = {
            "in_dim": in_dim,
            "hidden_sizes": [int(h) for h in hidden_sizes],
            "pooling": pooling,
            "dropout": float(dropout),
        }
        layers: list[nn.Module] = [nn.LayerNorm(in_dim)]
        width = in_dim
        for h in self.config["hidden_sizes"]:
            layers += [nn.Linear(width, h), nn.GELU(), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    @property
    def pooling(self) -> str:
        return self.config["pooling"]

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, W, H]`` or ``[B, H]`` -> ``[B, H]`` float32 features."""
        if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden)
            raise ValueError(f"hidden: expected a [B, W, H] or [B, H] tensor, got {shape}")
        if hidden.shape[-1] != self.config["in_dim"]:
            raise ValueError(
                f"hidden: expected last dim {self.config['in_dim']}, got {tuple(hidden.shape)}"
            )
        x = hidden.float()
        if x.dim() == 3:
            x = x[:, -1] if self.pooling == "last" else x.mean(dim=1)
        return x

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_from_features(self.pool(hidden))

    def logits_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """Logits from already pooled ``[B, H]`` features."""
        return self.net(features).squeeze(-1)

    def save(self, path: str | Path, *, extra: dict | None = None) -> Path:
        """Write weights (safetensors) with the config (and ``extra``) as JSON metadata."""
        meta = {"config": json.dumps(self.config), "extra": json.dumps(extra or {})}
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        return atomic_write_bytes(path, save(state, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> tuple[QualityHead, dict]:
        """Load a head written by `save`; returns ``(head, extra)``.

        Every failure (missing, truncated or foreign file, a hand-edited config, weights of the
        wrong shape or non-finite) is a ``ValueError`` naming the file and the field.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path: expected a safetensors file written by QualityHead.save, got {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            state = load_file(str(path))
        except Exception as exc:  # SafetensorError, OSError: a truncated or foreign file
            raise ValueError(f"path: {path} is not a readable safetensors file ({exc})") from None
        if "config" not in meta:
            raise ValueError(f"path: {path} has no 'config' metadata (not a QualityHead file)")
        try:
            config, extra = json.loads(meta["config"]), json.loads(meta.get("extra", "{}"))
            head = cls(
                json_field(config, "in_dim", where="config", kind="int"),
                hidden_sizes=json_field(config, "hidden_sizes", where="config", kind="list"),
                pooling=json_field(config, "pooling", where="config", kind="str"),
                dropout=json_field(config, "dropout", where="config", kind="number"),
            )
            if not isinstance(extra, dict):
                raise ValueError(f"extra: expected an object, got {extra!r}")
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"path: {path}: {exc}") from None
        try:
            head.load_state_dict(state)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()
            raise ValueError(f"path: {path}: weights do not match the config ({first[-1].strip()})") from None
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
        if bad:
            raise ValueError(f"path: {path}: non-finite weights in {bad}")
        return head, extra
