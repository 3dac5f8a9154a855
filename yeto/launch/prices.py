"""Hourly prices of GPU islands, read from SkyPilot's catalog through its own API.

SkyPilot keeps one catalog per cloud (`$SKY_RUNTIME_DIR/.sky/catalogs/<schema>/<cloud>/vms.csv`, SKY_RUNTIME_DIR
defaulting to the home directory): every instance type with its accelerators, and its on-demand and spot price per
region. `sky.catalog.list_accelerators(all_regions=True)` gives one row per instance type and region; the price of
an island is the cheapest region's, per cloud, for that accelerator and count, spot or on-demand.

SkyPilot downloads a missing catalog from the network on first read (with no timeout of its own), so only the clouds
whose catalog is already on this machine are asked, and the whole read is bounded by `CATALOG_TIMEOUT_S`. Whatever
is missing becomes one line in `PriceBook.unavailable`: the planner still ranks what fits, without prices.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from yeto import one_line

CATALOG_TIMEOUT_S = 60.0  # reading local catalogs takes seconds; past this SkyPilot is waiting on a network
CATALOG_FILE = "vms.csv"
FETCH_HINT = "`sky show-gpus` on a machine online fetches them"


@dataclass(frozen=True)
class Offer:
    """One island's price on one cloud: `count` GPUs on one VM (`instance_type`) in the cheapest region."""

    cloud: str  # SkyPilot's infra name, lower case ("aws", "lambda", "runpod")
    region: str
    gpu: str
    count: int
    instance_type: str
    hourly: float  # USD per hour of the whole VM
    spot: bool


@dataclass
class PriceBook:
    """The cheapest offer per (cloud, gpu, count, spot), and per region for pricing a named region."""

    offers: dict[tuple[str, str, int, bool], Offer] = field(default_factory=dict)
    by_region: dict[tuple[str, str, int, bool, str], Offer] = field(default_factory=dict)
    unavailable: Optional[str] = None  # one line: why some or all prices are missing

    @property
    def empty(self) -> bool:
        return not self.offers

    def cheapest(self, gpu: str, count: int, spot: bool, clouds: Optional[Iterable[str]] = None) -> Optional[Offer]:
        """The cheapest offer for `count` x `gpu` over `clouds` (default: every cloud priced)."""
        wanted = None if clouds is None else {c.lower() for c in clouds}
        found = [o for (c, g, n, s), o in self.offers.items()
                 if g == gpu and n == count and s == spot and (wanted is None or c in wanted)]
        return min(found, key=lambda o: (o.hourly, o.cloud), default=None)

    def island(self, cloud: str, gpu: str, count: int, spot: bool, region: Optional[str] = None) -> Optional[Offer]:
        """One VM's offer on `cloud` (in `region` when named, else its cheapest region)."""
        if region is not None:
            return self.by_region.get((cloud.lower(), gpu, count, spot, region))
        return self.offers.get((cloud.lower(), gpu, count, spot))


def _price(value: Any) -> Optional[float]:
    """A catalog price: None where the cell is empty (NaN: no spot market there) or not positive."""
    try:
        p = float(value)
    except (TypeError, ValueError):
        return None
    return p if math.isfinite(p) and p > 0 else None


def book_from_rows(rows: Iterable[Any], unavailable: Optional[str] = None) -> PriceBook:
    """A PriceBook from SkyPilot's InstanceTypeInfo rows (any object with its fields)."""
    book = PriceBook(unavailable=unavailable)
    for r in rows:
        count = float(r.accelerator_count)
        if not count.is_integer() or count < 1:
            continue  # fractional GPUs (a share of one device) are no island
        for spot, value in ((False, r.price), (True, r.spot_price)):
            hourly = _price(value)
            if hourly is None:
                continue
            o = Offer(r.cloud.lower(), str(r.region), r.accelerator_name, int(count), str(r.instance_type), hourly,
                      spot)
            for key, table in (((o.cloud, o.gpu, o.count, spot), book.offers),
                               ((o.cloud, o.gpu, o.count, spot, o.region), book.by_region)):
                if key not in table or (hourly, o.region) < (table[key].hourly, table[key].region):  # ties: by name
                    table[key] = o
    return book


def catalog_dir() -> Path:
    """Where SkyPilot reads its catalogs (SKY_RUNTIME_DIR moves it, e.g. to a test fixture)."""
    from sky.catalog import common

    return Path(common.get_catalog_path(""))


def local_clouds(root: Path) -> list[str]:
    """The clouds whose catalog is on this machine."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / CATALOG_FILE).is_file())


def _read(clouds: list[str], timeout_s: float) -> tuple[list[Any], list[str]]:
    """Every GPU row of `clouds` through `sky.catalog.list_accelerators`, each cloud in its own bounded read (a
    cloud whose read fails or hangs is named in the second list)."""
    import sky.catalog

    rows: list[Any] = []
    failed: list[str] = []

    def read(cloud: str) -> None:
        try:
            found = sky.catalog.list_accelerators(gpus_only=True, clouds=[cloud], all_regions=True)
            rows.extend(r for infos in found.values() for r in infos)
        except Exception as e:  # SkyPilot's errors are many; each means this cloud has no prices here
            failed.append(f"{cloud} ({one_line(e, 120)})")

    # daemon threads: a read stuck on a network SkyPilot tries to reach does not keep the process alive
    threads = [threading.Thread(target=read, args=(c,), daemon=True) for c in clouds]
    for t in threads:
        t.start()
    for c, t in zip(clouds, threads):
        t.join(timeout_s)
        if t.is_alive():
            failed.append(f"{c} (no answer in {timeout_s:g}s)")
    return rows, failed


def load_prices(clouds: Optional[Iterable[str]] = None, timeout_s: float = CATALOG_TIMEOUT_S) -> PriceBook:
    """Prices of `clouds` (default: every cloud with a catalog here), or a book saying in one line why not."""
    try:
        root = catalog_dir()
    except ImportError:
        return PriceBook(unavailable="prices unavailable: SkyPilot is not installed (pip install 'yeto[launch]')")
    present = local_clouds(root)
    asked = present if clouds is None else [c.lower() for c in clouds]
    missing = [c for c in asked if c not in present]
    to_read = [c for c in asked if c in present]
    rows, failed = _read(to_read, timeout_s) if to_read else ([], [])
    where = f"{root} (SKY_RUNTIME_DIR={os.environ['SKY_RUNTIME_DIR']})" if "SKY_RUNTIME_DIR" in os.environ else root
    notes = []
    if not present:
        notes.append(f"no SkyPilot catalog at {where}; {FETCH_HINT}")
    elif missing:
        notes.append(f"no catalog for {', '.join(missing)} at {where}; {FETCH_HINT}")
    if failed:
        notes.append(f"SkyPilot could not read {', '.join(failed)}")
    book = book_from_rows(rows)
    if notes:
        book.unavailable = ("prices unavailable: " if book.empty else "some prices unavailable: ") + "; ".join(notes)
    return book
