"""yeto's torch island vs a plain hand-written torch+peft loop, same model, data, batch and seq len.

Each variant runs in its own process (so peak memory is its own), on the same
packed chat blocks in the same order. Prints tokens/s, loss-bearing tokens/s,
peak memory and the ratio yeto / plain.

    python bench/island_throughput.py [--steps 8] [--warmup 2] [--seq-len 256] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def peak_memory_mb() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_variant(variant: str, args: dict, q) -> None:
    import torch

    from yeto.backends.torch.island import TorchIsland, TrainConfig

    cfg = TrainConfig(model=args["model"], data=args["data"], seq_len=args["seq_len"], batch_size=args["batch_size"],
                      max_steps=args["steps"] + args["warmup"], lr=1e-4, lora_dropout=0.0)
    island = TorchIsland(cfg, log=lambda s: None)  # both variants: same model, LoRA, data, sampler
    if variant == "plain":
        model, opt = island.model, island.optimizer

        def step():
            idx = island.sampler.next()
            ids = torch.from_numpy(island.data.train.input_ids[idx]).to(island.device)
            mask = torch.from_numpy(island.data.train.loss_mask[idx]).to(island.device)
            labels = ids.masked_fill(mask == 0, -100)
            model.train()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(island.trainable.values(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return ids.numel(), int(mask[:, 1:].sum())
    else:
        def step():
            s = island.step()
            return s["tokens"], s["loss_tokens"]

    for _ in range(args["warmup"]):
        step()
    tokens = loss_tokens = 0
    t0 = time.perf_counter()
    for _ in range(args["steps"]):
        a, b = step()
        tokens += a
        loss_tokens += b
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    q.put({"variant": variant, "tok_s": tokens / dt, "loss_tok_s": loss_tokens / dt, "loss_share": loss_tokens / tokens,
           "peak_mb": peak_memory_mb(), "seconds": dt})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=str(REPO / "data" / "demo"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()
    args = {"model": a.model, "data": a.data, "steps": a.steps, "warmup": a.warmup, "seq_len": a.seq_len,
            "batch_size": a.batch_size}
    from yeto.models.materialize import resolve_model

    resolve_model(a.model)  # materialize once, outside the timed children
    ctx = mp.get_context("spawn")
    results = {}
    for variant in ("plain", "yeto"):
        q = ctx.Queue()
        proc = ctx.Process(target=run_variant, args=(variant, args, q))
        proc.start()
        results[variant] = q.get()
        proc.join()
    plain, yeto = results["plain"], results["yeto"]
    print(f"model {a.model}, batch {a.batch_size} x {a.seq_len}, {a.steps} timed steps after {a.warmup} warmup, "
          f"chat data ({plain['loss_share']:.0%} of tokens carry loss)")
    print(f"{'':8} {'tok/s':>9} {'loss tok/s':>11} {'peak MB':>9}")
    for name, r in results.items():
        print(f"{name:8} {r['tok_s']:9.1f} {r['loss_tok_s']:11.1f} {r['peak_mb']:9.0f}")
    ratio = yeto["tok_s"] / plain["tok_s"]
    print(f"ratio yeto/plain: tokens/s {ratio:.2f}x, "
          f"loss-bearing tokens/s {yeto['loss_tok_s'] / plain['loss_tok_s']:.2f}x, "
          f"peak memory {yeto['peak_mb'] / plain['peak_mb']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": args, "results": results, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
