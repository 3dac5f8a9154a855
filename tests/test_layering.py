"""The architecture the folder tree shows, kept: no import circle, no core module importing an I/O shell, no library
module importing the CLI, backends apart from each other and from the island they share (scripts/import_graph.py reads
the imports from the code)."""

import subprocess
import sys

from tests.conftest import REPO


def test_the_import_graph_keeps_the_layers():
    r = subprocess.run([sys.executable, "scripts/import_graph.py", "--check"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout


def test_the_check_can_fail():
    """Each planted bad import (core -> shell, backend -> backend, island -> backend, a circle) is named."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    edges = import_graph.graph()
    edges["yeto.sync.core.syncer"] = edges["yeto.sync.core.syncer"] | {"yeto.sync.shell.server"}
    edges["yeto.sync.wire.layout"] = edges["yeto.sync.wire.layout"] | {"yeto.sync.core.syncer"}
    edges["yeto.backends.mlx.learner"] = edges["yeto.backends.mlx.learner"] | {"yeto.backends.torch.learner"}
    edges["yeto.island.training"] = edges["yeto.island.training"] | {"yeto.backends.torch.learner"}
    found = import_graph.problems(edges)
    assert "backend module yeto.backends.mlx.learner imports another backend (yeto.backends.torch.learner)" in found
    assert "backend-neutral module yeto.island.training imports a backend (yeto.backends.torch.learner)" in found
    assert "core module yeto.sync.core.syncer imports the shell yeto.sync.shell.server" in found
    assert any(p.startswith("import circle:") and "yeto.sync.wire.layout" in p for p in found)
