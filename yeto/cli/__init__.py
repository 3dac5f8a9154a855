"""The `yeto` command: train, syncer, launch, shape, data, eval, keys, tape, dashboard, generate, export, models."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

from yeto import YetoError
from yeto.cli.usage import (ADAPTER_HELP, BASE_MODEL_HELP, BASE_REVISION_HELP, JSON_HELP, RUNTIME_HELP, OldSpelling,
                            run_guarded, runtime, trust_remote_code_help, with_old_spellings)

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="LoRA fine-tuning across independent islands, DiLoCo-style.")


def _register() -> None:
    from yeto.cli.config_file import with_config_file
    from yeto.cli.data_command import data_app
    from yeto.cli.eval_command import eval_command
    from yeto.cli.launch_command import (LAUNCH_OLD_SPELLINGS, down_command, launch_command, launch_passes_on,
                                         logs_command, status_command)
    from yeto.cli.shape_command import shape_command
    from yeto.cli.syncer_command import syncer_command
    from yeto.cli.train_command import train_command

    app.command("train")(train_command())  # (--backend torch without torch, or mlx without MLX: one line, exit 2)
    app.command("syncer")(syncer_command)
    launch = with_old_spellings(with_config_file(launch_command, launch_passes_on), LAUNCH_OLD_SPELLINGS)
    app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(launch)
    app.command("status")(status_command)
    app.command("logs")(with_old_spellings(logs_command, ISLAND_OLD_SPELLING))
    app.command("down")(down_command)
    app.command("shape")(shape_command)
    app.command("eval")(eval_command)
    app.add_typer(data_app, name="data")  # `yeto data inspect` (a group: other data commands join it)


keys_app = typer.Typer(no_args_is_help=True, help="The run's credentials (docs/SECURITY.md): the syncer's key pair, "
                                                   "the shared join key, and per-island keys that can be revoked.")
app.add_typer(keys_app, name="keys")
OutOption = Annotated[str, typer.Option(help="The syncer's --out directory (its credentials live there), or the "
                                             "launch's --out (its syncer/ is used).")]
CreateOption = Annotated[bool, typer.Option(help="Start a new run's credentials in --out if it holds none (without "
                                                 "it such an --out is refused: the syncer would never read them).")]


def keyring_out(out: str, create: bool = False, changes: bool = True) -> Path:
    """The syncer's --out that `yeto keys` works on: `out`, or a launch's syncer/. One holding no keyring is refused
    unless `create` (a typo or the wrong directory would get a second keyring that no running syncer reads), as is
    a change to a cloud launch's copies (its syncer reads those on its head VM)."""
    from yeto.launch.registry import SYNCER_DIR, run_dirs
    from yeto.launch.tasks import HEAD_RUN_DIR
    from yeto.sync.shell.keys import has_keyring

    path = Path(out).expanduser()
    found = run_dirs(path) if path.is_dir() else None
    if found is not None and found.cloud and changes:
        raise YetoError(f"{path} is a cloud launch's: its syncer reads the keys on its head VM, not these copies; run "
                        f"the command there (ssh HEAD python3 -m yeto keys ... --out {HEAD_RUN_DIR}/{SYNCER_DIR}; "
                        "`yeto status NAME` names the head cluster)")
    if found is not None and found.what == "launch" and found.syncer is not None:
        path = found.syncer
    if create or has_keyring(path):
        return path
    if found is not None and found.what == "island":
        beside = f"; its syncer's is {found.syncer}" if found.syncer is not None else ""
        raise YetoError(f"--out {path} is an island's --out, not a syncer's (no keyring there{beside}): pass the "
                        "syncer's --out or the launch's")
    what = "does not exist" if not path.exists() else "holds no syncer keyring (no keys/syncer.key_secret)"
    raise YetoError(f"--out {path} {what}: pass the syncer's --out or the launch's, or --create to start a new "
                    "run's credentials there")


@keys_app.command("init")
def keys_init(out: OutOption) -> None:
    """Create the run's credentials before the syncer's first start (the syncer does it itself otherwise)."""
    from yeto.sync.shell.keys import JOIN_KEY_FILE, Keyring

    out = keyring_out(out, create=True)
    Keyring.ensure(out)
    typer.echo(f"join key: {out}/{JOIN_KEY_FILE} (mode 0600; give it to islands with --join-key or YETO_JOIN_KEY; "
               "the syncer's first start issues each expected island id a key of its own, keys/islands/<id>.key, "
               "and the join key then admits the ids beyond --islands: see --no-island-keys)")


ISLAND_OLD_SPELLING = (OldSpelling("--learner", "island"),)  # old spelling: `yeto keys add/revoke`, `yeto logs`


