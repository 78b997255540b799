"""Where parameter-server and embedding-cache modes keep dense parameters.

`DensePlacement.SERVER` (the default): every trainable parameter lives on a
server, which averages the workers' gradients and runs the update.
`DensePlacement.WORKER` (the hybrid of Persia, TorchRec and OpenEmbedding):
parameters with dense gradients, and their optimizer state, are replicated
on every worker, which updates its copy itself; only embedding rows (sparse
tables, cached tables) live on the servers. With several workers the dense
gradients are averaged between the workers first: one `all_reduce_mean`
node per step over all of them (one flat buffer, summed by a
`torch.distributed` all-reduce among the workers, then divided by the
number of workers, as the servers' mean divides), bound by the runtime
(`ops/worker_all_reduce.py`).
"""

from __future__ import annotations

import operator
from enum import Enum

from torch import fx

from ..errors import PlanError
from ..labels import MODULE_ANNOTATION, Label
from ..ops.worker_all_reduce import all_reduce_mean
from ..program import node_annotation, set_node_annotation

__all__ = ["DensePlacement", "average_dense_gradients"]

_OPTIMIZER_PREFIX = "optimizer."


class DensePlacement(Enum):
    SERVER = "server"
    WORKER = "worker"


def average_dense_gradients(graph: fx.Graph, grad_of: dict[str, str], params: list[str],
                            num_workers: int) -> None:
    """Insert one `all_reduce_mean` over the gradients of `params` (dense,
    updated on the workers) before the first update that reads one, and make
    every update read the averages.

    Requires: every parameter's update ops carry the module annotation
    `optimizer.<param>`. Ensures: no update of `params` reads a local gradient.
    """
    nodes = {n.name: n for n in graph.nodes}
    grads = [nodes[grad_of[param]] for param in params]
    updates = {param: [user for user in nodes[grad_of[param]].users
                       if node_annotation(user, MODULE_ANNOTATION) == _OPTIMIZER_PREFIX + param]
               for param in params}
    for param, readers in updates.items():
        if not readers:
            raise PlanError(f"no optimizer update reads the gradient of {param!r}")
    position = {node: index for index, node in enumerate(graph.nodes)}
    last_grad = max(grads, key=position.__getitem__)
    first_update = min((u for readers in updates.values() for u in readers),
                       key=position.__getitem__)
    if position[first_update] < position[last_grad]:
        raise PlanError(f"the update {first_update.name} runs before the gradient "
                        f"{last_grad.name} is computed; dense parameters on the workers "
                        f"average every gradient once, after the backward")
    with graph.inserting_before(last_grad.next):
        reduced = graph.call_function(all_reduce_mean, (grads,), {"num_workers": num_workers})
        set_node_annotation(reduced, str(Label.worker(0)))
        set_node_annotation(reduced, "gradient all-reduce", MODULE_ANNOTATION)
        averages = []
        for index, grad in enumerate(grads):
            item = graph.call_function(operator.getitem, (reduced, index))
            item.meta["val"] = grad.meta.get("val")
            set_node_annotation(item, str(Label.worker(0)))
            averages.append(item)
    for param, grad, mean in zip(params, grads, averages):
        for update in updates[param]:
            update.replace_input_with(grad, mean)
