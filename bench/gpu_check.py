"""The GPU check: yeto's torch island on one GPU against a plain torch+peft loop and against yeto.launch.sizing's
predictions, on models built from catalog configs with random weights (nothing downloaded, nothing read from disk).

    bench/gpu_check.sh [--out runs/gpu-check]         on a GPU machine: torch, transformers, peft, accelerate
    python bench/gpu_check.py --device cpu --tiny     every code path on tiny configs, fp32, a few steps

What it measures (bf16, --seq-len 2048, LoRA r=16 on every linear, every position loss-bearing):
- throughput: tokens/s of yeto's island step (TorchIsland.step: micro-batches, the LM head on loss-bearing rows
  only) against a plain loop (get_peft_model + AdamW + loss.backward) at the same batch, seq len and rank, on a
  1B- and an 8B-class config;
- memory: peak memory (torch.cuda.max_memory_reserved plus the CUDA context) against yeto.launch.sizing.memory's
  prediction, for three models at micro-batches 1 and 4;
- `--micro-batch-size auto`: the probe's choice (yeto.island.micro_batch) against
  yeto.launch.sizing.largest_micro_batch;
- gradient checkpointing: what it costs in tokens/s and saves in memory.

On a GPU each case runs in its own process, so its peak memory is its own; on the CPU they run in this one (there is
no peak to measure there). Prints a table and writes gpu_check.json under --out with every case and the ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yeto import YetoError  # noqa: E402
from yeto.models.catalog import CATALOG, hf_config  # noqa: E402

SMALL, MIDDLE, LARGE = "llama3.2-1b", "qwen3-4b", "llama3.1-8b"  # the 1B- and 8B-class configs, and one between
LORA_RANK, LORA_ALPHA, LORA_TARGETS = 16, 32.0, "all-linear"
LORA_DROPOUT = 0.0  # both loops alike (peft then keeps no dropout mask), and sizing told so
GIB = 2**30
# --tiny: each catalog config at test size (its structure kept: GQA, tied embeddings, head_dim where it has one)
TINY_FIELDS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
TINY_HEAD_DIM = 16
CPU_SIZED_AS = "H100"  # on the CPU, sizing's predictions are made as for this GPU (the code path, not the numbers)
CASE_TIMEOUT_S = 240  # one case's process; an 8B case takes well under a minute on an H100


@dataclass(frozen=True)
class Case:
    """One run of a training loop on one model: what the tables compare."""
    name: str
    alias: str  # the catalog row whose config builds the model
    loop: str  # "yeto" (TorchIsland) or "plain" (get_peft_model + AdamW + loss.backward)
    batch: int  # blocks per optimizer step
    micro_batch: str = "all"  # yeto's --micro-batch-size: all, N or auto (auto: probe only, no steps timed)
    checkpointing: bool = False


@dataclass(frozen=True)
class Settings:
    device: str  # "cuda" or "cpu"
    dtype: str  # TrainConfig's --dtype: bfloat16 on a GPU, float32 on the CPU
    seq_len: int
    steps: int  # timed steps, after `warmup` untimed ones
    warmup: int
    tiny: bool
    gpu: str  # the yeto.launch.gpus name sizing predicts for
    auto_batch: int  # the --batch-size the micro-batch probe searches under
    device_info: dict[str, Any]  # the GPU's name, memory and CUDA version (empty on the CPU)


def plan(s: Settings) -> list[Case]:
    """The cases, most telling first (a run cut short by --budget-s keeps the throughput comparison)."""
    fast = [Case("1b plain", SMALL, "plain", 4), Case("1b yeto", SMALL, "yeto", 4),
            Case("8b plain", LARGE, "plain", 2), Case("8b yeto", LARGE, "yeto", 2),
            Case("1b yeto ckpt", SMALL, "yeto", 4, checkpointing=True),
            Case("8b yeto ckpt", LARGE, "yeto", 2, checkpointing=True)]
    memory = [Case(f"{tag} yeto ckpt mb{mb}", alias, "yeto", 4, str(mb), True)
              for tag, alias in (("1b", SMALL), ("4b", MIDDLE), ("8b", LARGE)) for mb in (1, 4)]
    auto = [Case(f"{tag} yeto auto", alias, "yeto", s.auto_batch, "auto") for tag, alias in (("1b", SMALL),
                                                                                            ("8b", LARGE))]
    return fast + memory + auto


# ----------------------------------------------------------------------------- the models and data


def model_config(alias: str, tiny: bool) -> dict[str, Any]:
    config = CATALOG[alias].config
    if config is None:
        raise YetoError(f"{alias} has no config in yeto/models/catalog.py: pick a sized alias")
    if not tiny:
        return dict(config)
    small = {**config, **TINY_FIELDS}
    if "head_dim" in small:
        small["head_dim"] = TINY_HEAD_DIM
    return small


def build_model(config: dict[str, Any], device: str, dtype):
    """A causal LM from a config, random weights, made on `device` in `dtype` (an 8B in bf16 straight on the GPU:
    no fp32 copy on the host)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(config), dtype=dtype)