def keys_add(out: OutOption, island: Annotated[int, typer.Option(help="The island id this key admits.")],
             create: CreateOption = False) -> None:
    """Issue a key that admits one island id only (and that `revoke` can withdraw); the running syncer picks it
    up within seconds (this waits to say so). From then on island I must use it: the shared join key no longer
    speaks for I."""
    from yeto.sync.shell.keys import Keyring, syncer_pickup, tape_size

    syncer_out = keyring_out(out, create)
    since = tape_size(syncer_out)
    path = Keyring.ensure(syncer_out).add_island(island)
    typer.echo(f"island {island}'s key: {path} (start it with --join-key {path.name} or YETO_JOIN_KEY)")
    typer.echo(syncer_pickup(syncer_out, since, lambda e: island in e.get("islands", [])))


def keys_revoke(out: OutOption, island: Annotated[int, typer.Option(help="The island id whose key to revoke.")]
                ) -> None:
    """Withdraw an island's key: the running syncer refuses its handshakes and cuts its connections (this waits
    to say it did)."""
    from yeto.sync.shell.keys import Keyring, syncer_pickup, tape_size

    syncer_out = keyring_out(out)
    since = tape_size(syncer_out)
    path = Keyring.ensure(syncer_out).revoke_island(island)
    typer.echo(f"revoked island {island}'s key (kept as {path})")
    typer.echo(syncer_pickup(syncer_out, since, lambda e: island in e.get("revoked", [])))


keys_app.command("add")(with_old_spellings(keys_add, ISLAND_OLD_SPELLING))
keys_app.command("revoke")(with_old_spellings(keys_revoke, ISLAND_OLD_SPELLING))


@keys_app.command("list")
def keys_list(out: OutOption) -> None:
    """The island keys of the run, and the revoked ones."""
    from yeto.sync.shell.keys import JOIN_KEY_FILE, Keyring

    syncer_out = keyring_out(out, changes=False)
    ring = Keyring.ensure(syncer_out)
    typer.echo(f"join key: {syncer_out}/{JOIN_KEY_FILE} (any island id without its own key)")
    for public, lid in sorted(ring.islands.items(), key=lambda kv: kv[1]):
        typer.echo(f"island {lid}: key {public.decode()[:8]}...")
    for lid in sorted(ring.revoked_ids):
        typer.echo(f"island {lid}: revoked")


@app.command()
def tape(
    run_dir: Annotated[str, typer.Argument(help="The run: a launch's --out, the syncer's --out (or its tape.jsonl), "
                                                "or a launched run's name.")],
    plot: Annotated[bool, typer.Option(help="Also draw loss and per-island contribution over rounds to a PNG.")
                    ] = False,
    png: Annotated[Optional[str], typer.Option(help="Where to write the plot (default: RUN_DIR/tape.png).")] = None,
    audit: Annotated[bool, typer.Option(help="Prove from the tape that every accepted delta went into exactly one "
                                             "merge, every merge had quorum, versions are consecutive and every "
                                             "restart resumed at the last durable checkpoint; exit 1 naming the first "
                                             "violation.")] = False,
) -> None:
    """Summarize a syncer's event tape: a table per round (responders, weights, tokens, bytes, loss)."""
    from yeto.launch.registry import run_tape
    from yeto.sync.shell.tape import plot as plot_tape
    from yeto.sync.shell.tape import summarize

    run_dir = run_tape(run_dir)
    if audit:
        from yeto.sync.shell.audit import audit_run

        report = audit_run(run_dir)
        typer.secho(report.summary(), fg="green" if report.ok else "red")
        if not report.ok:
            raise typer.Exit(1)
        return
    summarize(run_dir)
    if plot or png:
        typer.echo(f"plot: {plot_tape(run_dir, png)}")


@app.command()
def dashboard(
    run: Annotated[str, typer.Argument(help="A run directory (yeto launch --out, a syncer's --out, or a standalone "
                                            "yeto train's --out), or a launched run's name (yeto status lists "
                                            "them).")],
    port: Annotated[int, typer.Option(help="Loopback port for the page (0: a free one, printed).")] = 0,
    export: Annotated[Optional[str], typer.Option("--export", help="Write the page as one self-contained HTML file "
                                                                   "(opens with no network) and exit.")] = None,
) -> None:
    """Watch a run in a browser, live or finished, local or cloud: the fleet, loss curves, where each round's time
    goes, bytes, staleness and clips, alerts (and for cloud runs the cost). It only reads the run's files."""
    from yeto.watch.dashboard import export as export_html
    from yeto.watch.dashboard import open_run, serve

    source = open_run(run)
    if export:
        typer.echo(f"dashboard written: {export_html(source, export)}")
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (started in a script's background it inherits SIGINT
    # ignored, and Ctrl-C or a SIGINT would not stop it)
    try:
        serve(source, port, ready=lambda url: typer.echo(f"dashboard: {url}  (Ctrl-C stops it)"))
    except KeyboardInterrupt:
        pass


@app.command()
def generate(
    prompt: Annotated[list[str], typer.Option(help="A prompt to answer (repeat for several).")],
    adapter: Annotated[str, typer.Option(help=ADAPTER_HELP)],
    model: Annotated[Optional[str], typer.Option(help=BASE_MODEL_HELP)] = None,
    model_revision: Annotated[Optional[str], typer.Option(help=BASE_REVISION_HELP)] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per answer (greedy).")] = 64,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps (MLX: auto or cpu).")] = "auto",
    trust_remote_code: Annotated[bool, typer.Option(help=trust_remote_code_help())] = False,
    backend: Annotated[str, typer.Option(help=RUNTIME_HELP)] = "auto",
) -> None:
    """Show the fine-tuned model's answers next to the base model's (greedy decoding)."""
    from rich.console import Console
    from rich.table import Table

    from yeto.launch.registry import run_adapter

    if runtime(backend, "yeto generate") == "mlx":
        from yeto.backends.mlx.generate import compare
    else:
        from yeto.backends.torch.generate import compare

    adapter = run_adapter(adapter)
    rows = compare(model, adapter, prompt, max_new_tokens, model_revision, device, trust_remote_code)
    table = Table(title=f"{model or 'its recorded base'}: base vs adapter {adapter}", show_lines=True)
    table.add_column("prompt", style="bold")
    table.add_column("base")
    table.add_column("with adapter", style="green")
    for p, before, after in rows:
        table.add_row(p, before, after)
    Console().print(table)


