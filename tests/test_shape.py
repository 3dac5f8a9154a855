"""`yeto shape`, its prices and `yeto launch --budget`, offline: prices come from a small catalog in SkyPilot's own
format (tests/data/sky_catalog) read through SkyPilot's API, the planner ranks real sizes (yeto.launch.sizing) of
catalog models, and the CLI runs as a real subprocess."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace

import pytest

from tests.conftest import DEMO_DATA, REPO
from yeto.launch.prices import PriceBook, book_from_rows
from yeto.launch.shape import (MAX_INNER_STEPS, MIN_INNER_STEPS, MIN_OUTER_STEPS, TARGET_ROUND_S, Order, Rejection,
                               ShapeRequest, candidates, duration, plan_shapes, tokens_per_step)
from yeto.launch.spec import parse_gpu
from yeto.launch.sizing import island_gib, model_size

FIXTURE = REPO / "tests" / "data" / "sky_catalog"
TIMEOUT_S = 180
# SkyPilot's InstanceTypeInfo fields (sky.catalog.common), without importing SkyPilot for the pure tests
Row = namedtuple("Row", "cloud instance_type accelerator_name accelerator_count cpu_count device_memory memory "
                        "price spot_price region")


def row(cloud: str, gpu: str, count: int, price: float, spot: float, region: str = "r1") -> Row:
    return Row(cloud, f"{count}x{gpu}", gpu, float(count), 8.0, 80.0, 64.0, price, spot, region)


def book(*rows: Row) -> PriceBook:
    return book_from_rows(rows)


@pytest.fixture
def catalog(tmp_path):
    """SKY_RUNTIME_DIR holding a copy of the fixture catalog (SkyPilot may write locks beside it)."""
    shutil.copytree(FIXTURE, tmp_path / "sky", dirs_exist_ok=True)
    return tmp_path / "sky"


def yeto(*args, sky_dir, env=None):
    env = dict(os.environ, SKY_RUNTIME_DIR=str(sky_dir), PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-m", "yeto", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------------- prices


def test_prices_are_read_through_skypilots_api_from_the_fixture(catalog):
    """Cheapest region per cloud, spot and on-demand, as SkyPilot's own list_accelerators reports the CSVs."""
    code = """
import json
from yeto.launch.prices import load_prices
b = load_prices()
def o(x): return None if x is None else [x.cloud, x.region, x.instance_type, x.hourly]
print(json.dumps(dict(
    unavailable=b.unavailable,
    a10g_spot=o(b.cheapest("A10G", 1, True)), a10g_east=o(b.island("aws", "A10G", 1, True, "us-east-1")),
    h100x8_od=o(b.cheapest("H100", 8, False)), h100x8_aws=o(b.island("aws", "H100", 8, False)),
    lambda_spot=o(b.island("lambda", "H100", 1, True)), lambda_od=o(b.island("lambda", "H100", 1, False)),
    only_aws=o(b.cheapest("H100", 8, False, ["aws"])), gcp=o(b.cheapest("L4", 1, True, ["gcp"])))))
import sky.catalog, time
sky.catalog.list_accelerators = lambda **kw: time.sleep(60)  # SkyPilot stuck on a network it cannot reach
t = time.monotonic()
print(json.dumps([load_prices(["aws"], timeout_s=0.5).unavailable, time.monotonic() - t]))
"""
    env = dict(os.environ, SKY_RUNTIME_DIR=str(catalog), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-2])
    stuck, waited = json.loads(r.stdout.strip().splitlines()[-1])
    assert stuck == "prices unavailable: SkyPilot could not read aws (no answer in 0.5s)" and waited < 10
    assert got["unavailable"] is None
    assert got["a10g_spot"] == ["aws", "us-west-2", "g5.xlarge", 0.4123]  # us-west-2's spot beats us-east-1's
    assert got["a10g_east"] == ["aws", "us-east-1", "g5.xlarge", 0.4396]  # a named region: that region's price
    assert got["h100x8_od"] == ["runpod", "US", "8x_H100_SECURE", 21.52]  # runpod under lambda (23.92) and aws
    assert got["h100x8_aws"] == ["aws", "us-east-1", "p5.48xlarge", 55.04]
    assert got["lambda_spot"] is None and got["lambda_od"][3] == 2.49  # Lambda sells no spot
    assert got["only_aws"][0] == "aws" and got["gcp"] is None


