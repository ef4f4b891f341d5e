"""Which point-to-point messages a plan's pipelines exchange, on which channel, in which order
(torch-free and pure): the one enumeration `pipeline.run_pipeline` executes, `groups` creates the
communicators for, and `comm_check` verifies under NCCL's rules.

A *channel* is one direction of one kind of traffic between two ranks: (src, dst, kind), kind
`activation` (forward) or `gradient` (backward). Each channel gets its own 2-rank process group, so
under NCCL its own communicator and stream (`groups.create_channel_groups`). No transfer carries a
tag: NCCL ignores tags (torch.distributed `isend`/`irecv` docstrings: "tag is not supported with the
NCCL backend") and matches a pair's sends and receives in posting order. Correctness therefore rests
on this property, which `comm_check` verifies for every plan it runs and which holds by construction:

  on every channel the sender posts its messages in the same order as the receiver posts its receives.

Why it holds. A channel carries one kind between two replicas of one pipeline. Activations: stage i
sends F(c, k)'s output to stage i + 1's F(c, k), or, under interleaving, stage p - 1 sends chunk c's
output to stage 0's F(c + 1, k). Every stage runs its forwards in one shared sequence of (c, k)
(`plan.orders`: k ascending under 1F1B and ZB-H1; the interleaved schedule's group-by-group, chunk-
by-chunk list), and the maps (c, k) -> (c, k) and (c, k) -> (c + 1, k) keep that sequence's order
(within a group c ascends, then k; the group is unchanged). Gradients: the same with the backward
sequence and (c, k) -> (c, k) or (c, k) -> (c - 1, k). This needs every stage of a pipeline to run
the order of the same round count (`schedule.step_rounds`): interleaved orders of different counts
group micro-batches differently.

Ops of rounds k >= the pipeline's micro-batch count transfer nothing, on both ends alike.

An activation crosses a boundary scattered (`topology`, `plan.comms.boundary_pieces`): a rank
receives its slice from one or more ranks of the neighbour replica, one transfer per channel, all
with the same message, and sends slices to one or more. Each channel still carries one kind between
two fixed ranks, so the argument above holds on each of them.

With a load-balancing loss (`runtime.balance`) every transfer is followed on its channel by a small
side message (`pipeline.P2P.side_sizes`), which both ends post right after the transfer: each
channel's order is still the op order.

Receives are posted one op ahead (`rank_program`): at the start of op j the rank posts op j's
receive (if not yet posted) and op j + 1's, so the next input can arrive during op j's compute; on
each channel that is still the op order, so the property above is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sailor.plan.orders import BWD, FWD, Op
from sailor.plan.spec import Plan
from sailor.runtime.schedule import runtime_schedule, step_rounds
from sailor.runtime.topology import RankRole, Topology

ACTIVATION, GRADIENT = "activation", "gradient"


class Channel(NamedTuple):
    """One direction of one kind of traffic between two global ranks."""

    src: int
    dst: int
    kind: str  # ACTIVATION or GRADIENT


class Message(NamedTuple):
    """What a transfer fills: its kind, the virtual boundary u -> u + 1 it crosses (which names the
    chunks at both ends) and its micro-batch."""

    kind: str
    boundary: int
    micro_batch: int


class Transfer(NamedTuple):
    channel: Channel
    message: Message


class Step(NamedTuple):
    """One op of a rank's program, with its transfers in posting order: `post` the receives posted
    at its start (before `recv` is waited on), `recv` the receives it waits for (the slices of its
    input, ordered by slice; empty: none), `sends` the sends posted after its compute."""

    op: Op
    post: tuple[Transfer, ...]
    recv: tuple[Transfer, ...]
    sends: tuple[Transfer, ...]


def plan_channels(topology: Topology) -> list[Channel]:
    """Every channel of the plan, sorted: the one order in which every rank creates their groups."""
    out = set()
    for r in topology.roles:
        out.update(Channel(r.rank, d.rank, ACTIVATION) for d in r.fwd_send_to)
        out.update(Channel(r.rank, s.rank, GRADIENT) for s in r.bwd_send_to)
    return sorted(out)


def op_receives(role: RankRole, op: Op) -> tuple[Transfer, ...]:
    """The receives `op` needs before its compute, one per slice of its input (empty: its input is
    local or it has none)."""
    last = role.num_stages * len(role.chunks) - 1
    u = op.chunk * role.num_stages + role.stage
    if op.micro_batch >= role.microbatches:
        return ()
    if op.kind == FWD and u > 0:
        assert role.fwd_recv_from, (role.rank, op)
        msg = Message(ACTIVATION, u - 1, op.micro_batch)
        return tuple(Transfer(Channel(s.rank, role.rank, ACTIVATION), msg) for s in role.fwd_recv_from)
    if op.kind == BWD and u < last:
        assert role.bwd_recv_from, (role.rank, op)
        msg = Message(GRADIENT, u, op.micro_batch)
        return tuple(Transfer(Channel(s.rank, role.rank, GRADIENT), msg) for s in role.bwd_recv_from)
    return ()


def op_sends(role: RankRole, op: Op) -> tuple[Transfer, ...]:
    """The sends `op` posts after its compute, ordered by slice: its output's slices to the ranks of
    the next virtual stage that need them, or its input gradient's slices to those of the previous
    one (`topology`)."""
    last = role.num_stages * len(role.chunks) - 1
    u = op.chunk * role.num_stages + role.stage
    if op.micro_batch >= role.microbatches:
        return ()
    if op.kind == FWD and u < last:
        msg = Message(ACTIVATION, u, op.micro_batch)
        return tuple(Transfer(Channel(role.rank, d.rank, ACTIVATION), msg) for d in role.fwd_send_to)
    if op.kind == BWD and u > 0:
        msg = Message(GRADIENT, u - 1, op.micro_batch)
        return tuple(Transfer(Channel(role.rank, s.rank, GRADIENT), msg) for s in role.bwd_send_to)
    return ()


def rank_program(role: RankRole, order: Sequence[Op], *, lookahead: bool = True) -> list[Step]:
    """`order` (this rank's ops) with its transfers. With `lookahead`, op j's start posts its own
    receive (unless op j - 1 did) and op j + 1's; without, each op posts only its own (the runtime
    before receives were posted ahead)."""
    recvs = [op_receives(role, op) for op in order]
    steps, posted = [], -1  # index of the last op whose receives are posted
    for j, op in enumerate(order):
        post: list[Transfer] = []
        for i in range(max(j, posted + 1), min(j + (2 if lookahead else 1), len(order))):
            post += recvs[i]
            posted = i
        steps.append(Step(op, tuple(post), recvs[j], op_sends(role, op)))
    return steps


def plan_programs(plan: Plan, topology: Topology, *, lookahead: bool = True) -> list[list[Step]]:
    """Every rank's program for one step of `plan` (indexed by global rank): the order the runtime
    runs (`Schedule.order` over `schedule.step_rounds`) with its transfers."""
    sched = runtime_schedule(plan)
    return [rank_program(r, sched.order(r.stage, r.num_stages, step_rounds(plan, r)), lookahead=lookahead)
            for r in topology.roles]
