"""The paper's experiments, stage by stage (run.py is their command line): the configs and the arms, the start
model, the groups, training and scoring, and the FLOP count and GPU-hours of a plan. device.py (the GPU round trip)
and page.py (the results page) build on these; nothing here imports them."""
from __future__ import annotations

import importlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from plumbing.common import atomic_write, read_json  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
# The ablations of xPRT (paper Table 3): flags added to the xprt arm, the groups' ranking, a factor on the steps.
ABLATIONS = {
    "no_fill_in": {"flags": ["--no_fill_in"]},
    "random_positive": {"flags": ["--positive", "random"]},
    "e5_ranking": {"ranking": "e5"},
    "tfidf_ranking": {"ranking": "tfidf"},
    # "as much text or more, up to five times the steps": it reads the anchor only, xPRT five passages per group
    "self_reconstruction_5x": {"flags": ["--objective", "self_reconstruction"], "steps_factor": 5},
}


# ----------------------------------------------------------------------------------------------------------------
# Configs and arms
# ----------------------------------------------------------------------------------------------------------------
def load_config(scale: str, toy: bool = False) -> dict:
    """configs/<scale>.json (or a path): {"experiments": [...], shared keys...}; each experiment gets the shared keys
    as defaults, and under --toy the config's "toy" overrides (dicts merged one level down)."""
    path = Path(scale) if scale.endswith(".json") else CONFIGS / f"{scale}.json"
    if not path.is_file():
        raise SystemExit(f"--scale {scale}: no config {path} (have: {sorted(p.stem for p in CONFIGS.glob('*.json'))})")
    # "{shared}" in a config: the shared data folder (../shared/data beside the checkout, or $XPRT_SHARED_DATA)
    shared_data = os.environ.get("XPRT_SHARED_DATA", "../shared/data")  # from the repository root
    cfg = json.loads(path.read_text().replace("{shared}", shared_data))
    shared = {k: v for k, v in cfg.items() if k not in ("experiments", "toy")}
    exps = []
    for e in cfg.get("experiments") or [{}]:
        e = merged(shared, e)
        if toy:
            e = merged(e, cfg.get("toy", {}))
        e.setdefault("name", cfg.get("scale", path.stem))
        e["config_path"] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        exps.append(e)
    return {"scale": cfg.get("scale", path.stem), "path": str(path), "experiments": exps}


def merged(base: dict, over: dict) -> dict:
    """base with over's keys on top; a dict in both is merged one level down (an experiment's "train" flags add to
    the shared ones)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def objective_choices() -> list:
    """train.py --objective's choices, from its parser (never a copy that can drift)."""
    import train

    return list(train.build_parser()._option_string_actions["--objective"].choices)


def arms_of(exp: dict, only=None) -> dict:
    """{arm: {"flags", "ranking", "steps_factor"}}: xprt, the ablations, one arm per other objective train.py offers,
    the config's "extra_arms"; its "arms" ("all", "objectives": no ablations, or a list) picks, "exclude" drops (a
    list, or {arm: why it does not run}, which the page says)."""
    arms = {"xprt": {}}
    arms.update(ABLATIONS)
    # an objective's own flags from the config ("objective_flags": SimLM's --generator_name_or_path; "{start}" is the
    # arms' start model)
    own = exp.get("objective_flags", {})
    arms.update({o: {"flags": ["--objective", o] + argv_of(own.get(o, {}))} for o in objective_choices()
                 if o != "xprt"})
    arms.update(exp.get("extra_arms", {}))  # a config's own variants: {"name": {"flags": [...]}}
    want = exp.get("arms", "all")
    if want in ("all", "objectives"):
        names = [a for a in arms if a not in exp.get("exclude", []) and (want == "all" or a not in ABLATIONS)]
    else:
        names = list(want)
    names = [a for a in names if only is None or a in only]
    unknown = [a for a in names if a not in arms]
    if unknown:
        raise SystemExit(f"{exp['name']}: unknown arms {unknown}; known: {list(arms)}")
    return {a: {"flags": [], "ranking": "rrf", "steps_factor": 1, **arms[a]} for a in names}


def argv_of(flags: dict) -> list:
    """{"--flag": value} -> argv: True -> the bare flag, None / False -> left out, a list -> its items."""
    out = []
    for k, v in flags.items():
        if v is None or v is False:
            continue
        out.append(k)
        if v is not True:
            out.extend(str(x) for x in (v if isinstance(v, list) else [v]))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Running a script: in this process (the tiny scale: no start-up per arm) or through a launcher
