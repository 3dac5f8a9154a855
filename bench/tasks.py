"""Task accuracy: does a fleet learn a task as well as one machine? (SmolLM2-135M, generated reasoning tasks.)

Each task is made offline by reasoning-gym (`yeto.eval.gym.write_task`: a training file and a held-out set from seeds
past the training range), and every arm is scored on the same held-out examples by the task's own scorer (greedy,
`yeto.eval`). The arms are real processes on this machine, run by bench/convergence.py's `run_arm` (a syncer on
loopback and islands, or one process alone):
  base model           no training
  one machine          data-parallel: one process, the fleet's global batch, --steps steps (the baseline)
  2 / 4 islands        the global batch split between the islands, --steps inner steps each (equal total tokens),
                       `yeto launch`'s defaults (H = its --inner-steps, outer lr 1, no momentum)
  torch + MLX          2 islands, one of them MLX (MLX's CPU backend here), equal tokens
  streamed             2 islands syncing the adapter in 2 parts (rounds of H/2 steps, each part every H)
  equal time           2 islands each with one machine's batch and steps: twice the tokens in the same time on two
                       machines, against one machine (the question of a user with a second machine)
  heterogeneous        2 islands in time-window rounds, one 10x slower, the mode's defaults, island keys (trusted),
                       against the fast island alone for the same wall-clock (beside a shadow slow island, so both
                       see the same CPU load)
`--levers` adds the few-sequential-steps arms (the 2-island fleet with H/2 and with outer lr 1.5), the
heterogeneous pair without step normalization, and bench/convergence.py's lockstep
arms (the pair in fixed-step rounds, the slow island one step of each: no clock, so a seed repeats).
Each fleet arm's accuracy minus one machine's is the paired difference over the same examples, with its 95% interval.

    python bench/tasks.py [--tasks chain_sum,word_sequence_reversal] [--seeds 0,1] [--steps 150] [--levers]
                          [--held-out 200] [--arms "a;b"] [--json FILE] [--png FILE] [--smoke]
    python bench/tasks.py --from-json run1.json,run2.json [--png FILE]   (tables and one plot of earlier runs)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import convergence  # noqa: E402
from convergence import MEAN, PLAIN, SLOWDOWN, Arm  # noqa: E402

from yeto.cli.launch_command import DEFAULT_INNER_STEPS  # noqa: E402

# the tasks and the generator settings tried (docs/benchmarks.md says which were kept and why)
TASKS: dict[str, dict] = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 2},
    "word_sequence_reversal": {"min_words": 3, "max_words": 4},
    "number_sorting": {"min_numbers": 3, "max_numbers": 4, "max_decimals": 0},
}
DEFAULT_TASKS = "chain_sum,word_sequence_reversal"
BASE, ONE = "base model", "one machine"
GOAL_POINTS = 2.0  # an equal-token fleet arm is within this many points of one machine (or its interval overlaps)
SMOKE_ARMS = (ONE, "2 islands")  # --smoke's arms (after the base model)
SMOKE = dict(steps=4, held_out=8, train_n=64, max_new_tokens=4, inner_steps=2, seq_len=64, batch_size=2)


def fleet_arms(h: int, levers: bool, round_seconds: float, slow_s: float, batch: int, steps: int) -> list[Arm]:
    """The arms after the base model, each naming its baseline (one machine, or the fast island alone)."""
    out = [Arm(ONE, baseline=ONE),
           Arm("2 islands", 2, h, PLAIN, baseline=ONE),
           Arm("4 islands", 4, h, PLAIN, baseline=ONE),
           Arm("2 islands, torch + MLX", 2, h, PLAIN, slow_backend="mlx", baseline=ONE),
           Arm("2 islands, 2 streamed parts", 2, max(1, h // 2), PLAIN + ["--fragments", "2"], baseline=ONE),
           Arm("2 islands, equal time (2x tokens)", 2, h, PLAIN, batch=batch, baseline=ONE, steps=steps)]
    if levers:
        out += [Arm(f"2 islands, H={max(1, h // 2)}", 2, max(1, h // 2), PLAIN, baseline=ONE),
                Arm("2 islands, outer lr 1.5", 2, h, ["--outer-lr", "1.5", "--outer-momentum", "0.0"],
                    baseline=ONE)]
    if round_seconds:
        alone = "heterogeneous: fast island alone"
        pair = dict(round_seconds=round_seconds, slow_delay_s=slow_s, batch=max(1, batch // 2), baseline=alone)
        out += [Arm(alone, 1, syncer=PLAIN, shards=2, shadow_slow_s=slow_s, **{**pair, "slow_delay_s": 0.0}),
                Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, defaults, own keys", 2, syncer=PLAIN, keys="own",
                    **pair)]
        if levers:  # the time-window default scales a short delta up to the round's length: without it
            out.append(Arm(f"heterogeneous: fast + {SLOWDOWN}x slow, mean, not step-normalized, own keys", 2,
                           syncer=MEAN + PLAIN + ["--no-step-normalize"], keys="own", **pair))
    return out


def adapter_of(arm: Arm, out: Path) -> Path:
    """Where run_arm leaves an arm's final adapter (one process's, or island 0's last merged global)."""
    return out / convergence.arm_dir(arm) / ("dp" if not arm.islands else "island-0") / "adapter"


