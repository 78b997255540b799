"""Datasets as users have them, streamed through `torch.utils.data`, each
worker reading only its own shard of every global batch."""

from .criteo import (
    NUM_CATEGORICAL,
    NUM_FIELDS,
    NUM_INTEGER,
    CriteoDataset,
    CriteoFile,
    CriteoFormatError,
    CriteoSchema,
    hash_categories,
    parse_lines,
)
from .synthetic_criteo import SyntheticCriteo, category_token, write_synthetic_criteo

__all__ = ["NUM_CATEGORICAL", "NUM_FIELDS", "NUM_INTEGER", "CriteoDataset", "CriteoFile",
           "CriteoFormatError", "CriteoSchema", "hash_categories", "parse_lines",
           "SyntheticCriteo", "category_token", "write_synthetic_criteo"]