# ----------------------------------------------------------------------------------------------------------------
def launcher(exp: dict, script: str) -> str:
    return exp.get("launch", {}).get(script, "inprocess")


def fresh_accelerate():
    """accelerate keeps its state in process-wide singletons: reset them between runs in one process."""
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def run_script(exp: dict, script: str, argv: list, dry_run: bool, log=print):
    """Print the command, then run it: `inprocess` calls the script's main(argv) here, anything else is a command
    prefix (python, accelerate launch --config_file ..., torchrun ...) run from the repository root."""
    how = launcher(exp, script)
    prefix = "python" if how == "inprocess" else how
    log("+ " + " ".join([prefix, f"{script}.py" if "/" not in script else script] + [shlex.quote(a) for a in argv]))
    if dry_run:
        return None
    if how == "inprocess":
        module = importlib.import_module(script.replace("/", ".").removesuffix(".py"))
        fresh_accelerate()  # each run builds its own Accelerator, as a new process would
        try:
            return module.main(argv)
        finally:
            fresh_accelerate()
    path = script if script.endswith(".py") else f"{script}.py"
    subprocess.run(shlex.split(how) + [path] + argv, check=True, cwd=ROOT)
    return None


# ----------------------------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------------------------
def stage_start(exp: dict, out: Path, dry_run: bool) -> str:
    """The start model -> its path or name. kinds: "model" (a name or folder: E5, BERT; with "carry": a copy in
    <out>/start, for a GPU run to carry), "random_bert" (a BERT built
    from a config with a given tokenizer: the tiny scale's stand-in for an MLM start), "pretrain_mlm"
    (experiments/nano/pretrain_mlm.py: a vocabulary and masked-language-model pre-training on the config's texts)."""
    start = exp["start"]
    dest = out / "start"
    if start["kind"] == "model" and start.get("carry"):
        # a start a GPU run carries (that machine fetches nothing): the named model's folder copied here, its weights
        # rounded to fp16, so the fp16 it travels in holds these very values and every arm starts from them
        print(f"+ ({start['name']} copied to {dest}, its weights rounded to fp16)")
        if not dry_run and not (dest / "config.json").is_file():
            import shutil

            from plumbing.common import atomic_path, resolve_model_path

            src = Path(resolve_model_path(start["name"]))
            if not src.is_dir():
                from huggingface_hub import snapshot_download

                src = Path(snapshot_download(start["name"]))
            with atomic_path(dest) as tmp:  # the weights as safetensors only (other formats would travel too)
                shutil.copytree(src, tmp, copy_function=shutil.copyfile,  # not the modes: a package's may be read-only
                                ignore=shutil.ignore_patterns("*.bin", "*.h5", "*.msgpack", "*.ot", "*.onnx", "onnx",
                                                              "openvino"))
                round_to_fp16(tmp)
        return str(dest)
    if start["kind"] == "model":
        return start["name"]
    if start["kind"] == "random_bert":
        print(f"+ (random BERT {start['config']} with {start['tokenizer']}'s vocabulary -> {dest})")
        if not dry_run and not (dest / "config.json").is_file():
            import torch
            from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

            from plumbing.common import resolve_model_path

            tok = AutoTokenizer.from_pretrained(resolve_model_path(start["tokenizer"]))
            torch.manual_seed(start.get("seed", 0))
            BertForMaskedLM(BertConfig(vocab_size=len(tok), **start["config"])).save_pretrained(dest)
            tok.save_pretrained(dest)
        return str(dest)
    if start["kind"] == "pretrain_mlm":
        if dry_run or not (dest / "mlm_stats.json").is_file():
            run_script(exp, "experiments/nano/pretrain_mlm.py",
                       argv_of({**start["flags"], "--output_dir": str(dest), "--overwrite": True}), dry_run)
        return str(dest)
    raise SystemExit(f"{exp['name']}: unknown start kind {start['kind']!r}")


