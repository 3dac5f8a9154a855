"""How much memory a LoRA island needs per device, the largest micro-batch that fits, and how fast it trains: pure
arithmetic on a model's config and counted parameters (no torch), so `yeto models` and `yeto shape` size any model
on any install. bench/sizing.py checks it against measured training steps (docs/benchmarks.md, "Sizing").

Memory per device, bytes (b: the base's bytes per value, 4 for fp32, 2 for bf16; P_lora: the adapter's values):
    base         b * total                    (nf4: the decoder's linears at NF4_BYTES, the rest bf16)
                 fsdp: the blocks divided over `count`, the embeddings, head and norms whole, plus FSDP_GATHERED
                 blocks gathered whole at a time
    lora         4 * P_lora                   (peft keeps the adapter in fp32 over a bf16 base)
    grads        4 * P_lora
    optimizer    8 * P_lora                   (AdamW's two moments, fp32)
    activations  tokens * (the layers' saved tensors + the final norm's fp32 input) + logits
                 (tokens = micro_batch * seq_len). Per layer and token, as autograd saves them: the two norms' fp32
                 inputs (8h), q, k, v and attention's output (b each), the MLP's gate, activation and up (3b I);
                 per adapted linear its input in fp32 through dropout (4 in: peft casts it to the adapter's dtype),
                 the dropout's mask (1 byte per value on a GPU, 4 on the CPU), lora_A's output (4r)
                 checkpointing: each layer keeps only its input (b h); one layer's tensors recomputed at a time
                 logits: the LM head's rows x vocab, LOGIT_BYTES each (the loss's fp32 log-softmax and two
                 fp32 gradients at the backward's start)
    context      the device's runtime (CUDA context, cuBLAS workspaces): Gpu.context_gib
    slack        SLACK * activations           (the caching allocator's fragmentation; 0 on the CPU)

Speed: FLOPs per trained token, N = the active parameters in matmuls (the blocks' linears and the LM head; the
embedding lookup is no matmul), A = attention's score and value matmuls (2 * context * heads * head_dim per layer,
causal: half of the 4 * seq one would count), P_lora = the adapter:
    forward                 2N + A + 2 P_lora
    backward                2N + 2A + 4 P_lora  (the input gradients only: the frozen base gets no weight gradient,
                                                 so LoRA's backward is 2N, not full fine-tuning's 4N)
    checkpointing           + 2N + A + 2 P_lora (the blocks' forward again; not the head)
    total                   4N + 3A + 6 P_lora, or 6N + 4A + 8 P_lora with checkpointing (the issue's "6N" is full
                            fine-tuning's count; for LoRA it holds only with checkpointing)
    tokens/s = count * peak * mfu / FLOPs-per-token (peak: the device's bf16, or fp32 for an fp32 base; nf4 at
               NF4_SPEED of bf16 for dequantizing), FSDP: no faster than its all-gathers over the link allow, and no
               faster than the device's memory bandwidth reads the frozen base once per pass of a micro-batch (2
               passes, 3 with checkpointing: a floor that binds only on short blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional

from yeto import YetoError
from yeto.launch.gpus import GPUS, Gpu, gpu

GiB = 1024**3
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits, an 8-bit absmax per 64 values, an fp32 scale per 256 absmaxes
LORA_BYTES = 4  # adapter values (and their gradients) in fp32
ADAM_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32
# per logit at the peak, the backward's start: the log-softmax the loss keeps (fp32), the NLL's gradient and the
# log-softmax's (fp32 each); the forward's peak is lower (fp32: head output and log-softmax, 8; bf16: 2 + 4 + 4)
LOGIT_BYTES = 12
NORM_BYTES = 4  # an RMSNorm keeps its input in fp32 per hidden value (HF norms compute in fp32)
GPU_MASK_BYTES = 1  # a LoRA dropout's mask per value on a GPU (native_dropout's bool); on the CPU the input's dtype
SLACK = 0.10  # of the activations: the CUDA caching allocator's fragmentation
FSDP_GATHERED = 2  # blocks whole at a time under FSDP: the one running and the one prefetched
NF4_SPEED = 0.7  # QLoRA's matmuls run at this share of bf16's rate (each weight dequantized first)
MAX_MICRO_BATCH = 4096
MIN_SHAPE_COUNTS = (1, 2, 4, 8)  # GPUs per island min_shape tries (one machine)
STRATEGIES = ("ddp", "fsdp")
BASES = ("bf16", "fp32", "nf4")
TARGETS = ("attention", "all-linear", "auto")


@dataclass(frozen=True)
class Linear:
    """One kind of linear layer in the decoder: `count` of them, in_features -> out_features."""

    kind: str  # "attention", "mlp", "conv" or "expert" (a routed expert that is its own linear)
    in_features: int
    out_features: int
    count: int


@dataclass(frozen=True)
class ModelSize:
    """What sizing needs of a model: counted parameters and the decoder's shapes."""

    name: str
    total: int  # every parameter, tied ones once
    active: int  # those a token uses (MoE: top_k of the routed experts)
    embedding: int  # the input embedding's values
    head: int  # an untied LM head's values (0: tied to the embedding)
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's width (an MoE's: top_k * expert width, what a token passes through)
    attention_layers: int  # layers with full causal attention
    sliding_layers: int = 0  # layers attending within `sliding_window`
    sliding_window: int = 0
    routed_experts: int = 0  # all routed experts' values (fused 3-D tensors: no linears, never adapted or quantized)
    linears: tuple[Linear, ...] = ()  # the decoder's linears (the LM head apart)
    moe: bool = False

    def targeted(self, targets: str) -> list[Linear]:
        """The linears LoRA adapts under a --lora-targets rule (yeto.island.lora_targets.select_targets, by kind)."""
        if targets not in TARGETS:
            raise YetoError(f"unknown LoRA targets {targets!r}: use one of {', '.join(TARGETS)}")
        if targets == "attention" or (targets == "auto" and not self.moe):
            return [lin for lin in self.linears if lin.kind == "attention"]
        if targets == "auto":  # an MoE: not the routed experts (listed only where they are linears, one per expert)
            return [lin for lin in self.linears if lin.kind != "expert"]
        return list(self.linears)  # routers are never listed

    def lora_params(self, targets: str, rank: int) -> int:
        return sum(rank * (lin.in_features + lin.out_features) * lin.count for lin in self.targeted(targets))

    @property
    def linear_params(self) -> int:
        return sum(lin.in_features * lin.out_features * lin.count for lin in self.linears)

    @property
    def matmul_params(self) -> int:
        """Active values a token multiplies: the blocks' (active less embedding and untied head) plus the head's."""
        return self.active - self.embedding - self.head + self.hidden * self.vocab


