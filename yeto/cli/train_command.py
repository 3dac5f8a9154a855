"""`yeto train`'s flags, one signature for every backend (`make_train_command`), and the command that picks the
backend (`--backend auto|torch|mlx`) and trains through the one entry, `yeto.island.training.train`."""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from yeto import YetoError
from yeto.backends import AUTO, MLX, TORCH, choose_backend, load_backend
from yeto.cli.config_file import current_context, with_config_file
from yeto.cli.test_hooks import HIDDEN_TRAIN_FLAGS, TRAIN_STATE, crash_hook
from yeto.cli.usage import OldSpelling, run_name_help, trust_remote_code_help, with_help_panels, with_old_spellings
from yeto.island.train_config import TrainConfig
from yeto.report.trackers import report_to_help

D = TrainConfig()
# renamed flags, still accepted (hidden)
OLD_SPELLINGS = (OldSpelling("--num-learners", "num_islands"), OldSpelling("--learners", "num_islands"),  # old spelling
                 OldSpelling("--learner-id", "island_id"))  # old spelling
# `yeto train --help` shows these after the everyday flags (their defaults need no touching)
TRAIN_ADVANCED = ("model_revision", "data_revision", "data_split", "data_config", "columns", "warmup_steps",
                  "trust_remote_code", "grad_accum", "lora_freeze_a", "micro_batch_size", "min_lr_ratio",
                  "weight_decay", "max_grad_norm", "lora_dropout", "lora_targets", "loss_function", "eval_fraction",
                  "dtype", "gradient_checkpointing", "full_logits", "overlap", "threads", "max_inner_steps",
                  "syncer_timeout", "give_up_after", "shard", "base_quantization", "save_every", "run_name",
                  "eval_task_limit", "eval_task_max_new_tokens")


TrainFn = Callable[[TrainConfig, bool, str], Any]  # (the flags, show the progress bar, the --backend asked for)
BACKEND_PARAMETER = inspect.Parameter(
    "backend", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=AUTO,
    annotation=Annotated[str, typer.Option(help="The tensor backend: auto (MLX on Apple silicon where the mlx extra is "
                                                "installed, else torch), torch (+ peft; CUDA, MPS, CPU) or mlx "
                                                "(Apple silicon; MLX's CPU backend on Linux).")])
BACKEND_DOCS = {
    None: "Train a LoRA adapter on one island (torch + peft or MLX: --backend): standalone, or with --syncer as part "
          "of a DiLoCo run.",
    TORCH: "Train a LoRA adapter on one torch + peft island (yeto train --backend torch): standalone, or with "
           "--syncer as part of a DiLoCo run.",
    MLX: "Train a LoRA adapter on one MLX island (yeto train --backend mlx; Apple silicon, MLX's CPU backend on "
         "Linux): standalone, or with --syncer as part of a DiLoCo run.",
}


def make_train_command(train_fn: TrainFn, doc: str, backend: Optional[str] = None) -> Callable[..., None]:
    """The `train` command with every flag, for any backend: `train_fn(config, show_progress, backend)` runs it.
    `backend` None: the command takes --backend (auto unless given); else it is that backend's own command."""

    def command(**kwargs: Any) -> None:
        progress = kwargs.pop("progress")
        asked = kwargs.pop("backend", backend)
        kwargs["max_steps"] = D.max_steps if kwargs["max_steps"] is None else kwargs["max_steps"]
        train_fn(TrainConfig(**kwargs), progress, asked)

    wrapper = functools.wraps(_train_signature)(command)
    signature = inspect.signature(_train_signature, eval_str=True)
    if backend is None:
        signature = signature.replace(parameters=[BACKEND_PARAMETER, *signature.parameters.values()])
    wrapper.__signature__ = signature
    with_help_panels(wrapper, advanced=TRAIN_ADVANCED, hidden=HIDDEN_TRAIN_FLAGS)
    wrapper.__doc__ = doc
    return with_old_spellings(with_config_file(wrapper, settle=settle_run_length), OLD_SPELLINGS)


def settle_run_length(values: dict[str, Any]) -> dict[str, Any]:
    """The train command's `values` with one of --max-steps and --epochs, which are one choice: where both are set,
    the one given on the command line wins over a --config file's; both on the command line (or both in the file)
    is a one-line error. Neither: --max-steps's default."""
    max_steps, epochs = values["max_steps"], values["epochs"]
    if max_steps is None or epochs is None:
        return values
    sources = current_context().get_parameter_source
    on_line = {name: sources(name).name == "COMMANDLINE" for name in ("max_steps", "epochs")}
    if on_line["max_steps"] == on_line["epochs"]:
        raise YetoError(f"--max-steps {max_steps} and --epochs {epochs:g} both set the run's length: give one of "
                        "them (--epochs N: N passes over this island's data shard, its steps computed at start)")
    loser = "epochs" if on_line["max_steps"] else "max_steps"
    return {**values, loser: None}


def train_command(backend: Optional[str] = None) -> Callable[..., None]:
    """`yeto train` (backend None: --backend picks it), or `python -m yeto.backends.<backend>` (torchrun's too): the
    same flags and the one entry every backend runs through (`yeto.island.training.train`)."""
    return make_train_command(run_train, BACKEND_DOCS[backend], backend)


