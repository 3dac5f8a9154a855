"""Where a --data points, read as records: a file, a directory laid out as the hub lays datasets out, a
dataset saved with `save_to_disk`, or a hub dataset at a pinned commit (the `datasets` library's own rules); a
table's columns renamed to record fields (--columns); a .txt's paragraphs cut into block-sized records.

Unreadable input is one error naming the file (or file:line) and the fix: not UTF-8, invalid JSON, corrupt
parquet, a CSV row with more fields than its header, a damaged save_to_disk directory, a missing split or config.
"""

from __future__ import annotations

import codecs
import csv
import functools
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from yeto import YetoError
from yeto.eval.gym import HELD_OUT_SUFFIX
from yeto.models.provenance import Artifact, content_hash, resolve_hub_snapshot

# the demo data (pirate-speak chats) ships inside the package, so `--data`'s default works after a pip install;
# the repository's data/demo is a link to it (make demo)
DEMO_DATA = str(Path(__file__).resolve().parent.parent / "data" / "demo")
SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv", ".txt")  # matched case-insensitively
# written by `datasets` beside the data (save_to_disk, the hub's legacy infos): skipped, and said so
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}


@dataclass(frozen=True)
class DataRecord:
    data: dict[str, Any]
    origin: str  # "file:line", used in every error about this record
    plain_text: bool = False  # a .txt paragraph: cut into block-sized pieces before the held-out split (data.py)


def data_source(name: str, revision: str | None = None) -> str:
    """Where --data resolves from ("local" or "hub"), decided without reading or fetching it: `yeto launch`
    refuses, in the training's own words, data its islands would not find."""
    local = Path(name).expanduser()
    if local.exists():
        if revision is not None:
            raise YetoError(f"--data-revision {revision!r} given for a local path {local}; "
                            "local data is pinned by content hash")
        return "local"
    parts = name.split("/")
    if (len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))
            and Path(name).suffix.lower() not in SUPPORTED_EXTENSIONS):
        return "hub"
    raise YetoError(f"data file not found: {name}")


def resolve_data(name: str, revision: str | None = None) -> Artifact:
    """The --data a run trains on, pinned: a local path by its content hash, a hub dataset by its commit."""
    if data_source(name, revision) == "local":
        local = Path(name).expanduser()
        return Artifact(name, "dataset", "local", str(local.resolve()), content_hash(local), None, None)
    path, sha = resolve_hub_snapshot(name, revision, "dataset")
    return Artifact(name, "dataset", "hub", str(path), sha, revision, name)


@dataclass
class DataLayout:
    """What a --data resolves to: the records of each split of one config, read on demand.

    A file is one split, `train`. A directory is read as the hub lays datasets
    out (the `datasets` library's own rules: `train-*`/`test-*`/`validation-*`
    files, `data/train-...`, the README's `configs`); one with no split names
    is all `train`. A dataset saved with `save_to_disk` keeps its splits.
    """

    splits: dict[str, Callable[[], list[DataRecord]]]
    config: str | None = None
    skipped: list[str] = field(default_factory=list)  # "file (why)": files in the directory that are not read


def data_layout(path: Path, config: str | None = None) -> DataLayout:
    path = Path(path).expanduser().resolve()
    if path.is_file():
        if config is not None:
            raise YetoError(f"--data-config {config!r} given for the single file {path}; a file has no configs")
        return DataLayout({"train": lambda: read_records(path)})
    if not path.is_dir():
        raise YetoError(f"data file not found: {path}")
    if _saved_with_save_to_disk(path):
        return _saved_layout(path, config)
    return _hub_layout(path, config)


