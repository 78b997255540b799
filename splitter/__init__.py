"""Everything decided before any process talks to another: labels, capture,
functional optimizers, the GraphSplitter and its modes, and the SplitPlan."""

from __future__ import annotations

from .lazy_exports import lazy_exports

# Each public name and the module it lives in; imported when first used.
_EXPORTS = {
    "optim": ".optim",
    "capture": ".capturing",
    "SplitrunError": ".errors",
    "LabelError": ".errors",
    "CaptureError": ".errors",
    "PlanError": ".errors",
    "PlanParseError": ".errors",
    "GraphSplitter": ".graph_splitter",
    "SplitProgram": ".graph_splitter",
    "split": ".graph_splitter",
    "split_program": ".graph_splitter",
    "ANY_SERVER": ".labels",
    "Cluster": ".labels",
    "Label": ".labels",
    "Role": ".labels",
    "place": ".labels",
    "placement_of": ".labels",
    "region": ".labels",
    "Mode": ".modes",
    "GeneralMode": ".modes",
    "ModeArtifacts": ".modes",
    "ParameterServerMode": ".ps_mode",
    "ServerAssignment": ".ps_mode",
    "Channel": ".plan",
    "ChannelKind": ".plan",
    "DataSync": ".plan",
    "Instruction": ".plan",
    "ModeKind": ".plan",
    "OpKind": ".plan",
    "ProcessPlan": ".plan",
    "SplitPlan": ".plan",
    "InputKind": ".program",
    "InputSpec": ".program",
    "OutputKind": ".program",
    "OutputSpec": ".program",
    "ParamGroup": ".program",
    "Program": ".program",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
