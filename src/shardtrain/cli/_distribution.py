"""The ``deepspeed`` alias distribution: built here, installed into this Python only.

Libraries such as the Hugging Face Trainer, Accelerate and Lightning import ``deepspeed``
themselves and read its installed version, so an import in the user's own script cannot
redirect them. The alias is a tiny distribution named ``deepspeed`` whose one module hands
``import deepspeed`` over to :mod:`shardtrain.deepspeed`. Its version is DeepSpeed's, with
a local label (``0.19.8+shardtrain.0.1.0``): version checks pass, and ``pip list`` says what
it is. Package indexes refuse local labels, and the name belongs to another project: the
wheel is built on the spot, in a temporary folder, and never meant to leave the machine.

Installing it where DeepSpeed itself is installed replaces DeepSpeed (one distribution owns
the ``deepspeed`` name), so :func:`install` refuses unless asked to ``replace`` and then says
what it replaced and how to bring it back.

It lives with the command that builds and installs it (``shardtrain deepspeed-alias``:
:mod:`._alias`); :mod:`shardtrain.deepspeed` reads its version from here
(:func:`alias_version` and :data:`DEEPSPEED_VERSION`, which :mod:`shardtrain.cli` exports),
so that imports between the two go one way: the alias tree, whose ``deepspeed`` and
``ds_report`` commands run this package's, over the command line.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from .. import __version__ as _shardtrain_version

NAME = "deepspeed"
#: the DeepSpeed release whose API and config this tree follows
DEEPSPEED_VERSION = "0.19.8"
_LABEL = "shardtrain"

_PACKAGE_INIT = '''\
"""deepspeed: an alias of shardtrain (``shardtrain.deepspeed``), not DeepSpeed itself.

Installed by ``shardtrain deepspeed-alias install`` so that libraries which import deepspeed
(the Hugging Face Trainer, Accelerate, Lightning, DeepSpeed-style scripts) train on
shardtrain. ``shardtrain deepspeed-alias uninstall`` removes it.
"""
from shardtrain.deepspeed._alias import install as _install

_install(__name__)
'''

_SCRIPTS = {
    "deepspeed": "shardtrain.deepspeed.launcher.runner:main",
    "ds_report": "shardtrain.deepspeed.env_report:main",
}


def alias_version() -> str:
    """``0.19.8+shardtrain.<shardtrain's version>``."""
    return f"{DEEPSPEED_VERSION}+{_LABEL}.{_shardtrain_version}"


def is_alias_version(version: str) -> bool:
    return f"+{_LABEL}" in version


@dataclasses.dataclass(frozen=True)
class Installed:
    """The ``deepspeed`` distribution this Python has."""

    version: str
    location: str

    @property
    def is_alias(self) -> bool:
        return is_alias_version(self.version)


def installed() -> Optional[Installed]:
    """The installed ``deepspeed`` distribution (the alias or DeepSpeed itself), or None."""
    try:
        dist = importlib.metadata.distribution(NAME)
    except importlib.metadata.PackageNotFoundError:
        return None
    location = str(dist.locate_file(""))
    return Installed(dist.version, location)


def status_line() -> str:
    """One line for ``shardtrain info``: which ``deepspeed`` an import gives, and the undo."""
    found = installed()
    if found is None:
        return ("not installed; `shardtrain deepspeed-alias install` lets libraries that "
                "import deepspeed run on shardtrain")
    if found.is_alias:
        return (f"the shardtrain alias {found.version} (import deepspeed runs "
                f"shardtrain.deepspeed); undo: shardtrain deepspeed-alias uninstall")
    return (f"DeepSpeed {found.version} itself ({found.location}); "
            f"`shardtrain deepspeed-alias install --replace` would replace it with the alias")


