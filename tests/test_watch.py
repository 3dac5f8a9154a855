"""`yeto dashboard`'s data: the snapshot folded from a finished run's files (tests/data/watch-run, the demo's tape and
island metrics), the alerts from tables of tapes, and the shell's file follower. The page in a browser:
tests/test_dashboard_browser.py."""

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from yeto.sync.shell.tape import read_tape
from yeto.watch.alerts import CRASH_SESSIONS, LATE_ROUNDS, alerts
from yeto.watch.dashboard import JsonlFollower, LocalRun, open_run
from yeto.watch.snapshot import IslandFiles, snapshot

RUN = REPO / "tests" / "data" / "watch-run"


def demo_snapshot(events=None, now=None):
    source = LocalRun(RUN)
    got, islands, info = source.read()
    events = got if events is None else events
    return snapshot(events, islands, now if now is not None else events[-1]["time"] + 5, info), events


def test_the_snapshot_of_a_finished_run_says_what_its_tape_and_islands_say():
    snap, events = demo_snapshot()
    run = snap["run"]
    assert (run["version"], run["outer_steps"], run["rounds_merged"], run["finished"]) == (5, 5, 5,
                                                                                          "outer steps done")
    assert [r["island"] for r in snap["fleet"]] == [0, 1]
    deltas = [e for e in events if e["event"] == "delta"]
    for row in snap["fleet"]:
        mine = [d for d in deltas if d["island"] == row["island"]]
        assert (row["backend"], row["device"], row["state"], row["version"], row["merges"]) == (
            "torch", "cpu", "done", 5, 5)  # left at the end of a finished run
        assert row["last_delta_round"] == 5 and row["lag"] == 0
        assert row["tokens_per_s"] == round(mine[-1]["tokens"] / mine[-1]["compute_s"], 1)
        assert 0.9 < row["utilization"] <= 1.0  # the demo's islands computed ~98% of their wall time
    merges = [e for e in events if e["event"] == "merge"]
    assert snap["curves"]["rounds"] == [1, 2, 3, 4, 5]
    for (rnd, merged), m in zip(snap["curves"]["merged"], merges):
        losses = {d["island"]: d["loss"] for d in deltas if d["round"] == rnd}
        assert merged == pytest.approx(sum(w * losses[r] for r, w in zip(m["responders"], m["weights"])))
    assert snap["curves"]["islands"]["1"][0] == [1, next(d["loss"] for d in deltas if d["island"] == 1)]
    assert snap["curves"]["eval"]["0"] == [[0.0, pytest.approx(2.7646641)], [5.0, pytest.approx(0.5016891)]]
    assert snap["bytes"] == [[m["round"], sum(d["bytes"] for d in deltas if d["round"] == m["round"])]
                             for m in merges]
    assert len(snap["timeline"]) == 10
    for t in snap["timeline"]:
        d = next(d for d in deltas if (d["round"], d["island"]) == (t["round"], t["island"]))
        assert t["inner_steps"] == d["compute_s"]
        assert all(t[k] >= 0 for k in ("push", "waiting", "merge", "broadcast"))
    # each round's last delta in waits for nobody
    assert {t["round"] for t in snap["timeline"] if t["waiting"] == 0} == {1, 2, 3, 4, 5}


def task_eval(step, version, accuracy, low, high, n=200):
    """An island's metrics line for one task evaluation (--eval-task), as the island writes it."""
    return {"time": 0.0, "event": "task_eval", "step": step, "round": None if version is None else version + 1,
            "version": version, "task": "gcd", "accuracy": accuracy, "low": low, "high": high, "n": n, "seconds": 2.0}


