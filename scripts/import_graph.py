"""yeto's import graph, from the code: prints it by layer and fails on what the architecture forbids.

    python scripts/import_graph.py            # the layers and their edges
    python scripts/import_graph.py --folders  # the folders and their imports, as the mermaid graph in docs/design.md
    python scripts/import_graph.py --check    # exit 1 on an import circle, an upward import (a module importing a
                                              # layer above its own, LAYERS), a core module importing a shell, a
                                              # library module importing the CLI, a backend importing another,
                                              # the backend-neutral island importing a backend, or the island
                                              # importing a tensor library

Imports are read with `ast` (module level and inside functions alike: a deferred import is still a dependency), so
nothing is imported to draw the graph. Written here because no maintained tool checks these project-specific layer
rules without a configuration language of its own (import-linter would need its own contract file and install).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "yeto"
# the pure coordination cores: state machines, the math and the wire format they use (no sockets, files, clocks)
CORE = ("yeto.sync.core", "yeto.sync.wire", "yeto.sync.merge")
# I/O shells around them
SHELLS = ("yeto.sync.shell", "yeto.sync.sim")
CLI = ("yeto.cli",)  # and every package's __main__ (an entry point: `python -m yeto.backends.torch`)
BACKENDS = ("yeto.backends.torch", "yeto.backends.mlx")  # peers: neither imports the other
ISLAND = ("yeto.island",)  # what every backend shares: imports no backend and no tensor library
TENSOR_LIBRARIES = ("torch", "mlx", "peft", "bitsandbytes")  # a backend's own: an MLX island never loads torch
# the layers from the bottom up: a module imports its own layer and those below, never one above (an entry point,
# `__main__`, may import anything: it runs the CLI). A module belongs to the longest prefix that names it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("yeto",)),  # YetoError and the install checks
    ("leaves", ("yeto.models", "yeto.report", "yeto.testbed", "yeto.eval")),  # models and adapters, trackers, the link
    # emulator, task evaluation (scoring; the generation is a backend's)
    ("wire", ("yeto.sync.wire",)),
    ("merge", ("yeto.sync.merge",)),
    ("core", ("yeto.sync.core",)),
    ("island core", ("yeto.sync.core.island",)),
    ("shell", ("yeto.sync.shell",)),
    ("island", ("yeto.island",)),
    ("sim", ("yeto.sync.sim",)),
    ("backend", BACKENDS),
    ("backends", ("yeto.backends",)),  # choosing one, and the parity check over both
    ("launch", ("yeto.launch",)),
    ("watch", ("yeto.watch",)),
    ("cli", CLI),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, name: str) -> set[str]:
    """The yeto modules `path` imports (resolved to modules, not names inside them)."""
    return {m for m in all_imports(path, name) if m == PACKAGE or m.startswith(PACKAGE + ".")}


def all_imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, yeto's and others' (`import torch.nn` is torch.nn; relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def tensor_imports() -> dict[str, set[str]]:
    """The tensor libraries (TENSOR_LIBRARIES) each yeto module imports, by top-level name."""
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        name = module_name(path)
        found[name] = {m.split(".")[0] for m in all_imports(path, name)} & set(TENSOR_LIBRARIES)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in sorted(files.items()):
        edges[name] = {m for m in imports_of(path, name) if m in files and m != name and m != PACKAGE}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def in_layer(module: str, layer: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in layer)


def is_cli(module: str) -> bool:
    return in_layer(module, CLI) or module.rpartition(".")[2] == "__main__"


def backend_of(module: str) -> str | None:
    return next((b for b in BACKENDS if in_layer(module, (b,))), None)


def rank_of(module: str) -> tuple[int, str]:
    """The module's layer (its index in LAYERS, and its name): the one whose longest prefix names the module."""
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if in_layer(module, (p,))),
               default=(0, 0))
    return best[1], LAYERS[best[1]][0]


def problems(edges: dict[str, set[str]], libraries: dict[str, set[str]] | None = None) -> list[str]:
    """What the architecture forbids in `edges` (yeto's imports) and `libraries` (tensor libraries imported; default:
    read from the code)."""
    found = [f"import circle: {' -> '.join(c)}" for c in cycles(edges)]
    for src, libs in sorted((tensor_imports() if libraries is None else libraries).items()):
        if in_layer(src, ISLAND) and libs:
            found.append(f"backend-neutral module {src} imports a tensor library ({', '.join(sorted(libs))})")
    for src, dsts in sorted(edges.items()):
        for dst in sorted(dsts):
            if not src.endswith("__main__") and rank_of(dst)[0] > rank_of(src)[0]:
                found.append(f"upward import: {src} ({rank_of(src)[1]}) imports {dst} ({rank_of(dst)[1]})")
            if in_layer(src, CORE) and in_layer(dst, SHELLS):
                found.append(f"core module {src} imports the shell {dst}")
            if is_cli(dst) and not is_cli(src):
                found.append(f"library module {src} imports the CLI ({dst})")
            if backend_of(src) and backend_of(dst) and backend_of(src) != backend_of(dst) and not is_cli(src):
                found.append(f"backend module {src} imports another backend ({dst})")
            if in_layer(src, ISLAND) and backend_of(dst):
                found.append(f"backend-neutral module {src} imports a backend ({dst})")
    return found


def layer_of(module: str) -> str:
    return f"{rank_of(module)[0]:02d} {rank_of(module)[1]}"


def folder_of(module: str) -> str:
    """The package folder a module lives in (a package's own __init__ is its folder)."""
    path = ROOT / Path(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def folder_graph(edges: dict[str, set[str]]) -> str:
    """The import graph between folders, as a mermaid flowchart (docs/design.md holds this text, checked by a test)."""
    links: set[tuple[str, str]] = set()
    for src, dsts in edges.items():
        if src.rpartition(".")[2] == "__main__":
            continue  # an entry point: `python -m` runs the CLI it imports
        links.update((folder_of(src), folder_of(d)) for d in dsts if folder_of(d) != folder_of(src))
    folders = sorted({f for link in links for f in link})
    node = {f: f.replace(".", "_") for f in folders}
    lines = ["flowchart TD"]
    lines += [f"  {node[f]}[\"{f.removeprefix('yeto.') or f}/\"]" for f in folders]
    lines += [f"  {node[a]} --> {node[b]}" for a, b in sorted(links)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 on a forbidden import")
    ap.add_argument("--folders", action="store_true", help="print the folder graph (mermaid)")
    args = ap.parse_args(argv)
    edges = graph()
    if args.folders:
        print(folder_graph(edges))
        return 0
    found = problems(edges)
    if args.check:
        for p in found:
            print(f"error: {p}", file=sys.stderr)
        print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports: "
              f"{'OK' if not found else f'{len(found)} problem(s)'}")
        return 1 if found else 0
    by_layer: dict[str, list[str]] = defaultdict(list)
    for m in edges:
        by_layer[layer_of(m)].append(m)
    for layer in sorted(by_layer):
        print(f"[{layer}]")
        for m in sorted(by_layer[layer]):
            deps = sorted(d for d in edges[m] if layer_of(d) != layer)
            print(f"  {m}" + (f" -> {', '.join(deps)}" if deps else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
