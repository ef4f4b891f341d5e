"""A model of one training step's communication under NCCL's rules (torch-free, pure, run by CPU
tests): does a plan deadlock, and does every message land in the buffer it was meant for?

It executes the ranks' programs (`messages.plan_programs`: the orders and topology the runtime
uses) as a GPU would, with these rules (NCCL user guide, "Point-to-point communication" and
"Communicators"; torch 2.13 `ProcessGroupNCCL`, which runs each communicator's operations on one
stream of its own):

- Each rank has a compute stream that runs its program in order. A receive's data is needed where
  the op waits for it (`Work.wait()`: the compute stream waits for the receive's completion); a
  collective blocks the compute stream of each member until every member has reached it.
- Every communicator has one stream per member; operations run on it in posting order (FIFO). A send
  or receive is posted when the compute stream reaches it and runs when it is at the head of its
  stream. Tags are ignored: the head send of one end pairs with the head receive of the other.
- A send is blocking: it completes only together with the matching receive (messages of real sizes
  exceed NCCL's buffers, so the sender waits for the receiver). A send at the head of a stream
  stops everything behind it on that stream, whatever its direction. With `blocking_sends=False`
  every send completes at once into its communicator's FIFO (small messages that fit NCCL's
  buffers): this shows where messages land when nothing deadlocks.
- Collectives of one group must come in the same order on all members: members meeting in one
  group's collective with different labels are reported.

Communicators (`scheme`): "channels" is the runtime's (one 2-rank group per `messages.Channel`);
"pairs" is the point-to-point code before it (every transfer between two ranks on the world group,
so one communicator and stream per unordered pair, both directions and both kinds).

Collectives modelled per op (labelled by the op, so any disagreement shows): the TP group's
all-reduces in a real F or B of a replica of TP > 1 (and the all-gather of the op's input slices
after its receives, `pipeline.P2P.receive`, which comes first among them), the EP group's
all-to-alls in a real F or B of a stage under expert parallelism (`runtime.moe.ExpertParallel`), and
under ZeRO-2/3 the gathers and reduce-scatters of each of the rank's sharding groups
(`role.block_groups`, `role.stage_group`, and its experts' `role.expert_block_groups`,
`role.expert_stage_group`) in every F, B and W, rounds without a micro-batch included. All collectives of one op are modelled as
one per group, in a fixed group order, which every member of a stage shares.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sailor.plan.orders import WGRAD
from sailor.plan.spec import Plan
from sailor.runtime.messages import Message, Step, Transfer, plan_programs
from sailor.runtime.topology import RankRole, Ranks, Topology, derive_topology

SCHEMES = ("channels", "pairs")


@dataclass
class CommReport:
    """Outcome of `check_plan`.

    Attributes:
        deadlock: some rank could not finish its program.
        blocked: for each rank that could not, what it waits for (one line each).
        wrong_buffer: (receiving rank, message expected, message delivered) for every receive that was
            filled with a message of another kind, boundary or micro-batch.
        collective_mismatch: (group, labels) where members met in one group's collective with
            different ops.
        messages: messages delivered.
    """

    deadlock: bool = False
    blocked: list[str] = field(default_factory=list)
    wrong_buffer: list[tuple[int, Message, Message]] = field(default_factory=list)
    collective_mismatch: list[tuple[Ranks, tuple]] = field(default_factory=list)
    messages: int = 0

    @property
    def ok(self) -> bool:
        return not (self.deadlock or self.wrong_buffer or self.collective_mismatch)


def op_collectives(role: RankRole, kind: str, chunk: int, micro_batch: int) -> list[tuple[Ranks, tuple]]:
    """(group, label) of the collectives of one op of `role`'s rank (module docstring)."""
    label = (kind, chunk, micro_batch)
    out = []
    if role.memory.zero >= 2:
        for g in sorted({*role.block_groups, role.stage_group, *role.expert_block_groups, role.expert_stage_group}):
            if len(g) > 1:
                out.append((g, label))
    if role.tp > 1 and micro_batch < role.microbatches and kind != WGRAD:
        out.append((role.tp_group, label))
    if len(role.ep_group) > 1 and micro_batch < role.microbatches and kind != WGRAD:
        out.append((role.ep_group, label))  # the MoE blocks' all-to-alls (forward; backward in B)
    return out


