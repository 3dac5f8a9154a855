"""A fleet plan: everything `yeto launch` decided before it starts anything, as one JSON-able record.

Island ids follow the --gpu entries (island 0, 1, ...), then the reserved external slots. Model and data
revisions are pinned to commits here, once, so that every island (and a relaunched one) trains the same thing;
the syncer pins the same base model in the run's contract.
"""

from __future__ import annotations

import json
import re
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from yeto import YetoError, one_line
from yeto.island.records import DEMO_DATA
from yeto.launch.spec import IslandSpec

SYNCER_PORT = 29400  # a cloud syncer's public port (docs/PROTOCOL.md), apart from torchrun's 29500
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# SkyPilot's cluster names: lower case, digits and dashes, starting with a letter (and short enough for every cloud)
RUN_NAME = re.compile(r"^[a-z][a-z0-9-]{0,34}$")
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "r2://", "az://", "https://", "cos://", "oci://", "nebius://")  # data
REMOTE_OUTPUTS = ("s3://", "gs://", "az://", "hf://")  # where a cloud run's head can deliver its result


@dataclass
class FleetPlan:
    name: str
    out: str  # the run directory on this machine (local head: also the syncer's and islands' directories)
    islands: list[IslandSpec]
    external: int = 0
    mlx: int = 0
    model: str = "smollm2-135m"
    model_revision: Optional[str] = None
    data: str = DEMO_DATA
    data_revision: Optional[str] = None
    syncer_args: list[str] = field(default_factory=list)
    island_args: list[str] = field(default_factory=list)
    port: int = SYNCER_PORT
    spot: bool = True
    retry_until_up: bool = False
    recover_timeout: float = 1800.0
    output: Optional[str] = None
    head_infra: Optional[str] = None
    report_to: str = "none"  # every process's --report-to (yeto.report.trackers), its runs grouped by the run's name
    data_local: bool = False  # --data / --model are paths on the launching machine: shipped to the VMs
    model_local: bool = False

    @property
    def local(self) -> bool:
        return all(i.local for i in self.islands)

    @property
    def tracking_args(self) -> list[str]:
        """--report-to and --run-name for every process of the run (none: no flags)."""
        return ["--report-to", self.report_to, "--run-name", self.name] if self.report_to != "none" else []

    @property
    def num_islands(self) -> int:
        return len(self.islands) + self.external

    @property
    def external_ids(self) -> list[int]:
        return list(range(len(self.islands), self.num_islands))

    @property
    def head_cluster(self) -> str:
        return f"{self.name}-head"

    def cluster(self, island: int) -> str:
        return f"{self.name}-island-{island}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "FleetPlan":
        raw = json.loads(text)
        raw["islands"] = [IslandSpec(**i) for i in raw["islands"]]
        return FleetPlan(**raw)

    def ship_local_paths(self) -> None:
        """Cloud runs: local data and model directories travel with the tasks (the head forwards them)."""
        for attr, flag in (("data", "data_local"), ("model", "model_local")):
            path = Path(getattr(self, attr)).expanduser()
            if path.exists():
                setattr(self, attr, str(path.resolve()))
                setattr(self, flag, True)

    def check_sources(self, data_config: Optional[str] = None) -> None:
        """The model and the data as `yeto train` resolves them, fetching and loading nothing (a local data path is
        laid out as training reads it, with --data-config): refused here, not by every island after the fleet
        starts. A hub id is checked by `pin_revision`, on the hub."""
        from yeto.island.records import data_layout, data_source
        from yeto.models.materialize import model_source

        model_source(self.model, self.model_revision)
        if not is_object_store(self.data) and data_source(self.data, self.data_revision) == "local":
            data_layout(Path(self.data), data_config)

    def check(self) -> None:
        """Refuse a plan that cannot run, before anything is provisioned."""
        from yeto.report.trackers import parse_report_to
        from yeto.sync.core.checks import check_port

        parse_report_to(self.report_to)
        if not RUN_NAME.match(self.name):
            raise YetoError(f"--name {self.name!r}: a run name is a lower-case letter, then up to 34 lower-case "
                            "letters, digits or dashes (it names the run's clusters)")
        if self.external < 0 or self.mlx < 0:
            raise YetoError("--external-islands and --mlx-islands must be 0 or more")
        if self.mlx and not self.local:
            raise YetoError("--mlx-islands runs MLX islands on this machine, so it needs --gpu local:N; a Mac joins "
                            "a cloud run through --external-islands and its printed join command")
        if self.mlx > len(self.islands):
            raise YetoError(f"--mlx-islands {self.mlx} exceeds the {len(self.islands)} local islands of --gpu")
        if self.port:
            check_port(self.port, "--port")
        if self.recover_timeout <= 0:
            raise YetoError("--recover-timeout must be positive (seconds a lost island is relaunched for)")
        if not self.local and self.output and not self.output.startswith(REMOTE_OUTPUTS):
            raise YetoError(f"--output {self.output!r}: a cloud run's head cannot write to this machine, and its own "
                            "disk goes away with it; use an object store or the hub: s3://bucket/path, "
                            "gs://bucket/path, az://container/path or hf://org/repo")


