"""A learner's side of the round protocol, as a deterministic state machine (`LearnerCore`), and what it is made of.

`core` (the core: the link, training events, the held round's release), `messages` (what each syncer message means
to a learner, and catching up), `pipeline` (the deltas in the syncer's hands, pipelined ones included), `phases` (the
learner's phases, the one table of their moves, each phase's data), `loop` (what the core and the training loop say
to each other), `work` (the training loops' arithmetic between rounds: steps, carries, where a round starts; how
many steps a round asks is the round policy's, `yeto.sync.core.policy`), `timing` (how a learner times its link),
`pushed` (what a pushed delta is, until it settles).
"""

from yeto.sync.core.learner.core import LearnerCore
from yeto.sync.core.learner.loop import Done, RoundCounts, StepVerdict, Task, Train, Wait
from yeto.sync.core.learner.phases import TRANSITIONS, Held, IllegalTransition, Phase, Place, Training
from yeto.sync.core.learner.pushed import Pushed
from yeto.sync.core.learner.timing import FINISH_CATCHUP_DEAD_AFTERS, HELLO_RETRY_HEARTBEATS, LinkTimeouts
from yeto.sync.core.rounds import WINDOW_NEAREST_BOUNDARY

__all__ = ["FINISH_CATCHUP_DEAD_AFTERS", "HELLO_RETRY_HEARTBEATS", "TRANSITIONS", "WINDOW_NEAREST_BOUNDARY", "Done",
           "Held", "IllegalTransition", "LearnerCore", "LinkTimeouts", "Phase", "Place", "Pushed", "RoundCounts",
           "StepVerdict", "Task", "Train", "Training", "Wait"]
