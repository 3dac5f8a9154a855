"""Wire precision: blockwise min-max quantization (2, 4 or 8 bits), fp16, or raw fp32.

Each block of `BLOCK` values stores a minimum and a step as fp16, and one code
per value (4-bit codes two to a byte, low nibble first; 2-bit codes four to a
byte, lowest bits first). The fp16 minimum is
rounded down and the step up, so every value lies in the block's grid range
and the error is at most half a step. Non-finite input is rejected: a NaN
delta never reaches the wire. 4 bits cost (BLOCK/2 + 4) bytes per BLOCK values:
68 bytes per 512 bytes of fp32 (7.5x smaller); 2 bits 36 bytes (14.2x smaller), with
a step of (max - min) / 3: only error feedback (`ErrorFeedback`) makes it usable.
"""

from __future__ import annotations

import numpy as np

from yeto.sync.wire.spans import over_spans

BLOCK = 128  # values per fp16 min/step pair: 4 bytes of scales per block, and an outlier coarsens one block only
BITS = (2, 4, 8, 16, 32)
CHUNK_BLOCKS = 512  # blocks decoded or encoded per step (256 KiB of fp32: stays in cache)
SPAN_BLOCKS = 4096  # blocks (512K values) at least per thread


class QuantError(ValueError):
    pass


