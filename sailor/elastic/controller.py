"""`sailor run`: keep a training job running, on the best plan, while GPUs come and go.

The loop (`run`), on the `local` provider (every "GPU" is a process of `sailor train`'s runtime on
this machine) or with `hosts` on the machines of HOSTS.yaml (`sailor.elastic.remote`; a crash takes
the dead rank's machine out too): a pool of rank processes that live across switches
(`sailor.elastic.inplace`; on machines one ssh session per rank), or with `--restart` one launch per
plan (`sailor.runtime.launcher`: a local torchrun, or one ssh session per node running its torchrun
agents):

1. Plan for the availability now (trace snapshot, minus GPUs lost to crashes) and launch, resuming
   from the newest checkpoint in the checkpoint folder that passes its checksums.
2. While it trains, watch the trace clock. On a change, re-plan (`Replanner`, cached) and apply the
   switch rule (`policy.decide`): always when the running plan lost GPUs, else when the expected gain
   over the remaining steps beats the measured switch cost. To switch (by default,
   `RunOptions.switches_live`): hand the new plan to the live pool (`inplace.InPlaceRun`), whose
   ranks stop at the step boundary and move their state in memory to the new plan's ranks, keeping
   their processes. Else (`--restart`): create the stop file; the ranks finish the step, write a
   checkpoint and exit; relaunch with the new plan and resume.
3. When the job fails (a rank died: SIGKILL, a fault), the launcher returns within about a second
   (torchrun's monitor); the dead ranks' GPUs are treated as gone until the trace reports a
   different count for their (zone, GPU type); re-plan on the survivors and resume from the last
   checkpoint: the steps after it are rolled back and trained again (and written to the metrics
   again). A launch whose process groups do not form within `start_timeout_s`, or a live switch whose
   new processes are not all started by then, is ended as failed.
4. SIGTERM/SIGINT: stop at a step boundary with a checkpoint, exit 3 (at once while a launch is
   still starting: it has nothing new to save); a second signal kills the job, exit 130.

Time: trace second t happens `t x time_scale` wall seconds after the controller starts, or, with the
`training` clock, after `t x time_scale` seconds spent in training steps (`Clock`).
Step accounting: a step is "kept" once it is in the trajectory that ends the run; the checkpoint a
run resumes from fixes the step it continues at, and data order depends only on (seed, step), so the
kept trajectory has every step 1..N exactly once with the same samples as an uninterrupted run.

Events (`--events`, one JSON line each, all with `time_s` since the controller started and
`trace_time_s`): start, machines (with hosts), availability, plan, launch, decision, switch_started,
switch_finished (seconds of each phase; a live switch's state bytes moved and `spares_used`, its new
ranks handed to spares; `pids_before` and `pids`, rank -> process id under each plan), crash (with hosts: the
machines), rollback, checkpoint_skipped, waiting, start_timeout, done / stopped / killed / failed.

What the loop reads of one launch (its thread, a switch's timestamps, the start timeout, whom a
failure blames) is in `sailor.elastic.launches`.

This module never imports torch: the runtime runs in other processes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from sailor.core.errors import InfeasibleError, SailorInputError
from sailor.core.limits import max_local_processes
from sailor.core.scratch import scratch_dir
from sailor.elastic.availability import Availability, Zones
from sailor.elastic.events import POLL_S, Clock, EventLog
from sailor.elastic.inplace import InPlaceRun
from sailor.elastic.launches import (
    START_TIMEOUT,
    Running,
    Switch,
    dead_ranks,
    failed_machines,
    kill_children,
    starting_since,
)
from sailor.elastic.options import RunOptions, RunResult, check_run, offered
from sailor.elastic.policy import SwitchCosts, decide, lost_gpus
from sailor.elastic.replan import Planned, Replanner
from sailor.elastic.switch_cost import LiveSwitchModel
from sailor.plan.placement import rank_layout
from sailor.runtime.launcher import ExitStatus, TrainResult
from sailor.runtime.prepare import TrainOptions, prepare

MAX_FAILED_LAUNCHES = 3  # launches in a row that fail before completing a step: then give up


class Controller:
    """The `sailor run` loop (module docstring). Use `run(options)`."""

    def __init__(self, options: RunOptions) -> None:
        check_run(options)
        o = options
        self.o = o
        self.clock = Clock(o.time_scale, o.clock)
        self.log = EventLog(o.events, self.clock, o.on_event)
        self.replanner = Replanner(o.job, o.cluster, profiles_path=o.profiles, network_path=o.network)
        self.costs = SwitchCosts(fixed_s=o.switch_cost_s)
        self.avail = Availability(o.trace, o.hosts)
        self.result = RunResult(ExitStatus.FAILED, "", steps=0)
        self.signals = 0
        self.current: Planned | None = None
        self.running: Running | None = None
        self.switch: Switch | None = None
        self.step_times: list[float] = []  # step_time_s of the current launch
        self.pids: dict[int, int] = {}  # rank -> process id of the running plan's ranks ("joined" events)
        self.changed = False  # the availability changed during a live switch: look again after it
        # most processes at once: a live pool keeps that many (ranks and spares)
        self.most = min(max(s.total() for s in o.trace.snapshots), max_local_processes())
        self.ratio = 1.0  # measured / predicted iteration time, from the last plan that ran
        self.failed_launches = 0
        self.last_step_at = 0.0  # monotonic time of the last step event
        self.reported: tuple[Zones, dict] | None = None  # availability (and lost machines) last logged

    # ---- top level -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Run until every step is done, the job cannot continue, or a stop is requested.

        Returns:
            RunResult (status DONE, FAILED or STOPPED).
        Raises:
            SailorInputError: a checkpoint made for another job or seed, a bad option.
        """
        old = {}
        if threading.current_thread() is threading.main_thread():
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        with contextlib.ExitStack() as stack:
            ckpt_dir = self.o.checkpoint_dir or stack.enter_context(scratch_dir("sailor-ckpt-"))
            self.ckpt_dir = str(Path(ckpt_dir).resolve())
            if self.o.hosts is None:
                self.work = stack.enter_context(scratch_dir("sailor-run-"))
            else:  # the plan and the stop file must be where every host sees them
                self.work = os.path.join(self.ckpt_dir, "control")
                os.makedirs(self.work, exist_ok=True)
            try:
                self.log.emit("start", steps=self.o.steps, seed=self.o.seed, checkpoint_dir=self.ckpt_dir,
                              model=self.o.job.model.name, global_batch_size=self.o.job.global_batch_size)
                if self.o.hosts is not None:
                    self._report_machines()
                self._loop()
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
                if self.running is not None and not self.running.done():
                    self.running.stop()
                    kill_children()
                    self.running.thread.join(timeout=10)
        return self.result

    def _report_availability(self) -> Zones:
        """The effective availability; logged when it differs from what was logged last."""
        zones = self.avail.zones()
        machines = {"machines_lost": sorted(self.o.hosts.host(m) for m in self.avail.lost_machines)} \
            if self.o.hosts else {}
        if (zones, machines) != self.reported:
            self.log.emit("availability", zones=zones, lost_to_crashes=_lost(self.avail.lost), **machines)
            self.reported = (zones, machines)
        return zones

    def _report_machines(self) -> None:
        """Log the machines per (zone, GPU type), and the trace's pairs that have none (never used)."""
        pool = self.o.hosts
        machines = {f"{g.gpu}@{g.zone}": len(g.hosts) for g in pool.hosts.groups}
        offered_at = {f"{g}@{z}" for z, g in offered(self.o.trace)}
        self.log.emit("machines", machines=machines, gpus_per_machine=pool.node_size,
                      offered_without_machines=sorted(offered_at - set(machines)),
                      machines_never_offered=sorted(set(machines) - offered_at))

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.running is not None:
            self.running.stop()
        if self.signals >= 2:
            kill_children()

    def _loop(self) -> None:
        while True:
            if self.signals:
                return self._finish(ExitStatus.STOPPED, "stopped on request before any step ran")
            self.avail.advance(self.clock.trace_s())
            zones = self._report_availability()
            planned = self._plan(zones)
            if planned is None:
                wait = self.avail.next_change_s()
                if wait is None:
                    return self._finish(ExitStatus.FAILED, "no plan fits the GPUs left and the trace brings no more")
                self.log.emit("waiting", until_trace_time_s=wait)
                self.clock.wait_until(wait, lambda: self.signals)
                continue
            self.current = planned
            outcome = self._train()
            if outcome is not None:
                return outcome

    # ---- planning ------------------------------------------------------------------------------
    def _plan(self, zones: Zones) -> Planned | None:
        try:
            planned = self.replanner.plan(zones)
        except InfeasibleError as e:
            self.log.emit("plan", feasible=False, reason=e.one_line())
            return None
        est = planned.estimate
        self.log.emit("plan", feasible=True, world_size=planned.plan.world_size,
                      predicted_iteration_s=est.iteration_time_s,
                      predicted_throughput_iters_per_s=est.throughput_iters_per_s,
                      predicted_samples_per_s=est.samples_per_s, cost_per_iteration_usd=est.cost_per_iteration_usd,
                      cost_per_hour_usd=est.cost_per_hour_usd, replan_s=planned.replan_s, cached=planned.cached,
                      plan=planned.plan.to_dict(with_specs=False))
        return planned

    # ---- one launch ----------------------------------------------------------------------------
    def _train(self) -> None | bool:
        """Launch the current plan and watch it until it ends; returns None to plan and launch again."""
        plan_file = os.path.join(self.work, f"plan-{len(self.log.records)}.json")
        self.current.plan.save(plan_file)
        opts = TrainOptions(plan=plan_file, steps=self.o.steps, checkpoint_dir=self.ckpt_dir,
                            checkpoint_every=self.o.checkpoint_every, resume=True, metrics=self.o.metrics,
                            seed=self.o.seed, device=self.o.device, data=self.o.data, init_from=self.o.init_from,
                            log_every=self.o.log_every, stop_file=os.path.join(self.work, "stop"),
                            timeout_s=self.o.timeout_s)
        if self.switch is not None:
            self.switch.launched = time.monotonic()
        Path(opts.stop_file).unlink(missing_ok=True)  # the last launch's stop request
        try:
            prep = prepare(opts, local=self.o.hosts is None)  # raises SailorInputError on a bad checkpoint
        except SailorInputError as e:
            if e.source != "--resume":
                raise
            # `sailor run` always resumes from its --checkpoint-dir; it has no --resume option to name
            raise SailorInputError(e.message, source="--checkpoint-dir", field=e.field, fix=e.fix) from None
        for note in prep.notes:
            if note.startswith("skipped"):
                self.log.emit("checkpoint_skipped", reason=note)
        if prep.resume_step >= self.o.steps:  # the checkpoint folder already holds the whole run
            self.result.steps = prep.resume_step
            return self._finish(ExitStatus.DONE, f"done: the checkpoint folder already holds step {prep.resume_step}"
                                                 f" (--steps {self.o.steps}): {prep.resume_from}")
        if self.o.switches_live:
            run = InPlaceRun(prep, self.work, processes=self.most, hosts=self.o.hosts, lost=self.avail.lost_machines)
        else:
            run = Running(prep, self.o.hosts.commands(prep, opts.stop_file, self.avail.lost_machines)
                          if self.o.hosts else None)
        self.running = run
        self.pids = {}
        if self.result.steps > prep.resume_step:
            self.log.emit("rollback", from_step=self.result.steps, to_step=prep.resume_step,
                          steps=self.result.steps - prep.resume_step)
            self.result.steps_rolled_back += self.result.steps - prep.resume_step
        self.result.steps = prep.resume_step
        self.log.emit("launch", world_size=prep.plan.world_size, resume_step=prep.resume_step,
                      checkpoint=str(prep.resume_from) if prep.resume_from else None,
                      **({"hosts": run.nodes.hosts} if run.nodes else {}))
        self.step_times = []
        if self.signals:
            run.stop()
        while not run.done():
            self._drain(run)
            if self.signals:
                run.stop()
                if not self.step_times:  # nothing trained since the checkpoint it loaded: end it now
                    run.kill(f"while starting, before step {self.result.steps + 1}")
            elif not run.killed and (since := starting_since(run, self.switch)) is not None \
                    and time.monotonic() - since > self.o.start_timeout_s:
                on = f" on {', '.join(dict.fromkeys(run.nodes.hosts))}" if run.nodes else ""
                run.kill(f"{START_TIMEOUT} within {self.o.start_timeout_s:g} s{on}")
                self.log.emit("start_timeout", message=run.killed)
            elif self.avail.advance(self.clock.trace_s()):
                self._on_change(run)
            time.sleep(POLL_S)
        run.thread.join()
        self._drain(run)
        if run.error is not None:
            raise run.error
        return self._ended(run, run.result)

    def _drain(self, run: Running) -> None:
        """Handle the runtime's events that have arrived."""
        while True:
            try:
                t, ev = run.events.get_nowait()
            except queue.Empty:
                return
            kind, sw = ev.get("event"), self.switch
            if kind == "joined" and "pid" in ev:
                self.pids[int(ev["rank"])] = int(ev["pid"])
            if kind == "step":
                self.result.steps = ev["step"]
                self.step_times.append(ev["step_time_s"])
                self.clock.add_step(ev["step_time_s"])
                if sw is not None and sw.stop_requested is not None and sw.launched is None:
                    sw.last_step_after_request = t
                elif sw is not None and sw.launched is not None:
                    self._switch_done(sw, t)
                self.last_step_at = t
                self.failed_launches = 0
            elif kind in ("started", "loaded"):
                run.started = True
                if sw is not None and sw.launched is not None:
                    setattr(sw, kind, t)
                    sw.moved = {k: v for k, v in ev.items() if k.endswith("_bytes")} or sw.moved
            elif sw is not None and kind == "switch_published":
                sw.published, sw.spares_used = t, ev.get("spares_used", 0)
            elif sw is not None and kind == "stopped":
                sw.stopped = t
                if sw.in_place:  # the same processes go on: what follows is the new plan's
                    sw.launched = t
                    self.step_times = []

    def _switch_done(self, sw: Switch, first_step: float) -> None:
        phases = sw.phases(first_step)
        total = first_step - sw.began
        if sw.reason != "crash":  # (the old plan trained on while a live switch's new processes started)
            self.costs.record(total - phases.get("start_s", 0.0))
        self.result.switch_s.append(total)
        # Ranks of both plans (GPUs kept), and how many of them run in another process than before
        # (every one after a restart; none when survivors keep their process).
        kept = len(sw.pids_before.keys() & self.pids.keys()) if sw.pids_before else 0
        restarted = kept - len(set(sw.pids_before.values()) & set(self.pids.values()))
        self.log.emit("switch_finished", reason=sw.reason, total_s=total, phases_s=phases,
                      world_size=self.current.plan.world_size, step=self.result.steps, in_place=sw.in_place,
                      survivors=kept, survivors_restarted=restarted, spares_used=sw.spares_used,
                      pids_before=sw.pids_before, pids=self.pids, **sw.moved)
        self.switch = None
        if self.changed and isinstance(self.running, InPlaceRun):
            self.changed = False
            self._on_change(self.running)

    def _on_change(self, run: Running) -> None:
        """A new trace snapshot while training: re-plan and maybe switch."""
        began = time.monotonic()
        zones = self._report_availability()
        if self.switch is not None and self.switch.in_place:
            self.changed = True  # looked at again once the live switch has its first step
            return
        if self.switch is not None and self.switch.launched is None:
            return  # a stop is already under way: the relaunch plans for the newest availability
        if self.switch is not None:  # relaunched, but no step yet: this switch's timing ends here
            self._interrupt_switch()
        planned = self._plan(zones)
        lost = lost_gpus(self.current.plan.gpu_usage(), zones)
        if planned is None:
            if lost:  # nothing fits, and the running plan cannot continue: stop and wait
                self._request_stop(run, Switch("lost GPUs, no plan fits", began))
            return
        if planned.plan == self.current.plan:
            self.log.emit("decision", switch=False, reason="the best plan is the running plan")
            return
        # Predictions are scaled by measured / predicted of the running plan (the first step, which
        # warms up, excluded), so gain and cost are both in this machine's seconds.
        measured = _median(self.step_times[1:])
        if measured > 0:
            self.ratio = measured / self.current.estimate.iteration_time_s
        old_est = None if lost else self.replanner.score(self.current.plan, zones)
        old_s = old_est.iteration_time_s * self.ratio if old_est is not None else None
        new_s = planned.estimate.iteration_time_s * self.ratio
        live = LiveSwitchModel.for_run(self.o.checkpoint_every)
        model_s = live.seconds(self.replanner.context(zones), self.current.plan, planned.plan) \
            if isinstance(run, InPlaceRun) else None  # before a live switch was measured
        d = decide(lost=lost, old_iteration_s=old_s, new_iteration_s=new_s,
                   remaining_iterations=self.o.steps - self.result.steps, switch_cost_s=self.costs.estimate_s(model_s))
        self.log.emit("decision", switch=d.switch, reason=d.reason, gain_s=_finite(d.gain_s), switch_cost_s=d.cost_s,
                      current_iteration_s=old_s, new_iteration_s=new_s, remaining_steps=self.o.steps - self.result.steps)
        if d.switch:
            sw = Switch("lost GPUs" if lost else "gain", began, replan_s=planned.replan_s)
            if isinstance(run, InPlaceRun):
                return self._switch_live(run, planned, sw)
            self._request_stop(run, sw)

    def _switch_live(self, run: InPlaceRun, planned: Planned, sw: Switch) -> None:
        """Switch `run` to `planned` without restarting its ranks (`InPlaceRun.switch`)."""
        sw.in_place, sw.pids_before = True, dict(self.pids)
        self.switch = sw
        sw.stop_requested = time.monotonic()
        self.log.emit("switch_started", reason=sw.reason, step=self.result.steps,
                      from_world_size=self.current.plan.world_size, in_place=True)
        plan_file = os.path.join(self.work, f"plan-{len(self.log.records)}.json")
        planned.plan.save(plan_file)
        self.current = planned
        self.pids = {}
        self.result.switches += 1
        run.switch(plan_file)

    def _request_stop(self, run: Running, sw: Switch) -> None:
        sw.pids_before = dict(self.pids)
        self.switch = sw
        sw.stop_requested = time.monotonic()
        self.log.emit("switch_started", reason=sw.reason, step=self.result.steps,
                      from_world_size=self.current.plan.world_size)
        run.stop()

    def _ended(self, run: Running, res: TrainResult) -> None | bool:
        """Act on how a launch ended; returns None to plan and launch again, True when finished."""
        now = time.monotonic()
        if res.status is ExitStatus.DONE or (res.last_step or 0) >= self.o.steps:
            return self._finish(ExitStatus.DONE, f"done: {self.result.steps} steps")
        if res.status is ExitStatus.STOPPED:
            if self.signals:
                return self._finish(ExitStatus.STOPPED, res.message)
            if self.switch is None:  # a stop nobody asked for (e.g. a stale stop file)
                self.switch = Switch("stopped", now)
            self.switch.exited = now
            self.result.switches += 1
            return None
        if self.signals >= 2:
            return self._finish(ExitStatus.KILLED, "killed by a second interrupt")
        if self.signals:
            return self._finish(ExitStatus.STOPPED, f"stopped on request ({run.killed or res.message})")
        if res.status is ExitStatus.BAD_INPUT:  # a rank refused its input: every relaunch would too
            return self._finish(ExitStatus.BAD_INPUT, res.message)
        # A rank failed: its GPUs are gone; roll back to the last checkpoint on the survivors.
        message = run.killed or res.message
        dead = dead_ranks(res)
        machines = failed_machines(run, dead)
        if self.o.hosts is not None:  # on a host pool the machines go (with all their GPUs)
            self.avail.lost_machines |= machines
        else:
            layout = rank_layout(self.current.plan)
            for r in dead:
                if 0 <= r < len(layout):
                    self.avail.lost[(layout[r].zone, layout[r].gpu)] += 1
        self.result.crashes += 1
        self._interrupt_switch()  # a switch under way ends with the crash
        where = {"hosts": sorted(self.o.hosts.host(m) for m in machines)} if self.o.hosts else {}
        self.log.emit("crash", ranks=sorted(dead), message=message, last_step=self.result.steps,
                      since_last_step_s=now - self.last_step_at if self.step_times else None, **where)
        if not self.step_times:
            self.failed_launches += 1
        if self.failed_launches >= MAX_FAILED_LAUNCHES:
            return self._finish(ExitStatus.FAILED, f"{MAX_FAILED_LAUNCHES} launches in a row failed before their"
                                                   f" first step; last: {message}")
        self.switch = Switch("crash", now)
        self.switch.exited = now
        return None

    def _interrupt_switch(self) -> None:
        """End the switch under way, if any, without a first step under its plan: its
        `switch_finished` event says `interrupted` (and has no phases)."""
        if self.switch is not None:
            self.log.emit("switch_finished", reason=self.switch.reason, interrupted=True)
            self.switch = None

    def _finish(self, status: ExitStatus, message: str) -> bool:
        """End the run with `status`: a switch still under way (the job's last step came first, a stop,
        a failure) ends interrupted, then the final event. Returns True (the loop's "ended")."""
        self._interrupt_switch()
        self.result.status, self.result.message = status, message
        name = {ExitStatus.DONE: "done", ExitStatus.STOPPED: "stopped", ExitStatus.KILLED: "killed"}.get(status, "failed")
        self.log.emit(name, message=message, steps=self.result.steps, switches=self.result.switches,
                      crashes=self.result.crashes, steps_rolled_back=self.result.steps_rolled_back)
        return True


def run(options: RunOptions) -> RunResult:
    """Run a job elastically (module docstring).

    Returns:
        RunResult: status DONE (0), FAILED (1: the job could not continue) or STOPPED (3).
    Raises:
        SailorInputError: a non-local provider without hosts, bad options, a checkpoint of another
            job or seed.
    """
    return Controller(options).run()


def _lost(lost: Counter) -> dict[str, int]:
    return {f"{g}@{z}": n for (z, g), n in lost.items() if n}


def _median(xs: list[float]) -> float:
    if not xs:
        return 0.0
    s = sorted(xs[-10:])
    return s[len(s) // 2]


def _finite(x: float) -> float | None:
    return x if x != float("inf") else None
