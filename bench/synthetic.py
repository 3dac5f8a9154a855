"""Synthetic islands for the benchmarks (bench/soak.py, bench/wan.py): numpy adapters speaking the real protocol.

A `NumpyIsland` holds LoRA-named numpy tensors of any shapes and takes timed fake steps (a sleep of `step_s`, then a
small update), so a fleet of them exercises the real syncer, wire and link at the sizes of real models without
their compute. It keeps the wall-clock times of its steps and of every adapter it is handed, for per-round timing.
`start_syncer` runs a real `yeto syncer` process with the run's credentials made first, as `yeto launch` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yeto.sync.shell.keys import Keyring  # noqa: E402


SYNCER_START_S = 120.0


class Crash(Exception):
    pass


class NumpyIsland:
    """An island whose step sleeps `step_s` and moves the first `touch` values of each tensor (None: all) toward a
    fixed target; it raises Crash once `crash_at` (monotonic) has passed."""

    backend = "numpy"

    def __init__(self, lid: int, shapes: dict[str, tuple[int, int]], step_s: float, r: int,
                 touch: Optional[int] = None, crash_at: float = float("inf")):
        rng = np.random.default_rng(lid)
        self.state = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
        self.touch = touch
        self.target = {n: rng.standard_normal(min(touch or s[0] * s[1], s[0] * s[1])).astype(np.float32)
                       for n, s in shapes.items()}
        self.step_s, self.r, self.crash_at = step_s, r, crash_at
        self.step_ends: list[float] = []  # time.time() at the end of each step
        self.step_count = 0
        self.loads: list[float] = []  # time.time() at each adapter handed in (a round's start, the end)

    def adapter_state(self):
        return {k: v.copy() for k, v in self.state.items()}

    def load_adapter_state(self, state):
        self.state = {k: np.asarray(v, np.float32).copy() for k, v in state.items()}
        self.loads.append(time.time())

    def step(self):
        if time.monotonic() >= self.crash_at:
            raise Crash("a simulated crash")
        time.sleep(self.step_s)
        for k, v in self.state.items():
            flat = v.reshape(-1)[:self.target[k].size]
            flat += 0.1 * (self.target[k] - flat)
        self.step_ends.append(time.time())
        self.step_count += 1
        return {"loss": 1.0, "tokens": 64, "loss_tokens": 32}

    def adapter_config(self):
        modules = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in self.state})
        return {"peft_type": "LORA", "r": self.r, "lora_alpha": 2 * self.r, "target_modules": modules}

    def record(self):
        return {"backend": "numpy", "config": {"batch_size": 1, "seq_len": 64}}

    def set_total_steps(self, total):
        pass

    def use_shard(self, index, count):  # (no data to cut: every shard is the same target)
        pass


def lora_names(layers: int, module: str = "self_attn.q_proj") -> list[str]:
    return [f"base_model.model.model.layers.{i}.{module}.lora_{ab}.default.weight"
            for i in range(layers) for ab in "AB"]


def start_syncer(out: Path, port: int, flags: list[str], log: Path) -> subprocess.Popen:
    """A real syncer process on loopback, returned once it listens; the run's keys are made first (islands read
    out/join.key). (Waiting matters behind a proxy: it accepts before the syncer is up, and an island takes the
    connection it then closes for a failed handshake.)"""
    Keyring.ensure(out)
    proc = subprocess.Popen([sys.executable, "-m", "yeto", "syncer", "--host", "127.0.0.1", "--port", str(port),
                             "--out", str(out), *flags], cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + SYNCER_START_S
    while "listening on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc
