"""Plan pictures for `splitrun plan`: the script writes the plan's text form;
the launcher turns it into what `--out` asks for (DOT, SVG through graphviz's
`dot`, or the text itself)."""

from __future__ import annotations

import logging
import pathlib
import shutil
import subprocess

from splitrun.splitter.errors import SplitrunError
from splitrun.splitter.plan import SplitPlan

__all__ = ["render_plan"]

logger = logging.getLogger(__name__)

# Bounds graphviz on a large plan.
_DOT_TIMEOUT_S = 120.0


def render_plan(text: str, out: str | pathlib.Path) -> SplitPlan:
    """Write the plan whose text form is `text` to `out`, by its suffix:
    .txt (the text form), .svg (needs graphviz's `dot`), else DOT."""
    plan = SplitPlan.from_text(text)
    path = pathlib.Path(out)
    if path.suffix == ".txt":
        path.write_text(text)
    elif path.suffix == ".svg":
        dot = shutil.which("dot")
        if dot is None:
            raise SplitrunError(f"writing {path} needs graphviz's `dot` on PATH (apt-get "
                                f"install graphviz, or brew install graphviz); or write a "
                                f".dot file and convert it elsewhere")
        subprocess.run([dot, "-Tsvg", "-o", str(path)], input=plan.to_dot(), text=True,
                       check=True, timeout=_DOT_TIMEOUT_S)
    else:
        path.write_text(plan.to_dot())
    return plan
