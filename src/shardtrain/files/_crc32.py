"""CRC32 of a concatenation from the CRC32s of its parts: zlib's ``crc32_combine``.

A rank file's CRC32 (which meta.json records) covers its header and its data, but the header
is written last, after the data has gone through ``zlib.crc32`` (the header holds the
tensors' checksums, known only then). Rather than read the data a second time, the file's
CRC32 is combined from the header's and the data's: ``crc32(a + b) == crc32_combine(crc32(a),
crc32(b), len(b))``. Python's ``zlib`` does not expose ``crc32_combine``, so this is zlib's
algorithm (1.2.12 and later) in Python.

Appending ``n`` bytes multiplies the CRC register by ``x^(8n)`` modulo the CRC polynomial
(the bytes' own contribution is the second CRC, added in GF(2), i.e. xor). ``x^(8n)`` is the
product of the precomputed ``x^(2^k)`` for the bits of ``8n``: a few dozen 32-step
multiplications, tens of microseconds whatever the length.
"""
from __future__ import annotations

__all__ = ["crc32_combine"]

_POLY = 0xEDB88320  # the CRC32 polynomial, bit-reflected as zlib stores it
_ONE = 1 << 31      # x^0 in the reflected representation


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (both reflected)."""
    product = 0
    while a:
        if a & _ONE:
            product ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list:
    """``x^(2^k)`` modulo the polynomial, for k = 0..31 (zlib's ``x2n_table``)."""
    table, p = [], _ONE >> 1  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _powers()


def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial: what appending ``nbytes`` bytes multiplies
    the register by."""
    p, k = _ONE, 3  # 8 * nbytes: start at bit 3
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)``.

    Example:
        >>> a, b = b"shard", b"train"
        >>> crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        True
    """
    if len2 < 0:
        raise ValueError(f"crc32_combine: len2 is {len2}; a length is >= 0.")
    return _multmodp(_shift(len2), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)
