"""Real processes under real faults: a syncer and torch island processes (tiny Llama) on loopback.

An island SIGKILLed mid-round and restarted, the syncer SIGKILLed between a merge
and its checkpoint, a 10-second network cut (through yeto.testbed.netem's link emulator) that heals by
itself, inner steps longer than --island-timeout, and an upload slower than the
island's dead-peer timeout. Each run must finish every merge, pass the tape
audit, and leave every island holding the syncer's final adapter.
"""

import signal

import pytest

from safetensors.numpy import load_file

from tests.test_fleet import ENV, finish, start_island, syncer, wait_for
from yeto.launch.local import free_port
from yeto.testbed.netem import Link
from yeto.sync.shell.audit import audit_run
from yeto.sync.shell.tape import read_tape


def assert_run_complete(s_out, outs, outer_steps, island_dirs, quorum_of=None):
    """Every process exited 0, every merge happened, the audit passes, every island holds the final adapter."""
    for name, (code, text) in outs.items():
        assert code == 0, f"{name} exited {code}:\n{text[-3000:]}"
    report = audit_run(s_out)
    assert report.ok and report.version == outer_steps, report.summary()
    events = read_tape(s_out)
    if quorum_of is not None:
        committed = {e["version"]: e for e in events if e["event"] == "merge"}  # the redo replaces a rollback
        assert all(sorted(m["responders"]) == quorum_of for m in committed.values()), committed
    merged = load_file(s_out / "adapter" / "adapter_model.safetensors")
    for d in island_dirs:
        mine = load_file(d / "adapter" / "adapter_model.safetensors")
        assert sorted(mine) == sorted(merged) and all((mine[k] == merged[k]).all() for k in merged), d
    return events


def test_a_island_killed_mid_round_and_restarted_rejoins_and_its_delta_counts(tiny_model, tmp_path):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 3, "--inner-steps", 4,
                              "--island-timeout", 4)}
    procs[0] = start_island(model, port, 0, 2, tmp_path / "l0", "--step-delay", 0.2, "--syncer-timeout", 5)
    slow = ("--step-delay", 1.5, "--syncer-timeout", 5)  # its rounds take 6 s, island 0's about 1 s
    victim = start_island(model, port, 1, 2, tmp_path / "l1", *slow)
    wait_for(s_out, "round_open", round=2)
    wait_for(s_out, "delta", round=2, island=0)  # mid-round: island 0 is done, island 1 still training
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    assert not any(e["event"] == "delta" and e["round"] == 2 and e["island"] == 1 for e in read_tape(s_out))
    procs[1] = start_island(model, port, 1, 2, tmp_path / "l1", *slow)  # the same command again
    outs = finish(procs)
    events = assert_run_complete(s_out, outs, 3, [tmp_path / "l0", tmp_path / "l1"], quorum_of=[0, 1])
    sessions = {e["session"] for e in events if e["event"] == "join" and e["island"] == 1}
    assert len(sessions) == 2  # the restarted process joined as a new session of island 1 ...
    rejoin = [e for e in events if e["event"] == "join" and e["island"] == 1 and e.get("rejoin")]
    assert rejoin and rejoin[0]["round"] == 2  # ... into the open round 2, whose merge it then made
    assert not any(e["event"] == "quorum_timeout" for e in events)


