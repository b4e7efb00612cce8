"""The one per-unit checksum: what the executor's commit vote and the checkpoint baselines compare.

xxh3 (64-bit) over the tensor's dtype, shape and raw bytes: raw bytes are stricter than
torch.equal (-0.0 vs 0.0, NaN payloads), and dtype and shape keep two pieces that happen to
share bytes apart.
"""
from __future__ import annotations

import torch
import xxhash


def unit_digest(t: torch.Tensor) -> int:
    """Checksum of one slice unit (or one whole replicated tensor)."""
    h = xxhash.xxh3_64()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())  # 0-dim too
    return h.intdigest()


def view_digest(t: torch.Tensor, scratch: torch.Tensor | None = None) -> int:
    """`unit_digest` of a view that may be strided (a column slice), without fresh memory: a strided
    view is copied into `scratch` (bytes, at least as many as the view's, reused across calls) first.
    `.contiguous()` would allocate new pages for every piece, and page faults cost more than the hash."""
    if t.is_contiguous() or scratch is None or t.device != scratch.device:
        return unit_digest(t)
    flat = scratch[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    flat.copy_(t)
    return unit_digest(flat)