@dataclass(frozen=True)
class IslandShape:
    gpu: str
    count: int = 1
    strategy: str = "ddp"  # "ddp" | "fsdp"
    base: str = "bf16"  # "bf16" | "fp32" | "nf4"
    seq_len: int = 2048
    micro_batch: int = 1
    checkpointing: bool = True
    lora_rank: int = 16
    targets: str = "all-linear"
    lora_dropout: float = 0.05  # yeto train's default; 0: no dropout (peft's Identity), no mask kept

    def describe(self) -> str:
        """As people write it: '1x L4 bf16', '2x H100 fsdp bf16', '1x A100-80GB nf4'."""
        strategy = " fsdp" if self.strategy == "fsdp" else ""
        return f"{self.count}x {self.gpu}{strategy} {self.base}"


@dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    base: int
    lora: int
    grads: int
    optimizer: int
    activations: int
    context: int
    slack: int

    @property
    def total(self) -> int:
        return self.base + self.lora + self.grads + self.optimizer + self.activations + self.context + self.slack


# --- the model's shapes from its config -------------------------------------------------------------------------

def _lfm2_ff(text: dict[str, Any]) -> int:
    """LFM2's feed-forward width: block_ff_dim, shrunk to 2/3 and rounded up as its config says."""
    ff = text.get("block_ff_dim") or text["intermediate_size"]
    if text.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if text.get("block_ffn_dim_multiplier") is not None:
            ff = int(text["block_ffn_dim_multiplier"] * ff)
        multiple = text.get("block_multiple_of", 256)
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _sparse_layer(text: dict[str, Any], i: int) -> bool:
    """Whether decoder layer i's MLP is routed experts."""
    if text["model_type"] == "lfm2_moe":
        return i >= text.get("num_dense_layers", 0)
    if i in (text.get("mlp_only_layers") or []):
        return False
    step = text.get("decoder_sparse_step", 1) or 1
    return (i + 1) % step == 0


