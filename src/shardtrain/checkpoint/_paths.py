"""Which paths a checkpoint may name, and which files a load may open.

A checkpoint is often copied from somewhere else, so nothing in it is trusted to point at a
file: a tag is a plain directory name, every file name comes from a fixed pattern, and a
path is opened only when it resolves (symbolic links included) inside the checkpoint
directory and is a regular file. A FIFO or a device in place of a checkpoint file is refused
without being opened (opening a FIFO would block the rank forever), and no message quotes
the content of a file that is not a checkpoint file.
"""
from __future__ import annotations

import os
import re
import stat
from typing import Optional

from ._agreement import Problem
from ._format import LATEST, REPLACED, TMP

__all__ = ["is_plain_tag", "check_tag", "RANK_FILE", "inside", "regular_file", "read_latest"]

#: The only file names a tag directory holds besides meta.json.
RANK_FILE = re.compile(r"rank(\d{5})\.(safetensors|json|client\.pt)")
_LATEST_MAX = 4096  # a tag name; more than this is not a `latest` file


def is_plain_tag(tag: str) -> bool:
    """A directory name and nothing else: no separator, not ``.``/``..``, not a name the save
    itself uses for its temporary directories."""
    return bool(tag) and tag not in (".", "..", LATEST) and "/" not in tag and "\\" not in tag \
        and os.sep not in tag and "\0" not in tag and TMP not in tag and REPLACED not in tag


def check_tag(tag: str, where: str) -> None:
    if not is_plain_tag(tag):
        raise Problem(ValueError, f"{where}: tag {tag!r} is not a plain directory name inside the "
                                  f"checkpoint directory (no '/', '\\\\', '..', 'latest', '{TMP}' or "
                                  f"'{REPLACED}'); pass the name of a tag directory.")


def inside(path: str, root: str) -> bool:
    """``path`` resolves (symbolic links followed) to ``root`` or below it."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def regular_file(path: str, root: str) -> Optional[os.stat_result]:
    """Checks that ``path`` may be opened: inside ``root`` and a regular file. Returns its
    stat, or None when it does not exist."""
    try:
        info = os.stat(path)  # follows links: the file that would be opened
    except FileNotFoundError:
        return None
    if not inside(path, root):
        raise Problem(ValueError, f"{path} resolves to a file outside {root}: a checkpoint's "
                                  "files must lie inside its directory; copy the file there "
                                  "instead of linking to it.")
    if not stat.S_ISREG(info.st_mode):
        raise Problem(ValueError, f"{path} is not a regular file (a directory, FIFO or device): "
                                  "it is not a checkpoint file; remove it, then re-save or copy "
                                  "the checkpoint again.")
    return info


def read_latest(load_dir: str) -> Optional[str]:
    """The tag that ``<load_dir>/latest`` names; None when there is no ``latest``. Its content
    is quoted in an error only when it is a plain tag name."""
    path = os.path.join(load_dir, LATEST)
    if os.path.islink(path):
        raise Problem(ValueError, f"{path} is a symbolic link; `latest` must be a file inside "
                                  f"{load_dir} holding a tag name: replace it, or pass tag=.")
    info = regular_file(path, load_dir)
    if info is None:
        return None
    if info.st_size > _LATEST_MAX:
        raise Problem(ValueError, f"{path} holds {info.st_size} bytes, not a tag name; pass "
                                  "tag= to name the checkpoint.")
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace").strip()
    if not is_plain_tag(text):
        raise Problem(ValueError, f"{path} holds {len(text)} characters that are not a plain tag "
                                  "name; pass tag= to name the checkpoint.")
    return text
