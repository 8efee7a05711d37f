"""The wire format: raw bytes without casts, aligned layout, bucket plan, consume pieces, checksum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.param_sync.bucket import (
    ALIGN,
    checksum,
    dtype_from_name,
    dtype_name,
    plan_manifest,
    tensor_bytes,
)
from tandem.param_sync.errors import LayoutError

DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_bytes_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    raw = torch.randint(0, 256, (6 * 4 * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    tensor = raw.view(dtype).reshape(6, 4)  # arbitrary bits: NaN payloads and subnormals included
    back = torch.empty_like(tensor)
    back.reshape(-1).view(torch.uint8).copy_(tensor_bytes(tensor))
    assert torch.equal(back.reshape(-1).view(torch.uint8), raw)
    assert dtype_from_name(dtype_name(dtype)) is dtype


def test_raw_bytes_of_zero_dim_and_non_contiguous_tensors() -> None:
    assert tensor_bytes(torch.tensor(1.5)).numel() == 4
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert torch.equal(tensor_bytes(base.t()), tensor_bytes(base.t().contiguous()))


def test_unknown_dtype_name_is_rejected() -> None:
    with pytest.raises(LayoutError):
        dtype_from_name("float7")
    with pytest.raises(LayoutError):
        dtype_from_name("nn")


def test_layout_is_aligned_ordered_and_rejects_duplicate_names() -> None:
    manifest = plan_manifest(
        [("a", torch.float32, (3,), 12), ("b", torch.bfloat16, (5,), 10), ("c", torch.int64, (), 8)],
        bucket_nbytes=16,
        version=0,
    )
    offsets = [t.offset for t in manifest.tensors]
    assert offsets == [0, ALIGN, 2 * ALIGN]
    assert manifest.total_nbytes == 2 * ALIGN + 8
    assert manifest.bucket_count == -(-manifest.total_nbytes // 16)
    with pytest.raises(LayoutError, match="twice"):
        plan_manifest([("a", torch.float32, (1,), 4), ("a", torch.float32, (1,), 4)], bucket_nbytes=8, version=0)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=0, max_size=8),
    bucket=st.integers(1, 200),
    piece=st.integers(1, 200),
)
def test_buckets_and_pieces_cover_every_tensor_byte_exactly_once(sizes: list[int], bucket: int, piece: int) -> None:
    manifest = plan_manifest(
        [(f"t{i}", torch.uint8, (n,), n) for i, n in enumerate(sizes)], bucket_nbytes=bucket, version=3
    )
    stream = np.arange(manifest.total_nbytes, dtype=np.uint64).astype(np.uint8)
    ranges = [manifest.bucket_range(seq) for seq in range(manifest.bucket_count)]
    edges = [0, *(hi for _, hi in ranges)]
    assert ranges == list(itertools.pairwise(edges))  # contiguous, in order
    assert edges[-1] == manifest.total_nbytes
    assert all(hi - lo <= bucket for lo, hi in ranges)
    rebuilt = {t.name: bytearray(t.nbytes) for t in manifest.tensors}
    covered = {t.name: 0 for t in manifest.tensors}
    for lo, hi in ranges:
        for start in range(lo, hi, piece):
            for part in manifest.slices(stream, start, min(start + piece, hi)):
                rebuilt[part.name][part.start : part.start + part.data.size] = part.data.tobytes()
                covered[part.name] += part.data.size
    for meta in manifest.tensors:
        assert covered[meta.name] == meta.nbytes
        assert bytes(rebuilt[meta.name]) == stream[meta.offset : meta.offset + meta.nbytes].tobytes()


@given(data=st.binary(min_size=1, max_size=100), index=st.integers(0, 99), flip=st.integers(1, 255))
def test_checksum_catches_any_single_byte_change(data: bytes, index: int, flip: int) -> None:
    original = np.frombuffer(data, np.uint8).copy()
    changed = original.copy()
    changed[index % len(data)] ^= flip
    assert checksum(original) == checksum(original.copy())
    assert checksum(changed) != checksum(original)


def test_checksum_catches_truncation_to_zeros_and_stale_bytes() -> None:
    fresh = np.frombuffer(np.random.default_rng(0).bytes(4096), np.uint8).copy()
    torn = fresh.copy()
    torn[2048:] = 0
    stale = fresh.copy()
    stale[100:200] = np.frombuffer(np.random.default_rng(1).bytes(100), np.uint8)
    assert len({checksum(fresh), checksum(torn), checksum(stale)}) == 3
