"""The README's example runs as written, and the flat API exposes every layer."""

import re
import subprocess
import sys
from pathlib import Path

import sparsecorr

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["out"].loss.requires_grad is False or namespace["out"].loss.grad_fn is not None
    assert "correction/ess" in namespace["out"].metrics


def test_flat_api_and_fast_import():
    for name in ("sparse_grpo", "group_advantages", "sparse_rl", "tis", "mismatch_metrics",
                 "token_logprobs", "balanced_keep", "Pruner", "generate", "RolloutBatch", "RKV"):
        assert name in sparsecorr.__all__ and getattr(sparsecorr, name) is not None
    code = "import sys, sparsecorr; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # decoding (and transformers) load lazily
