"""Plan pictures for `splitrun plan`: the script writes the plan's text form
and the module of each node; the launcher turns them into what each `--out`
asks for by its suffix (DOT, SVG through graphviz's `dot`, or the text itself),
all from one run of the script.

In the picture a block of ops is named by the modules its ops come from (the
capture records each node's module path, as `nn_module_stack` would, plus
`optimizer.<param>` and `accumulate.<param>` for the optimizer's and the
gradient sums' nodes), not by aten op names; a channel by the modules of the
values it carries, and the step's inputs among them by their names (a
parameter's key, `batch.0`). A legend tells data, data-sync and control edges
apart (and, in embedding-cache mode, the row traffic).
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from splitrun.splitter.errors import SplitrunError
from splitrun.splitter.plan import SplitPlan
from splitrun.splitter.plan.dot import count_of, plan_to_dot
from splitrun.splitter.plan.text import plan_from_text

__all__ = ["render_plan", "check_plan_out", "read_module_map", "ModuleNames", "PlanNames",
           "LEGEND"]

logger = logging.getLogger(__name__)

# Bounds graphviz on a large plan.
_DOT_TIMEOUT_S = 120.0
# Module groups shown per block or channel before "+N more".
_MAX_SHOWN = 4
# What each suffix of `--out` writes.
_FORMATS = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".txt": "text"}
# Annotations of nodes that belong to a parameter rather than a module: shown
# as one group per block, with the parameters named.
_PARAMETER_GROUPS = (("optimizer.", "optimizer"), ("accumulate.", "gradient sum"))
_OUTSIDE = "outside modules (loss function)"

# What the three kinds of edge mean, drawn as a small cluster of its own.
LEGEND = """\
  subgraph cluster_legend {
    label="legend"; style=dashed; color="#9ca3af"; fontname="Helvetica"; fontsize=9;
    node [shape=plaintext, style="", fontsize=8, label=""];
    legend_data_a -> legend_data_b [label="data: activations, gradients", style=solid];
    legend_sync_a -> legend_sync_b [label="data-sync: updated state, owner to reader", \
style=dashed];
    legend_control_a -> legend_control_b [label="control: orders two processes, no data", \
style=dotted];
  }
"""

# In embedding-cache mode: the rows of the cached tables, outside the channels.
ROWS_LEGEND = """\
  subgraph cluster_legend_rows {
    label=""; style=invis;
    node [shape=plaintext, style="", fontsize=8, label=""];
    legend_rows_a -> legend_rows_b [label="embedding rows: misses pulled, dirty rows pushed", \
dir=both, style=bold, color="#2563eb", fontcolor="#1d4ed8"];
  }
"""


def _graphviz_missing(path: pathlib.Path) -> str:
    return (f"cannot write {path}: graphviz's `dot` is not on PATH. Install graphviz "
            f"(Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; "
            f"conda: conda install -c conda-forge graphviz), or write {path.with_suffix('.dot')} "
            f"(--out {path.with_suffix('.dot').name}) and run `dot -Tsvg "
            f"{path.with_suffix('.dot').name} -o {path.name}` where graphviz is installed")


class PlanNames:
    """What `Job.start` wrote in plan mode for the picture: each op's module
    and each input's name."""

    def __init__(self, modules: Mapping[str, str], values: Mapping[str, str] | None = None
                 ) -> None:
        self.modules = dict(modules)
        self.values = dict(values or {})

    def __bool__(self) -> bool:
        return bool(self.modules or self.values)


