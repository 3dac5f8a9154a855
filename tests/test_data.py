import csv
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto import YetoError
from yeto.island.data import (Unusable, encode_chat, encode_record, pack_examples, prepare_data, record_format,
                              split_and_shard)
from yeto.island.records import DataRecord, read_records
from tests.conftest import DEMO_DATA

CHAT = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]


def masked_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def unmasked_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if not m])


def test_chat_mask_covers_exactly_the_assistant_turn(tokenizer):
    ids, mask = encode_chat(CHAT, tokenizer)
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.decode(ids) == full
    assert masked_text(tokenizer, ids, mask) == "Paris.<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert unmasked_text(tokenizer, ids, mask) == prompt
    # exact positions: the mask is one contiguous run at the end
    first = mask.index(1)
    assert all(mask[first:]) and not any(mask[:first])
    assert tokenizer.decode(ids[:first]) == prompt


def test_chat_mask_multi_turn_and_system(tokenizer):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!"},
    ]
    ids, mask = encode_chat(msgs, tokenizer)
    assert masked_text(tokenizer, ids, mask) == "Hello!<|im_end|>\nGoodbye!<|im_end|>\n"
    assert "Be brief." in unmasked_text(tokenizer, ids, mask) and "Bye" in unmasked_text(tokenizer, ids, mask)


def test_prompt_completion_and_text_masks(tokenizer):
    ids, mask = encode_record(DataRecord({"prompt": "2+2=", "completion": " 4"}, "x:1"), tokenizer)
    assert masked_text(tokenizer, ids, mask) == " 4<|im_end|>"
    assert unmasked_text(tokenizer, ids, mask) == "2+2="
    ids, mask = encode_record(DataRecord({"text": "Once upon a time."}, "x:2"), tokenizer)
    assert all(mask) and tokenizer.decode(ids) == "Once upon a time.<|im_end|>"


def test_every_file_format_reads_the_same_records(tmp_path):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "completion"])
        w.writeheader()
        w.writerows(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for ext in ("jsonl", "json", "csv", "parquet"):
        assert [r.data for r in read_records(tmp_path / f"d.{ext}")] == rows, ext
    assert len(read_records(tmp_path)) == 8  # a directory: all four files
    (tmp_path / "t.txt").write_text("first doc\nline two\n\n\nsecond doc\n")
    recs = read_records(tmp_path / "t.txt")
    assert [r.data["text"] for r in recs] == ["first doc\nline two", "second doc"]
    assert recs[1].origin.endswith("t.txt:5")


def test_chat_in_csv_column_and_sharegpt(tmp_path, tokenizer):
    with open(tmp_path / "c.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["messages"])
        w.writeheader()
        w.writerow({"messages": json.dumps(CHAT)})
    (rec,) = read_records(tmp_path / "c.csv")
    assert record_format(rec) == "chat"
    share = DataRecord({"conversations": [{"from": "human", "value": CHAT[0]["content"]},
                                      {"from": "gpt", "value": "Paris."}]}, "s:1")
    assert encode_record(share, tokenizer) == encode_chat(CHAT, tokenizer)


def test_bad_record_is_reported_with_its_line(chat_file, tokenizer):
    p = chat_file([{"messages": CHAT}, {"text": "fine"}, {"question": "no format"}])
    with pytest.raises(YetoError, match=r"data\.jsonl:3: record fits no format.*question"):
        prepare_data(str(p), tokenizer, 64)
    p.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(YetoError, match=r"data\.jsonl:2: invalid JSON"):
        read_records(p)
    p = chat_file([{"messages": [{"role": "user", "content": "only a question"}]}])
    with pytest.raises(YetoError, match=r"data\.jsonl: none of its records can be used \(no_assistant_turn: 1\)"):
        prepare_data(str(p), tokenizer, 64)
    p = chat_file([{"messages": [{"role": "wizard", "content": "x"}]}])
    with pytest.raises(YetoError, match=r"data\.jsonl: none of its records can be used \(unknown_role: 1\)"):
        prepare_data(str(p), tokenizer, 64)


def test_missing_and_unsupported_files(tmp_path, tokenizer):
    with pytest.raises(YetoError, match="data file not found"):
        prepare_data(str(tmp_path / "nope.jsonl"), tokenizer, 64)
    (tmp_path / "x.xml").write_text("<a/>")
    with pytest.raises(YetoError, match="unsupported data file"):
        read_records(tmp_path / "x.xml")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(YetoError, match="no data files"):
        read_records(empty)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 400), num=st.integers(1, 8), frac=st.sampled_from([0.0, 0.05, 0.2]), seed=st.integers(0, 5))