def shapes(fields: dict[str, Any], total: int, active: int, name: str = "") -> ModelSize:
    """A ModelSize from config.json's fields and the counted parameters (yeto.models.catalog.count_params)."""
    text = dict(fields.get("text_config") or fields)
    text.setdefault("model_type", fields["model_type"])
    mt = text["model_type"]
    h, n_layers, heads = text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    hd = text.get("head_dim") or h // heads
    vocab = text["vocab_size"]
    tie = fields.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    n_experts = next((text[k] for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                      if isinstance(text.get(k), int) and text[k] > 1), 0)
    top_k = text.get("num_experts_per_tok") or text.get("experts_per_token") or n_experts
    types = text.get("layer_types") or ["full_attention"] * n_layers
    window = text.get("sliding_window") or 0
    count: dict[tuple[str, str, int, int], int] = {}

    def add(kind: str, role: str, i: int, o: int) -> None:
        count[(kind, role, i, o)] = count.get((kind, role, i, o), 0) + 1

    inter = text.get("intermediate_size", 0)
    widths = []  # the MLP width a token passes through, per layer
    for i, kind in enumerate(types):
        if kind == "conv":
            add("conv", "in_proj", h, 3 * h)
            add("conv", "out_proj", h, h)
        elif mt == "phi3":
            add("attention", "qkv_proj", h, (heads + 2 * kv) * hd)
            add("attention", "o_proj", heads * hd, h)
        else:
            for role, o in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
                add("attention", role, h, o)
            add("attention", "o_proj", heads * hd, h)
        if n_experts and _sparse_layer(text, i):
            widths.append(top_k * (text.get("moe_intermediate_size") or inter))
            continue
        ff = _lfm2_ff(text) if mt == "lfm2" else inter
        widths.append(ff)
        if mt == "phi3":
            add("mlp", "gate_up_proj", h, 2 * ff)
        else:
            add("mlp", "gate_proj", h, ff)
            add("mlp", "up_proj", h, ff)
        add("mlp", "down_proj", ff, h)
    routed = (total - active) * n_experts // (n_experts - top_k) if n_experts and n_experts > top_k else 0
    linears = tuple(Linear(kind, i, o, c) for (kind, _, i, o), c in count.items())
    return ModelSize(name=name, total=total, active=active, embedding=vocab * h, head=0 if tie else vocab * h,
                     layers=n_layers, hidden=h, vocab=vocab, heads=heads, kv_heads=kv, head_dim=hd,
                     intermediate=max(widths) if widths else inter,
                     attention_layers=sum(t == "full_attention" for t in types),
                     sliding_layers=sum(t == "sliding_attention" for t in types), sliding_window=window,
                     routed_experts=routed, linears=linears, moe=n_experts > 0)


