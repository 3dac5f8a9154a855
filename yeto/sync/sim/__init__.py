from yeto.sync.sim.nodes import *  # noqa: F401,F403
from yeto.sync.sim.nodes import main, run_seed  # noqa: F401
