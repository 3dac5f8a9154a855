"""Wire cost and merge speed of the sync path.

(a) bytes on the wire per round per island (delta up + broadcast down, whole
    messages as encoded by yeto.sync.wire.protocol) at 2/4/8/16 bits vs 32 bits, for
    SmolLM2-135M's adapter layout (LoRA r=16 on attention, built by peft).
(b) the syncer's merge throughput for 16 islands' 4-bit deltas of a 1B-class
    adapter layout (Llama-3.2-1B shapes, LoRA r=16 on all linears): decode,
    token-weighted merge, outer Nesterov step, 4-bit broadcast encode. Reported as
    MB/s of fp32 adapter merged, against this machine's memory-copy bandwidth
    measured in the same run.

    python bench/sync_wire.py [--islands 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from yeto.sync.wire.layout import TensorSpec, layout_from_specs  # noqa: E402
from yeto.sync.merge.aggregate import RoundSum  # noqa: E402
from yeto.sync.merge.outer import nesterov_step  # noqa: E402
from yeto.sync.wire.protocol import (decode, decode_fragments, encode, encode_fragments,  # noqa: E402
                                     encode_fragments_ef, message_bytes)
from yeto.sync.wire.quant import ErrorFeedback  # noqa: E402


def smollm2_specs(r: int = 16) -> tuple[TensorSpec, ...]:
    """The real adapter's tensors (peft's names and shapes under yeto's default targets: attention, LoRA r=16), from
    the packaged SmolLM2's config alone (no torch)."""
    from transformers import AutoConfig

    from yeto.models.materialize import resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model("smollm2-135m").path)
    h = cfg.hidden_size
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    specs = []
    for i in range(cfg.num_hidden_layers):
        for mod, (fin, fout) in shapes.items():
            base = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            specs += [TensorSpec(f"{base}.lora_A.default.weight", (r, fin)),
                      TensorSpec(f"{base}.lora_B.default.weight", (fout, r))]
    return tuple(specs)


def llama_1b_specs(r: int = 16) -> tuple[TensorSpec, ...]:
    h, inter, layers, kv = 2048, 8192, 16, 512
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    specs = []
    for i in range(layers):
        for mod, (fin, fout) in shapes.items():
            base = f"base_model.model.model.layers.{i}.{mod}"
            specs.append(TensorSpec(f"{base}.lora_A.default.weight", (r, fin)))
            specs.append(TensorSpec(f"{base}.lora_B.default.weight", (fout, r)))
    return tuple(specs)


def delta_message(layout, flat, bits) -> list[bytes]:
    descs, frames = encode_fragments(layout, flat, bits)
    return encode("delta", {"island": 0, "session": "bench", "round": 1, "base_version": 0, "tokens": 4096,
                            "loss_tokens": 1300, "inner_steps": 50, "loss": 1.234, "fragments": descs}, frames)


def wire_bytes() -> None:
    layout = layout_from_specs(smollm2_specs())
    rng = np.random.default_rng(0)
    delta = (rng.standard_normal(layout.numel) * 1e-3).astype(np.float32)
    print(f"(a) SmolLM2-135M adapter: {len(layout.specs)} tensors, {layout.numel:,} values, "
          f"{len(layout.fragments)} fragment(s)")
    sizes = {}
    for bits in (32, 16, 8, 4, 2):
        up = message_bytes(delta_message(layout, delta, bits))
        descs, frames = encode_fragments(layout, delta, bits)
        down = message_bytes(encode("broadcast", {"version": 1, "round": 1, "digest": "0" * 16, "responders": [0, 1],
                                                  "weights": [0.5, 0.5], "deltas": ["0" * 16] * 2,
                                                  "fragments": descs}, frames))
        sizes[bits] = up + down
        print(f"    {bits:>2} bits: delta {up:>10,} B + broadcast {down:>10,} B = {up + down:>10,} B "
              "per round per island")
    for bits in (16, 8, 4, 2):
        print(f"    ratio {bits}-bit / 32-bit: {sizes[bits] / sizes[32]:.4f} (1/{sizes[32] / sizes[bits]:.2f})")


def memcpy_bandwidth(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e6


def merge_throughput(n_islands: int, repeats: int) -> None:
    layout = layout_from_specs(llama_1b_specs())
    mb = layout.numel * 4 / 1e6
    print(f"(b) 1B-class adapter (Llama-3.2-1B shapes, r=16, all linears): {layout.numel:,} values = {mb:.1f} MB fp32, "
          f"{len(layout.fragments)} fragments; {n_islands} islands at 4 bits")
    rng = np.random.default_rng(1)
    msgs = [decode(delta_message(layout, (rng.standard_normal(layout.numel) * 1e-3).astype(np.float32), 4))
            for _ in range(n_islands)]
    tokens = rng.integers(500, 5000, n_islands)
    g = np.zeros(layout.numel, np.float32)
    m = np.zeros_like(g)
    ef = ErrorFeedback(layout.numel)
    best = float("inf")
    for _ in range(repeats):  # the syncer's own merge path (decode and add each delta as it arrives, then close)
        t = time.perf_counter()
        s = RoundSum(layout.numel)
        for i, msg in enumerate(msgs):
            s.add(i, decode_fragments(layout, msg), int(tokens[i]))
        new_g, m = nesterov_step(g, s.mean(), m, 0.7, 0.9)
        _, _, sent = encode_fragments_ef(layout, new_g - g, 4, ef)
        g = g + sent
        best = min(best, time.perf_counter() - t)
    merged_mb = n_islands * mb
    rate = merged_mb / best
    bw = memcpy_bandwidth(int(merged_mb * 1e6), repeats)
    print(f"    merge round: {best * 1000:.0f} ms for {merged_mb:.0f} MB of fp32 deltas = {rate:,.0f} MB/s")
    print(f"    memory copy (np.copyto, {merged_mb:.0f} MB): {bw:,.0f} MB/s")
    print(f"    ratio merge / memcpy: {rate / bw:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--islands", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    wire_bytes()
    merge_throughput(a.islands, a.repeats)


if __name__ == "__main__":
    main()
