"""`yeto syncer`'s flags: the everyday ones, then the merge and timing knobs in the Advanced panel."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from yeto.cli.test_hooks import CHECKPOINT, crash_hook
from yeto.cli.config_file import with_config_file
from yeto.cli.usage import OldSpelling, run_name_help, with_help_panels, with_old_spellings
from yeto.models.adapter import ADAPTER_WEIGHTS
from yeto.sync.core.config import DEFAULT_MAX_BASE_LAG, OLD_FLAGS, field_flag
from yeto.sync.core.syncer import SyncerConfig
from yeto.sync.merge.rules import rules_help
from yeto.sync.shell.server import Syncer
from yeto.report.trackers import check_installed, open_trackers, parse_report_to, report_to_help, run_group

_D = SyncerConfig()
# renamed flags, still accepted (hidden); `yeto launch` routes them to the syncer by core.config.OLD_FLAGS
OLD_CONVERSIONS: dict[str, Callable[[Any], Any]] = {"--grace-ms": lambda ms: ms / 1000.0,
                                                    "--no-learner-keys": lambda given: not given}  # old spelling
OLD_SPELLINGS = tuple(OldSpelling(flag, field, OLD_CONVERSIONS.get(flag, lambda value: value))
                      for flag, field in OLD_FLAGS.items())


def syncer_command(
    port: Annotated[int, typer.Option(help="TCP port to listen on.")] = _D.port,
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0: all; 127.0.0.1: this machine only).")
                    ] = _D.host,
    islands: Annotated[int, typer.Option(help="Round 1 waits for this many islands (or for --quorum of them plus "
                                               "--straggler-timeout).")] = _D.islands,
    quorum: Annotated[int, typer.Option(help="Never merge a round with fewer responders than this.")] = _D.quorum,
    outer_lr: Annotated[float, typer.Option(help="Outer (DiLoCo) learning rate (1 with momentum 0: the merged "
                                                 "adapter is the merge of the islands').")] = _D.outer_lr,
    outer_momentum: Annotated[float, typer.Option(help="Outer Nesterov momentum (DiLoCo's pre-training setting: "
                                                       "--outer-lr 0.7 --outer-momentum 0.9).")] = _D.outer_momentum,
    outer_steps: Annotated[int, typer.Option(help="Merges to run; then every island is told to finish.")
                           ] = _D.outer_steps,
    inner_steps: Annotated[int, typer.Option(help="Round policy: every island does H inner steps per round.")
                           ] = _D.inner_steps,
    round_seconds: Annotated[float, typer.Option(help="Round policy: time windows of S seconds; each island "
                                                      "contributes what it did (overrides --inner-steps).")
                             ] = _D.round_seconds,
    sync_bits: Annotated[int, typer.Option(help="Wire precision of the islands' deltas: 2, 4, 8, 16 or 32 (below 32 "
                                                "with error feedback; 2 bits: docs/benchmarks.md).")] = _D.sync_bits,
    broadcast_bits: Annotated[Optional[int], typer.Option(
        help="Wire precision of the syncer's broadcasts of the merged change (with its own error feedback): 2, 4, 8, "
             "16 or 32. Default: --sync-bits.")] = None,
    out: Annotated[str, typer.Option(help="Directory for the tape, the checkpoint, saved deltas and the merged "
                                          "adapter; restarting with the same --out resumes the run.")] = _D.out,
    straggler_timeout: Annotated[float, typer.Option(help="Once quorum is reached, wait at most this long for the "
                                                          "remaining islands.")] = _D.straggler_timeout,
    quorum_timeout: Annotated[float, typer.Option(help="Give up (exit 3) if a round has not reached quorum after this "
                                                       "many seconds.")] = _D.quorum_timeout,
    island_timeout: Annotated[float, typer.Option(help="An island silent this long is gone (islands ping 4 times "
                                                        "per timeout, from their I/O thread).")] = _D.island_timeout,
    max_message_mb: Annotated[int, typer.Option(help="Largest inbound message (MiB); an island whose deltas cannot fit "
                                                     "is refused at join.")] = _D.max_message_mb,
    robust: Annotated[str, typer.Option(help="Robust merge against a bad or hostile island: norm-clip (clip a delta "
                                             "above --robust-k x the median norm), trimmed-mean, or off.")
                      ] = _D.robust,
    robust_k: Annotated[float, typer.Option(help="norm-clip: clip deltas whose norm exceeds k x the median.")
                        ] = _D.robust_k,
    merge: Annotated[Optional[str], typer.Option(
        help=f"How deltas combine: {rules_help()}. Unset on a resume: the run's own rule.")] = None,
    merge_weight: Annotated[str, typer.Option(help="Weights of the merge: loss-tokens, tokens, steps or equal.")
                            ] = _D.merge_weight,
    lora_merge: Annotated[str, typer.Option(help="LoRA aggregation: factors (lora_A and lora_B apart) or product "
                                                 "(the mean of the B.A updates, re-factorised to rank r).")
                          ] = _D.lora_merge,
    grace_s: Annotated[float, typer.Option(field_flag("grace_s"), help="Once quorum is in, wait at most this many "
                                           "seconds (less the merge time) for islands predicted, from their step "
                                           "times, to push by then.")] = _D.grace_s,
    max_base_lag: Annotated[Optional[int], typer.Option(
        help=f"Merge a delta trained from a global up to this many versions old (a slow island's work is not thrown "
             f"away; 0: refuse them). Default {DEFAULT_MAX_BASE_LAG}; 0 with --fragments.")] = None,
    fragments: Annotated[int, typer.Option(help="Stream the adapter in this many parts, one part merged and "
                                                "broadcast per round (each part syncs every P rounds: 1/P of the "
                                                "bytes per round). 1: the whole adapter every round.")
                         ] = _D.fragments,
    pipeline: Annotated[int, typer.Option(help="With --fragments: islands may push the next rounds' parts before "
                                               "this round's merge comes, up to this many deltas in flight (their "
                                               "upload overlaps training). 1: wait for each merge.")] = _D.pipeline,
    staleness_exponent: Annotated[float, typer.Option(help="A delta lag versions old weighs (1 + lag)^-this "
                                                           "(0: no discount).")] = _D.staleness_exponent,
    step_normalize: Annotated[Optional[bool], typer.Option(
        help="Scale each delta by the round's most inner steps / its own before merging: a slow island's shorter "
             "delta adds to the others' progress instead of shrinking it. Unset: on with --round-seconds (and the "
             "mean rule), off otherwise; on a resume, the run's own.")] = None,
    merge_alpha: Annotated[float, typer.Option(help="Islands start each round from alpha x the merged adapter + "
                                                    "(1 - alpha) x their own last one (1: the merged adapter).")
                           ] = _D.merge_alpha,
    model: Annotated[Optional[str], typer.Option(help="Pin the run's base model (alias or hub id as islands report "
                                                      "it); default: the first island's.")] = None,
    model_revision: Annotated[Optional[str], typer.Option(help="Pin the base model's resolved revision (commit or "
                                                               "sha256:...); default: the first island's.")] = None,
    max_islands: Annotated[int, typer.Option(help="Most island ids held at once.")] = _D.max_islands,
    init_adapter: Annotated[Optional[str], typer.Option(
        help="Start the run from this peft adapter (a directory, a run directory holding adapter/, or a hub id) "
             "instead of the founding island's fresh LoRA; islands of another base or LoRA shape are refused."
    )] = None,
    max_connections: Annotated[int, typer.Option(help="Most connections that proved a key (two per island); more "
                                                      "are asked to retry at the handshake.")] = _D.max_connections,
    join_key: Annotated[Optional[str], typer.Option(help="Admit islands holding this join key file (default: the "
                                                         "run's own, created as DIR/join.key on first start).")
                        ] = None,
    insecure: Annotated[bool, typer.Option(help="No encryption, no authentication: only with --host 127.0.0.1.")
                        ] = False,
    island_keys: Annotated[bool, typer.Option(help="On the run's first start, issue each expected island id a key "
                                                    "of its own (DIR/keys/islands/<id>.key: copy key i to island i; "
                                                    "trusted, weighs by its tokens); the join key then admits ids "
                                                    "beyond --islands only. --no-island-keys: every island may "
                                                    "share join.key (bounded, and any holder of it can take an "
                                                    "expected id first).")] = _D.island_keys,
    report_to: Annotated[str, typer.Option(help=report_to_help("every merge"))] = "none",
    run_name: Annotated[str, typer.Option(help=run_name_help("the name of --out's parent directory"))] = "",
) -> None:
    """Run the syncer: wait for islands, run outer rounds, merge, broadcast, checkpoint."""
    cfg = SyncerConfig(**{k: v for k, v in locals().items() if k in SyncerConfig.__dataclass_fields__})
    check_installed(parse_report_to(report_to))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s syncer %(levelname)s %(message)s", datefmt="%H:%M:%S")
    syncer = Syncer(cfg, before_checkpoint=crash_hook(CHECKPOINT))
    group = run_group(run_name, Path(cfg.out).resolve().parent)
    trackers = open_trackers(report_to, cfg.out, f"{group}-syncer", group, {}, logging.getLogger("yeto.syncer").warning)
    if trackers is not None:
        syncer.report_to(trackers)
    code = syncer.serve()
    if syncer.disk_failure is not None:
        typer.echo(f"error: {syncer.disk_failure}", err=True)
        raise typer.Exit(code)
    adapter = Path(cfg.out) / "adapter"
    merged = f"merged adapter {adapter}" if (adapter / ADAPTER_WEIGHTS).is_file() else "no merge yet, so no adapter"
    print(f"syncer: {merged}, tape {Path(cfg.out) / 'tape.jsonl'}", flush=True)
    raise typer.Exit(code)


with_help_panels(syncer_command, advanced=(
    "broadcast_bits", "outer_lr", "outer_momentum", "straggler_timeout", "quorum_timeout", "island_timeout",
    "max_message_mb", "robust", "robust_k", "merge", "merge_weight", "lora_merge", "grace_s", "max_base_lag",
    "staleness_exponent", "step_normalize", "merge_alpha", "fragments", "pipeline", "max_islands", "max_connections",
    "run_name"))
syncer_command = with_old_spellings(with_config_file(syncer_command), OLD_SPELLINGS)
