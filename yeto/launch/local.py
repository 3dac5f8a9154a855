"""`yeto launch --gpu local:N`: this machine is the head; a syncer and N island processes run here.

Every process is a real `python -m ...` child talking ZeroMQ, exactly as a WAN fleet would; their output is
streamed with a prefix per process and kept in <out>/logs/, and Ctrl-C (or `yeto down`) stops them all cleanly
(SIGINT, then SIGTERM, then SIGKILL). Reserved slots (--external-islands) get join scripts for other machines.
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

from yeto import YetoError, require_torch
from yeto.backends import MLX, TORCH
from yeto.launch.controller import USAGE_EXIT
from yeto.launch.join import join_instructions, write_join_files
from yeto.launch.output import deliver
from yeto.launch.plan import FleetPlan
from yeto.launch.registry import RunRecord, process_start
from yeto.launch.rundir import LOGS_DIR, SYNCER_DIR, island_dir, prepare_run_dir
from yeto.launch.tasks import island_argv, island_exit, syncer_argv
from yeto.sync.shell.keys import JOIN_KEY_ENV, Keyring
from yeto.sync.shell.given_up import give_up

LOOPBACK = "127.0.0.1"
LOOPBACK_NAMES = (LOOPBACK, "localhost", "::1")
STOP_GRACE_S = 15.0  # per signal (SIGINT, SIGTERM, SIGKILL) when stopping the fleet
SYNCER_HEAD_START_S = 0.5  # islands retry anyway; this only keeps their first lines quiet
WATCH_POLL_S = 0.2  # how often the launcher checks its children: a dead syncer stops the fleet within it
COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_host(public_host: str) -> str:
    """Where the local syncer listens: loopback for a loopback --public-host, else everywhere (a name others
    reach)."""
    return LOOPBACK if public_host in LOOPBACK_NAMES else "0.0.0.0"


def check_port_free(port: int, public_host: str = LOOPBACK) -> None:
    """A --port another process holds, refused before the fleet starts (else the syncer exits 2 after the islands
    started); port 0 picks a free one as the fleet starts."""
    if not port:
        return
    host = bind_host(public_host)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: a port in TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise YetoError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}): another process holds "
                            "it; pick another --port, or leave --port out for a free one") from e


def _stream(proc: subprocess.Popen, prefix: str, color: str, console, lock: threading.Lock, log: Path) -> None:
    """Print a child's lines with its prefix, and keep them in its log file (for `yeto logs`)."""
    with open(log, "a", buffering=1) as f:
        for line in iter(proc.stdout.readline, ""):
            f.write(line)
            with lock:
                console.print(f"[{color}]{prefix}[/{color}] {line.rstrip()}", highlight=False, markup=True,
                              soft_wrap=True)