def test_a_missing_catalog_is_one_line_and_no_fetch(tmp_path):
    code = "from yeto.launch.prices import load_prices; b = load_prices(); print(b.empty); print(b.unavailable)"
    env = dict(os.environ, SKY_RUNTIME_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    empty, line = r.stdout.strip().splitlines()[-2:]
    assert empty == "True" and line.startswith("prices unavailable: no SkyPilot catalog at ") and str(tmp_path) in line
    assert not (tmp_path / ".sky").exists()  # nothing was downloaded or written


def test_the_book_keeps_the_cheapest_region_and_skips_missing_spot():
    b = book(row("aws", "L4", 1, 0.80, 0.37, "us-east-1"), row("aws", "L4", 1, 0.80, 0.34, "us-west-2"),
             row("lambda", "L4", 1, 0.60, float("nan")), row("x", "L4", 0.5, 0.1, 0.05))
    assert b.cheapest("L4", 1, True).region == "us-west-2"
    assert b.cheapest("L4", 1, False).cloud == "lambda"
    assert b.island("lambda", "L4", 1, True) is None
    assert b.island("aws", "L4", 1, True, "us-east-1").hourly == 0.37
    assert all(o.count >= 1 for o in b.offers.values())  # half a GPU is no island


# ---------------------------------------------------------------------------------------------- the planner

PRICES = book(  # per-GPU spot prices chosen so that per token the L4 beats the A10G, and H100 x8 is pricey
    row("aws", "A10G", 1, 1.0, 0.45), row("aws", "L4", 1, 0.8, 0.30), row("aws", "T4", 1, 0.5, 0.20),
    row("runpod", "H100", 1, 2.7, 1.75), row("runpod", "H100", 8, 21.5, 14.0), row("aws", "A100-80GB", 8, 27, 12))


def test_options_are_ranked_by_cost_per_token_and_a_price_change_reorders_them():
    size = model_size("smollm2-135m")
    request = ShapeRequest("smollm2-135m", gpus=("A10G", "L4", "H100"))
    plan = plan_shapes(size, request, PRICES)
    costs = [o.usd_per_mtok for o in plan.options]
    assert costs == sorted(costs) and len(costs) == 4  # A10G, L4, H100 x1 and x8
    first = plan.options[0].shape
    repriced = book(*[row(o.cloud, o.gpu, o.count, o.hourly * (100 if (o.gpu, o.count) == (first.gpu, first.count)
                                                               else 1), o.hourly) for o in PRICES.offers.values()
                      if o.spot])
    assert plan_shapes(size, request, repriced).options[0].shape == first  # on-demand prices do not rank spot
    spot_up = book(*[row(o.cloud, o.gpu, o.count, o.hourly, o.hourly * (100 if (o.gpu, o.count) == (
        first.gpu, first.count) else 1)) for o in PRICES.offers.values() if o.spot])
    last = plan_shapes(size, request, spot_up).options[-1].shape
    assert (last.gpu, last.count) == (first.gpu, first.count)  # the same shape, priced up, goes last


def test_ranking_by_time_puts_the_fastest_fleet_first():
    size = model_size("smollm2-135m")
    plan = plan_shapes(size, ShapeRequest("smollm2-135m", gpus=("A10G", "L4", "H100"), order=Order.TIME), PRICES)
    hours = [f.hours for f in plan.fleets]
    assert hours == sorted(hours) and plan.best.option.shape.gpu == "H100"


def test_each_rejection_reason_fires():
    size = model_size("llama3.1-70b")
    request = ShapeRequest("llama3.1-70b", gpus=("T4", "H100", "B200", "M2-Max-64GB"), budget=10.0)
    plan = plan_shapes(size, request, PRICES)
    reasons = {(r.shape.gpu, r.shape.count): r.reason for r in plan.rejected}
    assert reasons[("T4", 8)] is Rejection.DOES_NOT_FIT  # 140 GB of bf16 weights over 8 x 15 GiB
    assert reasons[("H100", 8)] is Rejection.OVER_BUDGET  # fits, $14/h > $10/h
    assert reasons[("B200", 1)] is Rejection.NO_PRICE  # fits on one 179 GiB device, no catalog row
    assert reasons[("M2-Max-64GB", 1)] is Rejection.NOT_A_CLOUD_GPU
    nf4 = plan_shapes(size, replace(request, base="nf4", gpus=("H100",), budget=None), PRICES)
    assert {r.reason for r in nf4.rejected if r.shape.count > 1} == {Rejection.NF4_UNSUPPORTED}
    assert not plan.options  # nothing else was asked: every candidate is accounted for
    assert len(plan.rejected) == 4 * 3 + 1


def test_the_budget_is_respected_and_sizes_the_fleet():
    size = model_size("smollm2-135m")
    plan = plan_shapes(size, ShapeRequest("smollm2-135m", budget=1.0), PRICES)
    assert plan.fleets
    for f in plan.fleets:
        assert f.option.hourly <= 1.0 and f.islands * f.option.hourly <= 1.0 + 1e-9
    assert {(r.shape.gpu, r.shape.count) for r in plan.rejected if r.reason is Rejection.OVER_BUDGET} >= {
        ("H100", 1), ("H100", 8), ("A100-80GB", 8)}
    l4 = next(f for f in plan.fleets if f.option.shape.gpu == "L4")
    assert l4.islands == 3 and l4.quorum == 2  # $1/h buys three $0.30 spot L4s; one may be preempted


def test_the_fleet_launch_line_parses_and_its_round_takes_minutes():
    size = model_size("llama3.1-8b")
    plan = plan_shapes(size, ShapeRequest("my model", budget=3.0, spot=False), PRICES)
    for f in plan.fleets:
        argv = shlex.split(f.launch)
        assert argv[:2] == ["yeto", "launch"] and argv[argv.index("--model") + 1] == "my model"
        islands = parse_gpu(argv[argv.index("--gpu") + 1])  # yeto's own --gpu parser
        assert len(islands) == f.islands and {(i.cloud, i.count, i.gpu) for i in islands} == {
            (f.cloud, f.option.shape.count, f.option.shape.gpu)}
        assert "--on-demand" in argv and int(argv[argv.index("--quorum") + 1]) == f.islands  # on-demand: all
        assert argv[argv.index("--budget") + 1] == "3"  # (launch checks the price against it again)
        round_s = f.inner_steps * tokens_per_step(f.option.shape) / f.option.tokens_per_s
        assert MIN_INNER_STEPS <= f.inner_steps <= MAX_INNER_STEPS
        by_tokens = f.tokens // (MIN_OUTER_STEPS * f.islands * tokens_per_step(f.option.shape))
        assert f.inner_steps in (MIN_INNER_STEPS, MAX_INNER_STEPS, by_tokens) or (
            TARGET_ROUND_S / 2 < round_s < 2 * TARGET_ROUND_S)
        assert f.outer_steps >= MIN_OUTER_STEPS


def test_machines_you_own_join_in_time_windows_or_say_why_they_stay_out():
    size = model_size("qwen3-8b")
    request = ShapeRequest("qwen3-8b", gpus=("L4",), budget=1.0, own=("M3-Max-128GB", "T4"))
    fleet = plan_shapes(size, request, PRICES).best
    mac, t4 = fleet.own
    assert mac.fits and mac.tokens_per_s > 0 and fleet.joining == [mac]
    assert not t4.fits and "GiB" in t4.out  # 16 GB of bf16 weights on a 15 GiB card
    argv = shlex.split(fleet.launch)
    assert argv[argv.index("--external-islands") + 1] == "1" and "--inner-steps" not in argv
    assert float(argv[argv.index("--round-seconds") + 1]) == TARGET_ROUND_S and fleet.inner_steps == 0
    assert int(argv[argv.index("--quorum") + 1]) == fleet.quorum <= fleet.islands  # the Mac is not waited for
    alone = plan_shapes(size, replace(request, own=()), PRICES).best
    assert fleet.hours < alone.hours  # the Mac's tokens count
    assert any(line.startswith("M3-Max-128GB joins") for line in fleet.why)
    nf4 = plan_shapes(size, replace(request, base="nf4", own=("M3-Max-128GB",)), PRICES).best
    assert not nf4.joining and "nf4" in nf4.own[0].out and "--external-islands" not in nf4.launch
    big = plan_shapes(model_size("llama3.1-70b"), ShapeRequest("llama3.1-70b", gpus=("H100",), base="nf4",
                                                               own=("M3-Ultra-512GB",)), PRICES).best
    slow = plan_shapes(model_size("llama3.1-70b"), ShapeRequest("llama3.1-70b", gpus=("A100-80GB",),
                                                                own=("M3-Ultra-512GB",)), PRICES).best
    assert not big.joining and not slow.joining and "longer than a round" in slow.own[0].out


def test_without_prices_the_smallest_island_leads_and_the_missing_prices_are_said():
    """It proposed 2 x 8xB200 for SmolLM2-135M ("0 min", --outer-steps 1) and for an 8B model: unpriced, cost falls
    back to size (the smallest island that fits first), time ranks only when asked."""
    unpriced = PriceBook(unavailable="prices unavailable: test")
    for model, smallest in (("smollm2-135m", "T4"), ("llama3.1-8b", "L4")):
        plan = plan_shapes(model_size(model), ShapeRequest(model), unpriced)
        assert plan.prices == "prices unavailable: test" and plan.ranked_by is Order.SIZE
        assert plan.fleets and all(f.cost is None and f.option.offer is None for f in plan.fleets)
        assert not [r for r in plan.rejected if r.reason is Rejection.NO_PRICE]
        sizes = [island_gib(f.option.shape) for f in plan.fleets]
        assert sizes == sorted(sizes)
        best = plan.best.option.shape
        assert (best.count, best.gpu) == (1, smallest), best
        assert plan.best.outer_steps >= MIN_OUTER_STEPS and plan.best.hours * 60 >= 1
        assert any(n.startswith("prices missing: ranked by size") for n in plan.notes), plan.notes
    by_time = plan_shapes(model_size("smollm2-135m"), ShapeRequest("smollm2-135m", order=Order.TIME), unpriced)
    hours = [f.hours for f in by_time.fleets]
    assert hours == sorted(hours) and by_time.ranked_by is Order.TIME


def test_the_rounds_are_cut_so_the_tokens_make_a_few():
    """A fast island's 5-minute round held all of --tokens: one merge (--outer-steps 1) is no DiLoCo run."""
    size = model_size("smollm2-135m")
    fast = plan_shapes(size, ShapeRequest("smollm2-135m", gpus=("H100",)), PRICES)
    eight = next(f for f in fast.fleets if f.option.shape.count == 8)
    assert eight.outer_steps >= MIN_OUTER_STEPS and MIN_INNER_STEPS <= eight.inner_steps < MAX_INNER_STEPS
    assert f"make {MIN_OUTER_STEPS}+ rounds" in " ".join(eight.why)
    argv = shlex.split(eight.launch)
    assert int(argv[argv.index("--outer-steps") + 1]) == eight.outer_steps
    slow = plan_shapes(size, ShapeRequest("smollm2-135m", gpus=("T4",), tokens=10 ** 9), PRICES).best
    assert "rounds (--outer-steps) to merge" not in " ".join(slow.why)  # enough tokens: rounds of about 5 minutes


def test_a_duration_under_a_minute_is_in_seconds():
    assert (duration(10 / 3600), duration(0.5), duration(3.0), duration(72.0)) == ("10 s", "30 min", "3.0 h", "3.0 d")


def test_any_mac_joins_by_its_chip_and_memory():
    """An M2 MacBook Air and an M3 Pro were unknown GPUs; now each is sized and joins or says why not."""
    size = model_size("smollm2-135m")
    request = ShapeRequest("smollm2-135m", gpus=("T4",), budget=1.0, seq_len=512,
                           own=("M2-24GB", "M3-Pro-36GB", "M2-16GB"))
    fleet = plan_shapes(size, request, PRICES).best
    air, pro, small_air = fleet.own
    assert fleet.joining == [air, pro]
    assert 0 < air.tokens_per_s < pro.tokens_per_s  # 10 GPU cores at 100 GB/s, 18 at 150
    argv = shlex.split(fleet.launch)
    assert argv[argv.index("--external-islands") + 1] == "2"
    assert not small_air.fits and "it has 12" in small_air.out  # 16 GB, of which the GPU may wire 12 GiB


def test_every_catalog_alias_gets_a_plan():
    from yeto.models.catalog import CATALOG

    for alias in CATALOG:
        plan = plan_shapes(model_size(alias), ShapeRequest(alias), PRICES)
        assert plan.fleets, alias  # every alias fits some priced island (the largest on 8 x H100 or A100-80GB)
        assert len(plan.fleets) + len(plan.rejected) == len({(s.gpu, s.count) for s in candidates(plan.request)})


# ---------------------------------------------------------------------------------------------- the CLI


def test_yeto_shape_for_an_alias_prices_and_proposes(catalog):
    r = yeto("shape", "--model", "llama3.1-70b", "--budget", "20", "--json", sky_dir=catalog)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["prices"] is None and out["options"]
    best = out["options"][0]
    assert best["option"]["offer"]["cloud"] == "runpod" and best["option"]["shape"]["gpu"] == "H100"
    assert best["islands"] * best["option"]["usd_per_hour"] <= 20
    assert {r["reason"] for r in out["rejected"]} >= {"DOES_NOT_FIT", "NO_PRICE"}
    table = yeto("shape", "--model", "llama3.1-70b", "--budget", "20", sky_dir=catalog)
    assert table.returncode == 0 and best["launch"] in table.stdout.replace("\n", "")
    assert "rejected, does not fit:" in table.stdout


def test_yeto_shape_for_a_local_model_directory(catalog, tiny_model):
    r = yeto("shape", "--model", tiny_model("llama"), "--gpus", "T4,L4", "--json", sky_dir=catalog)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert {(o["option"]["shape"]["gpu"], o["option"]["shape"]["count"]) for o in out["options"]} >= {("T4", 1),
                                                                                                      ("L4", 1)}


def test_yeto_shape_without_a_catalog_lists_the_fits_and_says_so(tmp_path):
    r = yeto("shape", "--model", "smollm2-135m", sky_dir=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout.replace("\n", "")
    assert "prices unavailable: no SkyPilot catalog at" in text and "prices missing: ranked by size" in text
    assert "by size" in text and " 0 min " not in text
    assert "proposed fleet: 2 x 1xT4 on aws" in text and "unpriced" in text  # (it proposed 2 x 8xB200, 0 min)
    line = shlex.split(r.stdout.split("\nyeto launch", 1)[1].splitlines()[0])
    assert line[:2] == ["--gpu", "aws:1xT4,aws:1xT4"] and int(line[line.index("--outer-steps") + 1]) >= MIN_OUTER_STEPS
    assert "--budget" not in line  # (an unpriced line carries no budget)
    # a budget with nothing to price it by: the shapes, and no fleet (it proposed 2 x 8xB200 for SmolLM2-135M)
    budget = yeto("shape", "--model", "smollm2-135m", "--budget", "5", sky_dir=tmp_path)
    text = budget.stdout.replace("\n", "")
    assert budget.returncode == 0 and "no fleet proposed: --budget $5/h needs prices" in text, budget.stdout
    assert "yeto launch" not in text and "proposed fleet" not in text


def test_a_launch_budget_that_cannot_be_priced_is_refused_in_one_line(tmp_path):
    r = yeto("launch", "--gpu", "aws:1xL4", "--budget", "5", "--model", "smollm2-135m", "--data", DEMO_DATA,
             "--out", tmp_path / "run", "--dry-run", sky_dir=tmp_path, env={"YETO_RUNS": str(tmp_path / "runs")})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--budget $5/h cannot be checked: no spot price for" in lines[0]
    assert "leave --budget out" in lines[0], r.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--model", "no-such-alias"], "no-such-alias"),
    (["--model", "smollm2-135m", "--gpus", "H1000"], "unknown GPU 'H1000'"),
    (["--model", "smollm2-135m", "--budget", "-3"], "--budget -3"),
    (["--model", "smollm2-135m", "--own", "M9-Mac"], "unknown GPU 'M9-Mac'"),
])
def test_bad_shape_input_is_one_line_and_exit_2(tmp_path, args, fragment):
    r = yeto("shape", *args, sky_dir=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], r.stderr


