"""`check_plan`: the invariants a plan must keep, checked in one place."""

from __future__ import annotations

from collections import Counter

from torch import fx

from ..errors import PlanError
from ..labels import Role
from .model import ChannelKind, OpKind, SplitPlan, actions_in
from .pipeline_order import Action, stage_actions

__all__ = ["check_plan"]


def check_plan(plan: SplitPlan, program=None) -> None:
    """Check the plan's invariants; raise `PlanError` naming the first broken one.

    Always: channel names are unique, every channel has exactly one send (on
    its source) and one receive (on its destination), and the schedules
    cannot deadlock (checked by running them abstractly). With `program`
    (the one the plan's node names refer to: `SplitProgram.program`): no
    process reads a value it neither computes, receives nor holds, and every
    send carries values its process has.
    """
    _check_channels(plan)
    _check_no_deadlock(plan)
    _check_servers_start_on_a_message(plan)
    if plan.pipeline is not None:
        _check_pipeline(plan)
    if program is not None:
        _check_dataflow(plan, program)


def _check_channels(plan: SplitPlan) -> None:
    counts = Counter(c.name for c in plan.channels)
    duplicated = sorted(name for name, n in counts.items() if n > 1)
    if duplicated:
        raise PlanError(f"channel names are not unique: {', '.join(duplicated)}")
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for proc in plan.processes:
        for instr in proc.schedule:
            if instr.kind is OpKind.RUN:
                continue
            channel = plan.channel(instr.target)
            expected = channel.src if instr.kind is OpKind.SEND else channel.dst
            if proc.label != expected:
                raise PlanError(
                    f"[{proc.label.describe()}] {instr} but channel {channel.name} "
                    f"runs {channel.src} -> {channel.dst}")
            (sends if instr.kind is OpKind.SEND else recvs)[channel.name] += 1
    for channel in plan.channels:
        for what, count in (("send", sends[channel.name]), ("receive", recvs[channel.name])):
            if count != 1:
                raise PlanError(
                    f"channel {channel.name} has {count} {what}s; every channel needs "
                    f"exactly one send on {channel.src} and one receive on {channel.dst}")
        if len(channel.values) != len(channel.recv_names):
            raise PlanError(
                f"channel {channel.name}: {len(channel.values)} values sent but "
                f"{len(channel.recv_names)} names received")
        if channel.kind is ChannelKind.CONTROL and channel.values:
            raise PlanError(f"control channel {channel.name} carries values {channel.values}")


def _check_no_deadlock(plan: SplitPlan) -> None:
    """Run every schedule abstractly: sends never block, a receive waits for its
    send. If some process can never move on, the plan would deadlock."""
    position = {p.label: 0 for p in plan.processes}
    sent: set[str] = set()
    moved = True
    while moved:
        moved = False
        for proc in plan.processes:
            schedule, at = proc.schedule, position[proc.label]
            while at < len(schedule):
                instr = schedule[at]
                if instr.kind is OpKind.RECV and instr.target not in sent:
                    break
                if instr.kind is OpKind.SEND:
                    sent.add(instr.target)
                at += 1
                moved = True
            position[proc.label] = at
    blocked = [f"{p.label.describe()} waits on {p.schedule[position[p.label]].target} "
               f"(instruction {position[p.label]})"
               for p in plan.processes if position[p.label] < len(p.schedule)]
    if blocked:
        raise PlanError("the schedules deadlock: " + "; ".join(blocked))


def _check_servers_start_on_a_message(plan: SplitPlan) -> None:
    """A server serves a step when the step's first message comes. One that
    sends to a server before its first receive would start steps the workers
    never run, and make that server run them too."""
    for proc in plan.processes:
        if proc.label.role is not Role.SERVER:
            continue
        for instr in proc.schedule:
            if instr.kind is OpKind.RECV:
                break
            if instr.kind is OpKind.SEND and plan.channel(instr.target).dst.role is Role.SERVER:
                raise PlanError(
                    f"[{proc.label.describe()}] sends {instr.target} to a server before it "
                    f"receives anything: it would start steps the workers never run (a "
                    f"control edge from the default process is its per-step trigger)")


