"""The tape audit names the first broken invariant; the disk store survives torn writes and damaged files."""

import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from yeto.sync.shell.audit import audit
from yeto.sync.core.actions import AcceptedDelta, Checkpoint
from yeto.sync.wire.layout import build_layout
from yeto.sync.wire.protocol import array_digest
from yeto.sync.sim import Schedule, World
from yeto.sync.shell.store import PREV_STATE_FILE, STATE_FILE, DiskStore
from yeto.sync.shell.tape import TAPE_FILE, Tape


@pytest.fixture(scope="module")
def good_tape():
    """A real tape from a simulated run with a syncer crash, a rollback and a resume."""
    for seed in range(60):
        w = World(Schedule.draw(seed))
        w.run()
        tape = w.syncer.disk.tape
        kinds = {e["event"] for e in tape}
        if {"resume", "merge", "delta"} <= kinds and sum(e["event"] == "merge" for e in tape) >= 3:
            assert audit(tape).ok, audit(tape).summary()
            return tape
    raise AssertionError("no simulated run with a restart in the first 60 seeds")


def renumber(events):
    return [dict(e, seq=i) for i, e in enumerate(events)]


def first(tape, event, **where):
    return next(i for i, e in enumerate(tape) if e["event"] == event and all(e.get(k) == v for k, v in where.items()))


def test_a_good_tape_passes(good_tape):
    report = audit(good_tape)
    assert report.ok and report.merges == report.version >= 2 and report.restarts >= 1


def _delta_before_finish(t):
    last = t[first(t, "finish", complete=True)]
    t.insert(t.index(last), {**t[first(t, "delta")], "round": last["version"] + 1, "base_version": last["version"]})


def _quorum_of_99(t):
    t[:] = [e for e in t if e["event"] != "given_up"]  # (an island given up would lower the quorum, by the rule)
    for e in t:
        if e["event"] == "start":
            e["config"].update(quorum=99, islands=99)


