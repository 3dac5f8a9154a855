"""The join script a reserved slot's machine runs (yeto.launch.join), run for real by bash with a fake `python3` on
PATH: it reports the version a test asks for and logs every call, so the script's checks and its virtualenv and
install steps are seen without a network or a second Python."""

from __future__ import annotations

import subprocess

import pytest

import yeto
from yeto.launch.join import JOIN_VENV, MIN_PYTHON, join_script
from yeto.launch.plan import FleetPlan
from yeto.launch.spec import parse_gpu

TIMEOUT_S = 60
FAKE_PYTHON = """#!/bin/bash
# a python3 of version $FAKE_VERSION without yeto: logs each call, makes a fake virtualenv
echo "python3 $*" >> "$FAKE_LOG"
case "$1" in
  -c) case "$2" in *version_info*) echo "$FAKE_VERSION" ;; *) exit 1 ;; esac ;;
  -m) if [ "$2" = venv ]; then
        if [ -n "${FAKE_NO_VENV:-}" ]; then echo "ensurepip is not available" >&2; echo "apt install" >&2; exit 1; fi
        mkdir -p "$3/bin" && cp "$FAKE_VENV_PYTHON" "$3/bin/python"
      else
        echo "pip: externally-managed-environment" >&2; exit 1
      fi ;;
esac
"""
FAKE_VENV_PYTHON = """#!/bin/bash
# the virtualenv's python: yeto not installed yet; pip and yeto itself only log
echo "venv-python $*" >> "$FAKE_LOG"
case "$1" in -c) exit 1 ;; esac
"""


@pytest.fixture
def joining(tmp_path):
    """A join folder (script, key, the checkout's wheel) and a machine whose python3 is the fake; returns a function
    that runs the script with a Python version and returns (the completed run, the calls logged)."""
    folder = tmp_path / "join"
    folder.mkdir()
    plan = FleetPlan("wan", str(tmp_path / "x"), parse_gpu("aws:1xA10G"), external=1, data="HuggingFaceH4/no_robots")
    script = folder / "1.sh"
    script.write_text(join_script(plan, 1, "203.0.113.7:29400"))
    (folder / "1.key").write_text("key\n")
    wheel = folder / f"yeto-{yeto.__version__}-py3-none-any.whl"
    wheel.write_bytes(b"")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("venv-python", FAKE_VENV_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"

    def run(version: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        log.write_text("")
        base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "FAKE_LOG": str(log),
                "FAKE_VERSION": version, "FAKE_VENV_PYTHON": str(bin_dir / "venv-python"), "YETO_BACKEND": "mlx"}
        r = subprocess.run(["bash", "1.sh"], cwd=folder, env={**base, **env}, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        return r, log.read_text().splitlines()

    run.wheel = wheel  # type: ignore[attr-defined]
    run.home = tmp_path / "home"  # type: ignore[attr-defined]
    return run


def test_an_old_python_is_one_line_saying_how_to_get_a_new_one(joining):
    """Stock macOS has Python 3.9: the script stops before it installs anything, naming the version and the way out."""
    r, calls = joining("3 9")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: python3 is Python 3.9: yeto needs Python 3.11 or newer")
    assert "brew install python@3.12" in lines[0] and "PYTHON=python3.12 bash 1.sh" in lines[0]
    assert all("venv" not in c and "pip" not in c for c in calls), calls
    assert MIN_PYTHON == (3, 11)  # (pyproject's requires-python)


def test_a_missing_python_is_one_line(joining):
    r, calls = joining("3 12", PYTHON="python3.12")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: no python3.12 here: yeto needs Python 3.11 or newer (brew install python@3.12, the installer from "
        "python.org, or uv python install 3.12), then run PYTHON=python3.12 bash 1.sh"], r.stderr
    assert calls == []


def test_yeto_goes_into_a_virtualenv_of_its_own_never_the_system_python(joining):
    """An externally managed python3 (Debian's, Homebrew's) refuses `pip install`: the script makes its own
    virtualenv, installs the launching checkout's wheel with the mlx extra there, and runs the island from it."""
    r, calls = joining("3 12")
    assert r.returncode == 0, r.stderr
    venv = str(joining.home / JOIN_VENV.removeprefix("$HOME/"))
    assert f"python3 -m venv {venv}" in calls
    assert not [c for c in calls if c.startswith("python3 -m pip")]  # the system's Python installs nothing
    installs = [c for c in calls if c.startswith("venv-python -m pip install")]
    assert installs[0] == f"venv-python -m pip install {joining.wheel}[mlx]", calls
    train = calls[-1]
    assert train.startswith("venv-python -m yeto train --backend mlx --syncer 203.0.113.7:29400 --island-id 1")
    again, calls = joining("3 12")  # the next join finds the virtualenv (its yeto still missing here: installs)
    assert again.returncode == 0 and not [c for c in calls if "-m venv" in c], calls


def test_yeto_venv_names_the_virtualenv_and_a_python_without_venv_is_one_line(joining, tmp_path):
    r, calls = joining("3 11", YETO_VENV=str(tmp_path / "mine"), YETO_BACKEND="torch")
    assert r.returncode == 0 and (tmp_path / "mine" / "bin" / "python").exists(), r.stderr
    assert f"venv-python -m pip install {joining.wheel}[torch]" in calls
    r, calls = joining("3 11", YETO_VENV=str(tmp_path / "other"), FAKE_NO_VENV="1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "cannot make a virtualenv" in lines[0], r.stderr
    assert "apt install python3-venv" in lines[0] and not [c for c in calls if "pip" in c]

