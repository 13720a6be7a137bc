"""A slow, obviously correct crc32c (Castagnoli, reflected polynomial 0x82F63B78) in pure Python: the oracle the
integrity tests check the Rust core's hardware-accelerated sums against."""

from __future__ import annotations

_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes, value: int = 0) -> int:
    """crc32c of ``data`` appended to ``value``; ``crc32c(b"123456789") == 0xE3069283``."""
    crc = value ^ 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32c_hex(data: bytes) -> str:
    """As the manifest stores it: 8 lowercase hex digits."""
    return f"{crc32c(data):08x}"


assert crc32c(b"123456789") == 0xE3069283
