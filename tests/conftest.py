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


@pytest.fixture(scope="session")
def smollm2():
    from yeto.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    from yeto.models import load_tokenizer

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
            cfg = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tokenizer),
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                       bos_token_id=tokenizer.bos_token_id, **spec)
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