def stage_lm(exp: dict, out: Path, dry_run: bool):
    """Revela's language model, where a config names one as "lm" -> its path or name (None without one). kinds:
    "model" (a name or folder: Qwen/Qwen2.5-0.5B, from the Hub or carried), "pretrain_clm" (pre-trained by
    next-token prediction on the config's texts, experiments/nano/pretrain_mlm.py --causal: the gpu scale's, made on
    the GPU as its MLM start is), "random_causal_lm" (a causal LM built from a config with a given tokenizer: the
    tiny scale's stand-in)."""
    lm = exp.get("lm")
    if not lm:
        return None
    if lm["kind"] == "model":
        return lm["name"]
    dest = out / "lm"
    if lm["kind"] == "pretrain_clm":  # experiments/nano/pretrain_mlm.py --causal: made as the MLM start is
        if dry_run or not (dest / "mlm_stats.json").is_file():
            run_script(exp, "experiments/nano/pretrain_mlm.py",
                       argv_of({**lm["flags"], "--output_dir": str(dest), "--overwrite": True}), dry_run)
        return str(dest)
    print(f"+ (random {lm['architecture']} {lm['config']} with {lm['tokenizer']}'s vocabulary -> {dest})")
    if not dry_run and not (dest / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from plumbing.common import resolve_model_path

        tok = AutoTokenizer.from_pretrained(resolve_model_path(lm["tokenizer"]))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lm.get("seed", 0))
            config = AutoConfig.for_model(lm["architecture"], vocab_size=len(tok), **lm["config"])
            AutoModelForCausalLM.from_config(config).save_pretrained(dest)
        tok.save_pretrained(dest)
    return str(dest)


def stage_groups(exp: dict, out: Path, arms: dict, dry_run: bool, docs_dir: Path = None) -> dict:
    """select_groups.py once per ranking the arms need -> {ranking: groups folder}. A config's "documents" ([[path,
    first N], ...]) become one JSONL input (in docs_dir, default out); otherwise its "selection" flags name the input
    (--dataset ...)."""
    if exp.get("groups_from"):  # another experiment's groups folders (the paper's from-BERT runs read E5's)
        out = out.parent / exp["groups_from"]
    sel = dict(exp["selection"])
    if exp.get("documents"):
        docs = (docs_dir or out) / "train_docs.jsonl"
        print(f"+ (the first documents of {exp['documents']} -> {docs})")
        if not dry_run and not docs.is_file():
            docs.parent.mkdir(parents=True, exist_ok=True)
            lines = []
            for path, n in exp["documents"]:
                with open(ROOT / path if not os.path.isabs(path) else path, encoding="utf-8") as f:
                    lines += [line for _, line in zip(range(n), f)]
            atomic_write(docs, "".join(lines))
        sel["--input"] = str(docs)
    folders = {}
    for ranking in dict.fromkeys(a["ranking"] for a in arms.values()):
        folder = out / ("groups" if ranking == "rrf" else f"groups_{ranking}")
        folders[ranking] = str(folder)
        if dry_run or not (folder / "stats.json").is_file():
            run_script(exp, "select_groups", argv_of({**sel, "--ranking": ranking, "--output_dir": str(folder),
                                                      "--overwrite": True}), dry_run)
    return folders


def train_argv(exp: dict, arm: dict, start: str, groups: dict, seed: int, steps: int, out_dir: Path) -> list:
    """One arm's train.py flags: the shared budget, then the arm's own flags."""
    flags = {"--model_name_or_path": start, "--groups_dir": groups[arm["ranking"]], "--output_dir": str(out_dir),
             **exp["train"], "--seed": seed, "--overwrite": True}
    if steps:
        flags["--max_train_steps"] = steps * arm["steps_factor"]
    elif arm["steps_factor"] != 1:
        flags["--num_train_epochs"] = exp["train"].get("--num_train_epochs", 1) * arm["steps_factor"]
    # "{start}": the arms' start model; "{lm}": the language model Revela trains through (stage_lm)
    return argv_of(flags) + [{"{start}": start, "{lm}": exp.get("lm_path", f)}.get(f, f) for f in arm["flags"]]


def stage_train(exp: dict, out: Path, arms: dict, start: str, groups: dict, seeds: list, steps: int,
                dry_run: bool) -> dict:
    """train.py per arm and seed (a finished one, model/ written, is skipped) -> {seed: {arm: model folder}}."""
    models = {}
    for seed in seeds:
        for name, arm in arms.items():
            run_dir = out / f"s{seed}" / name
            models.setdefault(seed, {})[name] = str(run_dir / "model")
            if dry_run or not (run_dir / "model" / "config.json").is_file():
                t0 = time.time()
                run_script(exp, "train", train_argv(exp, arm, start, groups, seed, steps, run_dir), dry_run)
                if not dry_run:
                    with open(out / "wall_seconds.jsonl", "a") as f:
                        f.write(json.dumps({"seed": seed, "arm": name, "seconds": round(time.time() - t0, 1)}) + "\n")
    return models


