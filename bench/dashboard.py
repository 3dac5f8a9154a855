"""What `yeto dashboard` costs and how far behind it is.

(a) update lag: a run directory whose tape grows one line at a time (the demo's tape, tests/data/watch-run, replayed
    at random 0.2-0.8 s gaps), `yeto dashboard` serving it and headless Chromium showing it; the lag is from the
    line's write to the page showing the new event count (polled over selenium every 10 ms).
(b) the syncer's merge time with the dashboard attached and without: the syncer's merge path (bench/sync_wire.py's
    merge round: decode 4-bit deltas, token-weighted sum, outer step, 4-bit broadcast encode) on a 1B-class adapter,
    timed in trials of three merges in random order: one with the dashboard and its Chromium page watching a tape
    that grows two lines a second, one with the dashboard stopped (SIGSTOP: the page's polls go unanswered) and the
    tape still, and that again as a control whose ratio to the first is the machine's own noise. Reported as each
    arm's min and median against "without".

    python bench/dashboard.py [--lines 20] [--trials 40] [--islands 4]
"""

from __future__ import annotations

import argparse
import json
import random
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from sync_wire import delta_message, llama_1b_specs  # noqa: E402

from yeto.launch.local import free_port  # noqa: E402
from yeto.sync.merge.aggregate import RoundSum  # noqa: E402
from yeto.sync.merge.outer import nesterov_step  # noqa: E402
from yeto.sync.wire.layout import layout_from_specs  # noqa: E402
from yeto.sync.wire.protocol import decode, decode_fragments, encode_fragments_ef  # noqa: E402
from yeto.sync.wire.quant import ErrorFeedback  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "watch-run"
# (b)'s arms: the dashboard attached, stopped, and stopped again (a control: its ratio is this machine's noise)
ARMS = ("without", "with", "without (control)")
SETTLE_S = 0.6  # between switching an arm and its merge: a poll or more of the page's
FIRST_LINES = 12  # the replayed run starts with this much of the tape written


