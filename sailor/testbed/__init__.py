"""A cluster in a box: nodes as network namespaces on this machine, links shaped with tc, device
speeds as CPU quotas (cgroups), so that a plan runs over real sockets on slow, shared links.

- `spec`: the testbed file, and what it becomes for the planner (a cluster spec) and the launcher
  (HOSTS.yaml);
- `net`: names, addresses and the ip/tc commands, as data;
- `host`: bringing it up and down (root), entering a node, reading the link counters;
- `cgroups`: the cpu cgroups of nodes, ranks and communication threads, and placing ranks in them;
- `deadline`: a rank's compute thread's deadline reservation, its device's speed;
- `guard`: handing those reservations back when the kernel stops running ordinary threads;
- `ssh`: the stand-in `ssh` that `sailor launch --backend torchrun` and `sailor run --hosts` start
  ranks with.
"""

from sailor.testbed.host import (
                                 TestbedState,
                                 TestbedUnsupported,
                                 counters,
                                 down,
                                 down_all,
                                 find_state,
                                 leftovers,
                                 node_processes,
                                 support_problem,
                                 up,
)
from sailor.testbed.spec import TestbedSpec, cluster_spec, hosts_spec, load_testbed

__all__ = ["TestbedSpec", "TestbedState", "TestbedUnsupported", "cluster_spec", "counters", "down", "down_all",
           "find_state", "hosts_spec", "leftovers", "load_testbed", "node_processes", "support_problem", "up"]
