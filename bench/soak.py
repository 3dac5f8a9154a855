"""Soak: 64 islands against one authenticated syncer for hundreds of rounds, with drop-outs and rejoins.

The syncer is a real `yeto syncer` process (CURVE, ZAP, the run's join key);
the islands are lightweight: numpy islands with a small adapter, 16 threads in
each of 4 worker processes, each speaking the real protocol through
`run_island` (its own two encrypted connections, heartbeats, catch-up). A
island crashes at random (its island raises: it says goodbye, as a killed
process's link would be noticed) and comes back after a pause as a new session
of the same island id, which proves the same identity and rejoins.

Reports rounds per second, the syncer's resident memory over time (sampled from
/proc), the ratio of its last to its early RSS (flat: about 1.0; memory that grew
with rounds or with rejoins would show here), and the audit of the tape.

    python bench/soak.py [--islands 64 --rounds 300 --quorum 32]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import tempfile
import threading
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yeto import YetoError  # noqa: E402
from yeto.launch.local import free_port  # noqa: E402
from yeto.sync.shell.audit import audit_run  # noqa: E402
from bench.synthetic import Crash, NumpyIsland, lora_names, start_syncer  # noqa: E402
from yeto.sync.shell.keys import read_join_key  # noqa: E402
from yeto.sync.shell.tape import read_tape  # noqa: E402

WORKERS = 4
SAMPLE_S = 1.0
MEAN_LIFETIME_S = 20.0  # an island crashes after an exponential lifetime with this mean ...
REJOIN_AFTER_S = (0.5, 3.0)  # ... and comes back after a pause drawn from this range
GIVE_UP_S = 20.0  # an island that cannot reach the syncer this long gives up (the run is over)
STEP_S = 0.01  # one inner step of a numpy island
TENSOR = (16, 256)  # each adapter: lora_A and lora_B of two layers at this shape (16k values)


def small_island(lid: int, crash_at: float) -> NumpyIsland:
    return NumpyIsland(lid, {n: TENSOR for n in lora_names(2)}, STEP_S, r=TENSOR[0], crash_at=crash_at)


def island_life(port: int, key, lid: int, stop, counts: dict) -> None:
    from yeto.island.diloco import run_island
    from yeto.sync.core.island import LinkTimeouts

    rng = random.Random(lid)
    identity = f"soak-island-{lid:04d}-identity"
    timeouts = LinkTimeouts(heartbeat_s=1.0, dead_after_s=10.0, backoff_base_s=0.1, backoff_max_s=2.0,
                            give_up_s=GIVE_UP_S)
    while not stop.is_set():
        island = small_island(lid, time.monotonic() + rng.expovariate(1 / MEAN_LIFETIME_S))
        try:
            run_island(island, f"127.0.0.1:{port}", lid, log_fn=lambda s: None, timeouts=timeouts, join_key=key,
                       identity=identity)
            return  # the run finished
        except Crash:
            counts["crashes"] += 1
        except Exception as e:  # noqa: BLE001  (recorded: the soak reports what went wrong)
            if not stop.is_set():  # (after the run ended, an island that came back finds no syncer: not an error)
                counts["errors"].append(repr(e)[:200])
            return
        time.sleep(rng.uniform(*REJOIN_AFTER_S))
        if stop.is_set():
            return
        counts["rejoins"] += 1


def worker(port: int, key_path: str, ids: list[int], out: mp.Queue, stop) -> None:
    key = read_join_key(key_path)
    counts = {"crashes": 0, "rejoins": 0, "errors": []}
    threads = [threading.Thread(target=island_life, args=(port, key, lid, stop, counts), daemon=True)
               for lid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(counts)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--islands", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--quorum", type=int, default=32)
    ap.add_argument("--inner-steps", type=int, default=2)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="yeto-soak-"))
    out = tmp / "syncer"
    port = free_port()
    syncer = start_syncer(out, port, ["--no-island-keys", "--islands", str(a.islands), "--quorum", str(a.quorum),
                                      "--outer-steps", str(a.rounds), "--inner-steps", str(a.inner_steps),
                                      "--straggler-timeout", "1", "--island-timeout", "10", "--sync-bits", "4"],
                          tmp / "syncer.log")
    q: mp.Queue = mp.Queue()
    stop = mp.Event()  # set once the syncer exited: crashed islands do not come back
    ids = list(range(a.islands))
    procs = [mp.Process(target=worker, args=(port, str(out / "join.key"), ids[w::WORKERS], q, stop))
             for w in range(WORKERS)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    samples = []  # (seconds, rounds merged, RSS MB)
    merged = 0
    while syncer.poll() is None:
        time.sleep(SAMPLE_S)
        try:
            merged = sum(1 for e in read_tape(out) if e["event"] == "merge")
            samples.append((time.perf_counter() - t0, merged, rss_mb(syncer.pid)))
        except (OSError, ValueError, YetoError):  # (the tape does not exist yet)
            continue
        if samples and len(samples) % 15 == 0:
            print(f"soak: {merged}/{a.rounds} rounds, syncer RSS {samples[-1][2]:.0f} MB", flush=True)
    wall = time.perf_counter() - t0
    stop.set()
    counts = {"crashes": 0, "rejoins": 0, "errors": []}
    for _ in procs:  # (read before joining: a process with unread queue data does not exit)
        c = q.get(timeout=120)
        counts = {k: counts[k] + c[k] for k in counts}
    for p in procs:
        p.join(60)
    report = audit_run(out)
    tape = read_tape(out)
    samples = [s for s in samples if s[2] > 0]  # (the last one may be taken after the syncer exited)
    opened = next(e["time"] for e in tape if e["event"] == "round_open")
    last_merge = max(e["time"] for e in tape if e["event"] == "merge")
    joins = sum(1 for e in tape if e["event"] == "join")
    refused = sum(1 for e in tape if e["event"] in ("auth_refused", "refuse"))
    early = [s for s in samples if s[1] >= a.rounds // 10] or samples
    base, last, peak = early[0][2], samples[-1][2], max(s[2] for s in samples)
    print(f"\nsoak: {a.islands} islands ({WORKERS} processes), quorum {a.quorum}, {a.rounds} rounds of "
          f"{a.inner_steps} steps, adapter {4 * TENSOR[0] * TENSOR[1]:,} values, 4-bit wire, CURVE")
    print(f"  rounds merged      {merged} in {last_merge - opened:.0f} s from round 1: "
          f"{merged / (last_merge - opened):.2f} rounds/s (whole run with start-up and finish: {wall:.0f} s)")
    print(f"  island crashes    {counts['crashes']} (each rejoined: {counts['rejoins']}); joins on the tape {joins}; "
          f"errors {len(counts['errors'])} {counts['errors'][:2]}")
    print(f"  syncer RSS (MB)    at round {early[0][1]}: {base:.0f}; peak {peak:.0f}; at the end: {last:.0f}; "
          f"end / early = {last / base:.2f}x")
    every = max(1, len(samples) // 10)
    print("  RSS over time      " + "  ".join(f"{s[0]:.0f}s:{s[2]:.0f}MB" for s in samples[::every]))
    print(f"  refusals           {refused}; syncer exit {syncer.returncode}")
    print(f"  audit              {'ok' if report.ok else 'FAILED'}: {report.summary()}")
    print(f"  run directory      {tmp}")
    if not report.ok or syncer.returncode != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