def random_blocks(config: dict[str, Any], n: int, seq_len: int, seed: int = 0):
    """`n` blocks of random tokens, every position loss-bearing (the LM head's widest case, as in the probe)."""
    import numpy as np

    from yeto.island.data import Blocks

    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], (n, seq_len), dtype=np.int64)
    return Blocks(ids, np.ones((n, seq_len), np.float32))


@contextmanager
def random_init_loading(config: dict[str, Any], hub_id: str) -> Iterator[None]:
    """While open, yeto's torch island builds `config` with random weights instead of resolving a model on the hub
    (the one thing it cannot do on a machine without a network); everything else it does is what `yeto train` runs."""
    from yeto.backends.torch import island
    from yeto.models.provenance import Artifact

    swaps: dict[str, Callable[..., Any]] = {
        "resolve_model": lambda name, revision=None: Artifact(name, "model", "random-init", "", "random-init", None,
                                                              hub_id),
        "load_tokenizer": lambda artifact, trust_remote_code=False: None,  # the blocks come ready-made
        "load_model": lambda artifact, device, dtype=None, trust_remote_code=False, quantization="none":
            build_model(config, device, dtype),
    }
    missing = [name for name in swaps if not hasattr(island, name)]
    if missing:  # the island's loading moved: say where to follow it, not a hub lookup failing minutes later
        raise RuntimeError(f"yeto.backends.torch.island no longer has {missing}: update random_init_loading")
    saved = {name: getattr(island, name) for name in swaps}
    for name, fn in swaps.items():
        setattr(island, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(island, name, fn)


def yeto_island(case: Case, config: dict[str, Any], s: Settings, log: Callable[[str], None]):
    """yeto's TorchIsland as `yeto train` builds it (LoRA, gradient checkpointing, AdamW, the micro-batch probe),
    on `config` with random weights and training on random blocks."""
    from yeto.backends.torch.island import TorchIsland, TrainConfig
    from yeto.island.data import Blocks, PreparedData
    from yeto.island.schedule import BatchSampler
    from yeto.models.provenance import Artifact

    blocks = random_blocks(config, 2 * case.batch, s.seq_len)

    class RandomBlocksIsland(TorchIsland):
        def read_data(self, cfg: TrainConfig, tokenizer: Any, log: Callable[[str], None]) -> None:
            artifact = Artifact("random tokens", "dataset", "random-init", "", "random-init")
            self.data = PreparedData(blocks, Blocks(blocks.input_ids[:0], blocks.loss_mask[:0]), artifact)
            self.shard = (0, 1)
            self.sampler = BatchSampler(len(blocks), cfg.batch_size, cfg.seed)

    cfg = TrainConfig(model=case.alias, data="random tokens", out=tempfile.gettempdir(), seq_len=s.seq_len,
                      batch_size=case.batch, max_steps=s.steps + s.warmup, warmup_steps=0, lr=1e-4,
                      lora_r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, lora_targets=LORA_TARGETS,
                      device=s.device, dtype=s.dtype, gradient_checkpointing=case.checkpointing,
                      micro_batch_size=case.micro_batch)
    with random_init_loading(config, CATALOG[case.alias].hub_id):
        return RandomBlocksIsland(cfg, log=log)


def parameter_bytes(model) -> dict[str, int]:
    """The bytes of a model's frozen weights and of its trainable adapter, as allocated (tied tensors once)."""
    frozen = trainable = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel() * p.element_size()
        else:
            frozen += p.numel() * p.element_size()
    return {"weights_bytes": frozen, "adapter_bytes": trainable}


def plain_step(case: Case, config: dict[str, Any], s: Settings) -> tuple[Callable[[], int], Any]:
    """The loop a person writes: peft's LoRA on every linear, the model's own loss over full logits, AdamW."""
    import torch
    from peft import LoraConfig, get_peft_model

    dtype = getattr(torch, s.dtype)
    model = get_peft_model(build_model(config, s.device, dtype),
                           LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                                      target_modules=LORA_TARGETS))
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    blocks = random_blocks(config, 2 * case.batch, s.seq_len)
    model.train()
    position = [0]

    def step() -> int:
        start = position[0] % len(blocks)
        position[0] += case.batch
        ids = torch.from_numpy(blocks.input_ids[start:start + case.batch]).to(s.device)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return ids.numel()

    return step, model


