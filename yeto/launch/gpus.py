"""The accelerators an island runs on: memory, dense peak, the link between devices, and the stated MFU the speed
model (`yeto.launch.sizing`) uses for each.

Names are SkyPilot's accelerator names (what `yeto launch` asks a cloud for); Apple silicon rows are named
chip-memory. Figures are the vendors' published dense (not 2:4 sparse) tensor peaks per device:

- `memory_gib`: what the runtime can allocate per device. NVIDIA/AMD: the card's memory as nvidia-smi / rocm-smi
  report it. Apple: unified memory that MLX may wire for the GPU, `APPLE_GPU_SHARE` of the machine's RAM (macOS's
  default working-set limit), not the whole of it.
- `bf16_tflops`: dense bf16 tensor peak (T4 has no bf16: its fp16 peak, and torch runs bf16 there far slower, hence
  its low MFU). `fp32_tflops`: the non-tensor fp32 peak (a `--dtype float32` base on that device).
- `nvlink`: devices of one machine talk over NVLink / NVSwitch (AMD: Infinity Fabric), not PCIe: FSDP's per-block
  all-gathers are cheap there and costly over PCIe.
- `mfu`: the share of `bf16_tflops` a LoRA fine-tuning step reaches (stated, not measured here; bench/gpu_check.py
  measures it on the GPU a task has, docs/benchmarks.md records what it found).
- `bandwidth_gbs`: the device's published memory bandwidth, GB/s: every pass of a micro-batch reads the frozen base
  once, so a step takes no less than those reads (`yeto.launch.sizing`'s floor; it binds on short blocks).

Apple silicon covers base, Pro, Max and Ultra of M1 to M4 (`APPLE_SILICON`, one row per chip and GPU), each in
every unified memory size Apple sells it with: `M2-16GB` is an M2 MacBook Air, `M3-Pro-36GB` an M3 Pro.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from yeto import YetoError

APPLE_GPU_SHARE = 0.75  # macOS lets the GPU wire about three quarters of unified memory (iogpu.wired_limit default)
NVLINK_GBS = 300.0  # per-GPU all-gather bandwidth over NVLink/NVSwitch, GB/s (what NCCL reaches, below the link peak)
PCIE_GBS = 20.0  # per-GPU all-gather bandwidth over PCIe 4 without NVLink, GB/s


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # per device (Apple: unified memory MLX may use)
    bf16_tflops: float  # dense bf16 tensor peak per device
    nvlink: bool
    mfu: float  # the stated model-FLOPs utilization the speed model uses for this device
    apple: bool = False  # MLX backend (unified memory, one device per machine)
    fp32_tflops: float = 0.0  # dense fp32 (non-tensor) peak: the speed of an fp32 base
    cuda: bool = True  # NVIDIA: bitsandbytes' nf4 runs here
    context_gib: float = 0.5  # CUDA/HIP context, cuBLAS workspaces, kernels: resident before any tensor
    host: bool = False  # this machine's CPU (gpus.cpu): no caching allocator, dropout masks in the input's dtype
    bandwidth_gbs: float = 0.0  # published memory bandwidth, GB/s (0: not stated, no floor on a step's time)

    @property
    def link_gbs(self) -> float:
        """GB/s each device all-gathers at (FSDP)."""
        return NVLINK_GBS if self.nvlink else PCIE_GBS


APPLE_MFU = 0.30  # the stated share of an Apple GPU's peak a LoRA step reaches on MLX
APPLE_CONTEXT_GIB = 0.2  # MLX's runtime before any tensor (no CUDA context)
# Apple silicon as Apple publishes it (apple.com/<mac>/specs, support.apple.com's tech specs, the Apple Newsroom
# announcement of each chip): GPU cores, memory bandwidth in GB/s, the unified memory sizes sold, GB. One row per
# chip and GPU: a chip's largest GPU, and the smaller one where a memory size comes only with it (M3 Max 30-core:
# 36 or 96 GB at 300 GB/s; M4 Max 32-core: 36 GB at 410 GB/s). Apple made no M4 Ultra: the M3 Ultra (Mac Studio,
# 2025) is the newest Ultra.
APPLE_SILICON: tuple[tuple[str, int, float, tuple[int, ...]], ...] = (
    # chip       GPU cores  GB/s    memory, GB
    ("M1", 8, 68.25, (8, 16)),
    ("M1-Pro", 16, 200.0, (16, 32)),
    ("M1-Max", 32, 400.0, (32, 64)),
    ("M1-Ultra", 64, 800.0, (64, 128)),
    ("M2", 10, 100.0, (8, 16, 24)),
    ("M2-Pro", 19, 200.0, (16, 32)),
    ("M2-Max", 38, 400.0, (32, 64, 96)),
    ("M2-Ultra", 76, 800.0, (64, 128, 192)),
    ("M3", 10, 100.0, (8, 16, 24)),
    ("M3-Pro", 18, 150.0, (18, 36)),
    ("M3-Max", 30, 300.0, (36, 96)),
    ("M3-Max", 40, 400.0, (48, 64, 128)),
    ("M3-Ultra", 80, 819.0, (96, 256, 512)),
    ("M4", 10, 120.0, (16, 24, 32)),
    ("M4-Pro", 20, 273.0, (24, 48, 64)),
    ("M4-Max", 32, 410.0, (36,)),
    ("M4-Max", 40, 546.0, (48, 64, 128)),
)
# fp32 (= fp16/bf16) TFLOPS per GPU core of each generation: Apple's own figures for M1 (2.6 TFLOPS on 8 cores, 10.4
# on 32) and M2 (3.6 on 10, 13.6 on 38, 27.2 on 76); Apple publishes none for M3 and M4, so 128 ALUs x 2 FLOPs x
# their GPU clock (about 1.6 and 1.8 GHz)
APPLE_TFLOPS_PER_CORE = {"M1": 0.325, "M2": 0.358, "M3": 0.41, "M4": 0.46}


def _apple(chip: str, cores: int, bandwidth_gbs: float, ram_gb: int) -> Gpu:
    """An Apple silicon machine, named chip-memory: fp16/bf16 and fp32 run at the same GPU rate."""
    tflops = round(cores * APPLE_TFLOPS_PER_CORE[chip.split("-")[0]], 1)
    return Gpu(f"{chip}-{ram_gb}GB", ram_gb * APPLE_GPU_SHARE, tflops, False, APPLE_MFU, apple=True,
               fp32_tflops=tflops, cuda=False, context_gib=APPLE_CONTEXT_GIB, bandwidth_gbs=bandwidth_gbs)


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("T4", 15.0, 65.0, False, 0.15, fp32_tflops=8.1, bandwidth_gbs=320.0),
    Gpu("L4", 22.5, 121.0, False, 0.35, fp32_tflops=30.3, bandwidth_gbs=300.0),
    Gpu("A10G", 22.5, 70.0, False, 0.35, fp32_tflops=31.2, bandwidth_gbs=600.0),
    Gpu("RTX4090", 24.0, 165.2, False, 0.35, fp32_tflops=82.6, bandwidth_gbs=1008.0),
    Gpu("RTX5090", 32.0, 209.5, False, 0.35, fp32_tflops=104.8, bandwidth_gbs=1792.0),
    Gpu("A100", 40.0, 312.0, True, 0.40, fp32_tflops=19.5, bandwidth_gbs=1555.0),
    Gpu("A100-80GB", 80.0, 312.0, True, 0.40, fp32_tflops=19.5, bandwidth_gbs=2039.0),
    Gpu("H100", 79.6, 989.0, True, 0.35, fp32_tflops=67.0, bandwidth_gbs=3350.0),
    Gpu("H200", 140.4, 989.0, True, 0.35, fp32_tflops=67.0, bandwidth_gbs=4800.0),
    Gpu("B200", 179.0, 2250.0, True, 0.30, fp32_tflops=80.0, bandwidth_gbs=8000.0),
    Gpu("MI300X", 191.5, 1307.0, True, 0.25, fp32_tflops=163.4, cuda=False, bandwidth_gbs=5300.0),
    *(_apple(chip, cores, bandwidth, ram) for chip, cores, bandwidth, sizes in APPLE_SILICON for ram in sizes),
)}


CLOSE_MATCHES = 3  # names an unknown GPU's error suggests


def apple_names() -> str:
    """The Apple rows, each chip once with its memory sizes (`M2-8/16/24GB`): 40-odd names on one line."""
    sizes: dict[str, list[int]] = {}
    for chip, _, _, ram in APPLE_SILICON:
        sizes.setdefault(chip, []).extend(ram)
    return ", ".join(f"{chip}-{'/'.join(map(str, sorted(ram)))}GB" for chip, ram in sizes.items())


def gpu(name: str) -> Gpu:
    """A row of GPUS by name, or a one-line error naming the nearest and the known ones."""
    if name not in GPUS:
        lower = {n.lower(): n for n in GPUS}
        close = [lower[n] for n in difflib.get_close_matches(name.lower(), lower, n=CLOSE_MATCHES)]
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        clouds = ", ".join(n for n, g in GPUS.items() if not g.apple)
        raise YetoError(f"unknown GPU {name!r}{hint}: use one of {clouds}, or a Mac as chip-memory: {apple_names()}")
    return GPUS[name]


def cpu(gflops: float, memory_gib: float, mfu: float = 1.0) -> Gpu:
    """This machine's CPU as a device: `gflops` its measured matmul peak (bench/sizing.py measures it in the same run),
    no context (measured memory is taken above a baseline), no link."""
    return Gpu("CPU", memory_gib, gflops / 1000, False, mfu, fp32_tflops=gflops / 1000, cuda=False, context_gib=0.0,
               host=True)
