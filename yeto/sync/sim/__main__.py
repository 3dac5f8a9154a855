"""`python -m yeto.sync.sim --seeds N`: see yeto.sync.sim.runner.main."""

import sys

from yeto.sync.sim.runner import main

sys.exit(main())
