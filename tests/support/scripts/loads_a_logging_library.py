"""examples/pipeline_split.py behind a leading import of fbgemm_gpu, a library
that logs while it loads: the template imports it too (script_imports.py), and
the processes forked from it must keep their log and progress lines
(tests/launcher/test_launcher_logs.py)."""

import pathlib
import runpy
import sys

import fbgemm_gpu  # noqa: F401

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "pipeline_split.py"
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
