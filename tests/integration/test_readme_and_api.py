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


def test_core_never_imports_an_integration():
    """DESIGN layering: the core package imports no trainer and no glue package (the demo,
    which trains with TRL, lives in sparsecorr_trl)."""
    import ast

    forbidden = {"sparsecorr_trl", "sparsecorr_openrlhf", "trl", "openrlhf", "verl", "ray"}
    core = Path(sparsecorr.__file__).resolve().parent
    hits = []
    for path in core.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            hits += [f"{path.relative_to(core)}: {n}" for n in names
                     if n.split(".")[0] in forbidden]
    assert not hits, hits
    assert not list(core.glob("demo/*.py")) and not list(core.glob("assets/demo_model/*"))


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "\nmake test" in ci
