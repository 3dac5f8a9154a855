import sys

from yeto.sync.sim.nodes import main

sys.exit(main())
