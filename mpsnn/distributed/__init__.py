"""Data-parallel training through ``torch.distributed`` (see ``docs/distributed.md``).

* `DataParallel`: the hooks a training `Graph` calls (``graph.data_parallel = ...``) to
  combine batch-normalization statistics and sum weight gradients across ranks;
* `init_distributed` / `DistributedRun`: join the run a launcher (torchrun, ``mpsnn train
  --nproc``) describes, one device per rank;
* `RankMonitor`: heartbeats in the rendezvous store, so a dead or hung rank ends the run with
  a message naming it;
* `launch_local`: start the ranks of a run on this machine and watch them.
"""

from mpsnn.distributed.data_parallel import DataParallel
from mpsnn.distributed.launch import launch_local
from mpsnn.distributed.monitor import RankMonitor
from mpsnn.distributed.runtime import DistributedRun, init_distributed

__all__ = ["DataParallel", "DistributedRun", "RankMonitor", "init_distributed", "launch_local"]
