"""Micro-batches: how many blocks go through the model at once, apart from how many make an optimizer step.

`--batch-size` (blocks per rank per step) is a training choice; `--micro-batch-size` is only a memory one. A step's
blocks go through in micro-batches of that size, each loss weighted by its share of the step's loss-bearing
tokens, so any micro-batch size gives the same gradient (to float summation order).

    --micro-batch-size all    the whole --batch-size at once (the default)
    --micro-batch-size N      N blocks at a time
    --micro-batch-size auto   the largest N <= --batch-size whose forward and backward fit, found by probing:
                              try N, on out-of-memory try a smaller one (binary search, about log2(batch) probes)

The probe runs a full-length block with every position loss-bearing (the LM head's widest case). In a torchrun
island every rank probes the same sizes in lockstep and a size counts only if it fits on every rank.
"""

from __future__ import annotations

from typing import Callable

from yeto import YetoError

WHOLE_BATCH = "all"
PROBE = "auto"


def parse_micro_batch_size(value: str, batch_size: int) -> int | None:
    """The micro-batch size to use (at most `batch_size`), or None for `auto` (probe)."""
    if value == WHOLE_BATCH:
        return batch_size
    if value == PROBE:
        return None
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise YetoError(f"--micro-batch-size must be {WHOLE_BATCH}, {PROBE} or a positive integer, got {value!r}")
    return min(size, batch_size)


def largest_that_fits(fits: Callable[[int], bool], batch_size: int) -> int:
    """The largest n in [1, batch_size] with fits(n), given that fitting is monotone (what fits n fits less).
    fits(n) runs one probe; the whole batch is tried first, so a batch that fits costs one probe."""
    if fits(batch_size):
        return batch_size
    lo, hi = 0, batch_size  # fits(lo) (0: nothing tried yet), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def chunks(n: int, size: int) -> list[slice]:
    """Row slices of a batch of n rows, `size` at a time (the last one may be smaller)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]
