r"""``SparseCorrCallback``: drives a ``TailController`` and keeps its schedule with checkpoints.

The trainer feeds it the per-token acceptance \(\alpha_t = 1 - \mathrm{TV}(p_t, q_t)\) between
the dense and the sparse sampler's next-token distributions (top-k bound, the statistic
calibration measures; ``sparsecorr_trl.score``) of every generation batch (``observe``); at
every optimizer step the controller updates the budget schedule (Sparrow's tail rule, Dong et al. 2026), the per-bin
budgets are logged as ``sparsecorr/schedule/bin_<i>``, the per-bin tail profile as
``sparsecorr/tail/bin_<i>``, and the controller state is written to
``<checkpoint>/sparsecorr_controller.json`` on save and restored on resume.

Shapes:
    acceptance, mask: ``[B, T]``; offset (prompt lengths): ``[B]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import TrainerCallback

from sparsecorr._io import atomic_write_json
from sparsecorr.schedules import TailController

STATE_FILE = "sparsecorr_controller.json"


class SparseCorrCallback(TrainerCallback):
    """Tail-driven budget control for ``SparseGRPOTrainer`` (see the module docstring).

    Args:
        controller: the controller to drive; ``controller.schedule`` is the live schedule.
    """

    def __init__(self, controller: TailController) -> None:
        if not isinstance(controller, TailController):
            raise ValueError(f"controller: expected a TailController, got {type(controller)!r}")
        self.controller = controller

    @property
    def schedule(self):
        """The current budget schedule (pass it as the sampler's ``budget``)."""
        return self.controller.schedule

    def observe(self, acceptance: torch.Tensor, mask: torch.Tensor,
                offset: torch.Tensor | None = None) -> None:
        """Add a batch's per-token acceptance to the controller's tail sketch."""
        self.controller.observe(acceptance.detach(), mask, offset)

    def on_step_end(self, args, state, control, **kwargs):
        self.controller.step()
        return control

    def schedule_metrics(self) -> dict[str, float]:
        """Per-bin budgets of the live schedule (-1 = dense) and the tail profile the last
        controller step saw (``q``-quantile of the acceptance per context bin; bins with too
        few tokens are left out), for the trainer's logs."""
        out = {f"sparsecorr/schedule/bin_{i}": -1.0 if b is None else float(b)
               for i, b in enumerate(self.controller.schedule.budgets)}
        out.update({f"sparsecorr/tail/bin_{i}": float(t)
                    for i, t in enumerate(self.controller.last_tails) if t == t})
        return out

    def on_save(self, args, state, control, **kwargs):
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        ckpt.mkdir(parents=True, exist_ok=True)
        atomic_write_json(ckpt / STATE_FILE, self.controller.state_dict())
        return control

    def load_checkpoint(self, checkpoint: str | Path) -> bool:
        """Restore the controller from ``checkpoint``; False when the file is absent."""
        path = Path(checkpoint) / STATE_FILE
        if not path.is_file():
            return False
        self.controller = TailController.from_state_dict(json.loads(path.read_text()))
        return True
