"""``python -m sparsecorr_openrlhf.train_ppo_ray``: OpenRLHF's launcher with sparsecorr inside.

Accepts every argument of ``python -m openrlhf.cli.train_ppo_ray`` plus:

    --sparsecorr.correction NAME     a sparsecorr preset: sparse_rl, tis, icepop, mis, sparrow,
                                     sparse_tail, geo_rs, veto, divergence, opsm, trl, none
                                     (default sparse_rl)
    --sparsecorr.cap X --sparsecorr.low X --sparsecorr.high X --sparsecorr.veto_threshold X
    --sparsecorr.q X --sparsecorr.tau X --sparsecorr.delta X --sparsecorr.threshold X
    --sparsecorr.floor X --sparsecorr.clip_min X --sparsecorr.clip_max X
                                     the preset's numbers (only those given are passed)
    --sparsecorr.mode M --sparsecorr.level L --sparsecorr.estimator E --sparsecorr.reduce R
                                     the preset's choices (e.g. trl: --sparsecorr.mode token_mask;
                                     mis: --sparsecorr.level sequence; divergence: estimator/reduce)
    --sparsecorr.quantiles Q [Q ...] log-ratio quantiles to log (default 0.01 0.05 0.5)

Sparse rollouts (sparsecorr_openrlhf.rollout): with --sparsecorr.rollout POLICY, OpenRLHF's
vLLM engines are replaced by sparse rollout actors (same count, placement and calls), and
--algo.advantage.is_correction_level token is added when it is off, so the rollouts carry
their log-probs (sparsecorr's correction replaces OpenRLHF's own in the loss). Without
--sparsecorr.rollout nothing changes.
{rollout_flags}
It validates the correction, exports it to Ray workers (``SPARSECORR_OPENRLHF`` plus a
``worker_process_setup_hook`` that patches the PPO actor in each worker), initialises Ray with
OpenRLHF's own environment defaults, then runs OpenRLHF's normal entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from .hook import ENV_VAR, correction_from_spec, install
from .rollout import flags as rollout_flags
from .rollout.flags import parse_rollout_args

__doc__ = __doc__.format(rollout_flags=rollout_flags.__doc__.split("\n\n", 1)[1].rstrip() + "\n")

NUMBERS = ("cap", "low", "high", "veto_threshold", "q", "tau", "delta", "threshold", "floor",
           "clip_min", "clip_max")
CHOICES = ("mode", "level", "estimator", "reduce")


def parse_sparsecorr_args(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Split ``--sparsecorr.*`` flags from OpenRLHF's; returns ``(spec, openrlhf_argv)``."""
    p = argparse.ArgumentParser(prog="sparsecorr_openrlhf.train_ppo_ray", add_help=False)
    p.add_argument("--sparsecorr.correction", dest="correction", default="sparse_rl")
    for name in NUMBERS:
        p.add_argument(f"--sparsecorr.{name}", dest=name, type=float, default=None)
    for name in CHOICES:
        p.add_argument(f"--sparsecorr.{name}", dest=name, default=None)
    p.add_argument("--sparsecorr.quantiles", dest="quantiles", type=float, nargs="+",
                   default=[0.01, 0.05, 0.5])
    ns, rest = p.parse_known_args(list(argv))
    numbers = {k: getattr(ns, k) for k in (*NUMBERS, *CHOICES) if getattr(ns, k) is not None}
    spec = {"name": ns.correction, "numbers": numbers, "quantiles": ns.quantiles}
    correction_from_spec(spec)  # fail fast with the preset's own error message
    return spec, rest


def _init_ray(spec: dict[str, Any]) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
        ENV_VAR: json.dumps(spec),
    }
    ray.init(runtime_env={"env_vars": env,
                          "worker_process_setup_hook": "sparsecorr_openrlhf.hook.setup_worker"})


def print_help() -> None:
    """This launcher's flags, then OpenRLHF's own ``--help``; never starts Ray or patches
    anything. OpenRLHF's launcher imports Ray at module level: without it, say so instead."""
    print(__doc__)
    print("OpenRLHF's own options (python -m openrlhf.cli.train_ppo_ray --help):\n", flush=True)
    argv = sys.argv
    sys.argv = ["openrlhf.cli.train_ppo_ray", "--help"]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass  # argparse exits after printing help
    except ImportError as exc:
        print(f"  (not shown: OpenRLHF's launcher needs {exc.name or exc}, which is not "
              "installed here)")
    finally:
        sys.argv = argv


