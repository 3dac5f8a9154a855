"""`yeto dashboard` in a real browser: headless Chromium (Debian's chromium and chromium-driver, driven by selenium)
opens the page of a live 2-island local fleet and sees the island rows, the round count advance and the loss chart
drawn, no task chart until the islands' metrics hold task evaluations (task_eval lines, as --eval-task writes them),
then that chart with each island's accuracy and interval; then the finished run's export opens from file:// with the
network off and draws the same charts.

YETO_SCREENSHOT=docs/dashboard.png saves the finished run's page there (docs/watching.md shows it).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DEMO_DATA, REPO
from yeto.launch.local import free_port

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()), reason="Debian's chromium "
                                "and chromium-driver are not installed (make setup-test installs them)")
selenium = pytest.importorskip("selenium", reason="selenium is not installed (the dev extra)")
pytest.importorskip("plotly", reason="plotly is not installed (the watch extra)")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", COLUMNS="200")
WAIT_S = 180  # the fleet's rounds on two shared CPU cores: each wait is bounded by this
CHARTS = ("#loss-chart .scatterlayer .trace", "#timeline-chart .barlayer .trace", "#bytes-chart .barlayer .trace",
          "#task-chart .scatterlayer .trace", "#task-chart .errorbar")
TASK_EVALS = {0: [(0, 0.0, 0.0, 0.25), (5, 0.6, 0.31, 0.83)], 1: [(0, 0.0, 0.0, 0.25), (5, 0.5, 0.24, 0.76)]}


def add_task_evals(out: Path) -> None:
    """Each island's task_eval lines (version, accuracy, interval) appended to its metrics.jsonl, as an island run
    with --eval-task writes them."""
    for lid, points in TASK_EVALS.items():
        with open(out / f"island-{lid}" / "metrics.jsonl", "a") as f:
            for version, accuracy, low, high in points:
                f.write(json.dumps({"time": time.time(), "event": "task_eval", "step": 2 * version,
                                    "round": version + 1, "version": version, "task": "gcd", "accuracy": accuracy,
                                    "low": low, "high": high, "n": 12, "seconds": 0.5}) + "\n")


def chromium(offline: bool = False):
    o = webdriver.ChromeOptions()
    o.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        o.add_argument(arg)
    if offline:  # every request but loopback goes to a dead proxy, and the network itself is emulated off
        o.add_argument("--proxy-server=127.0.0.1:9")
    # without `make test`'s LD_PRELOAD of OpenBLAS (for MLX): preloaded into Chromium it crashes the renderer
    browser_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER), env=browser_env), options=o)
    driver.set_page_load_timeout(60)
    if offline:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    return driver


def count(driver, css: str) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, css))


def rounds_shown(driver) -> int:
    return int(driver.find_element(By.ID, "rounds").text or 0)


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory):
    """A live 2-island fleet watched in Chromium while it runs; yields its directory once it has finished."""
    model = tiny_model("llama")
    out = tmp_path_factory.mktemp("watched") / "run"
    fleet = subprocess.Popen([sys.executable, "-m", "yeto", "launch", "--gpu", "local:2", "--model", str(model),
                              "--data", str(DEMO_DATA), "--out", str(out), "--outer-steps", "5", "--inner-steps", "2",
                              "--seq-len", "64", "--batch-size", "2", "--lora-r", "4", "--step-delay", "0.5"],
                             cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    board = driver = None
    try:
        deadline = time.time() + WAIT_S
        while not (out / "syncer").is_dir() and time.time() < deadline and fleet.poll() is None:
            time.sleep(0.2)
        port = free_port()
        board = subprocess.Popen([sys.executable, "-m", "yeto", "dashboard", str(out), "--port", str(port)],
                                 cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        printed = board.stdout.readline()
        assert f"http://127.0.0.1:{port}/?token=" in printed
        driver = chromium()
        driver.get(printed.split()[1])  # (the URL carries the page's token: without it the page is refused)
        wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.2)
        wait.until(lambda d: count(d, "#fleet tbody tr.island") == 2)
        wait.until(lambda d: rounds_shown(d) >= 1)
        first = rounds_shown(driver)
        wait.until(lambda d: rounds_shown(d) > first)  # the page follows the tape as it grows
        assert count(driver, "#loss-chart .scatterlayer .trace") >= 3  # two islands and the merged loss
        assert {e.text for e in driver.find_elements(By.CSS_SELECTOR, "#fleet tbody td:nth-child(2)")} == {"torch"}
        fleet_out, _ = fleet.communicate(timeout=WAIT_S)
        assert fleet.returncode == 0, fleet_out[-3000:]
        wait.until(lambda d: rounds_shown(d) == 5 and "finished" in d.find_element(By.ID, "state").text)
        assert not driver.find_element(By.ID, "task-chart").is_displayed()  # no task evaluated: no task chart
        add_task_evals(out)
        wait.until(lambda d: count(d, CHARTS[3]) == len(TASK_EVALS))  # one accuracy line per island, live
        assert driver.find_element(By.ID, "task-chart").is_displayed()
        assert "task accuracy, 95% interval (gcd)" in driver.find_element(By.ID, "task-chart").text
        live = {css: count(driver, css) for css in CHARTS}
        assert all(live.values()), live
        shot = os.environ.get("YETO_SCREENSHOT")
        if shot:
            driver.save_screenshot(str(REPO / shot))
        yield out, live
    finally:
        if driver is not None:
            driver.quit()
        if board is not None:
            board.send_signal(signal.SIGINT)
            board.wait(timeout=30)
        if fleet.poll() is None:
            os.killpg(fleet.pid, signal.SIGINT)
            fleet.wait(timeout=60)


def test_the_live_page_shows_the_fleet_the_rounds_advancing_and_the_loss(finished_run):
    out, live = finished_run
    assert live[CHARTS[0]] >= 3


def test_the_export_opens_offline_and_draws_the_same_charts(finished_run, tmp_path):
    out, live = finished_run
    html = tmp_path / "run.html"
    r = subprocess.run([sys.executable, "-m", "yeto", "dashboard", str(out), "--export", str(html)], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    driver = chromium(offline=True)
    try:
        driver.get(html.as_uri())
        WebDriverWait(driver, 60, poll_frequency=0.2).until(lambda d: count(d, CHARTS[0]) > 0)
        assert {css: count(driver, css) for css in CHARTS} == live
        assert count(driver, "#fleet tbody tr.island") == 2 and rounds_shown(driver) == 5
        fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert [u for u in fetched if not u.startswith("file:")] == []
    finally:
        driver.quit()
