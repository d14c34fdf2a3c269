"""The unit lane's guard (tests/unit/conftest.py) fails tests that leave one process."""
from __future__ import annotations

from pathlib import Path

pytest_plugins = "pytester"

INNER_TESTS = '''
import multiprocessing, os, subprocess, sys
import torch
import torch.distributed as dist

def test_pure():
    assert torch.ones(2).sum().item() == 2

def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"])

def test_subprocess_error_swallowed():
    try:
        os.popen("true").read()
    except RuntimeError:
        pass

def test_multiprocessing():
    multiprocessing.get_context("spawn").Process(target=print).start()

def test_leaves_a_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

def test_after_the_group_was_destroyed():
    assert not dist.is_initialized()
'''


def test_guard_fails_process_starts_and_leftover_groups(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    # A refused start also fails the test body unless the test swallowed the error; the
    # guard's teardown fails every offender either way.
    result.assert_outcomes(passed=4, failed=2, errors=4)
    text = result.stdout.str()
    for name in ("test_subprocess", "test_subprocess_error_swallowed", "test_multiprocessing",
                 "test_leaves_a_process_group"):
        assert f"ERROR at teardown of {name}" in text
    assert "subprocess.Popen was called" in text
    assert "multiprocessing Process.start was called" in text
    assert "left a torch.distributed process group initialised" in text
