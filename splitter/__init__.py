"""Everything decided before any process talks to another: labels, capture,
functional optimizers, the GraphSplitter and its modes, and the SplitPlan."""

from . import optim
from .capture import capture
from .errors import CaptureError, LabelError, PlanError, PlanParseError, SplitrunError
from .graph_splitter import GraphSplitter, SplitProgram, split, split_program
from .labels import ANY_SERVER, Cluster, Label, Role, place, placement_of, region
from .modes import GeneralMode, Mode, ModeArtifacts
from .plan import (
    Channel,
    ChannelKind,
    ControlEdge,
    DataSync,
    Instruction,
    ModeKind,
    OpKind,
    ProcessPlan,
    SplitPlan,
)
from .program import InputKind, InputSpec, OutputKind, OutputSpec, ParamGroup, Program
from .ps_mode import ParameterServerMode, ServerAssignment

__all__ = [
    "optim",
    "capture",
    "SplitrunError",
    "LabelError",
    "CaptureError",
    "PlanError",
    "PlanParseError",
    "GraphSplitter",
    "SplitProgram",
    "split",
    "split_program",
    "ANY_SERVER",
    "Cluster",
    "Label",
    "Role",
    "place",
    "placement_of",
    "region",
    "Mode",
    "GeneralMode",
    "ModeArtifacts",
    "ParameterServerMode",
    "ServerAssignment",
    "Channel",
    "ChannelKind",
    "ControlEdge",
    "DataSync",
    "Instruction",
    "ModeKind",
    "OpKind",
    "ProcessPlan",
    "SplitPlan",
    "InputKind",
    "InputSpec",
    "OutputKind",
    "OutputSpec",
    "ParamGroup",
    "Program",
]