# ---------------------------------------------------------------------------------------- revisions


def is_object_store(uri: str) -> bool:
    return uri.startswith(OBJECT_STORE_SCHEMES)


def _hub_id(name: str, kind: str) -> Optional[str]:
    """The hub repository `name` resolves from (as `yeto train` resolves it), or None when it is pinned otherwise
    (package, local, bucket)."""
    if is_object_store(name):
        return None
    if kind == "model":
        from yeto.models.materialize import ALIASES, model_source

        source = model_source(name)
        return ALIASES[name].hub_id if source == "alias" else name if source == "hub" else None
    from yeto.island.records import data_source

    return name if data_source(name) == "hub" else None


def _not_a_local_path(name: str, kind: str) -> Optional[str]:
    """What `yeto train` says of `name` as a missing local path, where it reads as one (its folder is here:
    data/demoo); None where it reads as a hub id only."""
    parent = Path(name).expanduser().parent
    if parent == Path(".") or not parent.is_dir():
        return None
    return f"model path not found: {name}" if kind == "model" else f"data file not found: {name}"


def pin_revision(name: str, revision: Optional[str], kind: str) -> Optional[str]:
    """The commit every island will use. A packaged alias, a local path or a bucket needs none (pinned by content,
    checked by the run's contract); a hub repository is asked for its commit now, before anything launches."""
    repo = _hub_id(name, kind)
    if repo is None:
        if revision is not None and kind == "model" and name in _aliases():
            return pin_revision(_aliases()[name].hub_id, revision, kind)
        return revision
    if revision is not None and COMMIT.match(revision):
        return revision
    flag = "--model-revision" if kind == "model" else "--data-revision"
    from huggingface_hub import HfApi, snapshot_download

    try:
        return HfApi().repo_info(repo, revision=revision, repo_type=kind).sha
    except Exception as e:  # the hub's errors differ across versions; any failure means the same to the user
        try:  # offline: the commit this machine's HF cache holds for that revision (what an island here would use)
            return Path(snapshot_download(repo, revision=revision, repo_type=kind, local_files_only=True)).name
        except Exception:
            pass
        missing = _not_a_local_path(name, kind)
        if missing is not None:
            raise YetoError(f"{missing} (nor a hub {kind} this machine can reach: {type(e).__name__})") from e
        raise YetoError(f"cannot pin {kind} {repo!r} at {revision or 'main'} to a commit ({one_line(e, 200)}): "
                        f"pass {flag} with a 40-hex commit, or check the name and your network") from e


def _aliases() -> dict[str, Any]:
    from yeto.models.materialize import ALIASES

    return ALIASES


# ---------------------------------------------------------------------------------------- flags


def _passed_fields() -> list[Field]:
    from yeto.sync.core.syncer import SyncerConfig

    own = {"port", "host", "islands", "out", "insecure", "join_key"}
    return [f for f in fields(SyncerConfig) if f.init and f.name not in own]


def syncer_flags() -> set[str]:
    """The syncer's flags that `yeto launch` passes through (every one except those the launch itself sets)."""
    from yeto.sync.core.config import OLD_FLAGS, field_flag

    return {field_flag(f.name) for f in _passed_fields()} | set(OLD_FLAGS)


def syncer_switches() -> set[str]:
    """Those of them that are on/off switches (`--x` / `--no-x`, no value follows)."""
    flags = [f.name.replace("_", "-") for f in _passed_fields() if "bool" in str(f.type)]
    return {f"--{x}" for x in flags} | {f"--no-{x}" for x in flags}


def split_extra_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Route `yeto launch`'s extra flags: the syncer's flags (with their value) to the syncer, the rest to every
    island (`--seq-len 128 --lr 1e-3`)."""
    ours, switches = syncer_flags(), syncer_switches()
    syncer, island = [], []
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in switches:
            syncer.append(args[i])
            i += 1
        elif name in ours:
            take = 1 if "=" in args[i] else 2
            if i + take > len(args):
                raise YetoError(f"{name} needs a value")
            syncer += args[i:i + take]
            i += take
        else:
            island.append(args[i])
            i += 1
    return syncer, island
