"""`yeto launch --gpu local:N`: a syncer and N learner processes on this machine.

Every process is a real `python -m ...` child talking ZeroMQ over loopback, exactly
as a WAN fleet would; their output is streamed with a prefix per process, and
Ctrl-C stops them all cleanly (SIGINT, then SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from yeto import YetoError
from yeto.sync.auth import JOIN_KEY_ENV, Keyring


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_gpu(spec: str) -> int:
    kind, _, count = spec.partition(":")
    if kind != "local":
        raise YetoError(f"--gpu {spec!r}: only local:N is available in this version (cloud launch through SkyPilot is not built yet)")
    if not count.isdigit() or int(count) < 1:
        raise YetoError(f"--gpu local:N needs a positive N, got {spec!r}")
    return int(count)


def _stream(proc: subprocess.Popen, prefix: str, color: str, console, lock: threading.Lock) -> None:
    for line in iter(proc.stdout.readline, ""):
        with lock:
            console.print(f"[{color}]{prefix}[/{color}] {line.rstrip()}", highlight=False, markup=True, soft_wrap=True)


def launch_local(n: int, out: Path, syncer_args: list[str], learner_args: list[str], port: int = 0,
                 grace_s: float = 15.0, mlx_learners: int = 0) -> int:
    """Run the fleet; the last `mlx_learners` of the n islands use the MLX backend."""
    if not 0 <= mlx_learners <= n:
        raise YetoError(f"--mlx-learners must be between 0 and the number of learners ({n}), got {mlx_learners}")
    from rich.console import Console
    from rich.markup import escape

    console = Console(force_terminal=None)
    port = port or free_port()
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // n)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), COLUMNS=os.environ.get("COLUMNS", "160"))
    procs: list[tuple[str, subprocess.Popen]] = []
    streams: list[threading.Thread] = []
    lock = threading.Lock()
    colors = ["cyan", "magenta", "green", "yellow", "blue", "red"]

    def start(name: str, cmd: list[str], color: str, extra_env: dict[str, str] | None = None) -> None:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**env, **(extra_env or {})}, bufsize=1)
        procs.append((name, p))
        streams.append(threading.Thread(target=_stream, args=(p, escape(f"[{name}]"), color, console, lock), daemon=True))
        streams[-1].start()

    syncer_out = out / "syncer"
    keys = Keyring.ensure(syncer_out)  # the run's credentials, before anyone starts (the syncer reuses them)
    learner_env = {JOIN_KEY_ENV: keys.join.text()}  # the key travels in the environment, never on a command line
    start("syncer", [sys.executable, "-m", "yeto.sync.server", "--host", "127.0.0.1", "--port", str(port),
                     "--learners", str(n), "--out", str(syncer_out), *syncer_args], "bold white")
    time.sleep(0.5)
    for i in range(n):
        mlx = i >= n - mlx_learners
        start(f"island {i}{' mlx' if mlx else ''}", [sys.executable, "-m", "yeto.mlx.learner" if mlx else "yeto.learner", "--syncer", f"127.0.0.1:{port}", "--learner-id", str(i),
                              "--num-learners", str(n), "--threads", str(threads), "--out", str(out / f"island-{i}"),
                              "--no-progress", *learner_args], colors[i % len(colors)], learner_env)
    console.print(f"[bold]fleet[/bold]: syncer on 127.0.0.1:{port}, {n} islands x {threads} threads; run dir {out}")
    try:
        while any(p.poll() is None for _, p in procs):
            time.sleep(0.2)
            syncer = procs[0][1]
            if syncer.poll() is not None and syncer.returncode != 0:
                raise RuntimeError(f"syncer exited with {syncer.returncode}")
            learners_failed = [(nm, p.returncode) for nm, p in procs[1:] if p.poll() not in (None, 0)]
            if learners_failed and all(p.poll() is not None for _, p in procs[1:]):
                raise RuntimeError(f"every learner exited; failures: {learners_failed}")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the fleet[/yellow]")
        _stop(procs, grace_s)
        return 130
    except RuntimeError as e:
        console.print(f"[red]{e}: stopping the fleet[/red]")
        _stop(procs, grace_s)
        return 1
    codes = {name: p.returncode for name, p in procs}
    for t in streams:  # every child's last lines are printed before the summary
        t.join(timeout=5)
    ok = all(c == 0 for c in codes.values())
    console.print(f"[bold]fleet done[/bold]: exit codes {codes}")
    console.print(f"merged adapter: {syncer_out / 'adapter'}")
    console.print(f"event tape:     {syncer_out / 'tape.jsonl'}  (yeto tape {syncer_out} --plot)")
    return 0 if ok else 1


def _stop(procs: list[tuple[str, subprocess.Popen]], grace_s: float) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for _, p in procs):
            time.sleep(0.1)
        if all(p.poll() is not None for _, p in procs):
            return


def launch_command(
    ctx: typer.Context,
    gpu: Annotated[str, typer.Option(help="Where the learners run: local:N starts N learner processes on this machine.")] = "local:2",
    model: Annotated[str, typer.Option(help="Model alias, local directory or hub id.")] = "smollm2-135m",
    data: Annotated[str, typer.Option(help="Training data (file, directory or hub dataset id).")] = "data/demo",
    out: Annotated[str, typer.Option(help="Run directory: syncer/ (tape, merged adapter) and island-I/ per learner.")] = "runs/fleet",
    port: Annotated[int, typer.Option(help="Syncer port (0: pick a free one).")] = 0,
    outer_steps: Annotated[int, typer.Option(help="Merges to run.")] = 3,
    inner_steps: Annotated[int, typer.Option(help="Inner steps per learner per round.")] = 10,
    round_seconds: Annotated[float, typer.Option(help="Time-window rounds instead of --inner-steps (seconds).")] = 0.0,
    quorum: Annotated[int, typer.Option(help="Responders needed to merge a round (default: all learners).")] = 0,
    sync_bits: Annotated[int, typer.Option(help="Wire precision: 4, 8, 16 or 32.")] = 4,
    outer_lr: Annotated[float, typer.Option(help="Outer learning rate.")] = 0.7,
    outer_momentum: Annotated[float, typer.Option(help="Outer Nesterov momentum.")] = 0.9,
    overlap: Annotated[bool, typer.Option(help="Learners keep training while a merge is in flight.")] = False,
    mlx_learners: Annotated[int, typer.Option(help="How many of the N local learners run the MLX backend (a mixed torch + MLX fleet).")] = 0,
) -> None:
    """Run a DiLoCo fleet. Any other flag (e.g. --seq-len 128 --lr 1e-3) is passed to every learner (see `yeto train --help`)."""
    n = parse_gpu(gpu)
    syncer_args = ["--outer-steps", str(outer_steps), "--inner-steps", str(inner_steps), "--round-seconds", str(round_seconds),
                   "--quorum", str(quorum or n), "--sync-bits", str(sync_bits), "--outer-lr", str(outer_lr),
                   "--outer-momentum", str(outer_momentum)]
    learner_args = ["--model", model, "--data", data, *(["--overlap"] if overlap else []), *ctx.args]
    code = launch_local(n, Path(out), syncer_args, learner_args, port, mlx_learners=mlx_learners)
    raise typer.Exit(code)


