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
"""

from __future__ import annotations

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

    @property
    def link_gbs(self) -> float:
        """GB/s each device all-gathers at (FSDP)."""
        return NVLINK_GBS if self.nvlink else PCIE_GBS


def _apple(name: str, ram_gb: int, tflops: float) -> Gpu:
    """An Apple silicon machine: fp16/bf16 and fp32 run at the same GPU rate; no CUDA context (MLX's is small)."""
    return Gpu(name, ram_gb * APPLE_GPU_SHARE, tflops, False, 0.30, apple=True, fp32_tflops=tflops, cuda=False,
               context_gib=0.2)


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("T4", 15.0, 65.0, False, 0.15, fp32_tflops=8.1),
    Gpu("L4", 22.5, 121.0, False, 0.35, fp32_tflops=30.3),
    Gpu("A10G", 22.5, 70.0, False, 0.35, fp32_tflops=31.2),
    Gpu("RTX4090", 24.0, 165.2, False, 0.35, fp32_tflops=82.6),
    Gpu("RTX5090", 32.0, 209.5, False, 0.35, fp32_tflops=104.8),
    Gpu("A100", 40.0, 312.0, True, 0.40, fp32_tflops=19.5),
    Gpu("A100-80GB", 80.0, 312.0, True, 0.40, fp32_tflops=19.5),
    Gpu("H100", 79.6, 989.0, True, 0.35, fp32_tflops=67.0),
    Gpu("H200", 140.4, 989.0, True, 0.35, fp32_tflops=67.0),
    Gpu("B200", 179.0, 2250.0, True, 0.30, fp32_tflops=80.0),
    Gpu("MI300X", 191.5, 1307.0, True, 0.25, fp32_tflops=163.4, cuda=False),
    _apple("M2-Max-64GB", 64, 13.6),
    _apple("M3-Max-128GB", 128, 16.4),
    _apple("M4-Max-128GB", 128, 18.4),
    _apple("M2-Ultra-192GB", 192, 27.2),
    _apple("M3-Ultra-512GB", 512, 32.8),
)}


def gpu(name: str) -> Gpu:
    """A row of GPUS by name, or a one-line error naming the known ones."""
    if name not in GPUS:
        raise YetoError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}")
    return GPUS[name]


def cpu(gflops: float, memory_gib: float, mfu: float = 1.0) -> Gpu:
    """This machine's CPU as a device: `gflops` its measured matmul peak (bench/sizing.py measures it in the same run),
    no context (measured memory is taken above a baseline), no link."""
    return Gpu("CPU", memory_gib, gflops / 1000, False, mfu, fp32_tflops=gflops / 1000, cuda=False, context_gib=0.0,
               host=True)
