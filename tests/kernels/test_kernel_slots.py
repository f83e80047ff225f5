"""slots_for_tokens: block table -> slot mapping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.kernels import KernelInputError, gather_kv, slots_for_tokens


def test_docstring_example() -> None:
    slots = slots_for_tokens([7, 2], block_size=4, start_token=2, num_tokens=4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [30, 31, 8, 9]


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 16]),
    table=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    data=st.data(),
)
def test_matches_per_token_definition(
    block_size: int, table: list[int], data: st.DataObject
) -> None:
    capacity = len(table) * block_size
    start = data.draw(st.integers(0, capacity), label="start")
    count = data.draw(st.integers(0, capacity - start), label="count")
    expected = [
        table[p // block_size] * block_size + p % block_size for p in range(start, start + count)
    ]
    assert slots_for_tokens(table, block_size, start, count).tolist() == expected
    as_tensor = slots_for_tokens(torch.tensor(table, dtype=torch.int32), block_size, start, count)
    assert as_tensor.dtype == torch.int64 and as_tensor.tolist() == expected


def test_slots_address_the_blocks_tokens() -> None:
    # Each cache row holds its own (block, offset) so a gather shows where it read.
    num_blocks, block_size = 6, 16
    ids = torch.arange(num_blocks * block_size, dtype=torch.float32)
    cache = ids.view(1, 1, num_blocks, block_size, 1, 1).expand(2, 2, -1, -1, 1, 1).contiguous()
    table = [4, 0, 5]
    chunk = gather_kv(cache, slots_for_tokens(table, block_size, 10, 20))
    positions = torch.arange(10, 30)
    expected = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    assert torch.equal(chunk[1, 1, :, 0, 0], expected.float())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1, 2], 0, 0, 4), "block_size"),
        (([1, 2], 4, -1, 4), "start_token"),
        (([1, 2], 4, 0, -3), "num_tokens"),
        (([1, 2], 4, 5, 4), "need 3 blocks of 4, the table has 2"),
        (([1, -1], 4, 2, 4), "block ids >= 0"),
        ((torch.zeros(2, 2, dtype=torch.int64), 4, 0, 4), "1-D integer tensor"),
        ((torch.zeros(3), 4, 0, 4), "1-D integer tensor"),
    ],
)
def test_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(KernelInputError, match=message):
        slots_for_tokens(*args)


def test_unused_negative_entries_are_fine_and_empty_is_empty() -> None:
    # Only the blocks the range touches are checked.
    assert slots_for_tokens([-1, 3], 4, 4, 2).tolist() == [12, 13]
    assert slots_for_tokens([], 4, 0, 0).shape == (0,)


def test_device_argument_places_the_result() -> None:
    slots = slots_for_tokens([3, 1], 4, 1, 5, device="meta")
    assert slots.device.type == "meta" and slots.shape == (5,)
    assert slots_for_tokens([3, 1], 4, 0, 0, device="meta").device.type == "meta"
