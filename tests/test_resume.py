"""A preempted island resumes: real island processes killed (SIGKILL) and restarted with the same command.

Standalone, the resumed run ends with the uninterrupted run's adapter bit for bit on CPU (the same batches, dropout
draws, AdamW moments and LR from the saved state) and logs the same steps and LRs. In a fleet, an island killed
mid-round rejoins with its optimizer state, and its step numbers and LR schedule go on from where it was (as its
uninterrupted peer's), not from a second warm-up.
"""

import json
import signal
import subprocess
import sys
import time

import pytest
from safetensors.numpy import load_file

from tests.conftest import DEMO_DATA, REPO
from tests.test_fleet import ENV, finish, start_island, syncer
from yeto import YetoError
from yeto.island.checkpoint import load_state
from yeto.launch.local import free_port

STEPS = 8
FLAGS = ("--seq-len", "64", "--batch-size", "2", "--lora-r", "4", "--no-progress",
         "--eval-every", "0", "--warmup-steps", "2", "--lr", "1e-3", "--lora-dropout", "0.1", "--save-every", "2")


def train(model, out, *args, env=None, module="yeto.backends.torch"):
    return subprocess.Popen([sys.executable, "-m", module, "--model", str(model), "--data", str(DEMO_DATA),
                             "--out", str(out), "--max-steps", str(STEPS), *FLAGS, *map(str, args),
                             *(["--threads", "1"] if module == "yeto.backends.torch" else [])], cwd=REPO,
                            env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(model, out, *args, env=None, module="yeto.backends.torch"):
    p = train(model, out, *args, env=env, module=module)
    text, _ = p.communicate(timeout=300)
    return p.returncode, text


def events(out, kind):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == kind]


def steps_logged(out):
    """step -> (lr, loss) as the run finally took it (a step logged before a kill and lost is retaken later)."""
    return {e["step"]: (e["lr"], e["loss"]) for e in events(out, "step")}


def steps_after_resume(out):
    """The step numbers the last resumed process took."""
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at = max(i for i, e in enumerate(log) if e["event"] == "resumed")
    return [e["step"] for e in log[at:] if e["event"] == "step"]


def saved_step(out):
    try:
        state = load_state(out)
    except YetoError:
        return None
    return None if state is None else state.meta["step"]


def assert_same_adapter(a, b):
    x = load_file(a / "adapter" / "adapter_model.safetensors")
    y = load_file(b / "adapter" / "adapter_model.safetensors")
    assert sorted(x) == sorted(y)
    diff = {k: float(abs(x[k] - y[k]).max()) for k in x if not (x[k] == y[k]).all()}
    assert not diff, f"the resumed adapter differs from the uninterrupted one in {len(diff)} tensors, by up to " \
                     f"{max(diff.values())}"


def assert_resumed_from_step_2(whole, out):
    """The run in `out` went on from its state saved at step 2 and ended as the uninterrupted one in `whole`: the same
    steps logged, the same adapter bit for bit."""
    assert steps_after_resume(out) == [3, 4, 5, 6, 7, 8]
    assert_same_adapter(whole, out)
    assert steps_logged(out) == steps_logged(whole)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory):
    model, out = tiny_model("llama"), tmp_path_factory.mktemp("uninterrupted")
    code, text = run(model, out)
    assert code == 0, text[-3000:]
    return model, out


def test_a_run_killed_mid_save_resumes_to_the_uninterrupted_adapter(uninterrupted, tmp_path):
    model, whole = uninterrupted
    out = tmp_path / "run"
    code, text = run(model, out, env=dict(ENV, YETO_CRASH_AT="train_state:6"))  # dies inside the save of step 6
    assert code == -signal.SIGKILL, text[-3000:]
    assert saved_step(out) == 4  # the save it died in left the previous state whole
    code, text = run(model, out)  # the same command again
    assert code == 0, text[-3000:]
    assert "resuming from" in text and "at step 4" in text
    assert_same_adapter(whole, out)
    assert steps_logged(out) == steps_logged(whole)  # same step numbers, LRs and losses
    assert not list(out.glob(".train_state*"))  # the temp file the kill left is gone
    assert [e["step"] for e in events(out, "resumed")] == [4] and steps_after_resume(out) == [5, 6, 7, 8]
    code, text = run(model, out)  # a finished run does not silently train more
    assert code == 2 and "holds a finished run (8 steps)" in text and "Traceback" not in text, text[-3000:]
    assert len(events(out, "resumed")) == 1
    code, text = run(model, out, "--max-steps", STEPS + 2)  # raising --max-steps trains on from where it ended
    assert code == 0 and steps_after_resume(out) == [STEPS + 1, STEPS + 2], text[-3000:]


def test_an_mlx_run_killed_mid_save_resumes_to_the_uninterrupted_adapter(tiny_model, tmp_path):
    pytest.importorskip("mlx.core")
    model = tiny_model("llama")
    whole, out = tmp_path / "whole", tmp_path / "run"
    code, text = run(model, whole, module="yeto.backends.mlx")
    assert code == 0, text[-3000:]
    code, text = run(model, out, env=dict(ENV, YETO_CRASH_AT="train_state:4"), module="yeto.backends.mlx")
    assert code == -signal.SIGKILL and saved_step(out) == 2, text[-3000:]
    code, text = run(model, out, module="yeto.backends.mlx")
    assert code == 0 and "at step 2" in text, text[-3000:]
    assert_resumed_from_step_2(whole, out)