class Watched:
    """A copy of the fixture run whose tape is cut to FIRST_LINES and grows by `append()`, served by `yeto dashboard`
    and open in headless Chromium."""

    def __init__(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.dir = Path(tempfile.mkdtemp(prefix="yeto-dash-bench-"))
        shutil.copytree(FIXTURE, self.dir / "run")
        self.tape = self.dir / "run" / "syncer" / "tape.jsonl"
        self.lines = self.tape.read_text().splitlines(keepends=True)
        self.tape.write_text("".join(self.lines[:FIRST_LINES]))
        self.written = FIRST_LINES
        port = free_port()
        self.board = subprocess.Popen([sys.executable, "-m", "yeto", "dashboard", str(self.dir / "run"), "--port",
                                       str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.board.stdout.readline()
        o = webdriver.ChromeOptions()
        o.binary_location = "/usr/bin/chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
            o.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)
        self.driver.get(f"http://127.0.0.1:{port}/")
        self.wait_shown(FIRST_LINES, 60)

    def shown(self) -> int:
        return int(self.driver.execute_script("return document.body.dataset.events || 0"))

    def wait_shown(self, n: int, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while self.shown() < n:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"the page never showed {n} events")
            time.sleep(0.01)
        return time.perf_counter()

    def append(self) -> bool:
        """One more tape line (the replay restarts from FIRST_LINES when the tape is used up); False on a restart."""
        if self.written >= len(self.lines):
            self.tape.write_text("".join(self.lines[:FIRST_LINES]))
            self.written = FIRST_LINES
            return False
        with open(self.tape, "a") as f:
            f.write(self.lines[self.written])
        self.written += 1
        return True

    def close(self) -> None:
        self.driver.quit()
        self.board.terminate()
        self.board.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def update_lag(lines: int) -> None:
    """Also the CPU the dashboard's server and its Chromium page use meanwhile (a core's share)."""
    import psutil

    w = Watched()
    lags = []
    browser = [p.pid for p in psutil.Process(w.driver.service.process.pid).children(recursive=True)]
    t0, server0, browser0 = time.perf_counter(), cpu_seconds([w.board.pid]), cpu_seconds(browser)
    try:
        rng = random.Random(0)
        for _ in range(lines):
            time.sleep(rng.uniform(0.2, 0.8))
            if not w.append():
                continue
            t = time.perf_counter()
            lags.append(w.wait_shown(w.written, 10) - t)
        wall = time.perf_counter() - t0
        server, page = cpu_seconds([w.board.pid]) - server0, cpu_seconds(browser) - browser0
    finally:
        w.close()
    print(f"(a) update lag over {len(lags)} appended tape lines: median {statistics.median(lags) * 1000:.0f} ms, "
          f"max {max(lags) * 1000:.0f} ms (the page polls every 500 ms)")
    print(f"    CPU meanwhile ({wall:.0f} s, a line every 0.5 s on average): the dashboard server "
          f"{100 * server / wall:.1f}% of a core, Chromium (every process of it) {100 * page / wall:.1f}%")


def merge_round(layout, msgs, tokens, state) -> float:
    t = time.perf_counter()
    s = RoundSum(layout.numel)
    for i, msg in enumerate(msgs):
        s.add(i, decode_fragments(layout, msg), int(tokens[i]))
    g, m, ef = state
    new_g, m = nesterov_step(g, s.mean(), m, 0.7, 0.9)
    _, _, sent = encode_fragments_ef(layout, new_g - g, 4, ef)
    state[0], state[1] = g + sent, m
    return time.perf_counter() - t


def merge_time(trials: int, islands: int) -> None:
    layout = layout_from_specs(llama_1b_specs())
    rng = np.random.default_rng(1)
    msgs = [decode(delta_message(layout, (rng.standard_normal(layout.numel) * 1e-3).astype(np.float32), 4))
            for _ in range(islands)]
    tokens = rng.integers(500, 5000, islands)
    state = [np.zeros(layout.numel, np.float32), np.zeros(layout.numel, np.float32), ErrorFeedback(layout.numel)]
    merge_round(layout, msgs, tokens, state)  # warm
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    w = Watched()
    attached = threading.Event()

    def grow() -> None:  # while attached, the tape grows two lines a second
        while True:
            attached.wait()
            w.append()
            time.sleep(0.5)

    threading.Thread(target=grow, daemon=True).start()
    order = random.Random(1)
    try:
        for _ in range(trials):
            for arm in order.sample(ARMS, len(ARMS)):
                if arm == "with":
                    os.kill(w.board.pid, signal.SIGCONT)
                    attached.set()
                else:
                    attached.clear()
                    os.kill(w.board.pid, signal.SIGSTOP)  # the page's polls go unanswered: nothing runs for it
                time.sleep(SETTLE_S)
                times[arm].append(merge_round(layout, msgs, tokens, state))
    finally:
        os.kill(w.board.pid, signal.SIGCONT)
        w.close()
    print(f"(b) merge round ({islands} islands, {layout.numel * 4 / 1e6:.0f} MB fp32 adapter), {trials} of each arm:")
    base = {"min": min(times["without"]), "median": statistics.median(times["without"])}
    result = {}
    for arm in ARMS:
        lo, med = min(times[arm]), statistics.median(times[arm])
        result[arm] = {"min_ms": round(lo * 1000, 1), "median_ms": round(med * 1000, 1),
                       "ratio_min": round(lo / base["min"], 4), "ratio_median": round(med / base["median"], 4)}
        print(f"    {arm:>20}: min {lo * 1000:.0f} ms, median {med * 1000:.0f} ms; against without: "
              f"min {lo / base['min']:.3f}, median {med / base['median']:.3f}")
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=20)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--islands", type=int, default=4)
    a = p.parse_args()
    update_lag(a.lines)
    merge_time(a.trials, a.islands)


if __name__ == "__main__":
    main()
