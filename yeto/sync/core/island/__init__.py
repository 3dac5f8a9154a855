"""An island's side of the round protocol, as a deterministic state machine (`IslandCore`), and what it is made of.

`core` (the core: the link, training events, the held round's release), `messages` (what each syncer message means
to an island, and catching up), `pipeline` (the deltas in the syncer's hands, pipelined ones included), `phases` (the
island's phases, the one table of their moves, each phase's data), `loop` (what the core and the training loop say
to each other), `work` (the training loops' arithmetic between rounds: steps, carries, where a round starts; how
many steps a round asks is the round policy's, `yeto.sync.core.policy`), `timing` (how an island times its link),
`pushed` (what a pushed delta is, until it settles).
"""

from yeto.sync.core.island.core import IslandCore
from yeto.sync.core.island.loop import Done, RoundCounts, StepVerdict, Task, Train, Wait
from yeto.sync.core.island.phases import TRANSITIONS, Held, IllegalTransition, Phase, Place, Training
from yeto.sync.core.island.pushed import Pushed
from yeto.sync.core.island.timing import FINISH_CATCHUP_DEAD_AFTERS, HELLO_RETRY_HEARTBEATS, LinkTimeouts
from yeto.sync.core.rounds import WINDOW_NEAREST_BOUNDARY

__all__ = ["FINISH_CATCHUP_DEAD_AFTERS", "HELLO_RETRY_HEARTBEATS", "TRANSITIONS", "WINDOW_NEAREST_BOUNDARY", "Done",
           "Held", "IllegalTransition", "IslandCore", "LinkTimeouts", "Phase", "Place", "Pushed", "RoundCounts",
           "StepVerdict", "Task", "Train", "Training", "Wait"]
