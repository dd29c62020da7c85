"""Issue 50 (point 4): a backend's paged and graph capabilities are declared, not probed.

Every built-in backend declares ``name``, ``paged`` and ``additive_mask``; a paged one implements
`PagedCapable`. `check_backend` (called by ``select_backend`` and the engine) checks a user's
object once: one that declares neither flag is a plain backend with boolean masks
(`DeclaredBackend`), a malformed one is refused with a ValueError naming ``backend``. After that
no step asks the backend what it has: a backend that raises on any attribute it did not declare
decodes, eagerly and through the graph step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import sparsecorr.decoding as decoding_pkg
from sparsecorr.decoding import RKV, Dense, StreamingLLM, generate
from sparsecorr.decoding.backends import (
    DeclaredBackend,
    PagedBackend,
    PagedCapable,
    ReferenceBackend,
    ReferenceDecodeKernel,
    TorchBackend,
    check_backend,
    get_backend,
    select_backend,
)
from tests.models import tiny_model

SRC = Path(decoding_pkg.__file__).parent


def _builtins():
    return [TorchBackend(), ReferenceBackend(), PagedBackend(ReferenceDecodeKernel, name="paged-oracle")]


@pytest.mark.parametrize("backend", _builtins(), ids=lambda b: b.name)
def test_every_builtin_backend_declares_its_capabilities(backend):
    for flag in ("paged", "additive_mask"):
        assert isinstance(getattr(backend, flag), bool), flag
    assert isinstance(backend.name, str)
    assert isinstance(backend, PagedCapable) == backend.paged
    assert check_backend(backend) is backend  # declared: returned as is


def test_the_flashinfer_backend_is_a_declared_paged_backend():
    from sparsecorr.decoding.backends import flashinfer

    # its class (the kernel needs CUDA; the backend object is a PagedBackend around it)
    assert "PagedBackend(FlashInferDecode" in Path(flashinfer.__file__).read_text()
    assert PagedBackend.paged is True and PagedBackend.additive_mask is False


class _Plain:
    """A user's backend: ``attend`` only (and a name)."""

    name = "plain"

    def __init__(self) -> None:
        self.calls = 0
        self._ref = ReferenceBackend()

    def attend(self, *args, **kwargs):
        self.calls += 1
        return self._ref.attend(*args, **kwargs)


def test_an_undeclared_user_backend_is_a_plain_bool_mask_backend():
    user = _Plain()
    back, label = select_backend(user)
    assert isinstance(back, DeclaredBackend) and back.backend is user
    assert (back.paged, back.additive_mask, label) == (False, False, "plain")
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    kw = dict(policy=RKV(window=2, buffer=2), budget=6, max_new_tokens=8, temperature=0, prefill_chunk=3)
    got = generate(model, ids, backend=user, **kw)
    ref = generate(model, ids, backend="reference", **kw)
    assert user.calls > 0 and got.meta["backend"] == "plain"
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.rollout_logp, ref.rollout_logp, atol=1e-6, rtol=0)


def test_a_declared_user_backend_is_returned_as_is():
    class Declared(_Plain):
        paged = False
        additive_mask = False

    user = Declared()
    assert get_backend(user) is user and select_backend(user)[1] == "plain"


@pytest.mark.parametrize("make, message", [
    (lambda: type("HalfPaged", (_Plain,), {"paged": True, "additive_mask": False})(),
     r"^backend: declares paged = True, so expected the methods \['begin_step', 'decode', 'enable_graph', "
     r"'reset_graph'\], got HalfPaged without \['begin_step', 'decode', 'enable_graph', 'reset_graph'\]"),
    (lambda: type("OneFlag", (_Plain,), {"paged": False})(),
     r"^backend: expected both paged and additive_mask declared .*got OneFlag without additive_mask"),
    (lambda: type("IntFlag", (_Plain,), {"paged": 1, "additive_mask": False})(),
     r"^backend: expected paged to be a bool, got 1 on IntFlag"),
    (lambda: type("NoAttend", (), {"attend": None, "name": "x"})(),
     r"^backend: expected a backend name or an object with an attend method, got NoAttend"),
])
def test_a_malformed_backend_is_refused_naming_backend(make, message):
    with pytest.raises(ValueError, match=message):
        check_backend(make())


def test_a_paged_user_backend_missing_one_method_names_it():
    class AlmostPaged(PagedBackend):
        enable_graph = None  # not callable

    with pytest.raises(ValueError, match=r"without \['enable_graph'\]"):
        select_backend(AlmostPaged(ReferenceDecodeKernel, name="almost"))


class _Strict:
    """Declares its capabilities; any other attribute read fails the test (a probe)."""

    name = "strict"
    paged = False
    additive_mask = True

    def __init__(self) -> None:
        object.__setattr__(self, "_torch", TorchBackend())

    def attend(self, *args, **kwargs):
        return self._torch.attend(*args, **kwargs)

    def __getattr__(self, attr: str):
        raise AssertionError(f"the backend was probed for {attr!r}")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("policy", [Dense(), StreamingLLM(sink=1, buffer=2)], ids=lambda p: p.name)
def test_no_step_probes_the_backend(policy, graph, cpu_graphs):
    model = tiny_model("qwen3", num_layers=2)
    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(policy=policy, budget=None if policy.name == "dense" else 5, max_new_tokens=7, temperature=0,
              eos_token_id=[9, 40], cuda_graph=graph)
    got = generate(model, ids, backend=_Strict(), **kw)
    ref = generate(model, ids, backend="torch", **kw)
    assert got.meta["cuda_graph"] == ("on" if graph else "off")
    assert torch.equal(got.tokens, ref.tokens)


@pytest.mark.parametrize("module", ["engine.py", "cache.py", "graphs.py", "runner.py"])
def test_no_getattr_or_hasattr_probe_on_a_backend_remains(module):
    text = (SRC / module).read_text()
    probes = re.findall(r"(?:getattr|hasattr)\([^)]*backend[^)]*\)", text)
    allowed = ["getattr(self._backend, name)"]  # _Features forwards what the backend declared
    assert [p for p in probes if p not in allowed] == []
