"""Pin what is trained: hub ids resolve to one commit, local paths to a content hash.

Everything an island loads (weights, config, tokenizer, data) comes from the
snapshot directory materialized at the resolved commit, so the recorded revision
is exactly what was used.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from yeto import YetoError


@dataclass(frozen=True)
class Artifact:
    """One input of a run, as it was resolved."""

    name: str  # what the user asked for (alias, hub id or path)
    kind: str  # "model" or "dataset"
    source: str  # "hub", "local" or "package"
    path: str  # the directory (or file) that was actually loaded
    revision: str  # commit sha for hub, "sha256:..." for local/package content
    requested_revision: str | None = None
    hub_id: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def content_hash(path: str | Path) -> str:
    """sha256 over relative paths and bytes of every file, in sorted order."""
    path = Path(path)
    if not path.exists():
        raise YetoError(f"path not found: {path}")
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        rel = f.name if path.is_file() else f.relative_to(path).as_posix()
        if "/." in f"/{rel}" or "__pycache__" in rel:
            continue  # hidden files and caches are not content
        h.update(rel.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def resolve_hub_snapshot(repo_id: str, revision: str | None, repo_type: str = "model") -> tuple[Path, str]:
    """Resolve (repo, revision) to one commit and materialize that commit's snapshot.

    Online: ask the hub for the commit sha, then download exactly that commit.
    Offline (HF_HUB_OFFLINE=1 or no network): resolve from the local HF cache,
    whose snapshot directory name is the commit sha.
    """
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    sha: str | None = None
    if not hub_offline():
        try:
            sha = HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type).sha
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise YetoError(f"{repo_type} {repo_id!r} at revision {revision or 'main'!r} "
                            f"not found on the hub: {e}") from e
        except (HfHubHTTPError, OSError, ValueError):
            sha = None  # no network: fall back to the cache below
        except Exception:  # httpx/transport errors differ across hub versions
            sha = None
    try:
        path = snapshot_download(
            repo_id, revision=sha or revision, repo_type=repo_type, local_files_only=sha is None
        )
    except LocalEntryNotFoundError as e:
        raise YetoError(
            f"cannot resolve {repo_type} {repo_id!r} at revision {revision or 'main'!r}: "
            "the hub is unreachable and it is not in the local Hugging Face cache"
        ) from e
    except Exception as e:
        raise YetoError(f"cannot materialize {repo_type} {repo_id!r} at revision {revision or 'main'!r}: {e}") from e
    path = Path(path)
    return path, sha or path.name


BUILTIN_LOSSES = ("cross_entropy",)


def loss_source(spec: str) -> Path | None:
    """The file a custom `--loss-function` (`module:function` or `path/to/loss.py:function`) is defined in, found
    without importing it; None for a built-in loss or a module that cannot be found."""
    if spec in BUILTIN_LOSSES or ":" not in spec:
        return None
    module = spec.rsplit(":", 1)[0]
    if module.endswith(".py"):
        return Path(module).expanduser()
    import importlib.util

    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def loss_identity(spec: str) -> str:
    """The loss as the run's contract pins it: a built-in's name, or a custom loss's function name and the sha256 of
    its source file (the same name with other code is another loss)."""
    source = loss_source(spec)
    if source is None or not source.is_file():
        return spec
    return f"{spec.rsplit(':', 1)[1]}@{content_hash(source)}"
