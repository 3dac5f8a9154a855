import csv
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto import YetoError
from yeto.data import (encode_chat, encode_record, pack_examples, prepare_data, read_records, record_format,
                       split_and_shard, Record)

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
    ids, mask = encode_record(Record({"prompt": "2+2=", "completion": " 4"}, "x:1"), tokenizer)
    assert masked_text(tokenizer, ids, mask) == " 4<|im_end|>"
    assert unmasked_text(tokenizer, ids, mask) == "2+2="
    ids, mask = encode_record(Record({"text": "Once upon a time."}, "x:2"), tokenizer)
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
    share = Record({"conversations": [{"from": "human", "value": CHAT[0]["content"]},
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
    with pytest.raises(YetoError, match=r":1: chat record has no assistant message"):
        prepare_data(str(p), tokenizer, 64)
    p = chat_file([{"messages": [{"role": "wizard", "content": "x"}]}])
    with pytest.raises(YetoError, match=r"role 'wizard'"):
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
    assert len(evals) == 1  # every learner holds out the same records
    eval_set = set(shards[0][1])
    seen: set[int] = set()
    for train, _ in shards:
        t = set(train.tolist())
        assert not (t & seen) and not (t & eval_set)
        seen |= t
    assert seen | eval_set == set(range(n))


def test_shard_arguments_are_checked():
    with pytest.raises(YetoError, match="--learner-id"):
        split_and_shard(10, 3, 3, 0.0, 0)
    with pytest.raises(YetoError, match="--num-learners"):
        split_and_shard(10, 0, 0, 0.0, 0)


def test_learners_see_disjoint_blocks(tokenizer):
    from tests.conftest import DEMO_DATA

    a = prepare_data(str(DEMO_DATA), tokenizer, 128, learner_id=0, num_learners=2)
    b = prepare_data(str(DEMO_DATA), tokenizer, 128, learner_id=1, num_learners=2)
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