def test_task_accuracy_per_island_is_drawn_at_the_version_it_scored_with_its_interval():
    source = LocalRun(RUN)
    events, islands, info = source.read()
    assert snapshot(events, islands, events[-1]["time"], info)["curves"]["task"] == {}  # no task: no chart
    islands[0].metrics += [task_eval(0, 0, 0.05, 0.03, 0.09), task_eval(16, 2, 0.4, 0.33, 0.47),
                           task_eval(40, None, 0.6, 0.53, 0.66)]  # at the end: its own adapter, no global
    islands[1].metrics += [task_eval(16, 2, 0.35, 0.29, 0.42), {"event": "task_eval", "step": 20, "accuracy": None}]
    task = snapshot(events, islands, events[-1]["time"], info)["curves"]["task"]
    assert [(p["x"], p["accuracy"], p["low"], p["high"]) for p in task["0"]] == [
        (0, 0.05, 0.03, 0.09), (2, 0.4, 0.33, 0.47), (40 / 8, 0.6, 0.53, 0.66)]  # the demo: 8 inner steps a round
    assert task["1"] == [{"x": 2, "accuracy": 0.35, "low": 0.29, "high": 0.42, "n": 200, "task": "gcd", "round": 3,
                          "version": 2, "step": 16}]
    alone = {0: IslandFiles(0, metrics=[{"event": "step", "step": 5, "loss": 1.0}, task_eval(5, None, 0.5, 0.4, 0.6)])}
    standalone = snapshot([], alone, 10.0, {"standalone": True})
    assert [(p["x"], p["accuracy"]) for p in standalone["curves"]["task"]["0"]] == [(5, 0.5)]  # at its step


def test_the_snapshot_shows_nothing_secret():
    snap, events = demo_snapshot()
    text = json.dumps(snap)
    for e in events:
        if e.get("session"):
            assert e["session"] not in text
    assert "join.key" not in text and "config" not in json.dumps(snap["run"])


def test_an_island_missing_from_an_open_round_turns_late_then_rounds_show_open():
    _, events = demo_snapshot()
    opened = next(i for i, e in enumerate(events) if e["event"] == "round_open" and e["round"] == 3)
    first_delta = next(i for i, e in enumerate(events) if i > opened and e["event"] == "delta")
    cut = events[:first_delta + 1]
    sent = cut[-1]["island"]
    soon, _ = demo_snapshot(cut, now=events[opened]["time"] + 1)
    later, _ = demo_snapshot(cut, now=events[opened]["time"] + 500)
    assert soon["run"]["open_round"] == 3 and soon["run"]["finished"] is None
    assert {r["island"]: r["state"] for r in soon["fleet"]} == {0: "alive", 1: "alive"}
    assert {r["island"]: r["state"] for r in later["fleet"]} == {sent: "alive", 1 - sent: "late"}


# alerts, from tables of tapes (each event list the smallest that raises or does not raise the alert)
def _round(rnd, responders, stragglers=(), losses=None, compute=None):
    """Round `rnd`, its 12.5 s back to back with the others'."""
    t = 13.0 * rnd
    losses = losses or {}
    compute = compute or {}
    evs = [{"event": "round_open", "round": rnd, "time": t, "members": [*responders, *stragglers]}]
    evs += [{"event": "delta", "round": rnd, "island": r, "time": t + compute.get(r, 10) + 1, "tokens": 100,
             "loss_tokens": 50, "bytes": 10, "loss": losses.get(r, 1.0), "lag": 0, "compute_s": compute.get(r, 10)}
            for r in responders]
    evs += [{"event": "merge", "round": rnd, "version": rnd, "time": t + 12, "responders": list(responders),
             "weights": [1 / len(responders)] * len(responders), "stragglers": list(stragglers)},
            {"event": "broadcast", "round": rnd, "version": rnd, "time": t + 12.5, "to": [*responders, *stragglers]}]
    return evs


def _joins(*islands, sessions=1, every=10.0):
    return [{"event": "join", "island": lid, "backend": "torch", "session": f"s{lid}-{k}", "time": k * every,
             "tier": "trusted" if lid == 0 else "bounded"} for lid in islands for k in range(sessions)]


def _tape(*parts):
    events = [e for p in parts for e in p]
    events.insert(0, {"event": "start", "time": 0.0, "config": {"outer_steps": 10, "inner_steps": 4}})
    for i, e in enumerate(events):
        e["seq"] = i
    return events


LATE = _tape(_joins(0, 1, 2), *[_round(r, [0, 1], [2]) for r in range(1, LATE_ROUNDS + 1)])
LATE_BUT_ONCE_IN = _tape(_joins(0, 1, 2), _round(1, [0, 1], [2]), _round(2, [0, 1, 2]),
                         *[_round(r, [0, 1], [2]) for r in range(3, LATE_ROUNDS + 2)])
SLOW = _tape(_joins(0, 1, 2), _round(1, [0, 1, 2], compute={2: 40}),
             *[_round(r, [0, 1], [2]) for r in range(2, LATE_ROUNDS + 2)])
CRASHING = _tape(_joins(0), _joins(1, sessions=CRASH_SESSIONS, every=30.0),
                 [{"event": "leave", "island": 1, "reason": "connection lost", "time": 80.0}])