def score(model: str, adapter: Path | None, task, a: argparse.Namespace) -> dict:
    """The held-out accuracy of base `model` (+ `adapter`), greedy, in this process, as `yeto eval` scores it."""
    from contextlib import closing
    from itertools import islice

    import torch

    from yeto.backends.torch.generate import task_generators
    from yeto.eval.task import evaluate_task
    from yeto.models.materialize import resolve_model

    torch.set_num_threads(os.cpu_count() or 1)
    adapters = [adapter] if adapter is not None else []
    with closing(task_generators(resolve_model(model), adapters, "cpu")) as models:
        generate = list(islice(models, 1 + len(adapters)))[-1]  # (the base's first, then the adapter's)
        r = evaluate_task(generate, task, a.max_new_tokens, a.eval_batch)
    return {**r.summary(), "scores": r.scores}


def run_task(name: str, seed: int, a: argparse.Namespace, tmp: Path, env: dict[str, str]) -> dict[str, dict]:
    from yeto.eval.gym import write_task
    from yeto.eval.task import load_task

    where = tmp / f"{name}-seed-{seed}"
    files = write_task(name, a.train_n, seed * a.train_n, where / f"{name}.jsonl", a.held_out, TASKS.get(name))
    task = load_task(files["held_out"])
    print(f"\n== {name}, seed {seed}: {files['train_records']} training records ({files['dropped']} dropped as "
          f"held-out questions), {files['held_out_records']} held out", flush=True)
    a.data, a.seed = files["train"], seed
    results = {BASE: {**score(a.model, None, task, a), "wall_s": 0.0}}
    print(f"    {BASE}: accuracy {results[BASE]['accuracy']:.1%}", flush=True)
    slow_s = (SLOWDOWN - 1) * a.step_s
    todo = fleet_arms(a.inner_steps, a.levers, a.round_seconds, slow_s, a.batch_size, a.steps)
    if a.levers:  # the heterogeneous pair without the clock: merge rules compared on the same steps
        todo += convergence.lockstep_arms(a)
    if a.smoke:
        todo = [x for x in todo if x.name in SMOKE_ARMS]
    elif a.arms:
        keep = [k.strip() for k in a.arms.split(";")]
        wanted = [x for x in todo if any(x.name == k[1:] if k.startswith("=") else k in x.name for k in keep)]
        todo = [x for x in todo if x in wanted or any(x.name == w.baseline for w in wanted)]
    for i, arm in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {arm.name} ...", flush=True)
        trained = convergence.run_arm(arm, a, where, env)
        t = time.perf_counter()
        results[arm.name] = r = {**trained, **score(a.model, adapter_of(arm, where), task, a),
                                 "score_s": time.perf_counter() - t, "baseline": arm.baseline}
        print(f"    accuracy {r['accuracy']:.1%} [{r['low']:.1%}, {r['high']:.1%}], eval loss {r['eval_loss']:.4f}, "
              f"trained in {r['wall_s']:.0f}s", flush=True)
    return results


def table(name: str, seed: int, results: dict[str, dict]) -> list[str]:
    """The markdown table of one task and seed: accuracy with its interval, the paired difference to the baseline."""
    from yeto.eval.score import Interval, paired_difference

    rows = [f"**{name}**, seed {seed} ({results[BASE]['n']} held-out examples; accuracy with its 95% Wilson interval; "
            "difference: paired, in points, with its 95% interval)", "",
            "| arm | accuracy | vs its baseline | eval loss | wall s | bytes up / down per round |",
            "|---|---|---|---|---|---|"]
    for arm, r in results.items():
        acc = Interval(r["accuracy"], r["low"], r["high"]).text()
        base = results.get(r.get("baseline", ""))
        diff = "-"
        if base is not None and r.get("baseline") != arm:
            diff = f"{paired_difference(base['scores'], r['scores']).text(signed=True)} vs {r['baseline']}"
        loss = f"{r['eval_loss']:.4f}" if "eval_loss" in r else "-"
        wire = f"{r['bytes_up']:,.0f} / {r['bytes_down']:,.0f}" if r.get("bytes_up") else "-"
        rows.append(f"| {arm} | {acc} | {diff} | {loss} | {r['wall_s']:.0f} | {wire} |")
    return rows


def verdicts(results: dict[str, dict]) -> list[str]:
    """The issue's goals, checked on one task and seed."""
    from yeto.eval.score import paired_difference

    one, out = results.get(ONE), []
    if one is None:
        return out
    for arm, r in results.items():
        if r.get("baseline") != ONE or arm == ONE:
            continue
        d = paired_difference(one["scores"], r["scores"])
        if "equal time" in arm:
            ok = d.low > 0
            out.append(f"{arm}: {'above' if ok else 'NOT clearly above'} one machine ({d.text(signed=True)})")
        else:
            ok = abs(d.value) * 100 <= GOAL_POINTS or d.low <= 0 <= d.high
            out.append(f"{arm}: {'within' if ok else 'NOT within'} {GOAL_POINTS:g} points of one machine or its "
                       f"interval overlaps ({d.text(signed=True)})")
    for arm, r in results.items():
        if arm.startswith("heterogeneous: fast +") and r.get("baseline") in results:
            d = paired_difference(results[r["baseline"]]["scores"], r["scores"])
            out.append(f"{arm}: {d.text(signed=True)} vs the fast island alone at equal wall-clock")
    return out