def test_a_run_sigkilled_between_saves_resumes_to_the_uninterrupted_adapter(uninterrupted, tmp_path):
    model, whole = uninterrupted
    out = tmp_path / "run"
    p = train(model, out, "--step-delay", "0.5")
    deadline = time.time() + 120
    while saved_step(out) != 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert saved_step(out) == 2, p.communicate(timeout=60)[0][-3000:]
    time.sleep(0.7)  # mid-way to the next save: step 3 is taken and lost with the process
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)
    assert saved_step(out) == 2 and max(steps_logged(out)) >= 3
    code, text = run(model, out)
    assert code == 0, text[-3000:]
    assert_resumed_from_step_2(whole, out)


def test_a_state_of_another_run_is_refused_naming_what_differs(uninterrupted, tmp_path):
    import shutil

    model, whole = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    code, text = run(model, out, "--lora-alpha", "16", "--max-steps", "12")
    assert code == 2 and "--lora-alpha: 32.0 there, 16.0 here" in text and "--fresh" in text, text[-3000:]
    assert "Traceback" not in text
    code, text = run(model, out, "--max-steps", "2", "--fresh")  # starts over, replacing the state
    assert code == 0 and "resuming" not in text, text[-3000:]
    assert saved_step(out) == 2


def test_a_fleet_island_killed_and_restarted_continues_its_steps_and_lr(tiny_model, tmp_path):
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    inner = 3
    procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 4, "--inner-steps", inner,
                              "--island-timeout", 4)}
    flags = ("--warmup-steps", "2", "--lr", "1e-3", "--syncer-timeout", "5")
    procs[0] = start_island(model, port, 0, 2, tmp_path / "l0", *flags)
    victim = start_island(model, port, 1, 2, tmp_path / "l1", *flags, "--step-delay", 0.7)
    deadline = time.time() + 120
    while saved_step(tmp_path / "l1") != inner and time.time() < deadline:  # saved as round 2 starts
        time.sleep(0.05)
    assert saved_step(tmp_path / "l1") == inner
    assert "residual" in load_state(tmp_path / "l1").tensors
    time.sleep(1.0)  # mid-round 2
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    procs[1] = start_island(model, port, 1, 2, tmp_path / "l1", *flags, "--step-delay", 0.7)  # the same command
    outs = finish(procs)
    for name, (code, text) in outs.items():
        assert code == 0, f"{name} exited {code}:\n{text[-3000:]}"
    assert "resuming from" in outs[1][1] and f"at step {inner}" in outs[1][1]
    peer = {e["round"]: (e["step"], e["lr"]) for e in events(tmp_path / "l0", "round")}
    assert [s for s, _ in peer.values()] == [inner, 2 * inner, 3 * inner, 4 * inner]
    log = [json.loads(line) for line in (tmp_path / "l1" / "metrics.jsonl").read_text().splitlines()]
    resumed_at = next(i for i, e in enumerate(log) if e["event"] == "resumed")
    assert log[resumed_at]["step"] == inner
    after = {e["round"]: (e["step"], e["lr"]) for e in log[resumed_at:] if e["event"] == "round"}
    assert after and after == {r: peer[r] for r in after}, (after, peer)  # its steps and LRs are its peer's
    assert sorted(after) == [2, 3, 4]  # it trained round 2 again (its first push was lost with it), then the rest


def test_a_fleet_restore_takes_the_next_step_as_the_island_would_have(tiny_model, tmp_path):
    """In a fleet the state comes back without its adapter (the rejoin brings the global): given the same adapter,
    the restored island's next step is the original's, bit for bit (moments, schedule, batch, dropout)."""
    import torch

    from yeto.island.train_config import TrainConfig
    from yeto.backends.torch.island import TorchIsland

    cfg = TrainConfig(model=str(tiny_model("llama")), data=str(DEMO_DATA), out=str(tmp_path), seq_len=64,
                      batch_size=2, lora_r=4, lora_dropout=0.1, max_steps=10, warmup_steps=2, lr=1e-3,
                      syncer="127.0.0.1:9", num_islands=1)
    quiet = dict(log=lambda s: None)
    a = TorchIsland(cfg, **quiet)
    a.set_total_steps(20)  # the syncer's horizon
    for _ in range(3):
        a.step()
    state = a.training_state()
    b = TorchIsland(cfg, **quiet)
    fresh = b.adapter_state()
    b.load_training_state(state, adapter=False)
    assert all((b.adapter_state()[k] == fresh[k]).all() for k in fresh)  # not the saved adapter
    b.load_adapter_state(a.adapter_state())  # what the rejoin brings
    sb = [b.step() for _ in range(2)]  # (one process: a's steps then draw their dropout from the same point of
    torch.set_rng_state(torch.from_numpy(state.tensors["rng/torch"].copy()))  # torch's generator)
    sa = [a.step() for _ in range(2)]
    assert [(s["step"], s["lr"], s["loss"]) for s in sb] == [(s["step"], s["lr"], s["loss"]) for s in sa]
    assert [s["step"] for s in sb] == [4, 5]
    assert all((a.adapter_state()[k] == b.adapter_state()[k]).all() for k in fresh)


def test_run_island_seeds_the_error_feedback_with_the_saved_residual(start_syncer):
    """A resumed island's first round carries the quantization error it saved; each round start reports it."""
    import numpy as np

    from tests.peers import QuadraticIsland, island_thread, wait_until

    _, port = start_syncer(islands=1, quorum=1, outer_steps=2, inner_steps=2, sync_bits=4)
    saved = np.linspace(-0.01, 0.01, 16, dtype=np.float32)
    seen, results = [], {}
    island_thread(QuadraticIsland(1.0, 10), port, 0, results, residual=saved, on_round_start=seen.append)
    assert wait_until(lambda: 0 in results, 60), "the run did not finish"
    assert isinstance(results[0], dict) and results[0]["complete"], results[0]
    assert len(seen) == 2 and (seen[0] == saved).all() and not (seen[1] == saved).all()
