"""The gpu scale's round trip to a lent GPU machine (/work/.library/device/README.md): no network there, at most
64 MiB carried with the working tree, at most 8 files of 16 MiB (64 MiB together) brought back; torch, transformers,
accelerate, sentence-transformers, pyarrow there, but no datasets (train.py's load_groups and pretrain_mlm.py read
through it) and no mteb.

  build (here)     the groups (select_groups.py, one folder per ranking), the start's pre-training texts (gzip), the
                   wheels of datasets and the two packages it needs that the machine lacks (dill, multiprocess), all in
                   <out>/carry; its size against the limit; the FLOP count of every arm and the expected GPU minutes
  device (there)   the wheels installed to /tmp/site; the start pre-trained (pretrain_mlm.py); probes of the heaviest
                   and the lightest arm time a step as a + b x FLOPs, so the steps per arm fit the config's seconds;
                   every arm trained;
                   the models packed into $OUT: fp16 safetensors bundles (encoders only: scoring needs no decoder) and
                   one tar.gz of everything else (configs, tokenizers, cards, training logs)
  score (here)     the bundles unpacked into model folders (fp32), then run.py's score stage
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

from support import atomic_write, read_json

MIB = 1 << 20
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
    from experiments.paper import run

    carry = carry_dir(out)
    carry.mkdir(parents=True, exist_ok=True)
    groups = run.stage_groups(exp, carry, arms, False, docs_dir=out)  # the documents stay here
    texts = carry / "texts"
    texts.mkdir(exist_ok=True)
    for src in exp["start"]["flags"]["--inputs"]:
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
    tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=run.ROOT, check=True).stdout
    tree = sum(os.path.getsize(run.ROOT / f) for f in tracked.decode().split("\0") if f and
               os.path.isfile(run.ROOT / f))
    sizes = {"groups": {r: folder_bytes(Path(g)) for r, g in groups.items()}, "texts": folder_bytes(texts),
             "wheels": folder_bytes(wheels), "carry": folder_bytes(carry), "tracked_tree": tree}
    sizes["with_tree"] = sizes["carry"] + tree
    print(f"\ncarried: {carry} {sizes['carry'] / MIB:.1f} MiB (groups "
          f"{sum(sizes['groups'].values()) / MIB:.1f}, texts {sizes['texts'] / MIB:.1f}, wheels "
          f"{sizes['wheels'] / MIB:.1f}) + the tracked tree {tree / MIB:.1f} MiB = {sizes['with_tree'] / MIB:.1f} MiB "
          f"of the {CARRY_BYTES / MIB:.0f} MiB a run may carry")
    if sizes["with_tree"] > CARRY_BYTES:
        raise SystemExit("over the carry limit: fewer documents (the config's 'documents') or fewer rankings")
    plan = {"sizes": sizes, "flops_per_step": {a: run.estimate_flops(exp, arm) for a, arm in arms.items()},
            "steps_factor": {a: arm["steps_factor"] for a, arm in arms.items()}}
    atomic_write(carry / "plan.json", json.dumps(plan, indent=1))
    print_minutes(exp, plan)
    return plan


def print_minutes(exp: dict, plan: dict):
    """Expected GPU minutes per arm under the config's "steps" rule, before any GPU: a step costs the assumed per-step
    overhead ("estimate": "step_overhead_s") plus its FLOPs at each assumed sustained rate (peak x "mfu"). The device
    stage replaces both assumptions by its probes."""
    from experiments.paper import run

    rule, est = exp["steps"], exp.get("estimate", {})
    flops, factor = plan["flops_per_step"], plan["steps_factor"]
    a = est.get("step_overhead_s", 0.0)
    for mfu in est.get("mfu", [0.1, 0.25]):
        rate = est.get("peak_tflops", 989.0) * mfu * 1e12
        arms = {n: {"flags": [], "steps_factor": factor[n]} for n in flops}
        steps = run.fit_steps({**exp, "steps": rule}, arms, [1], lambda f: a + f / rate,
                              flops={n: flops[n] for n in flops})
        print(f"\nat {mfu:.0%} MFU ({rate / 1e12:.0f} TFLOP/s) and {a * 1e3:.0f} ms per step: {steps} steps per arm "
              f"(the rule: all arms in {rule['fit_seconds']} s, within [{rule['min']}, {rule['max']}])")
        total = 0.0
        for n, f in flops.items():
            minutes = steps * factor[n] * (a + f / rate) / 60
            total += minutes
            print(f"  {n:<26}{f / 1e12:8.3f} TFLOP/step x {steps * factor[n]:>6} steps = {minutes:5.2f} min")
        print(f"  {'all arms':<26}{'':>33}{total:5.2f} min")


def install_wheels(carry: Path):
    """datasets & co. from the carried wheels into /tmp/site, for this process and the ones it launches."""
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        return
    site = "/tmp/site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", site, *map(str, sorted((carry / "wheels").glob("*.whl")))], check=True)
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def run_on_device(exp: dict, out: Path, arms: dict, seeds: list, args) -> dict:
    """The one command on the GPU: start, probe, every arm, pack into $OUT (run.json says what happened)."""
    from experiments.paper import run

    t0 = time.time()
    carry = carry_dir(Path(exp.get("carry_from", out)))
    dest = Path(os.environ.get("OUT") or out / "returned")
    dest.mkdir(parents=True, exist_ok=True)
    install_wheels(carry)
    from importlib.metadata import version

    print("versions: " + ", ".join(f"{m} {version(m)}" for m in ("torch", "transformers", "accelerate", "pyarrow",
                                                                "datasets")), flush=True)
    clock = {"setup": time.time() - t0}
    # the start: the carried texts unpacked, then masked-language-model pre-training on this machine
    texts = out / "texts"
    texts.mkdir(parents=True, exist_ok=True)
    inputs = []
    for src in exp["start"]["flags"]["--inputs"]:
        path = texts / f"{Path(src).parent.name}.jsonl"
        with gzip.open(carry / "texts" / f"{path.name}.gz", "rb") as f, open(path, "wb") as g:
            shutil.copyfileobj(f, g)
        inputs.append(str(path))
    start_exp = {**exp, "start": {**exp["start"], "flags": {**exp["start"]["flags"], "--inputs": inputs}}}
    start = run.stage_start(start_exp, out, False)
    clock["start"] = time.time() - t0 - sum(clock.values())
    groups = {r: str(carry / ("groups" if r == "rrf" else f"groups_{r}"))
              for r in {a["ranking"] for a in arms.values()}}
    # the probes: the heaviest and the lightest arm for a few steps each; their second logging windows (after the
    # warm-up) give a step's time as a + b x FLOPs (a: the per-step cost a small model's step pays whatever its FLOPs)
    rule = exp["steps"]
    flops = {a: run.estimate_flops(exp, arm) for a, arm in arms.items()}
    probes = {}
    for name in dict.fromkeys([max(flops, key=flops.get), min(flops, key=flops.get)]):
        probe = out / f"probe_{name}"
        argv = run.train_argv(exp, {**arms[name], "steps_factor": 1}, start, groups, seeds[0], rule["probe_steps"],
                              probe)
        run.run_script(exp, "train", argv + ["--no_save_model", "--logging_steps", str(rule["probe_steps"] // 2)],
                       False)
        rec = [json.loads(line) for line in open(probe / "train_log.jsonl")][-1]
        probes[name] = {"time_per_step_s": rec["time_per_step_s"], "tflops_per_s": rec.get("tflops_per_s"),
                        "estimated_tflop_per_step": flops[name] / 1e12}
    (hi, p_hi), (lo, p_lo) = list(probes.items())[0], list(probes.items())[-1]
    b = (p_hi["time_per_step_s"] - p_lo["time_per_step_s"]) / max(flops[hi] - flops[lo], 1.0) if hi != lo else 0.0
    b = max(b, 0.0) or p_hi["time_per_step_s"] / flops[hi]
    a = max(p_hi["time_per_step_s"] - b * flops[hi], 0.0)
    steps = run.fit_steps(exp, arms, seeds, lambda f: a + b * f)
    clock["probe"] = time.time() - t0 - sum(clock.values())
    print(f"probes {json.dumps(probes)}: a step takes {a * 1e3:.1f} ms + FLOPs at {1 / b / 1e12:.3g} TFLOP/s -> "
          f"{steps} steps per arm to fit {rule['fit_seconds']} s", flush=True)
    models = run.stage_train(exp, out, arms, start, groups, seeds, steps, False)
    clock["train"] = time.time() - t0 - sum(clock.values())
    folders = {"start": Path(start), **{f"s{s}/{a}": Path(m) for s, ms in models.items() for a, m in ms.items()}}
    packed = pack(folders, out, dest)
    clock["pack"] = time.time() - t0 - sum(clock.values())
    report = {"steps_per_arm": steps, "probes": probes, "step_time_model": {"a_s": a, "tflops_per_s": 1 / b / 1e12},
              "seconds": clock, "arms": list(arms), "seeds": seeds, **packed}
    atomic_write(dest / "run.json", json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


def pack(folders: dict, out: Path, dest: Path) -> dict:
    """Model folders -> dest/models_<k>.safetensors (each encoder's tensors in fp16, named "<folder>::<tensor>", as
    many bundles as the return limits allow) and dest/folders.tar.gz (every other file of each folder, the training
    logs beside them). A model whose tensors do not fit is left out whole and named in "not_returned"."""
    import torch
    from safetensors.torch import load_file, save_file

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
    bundles, current, size, returned, left = [], {}, 0, [], []
    for name, folder in folders.items():
        tensors = {f"{folder.relative_to(out)}::{k}": v.to(torch.float16) if v.is_floating_point() else v
                   for k, v in load_file(str(folder / "model.safetensors")).items()}
        need = sum(v.numel() * v.element_size() for v in tensors.values())
        if size + need > RETURN["file_bytes"] and current:
            bundles.append(current)
            current, size = {}, 0
        used = sum(sum(v.numel() * v.element_size() for v in b.values()) for b in bundles) + size
        if need > RETURN["file_bytes"] or len(bundles) >= room["files"] or used + need > room["total"]:
            left.append(name)
            continue
        current.update(tensors)
        size += need
        returned.append(name)
    if current:
        bundles.append(current)
    for k, b in enumerate(bundles, 1):
        save_file({n: v.contiguous() for n, v in b.items()}, str(dest / f"models_{k}.safetensors"))
    return {"returned": returned, "not_returned": left, "bundles": len(bundles),
            "bytes": {p.name: p.stat().st_size for p in sorted(dest.iterdir())}}


def unpack(returned: Path, out: Path):
    """The device's files -> model folders under out (fp32 weights, as train.py saves them), logs beside them."""
    import torch
    from safetensors.torch import load_file, save_file

    report = read_json(returned / "run.json")
    with tarfile.open(returned / "folders.tar.gz", "r:gz") as tar:
        tar.extractall(out, filter="data")
    per_model = {}
    for bundle in sorted(returned.glob("models_*.safetensors")):
        for key, v in load_file(str(bundle)).items():
            folder, _, name = key.partition("::")
            per_model.setdefault(folder, {})[name] = v.to(torch.float32) if v.is_floating_point() else v
    for folder, tensors in per_model.items():
        save_file(tensors, str(out / folder / "model.safetensors"))
    if report["not_returned"]:
        raise SystemExit(f"the device run could not bring back {report['not_returned']}: score the rest with --arms")
    print(f"unpacked {len(per_model)} models from {returned} into {out} (steps per arm {report['steps_per_arm']})")
    atomic_write(out / "device_run.json", json.dumps(report, indent=1))