# ----------------------------------------------------------------------------- one case


def timed(step: Callable[[], int], s: Settings) -> dict[str, float]:
    import torch

    def sync() -> None:
        if s.device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(s.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    tokens = sum(step() for _ in range(s.steps))
    sync()
    seconds = time.perf_counter() - t0
    return {"tok_s": tokens / seconds, "step_s": seconds / s.steps}


def context_bytes(device: str) -> Optional[int]:
    """What the device holds outside torch's allocator once CUDA is up (the context, the kernels' code)."""
    import torch

    if not device.startswith("cuda"):
        return None
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def peak_memory(device: str, context: Optional[int]) -> dict[str, Optional[float]]:
    import torch

    if not device.startswith("cuda"):
        return {"peak_allocated_gib": None, "peak_reserved_gib": None, "context_gib": None, "peak_gib": None}
    reserved = torch.cuda.max_memory_reserved()
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB, "peak_reserved_gib": reserved / GIB,
            "context_gib": context / GIB, "peak_gib": (reserved + context) / GIB}


def run_case(case: Case, s: Settings) -> dict[str, Any]:
    """Build, warm up and time one case; its peak memory is the process's (one case per process on a GPU)."""
    import torch

    torch.manual_seed(0)
    context = context_bytes(s.device)
    config = model_config(case.alias, s.tiny)
    lines: list[str] = []
    result: dict[str, Any] = {"status": "ok"}
    t0 = time.perf_counter()
    try:
        if case.loop == "plain":
            step, model = plain_step(case, config, s)
        else:
            island = yeto_island(case, config, s, lines.append)
            result["micro_batch_used"] = island.micro_batch
            step, model = (lambda: island.step()["tokens"]), island.model
        result.update(parameter_bytes(model))
        result["setup_s"] = time.perf_counter() - t0
        if case.micro_batch != "auto":
            result.update(timed(step, s))
    except torch.OutOfMemoryError as e:
        result.update(status="out of memory", error=str(e).splitlines()[0][:200])
    result.update(peak_memory(s.device, context), log=lines)
    return result


