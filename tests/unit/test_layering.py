"""The import graph of DESIGN.md, checked on the source: each layer imports only the layers
below it, nothing in the core imports an integration, and no module imports another layer's
private (``_name``) helper. The shared internal utilities (``sparsecorr._checks``, ``_io``,
``_dist``, ``_modes``, ``_masks``, ``_ratio``) are open to every layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "sparsecorr"
SHARED = {"_checks", "_io", "_dist", "_modes", "_masks", "_ratio"}

#: layer -> the layers it may import (besides itself and the shared utilities)
ALLOWED = {
    "mismatch": set(),
    "correction": {"mismatch"},
    "losses": {"mismatch", "correction"},
    "decoding": {"mismatch"},
    "schedules": {"mismatch", "decoding"},
    # sparsecorr.sampler (SamplerSpec): the engine options every surface builds, loading a
    # BudgetSchedule file for the engine, so it sits above decoding and schedules
    "sampler": {"mismatch", "decoding", "schedules"},
    "pruning": set(),
    "commands": {"mismatch", "correction", "losses", "decoding", "schedules", "pruning", "sampler"},
}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(absolute sparsecorr module, imported names)`` for every import of the file."""
    rel = path.relative_to(SRC.parent).with_suffix("").parts
    package = list(rel[:-1])  # a module and an __init__ both live in their directory
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "sparsecorr" else None


FILES = sorted(p for p in SRC.rglob("*.py") if "demo" not in p.parts and p.name != "demo.py")


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(SRC)) for p in FILES])
def test_layers_import_only_downwards(path: Path) -> None:
    own = path.relative_to(SRC).parts[0].removesuffix(".py")
    for module, names in _imports(path):
        assert not module.startswith(("sparsecorr_trl", "sparsecorr_openrlhf")), (
            f"{path.name} imports the integration {module}")
        layer = _layer(module)
        if layer is None or layer == own or layer in SHARED or own not in ALLOWED:
            continue
        assert layer in ALLOWED[own], f"{own} must not import {module} ({path.relative_to(SRC)})"
        private = [n for n in names if n.startswith("_")]
        assert not private and not any(p.startswith("_") for p in module.split(".")[2:]), (
            f"{path.relative_to(SRC)} imports private {private or module} from another layer")


#: transformers names a module may import outside the adapter: the public loading API only
PUBLIC_TRANSFORMERS = {"AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "PreTrainedModel"}
#: spellings of transformers internals that only the adapter may use
INTERNALS = ("past_key_values", "_attn_implementation", "set_attn_implementation", "AttentionInterface",
             "cache_utils")


@pytest.mark.parametrize("path", sorted(p for p in SRC.rglob("*.py") if p.name != "hf.py"),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_only_the_adapter_touches_transformers_internals(path: Path) -> None:
    """Everything the engine needs from a Hugging Face model goes through
    ``sparsecorr.decoding.hf`` (issue 24): other modules import only transformers' public loading
    API, and name none of the internals the adapter wraps."""
    for module, names in _imports(path):
        if module == "transformers" or module.startswith("transformers."):
            assert module == "transformers" and set(names) <= PUBLIC_TRANSFORMERS, (
                f"{path.relative_to(SRC)} imports {module}:{names}; go through sparsecorr.decoding.hf")
    code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    tree = ast.parse(code)
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    docstrings = {ast.get_docstring(n) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))} - {None}
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
            {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg}
    used = {s for s in INTERNALS if s in names or any(s in t for t in strings - docstrings)}
    assert not used, f"{path.relative_to(SRC)} uses transformers internals {sorted(used)}: go through sparsecorr.decoding.hf"
