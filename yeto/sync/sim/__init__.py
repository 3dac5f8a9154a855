"""Deterministic simulation of a whole run: the real coordination cores under seeded faults.

One seed is one schedule: a fleet (islands, quorum, round policy, wire bits)
and a list of faults drawn from the seed: messages lost with their connection,
duplicated and delayed (so the control and bulk connections reorder), links cut
for seconds, islands killed and restarted (some for good), the syncer killed
at any point (also in the middle of an action list) and restarted from its
simulated disk (where only fsynced writes survive), nodes frozen (a laptop
asleep: their clock jumps), and slow inner steps. Nothing else varies: no
threads, no wall clock, no sockets, so a failing seed reproduces exactly.

The syncer is `SyncerCore`, every island is a `IslandCore` driven by a
simulated training loop over a fake island whose steps add known vectors.
The package reads as: `schedule` (the seeded faults), `world` (clock, network,
disk), `nodes` (the syncer and islands around the real cores), `sleep` (a frozen node), `oracle` (the
invariants), `runner` (one seed, or a sweep).
After every schedule, and along the way:
- the tape passes `yeto.sync.shell.audit.audit`;
- every delta was computed against the exact global adapter of its base version;
- a durable version is never redefined;
- the run finishes (every merge) once faults stop: nobody waits forever;
- every island that finished holds the syncer's final global adapter, bit for bit;
- replaying the merges on the tape from the captured payloads gives that adapter.

    python -m yeto.sync.sim --seeds 1000 [--workers 2]   # from a fresh random seed, printed
    python -m yeto.sync.sim --seeds 1000 --first 0      # a given range
    python -m yeto.sync.sim --seed 17 --trace      # one schedule, every event
"""

from yeto.sync.sim.oracle import Oracle, Violation
from yeto.sync.sim.runner import EXERCISED, Outcome, fresh_first_seed, main, run_seed
from yeto.sync.sim.faults import Hostile, Schedule
from yeto.sync.sim.world import World

__all__ = ["EXERCISED", "Hostile", "Oracle", "Outcome", "Schedule", "Violation", "World", "fresh_first_seed", "main",
           "run_seed"]
