"""Convergence: N islands vs one synchronous data-parallel run with the same total tokens (SmolLM2-135M, demo data).

Every arm is real processes on this machine (a syncer on loopback and torch islands, `python -m yeto.backends.torch`,
or one alone) and reports the held-out eval loss of its final (merged) adapter and its ratio to its baseline
(data-parallel with the same global batch; for the heterogeneous arms, the fast island alone beside a shadow
slow island):
  data-parallel      one process, the fleet's global batch (islands x per-island batch), T steps (the baseline)
  N islands, H       N islands x T steps of batch/N each, rounds of H inner steps, under a merge rule, LoRA
                     aggregation and outer optimizer setting
  1 island alone     one of the 4 islands with no one to merge with (its quarter of the data, its batch)
  longer run         data-parallel and the default fleets over --long-steps (12 rounds of H=16 instead of 3)
  heterogeneous      2 islands in time-window rounds, one 10x slower (--step-delay), quorum 1: the fast island's
                     utilization, and the merged model vs the fast island alone for the same wall-clock; with
                     no keys (--insecure: trusted), each island on its own key (trusted) or both on the shared
                     join key (bounded: claims capped at the round's low median); and a torch island beside
                     a 10x slower MLX one (a Mac beside a GPU; MLX's CPU backend on Linux)
  lockstep           the heterogeneous pair without the clock: fixed rounds of 12 steps, the slow island one step
                     of each (--max-inner-steps 1), against the fast island alone on the same steps, and a ceiling
                     (the fast island alone taking the slow island's step itself, 13-step rounds)
  streamed parts     the default 2-island fleet over the longer run with --fragments P (rounds of H/P steps, each
                     part synced every H), with and without --overlap, and with --pipeline 2, against the whole
                     adapter every H steps
  wire bits          the default 2-island fleet with 2-bit deltas and/or 8-bit broadcasts (`--arms bits`), against
                     the 4-bit default fleet: eval loss and bytes per round up (one island's delta) and down
Training-loss curves (per round, against tokens seen by the whole fleet) go to a PNG. `--seeds 0,1,2` runs every arm
once per seed and tables each arm's ratio to its baseline per seed, with the mean: a single time-window run moves by
a few percent with which steps fall in which window.

    python bench/convergence.py [--steps 48] [--long-steps 192] [--seq-len 128] [--batch-size 4]
                                [--arms "a;b;..."] [--seeds 0,1,2] [--png FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yeto.launch.local import free_port  # noqa: E402
from yeto.sync.shell.keys import JOIN_KEY_ENV, Keyring  # noqa: E402

PLAIN = ["--outer-lr", "1.0", "--outer-momentum", "0.0"]  # FedAvg: the merged adapter is the weighted mean
DILOCO = ["--outer-lr", "0.7", "--outer-momentum", "0.9"]  # DiLoCo's pre-training defaults
DAMPED = ["--outer-lr", "0.8", "--outer-momentum", "0.3"]
MEAN = ["--merge", "mean"]  # the rule before rda became the default


def scaled(n: int) -> list[str]:
    """Outer lr sqrt(n), no momentum: each island's (smaller-batch) delta carries ~1/sqrt(n) of the data-parallel
    step's signal once its noise averages out."""
    return ["--outer-lr", f"{n ** 0.5:.3g}", "--outer-momentum", "0.0"]
STREAM_PARTS = (2, 4)  # --fragments of the streamed arms
SLOWDOWN = 10  # the heterogeneous arm's slow island is this many times slower per step
LOCKSTEP_H = 12  # the lockstep arms' round: about the fast island's steps in a time window of the slow one's one
PROCESS_TIMEOUT_S = 3600


