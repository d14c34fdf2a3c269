"""DeepSpeed's hostfile: ``HOST slots=N`` per line, ``#`` comments; read by ``shardtrain run
--hostfile`` and by the alias's ``deepspeed`` command, which turn its errors into their own
(a usage error, a launcher error) with the message unchanged."""
from __future__ import annotations

import dataclasses
import re
import socket
from pathlib import Path
from typing import List, Set

__all__ = ["Host", "HostfileError", "read_hostfile", "local_names"]


@dataclasses.dataclass(frozen=True)
class Host:
    """One hostfile line."""

    name: str
    slots: int


class HostfileError(ValueError):
    """The hostfile cannot be read, or a line is not ``HOST slots=N``: the message names the
    file, the line and what to write."""


def read_hostfile(path: Path) -> List[Host]:
    """Reads DeepSpeed's hostfile format: ``HOST slots=N`` per line, ``#`` comments."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise HostfileError(f"cannot read --hostfile {str(path)!r}: {err.strerror}") from None
    hosts: List[Host] = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if not match or int(match.group(2)) < 1:
            raise HostfileError(f"{path}:{number}: expected 'HOST slots=N' with N >= 1, "
                                f"got {line!r}")
        if any(h.name == match.group(1) for h in hosts):
            raise HostfileError(f"{path}:{number}: host {match.group(1)!r} is listed twice")
        hosts.append(Host(match.group(1), int(match.group(2))))
    if not hosts:
        raise HostfileError(f"--hostfile {str(path)!r} lists no hosts ('HOST slots=N' lines)")
    return hosts


def local_names() -> Set[str]:
    """The names this host answers to in a hostfile."""
    return {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
