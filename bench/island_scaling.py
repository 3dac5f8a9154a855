"""Island scaling: one island as 1 process vs N torchrun ranks on the same machine, and rank 0's relay cost.

Runs, each as real processes:
  1 rank    `yeto train` with the global batch B, all threads in one process (the baseline)
  N ranks   `torchrun --nproc-per-node N -m yeto.backends.torch`, batch B/N per rank, threads split between ranks
  fleet     a syncer and the N-rank island for a few rounds: the share of rank 0's time spent relaying calls and
            adapters to the other ranks (and checking their digests)
and prints tokens/s of each and the ratio N ranks / 1 rank. On a CPU machine the ranks share the same cores, so
the ratio measures the island's overhead (gradient all-reduce, relays), not a speed-up; on a machine with N GPUs
(`--device cuda`) the same script measures the speed-up.

    python bench/island_scaling.py [--ranks 2] [--steps 12] [--seq-len 256] [--batch-size 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yeto.launch.local import free_port  # noqa: E402
from yeto.sync.shell.keys import JOIN_KEY_ENV, Keyring  # noqa: E402


def run(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "yeto.backends.torch"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=str(REPO / "data" / "demo"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4, help="the island's global batch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if a.batch_size % a.ranks:
        sys.exit("--batch-size must be a multiple of --ranks")
    tmp = Path(tempfile.mkdtemp(prefix="yeto-bench-island-"))
    cores = os.cpu_count() or 1
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    common = ["--model", a.model, "--data", a.data, "--seq-len", str(a.seq_len), "--lora-dropout", "0",
              "--eval-every", "0", "--eval-fraction", "0.05", "--device", a.device, "--no-progress"]
    per_rank = ["--batch-size", str(a.batch_size // a.ranks), "--threads", str(max(1, cores // a.ranks))]

    print(f"island scaling: {a.model}, seq {a.seq_len}, global batch {a.batch_size}, {a.steps} steps, {cores} cores, "
          f"device {a.device}", flush=True)
    wall1 = run([sys.executable, "-m", "yeto.backends.torch", *common, "--batch-size", str(a.batch_size), "--threads",
                 str(cores), "--max-steps", str(a.steps), "--out", str(tmp / "one")], env)
    one = json.loads((tmp / "one" / "summary.json").read_text())
    wallN = run([*torchrun(a.ranks), *common, *per_rank, "--max-steps", str(a.steps), "--out", str(tmp / "n")], env)
    many = json.loads((tmp / "n" / "summary.json").read_text())

    port, s_out = free_port(), tmp / "syncer"
    env[JOIN_KEY_ENV] = Keyring.ensure(s_out).own_key(0).text()  # (island 0's own key, as `yeto launch` gives it)
    syncer = subprocess.Popen([sys.executable, "-m", "yeto", "syncer", "--host", "127.0.0.1", "--port", str(port),
                               "--islands", "1", "--quorum", "1", "--outer-steps", str(a.rounds), "--inner-steps",
                               str(max(1, a.steps // a.rounds)), "--out", str(s_out)], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run([*torchrun(a.ranks), *common, *per_rank, "--syncer", f"127.0.0.1:{port}", "--island-id", "0",
         "--islands", "1", "--out", str(tmp / "fleet")], env)
    syncer.wait(timeout=120)
    fleet = json.loads((tmp / "fleet" / "summary.json").read_text())

    rows = [("1 rank", one["tok_s"], wall1), (f"{a.ranks} ranks", many["tok_s"], wallN)]
    print("\n| island | tokens/s | wall (s, incl. start-up) |\n|---|---|---|")
    for name, tok_s, wall in rows:
        print(f"| {name} | {tok_s:.0f} | {wall:.1f} |")
    print(f"\n{a.ranks} ranks / 1 rank tokens/s: {many['tok_s'] / one['tok_s']:.3f}x")
    relay, compute = fleet.get("relay_s", 0.0), fleet.get("compute_s") or 0.0
    print(f"fleet ({a.rounds} rounds): rank 0 relayed for {relay:.3f} s against {compute:.1f} s of inner steps "
          f"({relay / max(compute, 1e-9):.2%})")
    print(json.dumps({"one_tok_s": one["tok_s"], "ranks_tok_s": many["tok_s"], "ratio": many["tok_s"] / one["tok_s"],
                      "relay_s": relay, "compute_s": compute}))


if __name__ == "__main__":
    main()