@dataclass
class Arm:
    name: str
    islands: int = 0  # 0: data-parallel (one process)
    inner_steps: int = 16
    syncer: list[str] = field(default_factory=list)
    island: list[str] = field(default_factory=list)
    round_seconds: float = 0.0  # heterogeneous arms: time-window rounds
    slow_delay_s: float = 0.0  # the last island's --step-delay
    batch: int = 0  # per island (0: the global batch split between the islands); data-parallel: its batch
    shards: int = 0  # the data is split into this many shards (0: one per island)
    baseline: str = "data-parallel"  # the data-parallel arm with this arm's global batch
    # a slow island with this --step-delay trains alongside on a syncer of its own (its deltas never merge): the
    # machine carries the pair's load, so "the fast island alone" is compared at equal wall-clock and equal CPU
    shadow_slow_s: float = 0.0
    steps: int = 0  # inner steps per island (data-parallel: its steps); 0: --steps
    # the islands' keys: "" none (--insecure on loopback: trusted), "own" an island key each (trusted, what
    # `yeto launch` sets up), "join" the shared join key (bounded: claims capped at the round's low median)
    keys: str = ""
    slow_backend: str = "torch"  # the slow island's backend: "mlx" (a Mac beside a GPU; MLX's CPU backend here)
    slow_max_steps: int = 0  # the last island's --max-inner-steps (lockstep arms: a slow island's share of a round)


def arms(h_values: list[int], global_batch: int, long_steps: int) -> list[Arm]:
    out = [Arm("data-parallel")]
    # what the fleet adds: one of the 4 islands on its own quarter of the data, its batch, no one to merge with
    quarter = max(1, global_batch // 4)
    out += [Arm(f"1 island alone (a quarter of the data, batch {quarter})", 1, max(h_values), PLAIN, batch=quarter,
                shards=4)]
    for h in h_values:
        out += [Arm(f"2 islands H={h}, mean, DiLoCo 0.7/0.9", 2, h, MEAN + DILOCO),
                Arm(f"2 islands H={h}, mean, plain", 2, h, MEAN + PLAIN),
                Arm(f"2 islands H={h}, rda, plain (defaults)", 2, h, PLAIN)]
    h = max(h_values)
    out += [Arm(f"2 islands H={h}, mean, damped 0.8/0.3", 2, h, MEAN + DAMPED),
            Arm(f"2 islands H={h}, product, plain", 2, h, PLAIN + ["--lora-merge", "product"]),
            Arm(f"2 islands H={h}, frozen A, plain", 2, h, MEAN + PLAIN, ["--lora-freeze-a"]),
            Arm(f"2 islands H={h}, mean, plain, merge-alpha 0.5", 2, h, MEAN + PLAIN + ["--merge-alpha", "0.5"]),
            Arm(f"2 islands H={h}, mean, lr sqrt(2)", 2, h, MEAN + scaled(2))]
    default = f"2 islands H={h}, rda, plain (defaults)"  # deltas and broadcasts at 4 bits
    for up, down in ((2, 4), (2, 8), (4, 8), (2, 2)):
        out += [Arm(f"2 islands H={h}, defaults, wire bits {up} up / {down} down", 2, h,
                    PLAIN + ["--sync-bits", str(up), "--broadcast-bits", str(down)], baseline=default)]
    for k in h_values:
        out += [Arm(f"4 islands H={k}, mean, plain", 4, k, MEAN + PLAIN),
                Arm(f"4 islands H={k}, rda, plain (defaults)", 4, k, PLAIN)]
    big = 2 * global_batch  # 4 islands of batch 2: one sequence per island per step is what AdamW steps noisily on
    out += [Arm(f"4 islands H={h}, mean, lr sqrt(4)", 4, h, MEAN + scaled(4)),
            Arm(f"4 islands H={h}, mean, damped 0.8/0.3", 4, h, MEAN + DAMPED),
            Arm(f"4 islands H={h}, mean, DiLoCo 0.7/0.9", 4, h, MEAN + DILOCO),
            Arm(f"data-parallel, global batch {big}", batch=big),
            Arm(f"4 islands H={h}, batch {big // 4} each, mean, plain", 4, h, MEAN + PLAIN, batch=big // 4,
                baseline=f"data-parallel, global batch {big}"),
            Arm(f"4 islands H={h}, batch {big // 4} each, rda, plain (defaults)", 4, h, PLAIN, batch=big // 4,
                baseline=f"data-parallel, global batch {big}")]
    if long_steps:  # 3 outer steps are few for DiLoCo: the same fleets over a longer run (more rounds of the same H)
        base = f"data-parallel, {long_steps} steps"
        out += [Arm(base, steps=long_steps),
                Arm(f"2 islands H={h}, rda, plain (defaults), {long_steps} steps", 2, h, PLAIN, baseline=base,
                    steps=long_steps),
                Arm(f"4 islands H={h}, mean, plain, {long_steps} steps", 4, h, MEAN + PLAIN, baseline=base,
                    steps=long_steps),
                Arm(f"4 islands H={h}, rda, plain (defaults), {long_steps} steps", 4, h, PLAIN, baseline=base,
                    steps=long_steps)]
        out += streamed_arms(h, long_steps)
    return out


def streamed_arms(h: int, steps: int) -> list[Arm]:
    """Streaming fragments against whole-adapter sync at equal tokens: each part still syncs every H steps, so P parts
    take rounds of H/P steps (P times the rounds); with --overlap the islands train on while a merge is in flight."""
    whole = f"2 islands H={h}, rda, plain (defaults), {steps} steps"
    out = [Arm(f"2 islands H={h}, whole adapter, overlap, {steps} steps", 2, h, PLAIN, ["--overlap"], baseline=whole,
               steps=steps)]
    for parts in STREAM_PARTS:
        arm = f"2 islands H={h} in {parts} streamed parts (rounds of {h // parts})"
        out += [Arm(f"{arm}, {steps} steps", 2, h // parts, PLAIN + ["--fragments", str(parts)], baseline=whole,
                    steps=steps),
                Arm(f"{arm}, overlap, {steps} steps", 2, h // parts, PLAIN + ["--fragments", str(parts)],
                    ["--overlap"], baseline=whole, steps=steps),
                Arm(f"{arm}, pipeline 2, {steps} steps", 2, h // parts, PLAIN + ["--fragments", str(parts),
                                                                                 "--pipeline", "2"],
                    baseline=whole, steps=steps)]
    return out


