"""Liveness under slow links: a real syncer and real islands (threads) on loopback, one of them behind a slow link.

Scaled down from a 70B-class adapter (~400 MB up a 2 Mbit/s line, ~27 minutes): a ~4 MB adapter through a link of
~4 Mbit/s, so one message takes ~8-10 s, longer than the --island-timeout and the islands' dead-peer timeout.
"""

import threading
import time

import numpy as np

from tests.peers import QuadraticIsland, RawIsland, island_thread, wait_until
from yeto.testbed.netem import Link, Profile
from yeto.sync.shell.tape import read_tape
from yeto.sync.wire.layout import build_layout, flatten
from yeto.sync.wire.protocol import encode

ROWS = 500_000  # lora_B rows: 1M float32 values, ~4 MB per message at --sync-bits 32
ADAPTER_BYTES = (2 * 4 + ROWS * 2) * 4
RATE = 500_000  # bytes/s on the slow direction (4 Mbit/s): one adapter takes ~8 s
SLOW_WAIT_S = 120  # the most a test waits for the slow island (~20 s alone; CI's 2 busy cores slow its proxy's pumps)


def slow_link(target_port: int, up: float = 0.0, down: float = 0.0) -> Link:
    """A link shaped to `up`/`down` bytes/s (0: unlimited), no delay, no stalls."""
    return Link(target_port, Profile("slow", down_bps=8 * down, up_bps=8 * up))


def island():
    return QuadraticIsland(1.0, 10, shape_b=(ROWS, 2))


def test_an_upload_longer_than_the_island_timeout_is_not_dropped_merges_and_goes_up_once(start_syncer):
    syncer, port = start_syncer(islands=2, quorum=1, outer_steps=9, inner_steps=2, sync_bits=32, island_timeout=4,
                                grace_s=0.3, straggler_timeout=0.5, max_base_lag=10)
    link = slow_link(port, up=RATE)
    results = {}
    try:
        island_thread(island(), port, 0, results, step_delay=1.0)  # rounds of ~2 s
        wait_until(lambda: syncer.version == 0 and syncer.global_ is not None)
        slow = island_thread(island(), link.port, 1, results, step_delay=2.5)  # trains 5 s, uploads ~8 s
        assert wait_until(lambda: any(e["event"] == "delta" and e["island"] == 1 for e in read_tape(syncer.cfg.out)),
                          SLOW_WAIT_S), "the slow island's delta never came"
        up_at_ack = link.bytes_up
        time.sleep(2.5)  # it trains its next round (5 s): nothing of size should go up meanwhile
        resent = link.bytes_up - up_at_ack
        slow.join(SLOW_WAIT_S)
    finally:
        link.close()
    assert all(isinstance(r, dict) for r in results.values()), results
    events = read_tape(syncer.cfg.out)
    first = next(e for e in events if e["event"] == "delta" and e["island"] == 1)
    assert first["bytes"] / RATE > 4 * 1.5  # its upload took well over the --island-timeout ...
    assert not any(e["event"] == "leave" and e.get("island") == 1 and "silent" in e["reason"] for e in events)
    assert any(e["event"] == "merge" and 1 in e["responders"] for e in events)  # ... it stayed, and its delta merged
    # the rounds opened while it uploaded did not queue a second copy behind the first (a copy more of a slow upload)
    assert resent < ADAPTER_BYTES / 10, f"{resent} bytes went up after its delta arrived: a second copy"


def test_a_slow_reader_delays_nobody_is_held_bounded_and_catches_up_from_the_latest_global(start_syncer):
    syncer, port = start_syncer(islands=2, quorum=1, outer_steps=8, inner_steps=2, sync_bits=32, island_timeout=10,
                                grace_s=0.3, straggler_timeout=0.5, max_base_lag=10)
    link = slow_link(port, down=RATE)
    results, islands = {}, {0: island(), 1: island()}
    peak = [0]
    sampling = True

    def sample():
        while sampling:
            peak[0] = max(peak[0], syncer.queued_bytes(1))
            time.sleep(0.02)

    try:
        fast = island_thread(islands[0], port, 0, results, step_delay=0.2)
        wait_until(lambda: syncer.version == 0 and syncer.global_ is not None)
        t0 = time.monotonic()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        slow = island_thread(islands[1], link.port, 1, results)
        fast.join(30)
        fast_s = time.monotonic() - t0
        slow.join(SLOW_WAIT_S)
        slow_s = time.monotonic() - t0
        sampling = False
        sampler.join(5)
    finally:
        link.close()
    assert isinstance(results.get(0), dict), results
    # island 0 finished every round before the slow reader got its first adapter (~8 s): never held up by it
    assert syncer.version == 8 and fast_s < ADAPTER_BYTES / RATE, fast_s
    # the slow reader caught up from the latest global, not through the queue of every version it missed
    assert isinstance(results.get(1), dict), f"the slow reader did not finish within {slow_s:.0f}s: {results}"
    layout = build_layout(islands[1].state)
    assert np.array_equal(flatten(layout, islands[1].state), syncer.global_)
    assert link.bytes_down < 4 * ADAPTER_BYTES, f"{link.bytes_down} bytes went down to the slow reader"
    # what the syncer held for it at any moment: one adapter on its way and one waiting
    assert 0 < peak[0] <= 2 * (ADAPTER_BYTES + (64 << 10)), peak[0]


def test_a_catch_up_asking_again_for_a_broadcast_it_lost_gets_it_again(start_syncer):
    """The syncer holds back a broadcast whose base it skipped on a connection, never one a catch-up asks for again
    (its first copy may have been lost with a broken connection)."""
    syncer, port = start_syncer(islands=1, quorum=1, outer_steps=2, inner_steps=1, sync_bits=32)
    island = RawIsland(port, 0)
    try:
        layout = island.found(QuadraticIsland(0.0, 1).state)
        assert island.recv(want="round").header["round"] == 1
        parts = island.delta_parts(layout, 1, 0, np.full(layout.numel, 0.01, np.float32))
        assert island.ask(parts, bulk=True, want="ack").header["round"] == 1
        assert island.recv(want="broadcast").header["version"] == 1
        again = island.ask(encode("sync", island.header(version=0, pushed=None)), want="broadcast")
        assert again.header["version"] == 1
    finally:
        island.close()
