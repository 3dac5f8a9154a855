"""The model catalog: the aliases people fine-tune, each with the fields of its published config.json that define
the architecture, and parameter counts COUNTED from that config on the meta device (no weights).

Each row is data: the hub id, a pinned revision where one is known (None otherwise: the hub's main at resolve time),
license, context length, whether the repo's own code must run, and `config`, the architecture fields exactly as the
hub's config.json spells them. `count_params` builds the model from any config (a row's, or a local directory's
config.json) with `accelerate.init_empty_weights()` and counts its tensors; the MoE active count is the total less
the routed experts a token does not visit (the expert tensors found in the module tree, scaled by 1 - top_k/experts).
Counting a 235B MoE takes under a second, but `yeto models` lists every row, so the counts are kept in the rows
(`total`, `active`); tests/test_catalog.py recounts them and checks a few against the published figures.
`python -m yeto.models.catalog` prints the rows whose kept counts differ from a recount (after editing a config).

Why one module: the table is data read top to bottom, one row per alias; splitting it by family would scatter it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from yeto import YetoError, missing_torch, require_torch


def arch(model_type: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tie: bool,
         **more: Any) -> dict[str, Any]:
    """A config.json's architecture fields under their hub names (`more`: head_dim, MoE and hybrid fields, ...)."""
    return dict(model_type=model_type, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tie, **more)


def lfm2_layers(n: int, attention: list[int]) -> list[str]:
    """LFM2's `layer_types`: gated short-convolution blocks, full attention at the published indices."""
    return ["full_attention" if i in attention else "conv" for i in range(n)]


def every_sixth_global(n: int) -> list[str]:
    """Gemma 3's `layer_types`: five sliding-window layers, then one global (sliding_window_pattern 6)."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


def gemma3_vision(text: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 4B-27B: the text decoder plus the SigLIP vision tower and projector the checkpoint carries."""
    text = {k: v for k, v in text.items() if k not in ("model_type", "tie_word_embeddings")}
    return dict(model_type="gemma3", tie_word_embeddings=True, mm_tokens_per_image=256, text_config=text,
                vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                   num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False))


LLAMA3 = dict(rope_theta=500000.0)
QWEN3 = dict(head_dim=128, rope_theta=1000000.0)
LFM2 = dict(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256, conv_L_cache=3)
GEMMA3 = dict(query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0)


@dataclass(frozen=True)
class Entry:
    """One alias. `config`: None where the published config is not known offline (sized once downloaded)."""

    hub_id: str
    family: str
    license: str
    context: int
    config: Optional[dict[str, Any]]
    total: Optional[int]  # counted by count_params from `config`, kept here
    moe_active: Optional[int] = None  # an MoE's active count (count_params); None for a dense model
    revision: Optional[str] = None  # a pinned hub commit, where one is known
    trust_remote_code: bool = False

    @property
    def active(self) -> Optional[int]:
        return self.total if self.moe_active is None else self.moe_active

    @property
    def architecture(self) -> str:
        return self.config["model_type"] if self.config else "?"