@pytest.mark.parametrize("streamed", [(), ("--fragments", 2)], ids=["whole", "streamed"])
def test_the_syncer_killed_between_a_merge_and_its_checkpoint_resumes_losing_nothing(tiny_model, tmp_path, streamed):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    flags = ("--islands", 2, "--quorum", 2, "--outer-steps", 3, "--inner-steps", 3, "--island-timeout", 4, *streamed)
    first = syncer(port, s_out, *flags, env=dict(ENV, YETO_CRASH_AT="checkpoint:2"))
    procs = {i: start_island(model, port, i, 2, tmp_path / f"l{i}", "--syncer-timeout", 3) for i in (0, 1)}
    first_out, _ = first.communicate(timeout=240)
    assert first.returncode == -signal.SIGKILL, first_out[-3000:]
    procs["syncer"] = syncer(port, s_out, *flags)  # the same command, restarted
    outs = finish(procs)
    events = assert_run_complete(s_out, outs, 3, [tmp_path / "l0", tmp_path / "l1"], quorum_of=[0, 1])
    rollback = [e for e in events if e["event"] == "rollback"]
    resume = [e for e in events if e["event"] == "resume"]
    assert [e["version"] for e in rollback] == [2] and resume[0]["version"] == 1
    assert sorted(resume[0]["restored"]) == [0, 1]  # both round-2 deltas had been saved: merged again, once
    merges_2 = [e for e in events if e["event"] == "merge" and e["version"] == 2]
    assert len(merges_2) == 2 and merges_2[0]["deltas"] == merges_2[1]["deltas"]
    assert merges_2[0]["digest"] == merges_2[1]["digest"]  # the redo is bit for bit the lost merge
    parts = [e.get("part") for e in events if e["event"] == "merge"]
    assert all(parts[:3]) == bool(streamed) and (not streamed or parts[1] == parts[2] != parts[0])  # (the redo: its
    assert parts[3] is None  # part; the last round, whole)


def test_a_ten_second_network_cut_heals_by_itself(tiny_model, tmp_path):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    proxy = Link(port)
    try:
        procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 3, "--inner-steps", 3,
                                  "--island-timeout", 4)}
        procs[0] = start_island(model, port, 0, 2, tmp_path / "l0", "--step-delay", 0.3, "--syncer-timeout", 3)
        procs[1] = start_island(model, proxy.port, 1, 2, tmp_path / "l1", "--step-delay", 0.3, "--syncer-timeout", 3)
        wait_for(s_out, "round_open", round=2)
        proxy.cut(10.0)
        outs = finish(procs)
    finally:
        proxy.close()
    events = assert_run_complete(s_out, outs, 3, [tmp_path / "l0", tmp_path / "l1"], quorum_of=[0, 1])
    assert any(e["event"] == "leave" and e["island"] == 1 and "silent" in e["reason"] for e in events)  # felt ...
    assert "reconnecting" in outs[1][1]  # ... on both sides, and healed without help


def test_an_inner_step_longer_than_the_island_timeout_is_not_a_dead_island(tiny_model, tmp_path):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 2, "--inner-steps", 2,
                              "--island-timeout", 2)}
    procs[0] = start_island(model, port, 0, 2, tmp_path / "l0")
    procs[1] = start_island(model, port, 1, 2, tmp_path / "l1", "--step-delay", 3.5)  # every step outlasts the timeout
    outs = finish(procs)
    events = assert_run_complete(s_out, outs, 2, [tmp_path / "l0", tmp_path / "l1"], quorum_of=[0, 1])
    assert not any(e["event"] == "leave" and "silent" in e["reason"] for e in events)
    assert all(e["inner_steps"] == 2 for e in events if e["event"] == "delta" and e["island"] == 1)


def test_an_upload_slower_than_the_dead_peer_timeout_is_not_a_dead_syncer(tiny_model, tmp_path):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    proxy = Link(port)
    rate = 2000  # bytes/s island -> syncer, once the run has started
    try:
        procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 2, "--inner-steps", 2,
                                  "--island-timeout", 3, "--sync-bits", 32)}
        procs[0] = start_island(model, port, 0, 2, tmp_path / "l0")
        procs[1] = start_island(model, proxy.port, 1, 2, tmp_path / "l1", "--syncer-timeout", 2.5)
        wait_for(s_out, "round_open", round=1)
        proxy.throttle_up(rate, per_connection=True)  # the delta's connection is slow, the heartbeats' is not
        outs = finish(procs)
    finally:
        proxy.close()
    events = assert_run_complete(s_out, outs, 2, [tmp_path / "l0", tmp_path / "l1"], quorum_of=[0, 1])
    uploads = [e["bytes"] for e in events if e["event"] == "delta" and e["island"] == 1]
    assert min(uploads) / rate > 2 * 2.5  # each upload took over twice the dead-peer timeout ...
    assert not any(e["event"] == "leave" and "silent" in e["reason"] for e in events)  # ... and nobody looked dead
    assert "reconnecting" not in outs[1][1]
