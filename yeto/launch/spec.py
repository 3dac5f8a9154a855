"""`--gpu SPEC[,SPEC...]`: where each island runs, one island per entry.

    cloud:[NODESx]COUNTxGPU[@region]    aws:1xA10G@us-west-2  runpod:8xH100  gcp:2x8xA100@us-central1  k8s:1xL4
    local:N                             N islands on this machine

Parsing is pure (no SkyPilot import): a typo is caught before anything is provisioned, and SkyPilot's own
objects judge the rest (an unknown GPU name, a region the cloud lacks) when the tasks are built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from yeto import YetoError

GRAMMAR = ("cloud:[NODESx]COUNTxGPU[@region], e.g. aws:1xA10G@us-west-2, runpod:8xH100, gcp:2x8xA100@us-central1, "
           "k8s:1xL4; or local:N")
# Our short names for SkyPilot's infra names; any other cloud name goes to SkyPilot as written.
CLOUD_ALIASES = {"k8s": "kubernetes"}
_CLOUD = re.compile(r"^[a-z][a-z0-9-]*$")
_SHAPE = re.compile(r"^(?:(?P<nodes>\d+)x)?(?P<count>\d+)x(?P<gpu>[A-Za-z][A-Za-z0-9_.-]*)$")
_REGION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]*$")
# bounds that catch a typo (a digit too many) before anything is provisioned, well above any real island
MAX_NODES = 64
MAX_GPUS_PER_NODE = 16
MAX_LOCAL_ISLANDS = 64


@dataclass(frozen=True)
class IslandSpec:
    """One island: `nodes` machines with `count` GPUs each (a multi-node island runs under torchrun)."""

    cloud: str  # SkyPilot's infra name ("aws", "kubernetes"), or "local"
    count: int  # GPUs per node (local: 0)
    gpu: Optional[str] = None
    nodes: int = 1
    region: Optional[str] = None
    text: str = ""  # as the user wrote it, for messages

    @property
    def local(self) -> bool:
        return self.cloud == "local"

    @property
    def infra(self) -> str:
        """SkyPilot's `infra=` string: cloud or cloud/region (kubernetes: its context)."""
        return f"{self.cloud}/{self.region}" if self.region else self.cloud

    @property
    def gpus(self) -> int:
        return self.nodes * self.count

    @property
    def accelerators(self) -> str:
        return f"{self.gpu}:{self.count}"


def _bad(entry: str, why: str) -> YetoError:
    return YetoError(f"--gpu entry {entry!r}: {why}; the grammar is {GRAMMAR}")


def parse_entry(entry: str) -> list[IslandSpec]:
    """One comma-separated entry: a cloud island, or local:N (N local islands)."""
    entry = entry.strip()
    cloud, colon, rest = entry.partition(":")
    cloud = cloud.strip().lower()
    if not colon or not cloud or not rest:
        raise _bad(entry, "expected CLOUD:SHAPE")
    if cloud == "local":
        if not rest.isdigit() or not 1 <= int(rest) <= MAX_LOCAL_ISLANDS:
            raise _bad(entry, f"local:N needs N from 1 to {MAX_LOCAL_ISLANDS}")
        return [IslandSpec("local", 0, text=entry) for _ in range(int(rest))]
    if not _CLOUD.match(cloud):
        raise _bad(entry, f"{cloud!r} is not a cloud name")
    shape, at, region = rest.partition("@")
    if at and not _REGION.match(region):
        raise _bad(entry, f"region {region!r} is empty or has characters no region has")
    m = _SHAPE.match(shape)
    if m is None:
        raise _bad(entry, f"{shape!r} is not [NODESx]COUNTxGPU")
    nodes, count = int(m["nodes"] or 1), int(m["count"])
    if not 1 <= nodes <= MAX_NODES:
        raise _bad(entry, f"NODES must be from 1 to {MAX_NODES}, got {nodes}")
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise _bad(entry, f"COUNT (GPUs per node) must be from 1 to {MAX_GPUS_PER_NODE}, got {count}")
    return [IslandSpec(CLOUD_ALIASES.get(cloud, cloud), count, m["gpu"], nodes, region or None, entry)]


def parse_gpu(text: str) -> list[IslandSpec]:
    """Every island of a --gpu value, in order (their position is their island id)."""
    entries = [e for e in text.split(",")]
    if not text.strip() or any(not e.strip() for e in entries):
        raise YetoError(f"--gpu {text!r}: an empty entry; the grammar is {GRAMMAR}, entries separated by commas")
    islands = [island for e in entries for island in parse_entry(e)]
    if any(i.local for i in islands) and not all(i.local for i in islands):
        raise YetoError(f"--gpu {text!r}: local islands cannot be mixed with cloud ones (the head would be this "
                        "machine for some and a VM for others); add this machine to a cloud run with "
                        "--external-islands and run the printed join command here")
    return islands