def merged(files: list[str], a: argparse.Namespace) -> dict[str, dict[int, dict[str, dict]]]:
    """The results of earlier runs' --json files as one: a later file's arm replaces an earlier file's (same task and
    seed), and each table lists its arms in fleet_arms' order."""
    order = [BASE] + [x.name for x in fleet_arms(a.inner_steps, True, 1.0, 1.0, a.batch_size, a.steps)
                      + convergence.lockstep_arms(a)]
    out: dict[str, dict[int, dict[str, dict]]] = {}
    for f in files:
        for name, by_seed in json.loads(Path(f).read_text()).items():
            for seed, results in by_seed.items():
                out.setdefault(name, {}).setdefault(int(seed), {}).update(results)
    rank = {arm: i for i, arm in enumerate(order)}
    return {name: {seed: dict(sorted(r.items(), key=lambda kv: rank.get(kv[0], len(rank))))
                   for seed, r in sorted(by_seed.items())} for name, by_seed in out.items()}


def plot(all_results: dict[str, dict[int, dict[str, dict]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(7 * len(all_results), 5.5), squeeze=False)
    for ax, (name, by_seed) in zip(axes[0], all_results.items()):
        fullest_first = sorted(by_seed.values(), key=len, reverse=True)  # (its order: fleet_arms')
        arms = list(dict.fromkeys(arm for results in fullest_first for arm in results))
        width = 0.8 / len(by_seed)
        for k, (seed, results) in enumerate(sorted(by_seed.items())):
            rows = [(i, results[x]) for i, x in enumerate(arms) if x in results]  # (an arm this seed did not run)
            ys = [100 * r["accuracy"] for _, r in rows]
            err = [[100 * (r["accuracy"] - r["low"]) for _, r in rows],
                   [100 * (r["high"] - r["accuracy"]) for _, r in rows]]
            ax.barh([i + k * width for i, _ in rows], ys, height=width, xerr=err, label=f"seed {seed}")
        ax.set_yticks([i + width * (len(by_seed) - 1) / 2 for i in range(len(arms))], arms, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("held-out accuracy, % (95% Wilson interval)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma-separated, of {', '.join(TASKS)} or any generator")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=150, help="one machine's steps (each island's inner steps)")
    p.add_argument("--inner-steps", type=int, default=DEFAULT_INNER_STEPS, help="H (yeto launch's default)")
    p.add_argument("--batch-size", type=int, default=4, help="one machine's batch, which the islands split")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-n", type=int, default=2000, help="training records per task")
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--levers", action="store_true",
                   help="also the H/2 and outer-lr 1.5 fleets, and the heterogeneous pair not step-normalized")
    p.add_argument("--rounds", type=int, default=6, help="rounds of the heterogeneous arms")
    p.add_argument("--round-seconds", type=float, default=30.0, help="window of the heterogeneous arms (0: none)")
    p.add_argument("--step-s", type=float, default=1.0, help="the fast island's step time here (sizes the slow delay)")
    p.add_argument("--arms", default="", help="only the arms whose names contain one of these "
                                            "(;-separated; =NAME: that arm alone)")
    p.add_argument("--smoke", action="store_true", help="a few steps and examples (tests run it on a tiny model)")
    p.add_argument("--json")
    p.add_argument("--png", default=str(REPO / "docs" / "tasks.png"))
    p.add_argument("--from-json", default="", help="earlier runs' --json files (comma-separated): their tables and "
                                                 "one plot of them all, training nothing")
    a = p.parse_args()
    if a.from_json:
        all_results = merged(a.from_json.split(","), a)
        for name, by_seed in all_results.items():
            for seed, results in by_seed.items():
                print("\n".join(["", *table(name, seed, results), "", *verdicts(results)]), flush=True)
        plot(all_results, Path(a.png))
        print(f"plot: {a.png}")
        return
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
        a.round_seconds, a.seeds = 0.0, a.seeds.split(",")[0]
    tmp = Path(tempfile.mkdtemp(prefix="yeto-bench-tasks-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    all_results: dict[str, dict[int, dict[str, dict]]] = {}
    for name in a.tasks.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            results = run_task(name, seed, a, tmp, env)
            all_results.setdefault(name, {})[seed] = results
            print("\n".join(["", *table(name, seed, results), "", *verdicts(results)]), flush=True)
    if a.smoke:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"the arms' runs and adapters: {tmp}")
    if a.json:
        Path(a.json).write_text(json.dumps(all_results, indent=1))
    if not a.smoke:
        plot(all_results, Path(a.png))
        print(f"plot: {a.png}")


if __name__ == "__main__":
    main()
