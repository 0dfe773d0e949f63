"""
The paper's experiments as one command, at three scales (one config each in experiments/paper/configs/):

    python -m experiments.paper.run --scale tiny                        # CPU, minutes, the bundled data
    python -m experiments.paper.run --scale gpu --stage build           # here: groups, texts, wheels -> carry folder
    python3 -m experiments.paper.run --scale gpu --stage device          # on one H200: ~9 minutes, models -> $OUT
    python -m experiments.paper.run --scale gpu --stage score --returned DIR   # here: unpack, score, results page
    python -m experiments.paper.run --scale paper --dry_run             # the plan and its GPU-hours; no GPU needed

Every arm starts from the same model, reads the same groups and gets the same budget (steps, batch, length, lr and
schedule, retention), as the paper gives every method: xPRT, its ablations (no fill-in, random positive, E5-only and
TF-IDF-only ranking, self-reconstruction with five times the steps) and every other objective train.py --objective
offers (read from its parser, so a new objective becomes an arm without an edit here). Each is scored against the
start by evaluate.py, and results.md sets ours beside the paper's published numbers (experiments/paper/page.py,
published.py). Stages: start (the start model), groups (select_groups.py, one folder per ranking the arms need),
train (train.py per arm and seed), score (evaluate.py per seed, then the page); `--stage all` runs them in order,
and a finished step (its output folder complete) is skipped on a rerun.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from experiments.paper import device, page  # the GPU round trip; the results page

# stages first: it puts the repository on sys.path and sets the offline defaults before anything else imports
from experiments.paper.stages import (  # noqa: I001
    ROOT,
    arms_of,
    estimate_flops,
    gpu_hours,
    load_config,
    print_estimate,
    stage_groups,
    stage_lm,
    stage_score,
    stage_start,
    stage_train,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--scale", required=True,
                   help="tiny | gpu | paper (experiments/paper/configs/<scale>.json) or a config file's path")
    p.add_argument("--stage", default="all", choices=["all", "start", "groups", "train", "score", "build", "device"],
                   help="all = start, groups, train, score here; build / device / score = the GPU round trip")
    p.add_argument("--out", default=None, help="output folder (default: outputs/paper/<scale>)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="override the config's seeds")
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms (default: the config's)")
    p.add_argument("--returned", default=None, help="--stage score of a device run: the folder its files came to")
    p.add_argument("--dry_run", action="store_true",
                   help="print every command and the GPU-hour estimate (run_log.step_flops), run nothing")
    p.add_argument("--budget_seconds", type=float, default=None,
                   help="--stage device: its wall-clock budget (default: the config's steps.budget_seconds, 540 at the "
                        "gpu scale); arms that would end past it are skipped, and say so in run.json")
    p.add_argument("--compile", default="eager",
                   choices=["eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "auto"],
                   help="--stage device: the mode train.py trains the arms in (train.py --compile); auto = the fastest "
                        "train.py mode at the harness's size in the device check's report (--device_check_report), "
                        "eager without one")
    p.add_argument("--device_check_report", default=None,
                   help="bench.device_check's device_check.json for --compile auto (default: $OUT/device_check.json)")
    p.add_argument("--toy", action="store_true",
                   help="the gpu config's device stage at toy size on a CPU (tests/test_harness.py): same commands, "
                        "tiny model, few steps")
    return p.parse_args(argv)


def run_experiment(exp: dict, out: Path, args) -> dict:
    arms = arms_of(exp, args.arms)
    seeds = args.seeds or exp.get("seeds", [1])
    steps = exp["steps"] if isinstance(exp.get("steps"), int) else None
    print(f"\n=== {exp['name']}: {exp.get('about', '')}\narms: {', '.join(arms)}; seeds {seeds}; out {out}")
    if "revela" in arms:
        exp = {**exp, "lm_path": stage_lm(exp, out, args.dry_run or args.stage in ("score", "build", "device"))}
    if args.dry_run:
        start = stage_start(exp, out, True)
        groups = stage_groups(exp, out, arms, True)
        fit = isinstance(exp.get("steps"), dict)  # the gpu scale: its steps are set on the device
        models = stage_train(exp, out, arms, start, groups, seeds, steps or ("STEPS" if fit else None), True)
        stage_score(exp, out, start, models, True)
        if not fit:
            print_estimate(exp, gpu_hours(exp, arms, seeds, steps))
        else:  # the device stage's plan against its wall-clock budget, and the runs the ledger still misses
            device.print_expected(exp, arms, seeds, args)
            ledger = device.read_ledger(out)
            carried = ledger.get("start") or ("(carried)" if exp["start"].get("carry") else None)
            device.print_next_run(exp, out, {"todo": device.missing_runs(arms, seeds, ledger),
                                             "steps_factor": {a: arm["steps_factor"] for a, arm in arms.items()},
                                             "flops_per_step": {a: estimate_flops(exp, arm)
                                                                for a, arm in arms.items()},
                                             "start_digest": carried}, ledger, args)
        return {}
    missing = [p for p, _ in exp.get("documents", [])] + list(exp["eval"].get("--local_tasks", []))
    missing = [p for p in missing if not os.path.exists(p)]
    if missing and args.stage in ("all", "groups", "score", "build"):
        raise SystemExit(f"{exp['name']}: not found {missing} (the shared data: set XPRT_SHARED_DATA)")
    t0 = time.time()
    stages = {"all": ("start", "groups", "train", "score"), "start": ("start",), "groups": ("groups",),
              "train": ("start", "groups", "train"), "score": ("score",), "build": ("build",),
              "device": ("device",)}[args.stage]
    if "build" in stages:
        return device.build(exp, out, arms, args)
    if "device" in stages:
        return device.run_on_device(exp, out, arms, seeds, args)
    if args.returned:
        device.unpack(Path(args.returned), out)
    start = stage_start(exp, out, args.stage == "score")
    groups = stage_groups(exp, out, arms, args.stage == "score") if "groups" in stages or "train" in stages else {}
    if "train" in stages:
        stage_train(exp, out, arms, start, groups, seeds, steps, False)
    if "score" not in stages:
        return {}
    ledger = device.read_ledger(out)
    if ledger:  # a table built over GPU runs: the arms every seed of which the ledger holds, the rest said missing
        steps_used = sorted({r["steps"] for r in ledger["runs"].values()})
        exp = {**exp, "steps_used": steps_used[0] if len(steps_used) == 1 else steps_used,
               "missing_runs": device.missing_runs(arms, seeds, ledger)}
        back = {a: arm for a, arm in arms.items() if all(f"s{s}/{a}" in ledger["runs"] for s in seeds)}
        if len(back) < len(arms):
            print(f"scoring the {len(back)} arms the ledger holds; missing: {sorted(set(arms) - set(back))}")
        arms = back
    models = {s: {a: str(out / f"s{s}" / a / "model") for a in arms} for s in seeds}
    results, as_start = stage_score(exp, out, start, models, False)
    res = page.write(exp, out, list(arms), results, time.time() - t0, as_start)
    print((out / "results.md").read_text())
    return res


def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args.scale, args.toy)
    os.chdir(ROOT)  # the scripts' paths (data/, configs/) are the repository's; printed commands run from its root
    base = Path(args.out or Path("outputs") / "paper" / cfg["scale"])
    res = {}
    for exp in cfg["experiments"]:
        out = base if len(cfg["experiments"]) == 1 else base / exp["name"]
        res[exp["name"]] = run_experiment(exp, out, args)
    return res


if __name__ == "__main__":
    main()
