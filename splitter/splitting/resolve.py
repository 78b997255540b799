"""Give every node of a program its label.

Rules, in order: an explicit label (from `place`, `region` or capture) wins;
batch inputs and graph constants are replicated (every process that reads them
has them); a state slot lives with the process that updates it; an unlabelled
node that only views, reshapes or indexes one input follows its producer; any
other node takes the mode's default label.
"""

from __future__ import annotations

from torch import fx

from ..errors import PlanError
from ..fx_facts import is_follower
from ..labels import ANY_SERVER, LABEL_ANNOTATION, Cluster, Label, Role
from ..program import InputKind, OutputKind, Program

__all__ = ["resolve_labels", "describe_node"]

def describe_node(program: Program, node: fx.Node) -> str:
    module = program.module_of(node)
    spec = program.input_spec(node.name) if node.op == "placeholder" else None
    if spec is not None:
        return f"input {node.name} ({spec.kind.value} {spec.key!r})"
    return f"node {node.name}" + (f" (module {module!r})" if module else "")


class _LabelChecker:
    def __init__(self, program: Program, cluster: Cluster, mode) -> None:
        self.program, self.cluster, self.mode = program, cluster, mode
        self._parsed: dict[str, Label] = {}
        self.checked: set[Label] = set()

    def parse(self, node: fx.Node, text: str) -> Label:
        label = self._parsed.get(text)
        if label is None:
            try:
                label = Label.server(0) if text == ANY_SERVER else Label.parse(text)
            except PlanError:
                raise
            except Exception as exc:
                raise PlanError(f"{describe_node(self.program, node)}: {exc}") from None
            self._parsed[text] = label
        return label

    def check(self, node: fx.Node, label: Label) -> None:
        where = describe_node(self.program, node)
        if label.role is Role.SCHEDULER:
            raise PlanError(
                f"{where} is placed on the scheduler; the scheduler runs cluster "
                f"membership only, place the op on a worker or a server")
        size = self.cluster.size(label.role)
        if label.rank >= size:
            have = (f"ranks 0-{size - 1}" if size > 1 else "rank 0") if size else "none"
            raise PlanError(
                f"{where} is placed on {label.describe()}, but the cluster has "
                f"{size} {label.role.value}s ({have}); lower the rank or launch with "
                f"--{label.role.value}s {label.rank + 1}")
        reason = self.mode.reject_label(label, self.cluster)
        if reason:
            raise PlanError(f"{where} is placed on {label.describe()}: {reason}")
        self.checked.add(label)


def resolve_labels(program: Program, cluster: Cluster, mode) -> dict[fx.Node, Label | None]:
    """Label of every placeholder, constant and call; None means replicated."""
    default = mode.default_label(cluster)
    checker = _LabelChecker(program, cluster, mode)
    checked = checker.checked
    labels: dict[fx.Node, Label | None] = {}
    explicit_inputs: set[fx.Node] = set()
    for node in program.graph.nodes:
        op = node.op
        if op == "output":
            continue
        if op == "get_attr":
            labels[node] = None
            continue
        if op not in ("placeholder", "call_function"):
            raise PlanError(
                f"{describe_node(program, node)} has op kind {op!r}; splitrun graphs "
                f"hold placeholders, constants and function calls only (capture them "
                f"with splitrun.splitter.capture)")
        custom = node.meta.get("custom")
        text = custom.get(LABEL_ANNOTATION) if custom else None
        if op == "placeholder":
            spec = program.input_spec(node.name)
            if spec is None:
                raise PlanError(f"placeholder {node.name} is not one of the program's inputs")
            if spec.kind is InputKind.BATCH:
                labels[node] = None
                continue
            if text is not None:
                explicit_inputs.add(node)
        if text is not None:
            label = checker.parse(node, text)
        elif op == "call_function" and is_follower(node):
            label = labels[node.all_input_nodes[0]] or default
        else:
            label = default
        if label not in checked:
            checker.check(node, label)
        labels[node] = label
    _place_state_with_its_update(program, labels, explicit_inputs)
    return labels


def _place_state_with_its_update(program: Program, labels, explicit) -> None:
    nodes = {n.name: n for n in labels}
    for spec in program.outputs:
        if spec.kind is not OutputKind.STATE:
            continue
        placeholder = nodes[program.input_for_key(spec.key).node]
        producer = nodes.get(spec.node)
        if producer is None or producer is placeholder:
            continue
        owner = labels[producer]
        if labels[placeholder] == owner or owner is None:
            continue
        if placeholder in explicit:
            raise PlanError(
                f"state {spec.key!r} is placed on {labels[placeholder].describe()} but "
                f"updated by {describe_node(program, producer)} on {owner.describe()}; "
                f"a state slot lives where it is updated: place both on one process")
        labels[placeholder] = owner
