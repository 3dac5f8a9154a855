"""Islands of several processes under torchrun (gloo on CPU, 2 ranks, a tiny Llama): the same training as one
process with the whole batch, a 2-rank island and a 1-process island merged by a real syncer, a killed rank."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
from safetensors.numpy import load_file

from tests.conftest import DEMO_DATA, REPO
from tests.peers import wait_until
from tests.test_faults import assert_run_complete
from tests.test_fleet import ENV, finish, start_island, syncer, wait_for
from yeto.launch.local import free_port
from yeto.sync.shell.audit import audit
from yeto.sync.shell.tape import read_tape

COMMON = ["--data", str(DEMO_DATA), "--seq-len", "64", "--lora-r", "4", "--lora-dropout", "0", "--threads", "1",
          "--no-progress"]


def torchrun(model, out, *args, ranks=2, restarts=0, log=subprocess.PIPE):
    """A torchrun island (its output to `log`: a pipe, or a file when a crashing rank's traceback could fill one)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                             str(ranks), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                             "--max-restarts", str(restarts),
                             "-m", "yeto.backends.torch", "--model", str(model), "--out", str(out), *COMMON,
                             *map(str, args)], cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def adapter(out):
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_a_two_rank_island_trains_as_one_process_does_with_the_whole_batch(tiny_model, tmp_path):
    """2 ranks x batch 2 and 1 process x batch 4 see the same 4 blocks per step (every rank draws the global batch
    and takes its slice); the token-weighted gradients summed over the ranks are the whole batch's gradient, so the
    adapters agree to float32 summation order after 6 AdamW steps."""
    model = tiny_model("llama")
    two = torchrun(model, tmp_path / "two", "--batch-size", 2, "--max-steps", 6, "--eval-every", 0)
    out, _ = two.communicate(timeout=300)
    assert two.returncode == 0, out[-3000:]
    one = subprocess.run([sys.executable, "-m", "yeto.backends.torch", "--model", str(model),
                          "--out", str(tmp_path / "one"),
                          *COMMON, "--batch-size", "4", "--max-steps", "6", "--eval-every", "0"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = adapter(tmp_path / "two"), adapter(tmp_path / "one")
    assert a.keys() == b.keys() and len(a) > 0
    moved = max(float(np.abs(b[k]).max()) for k in b if "lora_B" in k)
    assert moved > 1e-4  # they trained (lora_B starts at zero)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)
    summary_two = (tmp_path / "two" / "summary.json").read_text()
    assert '"tokens": 1536' in summary_two  # the island's tokens: 6 steps x 4 blocks x 64, both ranks counted


def test_a_killed_torchrun_island_resumes_from_its_saved_state(tiny_model, tmp_path):
    """Rank 0 saves the island's training state (--save-every); the same command after a kill resumes there on every
    rank (moments, schedule, batch order) and ends on the adapter of an uninterrupted run."""
    model = tiny_model("llama")
    args = ("--batch-size", 2, "--max-steps", 6, "--eval-every", 0, "--save-every", 2)
    whole = torchrun(model, tmp_path / "whole", *args)
    out, _ = whole.communicate(timeout=300)
    assert whole.returncode == 0, out[-3000:]
    killed = torchrun(model, tmp_path / "k", *args, "--step-delay", 1)
    assert wait_until(lambda: (tmp_path / "k" / "train_state.safetensors").exists(), 200), "never saved its state"
    ranks = subprocess.run(["pgrep", "-P", str(killed.pid)], capture_output=True, text=True).stdout.split()
    for pid in [*ranks, killed.pid]:  # (the ranks run in sessions of their own: kill each)
        os.kill(int(pid), signal.SIGKILL)
    killed_out, _ = killed.communicate(timeout=60)
    assert "done" not in killed_out, killed_out[-3000:]
    again = torchrun(model, tmp_path / "k", *args)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out[-3000:]
    step = int(re.search(r"resuming from \S+ at step (\d+)", out).group(1))
    assert step in (2, 4)
    a, b = adapter(tmp_path / "whole"), adapter(tmp_path / "k")
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert json.loads((tmp_path / "k" / "summary.json").read_text())["steps"] == 6


def test_a_two_rank_island_a_one_process_island_and_an_mlx_island_merge_in_one_run(tiny_model, tmp_path):
    """A real syncer; a 2-rank torchrun island (island 0), a 1-process torch island (1), an MLX island (2). Every
    broadcast is checked by digest on both ranks (a difference ends the island); the island's tokens and its
    declared tokens per step count both ranks; every island ends on the merged adapter."""
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 3, "--quorum", 3, "--outer-steps", 3, "--inner-steps", 3,
                              "--sync-bits", 8)}
    procs[0] = torchrun(model, tmp_path / "l0", "--syncer", f"127.0.0.1:{port}", "--island-id", 0,
                        "--batch-size", 2)  # no --islands: the syncer says the shard (relayed to rank 1)
    procs[1] = start_island(model, port, 1, 3, tmp_path / "l1", "--lora-dropout", 0)  # (the contract: the same LoRA)
    procs[2] = subprocess.Popen([sys.executable, "-m", "yeto.backends.mlx", "--model", str(model), "--syncer",
                                 f"127.0.0.1:{port}", "--island-id", "2", "--out",
                                 str(tmp_path / "l2"), "--batch-size", "2", *COMMON], cwd=REPO, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = {name: p.communicate(timeout=400) for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, (name, outs[name][0][-3000:])
    tape = read_tape(s_out)
    assert {e["island"]: e["backend"] for e in tape if e["event"] == "join"} == {0: "torch", 1: "torch", 2: "mlx"}
    merges = [e for e in tape if e["event"] == "merge"]
    assert [m["responders"] for m in merges] == [[0, 1, 2]] * 3
    deltas = {(e["round"], e["island"]): e for e in tape if e["event"] == "delta"}
    assert deltas[(1, 0)]["tokens"] == 3 * 2 * 2 * 64  # 3 steps x 2 ranks x batch 2 x 64
    assert deltas[(1, 1)]["tokens"] == deltas[(1, 2)]["tokens"] == 3 * 2 * 64
    assert audit(tape).ok, audit(tape).summary()
    shards = [json.loads((tmp_path / f"l{i}" / "summary.json").read_text())["shard"] for i in range(3)]
    assert shards == [[0, 3], [1, 3], [2, 3]]  # said by the syncer (0, 2) or declared and checked (1)
    merged = load_file(str(s_out / "adapter" / "adapter_model.safetensors"))
    for island in ("l0", "l1", "l2"):
        mine = adapter(tmp_path / island)
        assert sorted(mine) == sorted(merged)
        assert max(float(np.abs(mine[k] - merged[k]).max()) for k in merged) < 1e-6


def test_a_killed_rank_ends_the_island_without_a_hang(tiny_model, tmp_path):
    model = tiny_model("llama")
    island = torchrun(model, tmp_path / "k", "--batch-size", 2, "--max-steps", 100000, "--eval-every", 0)
    try:
        assert wait_until(lambda: (tmp_path / "k" / "metrics.jsonl").exists()
                          and "step" in (tmp_path / "k" / "metrics.jsonl").read_text(), 120), "never trained"
        ranks = subprocess.run(["pgrep", "-f", "-P", str(island.pid), "yeto.backends.torch"], capture_output=True,
                               text=True).stdout.split()
        assert len(ranks) == 2, ranks
        os.kill(int(ranks[-1]), signal.SIGKILL)  # one rank dies mid-collective
        t0 = time.monotonic()
        out, _ = island.communicate(timeout=120)
        assert island.returncode != 0 and time.monotonic() - t0 < 90, out[-2000:]
    finally:
        if island.poll() is None:
            os.killpg(island.pid, signal.SIGKILL)
            island.wait()
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "k")], capture_output=True, text=True).stdout.split()
    assert not leftover, f"ranks left running: {leftover}"


