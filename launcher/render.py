"""Plan pictures for `splitrun plan`: the script writes the plan's text form
and the module of each node; the launcher turns them into what `--out` asks
for (DOT, SVG through graphviz's `dot`, or the text itself).

In the picture a block of ops is named by the modules its ops come from (the
capture records each node's module path, as `nn_module_stack` would, plus
`optimizer.<param>` and `accumulate.<param>` for the optimizer's and the
gradient sums' nodes), not by aten op names; a channel by the modules of the
values it carries. A legend tells data, data-sync and control edges apart.
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
from splitrun.splitter.plan_dot import plan_to_dot

__all__ = ["render_plan", "read_module_map", "ModuleNames", "LEGEND"]

logger = logging.getLogger(__name__)

# Bounds graphviz on a large plan.
_DOT_TIMEOUT_S = 120.0
# Module groups shown per block or channel before "+N more".
_MAX_SHOWN = 4
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

_GRAPHVIZ_HINT = ("graphviz's `dot` is not on PATH: install graphviz (Debian/Ubuntu: apt-get "
                  "install graphviz; macOS: brew install graphviz; conda: conda install -c "
                  "conda-forge graphviz), or write a .dot file and run `dot -Tsvg plan.dot -o "
                  "plan.svg` where graphviz is installed")


class ModuleNames:
    """Names blocks and channels by the modules of their nodes."""

    def __init__(self, module_of: Mapping[str, str]) -> None:
        self._module_of = module_of

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
                key = name if keep_unknown else _OUTSIDE
            else:
                key = f"module {module}"
                for prefix, group in _PARAMETER_GROUPS:
                    if module.startswith(prefix):
                        key, part = group, module[len(prefix):]
                        break
            members = groups.setdefault(key, [])
            counts[key] = counts.get(key, 0) + 1
            if part is not None and part not in members:
                members.append(part)
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
                text += f": {counts[key]} ops"
            lines.append(text)
        if len(groups) > _MAX_SHOWN:
            lines.append(f"+{len(groups) - _MAX_SHOWN} more modules")
        return lines

    def describe_ops(self, ops: Sequence[str]) -> str:
        groups, counts = self._groups(ops, keep_unknown=False)
        return "\\n".join([f"{len(ops)} ops"] + self._lines(groups, counts))

    def describe_values(self, values: Sequence[str]) -> str:
        # A value outside every module is state or a batch input: its own name says it.
        groups, _ = self._groups(values, keep_unknown=True)
        return ", ".join(self._lines(groups, None))


def read_module_map(path: str | pathlib.Path) -> dict[str, str]:
    """The node -> module map `Job.start` wrote in plan mode ({} if none)."""
    path = pathlib.Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SplitrunError(f"cannot read the plan's module map {path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in data.items()):
        raise SplitrunError(f"the plan's module map {path} is not a JSON object of strings")
    return data


def plan_picture(plan: SplitPlan, module_of: Mapping[str, str] | None = None) -> str:
    """The DOT source: blocks named by modules where `module_of` knows them,
    and the legend."""
    if module_of:
        names = ModuleNames(module_of)
        dot = plan_to_dot(plan, names.describe_ops, names.describe_values)
    else:
        dot = plan_to_dot(plan)
    body, closing = dot.rstrip().rsplit("}", 1)
    return body + LEGEND + "}" + closing + "\n"


def render_plan(text: str, out: str | pathlib.Path,
                module_of: Mapping[str, str] | None = None) -> SplitPlan:
    """Write the plan whose text form is `text` to `out`, by its suffix:
    .txt (the text form), .svg (needs graphviz's `dot`), else DOT."""
    plan = SplitPlan.from_text(text)
    path = pathlib.Path(out)
    if path.suffix == ".txt":
        path.write_text(text)
    elif path.suffix == ".svg":
        dot = shutil.which("dot")
        if dot is None:
            raise SplitrunError(f"writing {path} needs {_GRAPHVIZ_HINT}")
        subprocess.run([dot, "-Tsvg", "-o", str(path)], input=plan_picture(plan, module_of),
                       text=True, check=True, timeout=_DOT_TIMEOUT_S)
    else:
        path.write_text(plan_picture(plan, module_of))
    return plan