RESTARTED_TWICE = _tape(_joins(0), _joins(1, sessions=CRASH_SESSIONS - 1, every=30.0))
RISING = _tape(_joins(0, 1), *[_round(r, [0, 1], losses={0: 1.0, 1: y})
                               for r, y in enumerate([1.0, 1.2, 1.4], start=1)])
RISING_ONCE = _tape(_joins(0, 1), *[_round(r, [0, 1], losses={0: 1.0, 1: y})
                                    for r, y in enumerate([1.0, 0.8, 1.4], start=1)])
IDLE = _tape(_joins(0, 1), *[_round(r, [0, 1], compute={0: 2, 1: 2}) for r in range(1, 4)])


@pytest.mark.parametrize("events, want", [
    (LATE, [(2, "late", "no delta from it")]),
    (LATE_BUT_ONCE_IN, [(2, "low_utilization", "most of its idle time is")]),  # late twice only: idle, not late
    (SLOW, [(2, "late", "slow inner steps: 40.0s")]),
    (CRASHING, [(1, "crash_loop", "its last leave: connection lost")]),
    (RESTARTED_TWICE, []),
    (RISING, [(1, "loss_rising", "island 1's loss rose most")]),
    (RISING_ONCE, []),
    (IDLE, [(0, "low_utilization", "most of its idle time is"), (1, "low_utilization", "most of its idle time is")]),
], ids=["late", "late-but-once-in", "late-slow", "crash-loop", "two-restarts", "loss-rising", "rising-once", "idle"])
def test_alerts_name_the_island_and_the_cause(events, want):
    snap = snapshot(events, {}, now=events[-1]["time"] + 1)
    assert {r["island"]: r["tier"] for r in snap["fleet"]} == {  # (each row says whose claims the syncer believes)
        lid: "trusted" if lid == 0 else "bounded" for lid in {e["island"] for e in events if e["event"] == "join"}}
    got = alerts(snap, events)
    assert [(a["island"], a["kind"]) for a in got] == [(lid, kind) for lid, kind, _ in want]
    for a, (_, _, cause) in zip(got, want):
        assert cause in a["cause"], a


def test_the_follower_takes_complete_lines_only(tmp_path):
    path = tmp_path / "tape.jsonl"
    follow = JsonlFollower(path)
    assert not follow.read()
    path.write_text('{"seq": 0}\n{"seq": 1')
    assert follow.read() and follow.records == [{"seq": 0}]
    with open(path, "a") as f:
        f.write('}\n')
    assert follow.read() and follow.records == [{"seq": 0}, {"seq": 1}]
    assert not follow.read()


def test_the_live_snapshot_follows_a_growing_tape(tmp_path):
    events = read_tape(RUN / "syncer")
    (tmp_path / "syncer").mkdir()
    tape = tmp_path / "syncer" / "tape.jsonl"
    tape.write_text("".join(json.dumps(e) + "\n" for e in events[:20]))
    source = open_run(str(tmp_path))
    first, _, _ = source.read()
    n = len(first)
    with open(tape, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events[20:]))
    assert (n, len(source.read()[0])) == (20, len(events))


def test_the_live_page_needs_its_token_and_a_loopback_host():
    """A run's internals are its operator's: the URL `yeto dashboard` prints carries a token (the first page load
    turns it into a cookie for the page's own requests); without it, or under another Host (a DNS-rebinding page in
    the operator's browser), the page and the snapshot are refused."""
    import threading
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from yeto.watch.dashboard import serve

    printed: list[str] = []
    threading.Thread(target=serve, args=(open_run(str(RUN)),), kwargs={"ready": printed.append}, daemon=True).start()
    deadline = time.time() + 30
    while not printed and time.time() < deadline:
        time.sleep(0.05)
    url = printed[0]
    base = f"{urlsplit(url).scheme}://{urlsplit(url).netloc}"

    def get(path, headers=None):
        try:
            with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers or {}), timeout=10) as r:
                return r.status, r.headers.get("Set-Cookie", ""), r.read()
        except urllib.error.HTTPError as e:
            return e.code, "", e.read()

    token = url.split("token=")[1]
    status, cookie, body = get(f"/?token={token}")
    assert status == 200 and b"<html" in body.lower() and "HttpOnly" in cookie
    status, _, body = get("/snapshot.json", {"Cookie": cookie.split(";")[0]})
    assert status == 200 and json.loads(body)["run"]["rounds_merged"] == 5
    assert get("/snapshot.json")[0] == 403 and get("/")[0] == 403  # no token, no cookie
    assert get("/snapshot.json?token=wrong")[0] == 403
    status, _, body = get(f"/snapshot.json?token={token}", {"Host": "evil.example"})
    assert status == 403 and b"answers only to" in body
    assert get(f"/snapshot.json?token={token}", {"Host": f"localhost:{urlsplit(url).port}"})[0] == 200


