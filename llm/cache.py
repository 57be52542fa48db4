"""A batch's KV cache as rows of one left-padded tensor per layer, so rows can join and leave.

Every row ends in the same column (left padding), so one decode step appends one column for all rows.
Rows join by padding the shorter side on the left; rows leave by index; columns that are padding in
every remaining row are trimmed, so the width is always the longest live row.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def check_layers(cache: DynamicCache) -> None:
    """Sliding-window or quantized layers keep their own layout, which these functions would break."""
    odd = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if odd:
        raise ValueError(f"in-flight batching needs plain DynamicLayer caches, got {sorted(odd)}")


def _pad_left(t: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
    if columns == 0:
        return t
    shape = list(t.shape)
    shape[dim] = columns
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def concat(a: DynamicCache, mask_a: torch.Tensor, b: DynamicCache, mask_b: torch.Tensor):
    """Rows of ``a`` then rows of ``b`` in one cache, with the attention mask that goes with it."""
    width = max(mask_a.shape[1], mask_b.shape[1])
    for la, lb in zip(a.layers, b.layers):
        pa, pb = width - la.keys.shape[2], width - lb.keys.shape[2]
        la.keys = torch.cat([_pad_left(la.keys, pa, 2), _pad_left(lb.keys, pb, 2)])
        la.values = torch.cat([_pad_left(la.values, pa, 2), _pad_left(lb.values, pb, 2)])
    mask = torch.cat([_pad_left(mask_a, width - mask_a.shape[1], 1), _pad_left(mask_b, width - mask_b.shape[1], 1)])
    return a, mask


def select(cache: DynamicCache, mask: torch.Tensor, rows: list[int]):
    """Keep ``rows`` and drop the leading columns that none of them uses."""
    index = torch.tensor(rows, device=mask.device)
    mask = mask.index_select(0, index)
    used = mask.any(0).nonzero()
    start = int(used[0]) if len(used) else mask.shape[1]
    mask = mask[:, start:]
    for layer in cache.layers:
        # Slice first: index_select then copies only the columns that stay.
        layer.keys = layer.keys[:, :, start:].index_select(0, index)
        layer.values = layer.values[:, :, start:].index_select(0, index)
    return cache, mask