def model_size(name: str, trust_remote_code: bool = False) -> ModelSize:
    """Size a catalog alias (its kept config and counts: no torch), or a local model directory or a hub id whose
    config.json this machine's Hugging Face cache holds (counted with yeto.models.catalog.size_local; with torch,
    its linears read from the model built on the meta device, so any architecture's adapter is counted exactly)."""
    import json

    from yeto import missing_torch
    from yeto.models.catalog import CATALOG, config_dir, size_local

    if name in CATALOG:
        e = CATALOG[name]
        if e.config is None or e.total is None:
            raise YetoError(f"{name}: its published config is not known offline; size a download with its directory")
        return shapes(e.config, e.total, e.active or e.total, name)
    path, _ = config_dir(name)
    counted = size_local(path, trust_remote_code)
    fields = json.loads((path / "config.json").read_text())
    size = shapes(fields, counted.total, counted.active, name)
    if missing_torch() is None:
        try:
            size = replace(size, linears=meta_linears(fields, trust_remote_code))
        except (ValueError, KeyError):  # transformers cannot build it here: the linears the config implies
            pass
    return size


def meta_linears(fields: dict[str, Any], trust_remote_code: bool = False) -> tuple[Linear, ...]:
    """The decoder's linears of the model built on the meta device, by kind: what yeto.island.lora_targets's rules
    see."""
    import re

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from yeto.models.catalog import hf_config
    from yeto.backends.torch.lora import torch_linears
    from yeto.island.lora_targets import ATTENTION_REGEX, EXPERT_REGEX, NON_TEXT_REGEX, is_router

    cfg = hf_config(fields)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    linears, exclude = torch_linears(model)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    count: dict[tuple[str, int, int], int] = {}
    for n, i, o in linears:
        if n in exclude or n.endswith("lm_head") or re.fullmatch(NON_TEXT_REGEX, n) or is_router(n, o, text):
            continue
        kind = ("attention" if re.fullmatch(ATTENTION_REGEX, n) else "expert" if re.fullmatch(EXPERT_REGEX, n)
                else "conv" if ".conv." in n else "mlp")
        count[(kind, i, o)] = count.get((kind, i, o), 0) + 1
    return tuple(Linear(kind, i, o, c) for (kind, i, o), c in count.items())


# --- memory ----------------------------------------------------------------------------------------------------

def _check(shape: IslandShape, device: Optional[Gpu] = None) -> Gpu:
    """The shape's device (`device` where given: the bench's measured CPU), after checking its fields."""
    if shape.strategy not in STRATEGIES:
        raise YetoError(f"unknown strategy {shape.strategy!r}: use ddp or fsdp")
    if shape.base not in BASES:
        raise YetoError(f"unknown base {shape.base!r}: use one of {', '.join(BASES)}")
    if shape.count < 1 or shape.seq_len < 2 or shape.micro_batch < 1 or shape.lora_rank < 1:
        raise YetoError(f"island shape out of range (count, micro-batch, rank at least 1, seq_len 2): {shape}")
    return device or gpu(shape.gpu)


def base_bytes(model: ModelSize, base: str) -> tuple[int, int]:
    """(the blocks' bytes, the rest's: embeddings, head, final norm, vision tower) of the frozen base."""
    outside = model.embedding + model.head
    if base == "nf4":  # bitsandbytes quantizes the decoder's nn.Linear layers; the rest stays in bf16
        quantized = model.linear_params
        blocks = quantized * NF4_BYTES + (model.total - outside - quantized) * 2
        return int(blocks), outside * 2
    b = 4 if base == "fp32" else 2
    return (model.total - outside) * b, outside * b


