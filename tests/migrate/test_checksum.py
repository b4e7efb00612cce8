"""migrate.checksum.unit_digest against xxh3 of the header and the bytes read from the tensor's storage
(an independent path), for the dtypes and views a migration digests."""
from __future__ import annotations

import pytest
import torch
import xxhash

from migrate.checksum import unit_digest


def oracle(t: torch.Tensor) -> int:
    c = t.detach().clone(memory_format=torch.contiguous_format)
    return xxhash.xxh3_64_intdigest(f"{t.dtype}{tuple(t.shape)}".encode() + bytes(c.untyped_storage()))


@pytest.mark.parametrize("t", [
    torch.randn(384), torch.randn(3, 4)[:, 1:3], torch.tensor(2.5), torch.randn(5, requires_grad=True),
    torch.randn(6).to(torch.bfloat16), torch.arange(7, dtype=torch.int64), torch.tensor([True, False]),
    torch.zeros(0, 3), torch.randint(0, 255, (1000,), dtype=torch.uint8), torch.randn(2, 3).half()])
def test_digest_is_xxh3_of_header_and_raw_bytes(t: torch.Tensor) -> None:
    assert unit_digest(t) == oracle(t)


def test_same_bytes_of_another_dtype_or_shape_differ() -> None:
    t = torch.randn(4, 6)
    assert len({unit_digest(t), unit_digest(t.view(torch.int32)), unit_digest(t.view(6, 4)),
                unit_digest(t.reshape(-1).view(torch.uint8))}) == 4
    u = t.clone()
    u.view(torch.int32)[1, 2] ^= 1  # one bit of one element
    assert unit_digest(u) != unit_digest(t)