def _items(role: RankRole, program: Sequence[Step]) -> list[tuple]:
    """The compute stream's items: ("recv", t) posts, ("wait", t), ("coll", group, label), ("send", t)."""
    items: list[tuple] = []
    for s in program:
        items += [("recv", t) for t in s.post]
        items += [("wait", t) for t in s.recv]
        items += [("coll", g, lab) for g, lab in op_collectives(role, *s.op)]
        items += [("send", t) for t in s.sends]
    return items


def _comm(t: Transfer, scheme: str) -> tuple:
    if scheme == "channels":
        return t.channel
    return ("pair", min(t.channel.src, t.channel.dst), max(t.channel.src, t.channel.dst))


def simulate(topology: Topology, programs: Sequence[Sequence[Step]], scheme: str = "channels", *,
             blocking_sends: bool = True) -> CommReport:
    """Run `programs` (one per global rank) under the rules of the module docstring with the
    communicators of `scheme` ("channels" or "pairs"). Raises ValueError on an unknown scheme."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    n = topology.world_size
    items = [_items(topology.roles[r], programs[r]) for r in range(n)]
    pc = [0] * n
    streams: dict[tuple[int, tuple], deque] = {}  # (rank, communicator) -> posted ops, FIFO
    done: list[set[Transfer]] = [set() for _ in range(n)]  # receives completed, by the transfer expected
    buffered: dict[tuple[tuple, int, int], deque] = {}  # (communicator, src, dst) -> sends in flight
    report = CommReport()

    def advance(r: int) -> bool:
        moved = False
        while pc[r] < len(items[r]):
            it = items[r][pc[r]]
            if it[0] == "send" and not blocking_sends:
                t = it[1]
                buffered.setdefault((_comm(t, scheme), r, t.channel.dst), deque()).append(t)
            elif it[0] in ("recv", "send"):
                t = it[1]
                streams.setdefault((r, _comm(t, scheme)), deque()).append(it)
            elif it[0] == "wait":
                if it[1] not in done[r]:
                    return moved
            else:
                _, group, _label = it
                at = [items[m][pc[m]] if pc[m] < len(items[m]) else None for m in group]
                if not all(a is not None and a[0] == "coll" and a[1] == group for a in at):
                    return moved
                labels = tuple(a[2] for a in at)
                if len(set(labels)) > 1:
                    report.collective_mismatch.append((group, labels))
                for m in group:
                    if m != r:
                        pc[m] += 1
            pc[r] += 1
            moved = True
        return moved

    def match() -> bool:
        moved = False
        for (r, comm), q in streams.items():
            if not q:
                continue
            if not blocking_sends:  # the head receive takes the first message in flight from its source
                if q[0][0] != "recv" or not buffered.get((comm, q[0][1].channel.src, r)):
                    continue
                t = buffered[(comm, q[0][1].channel.src, r)].popleft()
                want = q.popleft()[1]
            else:
                if q[0][0] != "send":
                    continue
                t = q[0][1]
                peer = streams.get((t.channel.dst, comm))
                if not peer or peer[0][0] != "recv" or peer[0][1].channel.src != r:
                    continue
                want = peer.popleft()[1]
                q.popleft()
            if want.message != t.message or want.channel.kind != t.channel.kind:
                report.wrong_buffer.append((t.channel.dst, want.message, t.message))
            done[t.channel.dst].add(want)
            report.messages += 1
            moved = True
        return moved

    progress = True
    while progress:
        progress = False
        for r in range(n):
            progress |= advance(r)
        progress |= match()
    for r in range(n):
        left = [q[0] for (s, _), q in streams.items() if s == r and q]
        if pc[r] < len(items[r]) or left:
            report.deadlock = True
            at = items[r][pc[r]] if pc[r] < len(items[r]) else ("done",)
            report.blocked.append(f"rank {r}: compute at {_describe(at)}; stream heads: "
                                  + (", ".join(_describe(x) for x in left) or "none"))
    return report


def _describe(item: tuple) -> str:
    if item[0] in ("recv", "send", "wait"):
        t = item[1]
        return f"{item[0]} {t.message.kind} u{t.message.boundary} k{t.message.micro_batch} {t.channel.src}->{t.channel.dst}"
    if item[0] == "coll":
        return f"collective {item[2]} on {item[1]}"
    return item[0]


def check_plan(plan: Plan, scheme: str = "channels", *, blocking_sends: bool = True) -> CommReport:
    """`simulate` one training step of `plan` as the runtime runs it (`messages.plan_programs`) under
    `scheme`; "pairs" also posts each receive only at its op, as that code did."""
    topo = derive_topology(plan)
    return simulate(topo, plan_programs(plan, topo, lookahead=scheme == "channels"), scheme,
                    blocking_sends=blocking_sends)
