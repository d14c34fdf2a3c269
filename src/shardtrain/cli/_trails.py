"""``shardtrain trails``: the collective trails that ranks left behind, compared.

Each rank keeps its last collectives in a file (:func:`shardtrain.comm.trail`); a rank that ends
without ``shardtrain.destroy()`` (killed, aborted by NCCL's watchdog, an exception) leaves
it. When no rank lived to report, this command reads the files of one machine (or of many,
copied into one folder) and names the first collective at which the ranks differ.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Any, Dict, List

from .. import comm
from ._common import _Failure

_EXAMPLES = """\
examples:
  shardtrain trails                        # this machine's trail folder
  shardtrain trails /shared/run7-trails    # files copied there from every node
  shardtrain trails --json
"""
_NAME = re.compile(r"rank(\d+)-pid(\d+)\.trail")
_SPREAD_S = 600  # files written further apart than this come from different runs


def add_parser(commands) -> None:
    p = commands.add_parser(
        "trails", help="compare the collective trails ranks left behind",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Reads the trail files (rank<R>-pid<P>.trail) in FOLDER, the newest of "
                    "each rank, and names the first collective at which the ranks differ: "
                    "what a job that ended without a report was doing.",
        epilog=_EXAMPLES)
    p.add_argument("folder", nargs="?", default=None,
                   help="where the files are (default: $SHARDTRAIN_TRAIL_DIR or this user's "
                        "folder in the temporary directory)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(handler=_cmd_trails, subparser=p)


def _cmd_trails(args: argparse.Namespace) -> int:
    folder = args.folder or comm.trail_dir()
    files = _newest_per_rank(folder)
    if not files:
        raise _Failure(f"no trail files (rank<R>-pid<P>.trail) in {folder}: every rank of the "
                       "last jobs ended cleanly, or they ran on another machine (copy their "
                       "files here, or pass the folder that holds them).")
    trails = {rank: comm.read_trail(f["path"]) for rank, f in files.items()}
    diff = comm.first_difference(trails)
    ended = [r for r, f in files.items() if f["ended"]]
    report = {"folder": folder, "ranks": [_rank_row(r, files[r], trails[r]) for r in files],
              "first_difference": None if diff is None else diff.explain(ended),
              "spread_seconds": _spread(files)}
    print(json.dumps(report, indent=2) if args.json else _text(report))
    return 0


def _newest_per_rank(folder: str) -> Dict[int, Dict[str, Any]]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return {}
    found: Dict[int, Dict[str, Any]] = {}
    for name in names:
        match = _NAME.fullmatch(name)
        if not match:
            continue
        path = os.path.join(folder, name)
        rank, pid, mtime = int(match.group(1)), int(match.group(2)), os.path.getmtime(path)
        if rank not in found or mtime > found[rank]["mtime"]:
            found[rank] = {"path": path, "pid": pid, "mtime": mtime, "ended": comm.process_gone(pid)}
    return dict(sorted(found.items()))


def _rank_row(rank: int, f: Dict[str, Any], entries: List[comm.TrailEntry]) -> Dict[str, Any]:
    last = entries[-1] if entries else None
    return {"rank": rank, "file": f["path"], "pid": f["pid"], "ended": f["ended"],
            "written": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f["mtime"])),
            "records": len(entries), "last": None if last is None else
            f"#{last.seq} over the {last.group} group: {last.describe()}"}


def _spread(files: Dict[int, Dict[str, Any]]) -> float:
    times = [f["mtime"] for f in files.values()]
    return max(times) - min(times)


def _text(report: Dict[str, Any]) -> str:
    lines = [f"trails in {report['folder']}:"]
    for row in report["ranks"]:
        state = "ended" if row["ended"] else "running"
        lines.append(f"  rank {row['rank']} (pid {row['pid']}, {state}, written "
                     f"{row['written']}): {row['records']} records; last {row['last']}")
    if report["spread_seconds"] > _SPREAD_S:
        lines.append(f"note: the files were written {report['spread_seconds'] / 60:.0f} "
                     "minutes apart: they may come from different runs.")
    lines.append(report["first_difference"] or
                 "The trails agree as far as they overlap: the ranks issued the same "
                 "collectives (a lost rank or the network, not a different path).")
    return "\n".join(lines)