E = Entry
# `revision`: the hub commit that public code pinning this hub id downloads (found by search, several projects agreeing
# where there were several); None where none was found: the hub's main at resolve time
CATALOG: dict[str, Entry] = {
    # SmolLM2 / SmolLM3 (Hugging Face)
    "smollm2-135m": E("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2", "apache-2.0", 8192,
                      arch("llama", 576, 1536, 30, 9, 3, 49152, True, rope_theta=100000.0), 134515008),
    "smollm2-360m": E("HuggingFaceTB/SmolLM2-360M-Instruct", "SmolLM2", "apache-2.0", 8192,
                      arch("llama", 960, 2560, 32, 15, 5, 49152, True, rope_theta=100000.0), 361821120),
    "smollm2-1.7b": E("HuggingFaceTB/SmolLM2-1.7B-Instruct", "SmolLM2", "apache-2.0", 8192,
                      arch("llama", 2048, 8192, 24, 32, 32, 49152, True, rope_theta=130000.0), 1711376384),
    "smollm3-3b": E("HuggingFaceTB/SmolLM3-3B", "SmolLM3", "apache-2.0", 65536,
                    arch("smollm3", 2048, 11008, 36, 16, 4, 128256, True, no_rope_layer_interval=4,
                         rope_theta=5000000.0), 3075098624),
    # LFM2 / LFM2.5 (Liquid AI): short-convolution blocks with a few attention layers
    # LFM2.5-230M: the published shapes (hidden 1024, ff 2560 unadjusted, 16/8 heads, 14 blocks of which 6 attention)
    # count exactly its published 229,693,184; which 6 blocks attend is not published (the counts and the sizing do
    # not depend on it; training reads the downloaded config.json). LFM2.5-1.2B and -350M: LFM2-1.2B's and -350M's
    # layouts (the 1.2B card: 16 blocks, 10 convolution + 6 GQA, vocab 65536, 1.17B; public code on the 350M
    # addresses its attention blocks at LFM2-350M's indices 2, 5, 8, 10, 12, 14).
    "lfm25-230m": E("LiquidAI/LFM2.5-230M", "LFM2.5", "lfm1.0", 128000,
                    arch("lfm2", 1024, 2560, 14, 16, 8, 65536, True, block_ff_dim=2560,
                         layer_types=lfm2_layers(14, [2, 5, 7, 9, 11, 13]),
                         **{**LFM2, "block_auto_adjust_ff_dim": False}), 229693184,
                    revision="37b30cce3446f3f2e26a0d3f8c67c9167f5079d7"),
    "lfm25-350m": E("LiquidAI/LFM2.5-350M", "LFM2.5", "lfm1.0", 128000,
                    arch("lfm2", 1024, 6656, 16, 16, 8, 65536, True, block_ff_dim=6656,
                         layer_types=lfm2_layers(16, [2, 5, 8, 10, 12, 14]), **LFM2), 354483968),
    "lfm25-1b": E("LiquidAI/LFM2.5-1.2B-Instruct", "LFM2.5", "lfm1.0", 128000,
                  arch("lfm2", 2048, 12288, 16, 32, 8, 65536, True, block_ff_dim=12288,
                       layer_types=lfm2_layers(16, [2, 5, 8, 10, 12, 14]), **LFM2), 1170340608),
    "lfm2-350m": E("LiquidAI/LFM2-350M", "LFM2", "lfm1.0", 128000,
                   arch("lfm2", 1024, 6656, 16, 16, 8, 65536, True, block_ff_dim=6656,
                        layer_types=lfm2_layers(16, [2, 5, 8, 10, 12, 14]), **LFM2), 354483968),
    "lfm2-700m": E("LiquidAI/LFM2-700M", "LFM2", "lfm1.0", 128000,
                   arch("lfm2", 1536, 10240, 16, 24, 8, 65536, True, block_ff_dim=10240,
                        layer_types=lfm2_layers(16, [2, 5, 8, 10, 12, 14]), **LFM2), 742489344),
    "lfm2-1.2b": E("LiquidAI/LFM2-1.2B", "LFM2", "lfm1.0", 128000,
                   arch("lfm2", 2048, 12288, 16, 32, 8, 65536, True, block_ff_dim=12288,
                        layer_types=lfm2_layers(16, [2, 5, 8, 10, 12, 14]), **LFM2), 1170340608),
    "lfm2-8b-a1b": E("LiquidAI/LFM2-8B-A1B", "LFM2", "lfm1.0", 128000,
                     arch("lfm2_moe", 2048, 7168, 24, 32, 8, 65536, True, moe_intermediate_size=1792, num_experts=32,
                          num_experts_per_tok=4, num_dense_layers=2, norm_topk_prob=True, conv_L_cache=3,
                          layer_types=lfm2_layers(24, [2, 6, 10, 14, 18, 21])), 8339929856, 1557740288),
    # Llama 3.x (Meta)
    "llama3.2-1b": E("meta-llama/Llama-3.2-1B-Instruct", "Llama 3", "llama3.2", 131072,
                     arch("llama", 2048, 8192, 16, 32, 8, 128256, True, head_dim=64, **LLAMA3), 1235814400),
    "llama3.2-3b": E("meta-llama/Llama-3.2-3B-Instruct", "Llama 3", "llama3.2", 131072,
                     arch("llama", 3072, 8192, 28, 24, 8, 128256, True, head_dim=128, **LLAMA3), 3212749824),
    "llama3.1-8b": E("meta-llama/Llama-3.1-8B-Instruct", "Llama 3", "llama3.1", 131072,
                     arch("llama", 4096, 14336, 32, 32, 8, 128256, False, **LLAMA3), 8030261248,
                     revision="0e9e39f249a16976918f6564b8830bc894c89659"),
    "llama3.1-70b": E("meta-llama/Llama-3.1-70B-Instruct", "Llama 3", "llama3.1", 131072,
                      arch("llama", 8192, 28672, 80, 64, 8, 128256, False, **LLAMA3), 70553706496),
    "llama3.3-70b": E("meta-llama/Llama-3.3-70B-Instruct", "Llama 3", "llama3.3", 131072,
                      arch("llama", 8192, 28672, 80, 64, 8, 128256, False, **LLAMA3), 70553706496),
    # Qwen3 (Alibaba): dense and MoE
    "qwen3-0.6b": E("Qwen/Qwen3-0.6B", "Qwen3", "apache-2.0", 40960,
                    arch("qwen3", 1024, 3072, 28, 16, 8, 151936, True, **QWEN3), 596049920,
                    revision="c1899de289a04d12100db370d81485cdf75e47ca"),
    "qwen3-1.7b": E("Qwen/Qwen3-1.7B", "Qwen3", "apache-2.0", 40960,
                    arch("qwen3", 2048, 6144, 28, 16, 8, 151936, True, **QWEN3), 1720574976,
                    revision="70d244cc86ccca08cf5af4e1e306ecf908b1ad5e"),
    "qwen3-4b": E("Qwen/Qwen3-4B", "Qwen3", "apache-2.0", 40960,
                  arch("qwen3", 2560, 9728, 36, 32, 8, 151936, True, **QWEN3), 4022468096,
                  revision="1cfa9a7208912126459214e8b04321603b3df60c"),
    "qwen3-8b": E("Qwen/Qwen3-8B", "Qwen3", "apache-2.0", 40960,
                  arch("qwen3", 4096, 12288, 36, 32, 8, 151936, False, **QWEN3), 8190735360,
                  revision="b968826d9c46dd6066d109eabc6255188de91218"),
    "qwen3-14b": E("Qwen/Qwen3-14B", "Qwen3", "apache-2.0", 40960,
                   arch("qwen3", 5120, 17408, 40, 40, 8, 151936, False, **QWEN3), 14768307200),
    "qwen3-32b": E("Qwen/Qwen3-32B", "Qwen3", "apache-2.0", 40960,
                   arch("qwen3", 5120, 25600, 64, 64, 8, 151936, False, **QWEN3), 32762123264),
    "qwen3-30b-a3b": E("Qwen/Qwen3-30B-A3B", "Qwen3", "apache-2.0", 40960,
                       arch("qwen3_moe", 2048, 6144, 48, 32, 4, 151936, False, moe_intermediate_size=768,
                            num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                            norm_topk_prob=True, **QWEN3), 30532122624, 3353032704),
    "qwen3-235b-a22b": E("Qwen/Qwen3-235B-A22B", "Qwen3", "apache-2.0", 40960,
                         arch("qwen3_moe", 4096, 12288, 94, 64, 4, 151936, False, moe_intermediate_size=1536,
                              num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                              norm_topk_prob=True, **QWEN3), 235093634560, 22190763520),
    # Qwen2.5 (Alibaba)
    "qwen2.5-0.5b": E("Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5", "apache-2.0", 32768,
                      arch("qwen2", 896, 4864, 24, 14, 2, 151936, True), 494032768,
                      revision="7ae557604adf67be50417f59c2c2f167def9a775"),
    "qwen2.5-1.5b": E("Qwen/Qwen2.5-1.5B-Instruct", "Qwen2.5", "apache-2.0", 32768,
                      arch("qwen2", 1536, 8960, 28, 12, 2, 151936, True), 1543714304,
                      revision="989aa7980e4cf806f80c7fef2b1adb7bc71aa306"),
    "qwen2.5-3b": E("Qwen/Qwen2.5-3B-Instruct", "Qwen2.5", "qwen-research", 32768,
                    arch("qwen2", 2048, 11008, 36, 16, 2, 151936, True), 3085938688),
    "qwen2.5-7b": E("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5", "apache-2.0", 32768,
                    arch("qwen2", 3584, 18944, 28, 28, 4, 152064, False), 7615616512,
                    revision="a09a35458c702b33eeacc393d103063234e8bc28"),
    "qwen2.5-14b": E("Qwen/Qwen2.5-14B-Instruct", "Qwen2.5", "apache-2.0", 32768,
                     arch("qwen2", 5120, 13824, 48, 40, 8, 152064, False), 14770033664,
                     revision="cf98f3b3bbb457ad9e2bb7baf9a0125b6b88caa8"),
    "qwen2.5-32b": E("Qwen/Qwen2.5-32B-Instruct", "Qwen2.5", "apache-2.0", 32768,
                     arch("qwen2", 5120, 27648, 64, 40, 8, 152064, False), 32763876352),
    "qwen2.5-72b": E("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5", "qwen", 32768,
                     arch("qwen2", 8192, 29568, 80, 64, 8, 152064, False), 72706203648),
    # Gemma 3 (Google): five sliding-window layers to one global; 4B-27B carry a vision tower
    "gemma3-270m": E("google/gemma-3-270m-it", "Gemma 3", "gemma", 32768,
                     arch("gemma3_text", 640, 2048, 18, 4, 1, 262144, True, head_dim=256, sliding_window=512,
                          layer_types=every_sixth_global(18), **GEMMA3), 268098176),
    "gemma3-1b": E("google/gemma-3-1b-it", "Gemma 3", "gemma", 32768,
                   arch("gemma3_text", 1152, 6912, 26, 4, 1, 262144, True, head_dim=256, sliding_window=512,
                        layer_types=every_sixth_global(26), **GEMMA3), 999885952),
    "gemma3-4b": E("google/gemma-3-4b-it", "Gemma 3", "gemma", 131072, gemma3_vision(
                   arch("gemma3_text", 2560, 10240, 34, 8, 4, 262208, True, head_dim=256, sliding_window=1024,
                        layer_types=every_sixth_global(34), **GEMMA3)), 4300079472),
    "gemma3-12b": E("google/gemma-3-12b-it", "Gemma 3", "gemma", 131072, gemma3_vision(
                    arch("gemma3_text", 3840, 15360, 48, 16, 8, 262208, True, head_dim=256, sliding_window=1024,
                         layer_types=every_sixth_global(48), **GEMMA3)), 12187325040),
    "gemma3-27b": E("google/gemma-3-27b-it", "Gemma 3", "gemma", 131072, gemma3_vision(
                    arch("gemma3_text", 5376, 21504, 62, 32, 16, 262208, True, head_dim=128, sliding_window=1024,
                         layer_types=every_sixth_global(62), **{**GEMMA3, "query_pre_attn_scalar": 168})), 27432406640),
    # Mistral / Ministral (Mistral AI)
    "mistral-7b": E("mistralai/Mistral-7B-Instruct-v0.3", "Mistral", "apache-2.0", 32768,
                    arch("mistral", 4096, 14336, 32, 32, 8, 32768, False, rope_theta=1000000.0), 7248023552),
    "ministral-8b": E("mistralai/Ministral-8B-Instruct-2410", "Mistral", "mrl", 32768,
                      arch("mistral", 4096, 12288, 36, 32, 8, 131072, False, head_dim=128, rope_theta=100000000.0),
                      8019808256, 8019808256),
    "mistral-nemo-12b": E("mistralai/Mistral-Nemo-Instruct-2407", "Mistral", "apache-2.0", 1024000,
                          arch("mistral", 5120, 14336, 40, 32, 8, 131072, False, head_dim=128, rope_theta=1000000.0),
                          12247782400, 12247782400),
    "mistral-small-24b": E("mistralai/Mistral-Small-24B-Instruct-2501", "Mistral", "apache-2.0", 32768,
                           arch("mistral", 5120, 32768, 40, 32, 8, 131072, False, head_dim=128,
                                rope_theta=100000000.0), 23572403200),
    # Phi-4 (Microsoft)
    "phi4-mini": E("microsoft/Phi-4-mini-instruct", "Phi-4", "mit", 131072,
                   arch("phi3", 3072, 8192, 32, 24, 8, 200064, True, partial_rotary_factor=0.75), 3836021760),
    "phi4": E("microsoft/phi-4", "Phi-4", "mit", 16384,
              arch("phi3", 5120, 17920, 40, 40, 10, 100352, False, rope_theta=250000.0), 14659507200),
    # OLMo 2 (Ai2)
    "olmo2-1b": E("allenai/OLMo-2-0425-1B-Instruct", "OLMo 2", "apache-2.0", 4096,
                  arch("olmo2", 2048, 8192, 16, 16, 16, 100352, False, rope_theta=500000.0), 1484916736),
    "olmo2-7b": E("allenai/OLMo-2-1124-7B-Instruct", "OLMo 2", "apache-2.0", 4096,
                  arch("olmo2", 4096, 11008, 32, 32, 32, 100352, False, rope_theta=500000.0), 7298617344),
    "olmo2-13b": E("allenai/OLMo-2-1124-13B-Instruct", "OLMo 2", "apache-2.0", 4096,
                   arch("olmo2", 5120, 13824, 40, 40, 40, 100352, False, rope_theta=500000.0), 13716198400),
    "olmo2-32b": E("allenai/OLMo-2-0325-32B-Instruct", "OLMo 2", "apache-2.0", 4096,
                   arch("olmo2", 5120, 27648, 64, 40, 8, 100352, False, rope_theta=500000.0), 32234279936),
    # gpt-oss (OpenAI): MoE with attention sinks, alternating sliding-window and full attention
    "gpt-oss-20b": E("openai/gpt-oss-20b", "gpt-oss", "apache-2.0", 131072,
                     arch("gpt_oss", 2880, 2880, 24, 64, 8, 201088, False, head_dim=64, num_local_experts=32,
                          num_experts_per_tok=4, sliding_window=128, rope_theta=150000.0,
                          layer_types=["sliding_attention", "full_attention"] * 12), 20914757184, 4187440704),
    "gpt-oss-120b": E("openai/gpt-oss-120b", "gpt-oss", "apache-2.0", 131072,
                      arch("gpt_oss", 2880, 2880, 36, 64, 8, 201088, False, head_dim=64, num_local_experts=128,
                           num_experts_per_tok=4, sliding_window=128, rope_theta=150000.0,
                           layer_types=["sliding_attention", "full_attention"] * 18), 116829156672, 5711982912),
    # DeepSeek-R1 distills (DeepSeek): Qwen2.5 and Llama 3 bases
    "r1-distill-qwen-1.5b": E("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "DeepSeek-R1 distill", "mit", 131072,
                              arch("qwen2", 1536, 8960, 28, 12, 2, 151936, False, rope_theta=10000.0), 1777088000),
    "r1-distill-qwen-7b": E("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "DeepSeek-R1 distill", "mit", 131072,
                            arch("qwen2", 3584, 18944, 28, 28, 4, 152064, False, rope_theta=10000.0), 7615616512),
    "r1-distill-qwen-14b": E("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "DeepSeek-R1 distill", "mit", 131072,
                             arch("qwen2", 5120, 13824, 48, 40, 8, 152064, False, rope_theta=1000000.0), 14770033664),
    "r1-distill-qwen-32b": E("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "DeepSeek-R1 distill", "mit", 131072,
                             arch("qwen2", 5120, 27648, 64, 40, 8, 152064, False, rope_theta=1000000.0), 32763876352),
    "r1-distill-llama-8b": E("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "DeepSeek-R1 distill", "mit", 131072,
                             arch("llama", 4096, 14336, 32, 32, 8, 128256, False, **LLAMA3), 8030261248),
    "r1-distill-llama-70b": E("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "DeepSeek-R1 distill", "mit", 131072,
                              arch("llama", 8192, 28672, 80, 64, 8, 128256, False, **LLAMA3), 70553706496),
}


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # the routed-expert count