def _child(fn: Callable[..., dict[str, Any]], args: tuple, results) -> None:
    try:
        results.put(fn(*args))
    except BaseException as e:  # the parent reports it and goes on with the next case
        results.put({"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})


def in_child(fn: Callable[..., dict[str, Any]], args: tuple, timeout_s: float) -> dict[str, Any]:
    """`fn(*args)` in a fresh process: its peak memory is its own and an out-of-memory leaves nothing behind."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, results))
    proc.start()
    deadline = time.monotonic() + timeout_s
    result = None
    while result is None and time.monotonic() < deadline:
        try:
            result = results.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive() and results.empty():  # died without a word (killed for memory, a crash)
                result = {"status": f"the case's process died (exit code {proc.exitcode})"}
    if result is None:
        result = {"status": f"no result in {timeout_s:.0f} s"}
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return result


def read_gpu() -> dict[str, Any]:
    import torch

    return {"name": torch.cuda.get_device_name(), "memory_gib": torch.cuda.get_device_properties(0).total_memory / GIB,
            "cuda": torch.version.cuda}


def gpu_info(device: str) -> dict[str, Any]:
    """The GPU's name and memory, read in a child process: this one then holds no CUDA context, which would count in
    every case's measured context."""
    if device != "cuda":
        return {}
    info = in_child(read_gpu, (), CASE_TIMEOUT_S)
    if "name" not in info:
        raise YetoError(f"could not read the GPU's name and memory ({info['status']}): check that torch sees it")
    return info


# ----------------------------------------------------------------------------- predictions and the report


def sizing_model(alias: str, s: Settings, out: Path):
    """yeto.launch.sizing's ModelSize of the config the case builds (--tiny: the shrunk config, from a directory)."""
    from yeto.launch.sizing import model_size

    if not s.tiny:
        return model_size(alias)
    directory = out / "tiny-configs" / alias
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(alias, True)))
    return model_size(str(directory))


