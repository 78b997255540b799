"""Shared test setup: the example models live in examples/.

Launched jobs are compared with references computed in this process bit for
bit, and a different intra-op thread count sums in a different order. The
launcher takes a user's OMP_NUM_THREADS as its thread budget, so setting it
to this process's count makes every child compute as this process does.
"""

import os
import pathlib
import sys

import torch

os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