def layer_activation_bytes(model: ModelSize, shape: IslandShape, device: Optional[Gpu] = None) -> list[int]:
    """Per token, the bytes each decoder layer keeps for the backward (no checkpointing), as autograd saves them:
    the norms' fp32 inputs; attention's q, k, v (after RoPE) and output; the MLP's gate, its activation and up; and
    per adapted linear its input as the adapter's dtype (peft casts it to fp32) through dropout, the dropout's mask
    (a bool on a GPU, the input's dtype on the CPU), and lora_A's output."""
    a = 4 if shape.base == "fp32" else 2
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    mask = 0 if shape.lora_dropout == 0 else LORA_BYTES if device is not None and device.host else GPU_MASK_BYTES
    lora = {kind: 0 for kind in ("attention", "mlp", "conv", "expert")}  # all layers' adapted linears, by kind
    for lin in model.targeted(shape.targets):
        lora[lin.kind] += lin.count * (lin.in_features * (LORA_BYTES + mask) + shape.lora_rank * LORA_BYTES)
    attn_layers = model.attention_layers + model.sliding_layers
    attention = a * (2 * q + 2 * kv) + lora["attention"] / max(attn_layers, 1)
    conv = a * 4 * h + lora["conv"] / max(model.layers - attn_layers, 1)
    mlp = a * 3 * model.intermediate + (lora["mlp"] + lora["expert"]) / model.layers
    norms = 2 * NORM_BYTES * h
    return [int(norms + mlp + (attention if i < attn_layers else conv)) for i in range(model.layers)]


def activation_bytes(model: ModelSize, shape: IslandShape, device: Optional[Gpu] = None) -> int:
    """Bytes of activations a micro-batch keeps at its peak (the backward's start)."""
    a = 4 if shape.base == "fp32" else 2
    tokens = shape.micro_batch * shape.seq_len
    layers = layer_activation_bytes(model, shape, device)
    kept = model.layers * model.hidden * a + max(layers) if shape.checkpointing else sum(layers)
    kept += NORM_BYTES * model.hidden  # the final norm's input (outside the checkpointed layers)
    logits = shape.micro_batch * (shape.seq_len - 1) * model.vocab * LOGIT_BYTES
    return int(tokens * kept + logits)


def memory(model: ModelSize, shape: IslandShape, device: Optional[Gpu] = None) -> Memory:
    """Bytes per device of an island of `shape` training `model`."""
    device = _check(shape, device)
    blocks, outside = base_bytes(model, shape.base)
    if shape.strategy == "fsdp" and shape.count > 1:
        base = outside + blocks // shape.count + FSDP_GATHERED * blocks // model.layers
    else:
        base = outside + blocks
    p = model.lora_params(shape.targets, shape.lora_rank)
    act = activation_bytes(model, shape, device)
    slack = 0 if device.host else int(SLACK * act)
    return Memory(base=int(base), lora=LORA_BYTES * p, grads=LORA_BYTES * p, optimizer=ADAM_BYTES * p,
                  activations=act, context=int(device.context_gib * GiB), slack=slack)


def fits(model: ModelSize, shape: IslandShape, device: Optional[Gpu] = None) -> bool:
    """Whether every device of the island holds its memory."""
    device = _check(shape, device)
    return memory(model, shape, device).total <= device.memory_gib * GiB


def largest_micro_batch(model: ModelSize, shape: IslandShape, device: Optional[Gpu] = None) -> int:
    """The largest micro-batch (up to MAX_MICRO_BATCH) whose island fits; 0: not even 1 fits."""
    if not fits(model, replace(shape, micro_batch=1), device):
        return 0
    lo, hi = 1, MAX_MICRO_BATCH + 1  # fits(lo), not fits(hi) (or past the cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(model, replace(shape, micro_batch=mid), device) else (lo, mid)
    return lo


# --- speed -----------------------------------------------------------------------------------------------------

def attention_flops(model: ModelSize, seq_len: int) -> float:
    """Forward FLOPs per token of attention's QK^T and PV (causal: a token attends to half the context on average)."""
    width = model.heads * model.head_dim
    window = min(seq_len, model.sliding_window) if model.sliding_window else seq_len
    full = 2 * seq_len * width * model.attention_layers
    sliding = 4 * (window if window < seq_len else seq_len / 2) * width * model.sliding_layers
    return full + sliding


