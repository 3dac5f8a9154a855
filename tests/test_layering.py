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
    """Each planted bad import (core -> shell, backend -> backend, island -> backend, island -> a tensor library, a
    circle, a layer importing one above it) is named."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    edges = import_graph.graph()
    edges["yeto.sync.core.syncer"] = edges["yeto.sync.core.syncer"] | {"yeto.sync.shell.server"}
    edges["yeto.sync.wire.layout"] = edges["yeto.sync.wire.layout"] | {"yeto.sync.core.syncer"}
    edges["yeto.backends.mlx.island"] = edges["yeto.backends.mlx.island"] | {"yeto.backends.torch.island"}
    edges["yeto.island.training"] = edges["yeto.island.training"] | {"yeto.backends.torch.island"}
    edges["yeto.models.adapter"] = edges["yeto.models.adapter"] | {"yeto.sync.core.contract"}
    edges["yeto.sync.core.rounds"] = edges["yeto.sync.core.rounds"] | {"yeto.sync.core.island.timing"}
    libraries = import_graph.tensor_imports()
    libraries["yeto.island.data"] = libraries["yeto.island.data"] | {"torch"}
    found = import_graph.problems(edges, libraries)
    assert "backend-neutral module yeto.island.data imports a tensor library (torch)" in found
    assert "backend module yeto.backends.mlx.island imports another backend (yeto.backends.torch.island)" in found
    assert "backend-neutral module yeto.island.training imports a backend (yeto.backends.torch.island)" in found
    assert "core module yeto.sync.core.syncer imports the shell yeto.sync.shell.server" in found
    assert any(p.startswith("import circle:") and "yeto.sync.wire.layout" in p for p in found)
    assert "upward import: yeto.models.adapter (leaves) imports yeto.sync.core.contract (core)" in found
    assert "upward import: yeto.sync.core.rounds (core) imports yeto.sync.core.island.timing (island core)" in found
    assert not any("yeto.__main__" in p or "yeto.launch.__main__" in p for p in found)  # entry points import anything


def _design_modules_section() -> str:
    text = (REPO / "docs" / "design.md").read_text()
    return text[text.index("## Modules"):text.index("\n## ", text.index("## Modules") + 1)]


def test_the_design_doc_draws_the_folder_graph_the_code_has():
    """docs/design.md's picture is scripts/import_graph.py --folders' output, so it cannot drift from the code."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    section = _design_modules_section()
    drawn = section[section.index("```mermaid\n") + len("```mermaid\n"):]
    drawn = drawn[:drawn.index("```")].strip()
    assert drawn == import_graph.folder_graph(import_graph.graph()), "rerun scripts/import_graph.py --folders"


def test_the_design_doc_maps_every_module():
    """Every module of yeto/ has a row in docs/design.md's module map, and every row names a module that exists."""
    import re

    section = _design_modules_section()
    named = set(re.findall(r"`(yeto(?:\.\w+)+)`", section))
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "yeto").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    packages = {".".join(p.relative_to(REPO).parent.parts) for p in (REPO / "yeto").rglob("__init__.py")}
    assert modules - named == set(), "modules missing from docs/design.md's map"
    assert named - modules - packages == set(), "docs/design.md names modules that do not exist"


LONG_MODULE_LINES = 500  # a module past this says at its top why it is one module ("Why one module: ...")


def test_a_long_module_says_why_it_is_one():
    import ast

    long = {}
    for path in (REPO / "yeto").rglob("*.py"):
        text = path.read_text()
        lines = text.count("\n")
        if lines > LONG_MODULE_LINES and "Why one module:" not in (ast.get_docstring(ast.parse(text)) or ""):
            long[str(path.relative_to(REPO))] = lines
    assert not long, f"split these, or say at their top why each is one module ('Why one module: ...'): {long}"


class _Names:
    """Stands in for a core: each attribute is its own name, so a handler table reads as type -> method name."""

    def __getattr__(self, name: str) -> str:
        return name


