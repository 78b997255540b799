"""Programs made for tests and benchmarks, not captured from a model:
random graphs of a given size over given labels (`synthetic`)."""

from .synthetic import random_batches, random_program

__all__ = ["random_program", "random_batches"]
