"""The adapter's wire layout: tensors sorted by canonical (peft) name, packed into fragments.

Fragments are built from names and sizes only, so two islands whose adapters
have the same names and shapes get identical fragments whatever their backend.
The fingerprint (a hash of names, shapes and dtypes) is exchanged at join; a
island whose layout differs is refused with the first mismatching tensor named.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

DEFAULT_FRAGMENT_NUMEL = 1 << 22  # 4M values: 16 MiB fp32, 2 MiB at 4 bits (the most a fragment holds)
# an island's layout packs its adapter into about this many fragments (fewer where a fragment would hold less than
# MIN_FRAGMENT_NUMEL), so that a run may stream them in up to this many parts (`stream_part`)
STREAM_GRANULES = 32
MIN_FRAGMENT_NUMEL = 1 << 8
MAX_STREAM_PARTS = STREAM_GRANULES
WIRE_DTYPE = "float32"  # every backend exchanges fp32 views, whatever it trains in
MAX_DIM = 1 << 31  # no adapter tensor dimension (nor fragment) is larger


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = WIRE_DTYPE

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]
    offsets: tuple[int, ...]  # start of each tensor inside the fragment
    numel: int
    start: int  # offset of the fragment inside the whole flat adapter


@dataclass(frozen=True)
class Layout:
    specs: tuple[TensorSpec, ...]
    fragments: tuple[Fragment, ...]
    fingerprint: str
    max_fragment_numel: int = DEFAULT_FRAGMENT_NUMEL

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    def spec(self, name: str) -> TensorSpec:
        return self._by_name[name]

    @property
    def _by_name(self) -> dict[str, TensorSpec]:
        return {s.name: s for s in self.specs}

    def tensor_slices(self) -> dict[str, slice]:
        """Where each tensor lies in the flat adapter (fragments back to back)."""
        by_name = self._by_name
        return {name: slice(f.start + off, f.start + off + by_name[name].numel)
                for f in self.fragments for name, off in zip(f.names, f.offsets)}

    def to_json(self) -> dict[str, Any]:
        return {"specs": [[s.name, list(s.shape), s.dtype] for s in self.specs], "fingerprint": self.fingerprint,
                "fragment_numel": self.max_fragment_numel}


def fingerprint(specs: tuple[TensorSpec, ...]) -> str:
    blob = json.dumps([[s.name, list(s.shape), s.dtype] for s in specs], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def specs_of(named: Mapping[str, Any]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name, tuple(int(d) for d in named[name].shape)) for name in sorted(named))


def build_layout(named: Mapping[str, Any], max_fragment_numel: int | None = None) -> Layout:
    """Sort by name, then fill fragments greedily up to `max_fragment_numel` values (default: `fragment_bound`).

    A single tensor larger than the bound gets a fragment of its own.
    """
    if not named:
        raise ValueError("an adapter layout needs at least one tensor")
    specs = specs_of(named)
    return layout_from_specs(specs, max_fragment_numel or fragment_bound(sum(s.numel for s in specs)))


def fragment_bound(numel: int) -> int:
    """The fragment size an island packs an adapter of `numel` values with: about STREAM_GRANULES fragments, each
    between MIN_FRAGMENT_NUMEL and DEFAULT_FRAGMENT_NUMEL values (names and sizes alone decide it, so every island
    of a run packs alike)."""
    return min(DEFAULT_FRAGMENT_NUMEL, max(MIN_FRAGMENT_NUMEL, -(-numel // STREAM_GRANULES)))


def stream_parts(layout: Layout, parts: int) -> tuple[tuple[int, ...], ...]:
    """The parts a run streaming its adapter in `parts` parts syncs in turn: P = min(parts, fragments) contiguous runs
    of fragments (canonical names), never empty, of about N / P values each (N values in the adapter).

    Part k holds the fragments whose first value lies in [k N / P, (k + 1) N / P) of the flat adapter, its start moved
    where that would leave an earlier part empty or a later one without a fragment (a fragment larger than N / P
    ends up alone in its part).
    """
    n = len(layout.fragments)
    p = max(1, min(parts, n))
    starts = [f.start for f in layout.fragments]
    cuts = [0]
    for k in range(1, p):
        target = k * layout.numel / p
        cuts.append(min(max(bisect.bisect_left(starts, target), cuts[-1] + 1), n - (p - k)))
    cuts.append(n)
    return tuple(tuple(range(a, b)) for a, b in zip(cuts, cuts[1:]))


def stream_part(layout: Layout, parts: int, round_number: int) -> tuple[int, ...]:
    """The fragments round `round_number` syncs (`stream_parts`; 1 part: all of them). Rounds take the parts in turn,
    round r part (r - 1) mod P, so each part syncs every P rounds."""
    cycle = stream_parts(layout, parts)
    return cycle[(round_number - 1) % len(cycle)]


def round_part(layout: Layout, parts: int, round_number: int, last_round: int) -> Optional[tuple[int, ...]]:
    """The fragments round `round_number` syncs, None: the whole adapter. A run that streams (`parts` > 1) syncs its
    parts in turn (`stream_part`), and its last round (`last_round`: --outer-steps) the whole adapter: each part then
    brings every step since its own last sync, so no step of the run is left out of the final adapter."""
    if parts <= 1 or round_number >= last_round:
        return None
    return stream_part(layout, parts, round_number)


def untouched_since(layout: Layout, parts: int, round_number: int, base_version: int, last_round: int) -> bool:
    """Does round `round_number`'s part hold the same values in every version from `base_version` to the one the round
    opens on? Version v is round v's merge, so: do rounds base_version + 1 .. round_number - 1 sync only fragments
    round `round_number` does not? Then a delta of that part trained from `base_version` is as fresh as one trained
    from the round's own base (a pipelined push, `--pipeline`)."""
    mine = set(synced_fragments(layout, round_part(layout, parts, round_number, last_round)))
    return all(mine.isdisjoint(synced_fragments(layout, round_part(layout, parts, k, last_round)))
               for k in range(base_version + 1, round_number))


