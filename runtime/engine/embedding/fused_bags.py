"""Cached bags on FBGEMM's table-batched embedding kernels.

A group of tables (`bag_batching` chose them: sum bags trained with plain
SGD, write-back) keeps its caches' rows in one flat buffer, table after
table, as FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen` keeps its
weights: each table's cache slots are the kernel's rows. One forward call
sums every table's bags; one backward call sums each row's gradient over its
lookups (in batch order) and applies `row - lr * grad` to the cached rows in
place, rounded once, as `ops.sparse_updates.sparse_sgd_` does: bit for bit the
unsplit step. The CPU operators are called directly (not through the
module's autograd function): in a split step the forward and the backward
are separate graph nodes.

Measured on the bench's tables (8 x 16 384 lookups of 128-wide rows, one
thread): the fused backward and update 0.11 s against 0.22 s for the torch
ops it replaces (sort per table, `embedding_bag` over the gradient,
`index_add_`); the forward is torch's `embedding_bag` kernel either way
(FBGEMM's too), equal in time. On other devices (FBGEMM's CUDA build has
other operators) the same arithmetic runs on torch's ops.
"""

from __future__ import annotations

import itertools
import math

import torch

from splitrun.splitter.ops.bags import bag_gradient_rows, sorted_groups
from splitrun.splitter.ops.sparse_updates import sparse_sgd_

from ...errors import CacheError
from .huge_pages import zeros_rows
from .row_cache import RowCache

__all__ = ["FusedBags"]

# FBGEMM's placement code for weights in host memory (EmbeddingLocation.HOST).
_HOST = 3
_SUM_POOLING = 0
# The forward's output rows are padded by this many bytes when their width
# is a multiple of 1 KiB: rows 4 KiB apart share cache sets (measured on the
# bench's 8 x 128 floats, 4 KiB a row: the forward and the `stack` reading
# its bags ~1 ms, ~20 %, cheaper at 4 KiB + 64 B).
_ROW_PAD_BYTES = 64


def _fbgemm_ops():
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    except ImportError as exc:
        raise CacheError(
            f"the embedding cache's fused bags need FBGEMM's kernels: pip install "
            f"fbgemm-gpu-cpu==1.8.0 (CPU; GPU: fbgemm-gpu==1.8.0) ({exc})") from exc
    return torch.ops.fbgemm


