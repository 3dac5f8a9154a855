"""Records -> token blocks with loss masks, identical on every backend.

The pipeline: resolve the data (a jsonl/json/parquet/csv/txt file, a directory,
a dataset saved with `save_to_disk`, or a hub dataset at a pinned commit) to the
records of one split of one config (the `datasets` library's layout rules) ->
detect each record's format, counting the unusable ones by reason -> take the
held-out set (the dataset's validation/test split, else a seeded fraction) and
shard the rest by island -> tokenize with the Hugging Face tokenizer (chat
template for chat and alpaca records) -> pack whole examples into fixed-length
blocks. Only numpy and the tokenizer touch the tokens, so the torch and the MLX
island see byte-identical blocks.

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

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from yeto import YetoError
from yeto.models.provenance import Artifact
from yeto.island.records import (COLUMNS_HINT, DataRecord, data_layout, flat_message, map_columns, parse_columns,
                                 resolve_data, text_blocks)

EVAL_SPLITS = ("validation", "test")  # a dataset's own held-out split, in order of preference
CHAT_ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


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


# ----------------------------------------------------------------------------- formats


class Unusable(Exception):
    """A record that parses but cannot be trained on: counted by `reason` (one of UNUSABLE_REASONS), not fatal."""

    def __init__(self, reason: str, origin: str):
        super().__init__(f"{origin}: {reason}")
        self.reason = reason


NO_ASSISTANT, UNKNOWN_ROLE, EMPTY, OVER_LONG = "no_assistant_turn", "unknown_role", "empty", "over_long"
UNUSABLE_REASONS = (NO_ASSISTANT, UNKNOWN_ROLE, EMPTY, OVER_LONG)


def record_format(rec: DataRecord) -> str:
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
        f"'instruction'+'output' or 'text'; got keys {sorted(d)}); {COLUMNS_HINT}"
    )


def _alpaca_messages(rec: DataRecord) -> list[dict[str, str]]:
    """Alpaca's instruction (+ input) is the user turn, its output the assistant's."""
    d = rec.data
    instruction, extra, output = d["instruction"], d.get("input") or "", d["output"]
    if not all(isinstance(x, str) for x in (instruction, extra, output)):
        raise YetoError(f"{rec.origin}: 'instruction', 'input' and 'output' must be strings")
    if not instruction.strip() or not output.strip():
        raise Unusable(EMPTY, rec.origin)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _chat_messages(rec: DataRecord) -> list[dict[str, str]]:
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


def encode_record(rec: DataRecord, tokenizer) -> tuple[list[int], list[int]]:
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
            raise YetoError(f"{origin}: the model's chat template refuses this conversation ({flat_message(e)}); "
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
        raise YetoError(f"--islands must be at least 1, got {count}")
    if not 0 <= index < count:
        raise YetoError(f"--island-id must be in [0, {count}), got {index}")


def split_and_shard(n: int, island_id: int, num_islands: int, eval_fraction: float,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices of this island, eval indices): a seeded permutation, the
    held-out set first (the same for every island), then a round-robin shard."""
    check_shard(island_id, num_islands)
    if not 0.0 <= eval_fraction < 1.0:
        raise YetoError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_eval = int(round(n * eval_fraction))
    if eval_fraction > 0 and n >= 2:
        n_eval = max(1, n_eval)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return train_idx[island_id::num_islands], eval_idx


@dataclass
class DataSource:
    """A dataset read and checked, before it is cut into shards: its usable training records, the held-out blocks
    (the same for every island) and what reading found. An island reads before it joins a run, so bad data fails
    before anything else, and takes its shard once the syncer has told it which (`shard`)."""

    name: str
    tokenizer: Any
    seq_len: int
    pool: list[DataRecord]
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
            raise YetoError(f"island {index} of {count} has no training records "
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
    columns: str | None = None,
) -> DataSource:
    """Split `split` of config `config` of `data`, read and checked, with its held-out blocks.

    The held-out set is the dataset's own validation (else test) split where it
    has one, else `eval_fraction` of `split`: rows of another split never reach
    training. Unusable records are counted by reason in `stats["unusable"]`. `columns`: --columns, a table's
    columns mapped to record fields (`parse_columns`).
    """
    mapping = parse_columns(columns)
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
    def records(name: str) -> list[DataRecord]:
        return text_blocks(map_columns(layout.splits[name](), mapping), tokenizer, seq_len)

    pool = _usable(records(split), f"{data} (split {split!r})", formats, unusable, where)
    held_out = _usable(records(eval_split), data, formats, unusable, where) if eval_split else []
    train_idx, eval_idx = split_and_shard(len(pool), 0, 1, 0.0 if eval_split else eval_fraction, seed)
    eval_records = held_out if eval_split else [pool[i] for i in eval_idx]
    evalb, _ = pack_examples(_encode_all(eval_records, tokenizer, seq_len, unusable, where), seq_len,
                             _pad_id(tokenizer))
    stats = {"split": split, "config": layout.config, "eval_split": eval_split, "records": len(pool),
             "formats": dict(formats), "eval_records": int(len(eval_records)), "skipped_files": layout.skipped,
             **({"columns": mapping} if mapping else {})}
    return DataSource(data, tokenizer, seq_len, pool, train_idx, evalb, artifact, stats, unusable, where)


INSPECT_RECORDS = 2000  # `yeto data inspect` counts tokens on at most this many records (a seeded sample beyond)


def inspect_data(source: DataSource) -> dict[str, Any]:
    """What `yeto data inspect` shows of a dataset read and checked (`read_data`): its formats and counts, tokens per
    record (min, median, max over up to INSPECT_RECORDS records), what is skipped and why, and the first usable
    record's tokens with their loss mask, so a person sees what a run would learn before loading any weights."""
    pool = source.pool
    picked = (range(len(pool)) if len(pool) <= INSPECT_RECORDS
              else sorted(np.random.default_rng(0).choice(len(pool), INSPECT_RECORDS, replace=False)))
    unusable, where = Counter(source.unusable), dict(source.where)
    lengths, sample = [], None
    for i in picked:
        ids, mask = encode_record(pool[i], source.tokenizer)
        if not any(mask[1:source.seq_len]):
            reason = EMPTY if not any(mask[1:]) else OVER_LONG
            unusable[reason] += 1
            where.setdefault(reason, pool[i].origin)
            continue
        lengths.append(len(ids))
        if sample is None:
            sample = {"origin": pool[i].origin, "ids": ids, "mask": mask}
    tokens = ({"min": int(min(lengths)), "median": float(np.median(lengths)), "max": int(max(lengths)),
               "over_seq_len": int(sum(n > source.seq_len for n in lengths)), "counted": len(lengths)}
              if lengths else None)
    return {**source.stats, "tokens_per_record": tokens, "unusable": dict(unusable), "unusable_first": where,
            "sample": sample}


def prepare_data(data: str, tokenizer, seq_len: int, island_id: int = 0, num_islands: int = 1,
                 eval_fraction: float = 0.05, seed: int = 0, revision: str | None = None, split: str = "train",
                 config: str | None = None, columns: str | None = None) -> PreparedData:
    """This island's training blocks and the held-out blocks of `data`: `read_data`, then shard `island_id` of
    `num_islands`."""
    return read_data(data, tokenizer, seq_len, eval_fraction, seed, revision, split,
                     config, columns).shard(island_id, num_islands)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _usable(records: list[DataRecord], name: str, formats: Counter, unusable: Counter,
            where: dict[str, str]) -> list[DataRecord]:
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


def _encode_all(records: list[DataRecord], tokenizer, seq_len: int, unusable: Counter,
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
