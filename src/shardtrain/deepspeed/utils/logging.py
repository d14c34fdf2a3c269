"""``deepspeed.utils.logging``: the logger and the rank-filtered log functions."""
from ...log import log_dist, log_dist_once, logger

__all__ = ["logger", "log_dist", "log_dist_once", "set_log_level_from_string", "print_json_dist"]


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Sets the level from a name (``"info"``, ``"WARNING"``, ...)."""
    (custom_logger or logger).setLevel(log_level_str.upper())


def print_json_dist(message, ranks=None, path=None) -> None:
    """Writes ``message`` (a dict) as JSON to ``path`` on the chosen ranks."""
    import json

    from ... import comm
    if ranks is None or comm.get_rank() in ranks or -1 in ranks:
        with open(path, "w") as f:
            json.dump(message, f)