class FusedBags:
    """One group's caches as one table-batched buffer, and its two calls."""

    def __init__(self, caches: list[RowCache]) -> None:
        self.caches = caches
        self.device = caches[0].device
        self.dims = [cache.table.dim for cache in caches]
        sizes = [cache.capacity * cache.table.dim for cache in caches]
        self.weights = zeros_rows(sum(sizes), caches[0].table.dtype, self.device)
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        for cache, start, size in zip(caches, starts, sizes):
            cache.adopt_rows(self.weights[start:start + size].view(cache.capacity, cache.table.dim))
        self.is_native = self.device.type == "cpu"
        if self.is_native:
            self._ops = _fbgemm_ops()
            capacities = [cache.capacity for cache in caches]
            self._weights_offsets = torch.tensor(starts, dtype=torch.int64)
            self._d_offsets = torch.tensor([0, *itertools.accumulate(self.dims)], dtype=torch.int32)
            self._hash_size_cumsum = torch.tensor([0, *itertools.accumulate(capacities)],
                                                  dtype=torch.int64)
            self._hash_bits = int(math.log2(max(1, sum(capacities)))) + 1
            self._placements = torch.full((len(caches),), _HOST, dtype=torch.int32)
            row_bytes = sum(self.dims) * self.weights.element_size()
            self._out_width = sum(self.dims) + (
                _ROW_PAD_BYTES // self.weights.element_size() if row_bytes % 1024 == 0 else 0)
        self._lookups: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, slots: list[torch.Tensor], offsets: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every table's sum bags ([bags, dim] each): `slots` the cache slot of
        each lookup, `offsets` each bag's first lookup (the same number of bags
        in every table)."""
        num_bags = offsets[0].numel()
        if any(o.numel() != num_bags for o in offsets):
            raise CacheError(f"fused cached bags need the same number of bags in every table, "
                             f"got {[o.numel() for o in offsets]}")
        if not self.is_native:
            self._lookups = (slots, offsets)
            return [torch.nn.functional.embedding_bag(s.to(self.device), c.rows,
                                                      o.to(self.device), mode="sum")
                    for s, o, c in zip(slots, offsets, self.caches)]
        indices = torch.cat(slots)
        starts, total = [], 0
        for table_slots, table_offsets in zip(slots, offsets):
            starts.append(table_offsets + total)
            total += table_slots.numel()
        starts.append(torch.tensor([total], dtype=torch.int64))
        all_offsets = torch.cat(starts)
        self._lookups = (indices, all_offsets)
        out = self._ops.split_embedding_codegen_forward_cpu(
            self.weights, self._weights_offsets, self._d_offsets, self._out_width,
            self._hash_size_cumsum, indices, all_offsets, _SUM_POOLING, None, 0)
        return list(out[:, :sum(self.dims)].split(self.dims, 1))

    def backward_update(self, grads: list[torch.Tensor], lr: torch.Tensor, *,
                        maximize: bool = False) -> None:
        """The bags' gradients (one [bags, dim] per table) summed per row and
        applied to the cached rows by SGD, in place (the forward's lookups)."""
        if self._lookups is None:
            raise CacheError("the fused bags' backward ran before their forward in this step")
        rate = -float(lr) if maximize else float(lr)
        if not self.is_native:
            slots, offsets = self._lookups
            for grad, table_slots, table_offsets, cache in zip(grads, slots, offsets, self.caches):
                groups = sorted_groups(table_slots)
                summed = bag_gradient_rows(grad, table_slots, table_offsets, None, False, None,
                                           groups.order, groups.starts)
                sparse_sgd_(cache.rows, groups.unique.to(self.device), summed, rate, None,
                            is_coalesced=True)
            self._lookups = None
            return
        indices, offsets = self._lookups
        self._lookups = None
        grad_output, d_offsets = self._grad_rows(grads)
        self._ops.split_embedding_backward_codegen_sgd_cpu(
            grad_output, self.weights, self._placements, self._weights_offsets,
            d_offsets, max(self.dims), self._hash_size_cumsum, self._hash_bits, indices,
            offsets, _SUM_POOLING, None, False, torch.tensor(rate, dtype=torch.float32), 0)

    def _grad_rows(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The bags' gradients as the kernel reads them: one [bags, width]
        row-major tensor, each table's columns at its `D_offsets` entry.

        Where the gradients are side by side in the rows of one buffer (the
        backward of a `stack` or `cat` of the bags, as DLRM's interaction
        gives them), that buffer itself, columns shifted: no copy. Otherwise
        they are concatenated. Reading the buffer in place is also faster
        (measured on the bench's 8 tables: 9.8 against 12.9 ms with the
        concatenation): a concatenation of 8 x 128 floats is 4 KiB a row, and
        rows 4 KiB apart share cache sets (the kernel reads one table's column
        block of every row at once)."""
        first = grads[0]
        stride = first.stride(0)
        start = first.storage_offset() - first.storage_offset() % stride if stride else 0
        shift = first.storage_offset() - start
        num_bags = first.shape[0]
        column = shift
        in_place = stride > 0 and first.dtype == self.weights.dtype
        for grad, dim in zip(grads, self.dims):
            in_place = (in_place and grad.dim() == 2 and grad.shape == (num_bags, dim)
                        and grad.dtype == first.dtype and grad.device == first.device
                        and grad.stride() == (stride, 1) and grad.untyped_storage().data_ptr()
                        == first.untyped_storage().data_ptr()
                        and grad.storage_offset() == start + column)
            column += dim
        size = first.untyped_storage().nbytes() // first.element_size()
        if in_place and column <= stride and start + num_bags * stride <= size:
            rows = first.as_strided((num_bags, stride), (stride, 1), start)
            return rows, self._d_offsets + shift
        return torch.cat(grads, 1).contiguous(), self._d_offsets
