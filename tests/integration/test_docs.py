"""The documentation is true to what mkdocs renders: no Sphinx roles (mkdocstrings renders them
as raw text), math and fonts served by the site itself (it works offline), and the Benchmarks
page is benchmarks/RESULTS.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|obj|exc|ref|doc|const|term):`")
SOURCES = ("src", "integrations", "docs", "README.md", "benchmarks", "scripts")


def _files():
    for entry in SOURCES:
        path = ROOT / entry
        files = [path] if path.is_file() else [*path.rglob("*.py"), *path.rglob("*.md")]
        yield from (f for f in files if "vendor" not in f.parts)


def test_no_sphinx_roles_remain():
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
            for f in _files()
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
            if ROLE.search(line)]
    assert not hits, "Sphinx roles render as raw text in mkdocs; use backticks or " \
                     "[`name`][sparsecorr.module.name]:\n" + "\n".join(hits)


def test_mkdocs_config_loads_nothing_from_the_network():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert cfg["theme"].get("font") is False, "mkdocs-material fetches Google Fonts unless font: false"
    for key in ("extra_javascript", "extra_css"):
        for item in cfg.get(key, []):
            src = item if isinstance(item, str) else item["path"]
            assert "://" not in src, f"{key}: {src} is loaded from the network"
            assert (ROOT / "docs" / src).is_file(), f"{key}: {src} is missing"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_built_site_is_self_contained(site):
    external = re.compile(r'<(?:script|img)[^>]*\ssrc="https?://|<link[^>]*\shref="https?://')
    bad = [str(p.relative_to(site)) for p in site.rglob("*.html") if external.search(p.read_text())]
    assert not bad, f"pages loading resources from the network: {bad}"
    assert (site / "javascripts" / "vendor" / "mathjax" / "tex-chtml.js").is_file()
    fonts = site / "javascripts" / "vendor" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2"
    assert any(fonts.glob("*.woff"))
    rendered_roles = [str(p.relative_to(site)) for p in site.rglob("*.html")
                      if re.search(r":(?:func|mod|class|meth|attr|data):(?:<code>|`)", p.read_text())]
    assert not rendered_roles, rendered_roles


def test_benchmarks_page_renders_results_md(site):
    html = (site / "benchmarks" / "index.html").read_text()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    headings = re.findall(r"^## (.+)$", results, flags=re.M)
    assert headings
    for heading in headings:
        words = re.sub(r"[`*]", "", heading).split()[0]
        assert words in html, f"RESULTS.md section {heading!r} missing from the Benchmarks page"
    assert "--8&lt;--" not in html and "--8<--" not in html


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOTTED = re.compile(r"`(sparsecorr(?:_trl|_openrlhf)?(?:\.[A-Za-z_]\w*)+)`")
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")


def _commands(text: str) -> list[str]:
    """What follows ``sparsecorr `` in code: fenced-block lines and inline code spans."""
    snippets = [line for block in FENCED.findall(text) for line in block.splitlines()]
    snippets += INLINE.findall(FENCED.sub("", text))
    out = []
    for snip in snippets:
        snip = snip.split("#")[0].strip().removeprefix("$ ")
        if snip.startswith("sparsecorr "):
            out.append(snip.removeprefix("sparsecorr "))
    return out


def _resolve(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_dotted_name_in_the_docs_exists():
    pytest.importorskip("trl")
    missing = sorted({f"{doc.relative_to(ROOT)}: {name}" for doc in DOCS
                      for name in DOTTED.findall(doc.read_text()) if not _resolve(name)})
    assert not missing, "the docs name things that do not exist:\n" + "\n".join(missing)


def test_every_cli_invocation_in_the_docs_parses():
    """Each ``sparsecorr COMMAND ...`` in the docs names a real subcommand and real options."""
    from sparsecorr.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    wrong = []
    for doc in DOCS:
        for line in _commands(doc.read_text()):
            words = [w.strip("[]") for w in line.split()]
            if not words or words[0].startswith("-") or words[0].isupper() or words[0].endswith(":"):
                continue  # `sparsecorr --help`, `sparsecorr COMMAND --help`, an error line
            name, rest = words[0], words[1:]
            parser = sub.choices.get(name)
            if parser is None:
                wrong.append(f"{doc.relative_to(ROOT)}: no subcommand {name!r}: sparsecorr {line}")
                continue
            flags = set(parser._option_string_actions)
            positional = any(not a.option_strings for a in parser._actions)
            for w in rest:
                flag = w.split("=")[0]
                if flag.startswith("--") and flag not in flags:
                    wrong.append(f"{doc.relative_to(ROOT)}: {name} has no {flag}")
            if rest and not rest[0].startswith("-") and not positional and rest[0] != "...":
                wrong.append(f"{doc.relative_to(ROOT)}: {name} takes no {rest[0]!r}: "
                             f"sparsecorr {line.strip()}")
    assert not wrong, "\n".join(wrong)