@pytest.mark.parametrize("name,edit,message", [
    ("a lost line", lambda t: t.pop(len(t) // 2), "expected seq"),
    ("a delta accepted twice", lambda t: t.insert(first(t, "delta") + 1, dict(t[first(t, "delta")])), "accepted twice"),
    ("a merge below quorum", _quorum_of_99, "below the quorum"),
    ("a merge whose quorum is extra ids",
     lambda t: [e.update(tier="extra") for e in t if e["event"] == "delta"], "count toward quorum"),
    ("a version merged twice", lambda t: t.insert(first(t, "merge") + 1, dict(t[first(t, "merge")])), "consecutive"),
    ("a merge of a delta never accepted", lambda t: t[first(t, "merge")]["deltas"].__setitem__(0, "0" * 16),
     "not an outstanding accepted delta"),
    ("a restart at the wrong version", lambda t: t[first(t, "resume")].update(version=99),
     "restart resumed at version"),
    ("an accepted delta never merged", _delta_before_finish, "accepted deltas never merged"),
    ("a claim that bought more than the median's weight",
     lambda t: t[first(t, "merge")].update(counted=[c * 1e6 for c in t[first(t, "merge")]["counted"]]),
     "the bound gives"),
    ("an inflated clip reference (its merged norms within its own bound)",
     lambda t: t[first(t, "merge")].update(clip_ref=t[first(t, "merge")]["clip_ref"] * 1e3), "the tape's norms give"),
    ("a weight not what the capped claims and scales give",
     lambda t: t[first(t, "merge")].update(weights=[w * 2 for w in t[first(t, "merge")]["weights"]]),
     "the capped claims and step scales give"),
    ("a delta merged above the clip's bound",
     lambda t: t[first(t, "merge")].update(merged_norms=[n + 1e3 for n in t[first(t, "merge")]["merged_norms"]]),
     "above the clip bound"),
])
def test_a_planted_violation_is_named(good_tape, name, edit, message):
    t = copy.deepcopy(good_tape)
    edit(t)
    if name != "a lost line":
        t = renumber(t)
    report = audit(t)
    assert not report.ok, name
    assert message in str(report.violation), (name, report.summary())


def test_yeto_tape_audit_exits_nonzero_naming_the_violation(good_tape, tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d, events in ((good, good_tape), (bad, renumber(good_tape[:3] + good_tape[3:][::-1]))):
        d.mkdir()
        (d / TAPE_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    ok = subprocess.run([sys.executable, "-m", "yeto", "tape", str(good), "--audit"], cwd=REPO, capture_output=True,
                        text=True)
    assert ok.returncode == 0 and "audit OK" in ok.stdout, ok.stdout + ok.stderr
    ko = subprocess.run([sys.executable, "-m", "yeto", "tape", str(bad), "--audit"], cwd=REPO, capture_output=True,
                        text=True)
    assert ko.returncode == 1 and "audit FAILED at seq" in ko.stdout, ko.stdout + ko.stderr


# ---------------------------------------------------------------------------------------------- the disk


def a_checkpoint(version, seed=0):
    rng = np.random.default_rng(seed)
    layout = build_layout({"m.lora_A.default.weight": np.zeros((2, 8), np.float32)})
    g = rng.standard_normal(layout.numel).astype(np.float32)
    return Checkpoint(version, layout, {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q"]},
                      {"model": "x"}, g, rng.standard_normal(layout.numel).astype(np.float32),
                      rng.standard_normal(layout.numel).astype(np.float32), array_digest(g), {"sync_bits": 4}, [0, 1],
                      {0: [[version, "abc"]]})


def test_a_torn_last_tape_line_is_cut_and_the_sequence_continues(tmp_path):
    tape = Tape(tmp_path)
    for i in range(3):
        tape.append("ping", i=i)
    tape.close()
    with open(tmp_path / TAPE_FILE, "ab") as f:
        f.write(b'{"seq":3,"time":1.0,"event":"mer')  # the syncer died mid-line
    store = DiskStore(tmp_path)
    durable = store.load()
    assert [n.event for n in durable.notes] == ["tape_repair"] and durable.notes[0].fields["dropped_bytes"] == 32
    assert [e["seq"] for e in durable.tape] == [0, 1, 2]
    store.append("start", {})
    store.close()
    assert [e["seq"] for e in Tape(tmp_path).read_all()] == [0, 1, 2, 3]


def test_checkpoints_round_trip_bit_for_bit_and_a_damaged_one_falls_back_to_the_previous(tmp_path):
    store = DiskStore(tmp_path)
    store.save_checkpoint(a_checkpoint(1, seed=1))
    store.save_checkpoint(a_checkpoint(2, seed=2))
    back = store.load().checkpoint
    want = a_checkpoint(2, seed=2)
    assert back.version == 2 and back.merged == {0: [[2, "abc"]]} and back.members == [0, 1]
    for name in ("global_", "momentum", "residual"):
        assert getattr(back, name).tobytes() == getattr(want, name).tobytes()
    raw = bytearray((tmp_path / STATE_FILE).read_bytes())
    raw[-5] ^= 0xFF  # one flipped byte in the arrays
    (tmp_path / STATE_FILE).write_bytes(bytes(raw))
    durable = DiskStore(tmp_path).load()
    assert durable.checkpoint.version == 1 and durable.notes[0].event == "checkpoint_damaged"
    (tmp_path / PREV_STATE_FILE).write_bytes(b"garbage")
    with pytest.raises(Exception, match="every checkpoint .* is damaged"):
        DiskStore(tmp_path).load()


def test_saved_deltas_round_trip_and_drop(tmp_path):
    store = DiskStore(tmp_path)
    frames = (b"\x01\x02\x03", b"\x04" * 10)
    from yeto.sync.wire.protocol import digest_bytes

    d = AcceptedDelta(3, "s", 2, 1, 100, 50, 4, 0.5, digest_bytes(frames), [{"index": 0, "numel": 1, "bits": 4}] * 2,
                      frames)
    store.save_delta(d)
    store.save_delta(AcceptedDelta(**{**d.__dict__, "island": 4, "round": 3}))
    back = {(x.round, x.island): x for x in store.load().deltas}
    assert back[(2, 3)].frames == frames and back[(2, 3)].digest == d.digest and back[(2, 3)].loss_tokens == 50
    store.drop_deltas(through_round=2)
    assert [(x.round, x.island) for x in store.load().deltas] == [(3, 4)]
