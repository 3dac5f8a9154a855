"""Records -> token blocks with loss masks, identical on every backend.

The pipeline: resolve the data (a jsonl/json/parquet/csv/txt file, a directory,
a dataset saved with `save_to_disk`, or a hub dataset at a pinned commit) to the
records of one split of one config (the `datasets` library's layout rules) ->
detect each record's format, counting the unusable ones by reason -> take the
held-out set (the dataset's validation/test split, else a seeded fraction) and
shard the rest by learner -> tokenize with the Hugging Face tokenizer (chat
template for chat and alpaca records) -> pack whole examples into fixed-length
blocks. Only numpy and the tokenizer touch the tokens, so the torch and the MLX
learner see byte-identical blocks.

Hard errors (one line naming the file, or file:line, and the fix): unreadable
input (not UTF-8, invalid JSON, corrupt parquet, a CSV row with more fields than
its header, a damaged save_to_disk directory), a record whose structure is wrong
(not an object, no known format, fields of the wrong type), a chat template that
raises, a split or config the dataset lacks, and a file none of whose records can
be used. Everything else that cannot be trained on (no assistant turn, an unknown
role, empty, over-long) is counted in `stats["unusable"]`, never silently.

`loss_mask[b, t] == 1` means token t of block b is a training target: the loss
for position t-1 predicting token t is weighted by `loss_mask[b, t]`.
"""

from __future__ import annotations

import codecs
import csv
import functools
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from yeto import YetoError
from yeto.provenance import Artifact, content_hash, resolve_hub_snapshot

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv", ".txt")  # matched case-insensitively
# written by `datasets` beside the data (save_to_disk, the hub's legacy infos): skipped, and said so
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
IGNORED_EXTENSIONS = {".md", ".lock", ".gitattributes", ".py", ".arrow"}  # not data, not worth a word
EVAL_SPLITS = ("validation", "test")  # a dataset's own held-out split, in order of preference
CHAT_ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Record:
    data: dict[str, Any]
    origin: str  # "file:line", used in every error about this record


@dataclass
class Blocks:
    input_ids: np.ndarray  # [n, seq_len] int64
    loss_mask: np.ndarray  # [n, seq_len] float32

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask[:, 1:].sum())


@dataclass
class PreparedData:
    train: Blocks
    eval: Blocks
    artifact: Artifact
    stats: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- reading


def resolve_data(name: str, revision: str | None = None) -> Artifact:
    local = Path(name).expanduser()
    if local.exists():
        if revision is not None:
            raise YetoError(f"--data-revision {revision!r} given for a local path {local}; "
                            "local data is pinned by content hash")
        return Artifact(name, "dataset", "local", str(local.resolve()), content_hash(local), None, None)
    parts = name.split("/")
    if (len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))
            and Path(name).suffix.lower() not in SUPPORTED_EXTENSIONS):
        path, sha = resolve_hub_snapshot(name, revision, "dataset")
        return Artifact(name, "dataset", "hub", str(path), sha, revision, name)
    raise YetoError(f"data file not found: {name}")


@dataclass
class DataLayout:
    """What a --data resolves to: the records of each split of one config, read on demand.

    A file is one split, `train`. A directory is read as the hub lays datasets
    out (the `datasets` library's own rules: `train-*`/`test-*`/`validation-*`
    files, `data/train-...`, the README's `configs`); one with no split names
    is all `train`. A dataset saved with `save_to_disk` keeps its splits.
    """

    splits: dict[str, Callable[[], list[Record]]]
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
    splits: dict[str, Callable[[], list[Record]]] = {}
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
    """Every file below `base` (hidden parts below it skipped, not above: ~/.cache is fine), with why it is not
    data (None: it is)."""
    out: dict[Path, str | None] = {}
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base).parts
        if not p.is_file() or any(s.startswith(".") for s in rel) or p.name == "README.md":
            continue
        if p.name in METADATA_FILES:
            out[p.resolve()] = "dataset metadata, not records"
        elif p.suffix.lower() in SUPPORTED_EXTENSIONS:
            out[p.resolve()] = None
        elif p.suffix.lower() not in IGNORED_EXTENSIONS:
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
        raise YetoError(f"{readme}: cannot read its YAML header's `configs` ({_one_line(e)}); fix or remove it") from e


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
        raise YetoError(f"{path}: a dataset saved with save_to_disk that cannot be loaded ({_one_line(e)}); "
                        "save it again") from e
    parts = {"train": saved} if isinstance(saved, Dataset) else dict(saved)

    def rows(name: str) -> list[Record]:
        return [Record(row, f"{path}[{name}]:row {i + 1}") for i, row in enumerate(parts[name])]

    return DataLayout({name: functools.partial(rows, name) for name in parts})


