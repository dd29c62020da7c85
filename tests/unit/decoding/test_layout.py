"""Where the decoding code lives, checked on the source.

- The engine's Triton kernels, their stock-op references and the fallback they share are one
  package, `sparsecorr.decoding.kernels`: no other module of the library imports Triton,
  registers a CUDA kernel for a custom op, or calls the fallback.
- The docstrings and comments under ``src/sparsecorr/decoding`` say what the code does, not how
  it came to be: none names an issue number or the measurement folder outside the repository.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

import sparsecorr.decoding.kernels as kernels
from sparsecorr.decoding.kernels import fallback, kv_write, votes

SRC = Path(__file__).resolve().parents[3] / "src" / "sparsecorr"
DECODING = SRC / "decoding"
KERNELS = DECODING / "kernels"
FILES = sorted(DECODING.rglob("*.py"))
OUTSIDE = sorted(p for p in SRC.rglob("*.py") if KERNELS not in p.parents)


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(SRC)) for p in paths]


def test_kernels_are_one_package() -> None:
    assert (KERNELS / "__init__.py").is_file()
    for name in ("kernels.py", "kv_write.py", "policies/votes.py"):
        assert not (DECODING / name).exists(), f"decoding/{name} belongs in decoding/kernels/"
    public = {
        "fused_or_stock": fallback, "write_kv": kv_write, "write_kv_reference": kv_write,
        "write_kv_triton": kv_write, "window_votes": votes, "votes_reference": votes, "votes_triton": votes,
    }
    assert set(kernels.__all__) == set(public)
    for name, module in public.items():
        obj = getattr(kernels, name)
        assert obj is getattr(module, name) and obj.__module__ == module.__name__
        assert module.__name__.startswith("sparsecorr.decoding.kernels.")
    # the custom ops are registered by importing the package
    assert hasattr(torch.ops.sparsecorr, "write_kv") and hasattr(torch.ops.sparsecorr, "window_votes")


@pytest.mark.parametrize("path", OUTSIDE, ids=_ids(OUTSIDE))
def test_no_triton_kernel_outside_the_kernels_package(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "triton" for a in node.names), f"{path.name} imports triton"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            assert node.module.split(".")[0] != "triton", f"{path.name} imports from triton"
        elif isinstance(node, ast.Attribute) and node.attr == "register_kernel":
            pytest.fail(f"{path.name} registers a device kernel for a custom op (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id == "fused_or_stock":
            pytest.fail(f"{path.name} uses the kernels' fallback (line {node.lineno})")


#: history in prose: an issue number, the measurement folder outside the repository, a session
HISTORY = re.compile(r"\bissues?\s*#?\s*\d+|(?<![\w&])#\d+\b|shared/gpu|\blast session\b", re.IGNORECASE)


def _prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every docstring and comment of the file."""
    text = path.read_text()
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    out.extend((tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
               if tok.type == tokenize.COMMENT)
    return out


@pytest.mark.parametrize("path", FILES, ids=_ids(FILES))
def test_docstrings_carry_no_history(path: Path) -> None:
    found = [(line, m.group(0)) for line, prose in _prose(path) for m in [HISTORY.search(prose)] if m]
    assert not found, f"{path.relative_to(SRC)}: history in a docstring or comment: {found}"


def test_the_history_pattern_catches_what_it_should() -> None:
    """The pattern above against the spellings it must catch and the prose it must let through."""
    for bad in ("(issue 36: one op)", "see issue #45", "fixed in #12", "`../shared/gpu`'s H100", "last session"):
        assert HISTORY.search(bad), bad
    for ok in ("``[B, H_kv, S]``", "about 53 kernels per layer", "RMSNorm x4 = 32", "a CUDA graph issues one launch"):
        assert not HISTORY.search(ok), ok
