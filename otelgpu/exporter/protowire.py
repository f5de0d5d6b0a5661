"""Protocol buffers wire format pieces for the exporters' fast writers (numba kernels that lay
out messages from columns); each writer is tested byte for byte against the protobuf library."""

from __future__ import annotations

import numpy as np

from otelgpu.core.jit import kernel


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def len_field(number: int, payload: bytes) -> bytes:
    return len_head(number, len(payload)) + payload


def len_head(number: int, length: int) -> bytes:
    """What comes before a length-delimited field's `length` bytes: its tag and its length."""
    return varint(number << 3 | 2) + varint(length)


def arena(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The blobs end to end as one byte array, and where each starts (blob i is
    arena[offsets[i]:offsets[i + 1]]): what the kernels copy cached bytes from."""
    offsets = np.zeros(len(blobs) + 1, np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return np.frombuffer(b"".join(blobs), np.uint8), offsets


@kernel(inline=True)
def put_varint(out: np.ndarray, at: int, n: int) -> int:
    while n > 0x7F:
        out[at] = (n & 0x7F) | 0x80
        n >>= 7
        at += 1
    out[at] = n
    return at + 1


@kernel(inline=True)
def put_fixed64(out: np.ndarray, at: int, tag: int, n: int) -> int:
    out[at] = tag
    for k in range(8):
        out[at + 1 + k] = (n >> (8 * k)) & 0xFF
    return at + 9


@kernel(inline=True)
def varint_size(n: int) -> int:
    size = 1
    while n > 0x7F:
        n >>= 7
        size += 1
    return size
