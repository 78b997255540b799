"""Row copies by index (`row_copy`) and the split of ids by server
(`RowSharding`), against torch's own ops: bit for bit, whatever the dtype,
alignment or row stride."""

import pytest
import torch

from splitrun.runtime.engine.embedding.row_copy import RowArray, copy_rows_, gather_rows
from splitrun.runtime.engine.embedding.sharding import RowSharding


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("dim", [1, 3, 128])
def test_rows_move_bit_for_bit_as_torchs_index_ops(dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    table = torch.randn(100, dim, generator=generator).to(dtype)
    table[3, 0], table[4, 0] = float("nan"), -0.0
    index = torch.randperm(100, generator=generator)[:37]
    gathered = gather_rows(table, index)
    assert gathered.dtype == dtype and gathered.shape == (37, dim)
    assert torch.equal(_bits(gathered), _bits(table.index_select(0, index)))
    # A source that starts off any 16-byte boundary (rows after an odd count
    # of elements, as rows lent in place by a ring after ids), a strided table.
    flat = torch.randn(37 * dim + 1, generator=generator).to(dtype)
    flat[1] = float("nan")
    for source in (flat[:-1].view(37, dim), flat[1:].view(37, dim)):
        ours, theirs = torch.zeros(100, dim, dtype=dtype), torch.zeros(100, dim, dtype=dtype)
        copy_rows_(ours, index, source)
        theirs.index_copy_(0, index, source)
        assert torch.equal(_bits(ours), _bits(theirs))
    wide = torch.randn(100, dim + 5, generator=generator).to(dtype)[:, :dim]
    assert torch.equal(_bits(gather_rows(wide, index)), _bits(wide.index_select(0, index)))
    assert gather_rows(table, torch.empty(0, dtype=torch.int64)).shape == (0, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_array_puts_and_takes_as_torchs_index_ops(dtype):
    """A shard's rows viewed once (a server's copies): the same bits as
    `index_copy_` and `index_select`, a source in another dtype converted
    as theirs, an out of another dtype filled as `copy_` does."""
    generator = torch.Generator().manual_seed(1)
    table = torch.randn(50, 8, generator=generator).to(dtype)
    table[2, 1], table[9, 0] = float("nan"), -0.0
    rows, theirs = RowArray(table.clone()), table.clone()
    index = torch.randperm(50, generator=generator)[:13]
    for source in (torch.randn(13, 8, generator=generator).to(dtype),
                   torch.randn(13, 8, generator=generator, dtype=torch.float64)):
        rows.put(index.numpy(), source)
        theirs.index_copy_(0, index, source.to(dtype))
        assert torch.equal(_bits(rows.rows), _bits(theirs))
    out = torch.empty(13, 8, dtype=dtype)
    rows.take_into(out, index.numpy())
    assert torch.equal(_bits(out), _bits(theirs.index_select(0, index)))
    wider = torch.empty(13, 8, dtype=torch.float64)
    rows.take_into(wider, index.numpy())
    assert torch.equal(wider, theirs.index_select(0, index).double())
    with pytest.raises(ValueError, match="each contiguous"):
        RowArray(table.t())


@pytest.mark.parametrize("num_rows, num_servers", [(250_000, 2), (1_000, 3), (17, 1), (5, 4)])
def test_ids_split_by_server_as_the_hash_says(num_rows, num_servers):
    sharding = RowSharding(num_rows, num_servers)
    ids = torch.randint(0, num_rows, (3_000,), generator=torch.Generator().manual_seed(0))
    owner = sharding.server_of(ids)
    parts = sharding.positions_by_server(ids)
    assert len(parts) == num_servers
    for server, positions in enumerate(parts):
        assert torch.equal(positions, (owner == server).nonzero().reshape(-1))
        local = sharding.local_index(ids[positions], server)
        assert torch.equal(torch.from_numpy(sharding.local_rows(ids[positions], server, 7)),
                           local + 7)
        assert bool((local >= 0).all()) and bool((local < sharding.shard_size(server)).all())
        # local index -> id: the server's ids in local order
        assert torch.equal(sharding.ids_of(server)[local], ids[positions])
