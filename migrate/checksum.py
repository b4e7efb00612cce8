"""The one per-unit checksum: what the executor's commit vote and the checkpoint baselines compare.

xxh3 (64-bit) over the tensor's dtype, shape and raw bytes: raw bytes are stricter than
torch.equal (-0.0 vs 0.0, NaN payloads), and dtype and shape keep two pieces that happen to
share bytes apart.
"""
from __future__ import annotations

import functools

import torch
import xxhash

#: dtypes whose numpy view hands xxh3 the tensor's raw bytes directly (others go through a uint8 view)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


@functools.lru_cache(maxsize=4096)
def _header(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    return f"{dtype}{tuple(shape)}".encode()


def unit_digest(t: torch.Tensor) -> int:
    """Checksum of one slice unit (or one whole replicated tensor). Called once per message or unit
    inside a migration's pause, so it avoids every tensor op it can (2-3 us instead of 5-6)."""
    h = xxhash.xxh3_64(_header(t.dtype, t.shape))
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    h.update(t.numpy() if t.dtype in _NUMPY_DTYPES else t.reshape(-1).view(torch.uint8).numpy())  # 0-dim too
    return h.intdigest()
