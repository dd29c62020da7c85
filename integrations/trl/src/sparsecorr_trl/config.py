"""``SparseCorrConfig`` and the init-time checks that keep the correction on every loss path."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsecorr._checks import check_positive
from sparsecorr.correction import get_preset
from sparsecorr.decoding import get_policy
from sparsecorr.schedules import BudgetSchedule

#: TRL ``loss_type`` -> sparsecorr aggregation (see ``sparsecorr.losses.aggregation``).
AGGREGATION_BY_LOSS_TYPE = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


@dataclass(frozen=True)
class SparseCorrConfig:
    """What the trainer samples with, corrects and logs.

    Attributes:
        correction: preset name for ``sparsecorr.correction.get_preset`` (``"sparse_rl"``,
            ``"tis"``, ``"trl"``, ``"none"`` ...).
        correction_kwargs: numbers passed to the preset, e.g. ``{"cap": 2.0}``.
        log_metrics: copy the loss's ``mismatch/*`` and ``correction/*`` metrics and the
            rollout statistics into TRL's logged metrics.
        policy: KV policy name for ``sparsecorr.decoding.get_policy`` (``"streaming_llm"``,
            ``"snapkv"``, ``"rkv"``, ``"block_topk"``, ``"dense"``). Set, the trainer generates
            with ``sparsecorr.decoding.generate`` (needs ``use_vllm=False``); ``None`` keeps
            TRL's own generation (vLLM rollouts are then corrected with their log-probs).
        policy_kwargs: the policy's arguments, e.g. ``{"sink": 4}``.
        budget: a constant KV budget (tokens per layer and head).
        schedule: path of a ``BudgetSchedule`` JSON (``sparsecorr schedule fit`` writes one);
            the budget then depends on the context length. Exactly one of ``budget`` and
            ``schedule`` is needed with a sparse policy.
        controller: drive the schedule online with a ``TailController`` (Sparrow's tail rule);
            needs ``schedule``. A ``SparseCorrCallback`` is added unless one is passed.
        controller_candidates: budgets the controller may move between (default: the
            schedule's own budgets).
        tau: the controller's threshold on the tail of the acceptance (Sparrow: 0.86).
        distill: DistillSparse (Sparrow): a LoRA adapter active only in the sparse sampler,
            trained after each policy step with ``distill_sparse_loss``; needs ``policy`` and
            peft.
        distill_rank: LoRA rank (not stated in the paper).
        distill_alpha: LoRA alpha (paper: 16).
        distill_lr: the adapter's AdamW learning rate.
        distill_kl_weight: lambda of the k3 term (paper: 1e-3).

    Raises:
        ValueError: on an unknown preset or policy, or an invalid combination (both or neither
            of budget/schedule with a sparse policy, controller without a schedule,
            distillation without a sparse policy).
    """

    correction: str = "sparse_rl"
    correction_kwargs: dict[str, Any] = field(default_factory=dict)
    log_metrics: bool = True
    policy: str | None = None
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    schedule: str | Path | None = None
    controller: bool = False
    controller_candidates: tuple[int, ...] = ()
    tau: float = 0.86
    distill: bool = False
    distill_rank: int = 16
    distill_alpha: int = 16
    distill_lr: float = 1e-4
    distill_kl_weight: float = 1e-3

    def __post_init__(self) -> None:
        self.build()
        sparse = self.policy is not None and self.policy != "dense"
        if self.policy is not None:
            get_policy(self.policy, **self.policy_kwargs)
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"budget: expected a positive int or None, got {self.budget!r}")
        if self.budget is not None and self.schedule is not None:
            raise ValueError("budget/schedule: expected one of them, got both")
        if sparse and self.budget is None and self.schedule is None:
            raise ValueError(f"budget: policy {self.policy!r} needs a budget or a schedule, "
                             "got neither")
        if self.policy is None and (self.budget is not None or self.schedule is not None):
            raise ValueError("policy: expected a KV policy name when a budget or schedule is "
                             "given, got None")
        if self.schedule is not None and not Path(self.schedule).is_file():
            raise ValueError(f"schedule: expected a BudgetSchedule JSON file, got "
                             f"{str(self.schedule)!r} (not found)")
        if self.controller and self.schedule is None:
            raise ValueError("controller: needs a schedule (the controller adjusts its bins), "
                             "got schedule=None")
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau: expected a number in (0, 1), got {self.tau!r}")
        if self.distill and not sparse:
            raise ValueError("distill: DistillSparse needs a sparse policy (the adapter is "
                             f"active only in the sparse sampler), got policy={self.policy!r}")
        for name in ("distill_rank", "distill_alpha"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")
        check_positive("distill_lr", self.distill_lr, allow_zero=True)
        check_positive("distill_kl_weight", self.distill_kl_weight, allow_zero=True)

    def build(self):
        """The correction object (``None`` for ``"none"``); raises ValueError on a bad name."""
        return get_preset(self.correction, **self.correction_kwargs)

    def build_policy(self):
        """The KV policy, or ``None`` when TRL generates."""
        return None if self.policy is None else get_policy(self.policy, **self.policy_kwargs)

    def build_budget(self):
        """The initial budget: an int, a loaded ``BudgetSchedule`` or ``None`` (dense)."""
        if self.schedule is not None:
            return BudgetSchedule.load(self.schedule)
        return self.budget


def validate_grpo_args(args: Any, config: SparseCorrConfig | None = None) -> str:
    """Reject TRL settings that would bypass the corrected loss; return the aggregation.

    Raises:
        ValueError: ``use_liger_loss=True`` (Liger's fused loss never sees the correction),
            a ``loss_type`` without a sparsecorr aggregation, sequence-level ratios, or, with a
            sparse policy in ``config``: vLLM or continuous batching (they would generate
            instead of the sparse sampler), ``min_p``, ``repetition_penalty != 1`` or extra
            ``generation_kwargs`` (the sampler's recorded log-probs would not match).
    """
    if getattr(args, "use_liger_loss", False):
        raise ValueError("use_liger_loss: expected False (the Liger fused loss would skip the "
                         "sparse-rollout correction), got True")
    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in AGGREGATION_BY_LOSS_TYPE:
        raise ValueError(f"loss_type: expected one of {sorted(AGGREGATION_BY_LOSS_TYPE)}, "
                         f"got {loss_type!r}")
    level = getattr(args, "importance_sampling_level", "token")
    if level != "token":
        raise ValueError(f"importance_sampling_level: expected 'token', got {level!r}")
    if config is not None and config.policy is not None:
        for name, ok in (("use_vllm", False), ("use_transformers_continuous_batching", False)):
            if getattr(args, name, ok) != ok:
                raise ValueError(f"{name}: expected {ok} with SparseCorrConfig.policy="
                                 f"{config.policy!r} (sparsecorr generates), got True")
        if getattr(args, "min_p", None) not in (None, 0.0):
            raise ValueError(f"min_p: expected None with a sparsecorr policy, got {args.min_p!r}")
        if getattr(args, "repetition_penalty", 1.0) != 1.0:
            raise ValueError("repetition_penalty: expected 1.0 with a sparsecorr policy, got "
                             f"{args.repetition_penalty!r}")
        if getattr(args, "generation_kwargs", None):
            raise ValueError("generation_kwargs: expected none with a sparsecorr policy, got "
                             f"{sorted(args.generation_kwargs)}")
    return AGGREGATION_BY_LOSS_TYPE[loss_type]