def stage_score(exp: dict, out: Path, start: str, models: dict, dry_run: bool) -> tuple:
    """evaluate.py per seed, twice: every model scored as it is used (its own pooling, similarity, prefixes: an arm's
    setting is part of what it is), and every model scored as the start is (--score_as: the same pooling and
    similarity for all, so that a difference is the training's alone). The start first (every difference is to
    it), then the arms; the overlap thirds on every retrieval task -> (results.json paths as used, as the start)."""
    paths = ([], [])
    for seed, arm_models in models.items():
        for dest, extra, found in ((out / f"eval_s{seed}", [], paths[0]),
                                   (out / f"eval_s{seed}_as_start", ["--score_as", start], paths[1])):
            found.append(dest / "results.json")
            wanted = [start, *arm_models.values()]  # a ledger's new arms: scored again with them
            if dry_run or read_json(dest / "results.json").get("models") != wanted:
                argv = ["--models", start, *arm_models.values(), *argv_of(exp["eval"]), "--overlap_analysis",
                        *extra, "--output_dir", str(dest), "--overwrite"]
                run_script(exp, "evaluate", argv, dry_run)
    return paths


def fit_steps(exp: dict, arms: dict, seeds: list, seconds_per_step, flops: dict = None) -> int:
    """Steps per arm that fit the config's "steps": {"fit_seconds"}: fit_seconds over the time of one step of every arm
    and seed, `seconds_per_step(FLOPs of a step)` (estimate_flops, or `flops` by arm), within the config's
    [min, max]."""
    rule = exp["steps"]
    flops = flops or {n: estimate_flops(exp, arm) for n, arm in arms.items()}
    one_step = sum(seconds_per_step(flops[n]) * arm["steps_factor"] for n, arm in arms.items())
    return max(rule["min"], min(rule["max"], int(rule["fit_seconds"] / (one_step * len(seeds)))))


# ----------------------------------------------------------------------------------------------------------------
# The FLOP count and the GPU-hours (run_log.step_flops on one collated batch of full-length rows)
# ----------------------------------------------------------------------------------------------------------------
def model_config(exp: dict):
    """The start's BertConfig without building weights: the random BERT's / pre-training's sizes, or the config's
    "flops_config" for a named model this machine may not have."""
    from transformers import BertConfig

    start = exp["start"]
    if start["kind"] == "random_bert":
        return BertConfig(**start["config"])
    if start["kind"] == "pretrain_mlm":
        f = start["flags"]
        return BertConfig(vocab_size=f.get("--vocab_size", 8192), hidden_size=f.get("--hidden_size", 256),
                          num_hidden_layers=f.get("--num_layers", 4), num_attention_heads=f.get("--num_heads", 4),
                          intermediate_size=f.get("--intermediate_size", 1024))
    return BertConfig(**exp["flops_config"])


def estimate_flops(exp: dict, arm: dict) -> float:
    """Model FLOPs of one optimiser step of `arm` on one process: run_log.step_flops on a batch of
    --per_device_train_batch_size groups whose passages are all --max_length tokens long (an upper bound: length
    grouping leaves little padding, and padding counts as work), the model built on the meta device (no weights)."""
    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    import modeling_xprt as mx
    from plumbing import run_log
    flags = arm["flags"]
    objective = flags[flags.index("--objective") + 1] if "--objective" in flags else "xprt"
    options = {"fill_in": False} if "--no_fill_in" in flags else {}
    if "--generator_name_or_path" in flags:  # SimLM's frozen generator: the start's architecture stands in for it
        import tempfile

        gen_dir = tempfile.mkdtemp()
        with torch.random.fork_rng(devices=[]):
            BertForMaskedLM(model_config(exp)).save_pretrained(gen_dir)
        options["generator_name_or_path"] = gen_dir
    if objective == "revela":  # its language model: the config's "lm" built on the meta device (shapes only)
        options.update(revela_estimate_options(exp, flags))
    t = exp["train"]
    with torch.device("meta"):  # the encoder without weights; the objective's heads are built from its shapes
        encoder = BertForMaskedLM(model_config(exp))
    model = mx.XPRTModel(encoder, objective=objective, **options)
    tok = AutoTokenizer.from_pretrained(str(ROOT / "bench" / "tokenizer"))  # shapes only (one token a word); shipped
    text = " ".join(["word"] * t.get("--max_length", 128))
    rows = [{"doc_id": str(i), "anchor": text, "related": [text] * 4, "random_passage": text}
            for i in range(t.get("--per_device_train_batch_size", 32))]
    collator = model.objective.make_collator(tok, max_length=t.get("--max_length", 128),
                                          positive="random" if "random" in flags else "s1")
    return run_log.step_flops(model, collator(rows), t.get("--retention_weight", 40.0) > 0)