def encoded_size(numel: int, bits: int) -> int:
    if bits == 32:
        return 4 * numel
    if bits == 16:
        return 2 * numel
    blocks = -(-numel // BLOCK)
    codes = blocks * BLOCK * bits // 8
    return 4 * blocks + codes  # fp16 mins + fp16 steps, then codes


def _fp16_bounds(lo: np.ndarray, hi: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block fp16 minimum (rounded down) and step (rounded up): the grid covers the block."""
    lo16 = lo.astype(np.float16)
    down = lo16.astype(np.float32) > lo
    lo16[down] = np.nextafter(lo16[down], np.float16(-np.inf))
    step = (hi - lo16.astype(np.float32)) / levels
    step16 = step.astype(np.float16)
    up = step16.astype(np.float32) < step
    step16[up] = np.nextafter(step16[up], np.float16(np.inf))
    return lo16, step16


def _first_non_finite(x: np.ndarray) -> QuantError:
    bad = int(np.flatnonzero(~np.isfinite(x))[0])
    return QuantError(f"non-finite value {x[bad]} at index {bad}: refusing to send it")


def quantize(x: np.ndarray, bits: int) -> bytes:
    """Encode a 1-D fp32 vector; `dequantize(quantize(x, b), x.size, b)` approximates x.

    numpy, a cache-sized chunk of blocks at a time: codes = round((v - lo) / step), clamped to the grid. The blocks'
    minima and maxima also find a non-finite value (NaN and infinities reach one of them): no separate pass over x.
    """
    if bits not in BITS:
        raise QuantError(f"unsupported wire precision {bits} bits (use one of {BITS})")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if bits in (16, 32):
        if not np.isfinite(x).all():
            raise _first_non_finite(x)
        if bits == 32:
            return x.tobytes()
        h = x.astype(np.float16)
        if not np.isfinite(h).all():
            raise QuantError("value beyond the fp16 range: use --sync-bits 32")
        return h.tobytes()
    levels = (1 << bits) - 1
    n = x.size
    blocks = -(-n // BLOCK)  # the last block padded with the last value
    lo16, step16 = np.empty(blocks, np.float16), np.empty(blocks, np.float16)
    codes = np.empty(blocks * BLOCK * bits // 8, np.uint8)
    problems: set[str] = set()

    def encode_span(first: int, end: int) -> None:
        scratch = np.empty((CHUNK_BLOCKS, BLOCK), np.float32)
        for a in range(first, end, CHUNK_BLOCKS):  # a cache-sized chunk at a time
            b = min(a + CHUNK_BLOCKS, end)
            v = scratch[: b - a]
            flat = v.reshape(-1)
            have = min(b * BLOCK, n) - a * BLOCK
            flat[:have] = x[a * BLOCK : a * BLOCK + have]
            flat[have:] = x[-1]
            low, high = v.min(1), v.max(1)
            if not (np.isfinite(low).all() and np.isfinite(high).all()):
                problems.add("non-finite")
                return
            lo16[a:b], step16[a:b] = _fp16_bounds(low, high, levels)
            if not (np.isfinite(lo16[a:b]).all() and np.isfinite(step16[a:b]).all()):
                problems.add("fp16 range")
                return
            lo = lo16[a:b].astype(np.float32)[:, None]
            step = step16[a:b].astype(np.float32)[:, None]
            # a zero step means a constant block equal to its (exact) minimum: (v - lo) is 0 there
            np.subtract(v, lo, out=v)
            np.divide(v, np.where(step > 0, step, np.float32(1.0)), out=v)
            np.rint(v, out=v)  # half to even, as torch.round
            np.clip(v, 0, levels, out=v)
            c = v.astype(np.uint8).reshape(-1)
            if bits == 4:
                packed = codes[a * BLOCK // 2 : b * BLOCK // 2]
                np.left_shift(c[1::2], 4, out=packed)
                packed |= c[0::2]
            elif bits == 2:
                packed = codes[a * BLOCK // 4 : b * BLOCK // 4]
                packed[:] = c[0::4]
                for k in (1, 2, 3):
                    packed |= np.left_shift(c[k::4], 2 * k)
            else:
                codes[a * BLOCK : b * BLOCK] = c

    over_spans(blocks, encode_span, SPAN_BLOCKS)
    if "non-finite" in problems:
        raise _first_non_finite(x)
    if problems:
        raise QuantError(f"values beyond the fp16 range of the {bits}-bit block scales: use --sync-bits 32")
    return lo16.tobytes() + step16.tobytes() + codes.tobytes()


def _code_tables() -> dict[int, np.ndarray]:
    """Byte -> its codes as fp32, to decode by one look-up per byte: 8 bits one code (a float32), 4 bits two codes,
    low nibble first (the two float32s packed in a uint64, in the machine's byte order), 2 bits four codes, lowest
    bits first (the four float32s as one 16-byte item)."""
    b = np.arange(256)
    pairs = np.stack([b & 0x0F, b >> 4], axis=1).astype(np.float32)  # (256, 2)
    quads = np.stack([(b >> (2 * k)) & 0x03 for k in range(4)], axis=1).astype(np.float32)  # (256, 4)
    return {8: b.astype(np.float32), 4: pairs.view(np.uint64).reshape(-1),
            2: np.ascontiguousarray(quads).view(np.dtype((np.void, 16))).reshape(-1)}


CODE_TABLES = _code_tables()


def dequantize(buf: bytes | memoryview, numel: int, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """Decode (into `out`, a float32 vector of `numel`, when given); a buffer of the wrong length or with non-finite
    scales is an error. With finite fp16 scales every value lo + code * step is finite: no pass checks them."""
    if bits not in BITS:
        raise QuantError(f"unsupported wire precision {bits} bits")
    want = encoded_size(numel, bits)
    if len(buf) != want:
        raise QuantError(f"{bits}-bit payload of {numel} values must be {want} bytes, got {len(buf)}")
    if out is None:
        out = np.empty(numel, dtype=np.float32)
    if bits in (16, 32):
        out[:] = np.frombuffer(buf, dtype=np.float32 if bits == 32 else np.float16)
        if not np.isfinite(out).all():
            raise QuantError("payload decodes to non-finite values")
        return out
    blocks = -(-numel // BLOCK)
    raw = np.frombuffer(buf, dtype=np.uint8)
    lo = raw[: 2 * blocks].view(np.float16).astype(np.float32)[:, None]
    step = raw[2 * blocks : 4 * blocks].view(np.float16).astype(np.float32)[:, None]
    if not (np.isfinite(lo).all() and np.isfinite(step).all()):
        raise QuantError("payload decodes to non-finite values (block scales)")
    codes = raw[4 * blocks :]
    whole = numel // BLOCK  # blocks decoded in place; a last, partial block through a scratch block
    per_byte = 8 // bits
    table = CODE_TABLES[bits]

    def decode_span(first: int, end: int) -> None:
        for a in range(first, end, CHUNK_BLOCKS):  # a cache-sized chunk at a time: look-up, scale, shift in cache
            b = min(a + CHUNK_BLOCKS, end)
            v = out[a * BLOCK : b * BLOCK]
            table.take(codes[a * BLOCK // per_byte : b * BLOCK // per_byte], out=v.view(table.dtype))
            v = v.reshape(b - a, BLOCK)
            np.multiply(v, step[a:b], out=v)
            np.add(v, lo[a:b], out=v)

    over_spans(whole, decode_span, SPAN_BLOCKS)
    if whole < blocks:
        last = CODE_TABLES[bits].take(codes[whole * BLOCK // per_byte :]).view(np.float32)
        out[whole * BLOCK :] = (last * step[whole] + lo[whole])[: numel - whole * BLOCK]
    return out


def block_steps(buf: bytes, numel: int, bits: int) -> np.ndarray:
    """The per-block quantization steps (for error bounds in tests and logs)."""
    blocks = -(-numel // BLOCK)
    raw = np.frombuffer(buf, dtype=np.uint8)
    return np.frombuffer(raw[2 * blocks : 4 * blocks].tobytes(), dtype=np.float16).astype(np.float32)


class ErrorFeedback:
    """Carries each round's quantization error into the next round's payload,
    so a biased rounding never accumulates (the compressed sum tracks the true sum)."""

    def __init__(self, numel: int):
        self.residual = np.zeros(numel, dtype=np.float32)

    def encode(self, x: np.ndarray, bits: int,
               pieces: list[tuple[int, int]] | None = None) -> tuple[list[bytes], np.ndarray]:
        """(one payload per (start, numel) piece, the vector the receiver will decode: zero outside the pieces).

        Values outside the pieces are not sent and leave their residual as it was (a streamed part's turn comes
        later). The residual is a new array: a caller holding the old one keeps it."""
        target = np.add(x, self.residual, dtype=np.float32)
        pieces = [(0, target.size)] if pieces is None else pieces
        payloads = [quantize(target[a : a + n], bits) for a, n in pieces]
        covered = sum(n for _, n in pieces) == target.size
        sent = np.empty_like(target) if covered else np.zeros_like(target)
        for p, (a, n) in zip(payloads, pieces):
            dequantize(p, n, bits, out=sent[a : a + n])
        if covered:
            self.residual = np.subtract(target, sent, out=target)
        else:
            residual = self.residual.copy()
            for a, n in pieces:
                residual[a : a + n] = target[a : a + n] - sent[a : a + n]
            self.residual = residual
        return payloads, sent
