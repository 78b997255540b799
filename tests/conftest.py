"""Shared test setup: the example models live in examples/.

Every process of the suite computes with one intra-op thread: the tests
compare launched jobs with references computed here bit for bit, and a
different thread count sums in a different order. The launcher takes a
user's OMP_NUM_THREADS as its thread budget, so its children match.
"""

import os
import pathlib
import sys

import torch

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
torch.set_num_threads(1)

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