def test_shards_are_disjoint_and_cover_the_train_split(n, num, frac, seed):
    shards = [split_and_shard(n, i, num, frac, seed) for i in range(num)]
    evals = {tuple(e) for _, e in shards}
    assert len(evals) == 1  # every island holds out the same records
    eval_set = set(shards[0][1])
    seen: set[int] = set()
    for train, _ in shards:
        t = set(train.tolist())
        assert not (t & seen) and not (t & eval_set)
        seen |= t
    assert seen | eval_set == set(range(n))


def test_shard_arguments_are_checked():
    with pytest.raises(YetoError, match="--island-id"):
        split_and_shard(10, 3, 3, 0.0, 0)
    with pytest.raises(YetoError, match="--islands"):
        split_and_shard(10, 0, 0, 0.0, 0)


def test_islands_see_disjoint_blocks(tokenizer):
    from tests.conftest import DEMO_DATA

    a = prepare_data(str(DEMO_DATA), tokenizer, 128, island_id=0, num_islands=2)
    b = prepare_data(str(DEMO_DATA), tokenizer, 128, island_id=1, num_islands=2)
    assert a.stats["train_records"] + b.stats["train_records"] + a.stats["eval_records"] == a.stats["records"]
    rows_a = {r.tobytes() for r in a.train.input_ids}
    rows_b = {r.tobytes() for r in b.train.input_ids}
    assert not rows_a & rows_b
    np.testing.assert_array_equal(a.eval.input_ids, b.eval.input_ids)


def test_packing_is_deterministic_and_keeps_examples_whole(tokenizer):
    from tests.conftest import DEMO_DATA

    x = prepare_data(str(DEMO_DATA), tokenizer, 128)
    y = prepare_data(str(DEMO_DATA), tokenizer, 128)
    np.testing.assert_array_equal(x.train.input_ids, y.train.input_ids)
    np.testing.assert_array_equal(x.train.loss_mask, y.train.loss_mask)
    assert x.artifact.revision == y.artifact.revision and x.artifact.revision.startswith("sha256:")
    # every block starts with a whole example: the chat template's first token
    assert (x.train.input_ids[:, 0] == tokenizer.convert_tokens_to_ids("<|im_start|>")).all()
    assert x.stats["fill"] > 0.8


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=30), seq_len=st.integers(8, 48))
def test_pack_preserves_every_token_and_mask(lens, seq_len):
    examples = [([k * 1000 + j for j in range(n)], [(k + j) % 2 for j in range(n)]) for k, n in enumerate(lens)]
    blocks, stats = pack_examples(examples, seq_len, pad_id=-1)
    # what must survive: every piece (an example, or a block-sized chunk of a longer one) with a target
    pieces = [(ids[i : i + seq_len], m[i : i + seq_len]) for ids, m in examples for i in range(0, len(ids), seq_len)]
    kept = [p for p in pieces if any(p[1][1:])]
    got = blocks.input_ids[blocks.input_ids >= 0]
    want = np.concatenate([np.asarray(ids) for ids, _ in kept]) if kept else np.zeros(0)
    assert sorted(got.tolist()) == sorted(want.tolist())
    assert blocks.loss_mask.sum() == sum(sum(m) for _, m in kept)
    assert (blocks.loss_mask[blocks.input_ids < 0] == 0).all()  # padding never carries loss
    again, _ = pack_examples(examples, seq_len, pad_id=-1)
    np.testing.assert_array_equal(blocks.input_ids, again.input_ids)


