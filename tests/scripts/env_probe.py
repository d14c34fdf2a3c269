"""Joins the process group from the launcher variables it finds; prints what it saw."""
import json
import sys

import torch

import shardtrain
from shardtrain import comm

shardtrain.init_distributed()
total = torch.tensor([float(comm.get_rank() + 1)])
comm.all_reduce(total)
ops = {}  # rank r holds r + 1 (r + 2 for the asynchronous average)
for name, op in [("max", "max"), ("min", "MIN"), ("product", "product"), ("avg", "avg"),
                 ("ReduceOp.SUM", comm.ReduceOp.SUM), ("ReduceOp.AVG", comm.ReduceOp.AVG)]:
    value = torch.tensor([float(comm.get_rank() + 1)])
    comm.all_reduce(value, op=op, group=None)
    ops[name] = value.item()
value = torch.tensor([float(comm.get_rank() + 2)])
comm.all_reduce(value, "avg", async_op=True).wait()
ops["async avg"] = value.item()
print(json.dumps({"rank": comm.get_rank(), "world": comm.get_world_size(),
                  "local_rank": comm.get_local_rank(), "sum": total.item(), "ops": ops,
                  "source": comm.detect_launch_env().source}))
if "--destroy" in sys.argv:
    shardtrain.destroy()
    shardtrain.destroy()  # a second call is harmless
