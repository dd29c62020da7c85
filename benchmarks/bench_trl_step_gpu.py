"""GRPO steps on a GPU, end to end (issue 34): stock TRL ``GRPOTrainer`` (HF ``generate``)
against ``SparseGRPOTrainer`` on sparsecorr's engine (dense, and an eviction policy with
``sparse_rl()``), with the memory each step leaves allocated.

**Setup, identical for every row.** One process; a Qwen3-0.6B-shaped model (``Qwen3Config``:
28 layers, hidden 1024, 16/8 heads, head_dim 128, vocabulary 151,936, tied embeddings) with
random bf16 weights built in-process (seed 0) and deep-copied for every trainer; a word-level
tokenizer over the whole vocabulary built in memory (nothing is downloaded); ``--batch`` rollouts
per step (``--generations`` per prompt) of ``--prompt`` random prompt tokens and up to ``--new``
sampled tokens (temperature 1); a reward that counts distinct tokens; TRL's defaults otherwise
(``dapo`` loss, ``beta=0``, gradient checkpointing on as TRL's default, ``--no-gradient-checkpointing``
turns it off; one generation per step).

Rows:

1. stock ``trl.GRPOTrainer``: rollouts with HF ``generate``;
2. ``SparseGRPOTrainer`` with ``policy="dense"``: our engine, CUDA graphs and backend ``auto``
   (the trainer's defaults on CUDA), ``sparse_rl()`` correction;
3. ``SparseGRPOTrainer`` with ``--policy`` (RKV by default) at ``--budget`` and ``sparse_rl()``.

**Modes.** The default shape is 8 × (4,096 prompt + 256 new), ``--steps 3``, all three rows.
``--shape long`` is 8 × (512 prompt + 2,048 new) with our dense row and RKV at budget 512 and no
stock row (HF ``generate`` takes ~90 ms/token there): what a sparse policy buys inside the
trainer when decoding dominates. ``--memory-steps N`` runs only our rows for N steps (the
shape's sizes) and reports ``torch.cuda.memory_allocated()`` after each step, with no
``gc.collect()`` anywhere in the loop, and the drift from step 1 (flat: within ``--flat-mib``,
64 MiB by default).

**Columns.** Per step (CUDA-synchronised wall time, the mean over steps 2.. when there are
several; step 1 also shown): rollout seconds (the trainer's ``_generate_single_turn``), scoring
seconds (the rest of TRL's generate-and-score step: rewards, advantages, the old-log-prob
forward, our correction), training seconds (the rest of the step: loss, backward, optimizer),
the whole step; the peak memory of the row; ``torch.cuda.memory_allocated()`` after every step
(no ``gc.collect()``; it must stay flat: "flat" when every step after the first is within
``--flat-mib`` of the first) and its ratio to the stock row. What the engine ran (cuda_graph,
backend) is read from the trainer after every step's rollout, as it ran: ``fused`` and
``cuda_graph`` are the values of every step when they differ (a compile that failed says
``failed: ...``). Every row starts from a clean memory state. One JSON line per
row goes to ``--out`` as soon as it is measured.

``--smoke`` runs a tiny configuration on the CPU in seconds (CI runs it).

Usage: ``python benchmarks/bench_trl_step_gpu.py [--smoke] [--shape default|long] [--memory-steps N]
[--no-gradient-checkpointing] [--batch 8] [--generations 4] [--prompt 4096] [--new 256] [--steps 3]
[--policy rkv] [--budget 2048] [--out results.jsonl]``
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _common import table

GIB = 2**30
#: per shape: the sizes (full run, --smoke) and the default rows
SHAPES = {
    "default": {"sizes": {"batch": (8, 4), "generations": (4, 2), "prompt": (4096, 48), "new": (256, 8),
                          "steps": (3, 2), "budget": (2048, 16)}, "rows": "stock,dense,sparse"},
    "long": {"sizes": {"batch": (8, 4), "generations": (4, 2), "prompt": (512, 8), "new": (2048, 32),
                       "steps": (3, 2), "budget": (512, 8)}, "rows": "dense,sparse"},
}
STOCK, DENSE, SPARSE = "stock GRPOTrainer (HF generate)", "SparseGRPOTrainer, our dense engine", "SparseGRPOTrainer, {}"


def model_config(args):
    from transformers import Qwen3Config

    if args.smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)
    else:  # Qwen3-0.6B
        shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936)
    cfg = Qwen3Config(**shape, max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6,
                      bos_token_id=None, eos_token_id=1, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(args):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(model_config(args)).to(args.dtype)


def build_tokenizer(vocab: int):
    """Word-level: token ``i`` is the word ``w<i>`` (0 = pad, 1 = EOS, 2 = unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", *(f"w{i}" for i in range(3, vocab))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def dataset(args, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    n = args.batch // args.generations * (args.steps + 1)
    ids = torch.randint(3, vocab, (n, args.prompt), generator=g)
    return Dataset.from_dict({"prompt": [" ".join(f"w{i}" for i in row) for row in ids.tolist()]})


def distinct_tokens(completions, **_) -> list[float]:
    return [len(set(c.split())) / max(1, len(c.split())) for c in completions]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Per-step seconds of the rollout, the generate-and-score step and the whole step, and the
    memory allocated after each step (a ``TrainerCallback`` plus two timed wrappers)."""

    def __init__(self, device) -> None:
        from transformers import TrainerCallback

        self.device = device
        self.rollout: list[float] = []
        self.gen_score: list[float] = []
        self.step: list[float] = []
        self.allocated: list[int] = []
        self.engines: list[dict] = []  # what each step's rollout ran
        clock = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                sync(clock.device)
                clock._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                sync(clock.device)
                clock.step.append(time.perf_counter() - clock._t0)
                if clock.device.type == "cuda":
                    clock.allocated.append(torch.cuda.memory_allocated(clock.device))

        self.callback = _Callback()

    def wrap(self, fn, into: list[float]):
        def timed(*a, **kw):
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync(self.device)
            into.append(time.perf_counter() - t0)
            return out

        return timed


def grpo_config(args, out: str):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=out, per_device_train_batch_size=args.batch, num_generations=args.generations,
                      max_completion_length=args.new, max_steps=args.steps, logging_steps=1, report_to=[],
                      gradient_checkpointing=args.gradient_checkpointing,
                      use_cpu=args.device.type != "cuda", bf16=args.dtype == torch.bfloat16, seed=0,
                      save_strategy="no", disable_tqdm=True, temperature=1.0, shuffle_dataset=False)


def trainer(name: str, args, base, tokenizer, data, out: str, clock: Clock):
    from sparsecorr_trl import SparseCorrConfig, SparseGRPOTrainer
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    kwargs = dict(model=copy.deepcopy(base).train(), reward_funcs=distinct_tokens, args=grpo_config(args, out),
                  train_dataset=data, processing_class=tokenizer, callbacks=[clock.callback])
    if name == STOCK:
        t = GRPOTrainer(**kwargs)
    else:
        policy = "dense" if name == DENSE else args.policy
        cfg = SparseCorrConfig("sparse_rl", policy=policy, budget=None if policy == "dense" else args.budget)
        t = SparseGRPOTrainer(**kwargs, sparsecorr_config=cfg)
    t.remove_callback(PrinterCallback)
    t._generate_single_turn = clock.wrap(engine_recorder(t, clock.engines), clock.rollout)
    t._generate_and_score_completions = clock.wrap(t._generate_and_score_completions, clock.gen_score)
    return t


#: what HF ``generate`` (the stock row) runs, in the engine's words
HF_ENGINE = {"backend": "HF generate", "cuda_graph": "off", "fused": "off"}


def engine_recorder(t, into: list[dict]):
    """``t._generate_single_turn`` that appends what each call's rollout ran to ``into``."""
    fn = t._generate_single_turn

    def recorded(*a, **kw):
        out = fn(*a, **kw)
        into.append(dict(getattr(t, "sparsecorr_rollout_engine", None) or HF_ENGINE))
        return out

    return recorded


def as_ran(engines: list[dict]) -> dict:
    """One value per field when every step ran the same, else the per-step values joined."""
    keys = ("backend", "cuda_graph", "fused")
    return {k: ",".join(dict.fromkeys(e.get(k, "off") for e in engines)) or "-" for k in keys}


def clean(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_row(name: str, args, base, tokenizer, data) -> dict:
    clean(args.device)
    clock = Clock(args.device)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = trainer(name, args, base, tokenizer, data, out, clock)
        t.train()
    del t
    n = len(clock.step)
    if n != args.steps or len(clock.rollout) != n or len(clock.gen_score) != n:
        raise RuntimeError(f"{name}: expected {args.steps} steps with one rollout each, got {n} steps, "
                           f"{len(clock.rollout)} rollouts, {len(clock.gen_score)} generate-and-score calls")
    later = slice(1, None) if n > 1 else slice(0, None)
    mean = lambda xs: sum(xs[later]) / len(xs[later])  # noqa: E731
    score = [g - r for g, r in zip(clock.gen_score, clock.rollout)]
    train = [s - g for s, g in zip(clock.step, clock.gen_score)]
    alloc = clock.allocated
    drift = max(abs(a - alloc[0]) for a in alloc) / 2**20 if alloc else None
    flat = drift <= args.flat_mib if alloc else None
    peak = torch.cuda.max_memory_allocated(args.device) if args.device.type == "cuda" else None
    return {"row": name, "rollout_s": mean(clock.rollout), "scoring_s": mean(score), "training_s": mean(train),
            "step_s": mean(clock.step), "first_step_s": clock.step[0], "peak_gib": None if peak is None else peak / GIB,
            "allocated_gib": [a / GIB for a in alloc], "drift_mib": drift, "flat": flat,
            "gradient_checkpointing": args.gradient_checkpointing, "steps": n, **as_ran(clock.engines)}


def args_from(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny configuration on the CPU (CI)")
    ap.add_argument("--shape", default="default", choices=tuple(SHAPES),
                    help="default: 8 x (4096 + 256), all rows; long: 8 x (512 + 2048), ours at budget 512")
    ap.add_argument("--memory-steps", type=int, default=None,
                    help="run only our rows for this many steps, memory_allocated after each")
    ap.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                    help="turn TRL's default gradient checkpointing off")
    ap.add_argument("--batch", type=int, default=None, help="rollouts per step (default 8; smoke 4)")
    ap.add_argument("--generations", type=int, default=None, help="rollouts per prompt (default 4; smoke 2)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 4096; smoke 48)")
    ap.add_argument("--new", type=int, default=None, help="max new tokens (default 256; smoke 8)")
    ap.add_argument("--steps", type=int, default=None, help="steps per row (default 3; smoke 2)")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers of the 0.6B shape (default 28)")
    ap.add_argument("--policy", default="rkv", choices=("rkv", "streaming_llm", "snapkv"), help="the sparse row")
    ap.add_argument("--budget", type=int, default=None, help="KV budget of the sparse row (default 2048; smoke 16)")
    ap.add_argument("--rows", default=None, help="rows to run, comma-separated (default: the shape's)")
    ap.add_argument("--flat-mib", type=float, default=64.0, help="tolerance of 'flat' memory (MiB)")
    ap.add_argument("--out", default=None, help="append one JSON line per row to this file")
    args = ap.parse_args(argv)
    smoke = args.smoke
    shape = SHAPES[args.shape]
    if args.memory_steps is not None:
        if args.memory_steps < 2:
            raise SystemExit(f"--memory-steps: expected an int >= 2, got {args.memory_steps}")
        if args.steps is not None and args.steps != args.memory_steps:
            raise SystemExit(f"--steps: expected none with --memory-steps, got {args.steps}")
        args.steps = args.memory_steps
    for name, (full, small) in shape["sizes"].items():
        if getattr(args, name) is None:
            setattr(args, name, small if smoke else full)
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if args.rows is None:
        args.rows = "dense,sparse" if args.memory_steps is not None else shape["rows"]
    if args.batch % args.generations:
        raise SystemExit(f"--batch: expected a multiple of --generations ({args.generations}), got {args.batch}")
    rows = args.rows.split(",")
    if not rows or any(r not in ("stock", "dense", "sparse") for r in rows):
        raise SystemExit(f"--rows: expected a comma-separated subset of stock,dense,sparse, got {args.rows!r}")
    if args.memory_steps is not None and "stock" in rows:
        raise SystemExit("--rows: expected only our rows (dense,sparse) with --memory-steps, got stock")
    args.rows = rows
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (use --smoke for the CPU configuration)")
    args.device = torch.device("cuda" if not smoke else "cpu")
    args.dtype = torch.bfloat16 if not smoke else torch.float32
    if smoke:
        torch.set_num_threads(1)  # tiny matrices: threads only contend
    return args


def main(argv=None) -> list[dict]:
    args = args_from(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    base = build_model(args)
    vocab = base.config.vocab_size
    tokenizer, data = build_tokenizer(vocab), dataset(args, vocab)
    device = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU (smoke)"
    print(f"{device}, torch {torch.__version__}; Qwen3 {base.config.num_hidden_layers} layers, vocab {vocab}, "
          f"{args.dtype}; {args.batch} rollouts x ({args.prompt} prompt + <= {args.new} new), "
          f"{args.steps} steps per row, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}"
          + (" (memory mode: no gc.collect() in the loop)" if args.memory_steps else ""))
    names = {"stock": STOCK, "dense": DENSE, "sparse": SPARSE.format(f"{args.policy} @ {args.budget} + sparse_rl()")}
    results = []
    for key in args.rows:
        res = run_row(names[key], args, base, tokenizer, data)
        results.append(res)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"bench": "trl_step_gpu", "device": device, **res}) + "\n")
        print(f"  {res['row']}: step {res['step_s']:.2f} s, allocated after each step "
              f"{[round(a, 3) for a in res['allocated_gib']]} GiB", flush=True)
    stock = next((r for r in results if r["row"] == STOCK), None)
    rows = []
    for r in results:
        last = r["allocated_gib"][-1] if r["allocated_gib"] else None
        ratio = f"{last / stock['allocated_gib'][-1]:.2f}" if last and stock and stock["allocated_gib"] else "-"
        rows.append([r["row"], f"{r['cuda_graph']} / {r['fused']} / {r['backend']}", f"{r['rollout_s']:.2f}",
                     f"{r['scoring_s']:.2f}",
                     f"{r['training_s']:.2f}", f"{r['step_s']:.2f}", f"{r['first_step_s']:.2f}",
                     "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
                     " ".join(f"{a:.3f}" for a in r["allocated_gib"]) or "-", ratio,
                     "-" if r["drift_mib"] is None else f"{r['drift_mib']:.1f}",
                     {True: "yes", False: "NO", None: "-"}[r["flat"]]])
    print(table(["row", "graph / fused / backend", "rollout s", "scoring s", "training s", "step s", "step 1 s",
                 "peak GiB", "allocated after each step GiB", "vs stock", "drift MiB", "flat"], rows))
    return results


if __name__ == "__main__":
    main()
