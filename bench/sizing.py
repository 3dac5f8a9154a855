"""yeto.launch.sizing's predictions against measured training steps on this CPU: peak memory and tokens/s.

Each configuration (model, seq len, micro-batch, gradient checkpointing) runs in a fresh process through yeto's own
training step (TorchIsland.step: the loss on the loss-bearing rows, AdamW, fp32 on the CPU), on text data whose
every token bears loss (the sizing model's case: the LM head on every position).

Memory: the kernel's peak resident set (VmHWM), reset once the island is built (/proc/self/clear_refs 5), less the
resident set at that moment: what the steps add on top of the loaded base and adapter, i.e. sizing's grads +
optimizer + activations. glibc's malloc hands allocations over 64 KiB to mmap (MALLOC_MMAP_THRESHOLD_, set for the
child), so a freed tensor leaves the resident set and the peak is live tensors, as on a GPU's allocator without its
slack. The loaded base and adapter (sizing's base + lora) are checked the same way: the resident set the island's
construction adds, which also holds the tokenizer and the packed data (small beside the weights).

Speed: the baseline is this CPU's fp32 matmul rate, measured in the same process right before and after the steps,
one thread for both. The machine is shared (the load average is printed), so both are taken at their best: the
fastest of a few short matmul windows, the fastest step. The prediction is that rate times CPU_MFU over
sizing.flops_per_token.

    python bench/sizing.py [--quick] [--steps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CPU_MFU = 0.40  # the share of the matmul baseline a LoRA step reaches on this CPU (one thread, fp32): fitted once
MATMUL_N = 512  # the baseline's square matmul size
TARGET = 0.20  # predictions within 20% of measurement

# tiny random models (SmolLM2's tokenizer, its 49152-token vocabulary): dense, hybrid conv/attention, MoE
TINY = {
    "tiny-llama": dict(model_type="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny-lfm2": dict(model_type="lfm2", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, block_auto_adjust_ff_dim=False,
                      layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=256, tie_word_embeddings=True),
}

# (model, seq_len, micro_batch, checkpointing)
CONFIGS = [
    ("smollm2-135m", 128, 1, False), ("smollm2-135m", 128, 4, False), ("smollm2-135m", 512, 1, False),
    ("smollm2-135m", 512, 1, True), ("smollm2-135m", 256, 4, True),
    ("tiny-llama", 256, 2, False), ("tiny-llama", 1024, 2, False), ("tiny-llama", 1024, 2, True),
    ("tiny-lfm2", 512, 2, False), ("tiny-lfm2", 512, 2, True),
    ("tiny-qwen3-moe", 512, 2, False), ("tiny-qwen3-moe", 512, 2, True),
]
HEAD = (f"{'model':15} {'seq':>5} {'mb':>3} {'ckpt':>4} | {'static MiB':>17} {'ratio':>5} | "
        f"{'steps MiB':>17} {'ratio':>5} | {'tokens/s':>15} {'ratio':>5} | {'GFLOP/s':>7}")
QUICK = [CONFIGS[i] for i in (0, 3, 5, 8, 10)]


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def matmul_gflops(windows: int = 6, seconds: float = 0.25) -> float:
    """This CPU's fp32 matmul rate: the best of a few short windows (the machine is shared; the best window is the
    closest to its uncontended rate, as the fastest step is the steps')."""
    import torch

    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    a @ b
    best = 0.0
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        best = max(best, 2 * MATMUL_N**3 * n / (time.perf_counter() - t0) / 1e9)
    return best


def warm_up(spec: dict) -> None:
    """Import what building the island imports (the model's code, peft), load the tokenizer and read the data once, so
    the resident set the island then adds is its weights and adapter."""
    import peft  # noqa: F401

    from yeto.models.catalog import size_local
    from yeto.island.data import prepare_data
    from yeto.models.materialize import load_tokenizer, resolve_model

    size_local(spec["path"])  # the model built on the meta device: its modeling code imported
    tokenizer = load_tokenizer(resolve_model(spec["path"]))
    prepare_data(spec["data"], tokenizer, spec["seq_len"])


def child(spec: dict) -> dict:
    """One configuration in this (fresh) process: build the island, run steps, measure."""
    import torch

    from yeto.backends.torch.island import TorchIsland
    from yeto.island.train_config import TrainConfig

    torch.set_num_threads(1)
    warm_up(spec)  # the imports, tokenizer and data the island's construction would otherwise add to its count
    cfg = TrainConfig(model=spec["path"], data=spec["data"], seq_len=spec["seq_len"], batch_size=spec["micro_batch"],
                      max_steps=spec["steps"] + 10, lr=1e-4, dtype="float32", device="cpu", threads=1,
                      gradient_checkpointing=spec["checkpointing"], lora_targets=spec["targets"],
                      eval_fraction=0.0, out=spec["out"])
    before = rss_kib("VmRSS")
    island = TorchIsland(cfg, log=lambda s: None)
    with torch.no_grad():  # safetensors maps the weights' file: touch every page so it is resident before the steps
        for p in island.model.parameters():
            p.sum()
    loaded = rss_kib("VmRSS")
    gflops_before = matmul_gflops()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here
    base_rss = rss_kib("VmRSS")
    island.step()  # AdamW's state is made on the first step
    times, tokens = [], 0
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        s = island.step()
        times.append(time.perf_counter() - t0)
        tokens = s["tokens"]
    peak = rss_kib("VmHWM")
    gflops = max(gflops_before, matmul_gflops())  # the baseline's best window, before or after the steps
    return dict(static_mib=(loaded - before) / 1024, peak_mib=(peak - base_rss) / 1024, tok_s=tokens / min(times),
                tok_s_mean=tokens * len(times) / sum(times), loss_share=s["loss_tokens"] / tokens, gflops=gflops)


