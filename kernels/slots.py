"""Slot mappings: where each token of a chunk lives in the paged cache."""

from __future__ import annotations

import torch

from kvtier.kernels.errors import KernelInputError

__all__ = ["slots_for_tokens"]


def slots_for_tokens(
    block_ids: list[int] | torch.Tensor,
    block_size: int,
    start_token: int,
    num_tokens: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Builds the slot mapping of tokens ``[start_token, start_token + num_tokens)``.

    Token ``p`` of a request whose block table is ``block_ids`` lives at
    ``slot = block_ids[p // block_size] * block_size + p % block_size``::

        block_ids = [7, 2], block_size = 4, start_token = 2, num_tokens = 4
        positions     2   3   4   5
        blocks        7   7   2   2
        slots        30  31   8   9

    Args:
        block_ids: the request's block table (logical block i -> physical
            block id), a list or a 1-D integer tensor.
        block_size: tokens per block.
        start_token: position of the chunk's first token in the request.
        num_tokens: tokens in the chunk.
        device: where the result goes; defaults to ``block_ids``'s device
            for a tensor and the CPU for a list. A list is checked and
            expanded on the host and copied once (no device sync).

    Returns:
        ``[num_tokens]`` int64 slots.

    Raises:
        KernelInputError: if the sizes are negative, the block table is too
            short for the range, or a block id is negative.
    """
    if block_size < 1:
        raise KernelInputError(f"block_size: expected >= 1, got {block_size}")
    if start_token < 0 or num_tokens < 0:
        raise KernelInputError(
            f"start_token, num_tokens: expected >= 0, got {start_token}, {num_tokens}"
        )
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.is_floating_point() or block_ids.is_complex():
            raise KernelInputError(
                f"block_ids: expected a 1-D integer tensor, got {block_ids.dtype} "
                f"of shape {tuple(block_ids.shape)}"
            )
        table = block_ids.to(device=device, dtype=torch.int64)
        target = table.device
    else:
        # A list is checked and expanded on the host, then copied once: no
        # device sync for the common case of a host-side block table.
        table = torch.tensor(list(block_ids), dtype=torch.int64)
        target = torch.device(device) if device is not None else table.device
    if num_tokens == 0:
        return torch.empty(0, dtype=torch.int64, device=target)
    last_block = (start_token + num_tokens - 1) // block_size
    if last_block >= table.shape[0]:
        raise KernelInputError(
            f"block_ids: tokens [{start_token}, {start_token + num_tokens}) need "
            f"{last_block + 1} blocks of {block_size}, the table has {table.shape[0]}"
        )
    first_block = start_token // block_size
    used = table[first_block : last_block + 1]
    # NOTE: for a CUDA tensor table this check is one small sync.
    if bool((used < 0).any()):
        raise KernelInputError(f"block_ids: expected block ids >= 0, got {used.tolist()}")
    positions = torch.arange(start_token, start_token + num_tokens, device=table.device)
    slots = used[positions // block_size - first_block] * block_size + positions % block_size
    return slots.to(target)
