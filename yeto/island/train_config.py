"""What one island trains and how: `TrainConfig` (every backend's flags) and the checks every backend runs before
it loads anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from yeto import YetoError
from yeto.eval.task import DEFAULT_MAX_NEW_TOKENS
from yeto.island.micro_batch import WHOLE_BATCH
from yeto.island.records import DEMO_DATA

DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype (auto: fp32 on CPU, bf16 on GPU for torch)


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"
    data: str = DEMO_DATA
    out: str = "runs/train"
    model_revision: Optional[str] = None
    data_revision: Optional[str] = None
    data_split: str = "train"  # the dataset split trained on (a hub dataset or a directory with split files)
    data_config: Optional[str] = None  # the dataset config (subset) read, for datasets that have several
    columns: Optional[str] = None  # a table's columns as record fields: "question=prompt,answer=completion"
    trust_remote_code: bool = False
    seq_len: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 100
    epochs: Optional[float] = None  # passes over the shard instead: max_steps is then computed once it is known
    lr: float = 2e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    lora_targets: str = "auto"
    loss_function: str = "cross_entropy"
    eval_every: int = 50
    eval_fraction: float = 0.05
    seed: int = 0
    island_id: int = 0
    num_islands: int = 0  # 0: standalone the whole data, in a fleet the shard count the syncer says
    device: str = "auto"
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    full_logits: bool = False
    syncer: Optional[str] = None
    overlap: bool = False
    threads: int = 0
    max_inner_steps: int = 0
    step_delay: float = 0.0
    syncer_timeout: float = 30.0
    give_up_after: float = 1800.0
    join_key: Optional[str] = None
    insecure: bool = False
    shard: str = "ddp"  # a torchrun island's frozen base: replicated on every rank (ddp) or sharded (fsdp)
    base_quantization: str = "none"  # "nf4": QLoRA (the frozen base in 4 bits, bitsandbytes, CUDA)
    lora_freeze_a: bool = False  # FFA-LoRA: lora_A stays at the run's shared initialization, only lora_B trains
    micro_batch_size: str = WHOLE_BATCH  # blocks through the model at once: "all", N or "auto"
    save_every: int = 50  # standalone: save the training state every N steps (0: only at the end); fleet: each round
    fresh: bool = False  # start over, replacing the training state saved in --out
    init_adapter: Optional[str] = None  # start from this peft adapter (a directory or hub id) instead of LoRA's init
    report_to: str = "none"  # experiment trackers (yeto.report.trackers): tensorboard, wandb, trackio, mlflow, comma-
    # separated
    run_name: str = ""  # the run's name that groups its trackers' runs (default: --out's directory name)
    eval_task: Optional[str] = None  # a task file or generator name (yeto.eval.task.load_task): accuracy during the run
    eval_task_every: int = 0  # evaluate it every N rounds (standalone: steps); 0: at the start and the end only
    eval_task_limit: Optional[int] = None  # its first N examples (default: all of the file, a generator's held-out set)
    eval_task_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS


def check_config(cfg: TrainConfig) -> None:
    """The flags every backend checks before it loads anything: one line naming the flag and the fix."""
    from yeto.sync.core.checks import check_address, check_out_dir, check_range
    from yeto.report.trackers import parse_report_to
    from yeto.island.records import parse_columns

    for name in ("batch_size", "grad_accum", "max_steps", "seq_len", "lora_r"):
        check_range(getattr(cfg, name), f"--{name.replace('_', '-')}", low=1)
    check_range(cfg.seq_len, "--seq-len", low=2)
    if cfg.epochs is not None:
        check_range(cfg.epochs, "--epochs", low=0, low_open=True)
    check_range(cfg.lr, "--lr", low=0, low_open=True)
    check_range(cfg.lora_alpha, "--lora-alpha", low=0, low_open=True)
    check_range(cfg.lora_dropout, "--lora-dropout", low=0, high=1, high_open=True)
    check_range(cfg.min_lr_ratio, "--min-lr-ratio", low=0, high=1)
    check_range(cfg.max_grad_norm, "--max-grad-norm", low=0, low_open=True)
    check_range(cfg.eval_fraction, "--eval-fraction", low=0, high=1, high_open=True)
    for name in ("warmup_steps", "weight_decay", "eval_every", "save_every", "threads", "max_inner_steps",
                 "step_delay", "island_id", "num_islands", "eval_task_every"):
        check_range(getattr(cfg, name), f"--{name.replace('_', '-')}", low=0)
    if cfg.num_islands and cfg.island_id >= cfg.num_islands:
        raise YetoError(f"--island-id must be in [0, {cfg.num_islands}) with --islands {cfg.num_islands}, "
                        f"got {cfg.island_id}: fix one, or drop --islands (the syncer then says the count)")
    check_range(cfg.syncer_timeout, "--syncer-timeout", low=0, low_open=True)
    check_range(cfg.give_up_after, "--give-up-after", low=0, low_open=True)
    if cfg.dtype not in DTYPES:
        raise YetoError(f"unknown --dtype {cfg.dtype!r}: use {', '.join(DTYPES)}")
    if cfg.syncer:
        check_address(cfg.syncer)
    check_range(cfg.eval_task_max_new_tokens, "--eval-task-max-new-tokens", low=1)
    if cfg.eval_task_limit is not None:
        check_range(cfg.eval_task_limit, "--eval-task-limit", low=1)
    check_out_dir(cfg.out)
    parse_report_to(cfg.report_to)  # (its libraries are checked where the island runs: `open_session`)
    parse_columns(cfg.columns)


def check_seq_len(seq_len: int, context: Optional[int], model: str) -> None:
    """--seq-len within the model's context, checked before any data is tokenized: a longer block runs positions
    the model never learned, and its attention grows with the square of the length (a run that seems to hang)."""
    if context is not None and seq_len > context:
        raise YetoError(f"--seq-len {seq_len} is longer than the context of {model} ({context} tokens, its "
                        f"max_position_embeddings): use --seq-len {context} or less")
