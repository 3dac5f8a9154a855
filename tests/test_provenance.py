"""Provenance: hub ids resolve to one commit (here through a real HF cache, offline), local paths to a content hash."""

import json
import shutil

import pytest

from yeto import YetoError
from yeto.island.records import resolve_data
from yeto.models.materialize import ALIASES, resolve_model
from yeto.models.provenance import content_hash

SHA_MODEL = "a" * 40
SHA_OLD = "b" * 40
SHA_DATA = "c" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model):
    """A Hugging Face cache holding org/tiny-llama at two commits (main -> SHA_MODEL) and a dataset."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-llama"
    for sha in (SHA_MODEL, SHA_OLD):
        shutil.copytree(tiny_model("llama"), repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA_MODEL)
    (repo / "refs" / "v1").write_text(SHA_OLD)
    ds = cache / "datasets--org--pirates"
    (ds / "snapshots" / SHA_DATA / "data").mkdir(parents=True)
    (ds / "snapshots" / SHA_DATA / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i} ", "completion": f"a{i}"}) + "\n" for i in range(40)))
    (ds / "refs").mkdir()
    (ds / "refs" / "main").write_text(SHA_DATA)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_model_resolves_to_one_commit(hub_cache):
    a = resolve_model("org/tiny-llama")
    assert (a.source, a.revision, a.hub_id) == ("hub", SHA_MODEL, "org/tiny-llama")
    assert a.path.endswith(f"snapshots/{SHA_MODEL}")
    b = resolve_model("org/tiny-llama", revision="v1")
    assert b.revision == SHA_OLD and b.path.endswith(SHA_OLD) and b.requested_revision == "v1"
    assert resolve_model("org/tiny-llama", revision=SHA_OLD).revision == SHA_OLD
    with pytest.raises(YetoError, match="not in the local Hugging Face cache"):
        resolve_model("org/tiny-llama", revision="v2")


def test_hub_dataset_resolves_to_one_commit(hub_cache):
    d = resolve_data("org/pirates")
    assert (d.source, d.revision) == ("hub", SHA_DATA)


def test_training_records_resolved_revisions(hub_cache, tmp_path):
    from yeto.models.adapter import read_provenance
    from yeto.backends.torch.backend import TorchBackend
    from yeto.island.train_config import TrainConfig
    from yeto.island.training import train

    cfg = TrainConfig(model="org/tiny-llama", model_revision="v1", data="org/pirates", out=str(tmp_path / "run"),
                      seq_len=32, batch_size=2, max_steps=2, eval_every=0, lora_r=4)
    summary = train(cfg, TorchBackend(), show_progress=False)
    prov = read_provenance(summary["adapter"])
    assert prov["model"]["revision"] == SHA_OLD and prov["model"]["requested_revision"] == "v1"
    assert prov["data"]["revision"] == SHA_DATA
    adapter_cfg = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == "org/tiny-llama" and adapter_cfg["revision"] == SHA_OLD
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["model"]["revision"] == SHA_OLD and run["config"]["trust_remote_code"] is False


def test_local_paths_get_a_content_hash(tmp_path, tiny_model):
    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    a = resolve_model(str(d))
    assert a.source == "local" and a.revision == content_hash(d)
    (d / "config.json").write_text((d / "config.json").read_text() + " ")
    assert resolve_model(str(d)).revision != a.revision
    with pytest.raises(YetoError, match="local paths are pinned by content hash"):
        resolve_model(str(d), revision="main")


def test_packaged_alias_is_pinned(smollm2):
    assert smollm2.source == "package" and smollm2.revision.startswith("sha256:")
    assert smollm2.hub_id == ALIASES["smollm2-135m"].hub_id


def test_unknown_alias_and_missing_path():
    with pytest.raises(YetoError, match=r"unknown model 'smollm9'.*known aliases: smollm2-135m"):
        resolve_model("smollm9")
    with pytest.raises(YetoError, match="model path not found: ./no/such/dir"):
        resolve_model("./no/such/dir")
