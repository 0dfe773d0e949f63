"""The gpu scale's round trip to a lent GPU machine (/work/.library/device/README.md): no network there, at most
64 MiB carried with the working tree, at most 8 files of 16 MiB (64 MiB together) brought back; torch, transformers,
accelerate, sentence-transformers, pyarrow there, but no datasets (train.py's load_groups and pretrain_mlm.py read
through it) and no mteb.

  build (here)     the groups (select_groups.py, one folder per ranking, selected here; the carry holds those of
                   the next missing runs' rankings that fit), the pre-training texts (gzip) of a start or a language
                   model made there, a carried start or language model (packed as pack writes models), the wheels of
                   datasets and the two packages it needs that the machine lacks (dill, multiprocess), all in
                   <out>/carry; its size against the limit; the FLOP count of every arm and the expected GPU minutes
  device (there)   the wheels installed to /tmp/site; the start pre-trained (pretrain_mlm.py) or restored from the
                   carry, Revela's language model likewise (pretrain_mlm.py --causal); probes of the heaviest and the
                   lightest arm time a step as a + b x FLOPs, which plans the arms against the clock and what can come
                   back; every planned arm trained;
                   the models packed into $OUT: fp16 safetensors bundles (encoders only: scoring needs no decoder; a
                   large tensor in row slices, a model over several files) and one tar.gz of everything else
                   (configs, tokenizers, cards, training logs)
  score (here)     the bundles unpacked into model folders (fp32), each returned run added to the ledger, then
                   run.py's score stage over every run the ledger holds

One comparison is built over several short GPU runs (the ledger, <out>/ledger.json): each run returned is recorded
with its arm, seed, steps, the start's, the language model's and the groups' content digests and the code; `build`
carries the start the first run made or the config names (so every arm of the table starts from the same bytes) and
plans the next run to train only what is missing, at the steps per arm the config fixes (its "steps": {"per_arm"}, set
from measured step times, never
re-fitted per run); `score` refuses a run whose start or groups differ from the ledger's.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from experiments.paper import stages
from plumbing.common import atomic_write, read_json

MIB = 1 << 20
START_PACKED = "start_packed"  # <carry>/start_packed: the start a run carries, as pack writes it
LM_PACKED = "lm_packed"  # <carry>/lm_packed: Revela's language model, made by an earlier run, carried the same way
# the machine's limits on what comes back, with room for the safetensors headers
RETURN = {"files": 8, "file_bytes": 16 * MIB - 64 * 1024, "total_bytes": 64 * MIB - 256 * 1024}
CARRY_BYTES = 64 * MIB
WHEELS = ("datasets", "dill", "multiprocess")  # what train.py and pretrain_mlm.py import that the machine lacks


def carry_dir(out: Path) -> Path:
    return out / "carry"


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def build(exp: dict, out: Path, arms: dict, args) -> dict:
    """Everything the device stage needs that the repository does not hold, in <out>/carry (git ignores outputs/)."""
    carry = carry_dir(out)
    carry.mkdir(parents=True, exist_ok=True)
    selected = stages.stage_groups(exp, out, arms, False)  # every ranking the arms need, selected here
    texts = carry / "texts"
    texts.mkdir(exist_ok=True)
    for src in dict.fromkeys(pretraining_inputs(exp)):  # a start (or Revela's LM) pre-trained there: its texts
        dest = texts / f"{Path(src).parent.name}.jsonl.gz"
        if not dest.is_file():
            with open(src, "rb") as f, gzip.open(dest, "wb", compresslevel=9) as g:
                shutil.copyfileobj(f, g)
    wheels = carry / "wheels"
    wheels.mkdir(exist_ok=True)
    if args.toy:  # the CPU dry run has datasets, and the tests no registry
        print("toy: no wheels")
    elif not any(wheels.glob("*.whl")):
        from importlib.metadata import version

        pins = [f"{w}=={version(w)}" for w in WHEELS]
        print("+ pip download " + " ".join(pins))
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "-d",
                        str(wheels), *pins], check=True)
    ledger, start_digest = read_ledger(out), None
    if ledger.get("start") or exp["start"].get("carry"):
        # the start carried, in fp16 (its values are fp16 ones: round_to_fp16): the first run's, so every later arm
        # starts from the same bytes, or a named model the device cannot fetch (all-MiniLM-L6-v2 standing in for E5)
        start = out / "start" if ledger.get("start") else Path(stages.stage_start(exp, out, False))
        carry_packed(out, "start", carry / START_PACKED)
        start_digest = ledger.get("start") or tensors_digest(start)
    if ledger.get("lm"):  # Revela's language model, made by an earlier run: every Revela arm trains through it
        carry_packed(out, "lm", carry / LM_PACKED)
    tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=stages.ROOT, check=True).stdout
    tree = sum(os.path.getsize(stages.ROOT / f) for f in tracked.decode().split("\0") if f and
               os.path.isfile(stages.ROOT / f))
    # the groups of the rankings the next run trains, as many as the carry holds beside the rest (a ranking's groups
    # folder is tens of MB at the gpu scale: each run carries what its arms read, later runs the others)
    seeds = getattr(args, "seeds", None) or exp.get("seeds", [1])
    missing = missing_runs(arms, seeds, ledger)
    for old in [p for p in carry.iterdir() if p.name == "groups" or p.name.startswith("groups_")]:
        shutil.rmtree(old)
    group_bytes = {r: folder_bytes(Path(g)) for r, g in selected.items()}
    room = CARRY_BYTES - folder_bytes(carry) - tree
    carried = carried_rankings(missing, arms, group_bytes, room)
    for r in carried:
        shutil.copytree(selected[r], carry / Path(selected[r]).name)
    groups = {r: str(carry / Path(selected[r]).name) for r in carried}
    sizes = {"groups": {r: folder_bytes(Path(g)) for r, g in groups.items()}, "groups_selected": group_bytes,
             "room_for_groups": room, "texts": folder_bytes(texts),
             "start": folder_bytes(carry / START_PACKED) if (carry / START_PACKED).is_dir() else 0,
             "lm": folder_bytes(carry / LM_PACKED) if (carry / LM_PACKED).is_dir() else 0,
             "wheels": folder_bytes(wheels), "carry": folder_bytes(carry), "tracked_tree": tree}
    sizes["with_tree"] = sizes["carry"] + tree
    print(f"\ncarried: {carry} {sizes['carry'] / MIB:.1f} MiB (groups {sum(sizes['groups'].values()) / MIB:.1f}, "
          f"start {sizes['start'] / MIB:.1f}, texts {sizes['texts'] / MIB:.1f}, wheels "
          f"{sizes['wheels'] / MIB:.1f}) + the tracked tree {tree / MIB:.1f} MiB = {sizes['with_tree'] / MIB:.1f} MiB "
          f"of the {CARRY_BYTES / MIB:.0f} MiB a run may carry")
    if sizes["with_tree"] > CARRY_BYTES or (missing and not carried):
        raise SystemExit("over the carry limit: fewer documents (the config's 'documents') for a smaller groups "
                         "folder")
    plan = {"sizes": sizes, "flops_per_step": {a: stages.estimate_flops(exp, arm) for a, arm in arms.items()},
            "steps_factor": {a: arm["steps_factor"] for a, arm in arms.items()},
            "ranking": {a: arm["ranking"] for a, arm in arms.items()}}
    # the runs this carry can train (their groups are in it); the others wait for a build that carries theirs
    plan["todo"] = [r for r in missing if arms[r.split("/", 1)[1]]["ranking"] in carried]
    plan["later"] = [r for r in missing if r not in plan["todo"]]
    plan["missing"] = missing
    if start_digest:
        plan["start_digest"] = start_digest
    atomic_write(carry / "plan.json", json.dumps(plan, indent=1))
    print_minutes(exp, plan)
    print_next_run(exp, out, plan, ledger, args)
    return plan


def carry_packed(out: Path, name: str, dest: Path):
    """out/<name> (a model folder) packed into dest as pack packs a run's models; the device restores it with
    unpack_folders."""
    dest.mkdir(exist_ok=True)
    if pack({name: out / name}, out, dest)["not_returned"]:
        raise SystemExit(f"{out / name}: over the limits of a packed folder ({RETURN}): it cannot be carried")

def carried_rankings(todo: list, arms: dict, group_bytes: dict, room: int) -> list:
    """The rankings whose groups one run carries: those of the missing runs, in their order, while their folders
    fit the room the rest of the carry leaves."""
    carried, used = [], 0
    for run in todo:
        r = arms[run.split("/", 1)[1]]["ranking"]
        if r not in carried and used + group_bytes[r] <= room:
            carried.append(r)
            used += group_bytes[r]
    return carried

def pretraining_inputs(exp: dict) -> list:
    """The texts a run pre-trains on (its MLM start's, Revela's causal LM's): carried gzipped, unpacked there."""
    return [*exp["start"].get("flags", {}).get("--inputs", []),
            *(exp.get("lm") or {}).get("flags", {}).get("--inputs", [])]

def makes_lm(exp: dict, todo, ledger: dict) -> bool:
    """Whether a run with these "s<seed>/<arm>" runs to do makes Revela's language model: a Revela arm among them,
    a language model the config has made on the GPU ("pretrain_clm"), and none in the ledger yet."""
    return ((exp.get("lm") or {}).get("kind") == "pretrain_clm" and not ledger.get("lm")
            and any(r.endswith("/revela") for r in todo))


def print_next_run(exp: dict, out: Path, plan: dict, ledger: dict, args):
    """What the next GPU runs will do: the runs still missing, at the config's fixed steps and its measured step
    times ("steps": {"per_arm", "step_seconds"}), packed in order into runs of the budget (the first also makes the
    start); how many runs they need; a run longer than a whole run's budget, said as such; and the one command."""
    rule, est = exp["steps"], exp.get("estimate", {})
    per_arm = rule.get("per_arm") or rule.get("min", 0)
    startup, budget = est.get("run_startup_s", 15.0), budget_of(exp, args)
    room = budget - PACK_RESERVE_S
    # a run brings back at most `capacity` models (the return limits, models_per_run); the first also its start
    capacity, model_mib = models_per_run(exp), encoder_bytes(exp) / MIB
    runs, too_long = [[]], []
    used = 0.0 if plan.get("start_digest") else est.get("start_s", 120.0)  # the first run makes the start
    held, lm_made = (0 if plan.get("start_digest") else 1), False
    # a run carries the groups of its arms' rankings, within the room build measured (unknown in a dry run: the
    # groups are not selected yet, so not counted)
    sizes = plan.get("sizes", {})
    group_bytes, room_bytes = sizes.get("groups_selected"), sizes.get("room_for_groups")
    rankings = set()
    for run in plan.get("missing", plan["todo"]):
        arm = run.split("/", 1)[1]
        r = plan.get("ranking", {}).get(arm, "rrf")
        over = bool(group_bytes) and r not in rankings and sum(group_bytes[x] for x in rankings | {r}) > room_bytes
        secs = startup + per_arm * plan["steps_factor"][arm] * step_seconds(exp, arm, plan["flops_per_step"][arm])
        lm = int(not lm_made and makes_lm(exp, [run], ledger))  # the run that makes Revela's LM returns it too
        secs += lm * est.get("lm_s", 90.0)
        if secs > room:  # no run can hold it (a later run carries the start: its whole budget is the arms')
            too_long.append(f"{run} ({secs:.0f} s)")
            continue
        if used + secs > room or held + 1 + lm > capacity or over:
            runs.append([])
            used, held, rankings = 0.0, 0, set()  # later runs carry the start
        runs[-1].append(f"{run} ~{secs / 60:.1f} min" + (" (and its language model)" if lm else ""))
        used += secs
        held += 1 + lm
        rankings.add(r)
        lm_made = lm_made or bool(lm)
    runs = [r for r in runs if r]
    missing = plan.get("missing", plan["todo"])
    print(f"\nthe ledger ({out / LEDGER}): {len(ledger.get('runs', {}))} runs returned; missing "
          f"{len(missing)}: {', '.join(missing) or 'none'}")
    if plan.get("later"):
        print(f"this build carries the groups of {len(plan['todo'])} of them; a later build carries the others' "
              f"({', '.join(plan['later'])})")
    if not missing:
        return
    print(f"at {per_arm} steps per arm and the step times of {step_seconds_source(exp)}; at most {capacity} models "
          f"of {model_mib:.1f} MiB (fp16) come back from one run: {len(runs)} GPU run(s) of {budget:.0f} s for "
          f"{sum(map(len, runs))} of them")
    for k, r in enumerate(runs, 1):
        print(f"  run {k}: " + ", ".join(r))
    if too_long:
        print(f"  longer than one run's {room:.0f} s at this step time (a faster step, issue 42, or fewer steps): "
              + ", ".join(too_long))
    if runs:
        print(f"next GPU run: python3 -m experiments.paper.run --scale {exp.get('scale', 'gpu')} --stage device, "
              f"which brings back {'' if plan.get('start_digest') else 'the start model and '}the models of run 1 "
              "(fp16, at most 8 files); then here: --stage score --returned DIR")


def step_seconds(exp: dict, arm: str, flops: float) -> float:
    """One step of `arm` on the GPU, in seconds: measured ("steps": {"step_seconds"}), else from the config's fit
    of measured steps ("steps": {"step_time_fit": {"a_s", "tflops_per_s"}}: a + FLOPs / rate, for a model no GPU
    has run yet), else 0.3 s (an assumption, said by step_seconds_source)."""
    rule = exp["steps"]
    if arm in rule.get("step_seconds", {}):
        return rule["step_seconds"][arm]
    fit = rule.get("step_time_fit")
    return fit["a_s"] + flops / (fit["tflops_per_s"] * 1e12) if fit else 0.3

def step_seconds_source(exp: dict) -> str:
    rule = exp["steps"]
    said = [rule.get("step_seconds_source"), (rule.get("step_time_fit") or {}).get("source")]
    return "; and ".join(s for s in said if s) or "an assumed 0.3 s (nothing measured)"

def encoder_bytes(exp: dict) -> int:
    """The fp16 bytes of the start's encoder (what pack brings back of each model), from its config's shapes."""
    import torch
    from transformers import BertModel

    with torch.device("meta"):
        return 2 * sum(p.numel() for p in BertModel(stages.model_config(exp)).parameters())

def models_per_run(exp: dict) -> int:
    """How many encoders of this size one run brings back within RETURN (pack fills its files in order; the tar.gz
    of configs and logs and run.json take a file each, and about a MiB)."""
    size, files, total = encoder_bytes(exp), RETURN["files"] - 2, RETURN["total_bytes"] - 2 * MIB
    n = 0
    while (n + 1) * size <= total and -(-(n + 1) * size // RETURN["file_bytes"]) <= files:
        n += 1
    return n


# ----------------------------------------------------------------------------------------------------------------
# The ledger: what came back from each GPU run
# ----------------------------------------------------------------------------------------------------------------
LEDGER = "ledger.json"

def read_ledger(out: Path) -> dict:
    """<out>/ledger.json: {"start": its digest, "lm": Revela's LM's, "groups": {ranking: digest}, "code", "runs":
    {"s<seed>/<arm>": {"steps", "returned_from", "start", "groups", "code"}}}; {} before any run came back."""
    return read_json(out / LEDGER)

def missing_runs(arms: dict, seeds: list, ledger: dict) -> list:
    """The "s<seed>/<arm>" runs of the table the ledger does not hold yet, in the config's order (xPRT first)."""
    return [f"s{seed}/{a}" for seed in seeds for a in arms if f"s{seed}/{a}" not in ledger.get("runs", {})]

def tensors_digest(folder: Path) -> str:
    """sha256 over a model folder's model.safetensors tensors (names, dtypes, shapes, bytes), so two files written
    with other metadata but the same weights have one digest."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(Path(folder) / "model.safetensors")).items()):
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def record_returned(out: Path, returned: Path, report: dict) -> dict:
    """Add a returned GPU run's finished runs to the ledger, refusing one whose start (tensors_digest) or groups
    (their content) differ from the ledger's: a table compares trainings from one start on one groups folder.
    A run already in the ledger is kept as it was (its first return)."""
    ledger = read_ledger(out) or {"runs": {}}
    start, groups = report.get("start_digest"), report.get("groups_digests", {})
    if ledger.get("start") and start and start != ledger["start"]:
        raise SystemExit(f"{returned}: its arms started from another start model (digest {start[:12]}) than the "
                         f"ledger's ({ledger['start'][:12]}): build the next run here (it carries the start)")
    for ranking, digest in groups.items():
        if ledger.get("groups", {}).get(ranking, digest) != digest:
            raise SystemExit(f"{returned}: its {ranking} groups differ from the ledger's")
    lm = report.get("lm_digest")
    if ledger.get("lm") and lm and lm != ledger["lm"]:
        raise SystemExit(f"{returned}: its Revela arms trained through another language model (digest {lm[:12]}) "
                         f"than the ledger's ({ledger['lm'][:12]}): build the next run here (it carries the model)")
    ledger.setdefault("start", start)
    if lm:
        ledger.setdefault("lm", lm)
    ledger.setdefault("groups", {}).update(groups)
    for run in report.get("finished", []):
        ledger["runs"].setdefault(run, {"steps": report.get("steps_per_arm"), "returned_from": str(returned),
                                        "start": start, "groups": groups, "code": report.get("code")})
    atomic_write(out / LEDGER, json.dumps(ledger, indent=1))
    return ledger


def print_minutes(exp: dict, plan: dict):
    """Expected GPU minutes per arm under the config's "steps" rule, before any GPU: a step costs the assumed per-step
    overhead ("estimate": "step_overhead_s") plus its FLOPs at each assumed sustained rate (peak x "mfu"). The device
    stage replaces both assumptions by its probes."""
    rule, est = exp["steps"], exp.get("estimate", {})
    flops, factor = plan["flops_per_step"], plan["steps_factor"]
    a = est.get("step_overhead_s", 0.0)
    for mfu in est.get("mfu", [0.1, 0.25]):
        rate = est.get("peak_tflops", 989.0) * mfu * 1e12
        arms = {n: {"flags": [], "steps_factor": factor[n]} for n in flops}
        steps = rule.get("per_arm") or stages.fit_steps({**exp, "steps": rule}, arms, [1], lambda f: a + f / rate,
                                                        flops={n: flops[n] for n in flops})
        how = ("the config's fixed steps per arm" if rule.get("per_arm") else
               f"the rule: all arms in {rule['fit_seconds']} s, within [{rule['min']}, {rule['max']}]")
        print(f"\nat {mfu:.0%} MFU ({rate / 1e12:.0f} TFLOP/s) and {a * 1e3:.0f} ms per step: {steps} steps per arm "
              f"({how})")
        total = 0.0
        for n, f in flops.items():
            minutes = steps * factor[n] * (a + f / rate) / 60
            total += minutes
            print(f"  {n:<26}{f / 1e12:8.3f} TFLOP/step x {steps * factor[n]:>6} steps = {minutes:5.2f} min")
        print(f"  {'all arms':<26}{'':>33}{total:5.2f} min")


def install_wheels(carry: Path):
    """datasets & co. from the carried wheels into a site folder (no dependency resolution: the machine's packages
    stand), for this process and the ones it launches."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("datasets") is not None:
        return
    site = str(Path(tempfile.gettempdir()) / "xprt_site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", site, *map(str, sorted((carry / "wheels").glob("*.whl")))], check=True)
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def budget_of(exp: dict, args) -> float:
    """The device stage's wall-clock budget in seconds: --budget_seconds, else the config's "steps": {"budget_seconds"}
    (the gpu scale: 540, the 10-minute command less a margin for the transfers)."""
    return float(getattr(args, "budget_seconds", None) or exp["steps"].get("budget_seconds", 540))


def plan_arms(exp: dict, arms: dict, seeds: list, flops: dict, a: float, b: float, startup: float,
              left: float, todo=None, capacity: int = None) -> dict:
    """The arms' plan against the time left: steps per arm (the config's fixed "steps": {"per_arm"}, the same in
    every run of one table; else its rule, "fit_seconds" shortened to what is left after each run's start-up), each
    run's expected seconds (startup + steps x (a + b x FLOPs)) and its expected end; a run that would end past the
    budget is planned out, with the reason. Arms run in the config's order (xPRT first), so what a short budget
    drops is the last arms. todo: only these "s<seed>/<arm>" runs (the ledger's missing ones). capacity: the models
    this run can bring back (models_per_run, less the start when it comes back too); the runs past it are planned
    out, since their models would not come back."""
    runs = [(seed, name) for seed in seeds for name in arms if todo is None or f"s{seed}/{name}" in todo]
    rule = dict(exp["steps"])
    if rule.get("per_arm"):
        steps = rule["per_arm"]
    else:
        rule["fit_seconds"] = max(0.0, min(rule["fit_seconds"], left - startup * len(runs)))
        steps = stages.fit_steps({**exp, "steps": rule}, arms, seeds, lambda f: a + b * f, flops=flops)
    plan, end, skipped = [], 0.0, {}
    for seed, name in runs:
        secs = startup + steps * arms[name]["steps_factor"] * (a + b * flops[name])
        key = f"s{seed}/{name}"
        if capacity is not None and len(plan) >= capacity:
            skipped[key] = (f"planned out: one run brings back {capacity} such model(s) "
                            f"({encoder_bytes(exp) / MIB:.1f} MiB each in fp16) besides what it returns already")
            continue
        if end + secs > left:
            skipped[key] = (f"planned out: expected {secs:.0f} s ({steps * arms[name]['steps_factor']} steps), "
                            f"{max(left - end, 0):.0f} s of the budget left after the arms before it")
            continue
        end += secs
        plan.append({"run": key, "seed": seed, "arm": name, "steps": steps * arms[name]["steps_factor"],
                     "expected_s": round(secs, 1), "expected_end_s": round(end, 1)})
    return {"steps_per_arm": steps, "runs": plan, "skipped": skipped}


def print_plan(plan: dict, t_plan: float, budget: float):
    print(f"plan: {plan['steps_per_arm']} steps per arm, budget {budget:.0f} s, planned at {t_plan:.0f} s", flush=True)
    for r in plan["runs"]:
        end = t_plan + r["expected_end_s"]
        print(f"  {r['run']:<32}{r['steps']:>7} steps  ~{r['expected_s']:7.1f} s  ends ~{end:6.0f} s", flush=True)
    by_reason = {}
    for k, why in plan["skipped"].items():  # runs planned out for one reason, said once
        by_reason.setdefault(why, []).append(k)
    for why, runs in by_reason.items():
        print(f"  {', '.join(runs) if len(runs) < 4 else f'{runs[0]} and {len(runs) - 1} more':<31} skipped: {why}",
              flush=True)


def print_expected(exp: dict, arms: dict, seeds: list, args, stop_at: float = 300.0):
    """Before any GPU (--dry_run): the device stage's plan under the config's assumptions ("estimate": per-step
    overhead, MFU, the start's and each run's start-up seconds), with each run's expected end, and what a stop at
    `stop_at` seconds would bring back (every run that ended before it; the start model always). The device replaces
    the assumptions by its probes."""
    est = exp.get("estimate", {})
    budget = budget_of(exp, args)
    flops = {n: stages.estimate_flops(exp, arm) for n, arm in arms.items()}
    a, startup = est.get("step_overhead_s", 0.0), est.get("run_startup_s", 15.0)
    for mfu in est.get("mfu", [0.1, 0.25]):
        b = 1.0 / (est.get("peak_tflops", 989.0) * 1e12 * mfu)
        # before the arms: set-up and the start's pre-training, then the two probes
        probes = 2 * (startup + exp["steps"]["probe_steps"] * (a + b * max(flops.values())))
        t_plan = est.get("start_s", 120.0) + probes
        plan = plan_arms(exp, arms, seeds, flops, a, b, startup, budget - t_plan - PACK_RESERVE_S,
                         capacity=models_per_run(exp) - (0 if exp["start"].get("carry") else 1))
        print(f"\nat {mfu:.0%} MFU, {a * 1e3:.0f} ms per step, {startup:.0f} s to start a run, the start model ready "
              f"at ~{est.get('start_s', 120.0):.0f} s, the probes done at ~{t_plan:.0f} s (assumed, not measured):")
        print_plan(plan, t_plan, budget)
        back = [r["run"] for r in plan["runs"] if t_plan + r["expected_end_s"] <= stop_at]
        start = "" if exp["start"].get("carry") else "the start model and "
        print(f"  stopped at {stop_at:.0f} s: {start}{len(back)} arms come back ({', '.join(back)})")


def run_on_device(exp: dict, out: Path, arms: dict, seeds: list, args) -> dict:
    """The one command on the GPU: start, probe, plan the arms against the wall-clock budget, run them; each finished
    model (the start first) goes to $OUT at once, with run.json saying what came back, what was skipped and why, so a
    run stopped at its limit still brings back every arm it finished."""
    t0 = time.time()
    budget = budget_of(exp, args)
    carry = carry_dir(Path(exp.get("carry_from", out)))
    dest = Path(os.environ.get("OUT") or out / "returned")
    dest.mkdir(parents=True, exist_ok=True)
    install_wheels(carry)
    from importlib.metadata import version

    print("versions: " + ", ".join(f"{m} {version(m)}" for m in ("torch", "transformers", "accelerate", "pyarrow",
                                                                "datasets")), flush=True)
    clock = {"setup": time.time() - t0}
    report = {"status": "started", "budget_seconds": budget, "arms": list(arms), "seeds": seeds, "seconds": clock,
              "finished": [], "skipped": {}, "failed": {}}
    mode, why = train_mode(args, dest)
    report["compile"] = {"mode": mode, "why": why}
    print(f"train.py mode: {mode} ({why})", flush=True)
    if mode != "eager":  # every arm of the run in the one mode: a table compares objectives, not modes
        exp = {**exp, "train": {**exp["train"], "--compile": mode}}

    def lap(name):
        clock[name] = round(time.time() - t0 - sum(v for k, v in clock.items() if k != name), 1)

    plan_here = read_json(carry / "plan.json")
    if (carry / START_PACKED).is_dir():  # the table's one start, carried (build): restored in fp32
        unpack_folders(carry / START_PACKED, out)
        start, folders = str(out / "start"), {}
    else:  # the first run: masked-language-model pre-training on this machine, from the carried texts
        start = stages.stage_start(with_carried_texts(exp, "start", carry, out), out, False)
        stages.round_to_fp16(Path(start))
        folders = {"start": Path(start)}
    lap("start")
    from plumbing.training import code_revision, content_digest

    # Revela's language model, where this run trains a Revela arm: carried from the run that made it, else made here
    # as the start is (pre-trained, rounded to fp16) and brought back with the arms
    if "revela" in arms and (exp.get("lm") or {}).get("kind") == "pretrain_clm" and (
            "todo" not in plan_here or any(r.endswith("/revela") for r in plan_here["todo"])):
        if (carry / LM_PACKED).is_dir():
            unpack_folders(carry / LM_PACKED, out)
            lm = out / "lm"
        else:
            lm = Path(stages.stage_lm(with_carried_texts(exp, "lm", carry, out), out, False))
            stages.round_to_fp16(lm)
            folders["lm"] = lm
        exp = {**exp, "lm_path": str(lm)}
        report["lm_digest"] = tensors_digest(lm)
        lap("lm")

    # the groups this run carries (build carries the rankings of the runs it plans; those are the runs trained)
    groups = {r: str(carry / ("groups" if r == "rrf" else f"groups_{r}"))
              for r in {a["ranking"] for a in arms.values()}}
    groups = {r: g for r, g in groups.items() if Path(g).is_dir()}
    report.update({"start_digest": tensors_digest(Path(start)), "code": code_revision(),
                   "groups_digests": {r: content_digest([g], {})["sha256"] for r, g in groups.items()}})
    # build's plan: only the runs the ledger misses whose groups came; without one, every run whose groups came
    report["todo"] = [r for r in plan_here.get("todo", [f"s{seed}/{a}" for seed in seeds for a in arms])
                      if r.split("/", 1)[1] in arms and arms[r.split("/", 1)[1]]["ranking"] in groups]
    if folders:
        report.update(pack(folders, out, dest))
    write_report(dest, report)
    # the probes: the heaviest and the lightest arm for a few steps each; their second logging windows (after the
    # warm-up) give a step's time as a + b x FLOPs (a: the per-step cost a small model's step pays whatever its FLOPs);
    # a probe's wall time beyond its steps is what each train.py run costs to start (load, data, save)
    rule = exp["steps"]
    flops = {a: stages.estimate_flops(exp, arm) for a, arm in arms.items()}
    probes, startup = {}, []
    # the probes among the arms this run trains (build's todo), so a run of one missing arm probes that arm only
    todo_arms = {a for a in arms if any(r.endswith(f"/{a}") for r in report["todo"])}
    pick = {a: f for a, f in flops.items() if a in todo_arms} or flops
    for name in dict.fromkeys([max(pick, key=pick.get), min(pick, key=pick.get)]):
        probe = out / f"probe_{name}"
        argv = stages.train_argv(exp, {**arms[name], "steps_factor": 1}, start, groups, seeds[0], rule["probe_steps"],
                              probe)
        tp = time.time()
        stages.run_script(exp, "train", argv + ["--no_save_model", "--logging_steps", str(rule["probe_steps"] // 2)],
                       False)
        rec = [json.loads(line) for line in open(probe / "train_log.jsonl")][-1]
        startup.append(max(time.time() - tp - rec["time_per_step_s"] * rule["probe_steps"], 0.0))
        probes[name] = {"time_per_step_s": rec["time_per_step_s"], "tflops_per_s": rec.get("tflops_per_s"),
                        "estimated_tflop_per_step": flops[name] / 1e12, "wall_s": round(time.time() - tp, 1)}
    (hi, p_hi), (lo, p_lo) = list(probes.items())[0], list(probes.items())[-1]
    b = (p_hi["time_per_step_s"] - p_lo["time_per_step_s"]) / max(flops[hi] - flops[lo], 1.0) if hi != lo else 0.0
    b = max(b, 0.0) or p_hi["time_per_step_s"] / flops[hi]
    a = max(p_hi["time_per_step_s"] - b * flops[hi], 0.0)
    lap("probe")
    t_plan = time.time() - t0
    plan = plan_arms(exp, arms, seeds, flops, a, b, max(startup), budget - t_plan - PACK_RESERVE_S,
                     todo=report.get("todo"), capacity=models_per_run(exp) - len(folders))
    print(f"probes {json.dumps(probes)}: a step takes {a * 1e3:.1f} ms + FLOPs at {1 / b / 1e12:.3g} TFLOP/s, a run "
          f"starts in {max(startup):.1f} s", flush=True)
    print_plan(plan, t_plan, budget)
    report.update({"steps_per_arm": plan["steps_per_arm"], "probes": probes, "plan": plan["runs"],
                   "step_time_model": {"a_s": a, "tflops_per_s": 1 / b / 1e12, "startup_s": max(startup)},
                   "skipped": dict(plan["skipped"]), "status": "training"})
    write_report(dest, report)
    for r in plan["runs"]:
        left = budget - (time.time() - t0) - PACK_RESERVE_S
        if r["expected_s"] > left:  # the runs before it took longer than planned
            report["skipped"][r["run"]] = f"expected {r['expected_s']:.0f} s, {max(left, 0):.0f} s of the budget left"
            print(f"skip {r['run']}: {report['skipped'][r['run']]}", flush=True)
            write_report(dest, report)
            continue
        try:
            stages.stage_train(exp, out, {r["arm"]: arms[r["arm"]]}, start, groups, [r["seed"]], plan["steps_per_arm"],
                            False)
        except (Exception, SystemExit) as err:  # one arm's failure costs that arm only
            report["failed"][r["run"]] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"FAILED {r['run']}: {report['failed'][r['run']]}", flush=True)
            write_report(dest, report)
            continue
        folders[r["run"]] = out / r["run"] / "model"
        report.update(pack(folders, out, dest))  # this arm's model and log in $OUT now
        report["finished"].append(r["run"])
        write_report(dest, report)
    lap("train")
    report["status"] = "done"
    write_report(dest, report)
    print(json.dumps(report, indent=1))
    return report


def train_mode(args, dest: Path) -> tuple:
    """The --compile mode the arms train in -> (mode, why). --compile auto reads the device check run before the
    harness in the same GPU session (bench.device_check part 2, its table at the harness's size): the train.py mode
    with the fewest ms a step. Equality with the eager step is the CPU suite's (tests/test_compile.py: every
    objective's logged losses, fp32 and bf16); the check measures speed only. Eager when there is no report."""
    mode = getattr(args, "compile", "eager") or "eager"
    if mode != "auto":
        return mode, "--compile"
    path = Path(getattr(args, "device_check_report", None) or dest / "device_check.json")
    rows = ((read_json(path) or {}).get("loop", {}).get("harness", {}) or {}).get("modes") or {}
    ours = {m: r for m, r in rows.items() if not m.startswith("stock") and r.get("ms_per_step")}
    if not ours:
        return "eager", f"--compile auto: no device check table at the harness's size in {path}"
    best = min(ours, key=lambda m: ours[m]["ms_per_step"])
    return best, (f"--compile auto: the fastest in {path.name} at the harness's size: "
                  + ", ".join(f"{m} {r['ms_per_step']:.1f} ms" for m, r in sorted(ours.items(),
                                                                                key=lambda x: x[1]["ms_per_step"])))


def with_carried_texts(exp: dict, key: str, carry: Path, out: Path) -> dict:
    """exp with its "start" or "lm" pre-training reading the carried texts, unpacked into out/texts."""
    texts = out / "texts"
    texts.mkdir(parents=True, exist_ok=True)
    inputs = []
    for src in exp[key]["flags"]["--inputs"]:
        path = texts / f"{Path(src).parent.name}.jsonl"
        if not path.is_file():
            with gzip.open(carry / "texts" / f"{path.name}.gz", "rb") as f, open(path, "wb") as g:
                shutil.copyfileobj(f, g)
        inputs.append(str(path))
    return {**exp, key: {**exp[key], "flags": {**exp[key]["flags"], "--inputs": inputs}}}


# seconds kept at the end of the budget for the last pack and run.json
PACK_RESERVE_S = 15.0


def write_report(dest: Path, report: dict):
    """dest/run.json, atomically: what is in dest now (run.json is written after the files it names)."""
    atomic_write(dest / "run.json", json.dumps(report, indent=1))


def pack(folders: dict, out: Path, dest: Path) -> dict:
    """Model folders -> dest/models_<k>.safetensors (each encoder's tensors in fp16, named "<folder>::<tensor>", a
    tensor over half a file's limit in row slices "<folder>::<tensor>::<j>/<parts>", as many bundles as the return
    limits allow) and dest/folders.tar.gz (every other file of each folder, the training
    logs beside them). A model whose tensors do not fit is left out whole and named in "not_returned". Called again
    after each arm with every folder so far: each file is replaced atomically, so what dest holds is always whole."""
    import torch
    from safetensors.torch import load_file, save_file

    from plumbing.common import atomic_path

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, folder in folders.items():
            for f in sorted(folder.rglob("*")):
                if f.is_file() and not f.name.endswith(".safetensors"):
                    tar.add(f, arcname=str(f.relative_to(out)))
            for log in ("train_log.jsonl", "loss_curve.png"):
                if (folder.parent / log).is_file():
                    tar.add(folder.parent / log, arcname=str((folder.parent / log).relative_to(out)))
    atomic_write(dest / "folders.tar.gz", buf.getvalue())
    room = {"files": RETURN["files"] - 2, "total": RETURN["total_bytes"] - buf.tell() - 1 * MIB}  # + run.json
    bundles, returned, left = [{}], [], []
    for name, folder in folders.items():
        tensors = {}
        for k, v in load_file(str(folder / "model.safetensors")).items():
            v = v.to(torch.float16) if v.is_floating_point() else v
            # a tensor over one file's limit travels in row slices (MiniLM's word embeddings are 23 MB in fp16)
            parts = -(-v.numel() * v.element_size() // (RETURN["file_bytes"] // 2)) if v.dim() else 1
            for j, piece in enumerate(v.chunk(parts) if parts > 1 else [v]):
                tensors[f"{folder.relative_to(out)}::{k}" + (f"::{j}/{parts}" if parts > 1 else "")] = piece
        # the model's tensors fill the open file and as many more as they need (all-MiniLM-L6-v2 is 45 MB in fp16,
        # over one file's 16 MiB); it comes back whole or not at all: a trial placement, kept only if it fits
        trial = [dict(b) for b in bundles]
        for key, v in tensors.items():
            if bundle_bytes(trial[-1]) + v.numel() * v.element_size() > RETURN["file_bytes"] and trial[-1]:
                trial.append({})
            trial[-1][key] = v
        if (any(bundle_bytes(b) > RETURN["file_bytes"] for b in trial) or len(trial) > room["files"]
                or sum(map(bundle_bytes, trial)) > room["total"]):
            left.append(name)
            continue
        bundles = trial
        returned.append(name)
    bundles = [b for b in bundles if b]
    for k, b in enumerate(bundles, 1):
        with atomic_path(dest / f"models_{k}.safetensors") as tmp:
            save_file({n: v.contiguous() for n, v in b.items()}, str(tmp))
    return {"returned": returned, "not_returned": left, "bundles": len(bundles),
            "bytes": {p.name: p.stat().st_size for p in sorted(dest.iterdir()) if p.name != "run.json" and
                      not p.name.startswith(".tmp-")}}


def bundle_bytes(tensors: dict) -> int:
    return sum(v.numel() * v.element_size() for v in tensors.values())


def unpack(returned: Path, out: Path):
    """The device's files -> model folders under out (fp32 weights, as train.py saves them), logs beside them."""
    report = read_json(returned / "run.json")
    per_model = unpack_folders(returned, out)
    missing = {**{k: "over the return limits" for k in report.get("not_returned", [])}, **report.get("skipped", {}),
               **report.get("failed", {})}
    print(f"unpacked {len(per_model)} models from {returned} into {out} (steps per arm {report.get('steps_per_arm')}; "
          f"the device run's status: {report.get('status')})")
    for k, why in missing.items():
        print(f"  not brought back: {k}: {why}")
    for name, key in (("start", "start_digest"), ("lm", "lm_digest")):
        if name in per_model and report.get(key) and tensors_digest(out / name) != report[key]:
            raise SystemExit(f"{returned}: the {name} unpacked here is not the one its arms trained from (digest)")
    atomic_write(out / "device_run.json", json.dumps(report, indent=1))
    ledger = record_returned(out, returned, report)
    print(f"ledger {out / LEDGER}: {len(ledger['runs'])} runs ({', '.join(sorted(ledger['runs']))})")


def unpack_folders(packed: Path, out: Path) -> dict:
    """pack's files (folders.tar.gz and the models_<k>.safetensors bundles) -> the model folders under out, their
    weights in fp32 (as train.py saves them; the values are the fp16 ones) -> {folder: its tensors}. A returned
    run's models here, and on the device the start a run carries."""
    import torch
    from safetensors.torch import load_file, save_file

    with tarfile.open(packed / "folders.tar.gz", "r:gz") as tar:
        tar.extractall(out, filter="data")
    per_model, slices = {}, {}
    for bundle in sorted(packed.glob("models_*.safetensors")):
        for key, v in load_file(str(bundle)).items():
            folder, _, name = key.partition("::")
            v = v.to(torch.float32) if v.is_floating_point() else v
            name, _, part = name.partition("::")  # "<tensor>::<j>/<parts>": a row slice of a large tensor
            if part:
                slices.setdefault((folder, name), {})[int(part.split("/")[0])] = v
            else:
                per_model.setdefault(folder, {})[name] = v
    for (folder, name), pieces in slices.items():
        per_model.setdefault(folder, {})[name] = torch.cat([pieces[j] for j in sorted(pieces)])
    for folder, tensors in per_model.items():
        save_file(tensors, str(out / folder / "model.safetensors"), metadata={"format": "pt"})
    return per_model