# ----------------------------------------------------------------------------- data where users keep it


def rows(tag, n):
    return [{"prompt": f"{tag} question {i}? ", "completion": f"{tag} answer {i}."} for i in range(n)]


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def block_text(tok, blocks):
    return "".join(tok.decode(row) for row in blocks.input_ids)


def test_data_under_a_dot_directory_is_read(tmp_path, tokenizer):
    # the HF cache (~/.cache/huggingface/...) and ~/.data/x: dot-directories *above* the data are fine
    data = tmp_path / ".cache" / "huggingface" / "mine"
    write_jsonl(data / "chat.jsonl", [{"messages": CHAT}] * 4)
    write_jsonl(data / ".git" / "junk.jsonl", [{"text": "never read"}])  # hidden *below* it is skipped
    assert len(read_records(data)) == 4
    d = prepare_data(str(data), tokenizer, 64, eval_fraction=0.0)
    assert d.stats["records"] == 4 and "never read" not in block_text(tokenizer, d.train)
    single = prepare_data(str(data / "chat.jsonl"), tokenizer, 64, eval_fraction=0.0)
    assert single.stats["records"] == 4


def test_upper_case_extensions_are_read_and_metadata_json_is_skipped(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d" / "PIRATES.JSONL", rows("up", 6))
    (tmp_path / "d" / "dataset_info.json").write_text(json.dumps({"description": "x", "features": {}}))
    (tmp_path / "d" / "state.json").write_text(json.dumps({"_data_files": []}))
    assert [r.data for r in read_records(tmp_path / "d" / "PIRATES.JSONL")] == rows("up", 6)
    assert len(read_records(tmp_path / "d")) == 6
    d = prepare_data(str(tmp_path / "d"), tokenizer, 64, eval_fraction=0.0)
    assert d.stats["records"] == 6
    assert d.stats["skipped_files"] == ["dataset_info.json (dataset metadata, not records)",
                                        "state.json (dataset metadata, not records)"]


def snapshot(tmp_path, splits, fmt="parquet"):
    """A hub-style snapshot: data/<split>-00000-of-00001.<fmt>, a README and a dataset_info.json."""
    root = tmp_path / "snap"
    for split, recs in splits.items():
        f = root / "data" / f"{split}-00000-of-00001.{fmt}"
        (write_parquet if fmt == "parquet" else write_jsonl)(f, recs)
    (root / "README.md").write_text("# a dataset\n")
    (root / "dataset_info.json").write_text("{}")
    return root


def test_hub_snapshot_trains_on_one_split_and_holds_out_its_validation_split(tmp_path, tokenizer):
    root = snapshot(tmp_path, {"train": rows("TRAIN", 12), "validation": rows("VALID", 3), "test": rows("TEST", 5)})
    d = prepare_data(str(root), tokenizer, 64, num_islands=2, eval_fraction=0.5)
    assert (d.stats["split"], d.stats["eval_split"]) == ("train", "validation")
    assert d.stats["records"] == 12 and d.stats["eval_records"] == 3  # all of validation; --eval-fraction unused
    assert d.stats["train_records"] == 6  # half of train: island 0 of 2
    train, held_out = block_text(tokenizer, d.train), block_text(tokenizer, d.eval)
    assert "TRAIN" in train and "VALID" not in train and "TEST" not in train
    assert "VALID" in held_out and "TRAIN" not in held_out and "TEST" not in held_out
    t = prepare_data(str(root), tokenizer, 64, split="test")
    assert "TEST" in block_text(tokenizer, t.train) and t.stats["eval_split"] == "validation"
    with pytest.raises(YetoError, match=r"^--data-split 'dev' is not a split of .*; its splits: train, "
                                        r"(validation, test|test, validation)$"):
        prepare_data(str(root), tokenizer, 64, split="dev")


def test_hub_snapshot_without_validation_holds_out_test_else_a_fraction(tmp_path, tokenizer):
    root = snapshot(tmp_path, {"train": rows("TRAIN", 10), "test": rows("TEST", 4)}, fmt="jsonl")
    d = prepare_data(str(root), tokenizer, 64)
    assert d.stats["eval_split"] == "test" and d.stats["eval_records"] == 4 and d.stats["train_records"] == 10
    assert "TEST" not in block_text(tokenizer, d.train)
    shutil.rmtree(root)
    root = snapshot(tmp_path, {"train": rows("TRAIN", 10)})
    d = prepare_data(str(root), tokenizer, 64, eval_fraction=0.2)
    assert d.stats["eval_split"] is None and d.stats["eval_records"] == 2 and d.stats["train_records"] == 8


def test_saved_dataset_dict_reads_its_splits(tmp_path, tokenizer):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(rows("TRAIN", 8)),
                 "test": Dataset.from_list(rows("TEST", 3))}).save_to_disk(str(tmp_path / "saved"))
    d = prepare_data(str(tmp_path / "saved"), tokenizer, 64)
    assert (d.stats["records"], d.stats["eval_split"], d.stats["eval_records"]) == (8, "test", 3)
    assert "TEST" not in block_text(tokenizer, d.train) and "TEST" in block_text(tokenizer, d.eval)
    with pytest.raises(YetoError, match="its splits: train, test"):
        prepare_data(str(tmp_path / "saved"), tokenizer, 64, split="validation")
    Dataset.from_list(rows("ONE", 5)).save_to_disk(str(tmp_path / "one"))
    d = prepare_data(str(tmp_path / "one"), tokenizer, 64, eval_fraction=0.0)
    assert d.stats["records"] == 5 and d.stats["split"] == "train"


