"""WAN emulation: fleets behind emulated links (yeto.testbed.netem) against the same fleets on loopback, in one run.

Each island reaches a real `yeto syncer` (CURVE, 4-bit wire, quorum = every island) through its own
`yeto.testbed.netem.Link` with a named profile (datacenter, region, home, poor), or directly (`loopback`); `mix` puts
island 0 on `poor` and the rest on `region`. Islands are
  - synthetic (bench/synthetic.py's NumpyIsland, one process each): LoRA adapters at the sizes of real models,
    r and shapes from the catalog's published configs (all linears: q k v o gate up down), with timed fake steps.
    The round's compute is `inner steps x step seconds` of each size class (SIZES), shorter than a real round
    (a DiLoCo round is ~500 steps of ~1 s on one GPU for 8B) so the run fits minutes; the stall each round adds
    is measured, and the table also says what utilization that stall leaves in a 500 s round;
  - real SmolLM2-135M torch islands (`--real`), the fleet tests' adapter (r 8, q/v).
Per island and round: utilization (time in inner steps / wall time from the first round, run_island's own measure),
stall (time waiting on the syncer), bytes up and down, seconds up (the end of the round's last step -> the syncer
records the delta: encode + wire), seconds down (the syncer's broadcast -> the island holds the new adapter: wire +
decode), quorum -> received (the last delta the merge waited for arrives -> the island holds the merged adapter),
and false drops (a live island dropped as silent, a quorum timeout, a reconnect, an island that gave up: must be 0).

    python bench/wan.py                              # 1B-class and SmolLM2: loopback, home, mix, each also with
                                                     # --overlap and streamed in 4 parts (about 15 minutes)
    python bench/wan.py --sizes 8b --profiles loopback,home --no-real   # docs/benchmarks.md's streaming table
    python bench/wan.py --full                       # docs/benchmarks.md's table (about 30 minutes on 2 loaded cores)
    python bench/wan.py --sizes 70b --profiles loopback,home --no-real  # the 70B class (3.3 GB adapters)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.synthetic import NumpyIsland, start_syncer  # noqa: E402
from yeto.models.catalog import CATALOG  # noqa: E402
from yeto.launch.local import free_port  # noqa: E402
from yeto.testbed.netem import PROFILES, Link  # noqa: E402
from yeto.sync.shell.tape import read_tape  # noqa: E402

DEMO_DATA = REPO / "data" / "demo" / "pirate_chat.jsonl"
REAL_ROUND_S = 500.0  # a DiLoCo round on a real island: ~500 inner steps of ~1 s
TOUCH = 4096  # values a fake step moves per tensor (the rest of the adapter rides along unchanged)
CEILING_MB = 200  # bytes pushed through an unshaped link to measure the proxy's own ceiling
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class SizeClass:
    """A synthetic island: the catalog alias whose shapes it takes, LoRA rank, and its fake round."""

    alias: str
    r: int
    inner_steps: int
    step_s: float


SIZES = {
    "1b": SizeClass("llama3.2-1b", r=16, inner_steps=10, step_s=1.0),
    "8b": SizeClass("llama3.1-8b", r=16, inner_steps=20, step_s=2.0),
    "70b": SizeClass("llama3.1-70b", r=64, inner_steps=20, step_s=6.0),
}
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def lora_shapes(alias: str, r: int) -> dict[str, tuple[int, int]]:
    """peft's tensors for LoRA rank r on every linear of a Llama-shaped decoder: lora_A (r, in), lora_B (out, r)."""
    c = CATALOG[alias].config
    hidden, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], \
        c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    dims = {"self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv * head_dim),
            "self_attn.v_proj": (hidden, kv * head_dim), "self_attn.o_proj": (heads * head_dim, hidden),
            "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    shapes = {}
    for i in range(c["num_hidden_layers"]):
        for m in MODULES:
            fan_in, fan_out = dims[m]
            prefix = f"base_model.model.model.layers.{i}.{m}"
            shapes[f"{prefix}.lora_A.default.weight"] = (r, fan_in)
            shapes[f"{prefix}.lora_B.default.weight"] = (fan_out, r)
    return shapes


def values(shapes: dict[str, tuple[int, int]]) -> int:
    return sum(a * b for a, b in shapes.values())


@dataclass(frozen=True)
class Case:
    """One fleet: its island kind (a SIZES key or "smollm2"), each island's profile, and --overlap."""

    kind: str
    profiles: tuple[str, ...]
    overlap: bool = False
    fragments: int = 1  # streamed in this many parts: rounds of 1/P the steps, P times as many (equal steps)
    pipeline: int = 1  # streamed: deltas an island may have in flight (--pipeline)

    @property
    def name(self) -> str:
        names = sorted(set(self.profiles), key=self.profiles.index)
        where = names[0] if len(names) == 1 else "mix " + "+".join(names)
        return f"{self.kind} {where}" + (" overlap" if self.overlap else "") + (
            f" {self.fragments} parts" if self.fragments > 1 else "") + (
            f" pipeline {self.pipeline}" if self.pipeline > 1 else "")


def synthetic_island(case: Case, address: str, lid: int, key_path: str, out: mp.Queue) -> None:
    """One synthetic island's process: train through the link, report run_island's result and its timestamps."""
    from yeto.island.diloco import run_island
    from yeto.sync.shell.keys import read_join_key

    size = SIZES[case.kind]
    island = NumpyIsland(lid, lora_shapes(size.alias, size.r), size.step_s, size.r, touch=TOUCH)
    pushes: dict[int, tuple[float, float]] = {}  # round -> (the last step's end, the push queued)
    logs: list[str] = []

    def pushed(p: dict[str, Any]) -> None:
        pushes[p["round"]] = (island.step_ends[-1], time.time())

    try:
        result = run_island(island, address, lid, overlap=case.overlap, progress=pushed, log_fn=logs.append,
                            join_key=read_join_key(key_path), identity=f"wan-bench-island-{lid:04d}")
    except Exception as e:  # noqa: BLE001  (reported: the table shows an island that failed)
        result = {"error": repr(e)[:300]}
    out.put({"lid": lid, **result, "pushes": pushes, "loads": island.loads, "logs": logs})


def real_island(case: Case, address: str, lid: int, out_dir: Path, key: str) -> subprocess.Popen:
    from yeto.sync.shell.keys import JOIN_KEY_ENV

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **{JOIN_KEY_ENV: key})
    return subprocess.Popen([sys.executable, "-m", "yeto.backends.torch", "--model", "smollm2-135m",
                             "--data", str(DEMO_DATA), "--syncer", address, "--island-id", str(lid),
                             "--islands", str(len(case.profiles)), "--out", str(out_dir), "--seq-len", "64",
                             "--batch-size", "2", "--threads", "1", "--no-progress",
                             *(["--overlap"] if case.overlap else [])],
                            cwd=REPO, env=env, stdout=open(out_dir.parent / f"l{lid}.log", "w"),
                            stderr=subprocess.STDOUT)