def launch_local(plan: FleetPlan, public_host: str = LOOPBACK, grace_s: float = STOP_GRACE_S,
                 fresh: bool = False) -> int:
    """Run the fleet with this machine as the head; the last `plan.mlx` local islands run `yeto train --backend mlx`
    (the others `--backend torch`), and `plan.external` reserved slots wait for machines that run their printed join
    command. A run already in `plan.out` goes on (`fresh`: starts over; `yeto.launch.rundir`)."""
    from rich.console import Console
    from rich.markup import escape

    n_local = len(plan.islands)
    if n_local > plan.mlx:  # before the syncer starts: a torch island would die at its first import
        require_torch(f"yeto launch local:{n_local} (its {n_local - plan.mlx} torch island(s); --mlx-islands "
                      f"{n_local} runs them all on MLX)")
    console = Console(force_terminal=None)
    out = Path(plan.out)
    prepare_run_dir(out, list(range(n_local)), fresh)
    port = plan.port or free_port()
    syncer_at = f"{public_host}:{port}"
    bind = bind_host(public_host)
    out.mkdir(parents=True, exist_ok=True)
    (out / LOGS_DIR).mkdir(exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // n_local)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), COLUMNS=os.environ.get("COLUMNS", "160"))
    procs: list[tuple[str, subprocess.Popen]] = []
    streams: list[threading.Thread] = []
    lock = threading.Lock()
    record = RunRecord(plan.name, "local", str(out.resolve()), syncer_at, external=plan.external_ids,
                       launcher_pid=os.getpid(), started={str(os.getpid()): process_start(os.getpid())})

    def start(name: str, cmd: list[str], color: str, extra_env: dict[str, str] | None = None) -> None:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**env, **(extra_env or {})}, bufsize=1)
        procs.append((name, p))
        log = out / LOGS_DIR / f"{name}.log"
        record.processes[name], record.logs[name] = p.pid, str(log.resolve())
        record.started[str(p.pid)] = process_start(p.pid)
        streams.append(threading.Thread(target=_stream, args=(p, escape(f"[{name}]"), color, console, lock, log),
                                        daemon=True))
        streams[-1].start()

    syncer_out = out / SYNCER_DIR
    keys = Keyring.ensure(syncer_out)  # the run's credentials, before anyone starts (the syncer reuses them)
    # each island on a key of its own (trusted: it weighs by its tokens), in the environment, never on a command line
    own_keys = {i: keys.own_key(i).text() for i in range(n_local)}
    start("syncer", syncer_argv(plan, bind, port, syncer_out, sys.executable), "bold white")
    time.sleep(SYNCER_HEAD_START_S)
    for i in range(n_local):
        mlx = i >= n_local - plan.mlx
        cmd = island_argv(plan, i, f"127.0.0.1:{port}", plan.data, plan.model, MLX if mlx else TORCH, sys.executable)
        # (an MLX island's BLAS takes OMP_NUM_THREADS from the environment; its --threads needs OpenBLAS preloaded)
        start(f"island-{i}{'-mlx' if mlx else ''}",
              [*cmd, *([] if mlx else ["--threads", str(threads)]), "--out", str(island_dir(out, i)), "--no-progress"],
              COLORS[i % len(COLORS)], {JOIN_KEY_ENV: own_keys[i]})
    record.save()
    console.print(f"[bold]fleet {plan.name}[/bold]: syncer on {syncer_at}, {n_local} local islands x {threads} "
                  f"threads; run dir {out}")
    if plan.external:
        scripts = write_join_files(plan, keys, syncer_at, out)
        with lock:
            print(join_instructions(plan, scripts), flush=True)
            if bind == LOOPBACK:
                console.print(f"[yellow]the join scripts point at {public_host}: only this machine can run them; "
                              "pass --public-host with this machine's address for others[/yellow]")
    try:
        return _watch(procs, streams, plan, syncer_out, console, grace_s)
    finally:
        record.state = "ended"
        record.save()


def _watch(procs: list[tuple[str, subprocess.Popen]], streams: list[threading.Thread], plan: FleetPlan,
           syncer_out: Path, console, grace_s: float) -> int:
    """Wait for the fleet; stop it on Ctrl-C (SIGINT, as `yeto down` sends) or when the syncer fails."""
    if threading.current_thread() is threading.main_thread():  # a launch started in the background of a script
        signal.signal(signal.SIGINT, signal.default_int_handler)  # inherits SIGINT ignored: `yeto down` must stop it
    given_up: set[int] = set()
    try:
        while any(p.poll() is None for _, p in procs):
            time.sleep(WATCH_POLL_S)
            syncer = procs[0][1]
            if syncer.poll() is not None and syncer.returncode != 0:
                raise RuntimeError(f"syncer exited with {syncer.returncode}")
            for lid, (name, p) in enumerate(procs[1:]):  # (island i is the i-th process after the syncer)
                if p.poll() == USAGE_EXIT and lid not in given_up and syncer.poll() is None:
                    given_up.add(lid)
                    streams[1 + lid].join(timeout=5)  # its last lines are in its log
                    reason = _given_up_reason(syncer_out.parent / LOGS_DIR / f"{name}.log")
                    give_up(syncer_out, lid, reason)  # the syncer lowers its quorum: the run goes on without it
                    console.print(f"{name} given up: {reason}", style="red", markup=False, highlight=False)
            islands_failed = [(nm, p.returncode) for nm, p in procs[1:] if p.poll() not in (None, 0)]
            if islands_failed and all(p.poll() is not None for _, p in procs[1:]) and not plan.external:
                raise RuntimeError(f"every island exited; failures: {islands_failed}")
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
    if ok and plan.output:
        console.print(f"output:         {deliver(syncer_out, plan.output)}")
    return 0 if ok else 1


def _given_up_reason(log: Path) -> str:
    """Why a local island that exited with a usage error is not coming back: its last error line."""
    error = island_exit(log.read_text(errors="replace") if log.is_file() else "").error
    return f"island exited {USAGE_EXIT} (the same command would fail the same way): {error or 'see its log'}"


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
