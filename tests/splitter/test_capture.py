"""Capture: one graph with forward, backward and optimizer update, every node
labelled; and a clear error for steps that cannot be captured."""

import pytest
import torch
import torch.nn.functional as F
from models import TiedBigramLM, lm_loss, markov_batches
from torch import nn

from splitrun.splitter import (
    CaptureError,
    InputKind,
    Label,
    LabelError,
    capture,
    optim,
    place,
    region,
)
from splitrun.splitter.labels import LABEL_ANNOTATION, MODULE_ANNOTATION


def annotation(node, key):
    return (node.meta.get("custom") or {}).get(key)


@pytest.fixture(scope="module")
def lm_program():
    torch.manual_seed(0)
    model = TiedBigramLM(num_workers=3)
    return capture(model, lm_loss, optim.Adam(lr=0.01), markov_batches(1, batch=4)[0])


def test_backward_ops_carry_their_forward_label(lm_program):
    nodes = list(lm_program.graph.nodes)
    mlp_ops = [n for n in nodes if (annotation(n, MODULE_ANNOTATION) or "").startswith("mlp")]
    backward = [n for n in mlp_ops if "backward" in str(n.target) or n.target in (
        torch.ops.aten.mm.default,)]
    assert backward, "the MLP's backward ops must be in the graph"
    assert {annotation(n, LABEL_ANNOTATION) for n in mlp_ops} == {"w1"}
    # tanh's backward is a distinct op carrying the MLP's label
    assert any(n.target == torch.ops.aten.tanh_backward.default for n in mlp_ops)


def test_optimizer_updates_carry_the_owner_label(lm_program):
    updates = {}
    for node in lm_program.graph.nodes:
        module = annotation(node, MODULE_ANNOTATION) or ""
        if module.startswith("optimizer."):
            updates.setdefault(module.removeprefix("optimizer."), set()).add(
                annotation(node, LABEL_ANNOTATION))
    assert updates["embed.weight"] == {"w0"}
    assert updates["mlp.0.weight"] == {"w1"}
    assert updates["norm.weight"] == {"w2"}


def test_state_enters_as_inputs_and_leaves_as_outputs(lm_program):
    kinds = {spec.key: spec.kind for spec in lm_program.inputs}
    assert kinds["embed.weight"] is InputKind.PARAM
    assert kinds["embed.weight.exp_avg"] is InputKind.OPT_STATE
    assert kinds["lr"] is InputKind.HPARAM and kinds["step"] is InputKind.HPARAM
    state_outputs = {o.key for o in lm_program.outputs if o.kind.value == "state"}
    assert {"embed.weight", "embed.weight.exp_avg", "embed.weight.exp_avg_sq"} <= state_outputs
    assert lm_program.hparams(4)["step"].item() == 5.0


@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step")
def test_torch_optimizer_and_lr_schedule_are_followed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    eager = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    eager.load_state_dict(model.state_dict())
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    data = [(torch.randn(10, 6), torch.randint(0, 3, (10,))) for _ in range(8)]

    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, nesterov=True,
                          weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    program = capture(model, loss_fn, opt, data[0])
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.2, momentum=0.9, nesterov=True,
                                weight_decay=1e-2, foreach=False)
    eager_schedule = torch.optim.lr_scheduler.StepLR(eager_opt, step_size=2, gamma=0.5)

    state = program.initial_state
    for step, (x, y) in enumerate(data):
        feeds = {"batch.0": x, "batch.1": y, **program.hparams(step)}
        _, state = program.run_unsplit(state, feeds)
        schedule.step()  # no warning: splitrun tells the scheduler the step happened
        eager_opt.zero_grad()
        loss_fn(eager, x, y).backward()
        eager_opt.step()
        eager_schedule.step()
    assert program.hparams(0)["lr"].item() == pytest.approx(0.2 * 0.5 ** 4)
    for key, param in eager.named_parameters():
        torch.testing.assert_close(state[key], param.detach(), rtol=0, atol=1e-6)