def run_case(case: Case, rounds: int, real_steps: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="yeto-wan-"))
    out, port, n = tmp / "syncer", free_port(), len(case.profiles)
    steps = real_steps if case.kind == "smollm2" else SIZES[case.kind].inner_steps
    steps, rounds = max(1, steps // case.fragments), rounds * case.fragments  # (each part still syncs every H steps)
    syncer = start_syncer(out, port, ["--no-island-keys",  # (one join key for every island: links, not trust)
                                      "--islands", str(n), "--quorum", str(n), "--outer-steps", str(rounds),
                                      "--inner-steps", str(steps), "--sync-bits", "4",
                                      "--fragments", str(case.fragments), "--pipeline", str(case.pipeline)],
                          tmp / "syncer.log")
    links = [None if p == "loopback" else Link(port, PROFILES[p], seed=i) for i, p in enumerate(case.profiles)]
    addresses = [f"127.0.0.1:{port}" if link is None else link.address for link in links]
    t0 = time.perf_counter()
    procs: list[Any] = []
    try:
        if case.kind == "smollm2":
            key = (out / "join.key").read_text().strip()
            procs = [real_island(case, a, i, tmp / f"l{i}", key) for i, a in enumerate(addresses)]
            for p in procs:
                p.wait(RUN_TIMEOUT_S)
            results = []
            for i in range(n):
                summary = tmp / f"l{i}" / "summary.json"
                results.append(json.loads(summary.read_text()) if summary.exists() else
                               {"error": (tmp / f"l{i}.log").read_text()[-300:]})
                results[-1]["logs"] = (tmp / f"l{i}.log").read_text().splitlines()
        else:
            q: mp.Queue = mp.Queue()
            procs = [mp.Process(target=synthetic_island, args=(case, a, i, str(out / "join.key"), q))
                     for i, a in enumerate(addresses)]
            for p in procs:
                p.start()
            results = sorted((q.get(timeout=RUN_TIMEOUT_S) for _ in procs), key=lambda r: r["lid"])
            for p in procs:
                p.join(60)
        syncer.wait(120)
    finally:  # (a run that failed or hung leaves nothing behind)
        for p in procs:
            if (p.poll() is None) if isinstance(p, subprocess.Popen) else p.is_alive():
                p.kill()
        for link in links:
            if link is not None:
                link.close()
        if syncer.poll() is None:
            syncer.kill()
    wall = time.perf_counter() - t0
    return measure(case, read_tape(out), results, links, wall, tmp)


def measure(case: Case, tape: list[dict[str, Any]], results: list[dict[str, Any]], links: list[Optional[Link]],
            wall: float, tmp: Path) -> dict[str, Any]:
    merges = {e["round"]: e for e in tape if e["event"] == "merge"}
    broadcasts = {e["round"]: e["time"] for e in tape if e["event"] == "broadcast"}
    deltas = {(e["round"], e["island"]): e["time"] for e in tape if e["event"] == "delta"}
    opened = next(e["time"] for e in tape if e["event"] == "round_open")
    ends = [opened] + [merges[r]["time"] for r in sorted(merges)]
    silent = sum(1 for e in tape if e["event"] == "leave" and "silent" in e["reason"])
    timeouts = sum(1 for e in tape if e["event"] in ("quorum_timeout", "given_up"))
    islands = []
    for i, res in enumerate(results):
        rounds = max(1, res.get("rounds", 0))
        isl = {"profile": case.profiles[i], "error": res.get("error"),
               "reconnects": sum(1 for line in res.get("logs", []) if "reconnecting" in line),
               "utilization": res.get("utilization", 0.0), "stall_s": res.get("stall_s", 0.0) / rounds,
               "compute_s": res.get("compute_s", 0.0) / rounds,
               "delta_mb": mean([b / 1e6 for b in res.get("delta_bytes", [])]),
               "mb_up": res.get("bytes_sent", 0) / rounds / 1e6, "mb_down": res.get("bytes_received", 0) / rounds / 1e6,
               "complete": res.get("complete", False)}
        if "pushes" in res:  # synthetic: per-round timestamps
            loads = res["loads"]
            up, down, q2r = [], [], []
            for r, (last_step, _queued) in res["pushes"].items():
                if (r, i) in deltas:
                    up.append(deltas[(r, i)] - last_step)
                if r in broadcasts and r in merges:
                    got = next((t for t in loads if t > broadcasts[r]), None)
                    if got is not None:
                        down.append(got - broadcasts[r])
                        q2r.append(got - max(deltas[(r, j)] for j in merges[r]["responders"]))
            isl.update(up_s=mean(up), down_s=mean(down), quorum_to_received_s=mean(q2r))
        islands.append(isl)
    drops = silent + timeouts + sum(x["reconnects"] + (0 if x["complete"] and not x["error"] else 1) for x in islands)
    measured = {"case": case.name, "kind": case.kind, "rounds": len(merges), "fragments": case.fragments,
                "round_s": mean([b - a for a, b in zip(ends, ends[1:])]), "wall_s": wall, "islands": islands,
                "false_drops": drops, "dir": str(tmp),
                "link_mb": [None if link is None else (link.bytes_up / 1e6, link.bytes_down / 1e6) for link in links]}
    (tmp / "measured.json").write_text(json.dumps(dict(measured, logs=[r.get("logs", []) for r in results]), indent=1))
    return measured


def mean(xs: list[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def proxy_ceiling() -> float:
    """Mbit/s one connection gets through an unshaped link on this machine now (the proxy's own ceiling)."""
    sink = socket.create_server(("127.0.0.1", 0))
    got = [0]

    def swallow() -> None:
        conn, _ = sink.accept()
        with conn:
            while data := conn.recv(1 << 20):
                got[0] += len(data)

    reader = threading.Thread(target=swallow)
    reader.start()
    link = Link(sink.getsockname()[1])
    payload = hashlib.sha256(b"wan").digest() * (1 << 15)  # 1 MiB
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", link.port)) as s:
        for _ in range(CEILING_MB):
            s.sendall(payload)
    reader.join(120)
    took = time.perf_counter() - t
    link.close()
    sink.close()
    return got[0] * 8 / took / 1e6


def fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def per_island(c: dict[str, Any], key: str, spec: str = ".1f", scale: float = 1.0) -> str:
    vals = [x.get(key) for x in c["islands"]]
    shown = [fmt(None if v is None else v * scale, spec) for v in vals]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def table(cases: list[dict[str, Any]]) -> str:
    base = {c["kind"]: c["round_s"] for c in cases if c["case"].endswith(" loopback") and c["round_s"]}
    head = ("| fleet | rounds | round s | / loopback's | utilization % | stall s/round | at a 500 s round % | "
            "delta MB | MB up/round | s up | MB down/round | s down | quorum -> received s | false drops |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cases:
        real_round_s = REAL_ROUND_S / c.get("fragments", 1)  # (a streamed round is 1/P of the steps)
        at_real = [100 * real_round_s / (real_round_s + x["stall_s"]) for x in c["islands"]]
        at_real_s = " / ".join(f"{v:.1f}" for v in at_real) if len({f"{v:.1f}" for v in at_real}) > 1 else \
            f"{at_real[0]:.1f}"
        ratio = c["round_s"] * c.get("fragments", 1) / base[c["kind"]] if c["round_s"] and c["kind"] in base else None
        rows.append(f"| {c['case']} | {c['rounds']} | {fmt(c['round_s'])} | {fmt(ratio, '.2f')} | "
                    f"{per_island(c, 'utilization', '.1f', 100)}"
                    f" | {per_island(c, 'stall_s')} | {at_real_s} | {per_island(c, 'delta_mb', '.2f')} | "
                    f"{per_island(c, 'mb_up', '.2f')} | "
                    f"{per_island(c, 'up_s')} | {per_island(c, 'mb_down', '.2f')} | {per_island(c, 'down_s')} | "
                    f"{per_island(c, 'quorum_to_received_s')} | {c['false_drops']} |")
    return "\n".join(rows)


def cases_from(a: argparse.Namespace) -> list[Case]:
    out = []
    for size in a.sizes:
        for p in a.profiles:
            profiles = ("poor",) + ("region",) * (a.islands) if p == "mix" else (p,) * a.islands
            out.append(Case(size, profiles))
            if a.overlap and p != "loopback":
                out.append(Case(size, profiles, overlap=True))
            out += [Case(size, profiles, overlap=a.overlap, fragments=parts) for parts in a.fragments]
            out += [Case(size, profiles, overlap=a.overlap, fragments=parts, pipeline=d) for parts in a.fragments
                    for d in a.pipeline if 1 < d <= parts]
    if a.real:
        out += [Case("smollm2", (p,) * a.islands) for p in a.real_profiles]
    return out


def full_matrix(a: argparse.Namespace) -> list[Case]:
    """docs/benchmarks.md's table: every profile and the mix for the 1B class; loopback, home and home with
    --overlap for the larger ones; SmolLM2 on --real-profiles."""
    n = a.islands
    matrix = [Case("1b", (p,) * n) for p in ("loopback", "datacenter", "region", "home", "poor")]
    matrix.append(Case("1b", ("poor",) + ("region",) * n))
    for size in (s for s in a.sizes if s != "1b"):
        matrix += [Case(size, ("loopback",) * n), Case(size, ("home",) * n)]
        if a.overlap:
            matrix.append(Case(size, ("home",) * n, overlap=True))
        for parts in a.fragments:
            matrix.append(Case(size, ("home",) * n, overlap=a.overlap, fragments=parts))
            matrix += [Case(size, ("home",) * n, overlap=a.overlap, fragments=parts, pipeline=d)
                       for d in a.pipeline if 1 < d <= parts]
    if a.real:
        matrix += [Case("smollm2", (p,) * n) for p in a.real_profiles]
    return matrix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: s.split(","), default=["1b", "8b"],
                    help="synthetic size classes: " + ", ".join(SIZES))
    ap.add_argument("--profiles", type=lambda s: s.split(","), default=None,
                    help="loopback, " + ", ".join(p for p in PROFILES if p != "unshaped") + ", mix "
                         "(for each of --sizes)")
    ap.add_argument("--full", action="store_true", help="docs/benchmarks.md's whole matrix (about 30 minutes)")
    ap.add_argument("--islands", type=int, default=2, help="islands per fleet (mix: one more, on poor)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of H steps (streamed: P times as many)")
    ap.add_argument("--fragments", type=lambda s: [int(x) for x in s.split(",") if x], default=[4],
                    help="also run each shaped fleet streamed in these numbers of parts (--fragments; '' for none)")
    ap.add_argument("--pipeline", type=lambda s: [int(x) for x in s.split(",") if x], default=[2],
                    help="also run each streamed fleet with these --pipeline depths (at most its parts; '' for none)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each shaped fleet with --overlap")
    ap.add_argument("--cases", type=lambda s: [x.strip() for x in s.split(";") if x.strip()], default=[],
                    help="run only the fleets whose names contain one of these (;-separated)")
    ap.add_argument("--real", action=argparse.BooleanOptionalAction, default=True, help="SmolLM2-135M fleets")
    ap.add_argument("--real-profiles", type=lambda s: s.split(","), default=["loopback", "home", "poor"])
    ap.add_argument("--real-steps", type=int, default=4, help="inner steps of a SmolLM2 round")
    a = ap.parse_args()
    known = {"loopback", "mix", *PROFILES}
    for bad in [s for s in a.sizes if s not in SIZES] + [p for p in (a.profiles or []) + a.real_profiles
                                                         if p not in known]:
        ap.error(f"no size class or profile {bad!r}: sizes {', '.join(SIZES)}; profiles {', '.join(sorted(known))}")
    if a.profiles is not None:
        matrix = cases_from(a)
    elif a.full:
        matrix = full_matrix(a)
    else:  # a few minutes: loopback against home and the mix, 1B-class and SmolLM2
        n = a.islands
        matrix = [Case("1b", ("loopback",) * n), Case("1b", ("home",) * n), Case("1b", ("poor",) + ("region",) * n)]
        if a.real:
            matrix += [Case("smollm2", ("loopback",) * n), Case("smollm2", ("home",) * n)]
    if a.cases:
        matrix = [c for c in matrix if any(x in c.name for x in a.cases)]
    load = os.getloadavg()
    ceiling = proxy_ceiling()
    print(f"wan: {os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; proxy ceiling "
          f"(one unshaped connection): {ceiling:.0f} Mbit/s", flush=True)
    for size in a.sizes:
        s = SIZES[size]
        v = values(lora_shapes(s.alias, s.r))
        print(f"  {size}: {s.alias} LoRA r={s.r} all linears: {v / 1e6:.1f}M values ({v / 2e6:.1f} MB at 4 bits); "
              f"round = {s.inner_steps} steps x {s.step_s:g} s", flush=True)
    done = []
    for case in matrix:
        c = run_case(case, a.rounds, a.real_steps)
        done.append(c)
        util = " / ".join(f"{100 * x['utilization']:.1f}%" for x in c["islands"])
        print(f"  {c['case']:28s} round {fmt(c['round_s'])} s, utilization {util}, false drops {c['false_drops']}, "
              f"wall {c['wall_s']:.0f} s ({c['dir']})", flush=True)
    print(f"\nload average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(table(done))
    if any(c["false_drops"] for c in done):
        sys.exit(1)


if __name__ == "__main__":
    main()
