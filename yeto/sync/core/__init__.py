"""The coordination core: pure, deterministic state machines, no sockets, clocks or disks.

`syncer.SyncerCore` (rounds, membership, quorum, merges, recovery) and
`island.IslandCore` (an island's side of the round protocol: its own package) take events in
(a message received, a timer tick, a training step done) with the time and any
randomness injected, and return actions (send, record on the tape, save). The
I/O shells (`yeto.sync.shell.server`, `yeto.sync.shell.client`) execute those actions for
real; the simulator (`yeto.sync.sim`) executes them against a simulated network
and disk, through thousands of seeded fault schedules.

The syncer's core is composed of one object per concern: `admission`, `deltas`,
`merging`, `recovery` and `driver` (the open round), each handed the run's state
(`state`) and the outbox; `rounds` holds the pure rules of when a round closes, and
`syncer` owns them all and dispatches each event through one table.
"""