def make_tiny(name: str, where: Path, tokenizer) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY[name])
    cfg = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **spec)
    torch.manual_seed(0)
    path = where / name
    if (path / "config.json").is_file():
        return path
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def text_data(where: Path) -> Path:
    """The demo chats as plain text (every token bears loss), all of them in each record (rotated), so every block
    packs full."""
    lines = (REPO / "data" / "demo" / "pirate_chat.jsonl").read_text().splitlines()
    chats = [" ".join(m["content"] for m in json.loads(line)["messages"]) for line in lines]
    path = where / "text.jsonl"
    with path.open("w") as f:
        for i in range(0, len(chats), len(chats) // 8):
            f.write(json.dumps({"text": " ".join(chats[i:] + chats[:i])}) + "\n")
    return path


def predict(path: Path, seq_len: int, micro_batch: int, checkpointing: bool, targets: str, gflops: float) -> dict:
    from yeto.launch.gpus import cpu
    from yeto.launch.sizing import IslandShape, memory, model_size, tokens_per_second

    size = model_size(str(path))
    device = cpu(gflops, memory_gib=1e6, mfu=CPU_MFU)
    shape = IslandShape("CPU", base="fp32", seq_len=seq_len, micro_batch=micro_batch, checkpointing=checkpointing,
                        targets=targets)
    m = memory(size, shape, device)
    return dict(static_mib=(m.base + m.lora) / 2**20, peak_mib=(m.grads + m.optimizer + m.activations) / 2**20,
                tok_s=tokens_per_second(size, shape, device), activations_mib=m.activations / 2**20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="five configurations, not all")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warmup step)")
    p.add_argument("--targets", default="all-linear")
    p.add_argument("--only", help="run only the configurations of this model")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--replay", help="predict again from the measurements a --json run wrote (no steps run)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.replay:
        print(HEAD + "\n" + "-" * len(HEAD))
        summary([compare(row) for row in json.loads(Path(a.replay).read_text())])
        return
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    from yeto.models.materialize import load_tokenizer, resolve_model

    smollm2 = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(smollm2)
    work = Path(tempfile.gettempdir()) / "yeto-sizing-bench"  # kept: --replay sizes its tiny models again
    work.mkdir(exist_ok=True)
    data = text_data(work)
    paths = {"smollm2-135m": smollm2.path}
    configs = [c for c in (QUICK if a.quick else CONFIGS) if a.only is None or c[0] == a.only]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    rows = []
    load = os.getloadavg()[0]
    print(f"load average at start {load:.2f} on {os.cpu_count()} cores; CPU_MFU {CPU_MFU}; targets {a.targets}")
    print(HEAD + "\n" + "-" * len(HEAD))
    for name, seq_len, mb, ckpt in configs:
        if name not in paths:
            paths[name] = make_tiny(name, work, tokenizer)
        spec = dict(path=str(paths[name]), data=str(data), seq_len=seq_len, micro_batch=mb, checkpointing=ckpt,
                    steps=a.steps, targets=a.targets, out=str(work / f"out-{len(rows)}"))
        r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                           text=True, timeout=900)
        if r.returncode != 0:
            print(f"{name} {seq_len} {mb} {ckpt}: failed\n{r.stderr[-2000:]}")
            continue
        got = json.loads(r.stdout.strip().splitlines()[-1])
        row = dict(model=name, path=str(paths[name]), seq_len=seq_len, micro_batch=mb, checkpointing=ckpt,
                   targets=a.targets, measured=got)
        rows.append(compare(row))
        if a.json:  # after each configuration: `--replay` predicts again from these measurements
            Path(a.json).write_text(json.dumps(rows, indent=1))
    summary(rows)


def compare(row: dict) -> dict:
    """Predict a measured row, print it with the ratios predicted / measured."""
    got = row["measured"]
    want = predict(Path(row["path"]), row["seq_len"], row["micro_batch"], row["checkpointing"], row["targets"],
                   got["gflops"])
    row = {**row, "predicted": want, "ratios": {k: want[k] / got[k] for k in ("static_mib", "peak_mib", "tok_s")}}
    rt = row["ratios"]
    print(f"{row['model']:15} {row['seq_len']:5} {row['micro_batch']:3} {'on' if row['checkpointing'] else 'off':>4} | "
          f"{want['static_mib']:7.0f} / {got['static_mib']:7.0f} {rt['static_mib']:5.2f} | "
          f"{want['peak_mib']:7.0f} / {got['peak_mib']:7.0f} {rt['peak_mib']:5.2f} | "
          f"{want['tok_s']:6.0f} / {got['tok_s']:6.0f} {rt['tok_s']:5.2f} | {got['gflops']:7.1f}", flush=True)
    return row


def summary(rows: list[dict]) -> None:
    within = [all(abs(v - 1) <= TARGET for v in r["ratios"].values()) for r in rows]
    print(f"predicted / measured: {sum(within)} of {len(rows)} configurations within {TARGET:.0%} on every term; "
          f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
