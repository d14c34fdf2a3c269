"""The unit lane stays in one process.

Every test here runs without a process group, a subprocess or a child process, so the lane
takes seconds. A test that starts any of them fails and belongs in ``tests/`` (the
integration lane, real processes over gloo). ``tests/conftest.py`` still applies.
"""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Callable, Iterator, List

import pytest
import torch.distributed as dist

MOVE = "unit tests run in one process; move this test to tests/ (the integration lane)"


def _refuse(what: str, attempts: List[str]) -> Callable[..., None]:
    def refused(*args, **kwargs) -> None:
        attempts.append(what)
        raise RuntimeError(f"{what} was called: {MOVE}")
    return refused


@pytest.fixture(autouse=True)
def _no_child_processes(monkeypatch) -> Iterator[None]:
    """Refuses every way of starting a process; fails the test even if the refusal was caught."""
    attempts: List[str] = []
    # Popen._execute_child is what every subprocess entry point (run, check_output, os.popen,
    # a `from subprocess import Popen` made before this fixture) ends up calling.
    monkeypatch.setattr(subprocess.Popen, "_execute_child",
                        _refuse("subprocess.Popen", attempts))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        _refuse("multiprocessing Process.start", attempts))
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}", attempts))
    yield
    if attempts:
        pytest.fail(f"{', '.join(attempts)} was called: {MOVE}", pytrace=False)


@pytest.fixture(autouse=True)
def _no_process_group() -> Iterator[None]:
    """Fails a test that leaves a default process group behind (it is destroyed first, so
    the next test starts clean). A group made before the test is not its doing."""
    if not dist.is_available():
        yield
        return
    before = dist.group.WORLD if dist.is_initialized() else None
    yield
    if dist.is_initialized() and dist.group.WORLD is not before:
        dist.destroy_process_group()
        pytest.fail(f"the test left a torch.distributed process group initialised: {MOVE}",
                    pytrace=False)
