"""Starts one run of the user's script with a generated config, under a time limit.

One process (``python SCRIPT``) or several through torchrun, in a session of its own so that a
run that hangs is stopped together with its workers. Its output goes to ``output.log`` beside
its config; the end of it explains a failed trial.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..files import write_json


class Runner:
    """Starts the user's script with a generated config, under a time limit."""

    def __init__(self, script: str, args: List[str], config_arg: str, nproc: int, timeout: float,
                 exps: Path, arg_mappings: Optional[Dict[str, str]]):
        self.script, self.args, self.config_arg = script, args, config_arg
        self.nproc, self.timeout, self.exps = nproc, timeout, exps
        self.arg_mappings = arg_mappings or {}

    def run(self, name: str, config: Dict[str, Any], env: Dict[str, str]) -> Tuple[int, str, Path]:
        """Runs one experiment; returns (exit status, the end of its output, its directory).
        Status 124 means it ran past the time limit and was stopped."""
        folder = self.exps / name
        folder.mkdir(parents=True, exist_ok=True)
        config_path = folder / "config.json"
        write_json(str(config_path), config)
        argv = self._argv(str(config_path.resolve()), config)
        log_path = folder / "output.log"
        with open(log_path, "w") as out:
            out.write("$ " + " ".join(argv) + "\n")
            out.flush()
            # A session of its own, so that a stuck run and all its workers stop together.
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
            try:
                status = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = 124
        return status, _tail(log_path), folder

    def _argv(self, config_path: str, config: Dict[str, Any]) -> List[str]:
        args = list(self.args)
        if self.config_arg in args:  # the script's own config option: point it at the trial's
            index = args.index(self.config_arg)
            args[index + 1: index + 2] = [config_path]
        else:
            args += [self.config_arg, config_path]
        for key, flag in self.arg_mappings.items():
            value = config.get(key)
            if value is not None:
                args += [flag, str(value)]
        if self.nproc == 1:
            return [sys.executable, self.script, *args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(self.nproc), "--", self.script, *args]


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]
