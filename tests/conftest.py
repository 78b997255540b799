"""Shared test setup: the example models live in examples/."""

import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
