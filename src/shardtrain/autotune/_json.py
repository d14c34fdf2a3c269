"""The JSON files the autotuner and its runs hand each other (trial configs, model info,
metrics, the best config), written atomically: a run stopped mid-write (a timeout, a crash)
leaves the old file or none, never half of one for the search to read."""
from __future__ import annotations

import json
from typing import Any, Dict

from .._fileio import atomic_path


def write_json(path: str, data: Dict[str, Any]) -> None:
    """Writes ``data`` atomically (a reader never sees half a file)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