def predict(case: Case, s: Settings, out: Path) -> dict[str, Any]:
    """What yeto.launch.sizing says of a case of yeto's island: memory (bytes), tokens/s, the largest micro-batch."""
    from yeto.launch.sizing import IslandShape, largest_micro_batch, memory, tokens_per_second

    if case.loop != "yeto":
        return {}
    size = sizing_model(case.alias, s, out)
    micro = case.batch if case.micro_batch in ("all", "auto") else min(int(case.micro_batch), case.batch)
    shape = IslandShape(gpu=s.gpu, base="bf16" if s.dtype == "bfloat16" else "fp32", seq_len=s.seq_len,
                        micro_batch=micro, checkpointing=case.checkpointing, lora_rank=LORA_RANK,
                        targets=LORA_TARGETS, lora_dropout=LORA_DROPOUT)
    if case.micro_batch == "auto":
        return {"predicted_micro_batch": min(largest_micro_batch(size, shape), case.batch)}
    predicted = memory(size, shape)
    # the island's tokens/s, per step: a step of micro-batches runs at the speed of its micro-batch
    return {"predicted_gib": predicted.total / GIB, "predicted_memory": asdict(predicted),
            "predicted_tok_s": tokens_per_second(size, shape)}


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def summarize(rows: list[dict[str, Any]], stated_mfu: float) -> dict[str, Any]:
    """The ratios the check is for, from the cases that ran (`stated_mfu`: the one sizing's speed model uses for this
    GPU; the measured one is it times measured over predicted tokens/s)."""
    by = {r["name"]: r for r in rows if r.get("status") == "ok"}

    def get(name: str, key: str) -> Optional[float]:
        return by.get(name, {}).get(key)

    out: dict[str, Any] = {"yeto_over_plain_tok_s": {}, "checkpointing": {}, "memory_measured_over_predicted": {},
                           "tok_s_measured_over_predicted": {}, "mfu_measured": {}, "weights_allocated_over_predicted":
                           {}, "adapter_allocated_over_predicted": {}, "micro_batch_auto": {}}
    for tag in ("1b", "8b"):
        out["yeto_over_plain_tok_s"][tag] = ratio(get(f"{tag} yeto", "tok_s"), get(f"{tag} plain", "tok_s"))
        out["checkpointing"][tag] = {
            "tok_s_with_over_without": ratio(get(f"{tag} yeto ckpt", "tok_s"), get(f"{tag} yeto", "tok_s")),
            "peak_with_over_without": ratio(get(f"{tag} yeto ckpt", "peak_gib"), get(f"{tag} yeto", "peak_gib"))}
        auto = by.get(f"{tag} yeto auto")
        if auto:
            out["micro_batch_auto"][tag] = {"probed": auto.get("micro_batch_used"),
                                            "predicted": auto.get("predicted_micro_batch")}
    for name, r in by.items():
        if "predicted_gib" in r:
            out["memory_measured_over_predicted"][name] = ratio(r.get("peak_gib"), r["predicted_gib"])
            speed = ratio(r.get("tok_s"), r["predicted_tok_s"])
            out["tok_s_measured_over_predicted"][name] = speed
            out["mfu_measured"][name] = speed * stated_mfu if speed is not None else None
            predicted = r["predicted_memory"]  # the terms a CPU run checks too: what the model and adapter allocate
            out["weights_allocated_over_predicted"][name] = ratio(r.get("weights_bytes"), predicted["base"])
            out["adapter_allocated_over_predicted"][name] = ratio(r.get("adapter_bytes"), predicted["lora"])
    return out


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def print_report(rows: list[dict[str, Any]], summary: dict[str, Any], s: Settings, stated_mfu: float) -> None:
    print(f"\nseq len {s.seq_len}, {s.dtype}, LoRA r={LORA_RANK} on {LORA_TARGETS}, {s.steps} timed steps after "
          f"{s.warmup}; on {s.device}, sized as {s.gpu}" + (" (tiny configs)" if s.tiny else ""))
    head = (f"{'case':22} {'batch':>5} {'mb':>4} {'tok/s':>9} {'pred tok/s':>10} {'peak GiB':>8} {'pred GiB':>8} "
            f"{'peak/pred':>9}  status")
    print(head)
    print("-" * len(head))
    for r in rows:
        mb = r.get("micro_batch_used", r["micro_batch"] if r["loop"] == "yeto" else "-")
        print(f"{r['name']:22} {r['batch']:>5} {mb!s:>4} {fmt(r.get('tok_s'), '.0f'):>9} "
              f"{fmt(r.get('predicted_tok_s'), '.0f'):>10} {fmt(r.get('peak_gib')):>8} "
              f"{fmt(r.get('predicted_gib')):>8} {fmt(ratio(r.get('peak_gib'), r.get('predicted_gib'))):>9}  "
              f"{r['status']}")
    print()
    for tag, v in summary["yeto_over_plain_tok_s"].items():
        print(f"{tag}: yeto / plain tokens/s {fmt(v)}x")
    for tag, v in summary["checkpointing"].items():
        print(f"{tag}: gradient checkpointing: tokens/s {fmt(v['tok_s_with_over_without'])}x, "
              f"peak memory {fmt(v['peak_with_over_without'])}x")
    for term, key in (("weights", "weights_allocated_over_predicted"), ("adapter", "adapter_allocated_over_predicted")):
        values = [v for v in summary[key].values() if v is not None]
        if values:
            print(f"{term} allocated / sizing's {'base' if term == 'weights' else 'lora'} term: "
                  f"{min(values):.3f}x to {max(values):.3f}x over {len(values)} cases")
    for tag in ("1b", "8b"):
        mfu = summary["mfu_measured"].get(f"{tag} yeto")
        if mfu is not None and s.device == "cuda":
            print(f"{tag}: measured MFU {mfu:.1%} (sizing states {fmt(stated_mfu, '.0%')} for {s.gpu})")
    for tag, v in summary["micro_batch_auto"].items():
        print(f"{tag}: --micro-batch-size auto (batch {s.auto_batch}): probed {v['probed']}, "
              f"sizing predicts {v['predicted']}")


