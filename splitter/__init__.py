"""Everything decided before any process talks to another: labels, capture,
functional optimizers, the GraphSplitter and its modes, and the SplitPlan.

Every name a user imports comes from here (`from splitrun.splitter import
capture, EmbeddingCacheMode`); the rooms behind it (`capturing/`,
`splitting/`, `modes/`, `plan/`, `ops/`, `testing/`; docs/architecture.md)
are the splitter's own layout.
"""

from __future__ import annotations

from .lazy_exports import lazy_exports

# Each public name and the module it lives in; imported when first used.
_EXPORTS = {
    # capture
    "optim": ".capturing.optim",
    "capture": ".capturing.step",
    "TorchRecInput": ".capturing.torchrec_input",
    "CapturedEmbeddingBagCollection": ".capturing.torchrec_input",
    "CapturedFeatures": ".capturing.torchrec_input",
    "from_fused_params": ".capturing.torchrec_optim",
    "place_embedding_cache": ".capturing.cache_marks",
    # errors
    "SplitrunError": ".errors",
    "LabelError": ".errors",
    "CaptureError": ".errors",
    "PlanError": ".errors",
    "PlanParseError": ".errors",
    "RowInitError": ".errors",
    # the split
    "GraphSplitter": ".splitting.graph_splitter",
    "SplitProgram": ".splitting.graph_splitter",
    "split": ".splitting.graph_splitter",
    "split_program": ".splitting.graph_splitter",
    "Mode": ".splitting.mode",
    "ModeArtifacts": ".splitting.mode",
    # labels
    "ANY_SERVER": ".labels",
    "Cluster": ".labels",
    "Label": ".labels",
    "Role": ".labels",
    "place": ".labels",
    "placement_of": ".labels",
    "region": ".labels",
    # modes
    "GeneralMode": ".modes.general",
    "ParameterServerMode": ".modes.parameter_server",
    "ServerAssignment": ".modes.parameter_server",
    "DensePlacement": ".modes.dense_placement",
    "EmbeddingCacheMode": ".modes.embedding_cache.mode",
    "CacheArtifacts": ".modes.embedding_cache.mode",
    "CachedTable": ".ops.cache",
    "RowInit": ".ops.row_init",
    "DynamicTable": ".ops.dynamic_table",
    "CacheSettings": ".ops.cache",
    "EvictionPolicy": ".ops.cache",
    "ParallelMode": ".modes.parallel",
    "CollectiveBackend": ".modes.parallel",
    "Policy": ".modes.parallel",
    "ParallelLayout": ".modes.parallel",
    "ParallelLinear": ".modes.parallel",
    "ParallelEmbedding": ".modes.parallel",
    "ParallelCrossEntropyLoss": ".modes.parallel",
    "convert_parallel_linear": ".modes.parallel",
    "shard": ".modes.parallel",
    "constrain": ".modes.parallel",
    "Placement": ".modes.parallel",
    "parse_placement": ".modes.parallel",
    "ShardingError": ".modes.parallel",
    "collect_state_dict": ".modes.parallel",
    "relocate_state_dict": ".modes.parallel",
    "member_key": ".modes.parallel",
    # the plan
    "PipelineSchedule": ".plan.model",
    "Channel": ".plan.model",
    "ChannelKind": ".plan.model",
    "DataSync": ".plan.model",
    "Instruction": ".plan.model",
    "ModeKind": ".plan.model",
    "OpKind": ".plan.model",
    "ProcessPlan": ".plan.model",
    "SplitPlan": ".plan.model",
    "plan_to_text": ".plan.text",
    "plan_from_text": ".plan.text",
    "plan_to_dot": ".plan.dot",
    "check_plan": ".plan.check",
    # the program
    "InputKind": ".program",
    "InputSpec": ".program",
    "OutputKind": ".program",
    "OutputSpec": ".program",
    "ParamGroup": ".program",
    "Program": ".program",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
