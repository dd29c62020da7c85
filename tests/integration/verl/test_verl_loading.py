"""The loud plugin: verl's own entry-point loader (``verl/__init__.py``'s discovery block, which
logs a failing plugin at DEBUG only) loads sparsecorr-verl from the entry point its pyproject
declares; a changed hook signature or verl version is a WARNING or an error, never silence;
`uninstall` restores verl."""

from __future__ import annotations

import logging

import pytest

from tests.integration.verl.real_verl import source_block, verl_source

# -- the loud plugin ----------------------------------------------------------------------------

def _entry_point_dist(tmp_path):
    """A dist-info carrying the entry points written in integrations/verl/pyproject.toml (what
    ``pip install sparsecorr-verl`` records), for importlib.metadata to discover."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads(Path("integrations/verl/pyproject.toml").read_text())["project"]
    eps = project["entry-points"]["verl.plugins"]
    info = tmp_path / "sparsecorr_verl-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return eps


def _run_verl_plugin_loader(monkeypatch, tmp_path, policy="sparsecorr"):
    """Run the plugin-discovery block of verl's own ``verl/__init__.py`` (which logs a failing
    plugin at DEBUG only) against the tmp dist-info."""
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", policy)
    monkeypatch.delitem(sys.modules, "sparsecorr_verl.plugin", raising=False)
    block = source_block(verl_source("__init__.py"), "_plugins_policy = os.getenv(",
                         'logging.getLogger(__name__).debug("Failed to load plugin')
    import os

    exec(compile(block, "verl/__init__.py", "exec"), {"os": os, "logging": logging, "__name__": "verl"})


def test_entry_point_loads_the_plugin_through_verl(verl, plugin, monkeypatch, tmp_path, caplog):
    from verl.trainer.ppo import core_algos

    plugin.uninstall()
    assert "sparsecorr" not in core_algos.POLICY_LOSS_REGISTRY
    assert _entry_point_dist(tmp_path) == {"sparsecorr": "sparsecorr_verl.plugin"}
    with caplog.at_level(logging.INFO, logger="sparsecorr_verl"):
        _run_verl_plugin_loader(monkeypatch, tmp_path)
    import sparsecorr_verl.plugin as reloaded

    assert "sparsecorr" in core_algos.POLICY_LOSS_REGISTRY and reloaded.installed()
    assert any("wrapped verl.trainer.ppo.rollout_corr_helper" in r.getMessage() for r in caplog.records)


def test_broken_plugin_is_loud_through_verls_loader(verl, plugin, monkeypatch, tmp_path, caplog):
    """verl's hook with a changed signature: verl's loader swallows the error at DEBUG, but the
    plugin's own WARNING is there, and nothing was half-installed."""
    from verl.trainer.ppo import core_algos, rollout_corr_helper

    plugin.uninstall()
    original = rollout_corr_helper.compute_rollout_correction_and_add_to_batch

    def changed(batch, rollout_corr_config, *, step):  # a future verl passing one more argument
        return original(batch, rollout_corr_config)

    monkeypatch.setattr(rollout_corr_helper, "compute_rollout_correction_and_add_to_batch", changed)
    _entry_point_dist(tmp_path)
    with caplog.at_level(logging.DEBUG):
        _run_verl_plugin_loader(monkeypatch, tmp_path)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "sparsecorr_verl"]
    assert warnings and "NOT loaded" in warnings[0].getMessage()
    assert "signature changed" in warnings[0].getMessage()
    assert rollout_corr_helper.compute_rollout_correction_and_add_to_batch is changed
    assert "sparsecorr" not in core_algos.POLICY_LOSS_REGISTRY


def test_version_difference_is_a_warning_or_an_error(verl, plugin, caplog):
    from sparsecorr_verl import VerlMismatchError, check_verl
    from verl.trainer.ppo import core_algos, rollout_corr_helper

    assert check_verl(core_algos, rollout_corr_helper) == []  # the installed one is the tested one
    notes = check_verl(core_algos, rollout_corr_helper, installed="0.10.0")
    assert notes and "0.10.0" in notes[0]
    import sparsecorr_verl.check as check_mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(check_mod, "installed_verl_version", lambda: "0.10.0")
        with caplog.at_level(logging.WARNING, logger="sparsecorr_verl"):
            plugin.install()
        assert any("0.10.0" in r.getMessage() for r in caplog.records)
        with pytest.raises(VerlMismatchError, match=r"0\.10\.0"):
            plugin.install(strict=True)


def test_uninstall_restores_verl(verl, plugin):
    from verl.trainer.ppo import core_algos, rollout_corr_helper

    wrapper = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    plugin.uninstall()
    assert rollout_corr_helper.compute_rollout_correction_and_add_to_batch is wrapper._sparsecorr_original
    assert "sparsecorr" not in core_algos.POLICY_LOSS_REGISTRY
    plugin.install()
    plugin.install()  # idempotent: wraps once
    now = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    assert now._sparsecorr_original is wrapper._sparsecorr_original
