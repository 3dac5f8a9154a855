"""yeto's MLX island vs mlx-lm's own LoRA training step, same model, batch and sequence length.

The baseline is mlx-lm's trainer step as `mlx_lm.tuner.trainer.train` builds it:
`linear_to_lora_layers` on the same attention projections, `default_loss`,
`nn.value_and_grad`, and the `mx.compile`d AdamW update. yeto's island is
`yeto.backends.mlx.island.MLXIsland.step` on the same packed blocks. Each variant runs
in its own process with Debian's OpenBLAS preloaded where installed.

    python bench/mlx_throughput.py [--steps 4] [--warmup 1] [--seq-len 128] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_variant(variant: str, a: argparse.Namespace) -> dict:
    import mlx.core as mx
    import numpy as np

    from yeto.backends.torch.island import TrainConfig
    from yeto.backends.mlx.island import MLXIsland

    cfg = TrainConfig(model=a.model, data=a.data, seq_len=a.seq_len, batch_size=a.batch_size, max_steps=100, lr=1e-4,
                      lora_dropout=0.0, lora_r=16, lora_alpha=32)
    island = MLXIsland(cfg, log=lambda s: None)  # same model load, data and blocks for both
    if variant == "mlx-lm":
        from functools import partial

        import mlx.nn as nn
        import mlx.optimizers as optim
        from mlx_lm.tuner.trainer import default_loss
        from mlx_lm.tuner.utils import linear_to_lora_layers

        from yeto.backends.mlx.compat import load_mlx_model

        model = load_mlx_model(island.model_artifact.path)
        model.freeze()
        keys = sorted({t.split("layers.", 1)[1].split(".", 1)[1] for t in island.targets})
        linear_to_lora_layers(model, len(model.layers), {"rank": 16, "scale": 2.0, "dropout": 0.0, "keys": keys})
        opt = optim.AdamW(learning_rate=1e-4)
        vg = nn.value_and_grad(model, default_loss)
        state = [model.state, opt.state, mx.random.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(batch, lengths):
            (loss, toks), grad = vg(model, batch, lengths)
            opt.update(model, grad)
            return loss, toks

        def one():
            idx = island.sampler.next()
            ids = island.data.train.input_ids[idx]
            batch = mx.array(ids)
            lengths = mx.array(np.tile([[1, ids.shape[1] - 1]], (ids.shape[0], 1)))
            loss, toks = step(batch, lengths)
            mx.eval(loss, toks, state)
            return ids.size, int(island.data.train.loss_mask[idx][:, 1:].sum())
    else:
        def one():
            s = island.step()
            return s["tokens"], s["loss_tokens"]

    for _ in range(a.warmup):
        one()
    tokens = loss_tokens = 0
    t = time.perf_counter()
    for _ in range(a.steps):
        x, y = one()
        tokens += x
        loss_tokens += y
    dt = time.perf_counter() - t
    return {"variant": variant, "tok_s": tokens / dt, "loss_tok_s": loss_tokens / dt, "seconds": dt}


def matmul_gflops(n: int = 1024, repeats: int = 3) -> dict:
    import mlx.core as mx

    x = mx.random.normal((n, n))
    mx.eval(x @ x)
    t = time.perf_counter()
    for _ in range(repeats):
        mx.eval(x @ x)
    return {"gflops": 2 * n**3 * repeats / (time.perf_counter() - t) / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default=str(REPO / "data" / "demo"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant == "matmul":
        print(json.dumps(matmul_gflops()))
        return
    if a.variant:
        print(json.dumps(run_variant(a.variant, a)))
        return
    from yeto.backends.mlx.compat import fast_blas_env

    env = fast_blas_env() or dict(os.environ)
    blas = "OpenBLAS preloaded" if "openblas" in env.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
    results = {}
    for variant in ("mlx-lm", "yeto"):
        r = subprocess.run([sys.executable, __file__, "--variant", variant, *sys.argv[1:]], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(r.stderr[-3000:])
        results[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"model {a.model}, batch {a.batch_size} x {a.seq_len}, {a.steps} timed steps after {a.warmup} warmup, {blas}")
    for name, r in results.items():
        print(f"{name:8} {r['tok_s']:8.1f} tok/s  {r['loss_tok_s']:8.1f} loss-bearing tok/s")
    print(f"ratio yeto/backends/mlx-lm: tokens/s {results['yeto']['tok_s'] / results['mlx-lm']['tok_s']:.2f}x")
    plain_env = dict(os.environ, YETO_NO_FAST_BLAS="1")
    plain_env.pop("LD_PRELOAD", None)
    gf = {}
    for name, e in (("bundled BLAS", plain_env), ("OpenBLAS preloaded", env)):
        r = subprocess.run([sys.executable, __file__, "--variant", "matmul"], env=e, capture_output=True, text=True)
        gf[name] = json.loads(r.stdout.strip().splitlines()[-1])["gflops"]
    print("1024^3 fp32 matmul on MLX's CPU backend: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in gf.items())
          + f"; ratio {gf['OpenBLAS preloaded'] / gf['bundled BLAS']:.1f}x")


if __name__ == "__main__":
    main()