def test_ranks_count_in_the_claims_bound():
    from yeto.sync.core.contract import MAX_ISLAND_RANKS, tokens_per_step

    record = {"config": {"batch_size": 2, "grad_accum": 3, "seq_len": 64}}
    assert tokens_per_step(record) == 384
    assert tokens_per_step({**record, "ranks": 8}) == 8 * 384
    assert tokens_per_step({**record, "ranks": 10**9}) == MAX_ISLAND_RANKS * 384  # a claim cannot grow unbounded


def test_an_fsdp_island_trains_as_the_replicated_one(tiny_model, tmp_path):
    """--shard fsdp: the frozen base sharded per transformer block across the 2 ranks (FSDP2, gloo), LoRA whole on
    each. The same 4 steps as a replicated (ddp) island, adapters equal to float32 order, the same names and shapes
    as a one-process island's; evaluation, a collective forward now, is relayed to both ranks. The micro-batch size
    changes nothing either: the replicated island runs 1 block at a time, the sharded one probes (`auto`: both ranks
    in lockstep, through the sharded forward)."""
    model = tiny_model("llama")
    runs = {}
    for shard, micro in (("ddp", "1"), ("fsdp", "auto")):
        p = torchrun(model, tmp_path / shard, "--batch-size", 2, "--max-steps", 4, "--eval-every", 2, "--shard", shard,
                     "--micro-batch-size", micro)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, (shard, out[-3000:])
        runs[shard] = adapter(tmp_path / shard)
        if shard == "fsdp":  # rank 0 holds about half of the base (the embeddings and LM head stay whole)
            m = re.search(r"fsdp: (\d+) blocks sharded over 2 ranks; this rank holds ([\d.]+)M of the base's ([\d.]+)M",
                          out)
            assert m and int(m[1]) == 2 and float(m[2]) < float(m[3]), out[-2000:]
            assert "micro-batch: 2 of --batch-size 2 (probed on cpu)" in out, out[-2000:]
    assert runs["ddp"].keys() == runs["fsdp"].keys()
    for k in runs["ddp"]:
        assert runs["ddp"][k].shape == runs["fsdp"][k].shape
        np.testing.assert_allclose(runs["fsdp"][k], runs["ddp"][k], rtol=1e-4, atol=1e-6, err_msg=k)
    one = subprocess.run([sys.executable, "-m", "yeto.backends.torch", "--model", str(model),
                          "--out", str(tmp_path / "x"),
                          *COMMON, "--max-steps", "1", "--shard", "fsdp"], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert one.returncode == 2 and "--shard fsdp shards the frozen base across the ranks" in one.stderr


def test_base_quantization_nf4_is_cuda_only_and_says_so_in_one_line(tiny_model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "yeto.backends.torch", "--model", str(tiny_model("llama")), "--out",
                        str(tmp_path / "q"), *COMMON, "--max-steps", "1", "--base-quantization", "nf4"], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]  # (after the data summary the island logs first)
    assert r.returncode == 2 and last.startswith("error: --base-quantization nf4 (QLoRA through bitsandbytes) runs on "
                                                 "CUDA only"), r.stderr[-2000:]


