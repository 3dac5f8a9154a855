"""Running schedules: one seed (`run_seed`, what tests call) or a sweep over many, spread over processes
(`main`, the command line of `python -m yeto.sync.sim`)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from yeto.sync.core.island.phases import TRANSITIONS
from yeto.sync.sim.oracle import Violation
from yeto.sync.sim.faults import PROGRESS_CHUNK, Schedule
from yeto.sync.sim.world import World


@dataclass
class Outcome:
    seed: int
    ok: bool
    error: str = ""
    sim_s: float = 0.0
    merges: int = 0
    restarts: int = 0
    exercised: frozenset[str] = frozenset()  # the fault paths this schedule took (see EXERCISED)
    moves: frozenset[tuple[str, str]] = frozenset()  # the island phase moves it took (from, to)


FRESH_SEEDS_FROM, FRESH_SEEDS_TO = 10**5, 10**9  # where a fresh sweep's first seed is drawn from

# tape events that mark a recovery path, counted per schedule so a sweep shows what it really exercised
EXERCISED = ("resume", "rollback", "discard", "recovered", "refuse_delta", "supersede", "tape_repair", "quorum_wait",
             "stop", "reject", "given_up", "given_up_cleared", "stale")


def run_seed(seed: int, trace: Optional[Callable[[str], None]] = None) -> Outcome:
    w = World(Schedule.draw(seed), trace)
    try:
        w.run()
    except Violation as e:
        return Outcome(seed, False, str(e), w.now)
    except Exception as e:  # a crash in a core is a finding too
        import traceback

        return Outcome(seed, False, f"crash: {e!r}\n{traceback.format_exc()}", w.now)
    tape = w.syncer.disk.tape
    paths = {e["event"] for e in tape if e["event"] in EXERCISED}
    paths |= {"recovered" for e in tape if e["event"] == "delta" and e.get("recovered")}
    paths |= {"stale" for e in tape if e["event"] == "delta" and e.get("lag")}
    paths |= {"zombie"} if w.zombies else set()
    paths |= {"carry"} if w.carries else set()
    paths |= {"carry_back"} if w.carries_back else set()
    paths |= {"streamed"} if any(e["event"] == "merge" and e.get("part") for e in tape) else set()
    paths |= {"slow_link"} if w.s.slow_links else set()
    paths |= {"pipelined"} if any(e["event"] == "delta" and "trained_from" in e for e in tape) else set()
    paths |= {"extra_merged"} if any(e["event"] == "merge" and "extra" in (e.get("tiers") or ()) for e in tape) \
        else set()
    paths |= {"zero_delta"} if any(e["event"] == "delta" and e.get("norm") == 0 for e in tape) else set()
    return Outcome(seed, True, "", w.now, sum(1 for e in tape if e["event"] == "merge"),
                   sum(1 for e in tape if e["event"] == "resume"), frozenset(paths), frozenset(w.oracle.moves_seen()))


def fresh_first_seed() -> int:
    """A first seed drawn from the OS's randomness, past the seeds 0..FRESH_SEEDS_FROM - 1 that CI and earlier sweeps
    ran: a sweep from it checks schedules no change was tuned against."""
    return random.SystemRandom().randrange(FRESH_SEEDS_FROM, FRESH_SEEDS_TO)


def _run_range(args: tuple[int, int]) -> list[Outcome]:
    return [run_seed(s) for s in range(*args)]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Deterministic simulation of yeto's coordination under faults.")
    p.add_argument("--seeds", type=int, default=200, help="how many schedules to run")
    p.add_argument("--first", type=int, default=None,
                   help="the first seed (default: a fresh random one, printed, so a sweep sees schedules no earlier "
                        "sweep checked)")
    p.add_argument("--seed", type=int, help="run this one seed")
    p.add_argument("--trace", action="store_true", help="with --seed: print every event")
    p.add_argument("--workers", type=int, default=1, help="processes to spread the seeds over")
    a = p.parse_args(argv)
    if a.seed is not None:
        out = run_seed(a.seed, print if a.trace else None)
        print(json.dumps(Schedule.draw(a.seed).__dict__, default=str))
        print("ok" if out.ok else f"VIOLATION seed {out.seed}: {out.error}")
        return 0 if out.ok else 1
    if a.first is None:
        a.first = fresh_first_seed()
    sys.stderr.write(f"sim: seeds {a.first}..{a.first + a.seeds - 1} (again: --first {a.first} --seeds {a.seeds})\n")
    t0 = time.perf_counter()
    end = a.first + a.seeds
    ranges = [(s, min(s + PROGRESS_CHUNK, end)) for s in range(a.first, end, PROGRESS_CHUNK)]
    outcomes: list[Outcome] = []
    if a.workers > 1:
        from multiprocessing import Pool

        with Pool(a.workers) as pool:
            for res in pool.imap_unordered(_run_range, ranges):
                outcomes.extend(res)
                _progress(outcomes, res, a.seeds, t0)
    else:
        for r in ranges:
            res = _run_range(r)
            outcomes.extend(res)
            _progress(outcomes, res, a.seeds, t0)
    bad = sorted((o for o in outcomes if not o.ok), key=lambda o: o.seed)
    merges = sum(o.merges for o in outcomes)
    restarts = sum(o.restarts for o in outcomes)
    print(f"\n{len(outcomes)} schedules (seeds {a.first}..{a.first + a.seeds - 1}) in {time.perf_counter() - t0:.0f}s: "
          f"{len(bad)} violation(s); {merges} merges, {restarts} syncer restarts simulated")
    took = Counter(p for o in outcomes for p in o.exercised)
    paths = (*EXERCISED, "zombie", "carry", "carry_back", "streamed", "slow_link", "pipelined", "extra_merged",
             "zero_delta")
    print("schedules that took each recovery path: " + ", ".join(f"{p} {took[p]}" for p in paths))
    moved = Counter(m for o in outcomes for m in o.moves)
    table = [(old.value, new.value) for old, news in TRANSITIONS.items() for new in sorted(news, key=lambda p: p.value)]
    print("schedules that took each island phase move: " + ", ".join(f"{o}->{n} {moved[(o, n)]}" for o, n in table))
    for o in bad[:20]:
        print(f"seed {o.seed}: {o.error.splitlines()[0] if o.error else ''}")
    if bad:
        print(f"reproduce: python -m yeto.sync.sim --seed {bad[0].seed} --trace")
    return 1 if bad else 0


def _progress(outcomes: list[Outcome], latest: list[Outcome], total: int, t0: float) -> None:
    """A line per ~5% of the sweep, and each violation as soon as it is found (a long sweep's first finding need not
    wait for its end)."""
    for o in latest:
        if not o.ok:
            sys.stderr.write(f"\nsim: VIOLATION seed {o.seed}: {o.error.splitlines()[0] if o.error else ''}\n")
    done, bad = len(outcomes), sum(not o.ok for o in outcomes)
    line = f"sim: {done}/{total} schedules, {bad} violation(s), {time.perf_counter() - t0:.0f}s"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line)
    elif done == total or done % max(1, total // 20) < PROGRESS_CHUNK:  # a line per ~5% in logs
        sys.stderr.write(line + "\n")
    sys.stderr.flush()

