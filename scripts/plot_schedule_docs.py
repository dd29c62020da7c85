"""Regenerate the figures of docs/guides/schedules.md (tiny model, CPU, ~30 s).

    python scripts/plot_schedule_docs.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparsecorr.commands.schedule_cmds import plot_table  # noqa: E402
from sparsecorr.decoding import StreamingLLM  # noqa: E402
from sparsecorr.schedules import BudgetSchedule, CostModel, calibrate, fit_schedule  # noqa: E402
from tests.models import tiny_model  # noqa: E402

OUT = ROOT / "docs" / "assets"


def main() -> None:
    model = tiny_model("qwen3", vocab_size=64, num_layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(6.0)
    prompts = torch.randint(3, 64, (16, 4), generator=torch.Generator().manual_seed(0))
    table = calibrate(model, prompts, policy=StreamingLLM(sink=1), budgets=[4, 8, 16, 32, 48],
                      bin_size=16, n_bins=5, max_new_tokens=76, samples_per_prompt=2,
                      logprobs_topk=64)
    plot_table(table, tau=0.94, path=OUT / "calibration_tiny.png")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        print(fit_schedule(table, tau=0.94).table())
    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = [2048, 4096, 8192, 16384, 32768]
    for size in ("1.7b", "4b", "8b"):
        cm = CostModel.from_config(f"qwen3-{size}")
        s = BudgetSchedule.preset(f"sparrow-qwen3-{size}-0.86")
        ax.plot(lengths, [cm.speedup(s, n=8, l_in=512, l_out=n) for n in lengths], marker="o",
                label=f"Qwen3-{size.upper()} (model)")
    for size, measured in (("1.7B", 2.21), ("4B", 2.41), ("8B", 2.06)):
        ax.scatter([32768], [measured], marker="x", s=60, label=f"Qwen3-{size} (Sparrow, measured)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("rollout speedup over dense")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "cost_model_speedup.png", dpi=120)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
