"""Elementwise numpy work over a long vector on several cores.

numpy releases the GIL inside its loops, so threads over disjoint spans run in parallel; every value's arithmetic is
its own, so the result is the same bits whatever the split (and on one core).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

WORKERS = min(8, os.cpu_count() or 1)  # past ~8 threads the work is bound by memory bandwidth, not cores
_pool: Optional[ThreadPoolExecutor] = None


def over_spans(n: int, fn: Callable[[int, int], None], min_span: int) -> None:
    """fn(a, b) over disjoint spans [a, b) covering [0, n), one per worker, none shorter than `min_span` (a thread
    costs more than it saves on a short one)."""
    global _pool
    k = max(1, min(WORKERS, n // max(1, min_span)))
    if k == 1:
        if n:
            fn(0, n)
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="yeto-spans")
    step = -(-n // k)
    for job in [_pool.submit(fn, a, min(a + step, n)) for a in range(0, n, step)]:
        job.result()
