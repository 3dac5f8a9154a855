"""Shared fixtures: the real SmolLM2 (materialized once) and tiny random models built from configs."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# runs launched by tests are recorded here, not in the user's ~/.yeto/runs (`yeto status` would list them)
os.environ.setdefault("YETO_RUNS", tempfile.mkdtemp(prefix="yeto-test-runs-"))
DEMO_DATA = REPO / "data" / "demo" / "pirate_chat.jsonl"

TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "lfm2": dict(model_type="lfm2", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, block_auto_adjust_ff_dim=False,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64),
}

# the architecture matrix: one tiny model per architecture class of the catalog, shrunk from the first row of that
# class so the real config's structure stays (GQA, tied embeddings, sliding windows, conv blocks, MoE experts)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SMALL_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SMALL_FIELDS = dict(head_dim=16, sliding_window=16, block_ff_dim=128, block_multiple_of=32, num_dense_layers=1,
                    no_rope_layer_interval=2, query_pre_attn_scalar=16)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)


def shrink(config: dict) -> dict:
    """A catalog config at test size: two layers (one of each kind a hybrid has), four heads over two KV heads, four
    experts routing two; the fields that give it its structure kept."""
    if "text_config" in config:  # a multimodal checkpoint: its decoder shrunk, a tiny vision tower
        return {**config, "mm_tokens_per_image": 4, "vision_config": TINY_VISION,
                "text_config": {k: v for k, v in shrink({"model_type": "-", **config["text_config"]}).items()
                                if k != "model_type"}}
    small = {**config, **SMALL, **{k: v for k, v in SMALL_FIELDS.items() if k in config}}
    small.update({k: v for k, v in SMALL_MOE.items() if k in config})
    if "layer_types" in config:  # one layer of each kind, in the order they first appear
        kinds = list(dict.fromkeys(config["layer_types"]))
        small["layer_types"] = (kinds * 2)[:2] if len(kinds) < 2 else kinds[:2]
    return small


def architecture_classes() -> dict[str, dict]:
    from yeto.models.catalog import CATALOG

    out: dict[str, dict] = {}
    for entry in CATALOG.values():
        if entry.config is not None and entry.architecture not in out:
            out[entry.architecture] = shrink(entry.config)
    return out


ARCHITECTURES = architecture_classes()
TINY.update({kind: spec for kind, spec in ARCHITECTURES.items() if kind not in TINY})  # llama, lfm2: TINY's own


@pytest.fixture(scope="session")
def smollm2():
    from yeto.models.materialize import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    from yeto.models.materialize import load_tokenizer

    return load_tokenizer(smollm2)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer):
    """tiny_model(kind) -> path of a saved random model with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cache: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in cache:
            spec = dict(TINY[kind])
            tokens = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
            if "text_config" in spec:  # the decoder takes the tokenizer's vocabulary
                spec["text_config"] = {**spec["text_config"], **tokens}
                tokens = {k: v for k, v in tokens.items() if k != "vocab_size"}
            cfg = AutoConfig.for_model(spec.pop("model_type"), **{**spec, **tokens})
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg)
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            cache[kind] = path
        return cache[kind]

    return make


@pytest.fixture
def chat_file(tmp_path):
    def write(records, name="data.jsonl"):
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in records))
        return p

    return write


@pytest.fixture
def start_syncer(tmp_path):
    """start_syncer(**SyncerConfig fields) -> (syncer, port): a real syncer serving on loopback in a thread."""
    from yeto.launch.local import free_port
    from yeto.sync.shell.server import Syncer, SyncerConfig

    running = []

    def start(**kw):
        port = kw.pop("port", None) or free_port()
        kw.setdefault("insecure", True)  # protocol tests speak in clear; tests/test_security.py runs with keys
        kw.setdefault("island_keys", False)  # ... and the join key speaks for any id there unless a test asks
        cfg = SyncerConfig(port=port, host="127.0.0.1", out=str(kw.pop("out", tmp_path / "syncer")), **kw)
        s = Syncer(cfg)
        t = threading.Thread(target=s.serve, daemon=True)
        t.start()
        running.append((s, t))
        time.sleep(0.1)
        return s, port

    yield start
    for s, t in running:
        s.kill()
        t.join(5)
