"""The plan: `SplitPlan` and its parts as plain data (`model`), its text form
(`text`), its picture (`dot`), its invariants (`check`), the pipeline
schedules' order (`pipeline_order`) and the names a picture gives values
(`picture_names`). The forms and checks are functions over the data class,
which imports none of them."""

from __future__ import annotations

from ..lazy_exports import lazy_exports

# Each public name and the module it lives in; imported when first used (the
# launcher reads plans without torch, which `check` imports).
_EXPORTS = {
    "ModeKind": ".model",
    "ChannelKind": ".model",
    "OpKind": ".model",
    "Channel": ".model",
    "Instruction": ".model",
    "ProcessPlan": ".model",
    "DataSync": ".model",
    "CollectiveEntry": ".model",
    "ParallelSummary": ".model",
    "CachedTableEntry": ".model",
    "PipelineSchedule": ".pipeline_order",
    "PipelineSummary": ".model",
    "action_of": ".model",
    "actions_in": ".model",
    "SplitPlan": ".model",
    "Action": ".pipeline_order",
    "stage_actions": ".pipeline_order",
    "interleaved_rounds": ".pipeline_order",
    "max_in_flight": ".pipeline_order",
    "theoretical_bubble": ".pipeline_order",
    "plan_to_text": ".text",
    "plan_from_text": ".text",
    "plan_fingerprint": ".text",
    "plan_to_dot": ".dot",
    "check_plan": ".check",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