def _hub_layout(root: Path, config: str | None) -> DataLayout:
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns, sanitize_patterns

    base, patterns = root, None
    configs = _readme_configs(root)
    if configs:
        name = config or configs.get_default_config_name() or (next(iter(configs)) if len(configs) == 1 else None)
        if name is None:
            raise YetoError(f"dataset {root} has configs {', '.join(configs)}: pass --data-config NAME")
        if name not in configs:
            raise YetoError(f"--data-config {name!r} is not a config of {root}; its configs: {', '.join(configs)}")
        entry, config = configs[name], name
        base = root / entry.get("data_dir", "")
        if entry.get("data_files"):
            patterns = sanitize_patterns(entry["data_files"])
    elif config is not None:
        base = root / config
        if not base.is_dir():
            subdirs = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
            raise YetoError(f"--data-config {config!r}: {root} has no README `configs` and no subfolder {config!r} "
                            f"(subfolders: {', '.join(subdirs) or 'none'})")
    try:
        patterns = patterns or get_data_patterns(str(base))
        resolved = DataFilesDict.from_patterns(patterns, base_path=str(base))
    except (EmptyDatasetError, FileNotFoundError):
        resolved = {}
    present = _candidate_files(base)  # what a user may expect read: to say what is not, and why
    splits: dict[str, Callable[[], list[DataRecord]]] = {}
    taken: set[Path] = set()
    for split, files in resolved.items():
        keep = [Path(f) for f in files if Path(f) in present and present[Path(f)] is None]
        taken.update(keep)
        if keep:
            splits[str(split)] = lambda keep=keep: [r for f in keep for r in read_records(f)]
    skipped = [f"{f.relative_to(root).as_posix()} ({why or 'in no split'})"
               for f, why in present.items() if f not in taken and (why or not configs)]
    if not splits:
        raise YetoError(f"no data files ({', '.join(SUPPORTED_EXTENSIONS)}) in directory {base}"
                        + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    return DataLayout(splits, config, skipped)


def _candidate_files(base: Path) -> dict[Path, str | None]:
    """Every file below `base` (hidden parts below it skipped, not above: ~/.cache is fine; the README, the dataset's
    card, too), with why it is not data (None: it is): a file a person put there and is not read (notes.md) is
    named in the data stats, never dropped unsaid."""
    out: dict[Path, str | None] = {}
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base).parts
        if not p.is_file() or any(s.startswith(".") for s in rel) or p.name == "README.md":
            continue
        if p.name in METADATA_FILES:
            out[p.resolve()] = "dataset metadata, not records"
        elif p.name.endswith(HELD_OUT_SUFFIX):
            out[p.resolve()] = "a task's held-out set (yeto data task), never trained on"
        elif p.suffix.lower() in SUPPORTED_EXTENSIONS:
            out[p.resolve()] = None
        else:
            out[p.resolve()] = f"not a data file ({', '.join(SUPPORTED_EXTENSIONS)})"
    return out


def _readme_configs(root: Path):
    """The `configs` of the README's YAML header (the hub's way to declare several configs), or {}."""
    readme = root / "README.md"
    if not readme.is_file() or not readme.read_text(encoding="utf-8", errors="replace").startswith("---"):
        return {}
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        return MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data)
    except Exception as e:  # a README's header is the user's text: a bad one is named, not a traceback
        raise YetoError(f"{readme}: cannot read its YAML header's `configs` ({flat_message(e)}); "
                        "fix or remove it") from e


def _saved_with_save_to_disk(path: Path) -> bool:
    """A `save_to_disk` directory: a DatasetDict's dataset_dict.json, or a Dataset's state.json beside its arrow
    files (a stray state.json beside jsonl files is metadata, skipped)."""
    if (path / "dataset_dict.json").is_file():
        return True
    return (path / "state.json").is_file() and any(path.glob("*.arrow"))