def test_adamw_and_adagrad_lr_decay_track_torch():
    for torch_cls, kwargs in ((torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
                              (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01,
                                                     "initial_accumulator_value": 0.1})):
        torch.manual_seed(0)
        model = nn.Linear(5, 2)
        eager = nn.Linear(5, 2)
        eager.load_state_dict(model.state_dict())
        loss_fn = lambda m, x: m(x).pow(2).mean()  # noqa: E731
        program = capture(model, loss_fn, torch_cls(model.parameters(), **kwargs),
                          torch.randn(4, 5))
        eager_opt = torch_cls(eager.parameters(), foreach=False, **kwargs)
        state = program.initial_state
        for step in range(6):
            x = torch.randn(4, 5)
            _, state = program.run_unsplit(state, {"batch.0": x, **program.hparams(step)})
            eager_opt.zero_grad()
            loss_fn(eager, x).backward()
            eager_opt.step()
        for key, param in eager.named_parameters():
            torch.testing.assert_close(state[key], param.detach(), rtol=0, atol=1e-6)


def test_region_labels_ops_and_unplaced_parameter_follows_its_reader():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            with region(rank=1):
                return x * self.scale

    program = capture(Net(), lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(3, 4))
    placeholder = next(n for n in program.graph.nodes if n.name == "p_scale")
    assert annotation(placeholder, LABEL_ANNOTATION) == str(Label.worker(1))


# -- steps that cannot be captured -------------------------------------------

class InPlaceCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x)


def test_in_place_buffer_update_is_refused():
    with pytest.raises(CaptureError, match=r"mutates one of its inputs in place"):
        capture(InPlaceCounter(), lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(2, 4))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 1)
        self.body = nn.Linear(4, 4)

    def forward(self, x):
        if self.gate(x).sum() > 0:  # data-dependent control flow
            return self.body(x)
        return x


class Compacting(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)[self.inner(x) > 0]


def test_data_dependent_control_flow_names_module_and_op():
    model = nn.Sequential(nn.Linear(4, 4), Gated())
    with pytest.raises(CaptureError,
                       match=r"module '1' \(Gated\).*_local_scalar_dense.*torch.where"):
        capture(model, lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(2, 4))


def test_data_dependent_shape_names_op():
    with pytest.raises(CaptureError, match=r"module 'Compacting' calls aten.nonzero"):
        capture(Compacting(), lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(2, 4))


def test_batchnorm_running_stats_are_refused_with_a_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(CaptureError, match=r"module '1' \(BatchNorm1d\) updates its running"):
        capture(model, lambda m, x: m(x).sum(), optim.SGD(lr=0.1), torch.randn(3, 4))


def test_bad_arguments_name_the_culprit():
    model = nn.Linear(4, 2)
    loss = lambda m, x: m(x).sum()  # noqa: E731
    with pytest.raises(CaptureError, match=r"example_batch item 1 is a str"):
        capture(model, loss, optim.SGD(lr=0.1), (torch.randn(2, 4), "labels"))
    with pytest.raises(CaptureError, match=r"scalar tensor.*\[2, 2\]"):
        capture(model, lambda m, x: m(x), optim.SGD(lr=0.1), torch.randn(2, 4))
    with pytest.raises(CaptureError, match=r"RMSprop has no functional version"):
        capture(model, loss, torch.optim.RMSprop(model.parameters()), torch.randn(2, 4))
    with pytest.raises(CaptureError, match=r"amsgrad=True"):
        capture(model, loss, torch.optim.Adam(model.parameters(), amsgrad=True),
                torch.randn(2, 4))
    with pytest.raises(CaptureError, match=r"module 'bag' \(EmbeddingBag\) has mode='max' and "
                                           r"a sparse gradient"):
        capture(nn.ModuleDict({"bag": nn.EmbeddingBag(5, 2, mode="max", sparse=True)}),
                lambda m, i: m["bag"](i).sum(), optim.SGD(lr=0.1), torch.tensor([[1, 2]]))
    sparse = nn.ModuleDict({"emb": nn.Embedding(5, 2, sparse=True)})
    with pytest.raises(CaptureError, match=r"SGD with momentum or weight decay cannot update a "
                                           r"sparse embedding row by row"):
        capture(sparse, lambda m, i: m["emb"](i).sum(), optim.SGD(lr=0.1, momentum=0.9),
                torch.tensor([1, 2]))


def test_place_rejects_unknown_role_naming_module():
    with pytest.raises(LabelError, match=r"place\(Linear, role='wroker'.*unknown role 'wroker'"):
        place(nn.Linear(2, 2), role="wroker")
    with pytest.raises(LabelError, match=r"rank must be an integer >= 0, got -1"):
        place(nn.Linear(2, 2), rank=-1)
