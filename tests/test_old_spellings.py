"""What was written or typed before "learner" became "island" still works: a tape, a run's keys, the flags (their
old spellings are hidden from --help; tests/test_cli_errors.py checks `yeto train`'s)."""

import subprocess
from pathlib import Path

from tests.test_cli_errors import YETO
from yeto import OLD_WORD
from yeto.sync.shell.keys import ISLAND_KEYS, OLD_WORD_KEYS, Keyring, read_join_key
from yeto.sync.shell.tape import read_tape

OLD_TAPE = Path(__file__).parent / "data" / "watch-run" / "syncer"  # written before the rename: it says the old word


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_a_tape_written_before_the_rename_reads_in_todays_words():
    assert OLD_WORD in (OLD_TAPE / "tape.jsonl").read_text()
    events = read_tape(OLD_TAPE)
    assert not [k for k in _keys(events) if OLD_WORD in str(k)]
    assert {e["island"] for e in events if e["event"] == "join"} == {0, 1}


def test_a_run_keyed_before_the_rename_still_admits_its_islands(tmp_path):
    ring = Keyring.ensure(tmp_path)
    key = ring.add_island(3)
    public = read_join_key(key).public
    old_dir = ring.keys_dir / OLD_WORD_KEYS
    (ring.keys_dir / ISLAND_KEYS).rename(old_dir)  # the folder and the key's line as an older yeto wrote them
    old_key = old_dir / key.name
    old_key.write_text(old_key.read_text().replace("island = 3", f"{OLD_WORD} = 3"))

    again = Keyring.ensure(tmp_path)
    assert again.islands == {public: 3}
    assert (again.keys_dir / ISLAND_KEYS / key.name).is_file() and not old_dir.exists()


def test_the_syncers_old_flag_spellings_feed_its_new_flags(tmp_path):
    """--learners and --max-learners reach the check that names their new spellings; both spellings is an error."""
    old = subprocess.run(YETO + ["syncer", "--learners", "3", "--max-learners", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert old.returncode == 2 and "--max-islands (2) must be at least --islands (3)" in old.stderr, old.stderr
    both = subprocess.run(YETO + ["syncer", "--islands", "3", "--learners", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--learners is the old spelling of --islands" in both.stderr, both.stderr
