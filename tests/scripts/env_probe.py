"""Joins the process group from the launcher variables it finds; prints what it saw."""
import json
import sys

import torch

import shardtrain
from shardtrain import comm

shardtrain.init_distributed()
total = torch.tensor([float(comm.get_rank() + 1)])
comm.all_reduce(total)
print(json.dumps({"rank": comm.get_rank(), "world": comm.get_world_size(),
                  "local_rank": comm.get_local_rank(), "sum": total.item(),
                  "source": comm.detect_launch_env().source}))
if "--destroy" in sys.argv:
    shardtrain.destroy()
    shardtrain.destroy()  # a second call is harmless
