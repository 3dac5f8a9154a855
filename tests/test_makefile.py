"""The Makefile installs what each target runs: `make demo` no browser and no test tools, `make test` all of them."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def installs(tmp_path, target: str, *variables: str) -> tuple[set[str], str]:
    """The yeto extras `make -n TARGET` would pip install into a venv that does not exist yet, and its commands."""
    r = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", *variables], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    extras = {e for group in re.findall(r'pip install -q -e "\.\[([^]]*)\]"', r.stdout) for e in group.split(",")}
    return extras, r.stdout


def test_make_demo_installs_no_browser_and_no_test_tools(tmp_path):
    extras, commands = installs(tmp_path, "demo")
    assert {"torch", "watch"} <= extras and not extras & {"dev", "launch", "track"}, extras
    assert "chromium" not in commands and "apt-get" not in commands  # (no sudo on a laptop for the default demo)
    extras, commands = installs(tmp_path, "demo", "REPORT_TO=tensorboard", "MLX_ISLANDS=1")
    assert "track" in extras and "libopenblas0-pthread" in commands and "chromium" not in commands


def test_make_test_installs_the_browser_and_every_extra(tmp_path):
    extras, commands = installs(tmp_path, "test")
    assert {"torch", "dev", "mlx", "launch", "watch", "track"} <= extras, extras
    assert "chromium chromium-driver" in commands and "libopenblas0-pthread" in commands
