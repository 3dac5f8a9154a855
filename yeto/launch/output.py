"""`--output`: where the finished run's merged adapter goes (a local path, an object store, or the HF hub).

What is delivered: the peft adapter directory (with its provenance), the tape and the tape's plot when drawn. A
delivery is confirmed by listing it back; only a confirmed delivery lets the head tear itself down.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from yeto import YetoError, one_line
from yeto.launch.plan import is_object_store
from yeto.sync.shell.tape import TAPE_FILE

HF_PREFIX = "hf://"
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _payload(syncer_out: Path) -> list[Path]:
    adapter = syncer_out / ADAPTER_DIR
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise YetoError(f"{adapter} holds no merged adapter ({ADAPTER_WEIGHTS}): the run did not finish a merge")
    return [p for p in (adapter, syncer_out / TAPE_FILE, syncer_out / "tape.png") if p.exists()]


def deliver(syncer_out: str | Path, dest: str) -> str:
    """Copy the run's result to `dest` and confirm it is there; returns where it is."""
    syncer_out = Path(syncer_out)
    items = _payload(syncer_out)
    if dest.startswith(HF_PREFIX):
        return _to_hub(items, dest[len(HF_PREFIX):])
    if is_object_store(dest):
        return _to_object_store(items, dest)
    target = Path(dest).expanduser()
    target.mkdir(parents=True, exist_ok=True)
    for p in items:
        if p.is_dir():
            shutil.copytree(p, target / p.name, dirs_exist_ok=True)
        else:
            shutil.copy2(p, target / p.name)
    if not (target / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file():
        raise YetoError(f"--output {dest}: the adapter is not there after copying")
    return str(target)


def _to_object_store(items: list[Path], dest: str) -> str:
    import fsspec  # (datasets' dependency) s3fs / gcsfs / adlfs are installed on the head with yeto[launch]

    try:
        fs, root = fsspec.core.url_to_fs(dest)
        for p in items:
            fs.put(str(p), f"{root.rstrip('/')}/{p.name}", recursive=p.is_dir())
        if not fs.exists(f"{root.rstrip('/')}/{ADAPTER_DIR}/{ADAPTER_WEIGHTS}"):
            raise YetoError(f"--output {dest}: the adapter is not there after the upload")
    except (ImportError, ValueError, OSError) as e:
        raise YetoError(f"--output {dest}: cannot write there ({one_line(e)}); install the store's fsspec "
                        "driver (s3fs, gcsfs, adlfs) and check the credentials") from e
    return dest


def _to_hub(items: list[Path], repo: str) -> str:
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, private=True, exist_ok=True)
        for p in items:
            if p.is_dir():
                api.upload_folder(repo_id=repo, folder_path=str(p), path_in_repo="")
            else:
                api.upload_file(repo_id=repo, path_or_fileobj=str(p), path_in_repo=p.name)
        if ADAPTER_WEIGHTS not in api.list_repo_files(repo):
            raise YetoError(f"--output hf://{repo}: the adapter is not in the repo after the upload")
    except YetoError:
        raise
    except Exception as e:  # the hub's errors differ across versions; any failure means the same to the user
        raise YetoError(f"--output hf://{repo}: upload failed ({one_line(e)}); check HF_TOKEN") from e
    return f"https://huggingface.co/{repo}"
