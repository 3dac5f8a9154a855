"""Reserved slots: a machine of the user's own (a Mac, a box under the desk) joins the run with one script.

For slot I, `<out>/join/I.sh` installs yeto if it is missing and starts the learner; `<out>/join/I.key` is a key
that admits learner I only (revocable with `yeto keys revoke`). The two files travel together (scp); the key is
read from the file beside the script, never put on a command line.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yeto
from yeto.launch.plan import FleetPlan
from yeto.launch.tasks import learner_command
from yeto.sync.auth import Keyring, write_secret

JOIN_DIR = "join"


def join_script(plan: FleetPlan, learner: int, syncer: str) -> str:
    """The script's text. It picks the backend where it runs (MLX on an Apple-silicon Mac, torch elsewhere;
    YETO_BACKEND overrides), installs yeto only where it is not importable, and takes PYTHON and, for data that
    lives on the launching machine, YETO_DATA (the path of the joining machine's copy)."""
    version = yeto.__version__
    cmd = learner_command(plan, learner, syncer, "@DATA@", plan.model, "@BACKEND@", python="@PYTHON@")
    cmd += ["--out", f"runs/{plan.name}-island-{learner}"]
    placeholders = {"@PYTHON@": '"$PYTHON"', "@BACKEND@": '"$BACKEND"', "@DATA@": '"$DATA"'}
    line = " ".join(placeholders.get(a, shlex.quote(a)) for a in cmd)
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# joins run {plan.name} as learner {learner} of {plan.num_learners} (syncer {syncer})",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "$0")" && pwd)"',
        'PYTHON="${PYTHON:-python3}"',
        f"DATA={shlex.quote(plan.data)}",
        'DATA="${YETO_DATA:-$DATA}"',
        'case "$(uname -s)-$(uname -m)" in',
        f"  Darwin-arm64) BACKEND=\"${{YETO_BACKEND:-yeto.mlx.learner}}\"; PACKAGE='yeto[mlx]=={version}' ;;",
        f"  *) BACKEND=\"${{YETO_BACKEND:-yeto.learner}}\"; PACKAGE='yeto=={version}' ;;",
        "esac",
        '"$PYTHON" -c "import yeto" 2>/dev/null || "$PYTHON" -m pip install "$PACKAGE"',
        f'export YETO_JOIN_KEY="$(cat "${{YETO_JOIN_KEY_FILE:-$HERE/{learner}.key}}")"',
        f"exec {line}",
        "",
    ])


def write_join_files(plan: FleetPlan, keys: Keyring, syncer: str, out: Path) -> list[Path]:
    """Write join/I.sh and join/I.key for every reserved slot; returns the scripts."""
    scripts = []
    for lid in plan.external_ids:
        key = keys.keys_dir / "learners" / f"{lid}.key"
        if not key.exists():
            keys.add_learner(lid)
        write_secret(out / JOIN_DIR / f"{lid}.key", key.read_text())
        script = out / JOIN_DIR / f"{lid}.sh"
        script.write_text(join_script(plan, lid, syncer))
        script.chmod(0o755)
        scripts.append(script)
    return scripts


def join_instructions(plan: FleetPlan, scripts: list[Path]) -> str:
    lines = [f"{len(scripts)} reserved slot(s): on each machine that joins, copy the script and its key, then run it:"]
    for s in scripts:
        lines.append(f"  scp {shlex.quote(str(s))} {shlex.quote(str(s.with_suffix('.key')))} HOST:   &&   "
                     f"ssh HOST bash {shlex.quote(s.name)}")
    lines.append("  (each key admits its learner id only; `yeto keys revoke --out <run>/syncer --learner I` "
                 "withdraws it; the script installs yeto if missing; PYTHON=... picks the interpreter)")
    if Path(plan.data).expanduser().exists():
        lines.append(f"  the data {plan.data} is on this machine: copy it too and run with YETO_DATA=<its path>")
    return "\n".join(lines)
