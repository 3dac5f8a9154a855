"""Submitting a cloud run from this machine: credentials, the plan, the head VM, join scripts, the registry.

    this machine --sky.launch--> head VM (syncer + controller) --sky.launch--> island VMs --> syncer's port
                 <--- yeto status / logs / down (SkyPilot API) ---

After the head is up this machine only follows the head's log: Ctrl-C stops following, the run goes on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import yaml

from yeto.launch.join import join_instructions, join_script, write_join_files
from yeto.launch.plan import FleetPlan
from yeto.launch.registry import SYNCER_DIR, RunRecord, process_start
from yeto import YetoError, one_line
from yeto.launch.tasks import API_TOKEN_ENV, checkout_root, head_task, island_task, printable
from yeto.sync.shell.keys import Keyring

PLAN_FILE = "plan.json"
TASKS_BEGIN, TASKS_END = "# --- tasks (SkyPilot YAML) ---", "# --- end of tasks ---"
DRY_RUN_SYNCER = "HEAD_IP"  # stands for the head's address in a dry run (it is known once the head is up)


def api_endpoint() -> str:
    """The SkyPilot API server this machine talks to."""
    from sky.server import common

    return common.get_server_url()


def is_local_endpoint(url: str) -> bool:
    return (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def check_out_stays_home(out: Path) -> None:
    """The checkout is uploaded to every VM as SkyPilot's workdir (minus what git ignores): a run directory inside
    it that git does not ignore would ship the run's secret keys to every island."""
    root = checkout_root()
    if root is None or root.resolve() not in out.resolve().parents:
        return
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(out.resolve())],
                             capture_output=True).returncode == 0
    if not ignored or (root / ".skyignore").exists():
        raise YetoError(f"--out {out} is inside the checkout {root}, which is uploaded to every VM, and git does not "
                        "ignore it (or a .skyignore replaces .gitignore): its keys would travel with it. Use a "
                        "--out under runs/ or outside the checkout")


def prepare(plan: FleetPlan) -> tuple[Keyring, Path]:
    """The run's credentials (with a revocable key per reserved slot) and its plan file, under --out."""
    out = Path(plan.out)
    check_out_stays_home(out)
    keys = Keyring.ensure(out / SYNCER_DIR)
    for lid in [*range(len(plan.islands)), *plan.external_ids]:  # every island on its own key: trusted, revocable
        keys.own_key(lid)
    plan_file = out / PLAN_FILE
    plan_file.write_text(plan.to_json())
    return keys, plan_file


def render_tasks(plan: FleetPlan, keys: Keyring, plan_file: Path, syncer: str, endpoint: str | None) -> str:
    """Every task of the run as SkyPilot YAML (secrets redacted), in launch order."""
    docs = [printable(head_task(plan, plan_file, keys.bundle(), endpoint))]
    docs += [printable(island_task(plan, lid, syncer, keys.own_key(lid).text())) for lid in range(len(plan.islands))]
    return yaml.safe_dump_all(docs, sort_keys=False)


def dry_run_prices(plan: FleetPlan) -> list[str]:
    """Each island's hourly price and the run's estimated cost (or "price unknown"), from SkyPilot's catalog."""
    from yeto.launch.costs import price_lines, run_hours
    from yeto.launch.prices import load_prices

    return price_lines(plan, load_prices(sorted({i.cloud for i in plan.islands})), run_hours(plan))


def launch_cloud(plan: FleetPlan, dry_run: bool, console) -> int:
    keys, plan_file = prepare(plan)
    out = Path(plan.out)
    if dry_run:
        syncer = f"{DRY_RUN_SYNCER}:{plan.port}"
        print(f"# run {plan.name}: head {plan.head_cluster}, {len(plan.islands)} cloud island(s), {plan.external} "
              f"reserved slot(s); syncer flags {' '.join(plan.syncer_args)}\n{TASKS_BEGIN}")
        print(render_tasks(plan, keys, plan_file, syncer, None) + TASKS_END)
        print("\n".join(dry_run_prices(plan)))
        for lid in plan.external_ids:  # shown, not written: the head's address is known only once it is up
            print(f"# --- join/{lid}.sh (written at launch, with the head's address, beside its key join/{lid}.key)")
            print(join_script(plan, lid, syncer), end="")
        print("# dry run: nothing was launched")
        return 0
    from yeto.launch.cloud import SkyPilotClient

    client = SkyPilotClient()
    endpoint = api_endpoint()
    remote_api = not is_local_endpoint(endpoint)
    head = head_task(plan, plan_file, keys.bundle(), endpoint if remote_api else None,
                     os.environ.get(API_TOKEN_ENV) if remote_api else None)
    record = RunRecord(plan.name, "cloud", str(out.resolve()), "", head_cluster=plan.head_cluster,
                       island_clusters={str(lid): plan.cluster(lid) for lid in range(len(plan.islands))},
                       external=plan.external_ids, controller="head" if remote_api else "here")
    record.save()  # before anything is provisioned: `yeto down` finds whatever this launch leaves behind
    console.print(f"launching the head {plan.head_cluster} (syncer on port {plan.port}) ...")
    try:
        client.launch_head(head, plan.head_cluster, retry_until_up=plan.retry_until_up)
        syncer = record.syncer = client.head_address(plan.head_cluster, plan.port)
    except Exception as e:  # SkyPilot's errors are many; each means: the head is not serving
        raise YetoError(f"the head {plan.head_cluster} did not come up serving port {plan.port} ({one_line(e)}); "
                        f"`yeto down {plan.name}` tears down what was started") from e
    if not remote_api:  # the head cannot reach this machine's API server: the controller runs here, detached
        log = open(out / "controller.log", "a")
        proc = subprocess.Popen([sys.executable, "-m", "yeto.launch", "--plan", str(plan_file), "--out",
                                 str(out), "--no-syncer", "--syncer-address", syncer], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        record.processes["controller"] = proc.pid
        record.started[str(proc.pid)] = process_start(proc.pid)
        console.print(f"[yellow]the SkyPilot API server ({endpoint}) is local to this machine, so the fleet "
                      "controller runs here (log: controller.log); while this machine is off, preempted islands "
                      "are not relaunched. A remote API server (`sky api login`) moves it to the head.[/yellow]")
    record.save()
    scripts = write_join_files(plan, keys, syncer, out)
    if scripts:
        print(join_instructions(plan, scripts))
    console.print(f"run {plan.name}: syncer {syncer}; `yeto status {plan.name}`, `yeto logs {plan.name}`, "
                  f"`yeto down {plan.name}`. Following the head's log (Ctrl-C stops following; the run goes on).")
    try:
        import sky

        sky.tail_logs(plan.head_cluster, job_id=None, follow=True)
    except KeyboardInterrupt:
        console.print(f"stopped following; run {plan.name} goes on")
    return 0