class ModuleNames:
    """Names blocks and channels by the modules of their nodes (and the step's
    inputs by their own names)."""

    def __init__(self, module_of: Mapping[str, str],
                 value_names: Mapping[str, str] | None = None) -> None:
        self._module_of = module_of
        self._value_names = value_names or {}

    def _groups(self, names: Sequence[str], *, keep_unknown: bool
                ) -> tuple[dict[str, list[str]], dict[str, int]]:
        """Display group -> its parameters (or []), in order of first
        appearance; and group -> how many of `names` it holds."""
        groups: dict[str, list[str]] = {}
        counts: dict[str, int] = {}
        for name in names:
            module = self._module_of.get(name)
            part = None
            if module is None:
                key = self._value_names.get(name, name) if keep_unknown else _OUTSIDE
            else:
                key = f"module {module}"
                for prefix, group in _PARAMETER_GROUPS:
                    if module.startswith(prefix):
                        key, part = group, module[len(prefix):]
                        break
            members = groups.setdefault(key, [])
            counts[key] = counts.get(key, 0) + 1
            # A grouped multi-tensor update is `optimizer.{a,b,c}`: its parameters.
            parts = ([] if part is None else part[1:-1].split(",") if part.startswith("{")
                     else [part])
            members.extend(p for p in parts if p not in members)
        return groups, counts

    @staticmethod
    def _lines(groups: dict[str, list[str]], counts: dict[str, int] | None) -> list[str]:
        lines = []
        for key, members in list(groups.items())[:_MAX_SHOWN]:
            text = key
            if members:
                shown = ", ".join(members[:_MAX_SHOWN])
                more = len(members) - _MAX_SHOWN
                text += f" ({shown}{f', +{more}' if more > 0 else ''})"
            if counts is not None:
                text += f": {count_of(counts[key], 'op')}"
            lines.append(text)
        if len(groups) > _MAX_SHOWN:
            lines.append(f"+{len(groups) - _MAX_SHOWN} more modules")
        return lines

    def describe_ops(self, ops: Sequence[str]) -> str:
        groups, counts = self._groups(ops, keep_unknown=False)
        return "\\n".join([count_of(len(ops), "op")] + self._lines(groups, counts))

    def describe_values(self, values: Sequence[str]) -> str:
        # A value outside every module is state or a batch input: its own name says it.
        groups, _ = self._groups(values, keep_unknown=True)
        return ", ".join(self._lines(groups, None))


def read_module_map(path: str | pathlib.Path) -> PlanNames:
    """The names `Job.start` wrote in plan mode (none if it wrote none)."""
    path = pathlib.Path(path)
    if not path.exists():
        return PlanNames({})
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SplitrunError(f"cannot read the plan's module map {path}: {exc}") from None
    parts = [data.get("modules"), data.get("values")] if isinstance(data, dict) else [None]
    if not all(isinstance(part, dict) and all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in part.items()) for part in parts):
        raise SplitrunError(f"the plan's module map {path} is not a JSON object of "
                            f"\"modules\" and \"values\", each of strings")
    return PlanNames(data["modules"], data["values"])


def plan_picture(plan: SplitPlan, names: PlanNames | None = None) -> str:
    """The DOT source: blocks named by modules where `names` knows them, and
    the legend."""
    if names:
        named = ModuleNames(names.modules, names.values)
        dot = plan_to_dot(plan, named.describe_ops, named.describe_values)
    else:
        dot = plan_to_dot(plan)
    body, closing = dot.rstrip().rsplit("}", 1)
    legend = LEGEND + (ROWS_LEGEND if plan.cached_tables else "")
    return body + legend + "}" + closing + "\n"


def check_plan_out(out: str | pathlib.Path) -> str:
    """The form `out`'s suffix asks for ("dot", "svg" or "text"); a clear
    error for a suffix we do not write, or an .svg without graphviz, so the
    launcher refuses before it runs the script."""
    path = pathlib.Path(out)
    form = _FORMATS.get(path.suffix.lower())
    if form is None:
        raise SplitrunError(
            f"cannot write the plan to {path}: its suffix {path.suffix or '(none)'!r} is not "
            f"one splitrun plan writes; use .dot or .gv (DOT), .svg (a picture, needs "
            f"graphviz) or .txt (the text form), e.g. --out {path.with_suffix('.dot').name}; "
            f"repeat --out for several")
    if form == "svg" and shutil.which("dot") is None:
        raise SplitrunError(_graphviz_missing(path))
    return form


def render_plan(text: str, out: str | pathlib.Path,
                names: PlanNames | None = None) -> SplitPlan:
    """Write the plan whose text form is `text` to `out`, by its suffix:
    .txt (the text form), .svg (needs graphviz's `dot`), .dot or .gv (DOT)."""
    form = check_plan_out(out)
    plan = plan_from_text(text)
    path = pathlib.Path(out)
    if form == "text":
        path.write_text(text)
    elif form == "svg":
        subprocess.run([shutil.which("dot") or "dot", "-Tsvg", "-o", str(path)],
                       input=plan_picture(plan, names), text=True, check=True,
                       timeout=_DOT_TIMEOUT_S)
    else:
        path.write_text(plan_picture(plan, names))
    return plan
