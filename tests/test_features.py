"""Activation checkpointing and torch.compile through the engine, over real processes."""
from __future__ import annotations

import pytest
import torch

from _dist import result, run_ranks


@pytest.fixture(scope="module")
def run():
    return 2, run_ranks("cases_features:run_all", 2, timeout=600)


def close(a, b, atol=1e-5):
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-5, msg=key)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointing_changes_nothing_but_memory(run, stage):
    """shardtrain.checkpointing.checkpoint (with cpu_checkpointing) trains exactly as the
    model without it, at every stage, and keeps fewer bytes for backward."""
    for rank in range(run[0]):
        got = result(run, "checkpointing", rank)[stage]
        assert got[True]["losses"] == pytest.approx(got[False]["losses"], abs=1e-6)
        close(got[True]["params"], got[False]["params"])
    saved = result(run, "checkpointing")[0]
    assert saved[True]["saved"] < 0.7 * saved[False]["saved"], (saved[True]["saved"],
                                                                saved[False]["saved"])


@pytest.mark.parametrize("stage", [0, 3])
def test_compiled_engine_equals_eager(run, stage):
    for rank in range(run[0]):
        got = result(run, "compile", rank)[stage]
        assert got[True]["losses"] == pytest.approx(got[False]["losses"], abs=1e-4)
        close(got[True]["params"], got[False]["params"], atol=1e-4)


def test_compile_warning_once_from_rank_zero(run):
    assert len(result(run, "compile_warning", 0)["warnings"]) == 1
    assert result(run, "compile_warning", 1)["warnings"] == []