def revela_estimate_options(exp: dict, flags: list) -> dict:
    """Revela's options for the FLOP estimate: its language model built without weights (meta device) from the
    config's "lm_config" (the real model's published shapes; the harness reads no Hub) or its "lm"'s sizes, its
    tokenizer the shipped bench/tokenizer (shapes only: one token a word), LoRA as the arm's flags set it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    lm = exp["lm"]
    if exp.get("lm_config"):
        spec = dict(exp["lm_config"])
    elif lm["kind"] == "pretrain_clm":  # pretrain_mlm.py --causal's sizes
        f = lm["flags"]
        spec = {"architecture": f["--causal"], "vocab_size": f.get("--vocab_size", 8192),
                "hidden_size": f.get("--hidden_size", 256), "num_hidden_layers": f.get("--num_layers", 4),
                "num_attention_heads": f.get("--num_heads", 4), "num_key_value_heads": f.get("--num_heads", 4),
                "intermediate_size": f.get("--intermediate_size", 1024)}
    else:
        spec = {"architecture": lm["architecture"], **lm["config"]}
    # shapes only (one token a word): the shipped tokenizer, which the GPU machine has (it has no MiniLM package)
    tok = AutoTokenizer.from_pretrained(str(ROOT / "bench" / "tokenizer"))
    config = AutoConfig.for_model(spec.pop("architecture"), **{"vocab_size": len(tok), **spec})
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    options = {"lm": lm, "lm_tokenizer": tok}
    for flag, key, kind in (("--lora_rank", "lora_rank", int), ("--lora_target_modules", "lora_target_modules", str)):
        if flag in flags:
            value = kind(flags[flags.index(flag) + 1])
            options[key] = value.split(",") if key == "lora_target_modules" else value
    return options


def processes(exp: dict) -> int:
    """Processes (GPUs) of the train launcher: its accelerate config's num_processes, else --nproc_per_node, else 1."""
    how = launcher(exp, "train").split()
    if "--config_file" in how:
        import yaml

        return int(yaml.safe_load((ROOT / how[how.index("--config_file") + 1]).read_text()).get("num_processes", 1))
    return int(how[how.index("--nproc_per_node") + 1]) if "--nproc_per_node" in how else 1


def gpu_hours(exp: dict, arms: dict, seeds: list, steps) -> list:
    """Per arm: steps, FLOPs per step, and GPU-hours at the config's peak and each assumed MFU. Epoch-based runs take
    their steps from the groups (the config's "groups_estimate": documents x groups per document) over the global
    batch."""
    procs = processes(exp)
    est = exp.get("estimate", {})
    peak, mfus = est.get("peak_tflops", 989.0) * 1e12, est.get("mfu", [0.1, 0.25])
    if not steps:
        groups = est["documents"] * est.get("groups_per_document", 7.0)
        steps = math.ceil(exp["train"].get("--num_train_epochs", 1) * groups /
                          (exp["train"]["--per_device_train_batch_size"] * procs))
    rows = []
    for name, arm in arms.items():
        f = estimate_flops(exp, arm)
        n = steps * arm["steps_factor"]
        total = f * procs * n * len(seeds)
        rows.append({"arm": name, "steps": n, "tflop_per_step": f * procs / 1e12, "processes": procs,
                     "gpu_hours": {str(m): total / (peak * m) / 3600 for m in mfus}})
    return rows


def print_estimate(exp: dict, rows: list):
    est = exp.get("estimate", {})
    print(f"\nGPU-hours of {exp['name']} (run_log.step_flops on full-length rows; peak {est.get('peak_tflops', 989.0)} "
          f"TFLOP/s bf16 per GPU; MFU assumed, not measured; selection and scoring not counted):")
    print(f"  {'arm':<26}{'steps':>8}{'TFLOP/step':>12}  " + "  ".join(f"GPU-h @{m}" for m in rows[0]["gpu_hours"]))
    for r in rows:
        print(f"  {r['arm']:<26}{r['steps']:>8}{r['tflop_per_step']:>12.2f}  " +
              "  ".join(f"{v:>9.2f}" for v in r["gpu_hours"].values()))
    tot = {m: sum(r["gpu_hours"][m] for r in rows) for m in rows[0]["gpu_hours"]}
    print(f"  {'all arms':<46}  " + "  ".join(f"{v:>9.2f}" for v in tot.values()))


def round_to_fp16(folder: Path):
    """A start model's float weights rounded to fp16 and kept as fp32: the fp16 bundle it comes back in then holds
    these very values, so the arms trained from it here and those of later runs (which carry it) share one start."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = {k: v.to(torch.float16).to(v.dtype) if v.is_floating_point() else v
               for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
