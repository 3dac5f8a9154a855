"""Quality and utilization of real 2-island fleets on SmolLM2-135M (same total tokens).

Runs, each as real processes on this machine:
  single   one island (`yeto train`), T steps, all cores
  single, 2x batch   one island, T/2 steps of twice the batch (what synchronous data parallel would do)
  32-bit   `yeto launch --gpu local:2 --sync-bits 32`, T/2 steps per island
  4-bit    the same at 4 bits (error feedback on both directions)
  4-bit+ov the same with --overlap
and prints each run's final held-out loss (of the merged adapter), the 4-bit /
32-bit loss ratio (target within 2%), and each fleet's compute utilization
(share of wall time from the first round to the end spent in inner steps;
target >= 95%).

    python bench/fleet.py [--total-steps 40] [--inner-steps 5] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=str(REPO / "data" / "demo"))
    p.add_argument("--total-steps", type=int, default=40)
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="yeto-bench-"))
    base = ["--model", a.model, "--data", a.data, "--seq-len", str(a.seq_len),
            "--lr", str(a.lr), "--warmup-steps", "3", "--eval-every", "0"]
    common = base + ["--batch-size", str(a.batch_size)]
    yeto = [sys.executable, "-m", "yeto"]
    results = {}
    wall = run(yeto + ["train", *common, "--max-steps", str(a.total_steps), "--out", str(tmp / "single"),
                       "--no-progress"])
    s = json.loads((tmp / "single" / "summary.json").read_text())
    results["single"] = {"eval_loss": s["eval_loss_after"], "eval_before": s["eval_loss_before"], "wall_s": wall}
    per_island = a.total_steps // 2
    # the synchronous data-parallel equivalent of a 2-island fleet: twice the batch, half the steps
    wall = run(yeto + ["train", *base, "--batch-size", str(2 * a.batch_size),
                       "--max-steps", str(per_island), "--out", str(tmp / "single-2x-batch"), "--no-progress"])
    s = json.loads((tmp / "single-2x-batch" / "summary.json").read_text())
    results["single, 2x batch"] = {"eval_loss": s["eval_loss_after"], "wall_s": wall}
    rounds = per_island // a.inner_steps
    for name, extra in [("32-bit", ["--sync-bits", "32"]), ("4-bit", ["--sync-bits", "4"]),
                        ("4-bit+overlap", ["--sync-bits", "4", "--overlap"])]:
        out = tmp / name
        wall = run(yeto + ["launch", "--gpu", "local:2", "--out", str(out), "--outer-steps", str(rounds),
                           "--inner-steps", str(a.inner_steps), *extra, *common])
        isl = [json.loads((out / f"island-{i}" / "summary.json").read_text()) for i in range(2)]
        results[name] = {"eval_loss": isl[0]["eval_loss_after"], "wall_s": wall,
                         "utilization": [round(x["utilization"], 4) for x in isl],
                         "stall_s": [round(x["stall_s"], 2) for x in isl],
                         "delta_bytes": isl[0]["delta_bytes"][0] if isl[0]["delta_bytes"] else None}
    print(f"model {a.model}, {a.total_steps} total inner steps of {a.batch_size} x {a.seq_len} tokens "
          f"(fleets: 2 islands x {per_island} steps, {rounds} rounds of {a.inner_steps})")
    print(f"{'run':>15} {'eval loss':>10} {'utilization (island 0, 1)':>28} {'stall s':>14} {'wall s':>8}")
    for name, r in results.items():
        util = ", ".join(f"{u:.1%}" for u in r.get("utilization", [])) or "-"
        stall = ", ".join(f"{x:.1f}" for x in r.get("stall_s", [])) or "-"
        print(f"{name:>15} {r['eval_loss']:10.4f} {util:>28} {stall:>14} {r['wall_s']:8.0f}")
    print(f"eval loss before training: {results['single']['eval_before']:.4f}")
    q = results["4-bit"]["eval_loss"] / results["32-bit"]["eval_loss"]
    print(f"ratio 4-bit / 32-bit eval loss: {q:.4f} ({(q - 1) * 100:+.2f}%)")
    print(f"ratio 32-bit fleet / single island eval loss: "
          f"{results['32-bit']['eval_loss'] / results['single']['eval_loss']:.4f}; "
          f"/ single island at 2x batch (same steps and tokens as the fleet): "
          f"{results['32-bit']['eval_loss'] / results['single, 2x batch']['eval_loss']:.4f}")
    u0 = sum(results["4-bit"]["utilization"]) / 2
    u1 = sum(results["4-bit+overlap"]["utilization"]) / 2
    print(f"utilization 4-bit: {u0:.1%}; with overlap: {u1:.1%}; eval loss with overlap / without: "
          f"{results['4-bit+overlap']['eval_loss'] / results['4-bit']['eval_loss']:.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
