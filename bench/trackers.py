"""What a tracker costs the syncer's merge (`yeto syncer --report-to`): the same run twice, a real syncer on loopback
and two numpy islands with SmolLM2-135M's adapter shapes (LoRA r=16 on attention, 4-bit sync), once with no tracker
and once with TensorBoard attached. Each merge is timed as the syncer's whole handling of the event that merged it
(the merge, the tape, the checkpoint, the broadcast, and with a tracker its record), and the ratio of the medians is
printed: the target is at most 1.02.

    python bench/trackers.py [--rounds 12] [--repeats 3] [--tracker tensorboard]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from yeto.island.diloco import run_island  # noqa: E402
from yeto.launch.local import free_port  # noqa: E402
from yeto.sync.core.island import LinkTimeouts  # noqa: E402
from yeto.sync.shell.server import Syncer, SyncerConfig  # noqa: E402
from yeto.report.trackers import open_trackers  # noqa: E402

LAYERS, HIDDEN, KV, RANK = 30, 576, 192, 16  # SmolLM2-135M's attention, LoRA r=16
SHAPES = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN)}
LOSS_TOKENS = 1000
FAST = LinkTimeouts(heartbeat_s=0.2, dead_after_s=10.0, backoff_base_s=0.05, backoff_max_s=0.5)


class NumpyIsland:
    """An island whose step nudges every LoRA tensor (the adapter's size is what a merge's cost depends on)."""

    backend = "numpy"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.step_count = 0
        self.state = {}
        for i in range(LAYERS):
            for mod, (fin, fout) in SHAPES.items():
                base = f"base_model.model.model.layers.{i}.self_attn.{mod}"
                self.state[f"{base}.lora_A.default.weight"] = np.zeros((RANK, fin), np.float32)
                self.state[f"{base}.lora_B.default.weight"] = np.zeros((fout, RANK), np.float32)

    def adapter_state(self):
        return {k: v.copy() for k, v in self.state.items()}

    def load_adapter_state(self, state):
        self.state = {k: np.asarray(v, np.float32).copy() for k, v in state.items()}

    def step(self):
        for v in self.state.values():
            v += 1e-3 * self.rng.standard_normal(v.shape, dtype=np.float32)
        self.step_count += 1
        return {"loss": 1.0, "tokens": 2 * LOSS_TOKENS, "loss_tokens": LOSS_TOKENS}

    def adapter_config(self):
        return {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(SHAPES),
                "task_type": "CAUSAL_LM"}

    def record(self):
        return {"backend": "numpy", "config": {"batch_size": 1, "seq_len": 2 * LOSS_TOKENS}}

    def set_total_steps(self, total):
        pass

    def use_shard(self, index, count):  # (no data to cut: every shard is the same target)
        pass


def merge_times(rounds: int, tracker: str, out: Path, hook: list[float]) -> list[float]:
    """One run: the seconds of each merge's event handling (from the second merge on: the first follows the run's
    founding); `hook` gets the seconds spent in the tracker's hooks (`MergeTracking`), in all."""
    port = free_port()
    cfg = SyncerConfig(port=port, host="127.0.0.1", out=str(out / "syncer"), insecure=True, islands=2, quorum=2,
                       outer_steps=rounds, inner_steps=2, sync_bits=4)
    syncer = Syncer(cfg)
    trackers = open_trackers(tracker, cfg.out, "bench-syncer", "bench", {}, print)
    if trackers is not None:
        syncer.report_to(trackers)
        tracking = syncer.tracking
        for name in ("on_event", "merged"):
            setattr(tracking, name, _timed(getattr(tracking, name), hook))
    times: list[float] = []
    timed = syncer._run_timed

    def run_timed(event):  # the whole event, so that the tracker's part after the merge counts too
        version, t = syncer.core.version, time.perf_counter()
        timed(event)
        if syncer.core.version > version:
            times.append(time.perf_counter() - t)

    syncer._run_timed = run_timed
    serving = threading.Thread(target=syncer.serve, daemon=True)
    serving.start()
    islands = [threading.Thread(target=run_island, args=(NumpyIsland(i), f"127.0.0.1:{port}", i),
                                kwargs={"log_fn": lambda s: None, "timeouts": FAST}, daemon=True) for i in (0, 1)]
    for t in islands:
        t.start()
    for t in islands:
        t.join(600)
    serving.join(60)
    if trackers is not None:
        trackers.finish()
    if len(times) < rounds:  # (the founding, which makes version 0, is timed too)
        raise SystemExit(f"{len(times)} merges timed of {rounds}")
    return times[-(rounds - 1):]


def _timed(fn, total: list[float]):
    def call(*args):
        t = time.perf_counter()
        fn(*args)
        total.append(time.perf_counter() - t)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tracker", default="tensorboard")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each kind, interleaved")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, list[float]] = {}
        hook: list[float] = []
        for i, tracker in enumerate(["none", args.tracker] * args.repeats):  # interleaved: drift hits both
            runs.setdefault(tracker, []).extend(merge_times(args.rounds, tracker, Path(tmp) / str(i), hook))
    base, tracked = (statistics.median(runs[k]) for k in ("none", args.tracker))
    merges = len(runs[args.tracker])
    per_merge = sum(hook) / (merges + args.repeats)  # (the hooks also ran for each run's first merge)
    print(f"merge (median of {len(runs['none'])}): no tracker {base * 1e3:.2f} ms, {args.tracker} "
          f"{tracked * 1e3:.2f} ms; ratio {tracked / base:.3f} (target <= 1.02)")
    print(f"the tracker's hooks on the merge path: {per_merge * 1e6:.1f} us per merge, {per_merge / base:.5f} of a "
          "merge (the trackers' own work runs on their thread)")


if __name__ == "__main__":
    main()