# -- the wheel ------------------------------------------------------------------------------


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _wheel_files() -> List[Tuple[str, bytes]]:
    version = alias_version()
    info = f"{NAME}-{version}.dist-info"
    metadata = "\n".join([
        "Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {version}",
        "Summary: Alias of shardtrain for libraries that import deepspeed; not DeepSpeed. "
        "Built locally by `shardtrain deepspeed-alias install`; never upload it.",
        f"Requires-Dist: shardtrain=={_shardtrain_version}", "", ""])
    wheel = "\n".join(["Wheel-Version: 1.0", f"Generator: shardtrain {_shardtrain_version}",
                       "Root-Is-Purelib: true", "Tag: py3-none-any", "", ""])
    scripts = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in _SCRIPTS.items())
    return [(f"{NAME}/__init__.py", _PACKAGE_INIT.encode()),
            (f"{info}/METADATA", metadata.encode()), (f"{info}/WHEEL", wheel.encode()),
            (f"{info}/entry_points.txt", scripts.encode())]


def build_wheel(directory: Path) -> Path:
    """Writes the alias wheel into ``directory`` and returns its path."""
    files = _wheel_files()
    info = f"{NAME}-{alias_version()}.dist-info"
    record = "\n".join([_record_line(p, d) for p, d in files] + [f"{info}/RECORD,,", ""])
    path = Path(directory) / f"{NAME}-{alias_version()}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in files + [(f"{info}/RECORD", record.encode())]:
            archive.writestr(name, data)
    return path


# -- install and uninstall ---------------------------------------------------------------


class AliasError(RuntimeError):
    """The alias cannot be installed or removed as asked; the message says why and what to do."""


def _pip(*args: str) -> List[str]:
    return [sys.executable, "-m", "pip", *args]


def install(replace: bool = False, say: Callable[[str], None] = print,
            run: Callable[[List[str]], int] = lambda argv: subprocess.call(argv)) -> None:
    """Builds the alias wheel and installs it into this Python with pip (offline).

    Args:
        replace: allow replacing DeepSpeed itself when it is installed.
        say: where the progress lines go.
        run: runs a command line, returns its exit status (pip's).
    """
    found = installed()
    if found is not None and not found.is_alias and not replace:
        raise AliasError(
            f"DeepSpeed {found.version} is installed ({found.location}). The alias takes the "
            f"name deepspeed, so installing it uninstalls DeepSpeed and every `import deepspeed` "
            f"then runs shardtrain. To do that, run `shardtrain deepspeed-alias install "
            f"--replace`; `pip install deepspeed=={found.version}` brings DeepSpeed back.")
    if found is not None and not found.is_alias:
        say(f"Replacing DeepSpeed {found.version} ({found.location}) with the shardtrain alias "
            f"{alias_version()}. To undo: shardtrain deepspeed-alias uninstall && "
            f"pip install deepspeed=={found.version}")
    with tempfile.TemporaryDirectory(prefix="shardtrain-alias-") as tmp:
        wheel = build_wheel(Path(tmp))
        status = run(_pip("install", "--no-deps", "--no-index", "--force-reinstall",
                          "--disable-pip-version-check", "-q", str(wheel)))
    if status != 0:
        raise AliasError(f"pip could not install the alias wheel (exit status {status}); "
                         f"its output is above. `{sys.executable} -m ensurepip` installs pip "
                         f"where it is missing.")
    say(f"Installed deepspeed {alias_version()}: `import deepspeed` now runs shardtrain "
        f"(shardtrain.deepspeed). Undo: shardtrain deepspeed-alias uninstall")


def uninstall(say: Callable[[str], None] = print,
              run: Callable[[List[str]], int] = lambda argv: subprocess.call(argv)) -> None:
    """Removes the alias; refuses to touch DeepSpeed itself."""
    found = installed()
    if found is None:
        say("No deepspeed distribution is installed; nothing to remove.")
        return
    if not found.is_alias:
        raise AliasError(f"The installed deepspeed is DeepSpeed {found.version} itself, not the "
                         f"shardtrain alias; leaving it alone (`pip uninstall deepspeed` removes it).")
    status = run(_pip("uninstall", "-y", "-q", "--disable-pip-version-check", NAME))
    if status != 0:
        raise AliasError(f"pip could not uninstall the alias (exit status {status}).")
    say(f"Removed the shardtrain alias deepspeed {found.version}.")
