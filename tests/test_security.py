"""The threat model of docs/SECURITY.md against a real, CURVE-secured syncer on loopback.

Strangers (no key, a wrong key, plain text), a holder of the join key who replays,
takes over ids or lies about its training, an island on another base model, a
hostile delta, floods of connections and oversized frames, and a fuzzer: each
must leave the honest islands merging and the run's state untouched.
"""

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch  # noqa: F401  (imported up front: quantize's first import would stall a raw island past a 1 s timeout)
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from tests.peers import (ADAPTER_CONFIG, FAST, SEND_TIMEOUT_MS, HeldIsland, QuadraticIsland, RawIsland, island_thread,
                         tape_with, wait_until)
from yeto import YetoError
from yeto.island.diloco import run_island
from yeto.launch.local import free_port
from yeto.sync.shell import client
from yeto.sync.shell import gate as gating
from yeto.sync.shell.keys import JoinKey, Keyring, island_join_key, read_join_key
from yeto.sync.wire.protocol import encode
from yeto.sync.shell.server import Syncer, SyncerConfig
from yeto.sync.shell.tape import read_tape
from yeto.sync.core.island import LinkTimeouts

FUZZ_CASES = int(os.environ.get("YETO_FUZZ_CASES", "1000"))
HELD_STEPS = 4  # a held honest fleet's steps before it waits (2 rounds merge under the fuzz, the rest after it)
HOLD_S = 300  # the longest it waits (the fuzz takes well under a minute)
KEYS_CLI_TIMEOUT_S = 60  # one `yeto keys` command (it waits a few seconds for the syncer's acknowledgement)


def secure(start_syncer, **kw):
    """A syncer with security on (the default outside tests/test_syncer.py); returns (syncer, port, join key)."""
    syncer, port = start_syncer(insecure=False, **kw)
    return syncer, port, syncer.keys.join


def honest_fleet(port, key, n=2, hold: threading.Event | None = None, **kw):
    """`hold`: the islands take HELD_STEPS steps, then wait for it (the run outlasts what the test does meanwhile)."""
    results = {}
    islands = {i: QuadraticIsland(1.0 - 2 * i, 100 + 50 * i) if hold is None else
               HeldIsland(1.0 - 2 * i, 100 + 50 * i, steps_before=HELD_STEPS, hold=hold, hold_s=HOLD_S)
               for i in range(n)}
    threads = [island_thread(isl, port, i, results, join_key=key, **kw) for i, isl in islands.items()]
    return threads, results


def join_all(threads, results, timeout=60):
    for t in threads:
        t.join(timeout)
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results