@app.command()
def export(
    adapter: Annotated[str, typer.Argument(help=ADAPTER_HELP)],
    merged: Annotated[str, typer.Option(help="Where to write the base with the adapter merged in (a new directory).")],
    model: Annotated[Optional[str], typer.Option(help=BASE_MODEL_HELP)] = None,
    model_revision: Annotated[Optional[str], typer.Option(help=BASE_REVISION_HELP)] = None,
    dtype: Annotated[str, typer.Option(help="Weights' dtype: auto (the base model's own, as its config says: "
                                            "bfloat16 for most), float32, bfloat16 or float16.")] = "auto",
    force: Annotated[bool, typer.Option(help="Replace a non-empty --merged directory.")] = False,
    trust_remote_code: Annotated[bool, typer.Option(help=trust_remote_code_help())] = False,
    backend: Annotated[str, typer.Option(help=RUNTIME_HELP)] = "auto",
) -> None:
    """Write the base model with the adapter merged in: a plain transformers checkpoint (safetensors, config,
    tokenizer, chat template) for AutoModelForCausalLM, vLLM or llama.cpp's converter (on MLX: mlx-lm's fuse)."""
    from yeto.launch.registry import run_adapter

    if runtime(backend, "yeto export") == "mlx":
        from yeto.backends.mlx.export import export_merged
    else:
        from yeto.backends.torch.export import export_merged

    adapter = run_adapter(adapter)
    export_merged(adapter, merged, model, model_revision, dtype, force, trust_remote_code, log=typer.echo)


@app.command()
def models(
    model: Annotated[Optional[str], typer.Option(help="Size this alias, local model directory or hub id in this "
                                                      "machine's Hugging Face cache (its config.json, built on the "
                                                      "meta device: no weights read) instead of listing aliases.")
                     ] = None,
    json_out: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    trust_remote_code: Annotated[bool, typer.Option(help=trust_remote_code_help(" (with --model)"))] = False,
) -> None:
    """The model catalog: each alias's hub id, architecture, parameters (counted from its config: total, and active
    for MoE), context, license, whether its repo's code must run, and whether the MLX island can train it."""
    import json

    from rich.console import Console
    from rich.table import Table

    from yeto.backends.mlx.compat import mlx_implements
    from yeto.models.catalog import CATALOG, human, row, sized_row
    from yeto.launch.sizing import MIN_SHAPE_TERMS, island_row

    if model is not None:
        rows = [sized_row(model, trust_remote_code)]
    else:
        rows = [row(name, e) for name, e in CATALOG.items()]
    mlx = {r["architecture"]: mlx_implements(r["architecture"]) for r in rows if r["architecture"] != "?"}
    for r in rows:
        r["mlx"] = mlx.get(r["architecture"])
        r["min_shape"] = island_row(r["alias"] if model is None else model, trust_remote_code)
    if json_out:
        typer.echo(json.dumps(rows, indent=1))
        return
    table = Table(title=f"{len(rows)} models (parameters counted from each config.json on the meta device)")
    for col in ("alias", "hub id", "class", "total", "active", "context", "license", "remote code", "MLX",
                "min island"):
        table.add_column(col, justify="right" if col in ("total", "active", "context") else "left")
    marks = {True: "yes", False: "no (torch only)", None: "?"}
    for r in rows:
        table.add_row(r["alias"], r["hub_id"] or "-", r["architecture"], human(r["total_params"]),
                      human(r["active_params"]), str(r["context"] or "?"), r["license"] or "?",
                      "yes" if r["trust_remote_code"] else "no", marks[r["mlx"]],
                      r["min_shape"]["label"] if r["min_shape"] else "?")
    Console(width=220).print(table)
    typer.echo("min island: the GPUs with the least memory in all that train it "
               f"(yeto.launch.sizing: {MIN_SHAPE_TERMS})")
    if model is None and any(r["total_params"] is None for r in rows):
        typer.echo("?: the published config is not known offline; size a download with yeto models --model DIR")


def main() -> None:
    _register()
    run_guarded(app)


if __name__ == "__main__":
    main()
