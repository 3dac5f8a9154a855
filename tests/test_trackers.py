"""--report-to: a real `yeto train` and a real `yeto launch` fleet report to each tracker, read back with the
tracker's own reader (TensorBoard's EventAccumulator, wandb's offline run file, mlflow's client, trackio's store);
a bad name is one line; a tracker that raises never stops the syncer."""

import json
import os
import subprocess
import sys
import pytest

from tests.conftest import DEMO_DATA, REPO

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", COLUMNS="200", WANDB_MODE="offline",
           WANDB_SILENT="true")
for key in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "TRACKIO_DIR"):  # nothing leaves this machine
    ENV.pop(key, None)
STEPS = 4


def train(model, out, report_to, *args, backend=("yeto", "train")):
    return subprocess.run([sys.executable, "-m", *backend, "--model", str(model), "--data", str(DEMO_DATA),
                           "--out", str(out), "--max-steps", str(STEPS), "--seq-len", "64", "--batch-size", "2",
                           "--lora-r", "4", "--threads", "1", "--eval-every", "0", "--no-progress",
                           "--report-to", report_to, *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def scalars(logdir):
    """Every scalar series of a TensorBoard directory, by tag: [(step, value)], through TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path):
    """The records of a wandb offline run file, read by wandb's own DataStore and parsed by its protobuf."""
    from wandb.proto.wandb_internal_pb2 import Record
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(path))
    while (data := store.scan_data()) is not None:
        rec = Record()
        rec.ParseFromString(data)
        yield rec


def assert_series(got, expected):
    """The same (step, value) points, values to float32 precision (TensorBoard keeps float32)."""
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-5)


def steps_logged(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == "step"]


def test_train_reports_to_tensorboard_wandb_mlflow_and_trackio(tiny_model, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the `track` extra is not installed")
    out = tmp_path / "solo"
    r = train(tiny_model("llama"), out, "tensorboard,wandb,mlflow,trackio")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "failed" not in r.stderr, r.stderr[-2000:]
    expected = [(s["step"], s["loss"]) for s in steps_logged(out)]
    assert len(expected) == STEPS

    tb = scalars(out / "tb" / "solo")
    assert_series(tb["train/loss"], expected)
    for tag in ("train/lr", "train/grad_norm", "train/tok_s", "train/loss_tokens", "eval/eval_loss"):
        assert tag in tb, sorted(tb)

    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    history, config = [], {}
    for rec in wandb_records(runs[0]):
        if rec.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif rec.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    losses = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert_series(losses, expected)
    assert config["config"]["lr"] == pytest.approx(2e-4)

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("solo").experiment_id])
    assert run.info.run_name == "solo" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert_series(sorted((m.step, m.value) for m in history), expected)
    assert run.data.params["config.seq_len"] == "64"

    from trackio import sqlite_storage

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", out / "trackio")  # (trackio reads TRACKIO_DIR at import)
    SQLiteStorage = sqlite_storage.SQLiteStorage
    logs = [x for x in SQLiteStorage.get_logs(project="solo", run="solo") if "train/loss" in x]
    assert_series([(x["step"], x["train/loss"]) for x in logs], expected)