def test_every_message_and_tape_event_goes_to_the_handler_its_table_names():
    """The syncer, the island's message handlers and the tape fold dispatch through one table each (no handler looked
    up by a built name): every message type of its direction has an entry, and no `_on_` method is left outside the
    table."""
    from yeto.sync.core.fold import TapeFold
    from yeto.sync.core.island.messages import SyncerMessages
    from yeto.sync.core.syncer import SyncerCore
    from yeto.sync.wire.protocol import ISLAND_TYPES, SYNCER_TYPES

    from yeto.sync.core.config import SyncerConfig

    core = SyncerCore(SyncerConfig(islands=1), "inc")
    table = core._handlers()
    assert set(table) == ISLAND_TYPES
    owners = {id(core), *(id(getattr(core, c)) for c in ("admission", "deltas", "merging", "driver", "recovery"))}
    assert all(id(h.__self__) in owners for h in table.values()), "a syncer handler outside the core's concerns"
    handlers = {(type(h.__self__).__name__, h.__name__) for h in table.values()}
    for owner in [core, core.admission, core.deltas, core.merging, core.driver, core.recovery]:
        for name in [n for n in dir(type(owner)) if n.startswith(("_on_", "on_")) and n != "_on_unexpected"]:
            kind = name.removeprefix("_").removeprefix("on_")  # a concern's handler: the table's, or the core's
            # entry for its type calls it (then the round may open or close)
            assert (type(owner).__name__, name) in handlers or table[kind].__self__ is core, (owner, name)
    for cls, types, fallback in [(SyncerMessages, SYNCER_TYPES, {"_on_other"}), (TapeFold, None, set())]:
        table = cls._handlers(_Names())
        assert types is None or set(table) == types, cls
        assert all(callable(getattr(cls, name)) for name in table.values()), cls
        assert {n for n in dir(cls) if n.startswith("_on_")} == set(table.values()) | fallback, cls
        assert table == {kind: f"_on_{kind}" for kind in table}, cls


def test_module_names_say_one_thing():
    """No two modules share a file name, except a backend's peers (the same concept on two engines), and the root of
    yeto/ holds only its __init__ and __main__."""
    from collections import defaultdict

    by_name = defaultdict(set)
    for path in (REPO / "yeto").rglob("*.py"):
        rel = path.relative_to(REPO / "yeto")
        if path.name in ("__init__.py", "__main__.py"):
            continue
        peer = rel.parts[0] == "backends" and len(rel.parts) == 3  # backends/<engine>/<module>.py
        by_name[path.name].add("backends/*" if peer else str(rel.parent))
    assert {n: f for n, f in by_name.items() if len(f) > 1} == {}
    assert sorted(p.name for p in (REPO / "yeto").glob("*.py")) == ["__init__.py", "__main__.py"]


def test_no_two_types_share_a_name():
    """A type's name says one thing: no two classes of yeto/ (enums, dataclasses, protocols) are called the same."""
    import ast
    from collections import defaultdict

    where = defaultdict(list)
    for path in (REPO / "yeto").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(REPO)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


def _modules_computing_with(attr: str) -> set[str]:
    """The modules of yeto/ that compute with a config's or a policy's `attr` (arithmetic, min/max, a conditional
    value: not a copy into a message, not a range check): `cfg.X`, `config.X`, `policy.X`, or `self.X` inside a
    class whose name ends in Config or Policy."""
    import ast

    found = set()
    for path in (REPO / "yeto").rglob("*.py"):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr == attr):
                continue
            base = ast.unparse(node.value).split(".")[-1]
            owner = parents.get(node)
            while owner is not None and not isinstance(owner, ast.ClassDef):
                owner = parents.get(owner)
            in_own_class = base == "self" and owner is not None and owner.name.endswith(("Config", "Policy"))
            if base not in ("cfg", "config", "policy") and not in_own_class:
                continue
            use = parents[node]
            if isinstance(use, (ast.BinOp, ast.IfExp, ast.BoolOp)) or (
                    isinstance(use, ast.Call) and ast.unparse(use.func) in ("min", "max")):
                found.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_inner_steps_walks_from_the_flag_to_one_owner():
    """`--inner-steps` followed from the command line to its use: `yeto syncer`'s option (its default the config's,
    the config's the round policy's) -> `SyncerConfig` -> the welcome's policy -> the island's `RoundPolicy` ->
    `steps_for`, the one answer to how many steps a round asks of an island (the island's round start, its pipelined
    rounds, the training loop's limits and the syncer's check of a delta's claim all ask it); no other module computes
    with the flag's value."""
    import typer
    import typer.main

    from yeto.cli.syncer_command import syncer_command
    from yeto.sync.core.config import SyncerConfig
    from yeto.sync.core.policy import RoundPolicy

    app = typer.Typer()
    app.command()(syncer_command)
    command = typer.main.get_command(app)  # `yeto syncer`, as the CLI registers it
    option = next(p for p in command.params if p.name == "inner_steps")
    assert option.default == SyncerConfig().inner_steps == RoundPolicy().inner_steps
    with command.make_context("syncer", ["--inner-steps", "7", "--out", "unused"]) as ctx:
        cfg = SyncerConfig(**{k: v for k, v in ctx.params.items() if k in SyncerConfig.__dataclass_fields__})
    read_back = RoundPolicy.from_wire(cfg.policy())  # what the island reads from the welcome
    assert read_back == cfg.round_policy() and read_back.inner_steps == 7
    assert [read_back.steps_for(cap) for cap in (0, 3, 9)] == [7, 3, 7]
    assert _modules_computing_with("inner_steps") == {"yeto.sync.core.policy"}