def sized_as(gpu: dict[str, Any], named: Optional[str]) -> str:
    """The yeto.launch.gpus entry this GPU (`gpu_info`) is sized as: --gpu, or the one whose name and memory match
    it."""
    from yeto.launch.gpus import GPUS

    if named:
        if named not in GPUS:
            raise YetoError(f"--gpu {named!r} is not in yeto.launch.gpus: use one of {', '.join(GPUS)}")
        return named
    if not gpu:
        return CPU_SIZED_AS
    name = gpu["name"].lower().replace(" ", "")
    matches = [g for g in GPUS.values() if not g.apple and g.name.split("-")[0].lower() in name]
    if not matches:
        raise YetoError(f"this GPU ({gpu['name']}) is not in yeto.launch.gpus: pass --gpu with the nearest of "
                        f"{', '.join(GPUS)}")
    return min(matches, key=lambda g: abs(g.memory_gib - gpu["memory_gib"])).name


def settings(a: argparse.Namespace) -> Settings:
    import torch

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise YetoError("--device cuda, but torch sees no CUDA device here: run on a GPU machine, or --device cpu "
                        "--tiny")
    if device == "cpu" and not a.tiny:
        raise YetoError("on the CPU the check runs tiny configs only (an 8B in fp32 on a CPU takes hours): add --tiny")
    gpu = gpu_info(device)
    return Settings(device=device, dtype="bfloat16" if device == "cuda" else "float32",
                    seq_len=a.seq_len or (32 if a.tiny else 2048), steps=a.steps or (2 if a.tiny else 6),
                    warmup=a.warmup if a.warmup is not None else (1 if a.tiny else 2), tiny=a.tiny,
                    gpu=sized_as(gpu, a.gpu), auto_batch=a.auto_batch or (8 if a.tiny else 64), device_info=gpu)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny configs (the CPU mode: every code path, in seconds)")
    p.add_argument("--out", default="runs/gpu-check", help="gpu_check.json goes here")
    p.add_argument("--gpu", help="the yeto.launch.gpus name to predict for (default: this GPU's)")
    p.add_argument("--seq-len", type=int, default=0, help="default 2048 (--tiny: 32)")
    p.add_argument("--steps", type=int, default=0, help="timed steps per case; default 6 (--tiny: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first; default 2 (--tiny: 1)")
    p.add_argument("--auto-batch", type=int, default=0, help="--batch-size the micro-batch probe searches under; "
                   "default 64 (--tiny: 8)")
    p.add_argument("--only", help="run only the cases whose name contains this (e.g. '8b')")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each case in its own process (default: on a GPU)")
    p.add_argument("--budget-s", type=float, default=400.0, help="start no case after this many seconds")
    a = p.parse_args(argv)
    try:
        s = settings(a)
    except YetoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    isolate = s.device == "cuda" if a.isolate is None else a.isolate
    cases = [c for c in plan(s) if not a.only or a.only in c.name]
    t0 = time.perf_counter()
    rows = []
    for case in cases:
        row: dict[str, Any] = asdict(case)
        elapsed = time.perf_counter() - t0
        if elapsed > a.budget_s:
            row["status"] = f"skipped: past --budget-s {a.budget_s:.0f}"
        else:
            row.update(predict(case, s, out))
            row.update(in_child(run_case, (case, s), CASE_TIMEOUT_S) if isolate else run_case(case, s))
        row["wall_s"] = time.perf_counter() - t0 - elapsed
        rows.append(row)
        print(f"[{time.perf_counter() - t0:6.1f}s] {case.name}: {row['status']}"
              + (f", {row['tok_s']:.0f} tok/s" if "tok_s" in row else "")
              + (f", micro-batch {row['micro_batch_used']}" if case.micro_batch == "auto" and "micro_batch_used" in row
                 else ""), flush=True)
    from yeto.launch.gpus import GPUS

    summary = summarize(rows, GPUS[s.gpu].mfu)
    print_report(rows, summary, s, GPUS[s.gpu].mfu)
    report = {"settings": asdict(s), "environment": environment(s), "cases": rows, "summary": summary,
              "seconds": time.perf_counter() - t0}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out / 'gpu_check.json'} ({report['seconds']:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def environment(s: Settings) -> dict[str, Any]:
    import peft
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "python": sys.version.split()[0], **s.device_info}


if __name__ == "__main__":
    sys.exit(main())