def run_train(cfg: TrainConfig, progress: bool, asked: str) -> dict[str, Any]:
    """Train on the backend `asked` names (refused in one line when unknown or not installed)."""
    name = choose_backend(asked)
    if name == MLX and runs_as_yeto():
        from yeto.backends.mlx.compat import reexec_with_fast_blas

        reexec_with_fast_blas()  # (on Linux, once: OpenBLAS preloaded before MLX loads)
    from yeto.island.training import train

    return train(cfg, load_backend(name), progress, before_state_commit=crash_hook(TRAIN_STATE))


def runs_as_yeto() -> bool:
    """Whether this process is the `yeto` command (its script, or python -m yeto): its command line, run again,
    is this training (a process that only calls the command, a test's, is not re-executed)."""
    main = Path(sys.argv[0])
    return main.name == "yeto" or (main.name == "__main__.py" and main.parent.name == "yeto")


def _train_signature(
    model: Annotated[str, typer.Option(help="Model alias (`yeto models`), local HF directory or hub id.")
                     ] = D.model,
    data: Annotated[str, typer.Option(help="A .jsonl/.json/.parquet/.csv/.txt file, a directory, a hub dataset "
                                            "(default: the packaged demo data).")
                    ] = D.data,
    out: Annotated[str, typer.Option(help="Run directory: adapter/, metrics, state.")] = D.out,
    model_revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit) of the model; "
                                                               "resolved to one commit and recorded.")] = None,
    data_revision: Annotated[Optional[str], typer.Option(help="Hub revision of the dataset; "
                                                              "resolved to one commit and recorded.")] = None,
    data_split: Annotated[str, typer.Option(help="Dataset split to train on; the held-out set is the dataset's "
                                                 "validation (else test) split where it has one, else "
                                                 "--eval-fraction of this split.")] = D.data_split,
    data_config: Annotated[Optional[str], typer.Option(help="Dataset config (subset) to read, for a dataset with "
                                                            "several (README `configs` or one subfolder each).")
                           ] = None,
    columns: Annotated[Optional[str], typer.Option(help="A table's columns (CSV, parquet, JSON keys) as record "
                                                        "fields: COLUMN=FIELD,..., e.g. question=prompt,answer="
                                                        "completion (fields: messages, prompt, completion, "
                                                        "instruction, input, output, text).")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help=trust_remote_code_help(" (off unless given)"))] = False,
    seq_len: Annotated[int, typer.Option(help="Tokens per packed block.")] = D.seq_len,
    batch_size: Annotated[int, typer.Option(help="Blocks per batch (per rank under torchrun).")] = D.batch_size,
    grad_accum: Annotated[int, typer.Option(help="Batches per optimizer step (gradient accumulation).")] = D.grad_accum,
    lora_freeze_a: Annotated[bool, typer.Option(help="Train lora_B only; lora_A stays at the run's shared "
                                                     "initialization (FFA-LoRA: the syncer's average of B is then "
                                                     "exact). Every island of a run must agree.")] = False,
    micro_batch_size: Annotated[str, typer.Option(help="Blocks through the model at once: all (the whole batch), N, "
                                                       "or auto (the largest that fits the device, probed at start); "
                                                       "the gradient is the same whatever it is.")
                        ] = D.micro_batch_size,
    max_steps: Annotated[Optional[int], typer.Option(
        help=f"Optimizer steps (default {D.max_steps}; with --syncer the schedule spans the run: this is its "
             "horizon only in time-window rounds, until the island's pace is known).")] = None,
    epochs: Annotated[Optional[float], typer.Option(
        help="Instead of --max-steps: passes over this island's data shard (2, 0.5), the steps computed from its "
             "blocks, --batch-size and --grad-accum and shown at start.")] = None,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = D.lr,
    warmup_steps: Annotated[int, typer.Option(help="Linear warmup steps before the cosine decay.")] = D.warmup_steps,
    min_lr_ratio: Annotated[float, typer.Option(help="Cosine decays to this fraction of --lr.")] = D.min_lr_ratio,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = D.weight_decay,
    max_grad_norm: Annotated[float, typer.Option(help="Gradient clipping norm.")] = D.max_grad_norm,
    lora_r: Annotated[int, typer.Option(help="LoRA rank.")] = D.lora_r,
    lora_alpha: Annotated[float, typer.Option(help="LoRA alpha (scale = alpha / r).")] = D.lora_alpha,
    lora_dropout: Annotated[float, typer.Option(help="Dropout on the LoRA input.")] = D.lora_dropout,
    lora_targets: Annotated[str, typer.Option(help="Which linears to adapt: attention, all-linear or auto (attention; "
                                                   "MoE: plus non-expert linears, never routers).")] = D.lora_targets,
    loss_function: Annotated[str, typer.Option(help="cross_entropy, or module:function "
                                                    "taking (logits[N,V], targets[N], weights[N]) -> scalar.")
                             ] = D.loss_function,
    eval_every: Annotated[int, typer.Option(help="Held-out loss every N steps (0: at start and end).")
                          ] = D.eval_every,
    eval_fraction: Annotated[float, typer.Option(help="Fraction of records held out "
                                                      "for the eval loss.")] = D.eval_fraction,
    eval_task: Annotated[Optional[str], typer.Option(
        help="Score the adapter on a task during the run: a JSONL of {messages | prompt, answer} records, or a "
             "generated task's name (its held-out set; `yeto data task --list`). At the start, every "
             "--eval-task-every rounds (standalone: steps) and at the end; accuracy to metrics.jsonl, the trackers "
             "and, in a fleet, the tape. A fleet's island scores while it waits for a merge.")] = None,
    eval_task_every: Annotated[int, typer.Option(help="Score --eval-task every N rounds (standalone: steps); 0: at "
                                                      "the start and the end only.")] = D.eval_task_every,
    eval_task_limit: Annotated[Optional[int], typer.Option(help="Score the first N examples of --eval-task (default: "
                                                                "the whole file, or a task name's held-out set).")
                               ] = None,
    eval_task_max_new_tokens: Annotated[int, typer.Option(help="Tokens each --eval-task answer may take (greedy).")
                                        ] = D.eval_task_max_new_tokens,
    seed: Annotated[int, typer.Option(help="Seed of the split, batch order and LoRA init.")] = D.seed,
    island_id: Annotated[int, typer.Option(help="This island's index, for data sharding.")] = D.island_id,
    num_islands: Annotated[int, typer.Option("--islands", help="Islands sharing the data (0: all; with --syncer, "
                                                                 "the syncer's count).")] = D.num_islands,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or mps (MLX: auto or cpu).")] = D.device,
    dtype: Annotated[str, typer.Option(help="auto (fp32 on CPU, bf16 on GPU), "
                                            "float32, bfloat16 or float16.")] = D.dtype,
    gradient_checkpointing: Annotated[bool, typer.Option(help="Recompute activations in the backward pass "
                                                              "to save memory.")] = False,
    full_logits: Annotated[bool, typer.Option(help="Compute the LM head on every position "
                                                   "(default: loss-bearing positions only).")] = False,
    syncer: Annotated[Optional[str], typer.Option(help="HOST:PORT of a syncer: train as an island of its run.")
                      ] = None,
    overlap: Annotated[bool, typer.Option(help="With --syncer: keep training while a merge is in flight, "
                                               "then apply it as a correction.")] = False,
    threads: Annotated[int, typer.Option(help="CPU threads: torch's, or OpenBLAS's for MLX on Linux (0: the "
                                              "default).")] = D.threads,
    max_inner_steps: Annotated[int, typer.Option(help="With --syncer: do at most this many inner steps per round "
                                                      "(a weaker island contributing less; "
                                                      "0: the syncer's policy).")] = D.max_inner_steps,
    step_delay: Annotated[float, typer.Option(help="Sleep this long after each step, "
                                                   "to simulate a slow island (tests, benchmarks).")] = D.step_delay,
    syncer_timeout: Annotated[float, typer.Option(help="With --syncer: silence (seconds) after which the connection is "
                                                       "presumed dead and remade, with backoff.")] = D.syncer_timeout,
    give_up_after: Annotated[float, typer.Option(help="With --syncer: give up (exit 2, adapter saved) after the syncer "
                                                      "has been unreachable this long.")] = D.give_up_after,
    join_key: Annotated[Optional[str], typer.Option(help="The run's join key file (or YETO_JOIN_KEY).")] = None,
    insecure: Annotated[bool, typer.Option(help="No encryption, no key: a syncer on 127.0.0.1 run --insecure.")
                        ] = False,
    shard: Annotated[str, typer.Option(help="Under torchrun: ddp (the frozen base on every rank) or fsdp (the frozen "
                                            "base sharded across the ranks per transformer block; LoRA whole on "
                                            "each), for a base larger than one device.")] = D.shard,
    base_quantization: Annotated[str, typer.Option(help="none, or nf4: the frozen base in 4-bit NF4 through "
                                                        "bitsandbytes (QLoRA; CUDA only).")] = D.base_quantization,
    save_every: Annotated[int, typer.Option(help="Save the training state (optimizer, schedule, data position, RNG) "
                                                 "in --out every N steps, so the same command resumes a killed run "
                                                 "(0: only at the end; with --syncer: every round).")] = D.save_every,
    fresh: Annotated[bool, typer.Option(help="Start over, replacing the training state saved in --out.")] = False,
    init_adapter: Annotated[Optional[str], typer.Option(help="Start from this peft adapter (its base and LoRA "
                                                             "shape the run's).")] = None,
    report_to: Annotated[str, typer.Option(help=report_to_help("the island's training"))] = D.report_to,
    run_name: Annotated[str, typer.Option(help=run_name_help("--out's directory name; with --syncer, its parent's"))
                        ] = D.run_name,
    progress: Annotated[bool, typer.Option(help="Show the progress bar (--no-progress: no bar at all, the "
                                                   "libraries' loading and download bars included).")] = True,
) -> None:
    """(the flags of `yeto train`; see make_train_command)"""