LEVEL = "--algo.advantage.is_correction_level"


def with_rollout_logprobs(argv: Sequence[str], spec: dict[str, Any]) -> list[str]:
    """``argv`` with ``--algo.advantage.is_correction_level token`` when it is off (or absent)
    and a sparsecorr correction is on: OpenRLHF then asks its engines for log-probs
    (``SamplingParams(logprobs=1)``), the correction's input; the installed loss turns
    OpenRLHF's own correction off (`use_sparsecorr`). With ``--sparsecorr.correction none``
    ``argv`` is returned as given."""
    argv = list(argv)
    if correction_from_spec(spec) is None:
        return argv
    for i, a in enumerate(argv):
        if a == LEVEL and i + 1 < len(argv):
            if argv[i + 1] == "off":
                argv[i + 1] = "token"
            return argv
        if a.startswith(LEVEL + "="):
            if a.split("=", 1)[1] == "off":
                argv[i] = LEVEL + "=token"
            return argv
    return [*argv, LEVEL, "token"]


def sparse_engine_args(sampler, argv: Sequence[str]) -> list[dict[str, Any]]:
    """The sparse actors' arguments the launcher would create from OpenRLHF's flags in
    ``argv`` (its defaults; the dry run prints them), through the builder the engines use."""
    from .rollout.engines import actor_kwargs

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, kind, default in (("vllm.num_engines", int, None), ("vllm.tensor_parallel_size", int, 1),
                                ("actor.model_name_or_path", str, None), ("train.seed", int, 42),
                                ("data.max_len", int, 2048), ("train.agent_func_path", str, None),
                                ("reward.remote_url", str, None), ("data.max_images_per_prompt", int, 0),
                                ("algo.advantage.is_correction_level", str, "off")):
        p.add_argument(f"--{name}", dest=name, type=kind, default=default)
    for name in ("train.full_determinism_enable", "vllm.enable_prefix_caching", "vllm.enforce_eager",
                 "vllm.enable_sleep", "train.colocate_all", "train.async_enable"):
        p.add_argument(f"--{name}", dest=name, action="store_true")
    a = vars(p.parse_known_args(list(argv))[0])
    if not a["vllm.num_engines"]:
        raise ValueError(f"--vllm.num_engines: sparse rollout actors replace OpenRLHF's vLLM engines, expected "
                         f">= 1, got {a['vllm.num_engines']}")
    hybrid = a["train.colocate_all"] and not a["train.async_enable"]
    return actor_kwargs(a["vllm.num_engines"], a["vllm.tensor_parallel_size"], a["actor.model_name_or_path"],
                        a["train.seed"], a["train.full_determinism_enable"], a["vllm.enable_prefix_caching"],
                        a["vllm.enforce_eager"], a["data.max_len"], "shared" if hybrid else None, None,
                        a["vllm.enable_sleep"] and a["train.colocate_all"],
                        "processed_logprobs" if a["algo.advantage.is_correction_level"] != "off" else None,
                        a["train.agent_func_path"], a["reward.remote_url"], a["data.max_images_per_prompt"],
                        sampler=sampler)


def use_sparse_engines(sampler) -> None:
    """Make OpenRLHF's launcher create sparse rollout actors: ``openrlhf.trainer.ray.
    create_vllm_engines`` (which ``openrlhf.cli.train_ppo_ray`` imports when it runs) becomes
    `create_sparse_engines` with ``sampler``."""
    import importlib

    from .rollout import engines

    trainer_ray = importlib.import_module("openrlhf.trainer.ray")

    def create_engines(*args: Any, **kwargs: Any) -> list:
        return engines.create_sparse_engines(*args, **kwargs, sampler=sampler)

    trainer_ray.create_vllm_engines = create_engines


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print_help()
        return
    sampler, dry_run, argv = parse_rollout_args(argv, with_dry_run=True)
    spec, rest = parse_sparsecorr_args(argv)
    if sampler is not None:
        rest = with_rollout_logprobs(rest, spec)
        if dry_run:
            print(json.dumps(sparse_engine_args(sampler, rest), indent=1))
            return
        use_sparse_engines(sampler)
    os.environ[ENV_VAR] = json.dumps(spec)
    install(spec)  # the driver process (and local, non-Ray runs)
    _init_ray(spec)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