def test_the_mlx_island_reports_to_tensorboard(tiny_model, tmp_path):
    pytest.importorskip("tensorboard", reason="the `track` extra is not installed")
    pytest.importorskip("mlx.core", reason="the mlx extra is not installed")
    out = tmp_path / "mlx"
    r = train(tiny_model("llama"), out, "tensorboard", backend=("yeto", "train", "--backend", "mlx"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    tb = scalars(out / "tb" / "mlx")
    assert_series(tb["train/loss"], [(s["step"], s["loss"]) for s in steps_logged(out)])
    assert len(tb["train/loss"]) == STEPS and len(tb["train/grad_norm"]) == STEPS


def test_a_fleet_reports_each_island_and_every_merge(tiny_model, tmp_path):
    """`yeto launch --report-to tensorboard`: each island logs per step and per round, the syncer per merge, each in
    its own directory under the run's."""
    pytest.importorskip("tensorboard", reason="the `track` extra is not installed")
    rounds, inner = 2, 3
    run = tmp_path / "fleet"
    r = subprocess.run([sys.executable, "-m", "yeto", "launch", "--gpu", "local:2", "--model", str(tiny_model("llama")),
                        "--data", str(DEMO_DATA), "--seq-len", "64", "--batch-size", "2", "--lora-r", "4",
                        "--out", str(run), "--outer-steps", str(rounds), "--inner-steps", str(inner),
                        "--report-to", "tensorboard"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    merges = scalars(run / "syncer" / "tb" / "fleet-syncer")
    assert [s for s, _ in merges["merge/update_norm"]] == list(range(1, rounds + 1))
    for tag in ("merge/merge_s", "merge/round_s", "merge/responders", "merge/weight/0", "merge/weight/1",
                "merge/lag/0", "merge/quorum_waits", "merge/rejoins"):
        assert len(merges[tag]) == rounds, tag
    assert all(v == 2 for _, v in merges["merge/responders"])
    from yeto.sync.shell.tape import read_tape

    tape = [e for e in read_tape(run / "syncer") if e["event"] == "merge"]
    assert [v for _, v in merges["merge/update_norm"]] == pytest.approx([e["update_norm"] for e in tape], rel=1e-5)
    for lid in (0, 1):
        island = scalars(run / f"island-{lid}" / "tb" / f"fleet-island-{lid}")
        assert len(island["train/loss"]) == rounds * inner
        for tag in ("round/delta_norm", "round/delta_bytes", "round/stall_s", "round/utilization", "round/lag"):
            assert len(island[tag]) == rounds, tag
        assert all(v > 0 for _, v in island["round/delta_norm"])


def test_an_unknown_tracker_is_one_line(tmp_path):
    for cmd in (["train", "--out", str(tmp_path / "t")], ["syncer", "--out", str(tmp_path / "s"), "--insecure",
                                                          "--host", "127.0.0.1"]):
        r = subprocess.run([sys.executable, "-m", "yeto", *cmd, "--report-to", "tensorboard,neptune"], cwd=REPO,
                           env=ENV, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "unknown tracker 'neptune'" in lines[0] and "mlflow" in lines[0], r.stderr


def test_a_missing_library_names_the_extra(monkeypatch):
    import importlib.util

    from yeto import YetoError
    from yeto.report.trackers import check_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(YetoError, match=r"wandb not installed; pip install 'yeto\[track\]'"):
        check_installed(["tensorboard", "wandb"])


class Raising:
    """A tracker whose library fails on every record (as a lost network or a full disk would)."""

    def __init__(self, out, name, group):
        self.calls = 0

    def log_config(self, config):
        pass

    def log(self, step, metrics):
        self.calls += 1
        raise ConnectionError("tracker server unreachable")

    def finish(self):
        raise ConnectionError("tracker server unreachable")


class Recording:
    """A tracker that keeps what it is given."""

    logged: list = []

    def __init__(self, out, name, group):
        pass

    def log_config(self, config):
        pass

    def log(self, step, metrics):
        Recording.logged.append((step, metrics))

    def finish(self):
        pass


def test_a_tracker_that_raises_does_not_stop_the_syncer(tmp_path, start_syncer):
    """A real syncer on loopback with a failing tracker beside a working one merges every round; the failure is one
    warning, and the working tracker still gets every merge."""
    from tests.peers import QuadraticIsland, island_thread
    from yeto.report.trackers import Trackers

    warnings = []
    Recording.logged = []
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=3, inner_steps=2, sync_bits=32)
    trackers = Trackers(["raising", "recording"], tmp_path, "t-syncer", "t", {"x": 1}, warnings.append,
                        adapters={"raising": Raising, "recording": Recording})
    syncer.report_to(trackers)
    results = {}
    threads = [island_thread(QuadraticIsland(t, 100), port, lid, results) for lid, t in ((0, 1.0), (1, -2.0))]
    for t in threads:
        t.join(30)
    assert all(isinstance(r, dict) and r["complete"] for r in results.values()), results
    assert syncer.version == 3
    trackers.finish()
    assert [s for s, _ in Recording.logged] == [1, 2, 3]
    assert all(m["merge/responders"] == 2 and m["merge/update_norm"] > 0 for _, m in Recording.logged)
    assert [w for w in warnings if "tracker raising failed" in w] == [
        "tracker raising failed (ConnectionError: tracker server unreachable); going on without it"], warnings


def test_launch_passes_report_to_and_a_cloud_task_gets_the_key_only_as_a_secret(tmp_path):
    """Every process gets --report-to and the run's name; WANDB_API_KEY from this machine's environment is a SkyPilot
    secret of each cloud task (the head's too: it relaunches islands), never in a task's YAML or the dry run."""
    import yaml

    pytest.importorskip("sky", reason="the launch extra is not installed")
    key = "wandb-secret-0123456789abcdef"
    env = dict(ENV, YETO_RUNS=str(tmp_path / "runs"), WANDB_API_KEY=key)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "yeto", "launch", "--gpu", "aws:1xA10G@us-west-2", "--model",
                        "smollm2-135m", "--data", str(DEMO_DATA), "--out", str(out), "--name", "tracked", "--dry-run",
                        "--report-to", "wandb"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert key not in r.stdout + r.stderr and key not in (out / "plan.json").read_text()
    body = r.stdout.split("# --- tasks (SkyPilot YAML) ---\n", 1)[1].split("# --- end of tasks ---", 1)[0]
    head, island = yaml.safe_load_all(body)
    assert "--report-to wandb --run-name tracked" in island["run"] and ",track]" in island["setup"]
    assert head["secrets"]["WANDB_API_KEY"] == island["secrets"]["WANDB_API_KEY"] == "<redacted>"

    from yeto.launch.plan import FleetPlan
    from yeto.launch.tasks import head_task, island_task, syncer_argv

    plan = FleetPlan.from_json((out / "plan.json").read_text())
    assert syncer_argv(plan, "0.0.0.0", 1, out, "python3")[-4:] == ["--report-to", "wandb", "--run-name", "tracked"]
    os.environ["WANDB_API_KEY"] = key
    try:
        tasks = [island_task(plan, 0, "203.0.113.7:29400", "join"), head_task(plan, out / "plan.json", "keys")]
    finally:
        del os.environ["WANDB_API_KEY"]
    for task in tasks:
        config = task.to_yaml_config()
        assert config["secrets"]["WANDB_API_KEY"] == key
        assert key not in json.dumps({k: v for k, v in config.items() if k != "secrets"})


def test_a_join_script_reports_and_installs_the_trackers():
    from yeto.launch.join import join_script
    from yeto.launch.plan import FleetPlan
    from yeto.launch.spec import parse_gpu

    plan = FleetPlan("wan", "/tmp/x", parse_gpu("aws:1xA10G"), external=1, report_to="tensorboard")
    text = join_script(plan, 1, "203.0.113.7:29400")
    assert 'EXTRAS="[mlx,track]"' in text and 'EXTRAS="[torch,track]"' in text
    assert "--report-to tensorboard --run-name wan" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    plain = join_script(FleetPlan("wan", "/tmp/x", parse_gpu("aws:1xA10G"), external=1), 1, "203.0.113.7:29400")
    assert 'EXTRAS="[torch]"' in plain and "--report-to" not in plain


def test_launch_refuses_an_unknown_tracker_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "yeto", "launch", "--out", str(tmp_path / "x"), "--dry-run",
                        "--report-to", "comet"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --report-to 'comet': unknown tracker 'comet'; use a comma-separated list of tensorboard, wandb, "
        "trackio, mlflow, or none"], r.stderr


def test_report_to_is_read_as_a_list_of_known_trackers():
    from yeto import YetoError
    from yeto.report.trackers import parse_report_to

    assert parse_report_to("none") == [] and parse_report_to("") == []
    assert parse_report_to(" TensorBoard, wandb,tensorboard ") == ["tensorboard", "wandb"]
    with pytest.raises(YetoError, match="none with other trackers"):
        parse_report_to("none,wandb")


def test_a_merge_record_counts_the_quorum_waits_and_rejoins_since_the_last_merge():
    """The syncer's record per merge, from tape events as the shell appends them (a clock in hand)."""
    from yeto.sync.shell.tracking import MergeTracking

    class Fanout:
        def __init__(self):
            self.logged, self.configs = [], []

        def log(self, step, metrics):
            self.logged.append((step, metrics))

        def log_config(self, config):
            self.configs.append(config)

    now = [100.0]
    fan = Fanout()
    tracking = MergeTracking(fan, clock=lambda: now[0])
    tracking.on_event("contract", {"island": 0, "lora_r": 4})
    tracking.on_event("round_open", {"round": 1, "version": 0})
    tracking.on_event("quorum_wait", {"round": 1})
    tracking.on_event("quorum_wait", {"round": 1})
    tracking.on_event("join", {"island": 1, "rejoin": True})
    tracking.on_event("join", {"island": 2, "rejoin": False})
    tracking.on_event("merge", {"round": 1, "version": 1, "responders": [0, 2], "weights": [0.25, 0.75],
                                "lags": [0, 1], "clip": {"2": 0.5}, "update_norm": 0.3, "stragglers": [1]})
    now[0] = 107.5
    tracking.merged(0.2)
    tracking.on_event("round_open", {"round": 2, "version": 1})
    tracking.on_event("merge", {"round": 2, "version": 2, "responders": [0], "weights": [1.0], "lags": [0],
                                "clip": {}, "update_norm": 0.1, "stragglers": []})
    tracking.merged(0.1)
    tracking.merged(0.1)  # a batch without a merge record: nothing
    assert fan.configs == [{"contract": {"island": 0, "lora_r": 4}}]
    (s1, m1), (s2, m2) = fan.logged
    assert (s1, s2) == (1, 2)
    assert m1 == {"merge/responders": 2.0, "merge/stragglers": 1.0, "merge/update_norm": 0.3, "merge/merge_s": 0.2,
                  "merge/round": 1.0, "merge/round_s": 7.5, "merge/quorum_waits": 2.0, "merge/rejoins": 1.0,
                  "merge/clip/2": 0.5, "merge/weight/0": 0.25, "merge/weight/2": 0.75, "merge/lag/0": 0.0,
                  "merge/lag/2": 1.0}
    assert m2["merge/quorum_waits"] == 0 and m2["merge/rejoins"] == 0 and m2["merge/round_s"] == 0.0


def test_an_islands_task_accuracy_reaches_the_trackers_under_task(tmp_path):
    """The `task_eval` event of metrics.jsonl (an island's accuracy on --eval-task) as task/accuracy and its interval,
    at the island's step; the task's name and a standalone run's null round and version are left out."""
    from yeto.island.metrics import MetricsLog

    class Fanout:
        def __init__(self):
            self.logged, self.finished = [], False

        def log(self, step, metrics):
            self.logged.append((step, metrics))

        def finish(self):
            self.finished = True

    fan = Fanout()
    log = MetricsLog(tmp_path / "metrics.jsonl", trackers=fan)
    log.write(event="task_eval", step=16, round=2, version=2, task="gcd", accuracy=0.25, low=0.2, high=0.31, n=200,
              seconds=3.5)
    log.write(event="task_eval", step=0, round=None, version=None, task="gcd", accuracy=0.0, low=0.0, high=0.02,
              n=200, seconds=3.0)
    log.close()
    assert fan.logged == [
        (16, {"task/round": 2.0, "task/version": 2.0, "task/accuracy": 0.25, "task/low": 0.2, "task/high": 0.31,
              "task/n": 200.0, "task/seconds": 3.5}),
        (0, {"task/accuracy": 0.0, "task/low": 0.0, "task/high": 0.02, "task/n": 200.0, "task/seconds": 3.0})]
    assert [json.loads(line)["event"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        "task_eval", "task_eval"]
