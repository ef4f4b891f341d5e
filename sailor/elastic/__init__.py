"""Elasticity: keep a job running, on the best plan, as GPUs come and go.

- `availability`: traces of GPUs per zone and type over time (CSV, JSON events, Sailor's JSON).
- `policy`: when a switch pays off (gain over the remaining work vs. the measured switch cost).
- `replan`: planning per availability, with a cache keyed on every input.
- `availability`: also what is available now (the trace minus crash losses, capped by the machines).
- `events`: the trace clock (wall or training seconds) and the JSON-lines event log.
- `remote`: the machines of HOSTS.yaml for `sailor run --hosts` (ssh per node, a dead rank's machine
  left out).
- `controller`: `sailor run`, which drives the runtime's launcher (stop, checkpoint, relaunch, resume;
  crash detection and rollback).
- `launches`: one launch as the controller watches it (the launch thread, a switch's timestamps,
  the start timeout, whom a failed launch blames).
- `replay`: `sailor replay`, a trace-driven simulation of a whole run under a policy.

Nothing here imports torch; the runtime runs in its own processes.
"""
