"""The Makefile: `make demo` installs no browser and asks for no sudo; `make test` adds the browser; both get one set of
Python packages (resolved in one pip call, so the demo runs on the versions the tests ran)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def installs(tmp_path, target: str, *variables: str) -> tuple[set[str], str]:
    """The yeto extras `make -n TARGET` would pip install into a venv that does not exist yet, and its commands."""
    r = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", *variables], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    extras = {e for group in re.findall(r'pip install -q -c constraints.txt -e "\.\[([^]]*)\]"', r.stdout)
              for e in group.split(",")}  # (held at the versions in constraints.txt)
    return extras, r.stdout


# every extra pyproject.toml declares: one left out of the Makefile's set would never be installed where tests run
EVERY_EXTRA = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_make_demo_installs_no_browser_and_asks_no_sudo(tmp_path):
    extras, commands = installs(tmp_path, "demo")
    assert extras == EVERY_EXTRA, extras
    assert "chromium" not in commands and "apt-get" not in commands  # (no sudo on a laptop for the default demo)
    extras, commands = installs(tmp_path, "demo", "MLX_ISLANDS=1")
    assert "libopenblas0-pthread" in commands and "chromium" not in commands


def test_make_test_installs_the_browser_and_the_demos_packages_in_one_pip_call(tmp_path):
    extras, commands = installs(tmp_path, "test")
    assert extras == EVERY_EXTRA, extras
    assert len(re.findall(r'pip install -q .*-e "', commands)) == 1, commands
    assert "chromium chromium-driver" in commands and "libopenblas0-pthread" in commands
