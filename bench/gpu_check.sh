#!/usr/bin/env bash
# Run bench/gpu_check.py on a GPU machine that has torch, transformers, peft and accelerate and no network.
#
#   here:          make gpu-wheels         (peft as tested here, into build/wheels; carry build/wheels)
#   GPU machine:   bench/gpu_check.sh [--out runs/gpu-check] [any gpu_check.py flag]
#
# The wheels in build/wheels install into build/gpu-site, ahead of the machine's own packages for this run only,
# without their dependencies: torch and the rest stay the machine's. Without build/wheels the machine's versions run.
# Nothing is downloaded and nothing is installed outside build/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
SITE=""
if compgen -G "build/wheels/*.whl" >/dev/null; then
    rm -rf build/gpu-site
    "$PYTHON" -m pip install -q --no-index --no-deps --target build/gpu-site build/wheels/*.whl
    SITE="$PWD/build/gpu-site:"
fi
export PYTHONPATH="$SITE$PWD${PYTHONPATH:+:$PYTHONPATH}"
# yeto's ranges (pyproject.toml): one line naming what is missing or too old, before any model is built
"$PYTHON" - <<'PY'
import importlib.metadata as md
import sys

need = {"torch": (2, 4), "transformers": (5, 0), "peft": (0, 17), "accelerate": (0, 0)}
found = {}
for name, low in need.items():
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(f"error: {name} is not installed here: carry it as a wheel (make gpu-wheels GPU_WHEELS='{name}==...')")
    if tuple(int(p) for p in found[name].split("+")[0].split(".")[:2]) < low:
        sys.exit(f"error: {name} {found[name]} is older than yeto needs ({'.'.join(map(str, low))}): carry a newer "
                 f"one as a wheel (make gpu-wheels GPU_WHEELS='{name}==...')")
print(", ".join(f"{k} {v}" for k, v in found.items()))
PY
exec "$PYTHON" bench/gpu_check.py "$@"