def test_launch_budget_picks_a_fleet_and_the_dry_run_prices_it(catalog, tmp_path):
    env = {"YETO_RUNS": str(tmp_path / "runs")}
    r = yeto("launch", "--budget", "1", "--model", "smollm2-135m", "--data", DEMO_DATA, "--out", tmp_path / "run",
             "--name", "budget", "--dry-run", "--seq-len", "512", sky_dir=catalog, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    chose = next(line for line in r.stdout.splitlines() if line.startswith("--budget $1/h: --gpu "))
    gpu = chose.split("--gpu ", 1)[1].split(" ", 1)[0]
    islands = parse_gpu(gpu)
    assert len(islands) >= 2
    priced = [line for line in r.stdout.splitlines() if line.startswith("# island ")]
    assert len(priced) == len(islands) and all("/h spot (" in line for line in priced)
    fleet = next(line for line in r.stdout.splitlines() if line.startswith("# fleet: $"))
    hourly = float(fleet.split("$", 1)[1].split("/h", 1)[0])
    assert hourly <= 1.0 and "estimated run" in fleet
    over = yeto("launch", "--gpu", "aws:8xH100", "--budget", "5", "--model", "smollm2-135m", "--data", DEMO_DATA,
                "--out", tmp_path / "run2", "--dry-run", sky_dir=catalog, env=env)
    lines = [line for line in over.stderr.splitlines() if line.strip()]
    assert over.returncode == 2 and len(lines) == 1 and "over --budget $5/h" in lines[0], over.stderr