def test_a_torchrun_island_restarted_by_torchrun_rejoins_the_run(tiny_model, tmp_path):
    """A rank killed mid-round takes its island down; torchrun (c10d rendezvous, --max-restarts 1) starts the group
    again, and the new rank 0 rejoins the open round through the syncer's rejoin path (the identity kept in --out):
    every merge is [0, 1], the restarted island's included."""
    model, port, s_out = tiny_model("llama"), free_port(), tmp_path / "syncer"
    procs = {"syncer": syncer(port, s_out, "--islands", 2, "--quorum", 2, "--outer-steps", 3, "--inner-steps", 4,
                              "--island-timeout", 4)}
    procs[0] = start_island(model, port, 0, 2, tmp_path / "l0", "--lora-dropout", 0, "--step-delay", 0.2,
                       "--syncer-timeout", 5)
    with open(tmp_path / "island1.log", "w") as log:
        procs[1] = torchrun(model, tmp_path / "l1", "--syncer", f"127.0.0.1:{port}", "--island-id", 1,
                            "--islands", 2, "--batch-size", 1, "--step-delay", 1.5, "--syncer-timeout", 5,
                            restarts=1, log=log)
        try:
            wait_for(s_out, "round_open", round=2)
            wait_for(s_out, "delta", round=2, island=0)  # mid-round: island 1 still training
            ranks = subprocess.run(["pgrep", "-f", "-P", str(procs[1].pid), "yeto.backends.torch"], capture_output=True,
                                   text=True).stdout.split()
            assert len(ranks) == 2, ranks
            os.kill(int(ranks[-1]), signal.SIGKILL)
            outs = finish(procs)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    island_log = (tmp_path / "island1.log").read_text()
    outs[1] = (outs[1][0], island_log)
    events = assert_run_complete(s_out, outs, 3, [tmp_path / "l0", tmp_path / "l1"], quorum_of=[0, 1])
    joins = [e for e in events if e["event"] == "join" and e["island"] == 1]
    assert len({e["session"] for e in joins}) == 2, joins  # the restarted group joined as a new session ...
    assert [e["round"] for e in joins if e.get("rejoin")] == [2]  # ... into the open round 2
    assert island_log.count("island 1 joined the syncer") == 2
