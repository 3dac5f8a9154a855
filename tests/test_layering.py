"""The architecture the folder tree shows, kept: no import circle, no core module importing an I/O shell, no library
module importing the CLI (scripts/import_graph.py reads the imports from the code)."""

import subprocess
import sys

from tests.conftest import REPO


def test_the_import_graph_keeps_the_layers():
    r = subprocess.run([sys.executable, "scripts/import_graph.py", "--check"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr + r.stdout


def test_the_check_can_fail():
    """A planted core -> shell import and a planted circle are both named."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    edges = import_graph.graph()
    edges["yeto.sync.core.syncer"] = edges["yeto.sync.core.syncer"] | {"yeto.sync.server"}
    edges["yeto.sync.layout"] = edges["yeto.sync.layout"] | {"yeto.sync.core.syncer"}
    found = import_graph.problems(edges)
    assert "core module yeto.sync.core.syncer imports the shell yeto.sync.server" in found
    assert any(p.startswith("import circle:") and "yeto.sync.layout" in p for p in found)