def _saved_layout(path: Path, config: str | None) -> DataLayout:
    """A `datasets` Dataset or DatasetDict saved with `save_to_disk` (arrow files, read by `load_from_disk`)."""
    from datasets import Dataset, load_from_disk

    if config is not None:
        raise YetoError(f"--data-config {config!r} given for {path}, a dataset saved with save_to_disk: "
                        "it holds one config; drop --data-config")
    try:
        saved = load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError, ValueError or arrow errors for a damaged save
        raise YetoError(f"{path}: a dataset saved with save_to_disk that cannot be loaded ({flat_message(e)}); "
                        "save it again") from e
    parts = {"train": saved} if isinstance(saved, Dataset) else dict(saved)

    def rows(name: str) -> list[DataRecord]:
        return [DataRecord(row, f"{path}[{name}]:row {i + 1}") for i, row in enumerate(parts[name])]

    return DataLayout({name: functools.partial(rows, name) for name in parts})


RECORD_FIELDS = ("messages", "conversations", "prompt", "completion", "instruction", "input", "output", "text")
COLUMNS_HINT = "map yours with --columns COLUMN=FIELD,... (e.g. --columns question=prompt,answer=completion)"


def parse_columns(spec: str | None) -> dict[str, str]:
    """`--columns question=prompt,answer=completion`: which of a table's columns (CSV, parquet, JSON keys) is which
    field of a record, so data a person has need not be rewritten to yeto's names. {} when not given."""
    if not spec:
        return {}
    columns: dict[str, str] = {}
    for pair in spec.split(","):
        source, eq, target = (x.strip() for x in pair.partition("="))
        if not eq or not source or not target:
            raise YetoError(f"--columns {spec!r}: {pair.strip()!r} is not COLUMN=FIELD; write e.g. "
                            "--columns question=prompt,answer=completion")
        if target not in RECORD_FIELDS:
            raise YetoError(f"--columns {spec!r}: {target!r} is not a record field; map to one of "
                            f"{', '.join(RECORD_FIELDS)}")
        if source in columns or target in columns.values():
            raise YetoError(f"--columns {spec!r}: {source if source in columns else target!r} is mapped twice")
        columns[source] = target
    return columns


def map_columns(records: list[DataRecord], columns: dict[str, str]) -> list[DataRecord]:
    """Each record with its `columns` renamed to the fields they stand for (the other columns kept as they are); a
    record without one of them is an error naming the columns it has."""
    if not columns:
        return records
    out = []
    for rec in records:
        d = rec.data
        if not isinstance(d, dict):
            out.append(rec)  # (record_format names it)
            continue
        missing = [c for c in columns if c not in d]
        if missing:
            raise YetoError(f"{rec.origin}: --columns names {', '.join(map(repr, missing))}, not a column here; "
                            f"its columns: {', '.join(map(str, d)) or 'none'}")
        mapped = {k: v for k, v in d.items() if k not in columns}
        clash = [t for t in columns.values() if t in mapped]
        if clash:
            raise YetoError(f"{rec.origin}: --columns maps a column to {clash[0]!r}, which the record already has; "
                            f"map that column too, or another one (its columns: {', '.join(map(str, d))})")
        mapped.update({target: d[source] for source, target in columns.items()})
        out.append(DataRecord(mapped, rec.origin))
    return out


TEXT_BLOCK_ROOM = 2  # a piece of a .txt leaves room for the BOS its tokenizer may add and the EOS a text ends with


def text_blocks(records: list[DataRecord], tokenizer, seq_len: int) -> list[DataRecord]:
    """A .txt file's paragraphs, each one longer than a block cut at token boundaries into block-sized pieces before
    the held-out split: a text without blank lines (a book, a log) is many records with a held-out share, not one
    record that packing would cut after the split. Other records are left as they are."""
    budget = max(1, seq_len - TEXT_BLOCK_ROOM)
    out = []
    for rec in records:
        text = rec.data.get("text") if rec.plain_text else None
        if not isinstance(text, str):
            out.append(rec)
            continue
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) <= budget:
            out.append(rec)
            continue
        starts = [0] + [offsets[i][0] for i in range(budget, len(offsets), budget)]
        for k, (a, b) in enumerate(zip(starts, starts[1:] + [len(text)])):
            out.append(DataRecord({"text": text[a:b]}, f"{rec.origin} block {k + 1}"))
    return out