def _check_pipeline(plan: SplitPlan) -> None:
    """The schedules run each stage's actions in the order the pipeline
    summary says, every micro-batch's forward before its backward, and hold no
    more micro-batches in flight than the schedule promises."""
    pipeline = plan.pipeline
    for index, (stage, expected) in enumerate(zip(pipeline.stages, pipeline.actions)):
        who = stage.describe()
        actual = actions_in(plan.process(stage).schedule)
        if actual != expected:
            raise PlanError(
                f"[{who}] the schedule runs {' '.join(actual)} but the pipeline "
                f"({pipeline.schedule.value}) says {' '.join(expected)}")
        if len(set(actual)) != len(actual):
            raise PlanError(f"[{who}] runs an action in pieces: {' '.join(actual)}")
        in_flight, forwarded, bound = 0, set(), pipeline.max_in_flight(index)
        for text in actual:
            action = Action.parse(text)
            pair = (action.stage, action.micro)
            if action.phase == "F":
                forwarded.add(pair)
                in_flight += 1
                if in_flight > bound:
                    raise PlanError(
                        f"[{who}] holds {in_flight} micro-batches in flight at {text}; "
                        f"{pipeline.schedule.value} promises at most {bound} on stage {index}")
            else:
                forward = str(action._replace(phase="F"))
                if pair not in forwarded and forward in actual:
                    raise PlanError(f"[{who}] runs {text} before {forward}")
                in_flight -= pair in forwarded
        promised = tuple(str(a) for a in stage_actions(
            pipeline.schedule, len(pipeline.stages), index, pipeline.num_microbatches,
            pipeline.num_chunks))
        if actual != promised:
            raise PlanError(
                f"[{who}] the schedule runs {' '.join(actual)} but {pipeline.schedule.value} "
                f"orders stage {index} of {len(pipeline.stages)} as {' '.join(promised)}")


def _check_dataflow(plan: SplitPlan, program) -> None:
    nodes: dict[str, fx.Node] = {n.name: n for n in program.graph.nodes}
    constants = {n.name for n in nodes.values() if n.op == "get_attr"}
    output_node = {o.key: o.node for o in program.outputs}
    for proc in plan.processes:
        who = proc.label.describe()
        have = set(constants)
        for key in (*proc.state, *proc.feeds):
            have.add(program.input_for_key(key).node)
        for instr in proc.schedule:
            if instr.kind is OpKind.RUN:
                node = nodes.get(instr.target)
                if node is None:
                    raise PlanError(
                        f"[{who}] runs {instr.target}, which is not in the graph; check a plan "
                        f"against the program it was split into (split_program(...).program: "
                        f"the split may add nodes, such as grouped optimizer updates)")
                for arg in node.all_input_nodes:
                    if arg.name not in have:
                        raise PlanError(
                            f"[{who}] node {node.name} reads {arg.name}, which {who} "
                            f"neither computes, receives, nor holds as state or feed")
                have.add(node.name)
            elif instr.kind is OpKind.SEND:
                channel = plan.channel(instr.target)
                missing = [v for v in channel.values if v not in have]
                if missing:
                    raise PlanError(
                        f"[{who}] sends {', '.join(missing)} on {channel.name} before "
                        f"computing or receiving them")
            else:
                have.update(plan.channel(instr.target).recv_names)
        for key in proc.outputs:
            if output_node[key] not in have:
                raise PlanError(f"[{who}] output {key!r} ({output_node[key]}) never reaches it")
        for key in proc.state:
            spec = program.state_output(key)
            if spec is not None and spec.node not in have:
                raise PlanError(
                    f"[{who}] owns state {key!r} but its new value {spec.node} is "
                    f"computed elsewhere; the update must run on the owner")