def data_files(directory: Path) -> list[Path]:
    """The data files of a directory, sorted; raises naming the directory when it has none."""
    present = _candidate_files(directory)
    files = [f for f, why in present.items() if why is None]
    if not files:
        raise YetoError(f"no data files ({', '.join(SUPPORTED_EXTENSIONS)}) in directory {directory}")
    return files


def read_records(path: str | Path) -> list[Record]:
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


def _one_line(e: BaseException) -> str:
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


def _jsonl_records(path: Path, text: str) -> Iterable[Record]:
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise YetoError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                            "fix the line (one JSON object per line)") from e
        yield Record(data, f"{path}:{lineno}")


def _read_jsonl(path: Path) -> Iterable[Record]:
    return _jsonl_records(path, _read_text(path))


def _read_json(path: Path) -> Iterable[Record]:
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
        yield Record(rec, f"{path}:[{i}]")


def _read_parquet(path: Path) -> Iterable[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise YetoError(f"{path}: not a readable parquet file ({_one_line(e)}); re-export it or remove it") from e
    for i, row in enumerate(rows):
        yield Record(row, f"{path}:row {i + 1}")


def _read_csv(path: Path) -> Iterable[Record]:
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    try:
        for row in reader:
            if None in row:  # DictReader files the fields past the header under the key None
                raise YetoError(f"{path}:{reader.line_num}: {len(row[None])} more field(s) than the header's "
                                f"{len(reader.fieldnames or [])}; quote fields that contain commas")
            yield Record(dict(row), f"{path}:{reader.line_num}")
    except csv.Error as e:
        raise YetoError(f"{path}:{reader.line_num}: malformed CSV ({_one_line(e)}); fix the row") from e


def _read_txt(path: Path) -> Iterable[Record]:
    """A plain-text file is one document per blank-line-separated paragraph."""
    para: list[str] = []
    start = 0
    for lineno, line in enumerate(_read_text(path).split("\n"), 1):
        if line.strip():
            if not para:
                start = lineno
            para.append(line)
        elif para:
            yield Record({"text": "\n".join(para)}, f"{path}:{start}")
            para = []
    if para:
        yield Record({"text": "\n".join(para)}, f"{path}:{start}")


# ----------------------------------------------------------------------------- formats


class Unusable(Exception):
    """A record that parses but cannot be trained on: counted by `reason` (one of UNUSABLE_REASONS), not fatal."""

    def __init__(self, reason: str, origin: str):
        super().__init__(f"{origin}: {reason}")
        self.reason = reason


NO_ASSISTANT, UNKNOWN_ROLE, EMPTY, OVER_LONG = "no_assistant_turn", "unknown_role", "empty", "over_long"
UNUSABLE_REASONS = (NO_ASSISTANT, UNKNOWN_ROLE, EMPTY, OVER_LONG)


def record_format(rec: Record) -> str:
    """'chat', 'prompt_completion', 'alpaca' or 'text'.

    A record whose structure is wrong (not an object, no known format, fields of
    the wrong type) is a YetoError naming it: such a file is not understood.
    A well-formed record with nothing to learn (no assistant turn, a role no
    template knows, empty text) raises `Unusable`: it is counted and skipped.
    """
    d = rec.data
    if not isinstance(d, dict):
        raise YetoError(f"{rec.origin}: record is a {type(d).__name__}, expected an object")
    if "messages" in d or "conversations" in d:
        _chat_messages(rec)  # validates
        return "chat"
    if "prompt" in d and "completion" in d:
        p, c = d["prompt"], d["completion"]
        if isinstance(p, str) and isinstance(c, str):
            if not c.strip():
                raise Unusable(EMPTY, rec.origin)
            return "prompt_completion"
        if isinstance(p, list) and isinstance(c, list):
            _chat_messages(rec)
            return "chat"
        raise YetoError(f"{rec.origin}: 'prompt' and 'completion' must both be strings or both be message lists")
    if "instruction" in d and "output" in d:
        _alpaca_messages(rec)
        return "alpaca"
    if "text" in d:
        if not isinstance(d["text"], str):
            raise YetoError(f"{rec.origin}: 'text' must be a string, got {type(d['text']).__name__}")
        if not d["text"].strip():
            raise Unusable(EMPTY, rec.origin)
        return "text"
    raise YetoError(
        f"{rec.origin}: record fits no format (expected 'messages', 'prompt'+'completion', "
        f"'instruction'+'output' or 'text'; got keys {sorted(d)})"
    )


def _alpaca_messages(rec: Record) -> list[dict[str, str]]:
    """Alpaca's instruction (+ input) is the user turn, its output the assistant's."""
    d = rec.data
    instruction, extra, output = d["instruction"], d.get("input") or "", d["output"]
    if not all(isinstance(x, str) for x in (instruction, extra, output)):
        raise YetoError(f"{rec.origin}: 'instruction', 'input' and 'output' must be strings")
    if not instruction.strip() or not output.strip():
        raise Unusable(EMPTY, rec.origin)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _chat_messages(rec: Record) -> list[dict[str, str]]:
    d = rec.data
    if "messages" in d:
        msgs = d["messages"]
    elif "conversations" in d:
        msgs = d["conversations"]
    else:
        msgs = list(d["prompt"]) + list(d["completion"])
    if isinstance(msgs, str):  # CSV/parquet columns often hold JSON text
        try:
            msgs = json.loads(msgs)
        except json.JSONDecodeError as e:
            raise YetoError(f"{rec.origin}: 'messages' is a string that is not JSON ({e.msg})") from e
    if not isinstance(msgs, list):
        raise YetoError(f"{rec.origin}: 'messages' must be a list, got {type(msgs).__name__}")
    if not msgs:
        raise Unusable(EMPTY, rec.origin)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise YetoError(f"{rec.origin}: message {i} is not an object")
        if "from" in m and "value" in m:  # ShareGPT
            m = {"role": SHAREGPT_ROLES.get(m["from"]), "content": m["value"]}
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise Unusable(UNKNOWN_ROLE, rec.origin)
        if not isinstance(content, str):
            raise YetoError(f"{rec.origin}: message {i} content must be a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise Unusable(NO_ASSISTANT, rec.origin)
    return out


# ----------------------------------------------------------------------------- tokenizing


def encode_record(rec: Record, tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) for one record; the mask marks the tokens to learn."""
    fmt = record_format(rec)
    if fmt == "chat":
        return encode_chat(_chat_messages(rec), tokenizer, rec.origin)
    if fmt == "alpaca":
        return encode_chat(_alpaca_messages(rec), tokenizer, rec.origin)
    if fmt == "prompt_completion":
        p, c = rec.data["prompt"], rec.data["completion"]
        return _encode_spans(tokenizer, p + c, [(len(p), len(p) + len(c))], add_eos=True, special=True)
    text = rec.data["text"]
    return _encode_spans(tokenizer, text, [(0, len(text))], add_eos=True, special=True)


def encode_chat(messages: list[dict[str, str]], tokenizer, origin: str = "<chat>") -> tuple[list[int], list[int]]:
    """Render with the chat template; mask in exactly the assistant turns.

    Each assistant turn's character span is found by rendering the conversation
    up to the turn (with the generation prompt) and up to its end: the
    difference is what the model must produce, end-of-turn token included.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise YetoError(f"{origin}: chat record, but the tokenizer has no chat template")

    def render(msgs, gen=False) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # a template's own raise_exception (jinja2.TemplateError) or a bug in it
            raise YetoError(f"{origin}: the model's chat template refuses this conversation ({_one_line(e)}); "
                            "fix the record (e.g. roles the template accepts) or use another model") from e

    full = render(messages)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:k], gen=True) if k else ""
        upto = render(messages[: k + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            # Templates that rewrite history (e.g. strip reasoning) break the prefix
            # property; fall back to locating the content itself.
            start = full.find(m["content"], spans[-1][1] if spans else 0)
            if start < 0:
                raise YetoError(f"{origin}: cannot locate assistant turn {k} in the rendered chat template")
            spans.append((start, start + len(m["content"])))
            continue
        spans.append((len(before), len(upto)))
    return _encode_spans(tokenizer, full, spans, add_eos=False, special=False)


def _encode_spans(tokenizer, text: str, spans: list[tuple[int, int]], add_eos: bool,
                  special: bool) -> tuple[list[int], list[int]]:
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = []
    for start, end in enc["offset_mapping"]:
        inside = start != end and any(a <= start < b for a, b in spans)
        mask.append(1 if inside else 0)
    if add_eos and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
    return ids, mask


# ----------------------------------------------------------------------------- packing


def pack_examples(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
                  window: int = 64) -> tuple[Blocks, dict]:
    """Pack whole examples into blocks (first fit over the last `window` open blocks).

    Examples are never split unless longer than a block (then cut into
    seq_len chunks); the unused tail of a block is padding with mask 0.
    Deterministic: the same examples in the same order give the same blocks.
    """
    if seq_len < 2:
        raise YetoError(f"--seq-len must be at least 2, got {seq_len}")
    blocks: list[tuple[list[int], list[int]]] = []
    open_from = 0  # blocks before this index are closed
    split = 0
    for ids, mask in examples:
        if not any(mask[1:]):
            continue  # nothing to learn from this example
        pieces = [(ids, mask)]
        if len(ids) > seq_len:
            split += 1
            pieces = [(ids[i : i + seq_len], mask[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
        for pid, pm in pieces:
            if not any(pm[1:]):
                continue  # a chunk with no target to predict (position 0 is never predicted)
                # costs compute, teaches nothing
            for b in range(max(open_from, len(blocks) - window), len(blocks)):
                if len(blocks[b][0]) + len(pid) <= seq_len:
                    blocks[b][0].extend(pid)
                    blocks[b][1].extend(pm)
                    break
            else:
                blocks.append((list(pid), list(pm)))
            open_from = max(open_from, len(blocks) - window)
    n = len(blocks)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    loss_mask = np.zeros((n, seq_len), dtype=np.float32)
    for i, (ids, mask) in enumerate(blocks):
        input_ids[i, : len(ids)] = ids
        loss_mask[i, : len(mask)] = mask
    filled = sum(len(b[0]) for b in blocks)
    return Blocks(input_ids, loss_mask), {"blocks": n, "fill": filled / max(1, n * seq_len), "split_examples": split}


# ----------------------------------------------------------------------------- the whole pipeline


def check_shard(index: int, count: int) -> None:
    """Shard `index` of `count` must exist: one line naming the flags otherwise."""
    if count < 1:
        raise YetoError(f"--num-learners must be at least 1, got {count}")
    if not 0 <= index < count:
        raise YetoError(f"--learner-id must be in [0, {count}), got {index}")


def split_and_shard(n: int, learner_id: int, num_learners: int, eval_fraction: float,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices of this learner, eval indices): a seeded permutation, the
    held-out set first (the same for every learner), then a round-robin shard."""
    check_shard(learner_id, num_learners)
    if not 0.0 <= eval_fraction < 1.0:
        raise YetoError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_eval = int(round(n * eval_fraction))
    if eval_fraction > 0 and n >= 2:
        n_eval = max(1, n_eval)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return train_idx[learner_id::num_learners], eval_idx


@dataclass
class DataSource:
    """A dataset read and checked, before it is cut into shards: its usable training records, the held-out blocks
    (the same for every learner) and what reading found. A learner reads before it joins a run, so bad data fails
    before anything else, and takes its shard once the syncer has told it which (`shard`)."""

    name: str
    tokenizer: Any
    seq_len: int
    pool: list[Record]
    train_idx: np.ndarray
    eval: Blocks
    artifact: Artifact
    stats: dict[str, Any]
    unusable: Counter
    where: dict[str, str]

    def shard(self, index: int, count: int) -> PreparedData:
        """Shard `index` of `count` (round-robin over the seeded order), tokenized and packed, with the held-out
        blocks."""
        check_shard(index, count)
        idx = self.train_idx[index::count]
        if len(idx) == 0:
            raise YetoError(f"learner {index} of {count} has no training records "
                            f"({len(self.pool)} usable records in {self.name})")
        unusable, where = Counter(self.unusable), dict(self.where)
        examples = _encode_all([self.pool[i] for i in idx], self.tokenizer, self.seq_len, unusable, where)
        pad = _pad_id(self.tokenizer)
        train, tstats = pack_examples(examples, self.seq_len, pad)
        if len(train) == 0:
            raise YetoError(f"no loss-bearing tokens in the training shard of {self.name} "
                            f"(unusable records: {dict(unusable)}); check --seq-len {self.seq_len} and the records")
        stats = {**self.stats, "shard": [index, count], "train_records": len(examples), "unusable": dict(unusable),
                 "unusable_first": where, "train_blocks": len(train), "eval_blocks": len(self.eval),
                 "train_loss_tokens": train.loss_tokens, "fill": round(tstats["fill"], 4),
                 "split_examples": tstats["split_examples"]}
        return PreparedData(train, self.eval, self.artifact, stats)


def read_data(
    data: str,
    tokenizer,
    seq_len: int,
    eval_fraction: float = 0.05,
    seed: int = 0,
    revision: str | None = None,
    split: str = "train",
    config: str | None = None,
) -> DataSource:
    """Split `split` of config `config` of `data`, read and checked, with its held-out blocks.

    The held-out set is the dataset's own validation (else test) split where it
    has one, else `eval_fraction` of `split`: rows of another split never reach
    training. Unusable records are counted by reason in `stats["unusable"]`.
    """
    artifact = resolve_data(data, revision)
    layout = data_layout(Path(artifact.path), config)
    if split not in layout.splits:
        raise YetoError(f"--data-split {split!r} is not a split of {data}; its splits: {', '.join(layout.splits)}")
    if not 0.0 <= eval_fraction < 1.0:
        raise YetoError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    eval_split = next((s for s in EVAL_SPLITS if s in layout.splits and s != split), None)
    unusable: Counter[str] = Counter()
    where: dict[str, str] = {}  # the first unusable record of each reason, for the user to look at
    formats: Counter[str] = Counter()
    pool = _usable(layout.splits[split](), f"{data} (split {split!r})", formats, unusable, where)
    held_out = _usable(layout.splits[eval_split](), data, formats, unusable, where) if eval_split else []
    train_idx, eval_idx = split_and_shard(len(pool), 0, 1, 0.0 if eval_split else eval_fraction, seed)
    eval_records = held_out if eval_split else [pool[i] for i in eval_idx]
    evalb, _ = pack_examples(_encode_all(eval_records, tokenizer, seq_len, unusable, where), seq_len,
                             _pad_id(tokenizer))
    stats = {"split": split, "config": layout.config, "eval_split": eval_split, "records": len(pool),
             "formats": dict(formats), "eval_records": int(len(eval_records)), "skipped_files": layout.skipped}
    return DataSource(data, tokenizer, seq_len, pool, train_idx, evalb, artifact, stats, unusable, where)


def prepare_data(data: str, tokenizer, seq_len: int, learner_id: int = 0, num_learners: int = 1,
                 eval_fraction: float = 0.05, seed: int = 0, revision: str | None = None, split: str = "train",
                 config: str | None = None) -> PreparedData:
    """This learner's training blocks and the held-out blocks of `data`: `read_data`, then shard `learner_id` of
    `num_learners`."""
    return read_data(data, tokenizer, seq_len, eval_fraction, seed, revision, split,
                     config).shard(learner_id, num_learners)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _usable(records: list[Record], name: str, formats: Counter, unusable: Counter,
            where: dict[str, str]) -> list[Record]:
    """The records that can be trained on; a file none of whose records can is an error naming it."""
    if not records:
        raise YetoError(f"no records in {name}")
    keep, used, reasons = [], Counter(), {}
    for r in records:
        file = r.origin.rsplit(":", 1)[0]  # origins are "file:line", "file:row N" or "dir[split]:row N"
        used[file] += 0
        try:
            formats[record_format(r)] += 1
        except Unusable as u:
            unusable[u.reason] += 1
            where.setdefault(u.reason, r.origin)
            reasons.setdefault(file, Counter())[u.reason] += 1
            continue
        keep.append(r)
        used[file] += 1
    for file, n in used.items():
        if n == 0:
            why = ", ".join(f"{k}: {v}" for k, v in reasons[file].items())
            raise YetoError(f"{file}: none of its records can be used ({why}); fix the records or remove the file")
    return keep


def _encode_all(records: list[Record], tokenizer, seq_len: int, unusable: Counter,
                where: dict[str, str]) -> list[tuple[list[int], list[int]]]:
    """Tokenized records; one whose first target lies past the first block (its prompt alone fills
    --seq-len) is over-long: cut, its answer would be trained on without its question."""
    out = []
    for r in records:
        ids, mask = encode_record(r, tokenizer)
        reason = EMPTY if not any(mask[1:]) else OVER_LONG if not any(mask[1:seq_len]) else None
        if reason:
            unusable[reason] += 1
            where.setdefault(reason, r.origin)
            continue
        out.append((ids, mask))
    return out
