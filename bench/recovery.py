"""What a fault costs a real fleet: wall time of a 2-island run on SmolLM2-135M with and without faults.

Runs, each as real processes on this machine (`yeto syncer` + two `yeto train --syncer` islands,
4-bit, quorum 2, so a round cannot close without both islands):
  baseline        no fault
  island kill    island 1 is SIGKILLed 5 s into round 2 and restarted with the same command
  syncer kill     the syncer is SIGKILLed between the merge of round 2 and its checkpoint, then restarted
and prints each run's wall time, its ratio to the baseline measured in the same run, whether
every merge happened and the tape audit passed, and what the recovery cost (extra seconds).

    python bench/recovery.py [--outer-steps 4] [--inner-steps 6]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yeto.launch.local import free_port  # noqa: E402
from yeto.sync.shell.keys import JOIN_KEY_FILE, Keyring  # noqa: E402
from yeto.sync.shell.audit import audit_run  # noqa: E402
from yeto.sync.shell.tape import read_tape  # noqa: E402

POLL_S = 0.2
KILL_INTO_ROUND_S = 5.0  # island 1 is killed this long after round 2 opens: mid-round (a round takes ~25 s here)


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "yeto", *args], cwd=REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env or dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_tape(out: Path, event: str, **fields) -> None:
    while True:
        if (out / "tape.jsonl").exists() and any(
                e["event"] == event and all(e.get(k) == v for k, v in fields.items()) for e in read_tape(out)):
            return
        time.sleep(POLL_S)


def fleet(name: str, tmp: Path, a: argparse.Namespace, fault: str | None) -> dict:
    run = tmp / name
    run.mkdir()
    port = free_port()
    syncer_args = ["syncer", "--host", "127.0.0.1", "--port", str(port), "--out", str(run / "syncer"),
                   "--islands", "2", "--quorum", "2", "--outer-steps", str(a.outer_steps),
                   "--inner-steps", str(a.inner_steps), "--island-timeout", "10", "--no-island-keys"]
    threads = max(1, (os.cpu_count() or 2) // 2)

    def island(i: int) -> subprocess.Popen:
        return spawn(["train", "--model", "smollm2-135m", "--data", str(REPO / "data" / "demo"), "--syncer",
                      f"127.0.0.1:{port}", "--island-id", str(i), "--islands", "2", "--out",
                      str(run / f"island-{i}"), "--seq-len", "128", "--batch-size", "4", "--lr", "1e-3",
                      "--warmup-steps", "3", "--eval-every", "0", "--threads", str(threads), "--no-progress",
                      "--syncer-timeout", "10", "--join-key", str(run / "syncer" / JOIN_KEY_FILE)],
                     run / f"island-{i}.log")

    Keyring.ensure(run / "syncer")  # the run's credentials first (as `yeto launch` does)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if fault == "syncer":
        env["YETO_CRASH_AT"] = "checkpoint:2"
    t0 = time.perf_counter()
    syncer = spawn(syncer_args, run / "syncer.log", env)
    islands = [island(0), island(1)]
    recovery_s = 0.0
    if fault == "island":
        wait_tape(run / "syncer", "round_open", round=2)
        time.sleep(KILL_INTO_ROUND_S)
        if any(e["event"] == "delta" and e["round"] == 2 and e["island"] == 1 for e in read_tape(run / "syncer")):
            raise SystemExit("island 1 finished round 2 before the kill: lower KILL_INTO_ROUND_S")
        t = time.perf_counter()
        islands[1].send_signal(signal.SIGKILL)
        islands[1].wait()
        islands[1] = island(1)
        wait_tape(run / "syncer", "merge", round=2)
        recovery_s = time.perf_counter() - t  # kill -> the round it was killed in is merged (restart, retrain)
    elif fault == "syncer":
        syncer.wait()
        t = time.perf_counter()
        syncer = spawn(syncer_args, run / "syncer-2.log")
        wait_tape(run / "syncer", "broadcast", round=2)
        recovery_s = time.perf_counter() - t  # restart -> the lost round is merged again and broadcast
    codes = [p.wait() for p in (syncer, *islands)]
    wall = time.perf_counter() - t0
    report = audit_run(run / "syncer")
    return {"wall_s": wall, "recovery_s": recovery_s, "ok": all(c == 0 for c in codes) and report.ok
            and report.version == a.outer_steps, "audit": report.summary(), "codes": codes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outer-steps", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=6)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="yeto-recovery-"))
    results = {}
    for name, fault in (("baseline", None), ("island kill", "island"), ("syncer kill", "syncer")):
        results[name] = r = fleet(name.replace(" ", "-"), tmp, a, fault)
        print(f"{name:>13}: {r['wall_s']:6.1f} s  ok={r['ok']}  recovery {r['recovery_s']:5.1f} s  ({r['audit']})",
              flush=True)
    base = results["baseline"]["wall_s"]
    for name in ("island kill", "syncer kill"):
        r = results[name]
        print(f"ratio {name} / baseline: {r['wall_s'] / base:.3f} (+{r['wall_s'] - base:.1f} s)")
    print(f"runs in {tmp}")


if __name__ == "__main__":
    main()