def send_if_connected(sock: zmq.Socket, parts: list[bytes]) -> None:
    """A refused peer may have no connection left to queue on (a DEALER would block): then nothing is sent."""
    try:
        sock.send_multipart(parts, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def stranger_key(key: JoinKey) -> JoinKey:
    public, secret = zmq.curve_keypair()
    return JoinKey(key.syncer_public, public, secret)


def test_credentials_are_private_reused_on_restart_and_given_keys_are_honoured(tmp_path):
    ring = Keyring.ensure(tmp_path / "run")
    for f in (tmp_path / "run" / "join.key", tmp_path / "run" / "keys" / "syncer.key_secret"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    again = Keyring.ensure(tmp_path / "run")
    assert (again.syncer_public, again.join) == (ring.syncer_public, ring.join)
    # --join-key FILE: a join key made beforehand for this syncer key is admitted and becomes the run's join.key
    given_key = JoinKey(ring.syncer_public, *zmq.curve_keypair())
    path = tmp_path / "given.key"
    path.write_text(given_key.text())
    assert Keyring.ensure(tmp_path / "run", str(path)).join == given_key
    assert read_join_key(tmp_path / "run" / "join.key") == given_key
    other = Keyring.ensure(tmp_path / "other")  # a join key of another run names another syncer key
    with pytest.raises(YetoError, match="made for another syncer key"):
        Keyring.ensure(tmp_path / "other", str(tmp_path / "run" / "join.key"))
    assert other.join != given_key
    with pytest.raises(YetoError, match="not a yeto join key"):
        JoinKey.parse("secret-key = \"x\"\n", "env")


def test_insecure_is_refused_off_loopback_and_islands_need_a_key(tmp_path, monkeypatch):
    with pytest.raises(YetoError, match="--insecure is refused"):
        Syncer(SyncerConfig(host="0.0.0.0", port=free_port(), out=str(tmp_path / "s"), insecure=True))
    with pytest.raises(YetoError, match="--insecure is refused"):
        island_join_key(None, True, "203.0.113.7:29400")
    monkeypatch.delenv("YETO_JOIN_KEY", raising=False)
    with pytest.raises(YetoError, match="no join key: pass --join-key FILE or set YETO_JOIN_KEY"):
        island_join_key(None, False, "127.0.0.1:29400")
    key = Keyring.ensure(tmp_path / "s").join
    monkeypatch.setenv("YETO_JOIN_KEY", key.text())  # the file's contents, never a command-line argument
    assert island_join_key(None, False, "10.0.0.1:29400") == key


def test_strangers_get_nothing_and_change_nothing_while_honest_islands_merge(start_syncer, tmp_path):
    syncer, port, key = secure(start_syncer, islands=2, quorum=2, outer_steps=4, inner_steps=2)
    threads, results = honest_fleet(port, key, step_delay=0.1)
    assert wait_until(lambda: syncer.version >= 0, 15)
    plain = RawIsland(port, 7)  # no CURVE at all
    wrong = RawIsland(port, 8, key=stranger_key(key))  # CURVE with a key the run never issued
    for s in (plain, wrong):
        parts, _ = s.hello_parts(QuadraticIsland(0.0, 1).state)
        send_if_connected(s.ctl, parts)
        with pytest.raises(AssertionError, match="sent no message"):
            s.recv(timeout=1.5)
    join_all(threads, results)
    tape = read_tape(tmp_path / "syncer")
    assert {e["island"] for e in tape if e["event"] == "join"} == {0, 1}  # no stranger ever reached the core
    refused = [e for e in tape if e["event"] == "auth_refused"]
    assert refused and all(e["address"] == "127.0.0.1" for e in refused)
    assert any("unknown key" in e["reason"] for e in refused)  # the wrong key, at the gatekeeper
    failed = [e for e in tape if e["event"] == "handshake_failed"]
    assert any("no CURVE" in e["reason"] for e in failed), [e for e in tape if "refused" in e["event"]]
    assert sum(e["event"] == "merge" for e in tape) == 4


def test_a_island_with_a_wrong_or_missing_key_exits_with_what_is_missing(start_syncer):
    syncer, port, key = secure(start_syncer, islands=1, quorum=1, outer_steps=1, inner_steps=1)
    with pytest.raises(YetoError, match="refused this island's key.*--join-key"):
        run_island(QuadraticIsland(0.0, 1), f"127.0.0.1:{port}", 0, log_fn=lambda s: None,
                   join_key=stranger_key(key))
    with pytest.raises(YetoError, match="requires a join key: pass --join-key"):
        run_island(QuadraticIsland(0.0, 1), f"127.0.0.1:{port}", 0, log_fn=lambda s: None, join_key=None)
    other_syncer = JoinKey(zmq.curve_keypair()[0], key.public, key.secret)  # (the syncer cuts its handshakes: it
    # cannot read them, and says nothing; a stranger crowding our address would look the same, so it is retried
    # until --give-up-after, then said)
    seen: list[str] = []
    with pytest.raises(YetoError, match="unreachable for .* cut [0-9]+ handshake.*join key is this run's"):
        run_island(QuadraticIsland(0.0, 1), f"127.0.0.1:{port}", 0, log_fn=seen.append, join_key=other_syncer,
                   timeouts=LinkTimeouts(heartbeat_s=0.5, dead_after_s=2.0, give_up_s=4.0))
    assert sum("cut" in s and "retrying until --give-up-after" in s for s in seen) >= 1
    assert syncer.core.state.founding is None and syncer.core.run is None


def test_replay_from_another_connection_and_identity_takeover_are_refused(start_syncer, tmp_path):
    syncer, port, key = secure(start_syncer, islands=2, quorum=2, outer_steps=1, inner_steps=1, sync_bits=32)
    a = RawIsland(port, 0, key=key)
    state = QuadraticIsland(0.0, 1).state
    layout = a.found(state)
    b = RawIsland(port, 1, key=key)
    b.ask(b.hello_parts(state)[0])
    assert a.recv(want="round").header["round"] == 1
    delta = a.delta_parts(layout, 1, 0, np.full(layout.numel, 0.5, np.float32))
    # the same bytes, replayed by another holder of the join key on its own connection
    thief = RawIsland(port, 0, key=key, ident=b"island-0-s1-other")
    err = thief.ask(delta, bulk=True)
    assert err.type == "error" and err.header["code"] == "identity"
    assert 0 not in syncer.core.state.pending
    # another identity claiming island 0's id while it is live: refused and recorded; island 0 keeps it
    taker = RawIsland(port, 0, session="s2", key=key, identity="someone-else-entirely")
    err = taker.ask(taker.hello_parts(state)[0])
    assert err.type == "error" and err.header["code"] == "id_taken"
    assert syncer.core.state.members[0].session == "s1"
    assert a.ask(delta, bulk=True).type == "ack"  # the real island 0 is undisturbed
    tape = tape_with(tmp_path / "syncer", "delta")
    assert any(e["event"] == "reject" and e["code"] == "id_taken" for e in tape)
    assert any(e["event"] == "reject" and e["code"] == "identity" for e in tape)
    # the same island restarted (same identity, newer session) takes its id back at once
    restarted = RawIsland(port, 0, session="s3", key=key)
    assert restarted.ask(restarted.hello_parts(state)[0]).type == "welcome"
    for s in (a, b, thief, taker, restarted):
        s.close()


def test_per_island_keys_bind_an_id_and_can_be_revoked(start_syncer, tmp_path):
    out = tmp_path / "syncer"
    ring = Keyring.ensure(out)
    lk = read_join_key(ring.add_island(1))
    syncer, port, key = secure(start_syncer, islands=1, quorum=1, outer_steps=50, inner_steps=1, sync_bits=32)
    state = QuadraticIsland(0.0, 1).state
    RawIsland(port, 0, key=key).found(state)
    impostor = RawIsland(port, 1, key=key)  # the shared join key may not speak for island 1 any more
    r = impostor.ask(impostor.hello_parts(state)[0])
    assert r.type == "refuse" and r.header["code"] == "identity" and "own key" in r.header["reason"]
    wrong_id = RawIsland(port, 2, key=lk)  # island 1's key may not speak for island 2
    r = wrong_id.ask(wrong_id.hello_parts(state)[0])
    assert r.type == "refuse" and "belongs to island:1" in r.header["reason"]
    one = RawIsland(port, 1, key=lk)
    assert one.ask(one.hello_parts(state)[0]).type == "welcome"
    ring.revoke_island(1)
    assert one.recv(timeout=8, want="refuse").header["code"] == "revoked"
    tape = tape_with(out, "revoked")
    assert any(e["event"] == "revoked" and e["island"] == 1 for e in tape)
    again = RawIsland(port, 1, session="s9", key=lk)
    send_if_connected(again.ctl, again.hello_parts(state)[0])
    with pytest.raises(AssertionError, match="sent no message"):
        again.recv(timeout=1.5)
    assert any(e["event"] == "auth_refused" and "revoked" in e["reason"] for e in read_tape(out))


def yeto_keys(*args) -> subprocess.CompletedProcess:
    """`yeto keys ARGS` as a person runs it."""
    return subprocess.run([sys.executable, "-m", "yeto", "keys", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=KEYS_CLI_TIMEOUT_S)


def test_keys_reach_the_running_syncer_through_its_launch_directory_and_a_wrong_directory_is_refused(start_syncer,
                                                                                                     tmp_path):
    """Issue 36: `yeto keys revoke --out` on a typo exited 0, made a second keyring no syncer reads, and island 1
    stayed admitted. Now a directory holding no keyring is refused in one line (exit 2, nothing written), an island's
    --out names its syncer's, the launch's --out means its syncer's, and add and revoke say that the running
    syncer took the change in (its tape's `keys` record), or that it is not running."""
    launch = tmp_path / "fleet"
    out = launch / "syncer"
    lk = read_join_key(Keyring.ensure(out).add_island(1))
    (launch / "island-1").mkdir()
    (launch / "island-1" / "run.json").write_text("{}")
    syncer, port, key = secure(start_syncer, islands=1, quorum=1, outer_steps=50, inner_steps=1, sync_bits=32,
                               out=out)
    state = QuadraticIsland(0.0, 1).state
    RawIsland(port, 0, key=key).found(state)
    one = RawIsland(port, 1, key=lk)
    assert one.ask(one.hello_parts(state)[0]).type == "welcome"
    for wrong, says in [(tmp_path / "flete", "does not exist"), (launch / "island-1", f"its syncer's is {out}")]:
        r = yeto_keys("revoke", "--out", wrong, "--island", 1)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
        assert not (wrong / "keys").exists() and not (wrong / "join.key").exists()
    r = yeto_keys("add", "--out", launch, "--island", 7)
    assert r.returncode == 0 and str(out / "keys" / "islands" / "7.key") in r.stdout, r.stderr
    assert "the running syncer picked it up" in r.stdout, r.stdout
    r = yeto_keys("revoke", "--out", launch, "--island", 1)
    assert r.returncode == 0 and "the running syncer picked it up" in r.stdout, r.stdout + r.stderr
    assert one.recv(timeout=8, want="refuse").header["code"] == "revoked"
    assert [(e["islands"], e["revoked"]) for e in read_tape(out) if e["event"] == "keys"] == [([1, 7], []), ([7], [1])]
    assert not (launch / "keys").exists()  # (no second keyring beside the syncer's)
    syncer.stop()
    assert wait_until(lambda: any(e["event"] in ("stop", "finish") for e in read_tape(out)))
    r = yeto_keys("revoke", "--out", out, "--island", 7)
    assert r.returncode == 0 and "the syncer is not running" in r.stdout, r.stdout + r.stderr
    one.close()


def test_keys_refuse_a_cloud_launchs_copies_its_syncer_never_reads(tmp_path):
    """A cloud launch's syncer took its keys to the head VM at launch: a key revoked in this machine's copy never
    reached it. `yeto keys add/revoke` on that launch (its directory or its syncer/) is one line saying where to run
    it, and nothing is changed."""
    launch = tmp_path / "pirate"
    Keyring.ensure(launch / "syncer").add_island(2)
    (launch / "plan.json").write_text("{}")
    for out in (launch, launch / "syncer"):
        r = yeto_keys("revoke", "--out", out, "--island", 2)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "cloud launch" in lines[0] and "ssh" in lines[0], r.stderr
    assert (launch / "syncer" / "keys" / "islands" / "2.key").is_file()


def test_expected_ids_get_keys_of_their_own_so_no_join_key_holder_takes_one(start_syncer, tmp_path):
    """By default the run's first start issues an island key per expected id: a holder of the join key asking for
    island 1 before island 1 starts (issue 34: the real island then got id_taken) is refused, naming the key to
    use; island 1 on its key is welcomed, trusted; the join key still admits ids beyond --islands, as extra. A
    revoked key is not issued again."""
    out = tmp_path / "syncer"
    syncer, port, key = secure(start_syncer, islands=2, quorum=2, outer_steps=5, inner_steps=1, island_keys=True,
                               out=out)
    mine = {lid: read_join_key(out / "keys" / "islands" / f"{lid}.key") for lid in (0, 1)}
    assert all(k.island == lid for lid, k in mine.items())
    state = QuadraticIsland(0.0, 1).state
    RawIsland(port, 0, key=mine[0]).found(state)
    taker = RawIsland(port, 1, key=key)
    r = taker.ask(taker.hello_parts(state)[0])
    assert r.type == "refuse" and r.header["code"] == "identity" and "keys/islands/1.key" in r.header["reason"]
    one = RawIsland(port, 1, key=mine[1])
    assert one.ask(one.hello_parts(state)[0]).type == "welcome"
    extra = RawIsland(port, 2, key=key)
    assert extra.ask(extra.hello_parts(state)[0]).type == "welcome"
    assert wait_until(lambda: {e["island"]: e["tier"] for e in read_tape(out) if e["event"] == "join"} == {
        0: "trusted", 1: "trusted", 2: "extra"}), [e for e in read_tape(out) if e["event"] == "join"]
    ring = Keyring.ensure(out)
    ring.revoke_island(1)
    assert ring.issue_expected(2) == [] and not (out / "keys" / "islands" / "1.key").exists()
    for p in (taker, one, extra):
        p.close()


def test_the_contract_is_pinned_and_a_mismatch_names_the_field_and_both_values(start_syncer):
    syncer, port, key = secure(start_syncer, islands=1, quorum=1, outer_steps=5, inner_steps=1,
                               model="smollm2-135m", model_revision="sha256:aaa")
    state = QuadraticIsland(0.0, 1).state
    prov = {"model": {"name": "smollm2-135m", "source": "package", "revision": "sha256:aaa"}}
    founder = RawIsland(port, 0, key=key)
    req = founder.ask(founder.hello_parts(state, provenance=prov)[0])
    assert req.type == "init_request"
    other_rev = RawIsland(port, 1, key=key)
    other_prov = {"model": {**prov["model"], "revision": "sha256:bbb"}}
    r = other_rev.ask(other_rev.hello_parts(state, provenance=other_prov)[0])
    assert r.type == "refuse" and r.header["code"] == "contract_mismatch"
    assert ("base_revision (--model-revision) is 'sha256:bbb' on this island, 'sha256:aaa' in the run"
            in r.header["reason"])
    other_alpha = RawIsland(port, 2, key=key)
    r = other_alpha.ask(other_alpha.hello_parts(state, {**ADAPTER_CONFIG, "lora_alpha": 16}, prov)[0])
    assert r.type == "refuse" and "lora_alpha (--lora-alpha) is 16 on this island, 4 in the run" in r.header["reason"]
    assert syncer.core.state.founding.provenance["run"]["lora_alpha"] == 4  # the run's provenance: its contract


@pytest.mark.parametrize("field, changed, reason", [
    ("data", {"data": {"name": "d", "revision": "sha256:other"}}, "data (--data"),
    ("split", {"data_stats": {"split": "test"}}, "sha256:ddd test"),
    ("loss", {"loss": "my_loss@sha256:two"}, "loss (--loss-function) is 'my_loss@sha256:two' on this island"),
    ("shard count", {"config": {"num_islands": 1}}, "num_islands (--islands) is 1 on this island, 2 in"),
])
def test_a_island_on_other_data_another_loss_or_another_shard_count_is_refused(start_syncer, field, changed,
                                                                                reason):
    syncer, port, key = secure(start_syncer, islands=2, quorum=2, outer_steps=5, inner_steps=1)
    state = QuadraticIsland(0.0, 1).state
    prov = {"data": {"name": "d", "revision": "sha256:ddd"}, "data_stats": {"split": "train"},
            "loss": "my_loss@sha256:one", "config": {"num_islands": 2}}
    founder = RawIsland(port, 0, key=key)
    assert founder.ask(founder.hello_parts(state, provenance=prov)[0]).type == "init_request"
    other = RawIsland(port, 1, key=key)
    r = other.ask(other.hello_parts(state, provenance={**prov, **changed})[0])
    assert r.type == "refuse" and r.header["code"] == "contract_mismatch", r.header
    assert reason in r.header["reason"], r.header["reason"]


def test_inflated_claims_are_refused_and_an_outlier_delta_is_clipped(start_syncer, tmp_path):
    syncer, port, key = secure(start_syncer, islands=3, quorum=3, outer_steps=2, inner_steps=2, sync_bits=32,
                               outer_lr=1.0, outer_momentum=0.0)
    state = QuadraticIsland(0.0, 1).state
    peers = [RawIsland(port, i, key=key) for i in range(3)]
    layout = peers[0].found(state)
    for p in peers[1:]:
        p.ctl.send_multipart(p.hello_parts(state, tokens_per_step=64)[0])
        assert p.recv(want="welcome")
    greedy = peers[1].delta_parts(layout, 1, 0, np.full(layout.numel, 0.1, np.float32), tokens=10**6,
                                  loss_tokens=10**6, steps=2)
    err = peers[1].ask(greedy, bulk=True, want="error")
    assert err.type == "error" and "declared at most 64 tokens per step" in err.header["reason"]
    err = peers[1].ask(peers[1].delta_parts(layout, 1, 0, np.zeros(layout.numel, np.float32), steps=3), bulk=True,
                       want="error")
    assert err.type == "error" and "the round allows 2" in err.header["reason"]
    for carried in (3, -1, True, "2"):  # steps carried in: a count of its steps (they set the round's length)
        err = peers[1].ask(peers[1].delta_parts(layout, 1, 0, np.zeros(layout.numel, np.float32), steps=2,
                                                carried_steps=carried), bulk=True, want="error")
        assert err.type == "error" and "steps carried in" in err.header["reason"], carried
    honest = {0: 0.1, 1: 0.12}
    for i, v in honest.items():
        assert peers[i].ask(peers[i].delta_parts(layout, 1, 0, np.full(layout.numel, v, np.float32),
                                                 tokens=100, loss_tokens=100, steps=2), bulk=True, want="ack")
    hostile = peers[2].delta_parts(layout, 1, 0, np.full(layout.numel, 50.0, np.float32), tokens=100, loss_tokens=100,
                                   steps=2)
    assert peers[2].ask(hostile, bulk=True, want="ack")
    assert wait_until(lambda: syncer.version == 1)
    merge = next(e for e in tape_with(tmp_path / "syncer", "merge") if e["event"] == "merge")
    factor = merge["clip"]["2"]
    assert merge["robust"] == "norm-clip" and factor == pytest.approx(4 * 0.12 / 50.0, rel=1e-3)
    expected = (0.1 + 0.12 + 50.0 * factor) / 3  # outer lr 1, no momentum: the global moves by the clipped mean
    np.testing.assert_allclose(syncer.global_, expected, rtol=1e-5)
    assert float(np.abs(syncer.global_).max()) < 1.0  # unclipped, the hostile delta alone would move it by 16.7


def test_floods_of_connections_and_oversized_frames_leave_the_syncer_serving(start_syncer, tmp_path):
    syncer, port, key = secure(start_syncer, islands=2, quorum=2, outer_steps=4, inner_steps=2, max_connections=12)
    threads, results = honest_fleet(port, key, step_delay=0.05)
    assert wait_until(lambda: syncer.version >= 0, 15)
    ctx = zmq.Context.instance()
    big = ctx.socket(zmq.DEALER)  # a frame far above what the run's layout can need: the connection is cut
    big.setsockopt(zmq.LINGER, 0)
    big.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # (sent before the flood takes the connection slots)
    big.curve_serverkey, big.curve_publickey, big.curve_secretkey = key.syncer_public, key.public, key.secret
    big.connect(f"tcp://127.0.0.1:{port}")
    big.send_multipart([encode("ping", {"island": 9, "session": "s", "version": 0, "pushed": None})[0],
                        os.urandom(8 << 20)])
    flood = []
    for i in range(40):  # authenticated connections beyond --max-connections, and strangers
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if i % 2:
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = key.syncer_public, key.public, key.secret
        s.connect(f"tcp://127.0.0.1:{port}")
        send_if_connected(s, [b"x"])  # (a refused connection leaves a DEALER nowhere to queue: a send would block)
        flood.append(s)
    time.sleep(1.0)
    for s in flood:
        s.close()
    join_all(threads, results)
    big.close()
    tape = read_tape(tmp_path / "syncer")
    assert sum(e["event"] == "merge" for e in tape) == 4
    assert any(e["event"] == "auth_refused" and "too many connections" in e["reason"] for e in tape)
    assert not any(e.get("island") == 9 for e in tape)  # the oversized message never reached the core


class KeylessFlood:
    """A stranger without a key holding plain TCP connections to the syncer from several source addresses (loopback
    is 127.0.0.0/8): `per_address` from each, each reopened when the syncer cuts it or before the handshake timeout,
    so it never lets go of its share."""

    def __init__(self, port: int, addresses: list[str], per_address: int, reopen_after_s: float):
        self.port, self.reopen_after_s = port, reopen_after_s
        self.slots = [(a, None, 0.0) for a in addresses for _ in range(per_address)]
        self.cut = 0  # connections the syncer closed under the stranger
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, address: str) -> socket.socket:
        s = socket.socket()
        s.bind((address, 0))
        s.connect(("127.0.0.1", self.port))
        s.setblocking(False)
        return s

    def _alive(self, s: socket.socket) -> bool:
        try:
            return s.recv(4096) != b""  # (the syncer's greeting is read and dropped; b"": closed by the syncer)
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            for i, (address, s, opened) in enumerate(self.slots):
                alive = s is not None and self._alive(s)
                if s is not None and not alive:
                    self.cut += 1
                if alive and now - opened < self.reopen_after_s:
                    continue
                if s is not None:
                    s.close()
                try:
                    self.slots[i] = (address, self._open(address), now)
                except OSError:
                    self.slots[i] = (address, None, now)
            self.stop.wait(FLOOD_SWEEP_S)
        for _, s, _ in self.slots:
            if s is not None:
                s.close()

    def __enter__(self) -> "KeylessFlood":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


FLOOD_SWEEP_S = 0.2  # how often the stranger reopens what the syncer cut
FLOOD_REOPEN_S = 3.0  # ... and reopens every connection, well before the syncer's handshake timeout
ROUNDS = 40  # long enough (about 0.25 s each) for the joiner to get in while the flood is on


def within_caps(gate: gating.Gatekeeper) -> bool:
    waiting = list(dict(gate.pending).values())  # (a copy: the syncer's thread changes it meanwhile)
    per_address = Counter(w.address for w in waiting)
    return len(waiting) <= gating.PENDING_TOTAL and max(per_address.values(), default=0) <= gating.PENDING_PER_ADDRESS


def test_a_keyless_connection_flood_locks_no_island_out(start_syncer, tmp_path, monkeypatch):
    # caps small enough that the stranger's few dozen sockets overflow both, per source address and in total
    monkeypatch.setattr(gating, "PENDING_PER_ADDRESS", 4)
    monkeypatch.setattr(gating, "PENDING_TOTAL", 12)
    max_connections = 6  # two islands' four connections fit; the stranger alone holds five times as many
    syncer, port, key = secure(start_syncer, islands=1, quorum=1, outer_steps=ROUNDS, inner_steps=2,
                               max_connections=max_connections)
    results = {}
    first = island_thread(QuadraticIsland(1.0, 100), port, 0, results, join_key=key, step_delay=0.1)
    assert wait_until(lambda: syncer.version >= 1, 15)
    addresses = [f"127.0.0.{i}" for i in range(2, 6)]
    with KeylessFlood(port, addresses, per_address=8, reopen_after_s=FLOOD_REOPEN_S) as flood:
        time.sleep(1.0)  # the stranger holds its sockets: without a fix, every one counts toward the cap
        for fd in list(syncer.gate.handshaked):  # the island in the run loses its connections and reconnects
            gating.cut(fd)
        during = syncer.version
        joiner = island_thread(QuadraticIsland(-1.0, 150), port, 1, results, join_key=key, step_delay=0.1)
        assert wait_until(lambda: any(e["event"] == "join" and e["island"] == 1
                                      for e in read_tape(tmp_path / "syncer")) or 1 in results, 20)
        assert not isinstance(results.get(1), Exception), results[1]  # (not refused for good as a wrong key)
        with pytest.raises(YetoError, match="refused this island's key.*--join-key"):  # a wrong key: still final
            run_island(QuadraticIsland(0.0, 1), f"127.0.0.1:{port}", 5, log_fn=lambda s: None,
                       join_key=stranger_key(key), timeouts=FAST)
        assert wait_until(lambda: syncer.version >= during + 3, 10), (during, syncer.version, results)  # it goes on
        assert 0 not in results  # (the island that reconnected was not told its key is wrong)
        assert flood.cut > 0  # the stranger's oldest sockets were dropped ...
        assert wait_until(lambda: within_caps(syncer.gate), 5)  # ... so that what waits for a handshake stays
        # within both caps (once the syncer's thread has cut what it just accepted: sampled until it has)
    join_all([first, joiner], results)
    tape = read_tape(tmp_path / "syncer")
    assert not any(e["event"] == "auth_refused" and "too many connections" in e["reason"] for e in tape)
    assert sum(e["event"] == "merge" for e in tape) == ROUNDS


def test_the_gatekeeper_cuts_the_oldest_sockets_waiting_for_a_handshake_per_address_and_in_total(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setattr(gating, "PENDING_PER_ADDRESS", 3)
    monkeypatch.setattr(gating, "PENDING_TOTAL", 5)
    ctx = zmq.Context()
    ring = Keyring.ensure(tmp_path / "run")
    router = ctx.socket(zmq.ROUTER)
    gating.curve_server(router, ring)
    gate = gating.Gatekeeper(ctx, ring, max_connections=2)
    gate.watch(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def accepted() -> int:  # sockets the gatekeeper has seen accepted: waiting still, or cut for a cap
        return len(gate.pending) + sum("pending handshakes" in r.reason for r in gate.refusals)

    def connect(address: str) -> socket.socket:  # one plain TCP socket, seen by the gatekeeper before the next
        s = socket.create_connection(("127.0.0.1", port), source_address=(address, 0))
        seen = accepted()  # (not any change: a cut socket's late handshake failure is a refusal of its own)
        assert wait_until(lambda: gate.handle(time.monotonic()) or accepted() == seen + 1, 5)
        return s

    def cut_off(s: socket.socket) -> bool:
        s.settimeout(0.5)
        try:
            while s.recv(4096):  # (the syncer's greeting)
                pass
            return True
        except TimeoutError:
            return False
        except OSError:
            return True

    try:
        elsewhere = [connect("127.0.0.3") for _ in range(2)]
        flood = [connect("127.0.0.2") for _ in range(5)]
        assert [cut_off(s) for s in flood] == [True, True, False, False, False]  # its own oldest, 3 left
        late = connect("127.0.0.4")  # 6 waiting in all: the oldest of all goes
        assert [cut_off(s) for s in elsewhere + [late]] == [True, False, False]
        assert len(gate.pending) == gating.PENDING_TOTAL and not gate.handshaked
        assert [r.address for r in gate.drain()[0] if "pending handshakes" in r.reason] == ["127.0.0.2"] * 2 + [
            "127.0.0.3"]
        for s in elsewhere + flood + [late]:
            s.close()
    finally:
        gate.close()
        router.close(linger=0)
        ctx.term()


def test_a_full_syncer_has_key_holders_retry_and_still_refuses_a_wrong_key_for_good(start_syncer, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setattr(gating, "HANDSHAKE_IVL_MS", 2000)  # a busy refusal shows at the syncer's handshake timeout ...
    monkeypatch.setattr(client, "BUSY_AFTER_S", 1.0)  # ... shortened here, and the island's reading of it with it
    syncer, port, key = secure(start_syncer, islands=1, quorum=1, outer_steps=2, inner_steps=1, max_connections=2)
    occupant = RawIsland(port, 9, key=key)  # a key holder's two connections fill --max-connections
    assert wait_until(lambda: len(syncer.gate.handshaked) == 2, 5)
    with pytest.raises(YetoError, match="refused this island's key.*--join-key"):  # the key is judged first
        run_island(QuadraticIsland(0.0, 1), f"127.0.0.1:{port}", 5, log_fn=lambda s: None,
                   join_key=stranger_key(key), timeouts=FAST)
    results, logs = {}, []

    def island():
        try:
            results[0] = run_island(QuadraticIsland(1.0, 100), f"127.0.0.1:{port}", 0, log_fn=logs.append,
                                    timeouts=FAST, join_key=key)
        except Exception as e:  # surfaced by the test
            results[0] = e

    t = threading.Thread(target=island, daemon=True)
    t.start()
    assert wait_until(lambda: any("retrying" in line for line in logs), 10), logs
    time.sleep(2 * gating.HANDSHAKE_IVL_MS / 1000)  # refused again and again meanwhile: never for good
    assert 0 not in results and syncer.core.run is None, results
    occupant.close()  # room again: the island that waited gets in on its own
    join_all([t], results)
    tape = read_tape(tmp_path / "syncer")
    assert any(e["event"] == "auth_refused" and "too many connections" in e["reason"] for e in tape)
    assert sum(e["event"] == "merge" for e in tape) == 2


# ZMTP 3.0 greeting (RFC 23): signature, version 3.0, mechanism "CURVE" padded to 20 bytes, as-server 0, filler
ZMTP_CURVE_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" + bytes(31)
FRAME_TYPES = ["hello", "init", "delta", "ping", "sync", "leave", "welcome", "broadcast", "nonsense"]
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)


@st.composite
def fuzz_message(draw, templates):
    """A random message: raw bytes, or a real message with fields deleted, retyped or set to random values."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.lists(st.binary(max_size=256), min_size=1, max_size=4))
    parts = list(draw(st.sampled_from(templates)))
    import json

    head = json.loads(parts[0])
    for _ in range(draw(st.integers(1, 4))):
        keys = sorted(head)
        k = draw(st.sampled_from(keys + ["type", "v", "island", "extra"]))
        choice = draw(st.integers(0, 3))
        if choice == 0:
            head.pop(k, None)
        elif choice == 1:
            head[k] = draw(json_values)
        elif choice == 2:
            head["type"] = draw(st.sampled_from(FRAME_TYPES))
        else:
            head[k] = draw(st.integers(-3, 3))
    frames = parts[1:]
    if frames and draw(st.booleans()):
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] = draw(st.binary(max_size=len(frames[i]) + 8))
    try:
        encoded = json.dumps(head).encode()
    except (TypeError, ValueError):
        encoded = b"{"
    return [encoded, *frames]


def test_fuzzed_frames_authenticated_or_not_never_stop_honest_rounds(start_syncer, tmp_path):
    syncer, port, key = secure(start_syncer, islands=2, quorum=2, outer_steps=6, inner_steps=2,
                               straggler_timeout=2.0, sync_bits=32)
    fuzzed = threading.Event()  # (the run must not finish, and its syncer exit, while the fuzz goes on)
    threads, results = honest_fleet(port, key, step_delay=0.1, hold=fuzzed)
    assert wait_until(lambda: syncer.version >= 0, 15)
    fuzzer = RawIsland(port, 5, key=key, identity="fuzzer-identity-0001")
    state = QuadraticIsland(0.0, 1).state
    hello, layout = fuzzer.hello_parts(state)
    templates = [hello, fuzzer.delta_parts(layout, 1, 0, np.ones(layout.numel, np.float32)),
                 encode("ping", fuzzer.header(version=0, pushed=None)), encode("sync", fuzzer.header(version=0,
                                                                                                      pushed=None)),
                 encode("leave", fuzzer.header(reason="x")), encode("init", fuzzer.header(fragments=[]))]
    sent = []

    @settings(max_examples=FUZZ_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(parts=fuzz_message(templates), authenticated=st.booleans(), bulk=st.booleans(), greeting=st.booleans())
    def send(parts, authenticated, bulk, greeting):
        if authenticated:  # inside an encrypted, authenticated session (a holder of the join key)
            try:
                (fuzzer.bulk if bulk else fuzzer.ctl).send_multipart(parts, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
        else:  # a stranger: raw bytes at the port, with or without a ZMTP 3 CURVE greeting in front
            with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
                raw.sendall((ZMTP_CURVE_GREETING if greeting else b"") + b"".join(parts)[:4096])
        sent.append(authenticated)

    send()
    fuzzed.set()
    join_all(threads, results, timeout=120)
    core = syncer.core
    assert core.state.finish_header["complete"] and not core.internal_errors  # (it lingers for the fuzzer)
    tape = read_tape(tmp_path / "syncer")
    assert sum(e["event"] == "merge" for e in tape) == 6
    assert not any(e["event"] == "internal_error" or e.get("code") == "internal" for e in tape)
    assert any(e["event"] == "reject" and e["code"] == "malformed" for e in tape)  # the fuzz reached the core
    print(f"fuzz: {len(sent)} cases ({sum(sent)} authenticated) against a live syncer; every honest round merged")
    assert len(sent) == FUZZ_CASES