def lockstep_arms(a: argparse.Namespace) -> list[Arm]:
    """The heterogeneous pair without the clock: fixed-step rounds of LOCKSTEP_H steps, the slow island doing one
    step of each (what a 10x slower island does in a window of ~12 fast steps) and every delta merged in its round.
    Nothing depends on timing, so a run repeats and two merge rules compare on the same steps (the time-window arms
    move by a few percent run to run with which steps fall in which window)."""
    steps, half = a.rounds * LOCKSTEP_H, max(1, a.batch_size // 2)
    alone = "lockstep: fast island alone"
    solo = dict(steps=steps, batch=half, shards=2, baseline=alone)  # the fast island's shard, as in the pair
    pair = dict(inner_steps=LOCKSTEP_H, steps=steps, batch=half, slow_max_steps=1, baseline=alone)
    # step-normalized, the token-weighted mean is 12/13 (fast + slow): this outer lr adds the pair's steps instead
    longer = ["--outer-lr", f"{(LOCKSTEP_H + 1) / LOCKSTEP_H:.6g}", "--outer-momentum", "0.0"]
    # what no merge can beat: the slow island's step of each round taken by the fast island itself, in sequence
    ceiling = {**solo, "steps": a.rounds * (LOCKSTEP_H + 1)}
    return [Arm(alone, 1, LOCKSTEP_H, PLAIN, **solo),
            Arm(f"lockstep: fast island alone, outer lr {LOCKSTEP_H + 1}/{LOCKSTEP_H}", 1, LOCKSTEP_H, longer, **solo),
            Arm("lockstep: fast island alone, one step more a round (the pair's tokens: a ceiling)", 1,
                LOCKSTEP_H + 1, PLAIN, **ceiling),
            Arm("lockstep: fast + 1-step slow, mean, step-normalized (the time-window defaults)", 2,
                syncer=PLAIN + MEAN + ["--step-normalize"], **pair),
            Arm("lockstep: fast + 1-step slow, mean, not step-normalized", 2,
                syncer=PLAIN + MEAN + ["--no-step-normalize"], **pair),
            Arm(f"lockstep: fast + 1-step slow, step-normalized, outer lr {LOCKSTEP_H + 1}/{LOCKSTEP_H}", 2,
                syncer=MEAN + ["--step-normalize"] + longer, **pair)]


def arm_dir(arm: Arm) -> str:
    """The folder of an arm's processes (under the run's temporary directory)."""
    return arm.name.replace(" ", "_").replace(",", "").replace("/", "-").replace("=", "").replace("+", "and")


def run_arm(arm: Arm, a: argparse.Namespace, tmp: Path, env: dict[str, str]) -> dict:
    """Run one arm to the end; returns its eval loss, per-island summaries and its loss curve."""
    out = tmp / arm_dir(arm)
    common = ["--model", a.model, "--data", a.data, "--seq-len", str(a.seq_len), "--lr", str(a.lr),
              "--seed", str(a.seed), "--warmup-steps", "3", "--eval-every", "0", "--lora-dropout", "0", "--no-progress",
              *arm.island]
    island = [sys.executable, "-m", "yeto.backends.torch"]
    t0 = time.perf_counter()
    budget = arm.steps or a.steps  # inner steps per island (data-parallel: its steps)
    if not arm.islands:
        batch = arm.batch or a.batch_size
        r = subprocess.run(island + common + ["--batch-size", str(batch), "--max-steps", str(budget),
                                               "--out", str(out / "dp")], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=PROCESS_TIMEOUT_S)
        if r.returncode:
            sys.exit(f"{arm.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        s = json.loads((out / "dp" / "summary.json").read_text())
        steps = [json.loads(x) for x in (out / "dp" / "metrics.jsonl").read_text().splitlines()]
        losses = [e["loss"] for e in steps if e.get("event") == "step"]
        per = max(1, budget // 12)  # the curve in 12 points
        tokens_per_step = batch * a.seq_len
        curve = [((i + per) * tokens_per_step, sum(losses[i:i + per]) / per) for i in range(0, len(losses), per)]
        return {"eval_loss": s["eval_loss_after"], "eval_before": s["eval_loss_before"],
                "wall_s": time.perf_counter() - t0, "curve": curve}
    n, port = arm.islands, free_port()
    batch = arm.batch or max(1, a.batch_size // n)
    rounds = budget // arm.inner_steps if not arm.round_seconds else a.rounds

    def start_syncer(port: int, islands: int, where: Path, keyed: bool = False) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "yeto", "syncer", *([] if keyed else ["--insecure"]),
                                 "--host", "127.0.0.1",
                                 "--port", str(port), "--out", str(where), "--islands", str(islands),
                                 "--quorum", str(1 if arm.round_seconds else islands), "--outer-steps", str(rounds),
                                 "--inner-steps", str(arm.inner_steps), "--round-seconds", str(arm.round_seconds),
                                 "--sync-bits", "4", *(["--no-island-keys"] if arm.keys == "join" else []),
                                 *arm.syncer], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def start_island(port: int, i: int, delay_s: float, where: Path, key: str = "") -> subprocess.Popen:
        delay = ["--step-delay", str(delay_s)] if delay_s else []
        if i == n - 1 and arm.slow_max_steps:
            delay += ["--max-inner-steps", str(arm.slow_max_steps)]
        mlx = i == n - 1 and arm.slow_backend == "mlx"
        return subprocess.Popen(([sys.executable, "-m", "yeto.backends.mlx"] if mlx else island) + common + [
            "--batch-size", str(batch), "--syncer", f"127.0.0.1:{port}", *([] if key else ["--insecure"]),
            "--island-id", str(i), "--islands", str(arm.shards or n), "--threads", str(threads), "--out",
            str(where), *delay], cwd=REPO, env=dict(env, **{JOIN_KEY_ENV: key}) if key else env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    keys = {i: "" for i in range(n)}
    if arm.keys:  # the run's credentials before the syncer starts (as `yeto launch` makes them)
        ring = Keyring.ensure(out / "syncer")
        keys = {i: ring.own_key(i).text() if arm.keys == "own" else ring.join.text() for i in range(n)}
    syncer = start_syncer(port, n, out / "syncer", keyed=bool(arm.keys))
    threads = max(1, (os.cpu_count() or 1) // (n + (1 if arm.shadow_slow_s else 0)))
    procs = [start_island(port, i, arm.slow_delay_s if i == n - 1 else 0.0, out / f"island-{i}", keys[i])
             for i in range(n)]
    shadow = []
    if arm.shadow_slow_s:
        shadow_port = free_port()
        shadow = [start_syncer(shadow_port, 1, out / "shadow-syncer"),
                  start_island(shadow_port, n, arm.shadow_slow_s, out / "shadow-island")]
    for i, p in enumerate(procs):
        log, _ = p.communicate(timeout=PROCESS_TIMEOUT_S)
        if p.returncode:
            syncer.kill()
            sys.exit(f"{arm.name}: island {i} failed:\n{log[-3000:]}")
    syncer.wait(timeout=120)
    for p in shadow:
        p.kill()
        p.wait()
    isl = [json.loads((out / f"island-{i}" / "summary.json").read_text()) for i in range(n)]
    tape = [json.loads(x) for x in (out / "syncer" / "tape.jsonl").read_text().splitlines() if x.strip()]
    deltas = [e for e in tape if e["event"] == "delta"]
    curve, seen = [], 0
    for m in (e for e in tape if e["event"] == "merge"):
        mine = [d for d in deltas if d["round"] == m["round"] and d["island"] in m["responders"]]
        seen += sum(d["tokens"] for d in mine)
        curve.append((seen, sum(d["loss"] * d["loss_tokens"] for d in mine) / max(1, sum(d["loss_tokens"]
                                                                                       for d in mine))))
    broadcasts = [e for e in tape if e["event"] == "broadcast" and "bytes" in e]
    return {"eval_loss": isl[0]["eval_loss_after"], "eval_before": isl[0]["eval_loss_before"],
            "wall_s": time.perf_counter() - t0, "curve": curve,
            # one island's delta message per round, and the syncer's broadcast message per round (to each island)
            "bytes_up": sum(d["bytes"] for d in deltas if "bytes" in d) / max(1, len(deltas)),
            "bytes_down": sum(e["bytes"] for e in broadcasts) / max(1, len(broadcasts)),
            "utilization": [round(x.get("utilization", 0.0), 4) for x in isl],
            "stall_s": [round(x.get("stall_s", 0.0), 2) for x in isl],
            "carried": [x.get("carried_rounds", 0) for x in isl],  # rounds carried onto the next global
            "lags": [d.get("lag", 0) for d in deltas if d["island"] == n - 1],  # the last (slow) island's
            "merges": sum(1 for e in tape if e["event"] == "merge"),
            "pipelined": sum(1 for d in deltas if "trained_from" in d),  # (--pipeline: pushed before their round)
            "slow_deltas_merged": sum(1 for e in tape if e["event"] == "merge" for lid in e["responders"]
                                      if lid == n - 1)}


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
        ax.plot(xs, ys, marker="o", ms=3, lw=2.5 if name == "data-parallel" else 1.2, label=name)
    ax.set_xlabel("tokens seen by the fleet")
    ax.set_ylabel("training loss (per round, token-weighted)")
    ax.legend(fontsize=7)
    names = list(results)
    bx.barh(range(len(names)), [results[k]["eval_loss"] for k in names], color="tab:blue")
    bx.set_yticks(range(len(names)), names, fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("held-out eval loss of the final adapter")
    if "data-parallel" in results:
        bx.axvline(results["data-parallel"]["eval_loss"], color="k", ls="--", lw=1)
    losses = [r["eval_loss"] for r in results.values()]
    bx.set_xlim(min(losses) * 0.97, max(losses) * 1.01)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=str(REPO / "data" / "demo"))
    p.add_argument("--steps", type=int, default=48, help="inner steps per island (data-parallel: its steps)")
    p.add_argument("--long-steps", type=int, default=192, help="the longer run's steps (0: none)")
    p.add_argument("--inner-steps", default="8,16", help="values of H, comma-separated")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4, help="the fleet's global batch (islands split it)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="the islands' --seed: held-out split, batch order, LoRA init")
    p.add_argument("--seeds", default="", help="run every arm once per seed (comma-separated, e.g. 0,1,2) and table "
                                              "each arm's ratio to its baseline per seed and its mean")
    p.add_argument("--rounds", type=int, default=6, help="rounds of the heterogeneous arms")
    p.add_argument("--round-seconds", type=float, default=20.0, help="window of the heterogeneous arms")
    p.add_argument("--step-s", type=float, default=1.0, help="the fast island's step time here (sizes the slow delay)")
    p.add_argument("--arms", default="", help="run only the arms whose names contain one of these (;-separated)")
    p.add_argument("--no-heterogeneous", action="store_true")
    p.add_argument("--png", default=str(REPO / "docs" / "convergence.png"))
    p.add_argument("--json")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="yeto-bench-convergence-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    todo = arms([int(x) for x in a.inner_steps.split(",")], a.batch_size, a.long_steps)
    if not a.no_heterogeneous:  # the slow island: (SLOWDOWN - 1) fast steps of delay per step
        slow = (SLOWDOWN - 1) * a.step_s
        half = max(1, a.batch_size // 2)  # the fast island alone: its batch and its shard, as in the pair
        alone = "heterogeneous: fast island alone"  # the baseline: the same wall-clock without the slow island
        pair = dict(round_seconds=a.round_seconds, slow_delay_s=slow, batch=half, baseline=alone)
        todo += [Arm(alone, 1, syncer=PLAIN, round_seconds=a.round_seconds, batch=half, shards=2, baseline=alone,
                     shadow_slow_s=slow),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow (defaults: mean, step-normalized)", 2, syncer=PLAIN,
                     **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, defaults, own keys (trusted)", 2, syncer=PLAIN,
                     keys="own", **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, defaults, shared join key (bounded)", 2,
                     syncer=PLAIN, keys="join", **pair),
                 Arm(f"heterogeneous: fast torch + {SLOWDOWN}x slow MLX, defaults, own keys (trusted)", 2,
                     syncer=PLAIN, keys="own", slow_backend="mlx", **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, rda, own keys (trusted)", 2,
                     syncer=PLAIN + ["--merge", "rda"], keys="own", **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, rda, shared join key (bounded)", 2,
                     syncer=PLAIN + ["--merge", "rda"], keys="join", **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, rda", 2, syncer=PLAIN + ["--merge", "rda"], **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, rda, step-normalized", 2,
                     syncer=PLAIN + ["--merge", "rda", "--step-normalize"], **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, mean, not step-normalized", 2,
                     syncer=MEAN + PLAIN + ["--no-step-normalize"], **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, no stale discount", 2,
                     syncer=PLAIN + ["--staleness-exponent", "0"], **pair),
                 Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, stale dropped", 2,
                     syncer=PLAIN + ["--max-base-lag", "0"], **pair)]
    if not a.no_heterogeneous:
        todo += lockstep_arms(a)
    if a.arms:
        keep = [k.strip() for k in a.arms.split(";")]
        wanted = [x for x in todo if any(k in x.name for k in keep)]
        todo = [x for x in todo if x in wanted or any(x.name == w.baseline for w in wanted)]
    by_seed = {}
    for seed in [int(x) for x in a.seeds.split(",")] if a.seeds else [a.seed]:
        a.seed = seed
        by_seed[seed] = results = run_arms(todo, a, tmp / f"seed-{seed}", env)
        print_table(todo, results, a)
    if len(by_seed) > 1:
        print_seeds(todo, by_seed)
    plot(results, Path(a.png))
    print(f"plot: {a.png} (seed {a.seed})")
    if a.json:
        Path(a.json).write_text(json.dumps(results if len(by_seed) == 1 else by_seed, indent=2))


def run_arms(todo: list[Arm], a: argparse.Namespace, tmp: Path, env: dict[str, str]) -> dict[str, dict]:
    """Every arm once, with the islands' --seed a.seed."""
    results: dict[str, dict] = {}
    for i, arm in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] seed {a.seed}: {arm.name} ...", flush=True)
        results[arm.name] = r = run_arm(arm, a, tmp, env)
        wire = f", bytes/round up {r['bytes_up']:,.0f} down {r['bytes_down']:,.0f}" if r.get("bytes_up") else ""
        print(f"    eval loss {r['eval_loss']:.4f} ({r['wall_s']:.0f}s){wire}"
              + (f", utilization {r['utilization']}, lags {r['lags']}" if r.get("utilization") else ""), flush=True)
    return results


def print_table(todo: list[Arm], results: dict[str, dict], a: argparse.Namespace) -> None:
    print(f"\nseed {a.seed}; model {a.model}; {a.steps} steps x global batch {a.batch_size} x {a.seq_len} tokens per "
          f"arm; eval loss before training {next(iter(results.values()))['eval_before']:.4f}")
    print(f"{'arm':<60} {'eval loss':>9} {'/ base':>7} {'wall s':>7} {'up B/round':>11} {'down B/round':>12}"
          "  utilization")
    for arm in todo:
        r, base = results[arm.name], results.get(arm.baseline)  # (a baseline not run: no ratio)
        ratio = f"{r['eval_loss'] / base['eval_loss']:7.4f}" if base else f"{'-':>7}"
        util = ", ".join(f"{u:.1%}" for u in r.get("utilization", [])) or "-"
        up, down = (f"{r[k]:,.0f}" if r.get(k) else "-" for k in ("bytes_up", "bytes_down"))
        print(f"{arm.name:<60} {r['eval_loss']:9.4f} {ratio} {r['wall_s']:7.0f} {up:>11} {down:>12}  {util}")
    alone = results.get("heterogeneous: fast island alone")
    for k in (k for k in results if k.startswith("heterogeneous: fast ") and results[k] is not alone and alone):
        r = results[k]
        print(f"{k}: fast island utilization {r['utilization'][0]:.1%}; slow island's deltas merged "
              f"{r['slow_deltas_merged']} (lags {r['lags']}); merged / fast alone eval loss "
              f"{r['eval_loss'] / alone['eval_loss']:.4f}")


def print_seeds(todo: list[Arm], by_seed: dict[int, dict[str, dict]]) -> None:
    """Each arm's ratio to its baseline per seed, their mean and spread: one run of a time-window arm moves by a few
    percent with which steps fall in which window, so rules are ranked on the mean of several seeds."""
    seeds = sorted(by_seed)
    print(f"\n{'arm / its baseline, per seed':<60} " + " ".join(f"{f'seed {s}':>8}" for s in seeds)
          + f" {'mean':>8} {'min-max':>15}")
    for arm in todo:
        ratios = [by_seed[s][arm.name]["eval_loss"] / by_seed[s][arm.baseline]["eval_loss"] for s in seeds
                  if arm.baseline in by_seed[s]]
        if len(ratios) == len(seeds) and arm.name != arm.baseline:
            print(f"{arm.name:<60} " + " ".join(f"{x:8.4f}" for x in ratios)
                  + f" {sum(ratios) / len(ratios):8.4f} {min(ratios):7.4f}-{max(ratios):.4f}")


if __name__ == "__main__":
    main()
