"""The backends as peers: each island provides every member of the written `Island` protocol, `yeto train --backend`
picks one (auto: MLX on Apple silicon with the mlx extra, else torch) or says in one line why it cannot, and
`yeto train --backend mlx` trains on MLX (its CPU backend on Linux) through the one entry both backends use."""

import ast
import inspect
import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import DEMO_DATA, REPO
from tests.test_lean import torchless_env
from yeto import YetoError
from yeto.island.interface import Backend, Island


def protocol_members(protocol: type) -> set[str]:
    """The attributes (annotated) and methods a Protocol declares."""
    methods = {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods | set(vars(protocol).get("__annotations__", {}))


def provided(cls: type) -> set[str]:
    """What instances of `cls` have, read from its classes (no instance made, no tensor library loaded): attributes
    and methods of the class and its bases, their annotations, and every `self.NAME = ...` in their methods."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names |= {n for n in vars(klass) if not n.startswith("__")} | set(vars(klass).get("__annotations__", {}))
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def test_the_island_protocol_is_whole():
    """The loops' and records' every use of an island is written in the protocol (the members below, typed)."""
    assert protocol_members(Island) == {
        "backend", "cfg", "model_artifact", "source", "shard", "ranks", "step_count", "tokens_seen",
        "loss_tokens_seen", "step", "evaluate", "generate", "adapter_state", "load_adapter_state", "adapter_config",
        "record", "data_record", "set_total_steps", "use_shard", "save", "training_state", "load_training_state"}
    for name in protocol_members(Island) - set(Island.__annotations__):
        assert "return" in getattr(Island, name).__annotations__, name  # typed


def test_the_mlx_island_provides_every_island_member():
    from yeto.backends.mlx.island import MLXIsland  # (imports neither MLX nor torch)

    assert protocol_members(Island) - provided(MLXIsland) == set()


def test_the_torch_island_provides_every_island_member():
    pytest.importorskip("torch")
    from yeto.backends.torch.island import TorchIsland

    assert protocol_members(Island) - provided(TorchIsland) == set()


def test_both_backends_provide_every_backend_member():
    from yeto.backends.mlx.backend import MLXBackend
    from yeto.backends.torch.backend import TorchBackend

    for cls in (TorchBackend, MLXBackend):
        assert protocol_members(Backend) - provided(cls) == set(), cls


def test_backend_choice(monkeypatch):
    import yeto.backends as backends

    monkeypatch.setattr(backends, "missing_mlx", lambda: None)
    monkeypatch.setattr(backends, "require_torch", lambda what: None)
    for system, machine, auto in (("Darwin", "arm64", "mlx"), ("Linux", "x86_64", "torch"),
                                  ("Darwin", "x86_64", "torch"), ("Linux", "aarch64", "torch")):
        monkeypatch.setattr(backends.platform, "system", lambda: system)
        monkeypatch.setattr(backends.platform, "machine", lambda: machine)
        assert backends.choose_backend("auto") == auto, (system, machine)
        assert backends.choose_backend("torch") == "torch" and backends.choose_backend("mlx") == "mlx"
    monkeypatch.setattr(backends, "missing_mlx", lambda: "mlx")  # an Apple-silicon Mac without the mlx extra
    assert backends.choose_backend("auto") == "torch"
    with pytest.raises(YetoError, match=r"--backend mlx, but this install has no mlx: pip install 'yeto\[mlx\]'"):
        backends.choose_backend("mlx")
    with pytest.raises(YetoError, match="unknown --backend 'jax': use auto, torch or mlx"):
        backends.choose_backend("jax")


@pytest.mark.parametrize("args, says", [
    (["--backend", "jax"], "unknown --backend 'jax': use auto, torch or mlx"),
    (["--backend", "torch"], "yeto train --backend torch runs on torch and this install has no torch"),
    (["--backend", "mlx"], "--backend mlx, but this install has no mlx"),
])
def test_yeto_train_refuses_a_backend_it_cannot_run_in_one_line(tmp_path, args, says):
    """Without torch (blocked) nor MLX (blocked here too): every refusal is one line, exit 2, nothing written."""
    env = torchless_env(tmp_path)
    site = tmp_path / "no-torch" / "sitecustomize.py"
    site.write_text(site.read_text() + "for _name in ('mlx', 'mlx_lm'):\n    sys.modules[_name] = None\n")
    r = subprocess.run([sys.executable, "-m", "yeto", "train", *args, "--out", str(tmp_path / "o")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_yeto_train_backend_mlx_trains_on_mlx(tiny_model, tmp_path):
    """`yeto train --backend mlx` on this machine's MLX (the CPU backend on Linux), in a process where torch cannot
    load: two steps of a tiny model, the adapter saved, the run recorded as MLX's."""
    pytest.importorskip("mlx.core")
    from yeto.backends.mlx.compat import fast_blas_library

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "yeto", "train", "--backend", "mlx", "--model", str(tiny_model("llama")),
                        "--data", str(DEMO_DATA), "--out", str(out), "--max-steps", "2", "--seq-len", "64",
                        "--batch-size", "2", "--lora-r", "4", "--eval-every", "0", "--no-progress"],
                       cwd=REPO, env=torchless_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["last_loss"] > 0, summary
    assert json.loads((out / "run.json").read_text())["backend"] == "mlx"
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    if sys.platform.startswith("linux") and fast_blas_library():  # re-executed with OpenBLAS before MLX loaded
        assert "OpenBLAS preloaded" in r.stderr, r.stderr[-3000:]