README_CONFIGS = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/train.jsonl
  - split: test
    path: en/test.jsonl
- config_name: fr
  data_files:
  - split: train
    path: fr/train.jsonl
---
# two configs
"""


def test_one_config_is_read(tmp_path, tokenizer):
    root = tmp_path / "multi"
    write_jsonl(root / "en" / "train.jsonl", rows("ENGLISH", 6))
    write_jsonl(root / "en" / "test.jsonl", rows("ENTEST", 2))
    write_jsonl(root / "fr" / "train.jsonl", rows("FRENCH", 4))
    (root / "README.md").write_text(README_CONFIGS)
    with pytest.raises(YetoError, match=r"has configs en, fr: pass --data-config NAME"):
        prepare_data(str(root), tokenizer, 64)
    fr = prepare_data(str(root), tokenizer, 64, config="fr", eval_fraction=0.0)
    assert fr.stats["config"] == "fr" and fr.stats["records"] == 4
    assert "FRENCH" in block_text(tokenizer, fr.train) and "ENGLISH" not in block_text(tokenizer, fr.train)
    en = prepare_data(str(root), tokenizer, 64, config="en")
    assert (en.stats["records"], en.stats["eval_split"]) == (6, "test")
    with pytest.raises(YetoError, match=r"--data-config 'de' is not a config of .*; its configs: en, fr"):
        prepare_data(str(root), tokenizer, 64, config="de")
    (root / "README.md").unlink()  # no YAML: a config is a subfolder
    fr = prepare_data(str(root), tokenizer, 64, config="fr", eval_fraction=0.0)
    assert fr.stats["records"] == 4 and "ENGLISH" not in block_text(tokenizer, fr.train)
    with pytest.raises(YetoError, match=r"no subfolder 'de' \(subfolders: en, fr\)"):
        prepare_data(str(root), tokenizer, 64, config="de")
    with pytest.raises(YetoError, match=r"--data-config 'fr' given for the single file"):
        prepare_data(str(root / "fr" / "train.jsonl"), tokenizer, 64, config="fr")


def test_hub_dataset_id_reads_one_split_offline(tmp_path, monkeypatch, tokenizer):
    import huggingface_hub.constants as hc

    sha = "c" * 40
    snap = tmp_path / "hub" / "datasets--org--splits" / "snapshots" / sha
    write_parquet(snap / "data" / "train-00000-of-00001.parquet", rows("TRAIN", 9))
    write_parquet(snap / "data" / "test-00000-of-00001.parquet", rows("TEST", 3))
    (tmp_path / "hub" / "datasets--org--splits" / "refs").mkdir()
    (tmp_path / "hub" / "datasets--org--splits" / "refs" / "main").write_text(sha)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = prepare_data("org/splits", tokenizer, 64)
    assert d.artifact.revision == sha and (d.stats["records"], d.stats["eval_split"]) == (9, "test")
    assert "TEST" not in block_text(tokenizer, d.train)


def test_alpaca_records_are_a_chat(tokenizer):
    plain = DataRecord({"instruction": "What is the capital of France?", "input": "", "output": "Paris."}, "a:1")
    assert record_format(plain) == "alpaca"
    assert encode_record(plain, tokenizer) == encode_chat(CHAT, tokenizer)
    with_input = DataRecord({"instruction": "Translate.", "input": "bonjour", "output": "hello"}, "a:2")
    ids, mask = encode_record(with_input, tokenizer)
    assert masked_text(tokenizer, ids, mask) == "hello<|im_end|>\n"
    assert "Translate.\n\nbonjour" in unmasked_text(tokenizer, ids, mask)
    null_input = DataRecord({"instruction": "Say hi.", "input": None, "output": "hi"}, "a:3")  # parquet nulls
    assert masked_text(tokenizer, *encode_record(null_input, tokenizer)) == "hi<|im_end|>\n"


def test_unusable_records_are_counted_by_reason(tmp_path, tokenizer):
    long_prompt = "word " * 200
    good = [{"messages": CHAT}] * 5
    bad = [
        {"messages": [{"role": "user", "content": "no answer"}]},  # no assistant turn
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},  # unknown role
        {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},  # unknown ShareGPT role
        {"text": "   "},  # empty
        {"prompt": "q", "completion": ""},  # empty
        {"instruction": "do", "output": ""},  # empty
        {"messages": []},  # empty
        {"prompt": long_prompt, "completion": "the answer"},  # the prompt alone fills --seq-len
    ]
    with pytest.raises(Unusable):
        record_format(DataRecord(bad[0], "x:1"))
    p = write_jsonl(tmp_path / "mixed.jsonl", good + bad)
    d = prepare_data(str(p), tokenizer, 64, eval_fraction=0.0)
    assert d.stats["unusable"] == {"no_assistant_turn": 1, "unknown_role": 2, "empty": 4, "over_long": 1}
    assert d.stats["unusable_first"]["over_long"] == f"{p}:13"
    assert d.stats["records"] == 6 and d.stats["train_records"] == 5  # the over-long one is found when tokenized
    # a second file with nothing usable is an error naming it, even beside a good one
    write_jsonl(tmp_path / "dir" / "good.jsonl", good)
    write_jsonl(tmp_path / "dir" / "useless.jsonl", bad[:2])
    with pytest.raises(YetoError, match=r"useless\.jsonl: none of its records can be used "
                                        r"\(no_assistant_turn: 1, unknown_role: 1\)"):
        prepare_data(str(tmp_path / "dir"), tokenizer, 64)


def raising_template_model(tiny_model, tokenizer, tmp_path):
    path = tmp_path / "model-raising-template"
    shutil.copytree(tiny_model("llama"), path)
    tok = type(tokenizer).from_pretrained(path)
    tok.chat_template = "{{ raise_exception('this template takes no assistant turns') }}"
    tok.save_pretrained(path)
    return path


def corrupt_parquet(path):
    write_parquet(path, rows("x", 4))
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + b"\xff" * 64 + raw[72:])  # damaged pages, the magic bytes intact
    return path


BAD_INPUTS = {  # name -> (write the input into tmp_path, returning (--data, extra flags), the message)
    "non-UTF-8": (lambda t: ((t / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n') and t / "latin1.jsonl", []),
                  r"latin1\.jsonl: not UTF-8 text \(byte b'\\xe9' at byte offset 13\); re-save it as UTF-8"),
    "corrupt parquet": (lambda t: (corrupt_parquet(t / "broken.parquet"), []),
                        r"broken\.parquet: not a readable parquet file \(.*\); re-export it"),
    "truncated parquet": (lambda t: ((t / "short.parquet").write_bytes(b"PAR1\x00\x01") and t / "short.parquet", []),
                          r"short\.parquet: not a readable parquet file"),
    "corrupt JSON Lines": (lambda t: (write_jsonl(t / "c.jsonl", [{"text": "ok"}]).open("a").write('{"text": 1,\n')
                                      and t / "c.jsonl", []),
                           r"c\.jsonl:2: invalid JSON \(.* at column \d+\); fix the line"),
    "corrupt JSON array": (lambda t: ((t / "a.json").write_text('[\n {"text": "ok"},\n {"text": \n') and t / "a.json",
                                      []),
                           r"a\.json:4: invalid JSON"),
    "CSV row with extra fields": (lambda t: ((t / "x.csv").write_text('text\nfine\n"a",b,c\n') and t / "x.csv", []),
                                  r"x\.csv:3: 2 more field\(s\) than the header's 1; quote fields that contain commas"),
    "no usable record": (lambda t: (write_jsonl(t / "q.jsonl", [{"messages": [{"role": "user", "content": "?"}]}]),
                                    []),
                         r"q\.jsonl: none of its records can be used \(no_assistant_turn: 1\)"),
    "missing split": (lambda t: (snapshot(t, {"train": rows("a", 4), "test": rows("b", 2)}), ["--data-split", "dev"]),
                      r"--data-split 'dev' is not a split of .*; its splits: train, test"),
    "missing config": (lambda t: (write_jsonl(t / "cfg" / "en" / "train.jsonl", rows("a", 3)).parent.parent,
                                  ["--data-config", "de"]),
                       r"--data-config 'de': .* no subfolder 'de' \(subfolders: en\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_data_input_is_one_line(case, tmp_path, tokenizer):
    make, message = BAD_INPUTS[case]
    data, flags = make(tmp_path)
    split = dict(zip(flags[::2], flags[1::2]))
    with pytest.raises(YetoError, match=message):
        prepare_data(str(data), tokenizer, 64, split=split.get("--data-split", "train"),
                     config=split.get("--data-config"))


def test_a_chat_template_that_raises_is_one_line(tmp_path, tiny_model, tokenizer):
    from yeto.models.materialize import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(str(raising_template_model(tiny_model, tokenizer, tmp_path))))
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 2)
    with pytest.raises(YetoError, match=r"chat\.jsonl:\d+: the model's chat template refuses this conversation "
                                        r"\(.*takes no assistant turns\); fix the record"):
        prepare_data(str(p), tok, 64)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS) + ["chat template raises"])
def test_cli_bad_data_is_one_line_exit_2(case, tmp_path, tiny_model, tokenizer):
    from tests.conftest import REPO

    model = tiny_model("llama")
    if case == "chat template raises":
        model = raising_template_model(tiny_model, tokenizer, tmp_path)
        data, flags = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 2), []
        message = r"chat\.jsonl:\d+: the model's chat template refuses this conversation"
    else:
        make, message = BAD_INPUTS[case]
        data, flags = make(tmp_path)
    r = subprocess.run([sys.executable, "-m", "yeto", "train", "--model", str(model), "--data", str(data),
                        "--out", str(tmp_path / "run"), "--max-steps", "1", "--no-progress", *flags],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    import re

    assert lines[0].startswith("error: ") and re.search(message, lines[0]), lines[0]


# ----------------------------------------------------------------------------- data a person actually has


def run_yeto(*args, cwd=None, timeout=300):
    from tests.conftest import REPO

    return subprocess.run([sys.executable, "-m", "yeto", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout)


def one_error_line(r) -> str:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_a_seq_len_beyond_the_models_context_is_refused_before_training(tmp_path, tiny_model):
    model = tiny_model("llama")
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    r = run_yeto("train", "--model", model, "--data", DEMO_DATA, "--out", tmp_path / "run", "--max-steps", 1,
                 "--seq-len", context + 1, "--no-progress")
    line = one_error_line(r)
    assert f"--seq-len {context + 1} is longer than the context" in line and f"({context} tokens" in line
    assert not (tmp_path / "run" / "adapter").exists()


def test_a_file_in_a_data_directory_that_is_not_read_is_listed(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d" / "train.jsonl", rows("x", 6))
    (tmp_path / "d" / "notes.md").write_text("# what I meant to do\n")
    (tmp_path / "d" / "prep.py").write_text("print('made the data')\n")
    (tmp_path / "d" / "README.md").write_text("# the dataset's card\n")  # the card: not listed
    d = prepare_data(str(tmp_path / "d"), tokenizer, 64, eval_fraction=0.0)
    assert d.stats["records"] == 6
    assert [f.split(" (")[0] for f in d.stats["skipped_files"]] == ["notes.md", "prep.py"]
    assert all("not a data file" in f for f in d.stats["skipped_files"])


QA = [{"question": f"What is {i} + {i}?", "answer": f"{2 * i}.", "source": "sums"} for i in range(8)]


def write_csv(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, list(records[0]))
        w.writeheader()
        w.writerows(records)
    return path


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_columns_map_a_tables_columns_to_record_fields(fmt, tmp_path, tokenizer):
    path = {"csv": write_csv, "parquet": write_parquet, "jsonl": write_jsonl}[fmt](tmp_path / f"qa.{fmt}", QA)
    with pytest.raises(YetoError, match=r"got keys \['answer', 'question', 'source'\]\); map yours with --columns"):
        prepare_data(str(path), tokenizer, 64)
    d = prepare_data(str(path), tokenizer, 64, eval_fraction=0.0, columns="question=prompt, answer=completion")
    assert d.stats["formats"] == {"prompt_completion": 8} and d.stats["columns"] == {"question": "prompt",
                                                                                     "answer": "completion"}
    ids, mask = d.train.input_ids.ravel(), d.train.loss_mask.ravel()
    assert "What is 3 + 3?" in tokenizer.decode(ids)
    learned = masked_text(tokenizer, ids, mask)
    assert "6." in learned and "What is" not in learned  # the answer is the target, the question the prompt


def test_a_bad_column_mapping_names_the_columns_the_file_has(tmp_path, tokenizer):
    path = write_csv(tmp_path / "qa.csv", QA)
    with pytest.raises(YetoError, match=r"qa\.csv:2: --columns names 'q', not a column here; its columns: "
                                        r"question, answer, source$"):
        prepare_data(str(path), tokenizer, 64, columns="q=prompt,answer=completion")
    for spec, message in {"question": r"'question' is not COLUMN=FIELD", "question=query": r"'query' is not a "
                          r"record field; map to one of messages, ", "question=prompt,answer=prompt":
                          r"'prompt' is mapped twice"}.items():
        with pytest.raises(YetoError, match=message):
            prepare_data(str(path), tokenizer, 64, columns=spec)


def test_train_maps_columns_and_names_the_files_it_skipped(tmp_path, tiny_model):
    data = tmp_path / "mine"
    write_csv(data / "qa.csv", QA * 4)
    (data / "notes.md").write_text("where the data came from\n")
    r = run_yeto("train", "--model", tiny_model("llama"), "--data", data, "--out", tmp_path / "run", "--max-steps", 1,
                 "--seq-len", 64, "--columns", "question=prompt,answer=completion", "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [f.split(" (")[0] for f in summary["skipped_files"]] == ["notes.md"]
    said = " ".join(r.stderr.split())  # (rich wraps the console's lines)
    assert "skipped 1 file(s) of --data: notes.md (not a data file" in said
    stats = json.loads((tmp_path / "run" / "run.json").read_text())["data_stats"]
    assert stats["columns"] == {"question": "prompt", "answer": "completion"} and stats["skipped_files"]


def test_the_default_data_is_the_packaged_demo_wherever_yeto_runs(tmp_path, tokenizer):
    from yeto.island.train_config import TrainConfig

    default = TrainConfig().data
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-c", "from yeto.island.records import resolve_data, read_records\n"
                        f"a = resolve_data({default!r}); print(len(read_records(a.path)))"],
                       capture_output=True, text=True, cwd=elsewhere, timeout=120)
    assert r.returncode == 0 and int(r.stdout) > 100, r.stderr
    from tests.conftest import REPO

    assert (REPO / "data" / "demo").resolve() == DEMO_DATA.parent.resolve()  # make demo's data/demo: one copy


def test_the_wheel_ships_the_demo_data(tmp_path):
    from tests.conftest import REPO

    src = tmp_path / "src"
    shutil.copytree(REPO / "yeto", src / "yeto", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import zipfile

    (wheel,) = (tmp_path / "wheel").glob("yeto-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "yeto/data/demo/pirate_chat.jsonl" in names and "yeto/data/demo/README.md" in names


def test_a_txt_file_is_cut_into_blocks_with_a_held_out_share(tmp_path, tokenizer):
    book = tmp_path / "book.txt"
    text = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
    book.write_text(text + "\n")  # no blank line: one paragraph
    d = prepare_data(str(book), tokenizer, 64, eval_fraction=0.1)
    assert d.stats["records"] > 10 and d.stats["eval_records"] >= 1 and len(d.eval) >= 1
    assert d.stats["split_examples"] == 0  # every piece fits a block: cut before the split, not after
    from yeto.island.records import text_blocks

    pieces = text_blocks(read_records(book), tokenizer, 64)
    assert "".join(p.data["text"] for p in pieces) == text  # nothing lost, nothing repeated
    assert all(len(tokenizer(p.data["text"])["input_ids"]) <= 64 - 1 for p in pieces)  # (+ EOS: one block)
    short = tmp_path / "short.txt"
    short.write_text("first paragraph\n\nsecond paragraph\n")  # paragraphs that fit a block stay whole
    assert prepare_data(str(short), tokenizer, 64, eval_fraction=0.0).stats["records"] == 2


def test_data_inspect_shows_formats_tokens_skips_and_a_masked_sample_without_weights(tmp_path, tiny_model):
    model = tmp_path / "tokenizer-only"
    shutil.copytree(tiny_model("llama"), model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()  # only the config and the tokenizer: inspect loads no weights
    data = tmp_path / "mine"
    write_jsonl(data / "chat.jsonl", [{"messages": CHAT}] * 9 + [{"messages": CHAT[:1]}])
    (data / "notes.md").write_text("todo\n")
    r = run_yeto("data", "inspect", data, "--model", model, "--seq-len", 64, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"{data}: 9 records (chat 9), split 'train'; 1 held out" in out
    assert "tokens per record: min " in out and "(of 9 records; 0 longer than --seq-len" in out
    assert "skipped 1 record(s): no_assistant_turn (first: " in out and "chat.jsonl:10)" in out
    assert "skipped file: notes.md (not a data file" in out
    rendered = out.split("the rest is context):\n")[1]
    assert rendered.count("[[") == 1 and "[[Paris.<|im_end|>\n]]" in rendered  # the answer alone is learned
    assert "What is the capital of France?" in rendered.split("[[")[0]
    r = run_yeto("data", "inspect", data, "--model", model, "--seq-len", 100000, timeout=120)
    assert "--seq-len 100000 is longer than the context" in one_error_line(r)