def data_files(directory: Path) -> list[Path]:
    """The data files of a directory, sorted; raises naming the directory when it has none."""
    present = _candidate_files(directory)
    files = [f for f, why in present.items() if why is None]
    if not files:
        raise YetoError(f"no data files ({', '.join(SUPPORTED_EXTENSIONS)}) in directory {directory}")
    return files


def read_records(path: str | Path) -> list[DataRecord]:
    """Every record of a file or a directory (its data files, in sorted order; no splits).

    Hard errors (one line naming file:line and the fix): a file that is not UTF-8,
    invalid JSON, a corrupt parquet file, a CSV row with more fields than its header.
    Records that parse but cannot be trained on are judged later (`record_format`).
    """
    path = Path(path)
    if path.is_dir():
        return [r for f in data_files(path) for r in read_records(f)]
    if not path.is_file():
        raise YetoError(f"data file not found: {path}")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv,
               ".txt": _read_txt}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise YetoError(f"unsupported data file {path}: expected one of {', '.join(SUPPORTED_EXTENSIONS)}")
    return list(reader(path))


def flat_message(e: BaseException) -> str:
    """An error's whole message on one line (a parser's multi-line complaint inside ours)."""
    return " ".join(str(e).split()) or type(e).__name__


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = bom + e.start
        raise YetoError(f"{path}: not UTF-8 text (byte {raw[offset:offset + 1]!r} at byte offset {offset}); "
                        "re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from e


def _jsonl_records(path: Path, text: str) -> Iterable[DataRecord]:
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise YetoError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                            "fix the line (one JSON object per line)") from e
        yield DataRecord(data, f"{path}:{lineno}")


def _read_jsonl(path: Path) -> Iterable[DataRecord]:
    return _jsonl_records(path, _read_text(path))


def _read_json(path: Path) -> Iterable[DataRecord]:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):  # a JSON array that does not parse: where it breaks
            raise YetoError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno}); fix the file") from e
        yield from _jsonl_records(path, text)  # JSON Lines saved as .json
        return
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise YetoError(f"{path}: expected a list of records (or an object holding one list), "
                            f"got an object with keys {sorted(data)}")
        data = lists[0]
    if not isinstance(data, list):
        raise YetoError(f"{path}: expected a list of records, got {type(data).__name__}")
    for i, rec in enumerate(data):
        yield DataRecord(rec, f"{path}:[{i}]")


def _read_parquet(path: Path) -> Iterable[DataRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise YetoError(f"{path}: not a readable parquet file ({flat_message(e)}); re-export it or remove it") from e
    for i, row in enumerate(rows):
        yield DataRecord(row, f"{path}:row {i + 1}")


def _read_csv(path: Path) -> Iterable[DataRecord]:
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    try:
        for row in reader:
            if None in row:  # DictReader files the fields past the header under the key None
                raise YetoError(f"{path}:{reader.line_num}: {len(row[None])} more field(s) than the header's "
                                f"{len(reader.fieldnames or [])}; quote fields that contain commas")
            yield DataRecord(dict(row), f"{path}:{reader.line_num}")
    except csv.Error as e:
        raise YetoError(f"{path}:{reader.line_num}: malformed CSV ({flat_message(e)}); fix the row") from e


def _read_txt(path: Path) -> Iterable[DataRecord]:
    """A plain-text file is one document per blank-line-separated paragraph (a paragraph longer than a block is cut
    into blocks once the tokenizer is known: `yeto.island.data.text_blocks`)."""
    para: list[str] = []
    start = 0
    for lineno, line in enumerate(_read_text(path).split("\n"), 1):
        if line.strip():
            if not para:
                start = lineno
            para.append(line)
        elif para:
            yield DataRecord({"text": "\n".join(para)}, f"{path}:{start}", plain_text=True)
            para = []
    if para:
        yield DataRecord({"text": "\n".join(para)}, f"{path}:{start}", plain_text=True)
