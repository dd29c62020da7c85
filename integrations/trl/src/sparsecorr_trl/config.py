"""``SparseCorrConfig``: what ``SparseGRPOTrainer`` samples with, corrects and logs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsecorr._checks import check_positive
from sparsecorr.correction import Correction, get_preset
from sparsecorr.sampler import SamplerSpec, spec_from

_RENAMED = {"fused": "fused_step", "max_num_seqs": "sparse_max_num_seqs"}  # SamplerSpec field -> ours


@dataclass(frozen=True)
class SparseCorrConfig:
    """What the trainer samples with, corrects and logs. The sampler's fields (``policy`` ...
    ``sparse_max_num_seqs``) are those of the shared ``sparsecorr.sampler.SamplerSpec``
    (`sampler_spec`), which validates them.

    Attributes:
        correction: the rollout correction: a preset name for
            ``sparsecorr.correction.get_preset`` (``"sparse_rl"``, ``"tis"``, ``"none"`` ...),
            any correction object (a factory result such as ``tis(cap=2.0)``, a
            ``chain(...)``, your own callable), or ``None`` (``"none"``): no correction. It acts
            only on rollouts whose sampler log-probs are known (a sparse ``policy``, or vLLM).
        correction_kwargs: numbers passed to the preset by name, e.g. ``{"cap": 2.0}`` (only
            with a preset name).
        log_metrics: copy the loss's ``mismatch/*`` and ``correction/*`` metrics and the
            rollout statistics into TRL's logged metrics.
        policy: KV policy name for ``sparsecorr.decoding.get_policy`` (``"streaming_llm"``,
            ``"snapkv"``, ``"rkv"``, ``"block_topk"``, ``"dense"``). Set, the trainer generates
            with ``sparsecorr.decoding.generate`` (needs ``use_vllm=False``); ``None`` keeps
            TRL's own generation (vLLM rollouts are then corrected with their log-probs).
        policy_kwargs: the policy's arguments, e.g. ``{"sink": 4}``.
        budget: a constant KV budget (tokens per layer and head).
        schedule: path of a ``BudgetSchedule`` JSON (``sparsecorr schedule --table ...
            --out ...`` writes one); the budget then depends on the context length. Exactly one of ``budget`` and
            ``schedule`` is needed with a sparse policy.
        controller: drive the schedule online with a ``TailController`` (Sparrow's tail rule);
            needs ``schedule``. A ``SparseCorrCallback`` is added unless one is passed.
        controller_candidates: budgets the controller may move between (default: the
            schedule's own budgets).
        tau: the controller's threshold on the tail of the acceptance (Sparrow: 0.86).
        acceptance: compute the per-token acceptance rate (``Mismatch.acceptance``, see
            ``sparsecorr_trl.score``) for a correction of your own that reads it; it is computed
            anyway with a controller or a ``sparse_tail`` correction. Needs ``policy``.
        acceptance_topk: k of the top-k lower bound of the acceptance on both sides (use the
            ``logprobs_topk`` your calibration used; Sparrow: 20; the vocabulary size makes it
            exact). A k above the model's vocabulary size is clamped to it by the sampler
            (``sparsecorr.decoding.generate``), so the default works on any model.
        distill: DistillSparse (Sparrow): a LoRA adapter active only in the sparse sampler,
            trained after each policy step with ``distill_sparse_loss``; needs ``policy`` and
            peft.
        distill_rank: LoRA rank (not stated in the paper).
        distill_alpha: LoRA alpha (paper: 16).
        distill_lr: the adapter's AdamW learning rate.
        distill_kl_weight: lambda of the k3 term (paper: 1e-3).
        cuda_graph: replay the sparse sampler's decode steps as CUDA graphs (``generate(...,
            cuda_graph=True)``); ``None`` (default): on when the model is on a CUDA device, off
            elsewhere; ``False`` turns them off (e.g. to debug a capture). ``True`` with a model
            off CUDA raises at the first rollout. Needs ``policy``.
        fused_step: compile the captured decode step (``generate(..., fused=...)``: HF's
            elementwise chains fused by ``torch.compile``, see ``sparsecorr.decoding.fused``);
            ``None`` (default): on whenever the CUDA-graph step is; ``False`` turns it off;
            ``True`` needs ``cuda_graph`` not ``False``. Logged as ``sparsecorr/rollout/fused``.
        backend: the sampler's attention backend (``"auto"``: FlashInfer on CUDA when installed,
            else ``"torch"``; or ``"torch"``, ``"flashinfer"``, ``"reference"``).
        sparse_max_num_seqs: most rollouts the sparse sampler decodes at once
            (``generate(..., max_num_seqs=...)``). ``None`` (default): the memory plan alone
            decides (on CUDA, 0.9 × the free memory over one row's KV pool and policy state). A
            generation batch larger than the plan runs through the continuous-batching
            scheduler (rows admitted as others finish) instead of failing with out-of-memory.
            Needs ``policy``.

    Raises:
        ValueError: on an unknown preset or policy, a correction that is neither a name nor a
            callable (a computed ``Correction`` record belongs to one batch), numbers with a
            correction object, or an invalid combination (both or neither
            of budget/schedule with a sparse policy, controller without a schedule,
            distillation without a sparse policy).
    """

    correction: str | Callable | None = "sparse_rl"
    correction_kwargs: dict[str, Any] = field(default_factory=dict)
    log_metrics: bool = True
    policy: str | None = None
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    budget: int | None = None
    schedule: str | Path | None = None
    controller: bool = False
    controller_candidates: tuple[int, ...] = ()
    tau: float = 0.86
    acceptance: bool = False
    acceptance_topk: int = 20
    distill: bool = False
    distill_rank: int = 16
    distill_alpha: int = 16
    distill_lr: float = 1e-4
    distill_kl_weight: float = 1e-3
    cuda_graph: bool | None = None
    fused_step: bool | None = None
    backend: str = "auto"
    sparse_max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        self.build()
        sparse = self.policy is not None and self.policy != "dense"
        # the sampler's fields: validated once, by the shared SamplerSpec (a dense spec checks the
        # engine fields' types when TRL generates)
        self._spec(self.policy or "dense", with_budget=self.policy is not None)
        if self.policy is None and (self.budget is not None or self.schedule is not None):
            raise ValueError("policy: expected a KV policy name when a budget or schedule is "
                             "given, got None")
        if self.controller and self.schedule is None:
            raise ValueError("controller: needs a schedule (the controller adjusts its bins), "
                             "got schedule=None")
        if self.acceptance and self.policy is None:
            raise ValueError("acceptance: needs the sparse sampler's top-k log-probs (set "
                             "policy), got policy=None")
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau: expected a number in (0, 1), got {self.tau!r}")
        if self.distill and not sparse:
            raise ValueError("distill: DistillSparse needs a sparse policy (the adapter is "
                             f"active only in the sparse sampler), got policy={self.policy!r}")
        for name in ("distill_rank", "distill_alpha", "acceptance_topk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")
        if self.cuda_graph and self.policy is None:
            raise ValueError("cuda_graph: applies to sparsecorr's sampler (set policy), got policy=None")
        if self.fused_step and self.policy is None:
            raise ValueError("fused_step: compiles sparsecorr's CUDA-graph decode step (needs policy set and "
                             f"cuda_graph None or True), got policy={self.policy!r}, cuda_graph={self.cuda_graph!r}")
        if self.sparse_max_num_seqs is not None and self.policy is None:
            raise ValueError("sparse_max_num_seqs: caps sparsecorr's sampler (set policy), got policy=None")
        check_positive("distill_lr", self.distill_lr, allow_zero=True)
        check_positive("distill_kl_weight", self.distill_kl_weight, allow_zero=True)

    def _spec(self, policy: str, *, with_budget: bool) -> SamplerSpec:
        values = {"policy": policy, "policy_kwargs": self.policy_kwargs if with_budget else {},
                  "backend": self.backend, "cuda_graph": self.cuda_graph, "fused": self.fused_step,
                  "max_num_seqs": self.sparse_max_num_seqs}
        if with_budget:
            values.update(budget=self.budget, schedule=None if self.schedule is None else str(self.schedule))
        return spec_from(values, rename=_RENAMED)

    def sampler_spec(self) -> SamplerSpec | None:
        """The sparse sampler's options as the shared ``sparsecorr.sampler.SamplerSpec``
        (``fused_step`` is its ``fused``, ``sparse_max_num_seqs`` its ``max_num_seqs``), or
        None when TRL generates (``policy=None``)."""
        return None if self.policy is None else self._spec(self.policy, with_budget=True)

    def build(self):
        """The correction callable, or ``None`` for no correction (ValueError on a bad value)."""
        c = self.correction
        if c is None or isinstance(c, str):
            if self.correction_kwargs and c in (None, "none"):
                raise ValueError(f"correction_kwargs: expected none without a correction, got "
                                 f"{sorted(self.correction_kwargs)}")
            return None if c is None else get_preset(c, **self.correction_kwargs)
        if isinstance(c, Correction):
            raise ValueError("correction: expected a preset name or a callable correction, got a "
                             "computed Correction record (it belongs to one batch)")
        if not callable(c):
            raise ValueError(f"correction: expected a preset name, a callable correction or None, "
                             f"got {type(c).__name__}")
        if self.correction_kwargs:
            raise ValueError(f"correction_kwargs: expected none with a correction object (pass the "
                             f"numbers to its factory), got {sorted(self.correction_kwargs)}")
        return c

    def build_policy(self):
        """The KV policy, or ``None`` when TRL generates."""
        spec = self.sampler_spec()
        return None if spec is None else spec.build_policy()

    def build_budget(self):
        """The initial budget: an int, a loaded ``BudgetSchedule`` or ``None`` (dense)."""
        spec = self.sampler_spec()
        return None if spec is None else spec.build_budget()
