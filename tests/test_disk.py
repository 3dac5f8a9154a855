"""The syncer's disk failing under it: handled by what was being written, not by the exception's type.

Faults are injected into the real `DiskStore` of an in-process syncer (the exceptions a full disk raises: OSError
ENOSPC from files, SafetensorError from safetensors), with real island code on loopback; the signal convention is
checked on a real syncer process.
"""

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from safetensors import SafetensorError

from tests.conftest import REPO
from tests.peers import HeldIsland, QuadraticIsland, RawIsland, island_thread, tape_with, wait_until
from yeto.launch.local import free_port
from yeto.sync.shell.server import DISK_FAILED_EXIT
from yeto.sync.shell.store import DiskStore
from yeto.sync.shell.tape import read_tape

ENOSPC = OSError(errno.ENOSPC, "No space left on device")
SYNCER_START_S = 60  # a syncer process started under load may take this long to import and bind


def fleet(port, n=2, logs=None):
    results = {}
    threads = [island_thread(QuadraticIsland(1.0 - 2 * i, 100), port, i, results,
                             log_fn=(lambda s, i=i: logs.setdefault(i, []).append(s)) if logs is not None else
                             (lambda s: None)) for i in range(n)]
    return threads, results


def test_a_failed_adapter_write_is_recorded_and_survived(start_syncer, tmp_path, monkeypatch):
    def full(self, ck):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(DiskStore, "write_adapter", full)
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=2, inner_steps=2, sync_bits=32)
    threads, results = fleet(port)
    for t in threads:
        t.join(60)
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results
    assert wait_until(lambda: syncer.finished) and syncer.exit_code == 0 and syncer.disk_failure is None
    failed = [e for e in read_tape(tmp_path / "syncer") if e["event"] == "adapter_write_failed"]
    assert len(failed) == 3 and "SafetensorError" in failed[0]["reason"]  # versions 0, 1, 2: each survived


def test_a_failed_checkpoint_stops_the_syncer_cleanly_and_the_run_resumes(start_syncer, tmp_path, monkeypatch):
    """The first merge's checkpoint cannot be written: the syncer writes and acknowledges nothing more, tells every
    island to finish with the reason, names the path and its free space, exits DISK_FAILED_EXIT; restarted with
    space, it resumes from its last checkpoint and finishes the run."""
    save = DiskStore.save_checkpoint

    def full_after_founding(self, ck):
        if ck.version >= 1:
            raise ENOSPC
        save(self, ck)

    monkeypatch.setattr(DiskStore, "save_checkpoint", full_after_founding)
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=3, inner_steps=2, sync_bits=32,
                                island_timeout=2.0)
    logs = {}
    threads, results = fleet(port, logs=logs)
    for t in threads:
        t.join(60)
    assert wait_until(lambda: syncer.finished, 20)
    assert syncer.exit_code == DISK_FAILED_EXIT
    assert "state.safetensors" in syncer.disk_failure
    assert "free on its disk" in syncer.disk_failure and "restart with the same --out" in syncer.disk_failure
    for lid, r in results.items():  # each was told to finish, with the reason, holding the last durable version
        assert isinstance(r, dict) and not r["complete"] and r["version"] == 0, results
        assert any("could not write its state" in line for line in logs[lid]), logs[lid][-5:]
    tape = read_tape(tmp_path / "syncer")
    assert not [e for e in tape if e["event"] == "checkpoint" and e["version"] >= 1]

    monkeypatch.setattr(DiskStore, "save_checkpoint", save)  # space freed: the same --out resumes
    again, port = start_syncer(islands=2, quorum=2, outer_steps=3, inner_steps=2, sync_bits=32)
    # the merge whose checkpoint failed is rolled back, and redone at once from the two saved deltas
    resume = tape_with(tmp_path / "syncer", "resume")
    resume = next(e for e in resume if e["event"] == "resume")
    assert (resume["version"], resume["rolled_back"], resume["restored"]) == (0, [1], [0, 1])
    threads, results = fleet(port)
    for t in threads:
        t.join(60)
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results
    assert wait_until(lambda: again.finished) and again.exit_code == 0 and again.version == 3


def test_a_failed_tape_write_stops_the_syncer_too(start_syncer, tmp_path, monkeypatch):
    append = DiskStore.append

    def full_on_merge(self, event, fields):
        if event == "merge":
            raise ENOSPC
        append(self, event, fields)

    monkeypatch.setattr(DiskStore, "append", full_on_merge)
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=3, inner_steps=2, sync_bits=32,
                                island_timeout=2.0)
    threads, _ = fleet(port)
    for t in threads:
        t.join(60)
    assert wait_until(lambda: syncer.finished, 20) and syncer.exit_code == DISK_FAILED_EXIT
    assert "tape.jsonl" in syncer.disk_failure


@pytest.mark.parametrize("when", ["running", "final linger"])
def test_sigterm_exits_143_whenever_it_comes(tmp_path, when):
    """128 + the signal, during the run and after its finish while the syncer still serves a silent island."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "yeto", "syncer", "--host", "127.0.0.1", "--port", str(port),
                             "--insecure", "--out", str(tmp_path / "s"), "--islands", "1", "--outer-steps", "1",
                             "--inner-steps", "1", "--sync-bits", "32", "--island-timeout", "30"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        island = RawIsland(port, 0)
        layout = island.found(QuadraticIsland(0.0, 1).state, timeout=SYNCER_START_S)
        if when == "final linger":  # one merge finishes the run; the island never says goodbye
            import numpy as np

            island.ask(island.delta_parts(layout, 1, 0, np.full(layout.numel, 0.01, np.float32)), bulk=True,
                        want="ack")
            tape_with(tmp_path / "s", "finish", 10.0)
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
        island.close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_full_tmpfs_stops_the_run_and_freeing_space_resumes_it(start_syncer, tmp_path):
    """The real thing where mounting is permitted (root): a small tmpfs filled to the last byte mid-run."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        out = mnt / "syncer"
        syncer, port = start_syncer(islands=1, quorum=1, outer_steps=6, inner_steps=1, sync_bits=32, out=out)
        results = {}
        filled = threading.Event()
        t = island_thread(HeldIsland(1.0, 10, lr=0.1, steps_before=2, hold=filled), port, 0, results)
        assert wait_until(lambda: syncer.version >= 2 or syncer.finished)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 512):
                pass
        except OSError:  # (ENOSPC: full)
            pass
        finally:
            os.close(fd)
            filled.set()
        assert wait_until(lambda: syncer.finished, 30)
        t.join(40)
        assert syncer.exit_code == DISK_FAILED_EXIT and str(out) in syncer.disk_failure, syncer.disk_failure
        (mnt / "filler").unlink()
        again, _ = start_syncer(islands=1, quorum=1, outer_steps=6, inner_steps=1, sync_bits=32, out=out,
                                port=port, island_timeout=2.0)
        results = {}
        t = island_thread(QuadraticIsland(1.0, 10, lr=0.1), port, 0, results)
        assert wait_until(lambda: again.finished, 60)
        t.join(40)
        assert again.version == 6 and again.exit_code == 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
