"""Reading a run's monitor files back: the records of ``metrics.jsonl``, or of the CSV
monitor's files, merged by step. This is what ``shardtrain plot`` draws, and what a notebook
reads to compare runs.

Example:
    >>> records, x = read_metrics("runs/demo")
    >>> [r["loss"] for r in records][-1]
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ._events import EVENTS, TIMER_EVENTS
from .monitors import JSONLinesMonitor

__all__ = ["read_metrics"]


def read_metrics(run_dir: str) -> Tuple[List[Dict[str, Any]], str]:
    """The records of a run directory (``output_path/job_name``), merged by step.

    Reads ``metrics.jsonl`` when present (x = step); otherwise the CSV monitor's files
    (x = global samples, as DeepSpeed writes them). The monitors append, so a file may hold
    several runs: a training record of step 1 starts a new run and only the last one is kept
    (a run resumed from a checkpoint continues its steps and stays whole).

    Returns:
        ``(records sorted by x, x-axis name "step" or "samples")``.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"no run directory {run_dir!r} (give output_path/job_name of a monitor)")
    jsonl = path / JSONLinesMonitor.filename
    if jsonl.is_file():
        merged: Dict[int, Dict[str, Any]] = {}
        for number, line in enumerate(jsonl.read_text().splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"{jsonl}:{number} is not a JSON object; is the file damaged?") from None
                if record.get("step") == 1 and "lr" in record:
                    merged = {}  # a new run
                merged.setdefault(record["step"], {}).update(record)
        return [merged[k] for k in sorted(merged)], "step"
    return _read_csv_dir(path), "samples"


def _read_csv_dir(path: Path) -> List[Dict[str, Any]]:
    names = {v.replace("/", "_") + ".csv": k for k, v in EVENTS.items()}
    names.update({v.replace("/", "_") + ".csv": ("time_ms", k) for k, v in TIMER_EVENTS.items()})
    merged: Dict[int, Dict[str, Any]] = {}
    files = sorted(path.glob("*.csv"))
    if not files:
        raise FileNotFoundError(f"{path} has neither {JSONLinesMonitor.filename} nor CSV monitor files")
    for file in files:
        key = names.get(file.name)
        for prefix, field in (("Train_Samples_memory_allocated_rank", "memory_allocated"),
                              ("Train_Samples_memory_peak_rank", "memory_peak")):
            if file.name.startswith(prefix):
                key = (field, int(file.stem[len(prefix):]))
        if key is None:
            continue
        with open(file, newline="") as f:
            for row in list(csv.reader(f))[1:]:
                record = merged.setdefault(int(float(row[0])), {"samples": int(float(row[0]))})
                value = float(row[1])
                if isinstance(key, tuple) and key[0] == "time_ms":
                    record.setdefault("time_ms", {})[key[1]] = value
                elif isinstance(key, tuple):
                    ranks = record.setdefault(key[0], [])
                    ranks.extend([None] * (key[1] + 1 - len(ranks)))
                    ranks[key[1]] = value
                else:
                    record[key] = value
    return [merged[k] for k in sorted(merged)]