def test_a_bad_target_or_port_is_one_error_line(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        for args, says in [([str(tmp_path)], "holds no run"), (["no-such-run"], "neither a run directory nor"),
                           ([str(RUN), "--port", "70000"], "--port 70000 is not a port"),
                           ([str(RUN), "--port", str(taken.getsockname()[1])], "pick another --port")]:
            r = subprocess.run([sys.executable, "-m", "yeto", "dashboard", *args], cwd=REPO, capture_output=True,
                               text=True, timeout=60)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
    finally:
        taken.close()


def test_the_export_is_one_file_with_the_snapshot_and_plotly_inside(tmp_path):
    pytest.importorskip("plotly", reason="the watch extra (plotly) is not installed")
    out = tmp_path / "run.html"
    r = subprocess.run([sys.executable, "-m", "yeto", "dashboard", str(RUN), "--export", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert "src=\"http" not in html and "<link" not in html and "/snapshot.json\"" in html  # poll() is unused
    assert "render({" in html and '"rounds_merged":5' in html and "Plotly" in html


def test_a_cloud_run_is_read_as_yeto_status_reads_it_with_its_cost(monkeypatch):
    """The head's tape (over ssh in a real run) and SkyPilot's cost report stand in by fakes: no cloud here."""
    import yeto.launch.cloud
    import yeto.launch.manage
    from yeto.launch.registry import RunRecord
    from yeto.watch.dashboard import CloudRun, Dashboard

    events = read_tape(RUN / "syncer")
    copies = []
    monkeypatch.setattr(yeto.launch.manage, "_head_tape", lambda run: copies.append(run.name) or (events, ""))

    class FakeSky:
        def cost_report(self):
            return "request"

        def get(self, request):
            assert request == "request"
            return [{"name": "pirate-head", "launched_at": 1000.0, "total_cost": 1.5},
                    {"name": "pirate-l0", "launched_at": 1000.0, "total_cost": 0.5},
                    {"name": "someone-else", "launched_at": 1000.0, "total_cost": 99.0},
                    {"name": "pirate-l0", "launched_at": 10.0, "total_cost": 7.0}]  # an older run's cluster

    monkeypatch.setattr(yeto.launch.cloud, "SkyPilotClient", lambda: type("C", (), {"sky": FakeSky()})())
    record = RunRecord("pirate", "cloud", "/nowhere", created=1000.0, head_cluster="pirate-head",
                       island_clusters={"0": "pirate-l0"})
    clock = lambda: 1000.0 + 2 * 3600  # noqa: E731
    board = Dashboard(CloudRun(record, clock), clock)
    snap = board.snapshot()
    assert (snap["run"]["kind"], snap["run"]["cost"], snap["run"]["cost_per_hour"]) == ("cloud", 2.0, 1.0)
    assert [r["island"] for r in snap["fleet"]] == [0, 1] and snap["run"]["rounds_merged"] == 5
    board.snapshot()
    assert copies == ["pirate"]  # the head's tape is copied at most every CLOUD_POLL_S, not on every poll


def test_the_snapshot_is_folded_again_when_the_tape_grows_or_time_passes(tmp_path):
    from yeto.watch.dashboard import REFOLD_S, Dashboard

    events = read_tape(RUN / "syncer")
    (tmp_path / "syncer").mkdir()
    tape = tmp_path / "syncer" / "tape.jsonl"
    tape.write_text("".join(json.dumps(e) + "\n" for e in events[:20]))
    now = [events[19]["time"]]
    board = Dashboard(open_run(str(tmp_path)), clock=lambda: now[0])
    first = board.snapshot()
    now[0] += 1
    again = board.snapshot()
    assert again is first and again["run"]["now"] == now[0]  # nothing grew: the same fold, its clock moved
    now[0] += REFOLD_S
    assert board.snapshot() is not first
    with open(tape, "a") as f:
        f.write(json.dumps(events[20]) + "\n")
    assert board.snapshot()["run"]["events"] == 21