def flops_per_token(model: ModelSize, shape: IslandShape) -> float:
    """Training FLOPs per token (the module docstring's count)."""
    n = model.matmul_params
    head = model.hidden * model.vocab
    att = attention_flops(model, shape.seq_len)
    lora = model.lora_params(shape.targets, shape.lora_rank)
    total = 4 * n + 3 * att + 6 * lora
    if shape.checkpointing:
        total += 2 * (n - head) + att + 2 * lora
    return float(total)


def tokens_per_second(model: ModelSize, shape: IslandShape, device: Optional[Gpu] = None) -> float:
    """Tokens per second of the whole island (all `count` devices)."""
    device = _check(shape, device)
    peak = device.fp32_tflops if shape.base == "fp32" and device.fp32_tflops else device.bf16_tflops
    rate = peak * 1e12 * device.mfu * (NF4_SPEED if shape.base == "nf4" else 1.0)
    tokens = shape.micro_batch * shape.seq_len
    compute_s = tokens / (rate / flops_per_token(model, shape))
    blocks, outside = base_bytes(model, shape.base)
    passes = 3 if shape.checkpointing else 2
    read_s = passes * (blocks + outside) / (device.bandwidth_gbs * 1e9) if device.bandwidth_gbs else 0.0
    gather_s = 0.0
    if shape.strategy == "fsdp" and shape.count > 1:  # every micro-batch all-gathers the blocks per pass
        gather_s = passes * blocks * (shape.count - 1) / shape.count / (device.link_gbs * 1e9)
    return shape.count * tokens / max(compute_s, read_s, gather_s)


def island_gib(shape: IslandShape) -> float:
    """An island's size: its devices' memory together (what "the smallest island" means, without prices)."""
    return shape.count * gpu(shape.gpu).memory_gib


# --- the smallest island -----------------------------------------------------------------------------------------

def candidates(gpus: Iterable[str], seq_len: int, **shape: Any) -> list[IslandShape]:
    """Island shapes from smallest to largest total device memory; at equal memory bf16 before nf4, fewer devices
    first. nf4 on one CUDA device only (bitsandbytes), Apple and FSDP islands of one machine each."""
    out = []
    for name in gpus:
        g = gpu(name)
        for count in (1,) if g.apple else MIN_SHAPE_COUNTS:
            strategy = "fsdp" if count > 1 else "ddp"
            for base in ("bf16", "nf4") if g.cuda and count == 1 else ("bf16",):
                out.append(IslandShape(name, count, strategy, base, seq_len, **shape))
    return sorted(out, key=lambda s: (island_gib(s), s.base != "bf16", s.count))


DEFAULT_GPUS = tuple(name for name, g in GPUS.items() if not g.apple)


def min_shape(model: ModelSize, gpus: Iterable[str] = DEFAULT_GPUS, seq_len: int = 2048,
              **shape: Any) -> Optional[IslandShape]:
    """The island with the least total device memory that trains `model` at micro-batch 1 (None: none fits)."""
    for s in candidates(gpus, seq_len, **shape):
        if fits(model, s):
            return s
    return None


MIN_SHAPE_TERMS = "seq len 2048, micro-batch 1, gradient checkpointing, LoRA r=16 on the island's auto targets"


def island_row(name: str, trust_remote_code: bool = False) -> Optional[dict[str, Any]]:
    """`yeto models`' min island of a model (MIN_SHAPE_TERMS): its shape and per-device memory; None where the model
    is not sized offline or nothing fits."""
    try:
        size = model_size(name, trust_remote_code)
    except YetoError:
        return None
    s = min_shape(size, targets="auto")
    if s is None:
        return None
    return dict(label=s.describe(), gpu=s.gpu, count=s.count, strategy=s.strategy, base=s.base,
                memory_gib=round(memory(size, s).total / GiB, 1), tokens_per_second=round(tokens_per_second(size, s)))


def human_bytes(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2**20:.0f} MiB"