def num_experts(config) -> int:
    """How many routed experts each MoE layer of a (text) config has; 0 for a dense model."""
    for key in MOE_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 1:
            return v
    return 0


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # total less the routed-expert tensors a token does not visit
    experts: int  # the routed experts' tensors, all of them
    source: str = "config"  # "config": the model built on the meta device; "safetensors": the stored tensors' headers


def _active(total: int, experts: int, text_config) -> int:
    """The total less the routed experts a token does not visit (top_k of them run)."""
    n = num_experts(text_config)
    top_k = getattr(text_config, "num_experts_per_tok", None) or getattr(text_config, "experts_per_token", None) or n
    return total - (experts - experts * top_k // n) if n else total


def hf_config(config: dict[str, Any]):
    """A transformers config from a row's fields (or a config.json's contents)."""
    from transformers import AutoConfig

    fields = dict(config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def count_params(config, trust_remote_code: bool = False) -> ParamCount:
    """Count a model's parameters from its config (a dict of config.json fields or a transformers config) by
    building it on the meta device: tied tensors once, every buffer left out."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config) if isinstance(config, dict) else config
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    model.tie_weights()  # init_empty_weights swaps each tensor for a meta one after from_config tied them
    total = experts = 0
    for name, p in model.named_parameters():  # named_parameters yields a tied tensor once
        total += p.numel()
        if ".experts." in name:  # routed experts, fused (experts.gate_up_proj) or one module each (experts.3.w1)
            experts += p.numel()
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return ParamCount(total, _active(total, experts, text), experts)


def count_stored(directory: Path, fields: dict[str, Any]) -> Optional[ParamCount]:
    """Count from the headers of a directory's safetensors files, no tensor read: for a model transformers cannot
    build here. Elements as stored (a quantized checkpoint's packed tensors count packed); None without any."""
    from math import prod
    from types import SimpleNamespace

    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = experts = 0
    for file in files:
        with safe_open(file, framework="numpy") as stored:
            for name in stored.keys():
                n = prod(stored.get_slice(name).get_shape())
                total += n
                experts += n if ".experts." in name else 0
    text = SimpleNamespace(**(fields.get("text_config") or fields))
    return ParamCount(total, _active(total, experts, text), experts, "safetensors")


def size_local(path: str | Path, trust_remote_code: bool = False) -> ParamCount:
    """Count the parameters of a local model directory from its config.json (no weights read), or, for a model
    transformers cannot build here (or on an install without torch), from its safetensors headers."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        raise YetoError(f"{path} has no config.json: give a Hugging Face model directory")
    try:
        fields = json.loads(config.read_text())
    except ValueError as e:
        raise YetoError(f"{config} is not valid JSON ({e}): fix or re-download it") from e
    if "model_type" not in fields:
        raise YetoError(f"{config} names no model_type: it is not a transformers model's config")
    reason = None
    if missing_torch() is None:
        try:
            return count_params(fields, trust_remote_code)
        except (ValueError, KeyError) as e:
            reason = f"transformers cannot build {fields['model_type']!r} from {config} ({e})"
    stored = count_stored(config.parent, fields)
    if stored is not None:
        return stored
    if reason is None:  # an install without torch, and nothing stored to count
        require_torch("counting a model from its config.json")
    raise YetoError(f"{reason} and the directory has no safetensors to count; if the repo ships its own code, pass "
                    "--trust-remote-code")


def human(n: Optional[int]) -> str:
    """A parameter count as people write it: 134.5M, 8.03B, 235.1B ('?' where not known)."""
    if n is None:
        return "?"
    if n >= 10**11:
        return f"{n / 1e9:.1f}B"
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M"


def row(alias: str, e: Entry) -> dict[str, Any]:
    """One alias as `yeto models --json` shows it."""
    return dict(alias=alias, hub_id=e.hub_id, revision=e.revision, family=e.family, architecture=e.architecture,
                total_params=e.total, active_params=e.active, context=e.context, license=e.license,
                trust_remote_code=e.trust_remote_code, counted_from="config" if e.config else None)


def config_dir(name: str) -> tuple[Path, Optional[str]]:
    """(the directory holding config.json, the hub id or None) of a local model directory or a hub id whose config.json
    this machine's Hugging Face cache holds."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path, None
    parts = name.split("/")
    cached = None
    if len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    if not isinstance(cached, str):
        raise YetoError(f"--model {name}: not an alias, a local model directory or a hub id in this machine's "
                        "Hugging Face cache: fetch its config.json (`hf download ID config.json`) and retry")
    return Path(cached).parent, name


def context_length(model_dir: str | Path) -> Optional[int]:
    """The tokens a model's positions reach (`max_position_embeddings` of config.json, or of its text config in a
    multimodal one), read without loading weights; None when the config does not say."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or config
    context = text.get("max_position_embeddings")
    return int(context) if isinstance(context, int) else None


def sized_row(name: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """`yeto models --model NAME`: an alias's row, or a local directory or a hub id whose config.json this machine's
    Hugging Face cache holds, counted from that config.json."""
    if name in CATALOG:
        return row(name, CATALOG[name])
    path, hub_id = config_dir(name)
    count = size_local(path, trust_remote_code)
    config = json.loads((path / "config.json").read_text())
    return dict(alias=name, hub_id=hub_id, revision=path.name if hub_id else None, family=None,
                architecture=config["model_type"], total_params=count.total, active_params=count.active,
                context=context_length(path), license=None, trust_remote_code=trust_remote_code,
                counted_from=count.source)


def stale_counts() -> list[str]:
    """Lines naming each row whose kept counts differ from a recount (empty when all agree)."""
    out = []
    for alias, e in CATALOG.items():
        if e.config is None:
            continue
        c = count_params(e.config)
        if (c.total, c.active) != (e.total, e.active):
            out.append(f"{alias}: kept {e.total}, {e.active}; counted {c.total}, {c.active}")
    return out


if __name__ == "__main__":
    stale = stale_counts()
    print("\n".join(stale) or f"all {len(CATALOG)} rows' counts agree")
    sys.exit(1 if stale else 0)
