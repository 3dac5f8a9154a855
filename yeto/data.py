"""Records -> token blocks with loss masks, identical on every backend.

The pipeline: read records (jsonl/json/parquet/csv/txt, a directory, or a hub
dataset at a pinned commit) -> detect each record's format -> split off a
held-out set and shard the rest by learner -> tokenize with the Hugging Face
tokenizer (chat template for chat records) -> pack whole examples into
fixed-length blocks. Only numpy and the tokenizer are used, so the torch and
the MLX learner see byte-identical blocks.

`loss_mask[b, t] == 1` means token t of block b is a training target: the loss
for position t-1 predicting token t is weighted by `loss_mask[b, t]`.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from yeto import YetoError
from yeto.provenance import Artifact, content_hash, resolve_hub_snapshot

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv", ".txt")
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
            and Path(name).suffix not in SUPPORTED_EXTENSIONS):
        path, sha = resolve_hub_snapshot(name, revision, "dataset")
        return Artifact(name, "dataset", "hub", str(path), sha, revision, name)
    raise YetoError(f"data file not found: {name}")


def read_records(path: str | Path) -> list[Record]:
    """Every record of a file or a directory (its supported files, in sorted order)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.suffix in SUPPORTED_EXTENSIONS and not any(s.startswith(".") for s in p.parts))
        if not files:
            raise YetoError(f"no data files ({', '.join(SUPPORTED_EXTENSIONS)}) in directory {path}")
        return [r for f in files for r in read_records(f)]
    if not path.is_file():
        raise YetoError(f"data file not found: {path}")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv,
               ".txt": _read_txt}
    reader = readers.get(path.suffix)
    if reader is None:
        raise YetoError(f"unsupported data file {path}: expected one of {', '.join(SUPPORTED_EXTENSIONS)}")
    return list(reader(path))


def _read_jsonl(path: Path) -> Iterable[Record]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise YetoError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
            yield Record(data, f"{path}:{lineno}")


def _read_json(path: Path) -> Iterable[Record]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        yield from _read_jsonl(path)  # JSON Lines saved as .json
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
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield Record(row, f"{path}:row {i + 1}")


def _read_csv(path: Path) -> Iterable[Record]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            yield Record(dict(row), f"{path}:{reader.line_num}")


def _read_txt(path: Path) -> Iterable[Record]:
    """A plain-text file is one document per blank-line-separated paragraph."""
    para: list[str] = []
    start = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                if not para:
                    start = lineno
                para.append(line)
            elif para:
                yield Record({"text": "".join(para).strip("\n")}, f"{path}:{start}")
                para = []
    if para:
        yield Record({"text": "".join(para).strip("\n")}, f"{path}:{start}")


# ----------------------------------------------------------------------------- formats


def record_format(rec: Record) -> str:
    """'chat', 'prompt_completion' or 'text'; a record that fits none is an error naming it."""
    d = rec.data
    if not isinstance(d, dict):
        raise YetoError(f"{rec.origin}: record is a {type(d).__name__}, expected an object")
    if "messages" in d or "conversations" in d:
        _chat_messages(rec)  # validates
        return "chat"
    if "prompt" in d and "completion" in d:
        p, c = d["prompt"], d["completion"]
        if isinstance(p, str) and isinstance(c, str):
            if not c:
                raise YetoError(f"{rec.origin}: empty 'completion' (nothing to learn from)")
            return "prompt_completion"
        if isinstance(p, list) and isinstance(c, list):
            _chat_messages(rec)
            return "chat"
        raise YetoError(f"{rec.origin}: 'prompt' and 'completion' must both be strings or both be message lists")
    if "text" in d:
        if not isinstance(d["text"], str) or not d["text"].strip():
            raise YetoError(f"{rec.origin}: 'text' must be a non-empty string")
        return "text"
    raise YetoError(
        f"{rec.origin}: record fits no format (expected 'messages', 'prompt'+'completion' or 'text'; "
        f"got keys {sorted(d)})"
    )


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
    if not isinstance(msgs, list) or not msgs:
        raise YetoError(f"{rec.origin}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise YetoError(f"{rec.origin}: message {i} is not an object")
        if "from" in m and "value" in m:  # ShareGPT
            role = SHAREGPT_ROLES.get(m["from"])
            m = {"role": role, "content": m["value"]}
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise YetoError(f"{rec.origin}: message {i} has role {role!r}, expected one of {sorted(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise YetoError(f"{rec.origin}: message {i} content must be a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise YetoError(f"{rec.origin}: chat record has no assistant message (nothing to learn from)")
    return out


# ----------------------------------------------------------------------------- tokenizing


def encode_record(rec: Record, tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) for one record; the mask marks the tokens to learn."""
    fmt = record_format(rec)
    if fmt == "chat":
        return encode_chat(_chat_messages(rec), tokenizer, rec.origin)
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
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

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


def split_and_shard(n: int, learner_id: int, num_learners: int, eval_fraction: float,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices of this learner, eval indices): a seeded permutation, the
    held-out set first (the same for every learner), then a round-robin shard."""
    if num_learners < 1:
        raise YetoError(f"--num-learners must be at least 1, got {num_learners}")
    if not 0 <= learner_id < num_learners:
        raise YetoError(f"--learner-id must be in [0, {num_learners}), got {learner_id}")
    if not 0.0 <= eval_fraction < 1.0:
        raise YetoError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_eval = int(round(n * eval_fraction))
    if eval_fraction > 0 and n >= 2:
        n_eval = max(1, n_eval)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return train_idx[learner_id::num_learners], eval_idx


def prepare_data(
    data: str,
    tokenizer,
    seq_len: int,
    learner_id: int = 0,
    num_learners: int = 1,
    eval_fraction: float = 0.05,
    seed: int = 0,
    revision: str | None = None,
) -> PreparedData:
    artifact = resolve_data(data, revision)
    records = read_records(artifact.path)
    if not records:
        raise YetoError(f"no records in {data}")
    formats: dict[str, int] = {}
    for r in records:  # validate every record up front: a bad one fails loudly
        f = record_format(r)
        formats[f] = formats.get(f, 0) + 1
    train_idx, eval_idx = split_and_shard(len(records), learner_id, num_learners, eval_fraction, seed)
    if len(train_idx) == 0:
        raise YetoError(f"learner {learner_id} of {num_learners} has no training records "
                        f"({len(records)} records in {data})")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train, tstats = pack_examples([encode_record(records[i], tokenizer) for i in train_idx], seq_len, pad)
    evalb, _ = pack_examples([encode_record(records[i], tokenizer) for i in eval_idx], seq_len, pad)
    if len(train) == 0:
        raise YetoError(f"no loss-bearing tokens in the training shard of {data}")
    stats = {
        "records": len(records),
        "formats": formats,
        "train_records": int(len(train_idx)),
        "eval_records": int(len(eval_idx)),
        "train_blocks": len(train),
        "eval_blocks": len(evalb),
        "train_loss_tokens": train.loss_tokens,
        "fill": round(tstats["fill"], 4),
        "split_examples": tstats["split_examples"],
    }
    return PreparedData(train, evalb, artifact, stats)