def synced_fragments(layout: Layout, part: Optional[tuple[int, ...]]) -> tuple[int, ...]:
    """The fragments a round with this part syncs (`round_part`'s None: every one)."""
    return tuple(range(len(layout.fragments))) if part is None else part


def fragment_pieces(layout: Layout, indices: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, numel) in the flat adapter of each listed fragment."""
    return [(layout.fragments[i].start, layout.fragments[i].numel) for i in indices]


def layout_from_specs(specs: tuple[TensorSpec, ...], max_fragment_numel: int = DEFAULT_FRAGMENT_NUMEL) -> Layout:
    if max_fragment_numel < 1:
        raise ValueError("max_fragment_numel must be positive")
    specs = tuple(sorted(specs, key=lambda s: s.name))
    fragments: list[Fragment] = []
    names: list[str] = []
    offsets: list[int] = []
    size = 0
    start = 0

    def close() -> None:
        nonlocal names, offsets, size, start
        if names:
            fragments.append(Fragment(len(fragments), tuple(names), tuple(offsets), size, start))
            start += size
        names, offsets, size = [], [], 0

    for s in specs:
        if names and size + s.numel > max_fragment_numel:
            close()
        names.append(s.name)
        offsets.append(size)
        size += s.numel
    close()
    return Layout(specs, tuple(fragments), fingerprint(specs), max_fragment_numel)


def layout_from_json(d: Mapping[str, Any]) -> Layout:
    """A layout as a peer described it; a shape or bound no adapter could have is a ValueError."""
    specs = tuple(TensorSpec(str(n), tuple(int(x) for x in shape), str(dt)) for n, shape, dt in d["specs"])
    if not specs or len({s.name for s in specs}) != len(specs):
        raise ValueError("a layout needs at least one tensor, each named once")
    for s in specs:
        if not s.shape or any(not 0 < x <= MAX_DIM for x in s.shape) or s.dtype != WIRE_DTYPE:
            raise ValueError(f"tensor {s.name[:80]} has shape {list(s.shape)[:8]} / dtype {s.dtype[:20]}: dimensions "
                             f"must be 1..{MAX_DIM} and the dtype {WIRE_DTYPE}")
    bound = int(d.get("fragment_numel") or DEFAULT_FRAGMENT_NUMEL)
    if not 0 < bound <= MAX_DIM:
        raise ValueError(f"fragment_numel {bound} is out of range")
    return layout_from_specs(specs, bound)


def layout_mismatch(expected: Layout, got: Layout) -> str | None:
    """None if the layouts agree, else a message naming the first tensor that differs."""
    same_fragments = [f.numel for f in expected.fragments] == [f.numel for f in got.fragments]
    if expected.fingerprint == got.fingerprint and same_fragments:
        return None
    a, b = {s.name: s for s in expected.specs}, {s.name: s for s in got.specs}
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"tensor {name} {list(a[name].shape)} is missing from the island's adapter"
        if name not in a:
            return f"tensor {name} {list(b[name].shape)} is not in the syncer's adapter"
        if a[name] != b[name]:
            return (f"tensor {name}: syncer has {list(a[name].shape)} {a[name].dtype}, "
                    f"island has {list(b[name].shape)} {b[name].dtype}")
    return "fragment sizes differ (different --fragment-numel)"


def pack_fragment(layout: Layout, index: int, tensors: Mapping[str, Any]) -> np.ndarray:
    """The fragment's tensors, flattened in name order into one fp32 vector."""
    frag = layout.fragments[index]
    out = np.empty(frag.numel, dtype=np.float32)
    for name, off in zip(frag.names, frag.offsets):
        t = np.asarray(tensors[name], dtype=np.float32)
        n = layout.spec(name).numel
        if t.size != n:
            raise ValueError(f"tensor {name} has {t.size} values, layout expects {n}")
        out[off : off + n] = t.reshape(-1)
    return out


def unpack_fragment(layout: Layout, index: int, flat: np.ndarray) -> dict[str, np.ndarray]:
    frag = layout.fragments[index]
    if flat.size != frag.numel:
        raise ValueError(f"fragment {index} has {flat.size} values, layout expects {frag.numel}")
    by_name = layout._by_name
    return {name: flat[off : off + by_name[name].numel].reshape(by_name[name].shape).copy()
            for name, off in zip(frag.names, frag.offsets)}


def flatten(layout: Layout, tensors: Mapping[str, Any]) -> np.ndarray:
    """The whole adapter as one fp32 vector (fragments back to back)."""
    return np.concatenate([pack_fragment(layout, f.index, tensors) for f in layout.fragments])


def unflatten(layout: Layout, flat: np.ndarray) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in layout.fragments:
        out.update(unpack_fragment(layout, f.index, flat[f.start : f.start + f.numel]))
    return out
