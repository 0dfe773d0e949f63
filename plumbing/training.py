"""
What the two training loops (train.py's and finetune.py's, each written in its script) call, one call each.
  1. the loop's pieces: an epoch's batches (resume skips what was done), the gradient cache step under Accelerate, a
     scoring logged, the line a stopped run ends with
  2. the model and the optimiser: XPRTModel loaded for a run, AdamW's groups (the heads at their own lr)
  3. the accelerator, the run folder, prepare and the run's length
  4. a run's identity: the folder's lock, the run record a resume or a rerun is checked against
  5. checkpoints, resume, stop signals, the saved model and its card
  6. the flags both stages share
It imports modeling_xprt.py and the plumbing beside it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from modeling_xprt import XPRTModel
from plumbing.architectures import longest_input, runs_at_length
from plumbing.batches import STOP_SIGNALS
from plumbing.common import (PAPER_MODEL, UserError, atomic_write, claim_output_folder, describe_prompts, disk_full,
                             is_zero3, non_negative_float, non_negative_int, positive_float, positive_int, read_json,
                             read_jsonl, real_path, record_outputs, remove_outputs, resolve_model_path, scheduler_names)
from plumbing.common import Stopped  # run_script's exception for a stop signal
from plumbing.model_folder import (check_tokenizer_fits, describe_scoring, load_xprt_folder, model_card,
                                    push_to_hub, save_xprt_folder)
from plumbing.run_log import plot_loss_curves, write_log_record

# ==============================================================================================================
# 1. The loop's pieces
# ==============================================================================================================

def log_score(accelerator, args, scorer, model, step: int, epoch: int, window=None) -> dict:
    """--eval_tasks scored now (evaluate.TrainingScorer) -> its record, written to train_log.jsonl; its time left out
    of the log window's (LogWindow.exclude), so tokens/s and time per step count training only."""
    with uncompiled():
        rec = scorer(model, step, epoch)
    if window is not None:
        window.exclude(rec["scoring_time_s"])
    write_log_record(accelerator, Path(args.output_dir) / "train_log.jsonl", rec)
    return rec

def uncompiled():
    """Inside, --compile's layers run eagerly (set_stance "force_eager"), so passes beside the step (scoring, the
    drift) compile no graphs of their own. A no-op without --compile."""
    return torch.compiler.set_stance("force_eager")

def say_stopped(accelerator, args, signum: int, state: "TrainState") -> str:
    """The line a run stopped by a signal ends with (its checkpoint is written) -> the signal's name."""
    name = signal.Signals(signum).name
    accelerator.print(f"{name} at step {state.completed_steps}: checkpoint written to {Path(args.output_dir)}/"
                      f"checkpoints/step_{state.completed_steps}; the same command with --resume_from_checkpoint "
                      "latest continues the run")
    return name

def epoch_batches(accelerator, dataloader, sampler, state: "TrainState", epoch: int):
    """The epoch's collated batches (their order depends on (seed, epoch) only). A resumed run starts its checkpoint's
    epoch after the batches it had done; both epoch counters are set (docs/plumbing.md: epoch_batches)."""
    dataloader.set_epoch(epoch)
    sampler.set_epoch(epoch)
    skip = state.batches_in_epoch if epoch == state.epoch else 0
    state.epoch, state.batches_in_epoch = epoch, skip
    return accelerator.skip_first_batches(dataloader, skip) if skip else dataloader

def gradient_cache_step(accelerator, model, batch, chunk: int, **kw) -> dict:
    """--gradient_cache_chunk: XPRTModel.cached_step under Accelerate: its backward passes under no_sync, the
    gradients all-reduced once on the last micro-batch; mixed precision through accelerator.autocast."""
    unwrapped = accelerator.unwrap_model(model)
    with accelerator.no_sync(model), accelerator.autocast():
        outputs = unwrapped.cached_step(batch, chunk, accelerator.backward, **kw)
    if accelerator.sync_gradients and accelerator.num_processes > 1:
        all_reduce_mean([p.grad for p in model.parameters() if p.grad is not None], accelerator.num_processes)
    return outputs

def all_reduce_mean(grads: list, world: int, bucket_bytes: int = 25 * 2**20):
    """The gradients averaged over the processes in place, in buckets of about bucket_bytes (DDP's default, 25 MiB):
    each bucket flattened into one buffer, one all-reduce, copied back (docs/plumbing.md: all_reduce_mean)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    buckets, size = [], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not buckets or size + nbytes > bucket_bytes or g.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        torch.distributed.all_reduce(flat)
        flat.div_(world)
        for g, v in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(v)

# ==============================================================================================================
# 2. The model and the optimiser
# ==============================================================================================================

def load_model(accelerator, args, **kw):
    """load_xprt_folder(XPRTModel, --model_name_or_path, **kw) and its tokenizer, for train.py and finetune.py:
    loaded whole even under ZeRO-3, the tokenizer checked against the embeddings, the prefixes printed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_name_or_path),
                                              trust_remote_code=args.trust_remote_code)
    with unpartitioned_loading():
        model = load_xprt_folder(XPRTModel, args.model_name_or_path, tau=args.tau or 0.05,
                                            trust_remote_code=args.trust_remote_code, prefixes=args.prefixes,
                                            hub_model_id=args.hub_model_id, **kw)
    check_tokenizer_fits(tokenizer, model.encoder.config, args.model_name_or_path)
    accelerator.print(f"model: {model.load_message}")
    accelerator.print(f"{describe_prompts(model.prompts)} (--prefixes {args.prefixes}; start model "
                      f"{model.info.start_model})")
    start_scoring = describe_scoring(model.info)
    saved_similarity = getattr(args, "saved_similarity", "start")
    if saved_similarity == "cosine":
        model.info.normalize, model.info.similarity_fn_name = True, "cosine"
    accelerator.print(f"scoring: the start model's is {start_scoring}, at most {model.info.max_seq_length} tokens; "
                      "the losses train cosines (L2-normalised vectors, the paper's); the saved folder states "
                      f"{describe_scoring(model.info)} (--saved_similarity {saved_similarity}), as the scores during "
                      "training (--eval_tasks) are")
    if model.info.modules:
        accelerator.print(f"modules after pooling: {', '.join(model.info.modules)} ({model.info.dim}-d vectors): the "
                          "start's, frozen and saved back unchanged; the similarity losses read the vectors they make, "
                          "so the encoder is trained under them; the decoders read the pooled vector")
    register_tied_projection(accelerator, model)
    if args.gradient_checkpointing:
        model.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer

def check_input_length(model, name: str, flag: str, value: int, extra: int = 0, why: str = ""):
    """Refuse, before any work, a length flag whose inputs (value + extra positions) the model's encoder cannot take
    (measured: architectures.runs_at_length), naming the value that fits."""
    base = model.encoder.base_model
    need = value + extra
    if not runs_at_length(base, need):
        most = longest_input(base, need)
        raise UserError(f"{flag} {value}: {name} takes inputs of at most {most} positions, and a step needs {need}"
                        + (f" ({why})" if why else "") + f": pass {flag} {max(most - extra, 0)} or less")

def engine_dtype(accelerator) -> torch.dtype:
    """The dtype a prepared model's weights compute in: bf16 / fp16 under DeepSpeed's, else fp32 (autocast recasts
    inside each op). The frozen retention teacher takes this dtype."""
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    return torch.float32

def register_tied_projection(accelerator, model):
    """Under ZeRO-3, keep the tied vocabulary projection and its bias (read outside their modules) gathered."""
    if is_zero3(accelerator):
        import deepspeed

        for p in model.projection():
            deepspeed.zero.register_external_parameter(model, p)

def optimizer_groups(model, learning_rate: float, head_learning_rate=None, weight_decay: float = 0.01):
    """AdamW parameter groups: no decay on biases and LayerNorm weights (BERT recipe); the heads
    (XPRTModel.head_parameters) at head_learning_rate (None: the encoder's); the tied projection at the encoder's.
    Frozen parameters and empty groups are left out."""
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    head_ids = {id(p) for p in model.head_parameters()}
    head_lr = learning_rate if head_learning_rate is None else head_learning_rate
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_head = id(p) in head_ids
        decay = 0.0 if n.endswith(no_decay) else weight_decay
        group = groups.setdefault((is_head, decay), {"params": [], "weight_decay": decay,
                                                     "name": "heads" if is_head else "encoder",
                                                     "lr": head_lr if is_head else learning_rate})
        group["params"].append(p)
    return [g for _, g in sorted(groups.items())]

def adamw(accelerator, model, args, head_learning_rate=None):
    """AdamW over optimizer_groups (the heads at head_learning_rate), its trainable parameters printed ->
    (optimizer, trainable parameter count)."""
    param_groups = optimizer_groups(model, args.learning_rate, head_learning_rate, args.weight_decay)
    trainable = sum(p.numel() for g in param_groups for p in g["params"])
    kernel = adamw_kernel(accelerator.device.type)
    accelerator.print(f"trainable parameters: {trainable:,} "
                      f"({', '.join(sorted({g['name'] for g in param_groups}))}); AdamW: "
                      f"{'the fused kernel' if kernel.get('fused') else 'torch default kernel'}")
    return torch.optim.AdamW(param_groups, lr=args.learning_rate, **kernel), trainable

def adamw_kernel(device_type: str) -> dict:
    """AdamW's implementation for parameters on a `device_type` device: the fused kernel on CUDA, torch's default
    elsewhere (docs/plumbing.md: adamw_kernel)."""
    return {"fused": True} if device_type == "cuda" else {}

# ==============================================================================================================
# 3. The accelerator, the run folder, prepare
# ==============================================================================================================

def make_accelerator(args, find_unused_parameters: bool):
    """The Accelerator of a run: trackers in <output_dir>/logs, DDP told whether some parameters go unused
    (objectives without a decoder pass), DeepSpeed given the micro-batch size it cannot infer."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # cpu=True without a GPU (accelerate's gloo group), never under DeepSpeed (docs/plumbing.md: make_accelerator)
    deepspeed_on = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    matmul_precision_policy()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available() and not deepspeed_on,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=str(Path(args.output_dir) / "logs"),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)],
    )
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if deepspeed_on and world != accelerator.num_processes:
        # accelerate sees 1 process of a larger group (CPU DeepSpeed: docs/plumbing.md: make_accelerator)
        raise UserError(f"DeepSpeed with {world} processes, but accelerate sees {accelerator.num_processes} "
                        f"({accelerator.device.type}): accelerate forms no multi-process state for DeepSpeed on "
                        "CPU. The CPU DeepSpeed configs are one-process smoke tests (num_processes: 1); for several "
                        "CPU processes use torchrun without DeepSpeed, for DeepSpeed use GPUs "
                        "(configs/accelerate_deepspeed_zero2.yaml)")
    asked = launcher_processes()
    if asked and asked > accelerator.num_processes:  # accelerate launch starts one process without GPUs, silently
        accelerator.print(f"warning: `accelerate launch --num_processes {asked}` started {accelerator.num_processes} "
                          f"process(es) on this machine ({accelerator.device.type}; it forms a group of several only "
                          f"on GPUs, or with --multi_gpu): for {asked} CPU processes use torchrun --nproc_per_node "
                          f"{asked}. The run goes on with {accelerator.num_processes}: its batch and negatives are "
                          "those of that many processes")
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None and args.gradient_cache_chunk:
        raise UserError("--gradient_cache_chunk runs several backward passes per step (one per chunk, and one for the "
                        "batch-wide terms); DeepSpeed's engine expects one backward per forward of its module and "
                        "owns the gradient reduction: use the plain (DDP) launcher, or drop the flag")
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None and getattr(args, "compile", None) and \
            accelerator.state.deepspeed_plugin.zero_stage == 3:
        accelerator.print("warning: --compile under DeepSpeed ZeRO-3: the hooks that gather each layer's parameters "
                          "break its compiled graphs (a tiny BERT, one CPU process: 39 graphs and 377 s of compiling, "
                          "each step 6x ZeRO-2's compiled step, the same losses); ZeRO-2 compiles as the plain run "
                          "does (3 graphs)")
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        # our DataLoader has a batch_sampler (no batch_size attribute), so DeepSpeed's "auto" cannot infer it
        ds_cfg = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_cfg["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        if ds_cfg.get("gradient_clipping") == "auto":
            ds_cfg["gradient_clipping"] = args.max_grad_norm
    return accelerator

def launcher_processes(pid: int | None = None):
    """The `--num_processes N` of the parent `accelerate launch` (/proc, so Linux), or None: how a launch of N
    processes that became one is seen (accelerate sets no variable for a single process)."""
    try:
        raw = Path(f"/proc/{os.getppid() if pid is None else pid}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    # `accelerate launch ...`, `python -m accelerate.commands.launch ...` (or its accelerate_cli, then launch)
    head = argv[:4]
    if not any(a == "accelerate.commands.launch" or (a == "launch" and any(
            Path(b).name == "accelerate" or b.startswith("accelerate.commands") for b in head[:i]))
            for i, a in enumerate(head)):
        return None
    for i, a in enumerate(argv[:-1]):
        value = argv[i + 1] if a == "--num_processes" else None
        if a.startswith("--num_processes="):
            value = a.split("=", 1)[1]
        if value is not None:
            return int(value) if value.isdigit() else None
    return None

def matmul_precision_policy():
    """The TF32 policy, set here once per run (make_accelerator): fp32 matrix products stay IEEE fp32, TF32 off, set
    explicitly (another library may have turned it on; why: docs/plumbing.md: matmul_precision_policy)."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

@contextlib.contextmanager
def unpartitioned_loading():
    """Load models whole inside this block, even under ZeRO-3: an unprepared model (the retention teacher) would
    otherwise run on empty shards (docs/plumbing.md: unpartitioned_loading)."""
    from transformers.integrations import deepspeed as hf_ds

    registered = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = registered

def gathered_params(accelerator, model):
    """Context that gathers ZeRO-3 partitioned parameters (a no-op otherwise)."""
    if is_zero3(accelerator):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    return contextlib.nullcontext()

# What train.py and finetune.py write in --output_dir (the model folder is replaced at the end, in one rename)
RUN_OUTPUTS = ("model", "checkpoints", "logs", "train_log.jsonl", "loss_curve.png", "best_model", "best.json",
               "run.json", "run.lock")

def prepare_output_dir(accelerator, args, script: str, inputs: dict, extra_outputs=(), reuse=()):
    """Make --output_dir ready for a run, deleting nothing the script did not write (claim_output_folder): inputs
    (`inputs`, local_inputs' form) kept out of it, a stranger's file never replaced, the folder checked for writing.
    Then the run's identity (section 4): the folder locked for this run (take_run_lock), --resume_from_checkpoint
    resolved ('latest': the newest complete checkpoint, none: a fresh run) and checked against the run that wrote
    it, a fresh run against a killed one's record (check_same_run); run.json written.
    A finished run (model/) or its checkpoints are refused unless --overwrite (or resuming); a fresh run removes the
    recorded outputs it rewrites, model/ stays until replaced in one rename. A resume cuts train_log.jsonl back to
    its checkpoint's step (docs/plumbing.md: prepare_output_dir)."""
    out = Path(args.output_dir)
    outputs = (*RUN_OUTPUTS, *extra_outputs)
    if args.resume_from_checkpoint not in (None, "latest"):  # a checkpoint of this very run is no outside input
        ckpt = real_path(args.resume_from_checkpoint)
        if real_path(out / "checkpoints") in ckpt.parents:
            reuse = (*reuse, ckpt)
    previous = claim_output_folder(out, script, outputs, inputs, reuse)
    # every process has checked the folder as it was before the main one records and locks it: a process that
    # checked after would find run.lock (or a half-written record) and refuse a run that is its own
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record_outputs(out, script, outputs)
        take_run_lock(accelerator, out / RUN_LOCK)
    accelerator.wait_for_everyone()
    checkpoint = checkpoint_to_resume(accelerator, args)
    args.resume_from_checkpoint = str(checkpoint) if checkpoint else None  # resume() loads it (prepare_run)
    if (out / "model").exists() and not args.overwrite:
        raise UserError(f"{out / 'model'} exists: pass --overwrite to replace it (only {script}'s recorded outputs "
                        "are replaced), or choose another --output_dir")
    if checkpoint is None and list_checkpoints(out / "checkpoints") and not args.overwrite:
        raise UserError(f"{out / 'checkpoints'} has checkpoints: --resume_from_checkpoint latest, or --overwrite")
    identity = check_same_run(accelerator, args, inputs, out, checkpoint)
    accelerator.wait_for_everyone()  # all have read run.json and the log before the main process rewrites them
    if accelerator.is_main_process:
        if checkpoint is None:  # a fresh run: a fresh log, no killed run's steps before its own
            remove_outputs(out, script, [p for p in previous if p.name not in ("model", RUN_LOCK)])
        elif (out / "train_log.jsonl").exists():
            cut_log(out / "train_log.jsonl", int((checkpoint / "DONE").read_text()))
        atomic_write(out / RUN_RECORD, json.dumps(identity, indent=1))
    accelerator.wait_for_everyone()

def prepare_run(accelerator, args, model, optimizer, dataloader):
    """accelerator.prepare, then from the prepared loader's length the run's steps, its checkpoint interval, the lr
    scheduler, the TrainState (resumed with --resume_from_checkpoint); the trackers started
    -> (model, optimizer, dataloader, lr_scheduler, state, steps_per_epoch)."""
    from transformers import get_scheduler

    if getattr(args, "compile", None):  # after any mining (finetune.py), before DDP wraps the model
        accelerator.print(compile_layers(model, args.compile))
    model, optimizer = accelerator.prepare(model, optimizer)
    # The loader is prepared without device placement: its batches stay on the CPU (pinned on CUDA, loader_options)
    # until train_loop's one batch_to_device, so the host-side counts before it never wait on the device
    dataloader = accelerator.prepare_data_loader(dataloader, device_placement=False)
    steps_per_epoch = math.ceil(len(dataloader) / args.gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise UserError("not enough data for one step per process: lower --per_device_train_batch_size")
    max_steps = args.max_train_steps if args.max_train_steps is not None else args.num_train_epochs * steps_per_epoch
    world = accelerator.num_processes
    # AcceleratedScheduler steps once per process per optimiser step: scaled like the HF no_trainer examples
    lr_scheduler = accelerator.prepare(get_scheduler(args.lr_scheduler_type, optimizer,
                                                     num_warmup_steps=int(args.warmup_ratio * max_steps) * world,
                                                     num_training_steps=max_steps * world))
    args.checkpointing_steps = checkpoint_interval(args, max_steps)
    state = TrainState(max_steps)
    accelerator.register_for_checkpointing(state)
    if args.resume_from_checkpoint is not None:  # resolved by prepare_output_dir (None: a fresh run)
        resume(accelerator, args, state)
    if accelerator.is_main_process:
        accelerator.init_trackers("xprt", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                  for k, v in vars(args).items()})
    return model, optimizer, dataloader, lr_scheduler, state, steps_per_epoch

def compile_layers(model, mode: str) -> str:
    """--compile: regional compilation: every Transformer layer of a class the model repeats in a list, in the model
    and in Objective.held_modules, compiled in place (nn.Module.compile: names and checkpoints unchanged); the code
    around them stays eager. Static shapes, dynamo's recompile limit raised to hold a run's batch widths.
    mode: torch.compile's, or "exact": default's with eager's dropout (tests/test_compile.py). -> the line printed."""
    import torch._dynamo

    roots = [model] + [held for m in model.modules() for held in getattr(m, "held_modules", ())]
    modules = {id(m): m for root in roots for m in root.modules()}.values()
    # a layer class is what a list of repeated layers holds; a layer of that class outside a list (RetroMAE's one
    # decoder layer, a copy of the encoder's) is compiled too
    classes = {type(m[0]) for m in modules if isinstance(m, torch.nn.ModuleList) and len(m) > 0
               and len({type(x) for x in m}) == 1 and any(True for _ in m.parameters())}
    layers = [m for m in modules if type(m) in classes]
    how = {"options": {"fallback_random": True}} if mode == "exact" else {"mode": mode}  # "default": options {}
    for layer in layers:
        layer.compile(dynamic=False, **how)
    # each width a batch can have, encoder and decoder inputs alike (up to 512 / 8 = 64 of them), compiled once
    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # (its name before 2.7)
    setattr(cfg, limit, max(getattr(cfg, limit), 128))
    counts = collections.Counter(type(m).__name__ for m in layers)
    names = [f"{n} x {name}" for name, n in counts.items()]
    return (f"compiled ({mode}, regional): {', '.join(names)}; one graph per batch width (--pad_to_multiple_of); "
            "compile seconds are logged apart (compile_s) and left out of the step time and MFU")

def run_line(accelerator, args, data: str, max_steps: int, negatives: str) -> str:
    """The run's shape at its start: processes, precision, the data (`data`, e.g. "1,000 groups"), steps, batch, the
    in-batch negatives a row has (`negatives`: the script's losses say what they are), lr, checkpoints."""
    world = accelerator.num_processes
    return (f"{accelerator.distributed_type} x {world}, mixed precision {accelerator.mixed_precision}; {data}, "
            f"{max_steps} steps x {args.per_device_train_batch_size} per device x {world} processes x "
            f"{args.gradient_accumulation_steps} accumulation; in-batch negatives {negatives}; "
            f"lr {args.learning_rate}; "
            + (f"a checkpoint every {args.checkpointing_steps} steps" if args.checkpointing_steps else "no checkpoints")
            + " (and one on SIGTERM / SIGUSR1 / Ctrl-C)")

# ==============================================================================================================
# 4. A run's identity: one live run per folder, and a resume (or a rerun) that is the same run
# ==============================================================================================================

RUN_RECORD, RUN_LOCK = "run.json", "run.lock"
# The flags that change how a run is watched, saved, scored or published, not the steps it takes: every other flag
# (and any flag added later) decides the trajectory. The batches are the same for any --dataloader_num_workers
# (SeededCollate), and a local input is compared by its content, not its path (run_identity).
WATCH_FLAGS = frozenset({
    "output_dir", "overwrite", "resume_from_checkpoint", "stop_after_steps", "checkpointing_steps",
    "checkpoints_total_limit", "report_to", "logging_steps", "no_save_model", "eval_tasks", "eval_steps",
    "eval_limit", "eval_batch_size", "save_best", "license", "push_to_hub", "hub_model_id", "hub_private",
    "hub_token", "dataloader_num_workers", "peak_tflops", "trust_remote_code", "mining_batch_size",
    "min_in_batch_negatives", "ignore_memory_estimate"})

def take_run_lock(accelerator, lock: Path):
    """Lock the run folder (main process): run.lock holds the owner's pid, start time and host. A live owner or
    another host refuses the run; a dead one's lock is taken over, and said. Released at exit (release_run_lock)."""
    import psutil

    me = psutil.Process()
    mine = {"pid": me.pid, "started": me.create_time(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # atomic: one of two racing runs wins
        except FileExistsError:
            owner = read_json(lock)
            if owner.get("host") != mine["host"]:
                raise UserError(f"{lock.parent} is locked by pid {owner.get('pid')} on host {owner.get('host')}, "
                                f"which this machine cannot check: if that run has ended, delete {lock}")
            if owner.get("pid") != me.pid and process_alive(owner):
                raise UserError(f"{lock.parent} is in use by a live run (pid {owner['pid']}, started "
                                f"{time.ctime(owner['started'])}): wait for it, or choose another --output_dir")
            if owner.get("pid") != me.pid:
                accelerator.print(f"{lock}: the run that held it (pid {owner.get('pid')}) has ended; taken over")
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        atexit.register(release_run_lock, lock)
        return
    raise UserError(f"{lock}: another run took the folder while this one started; choose another --output_dir")

def process_alive(owner: dict) -> bool:
    """Whether the lock's pid runs and is the process that wrote it (its start time: a reused pid is not)."""
    import psutil

    try:
        return abs(psutil.Process(int(owner["pid"])).create_time() - float(owner["started"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False

def release_run_lock(lock: Path):
    """Remove run.lock if this process holds it (the end of save_run, and at exit)."""
    if read_json(lock).get("pid") == os.getpid():
        lock.unlink(missing_ok=True)

def checkpoint_to_resume(accelerator, args):
    """--resume_from_checkpoint resolved -> a complete checkpoint folder, or None for a fresh run ('latest' with no
    checkpoint yet, said)."""
    if args.resume_from_checkpoint is None:
        return None
    if args.resume_from_checkpoint == "latest":
        found = list_checkpoints(Path(args.output_dir) / "checkpoints")
        if not found:
            accelerator.print(f"no complete checkpoint in {Path(args.output_dir) / 'checkpoints'}: a fresh run")
        return found[-1] if found else None
    path = Path(args.resume_from_checkpoint)
    if not (path / "DONE").exists():
        raise UserError(f"--resume_from_checkpoint {path}: not a complete checkpoint (no DONE marker)")
    return path

def check_same_run(accelerator, args, inputs: dict, out: Path, checkpoint) -> dict:
    """This run's identity (run_identity), checked against its checkpoint's record (a resume) or a killed run's
    run.json that logged a step; a difference is refused naming each one -> the identity."""
    recorded = out / RUN_RECORD if checkpoint is None else checkpoint / RUN_RECORD
    then = read_json(recorded)
    now = run_identity(accelerator, args, inputs, known=then)
    trained = (out / "train_log.jsonl").exists() and (out / "train_log.jsonl").stat().st_size > 0
    if checkpoint is None and (args.overwrite or not trained):
        return now
    if not then:
        if checkpoint is not None:
            accelerator.print(f"{checkpoint} carries no run record (an earlier version wrote it): not checked")
            return now
        raise UserError(f"{out} holds a killed run's log and no record of its flags: --overwrite to start afresh")
    changed = identity_differences(then, now)
    if changed:
        what = f"{checkpoint}'s run" if checkpoint is not None else f"the run {out} holds (killed)"
        raise UserError(f"this run is not {what}: " + "; ".join(changed) + ". Rerun it as it was, or --overwrite "
                        "to start afresh in this folder")
    return now

def run_identity(accelerator, args, inputs: dict, known=None) -> dict:
    """What decides a run's trajectory: its flags but WATCH_FLAGS, the processes and the precision, the content of
    every local input (content_digest: the start model, the groups or training data, the teacher, ...; a Hub id is
    its flag's value) and the code (code_revision). `known`: an earlier identity, whose hashes unchanged files keep."""
    local = {f: paths for f, paths in inputs.items() if f not in ("--eval_tasks", "--resume_from_checkpoint")}
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in WATCH_FLAGS and f"--{k}" not in local}
    cache = {name: entry for d in (known or {}).get("inputs", {}).values() for name, entry in d["files"].items()}
    return {"flags": json.loads(json.dumps(flags, default=str)), "processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "inputs": {f: content_digest(paths, cache) for f, paths in local.items()}, "code": code_revision()}

def content_digest(paths, cache: dict) -> dict:
    """sha256 over the files under `paths` (relative names and bytes; hidden and '.tmp-' files skipped) ->
    {"sha256", "paths", "files": {file: [size, mtime_ns, sha256, ctime_ns, inode]}}. A file whose stat equals
    `cache`'s entry is trusted unread (docs/plumbing.md: content_digest)."""
    total, files = hashlib.sha256(), {}
    for root in map(Path, paths):
        found = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and not any(n.startswith(".") for n in p.relative_to(root).parts))
        for f in found:
            st, entry = f.stat(), cache.get(str(f))
            stat = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            if not (isinstance(entry, list) and len(entry) == 5 and entry[:2] + entry[3:] == stat):
                with open(f, "rb") as fh:
                    entry = [*stat[:2], hashlib.file_digest(fh, "sha256").hexdigest(), *stat[2:]]
            files[str(f)] = entry
            total.update(f"{f.relative_to(root) if f != root else f.name}\0{entry[2]}\n".encode())
    return {"sha256": total.hexdigest(), "paths": [str(p) for p in paths], "files": files}

def code_revision() -> dict:
    """The code a run runs: sha256 of the repository's scripts (the root's, plumbing/'s and baselines/' *.py), and
    the git commit when there is one (for the reader; the hash is what is compared)."""
    root = Path(__file__).resolve().parent.parent
    total = hashlib.sha256()
    for f in sorted(p for d in ("", "plumbing", "baselines") for p in (root / d).glob("*.py")):
        total.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"sha256": total.hexdigest(), "git": head.stdout.strip() if head.returncode == 0 else None}

def identity_differences(then: dict, now: dict) -> list:
    """Each way two run identities differ, in words: '--learning_rate 1e-05 there, 0.00011 here'."""
    changed = []
    for k in sorted(set(then.get("flags", {})) | set(now["flags"])):
        a, b = then.get("flags", {}).get(k, "(not given)"), now["flags"].get(k, "(not given)")
        if a != b:
            changed.append(f"--{k} {a} there, {b} here")
    for k in ("processes", "mixed_precision"):
        if then.get(k) != now[k]:
            changed.append(f"{k} {then.get(k)} there, {now[k]} here")
    for flag in sorted(set(then.get("inputs", {})) | set(now["inputs"])):
        a, b = (d.get("inputs", {}).get(flag, {}).get("sha256", "(none)") for d in (then, now))
        if a != b:
            changed.append(f"{flag}'s content (sha256 {a[:12]} there, {b[:12]} here)")
    if then.get("code", {}).get("sha256") != now["code"]["sha256"]:
        changed.append(f"the code (git {then.get('code', {}).get('git')} there, {now['code']['git']} here; the "
                       "scripts' sha256 differs)")
    return changed

def cut_log(log_path: Path, step: int):
    """A resume continues train_log.jsonl from its checkpoint: the records of the killed run's steps after it go
    (the resumed run logs them again)."""
    keep = [r for r in read_jsonl(log_path) if r.get("step", 0) <= step]
    atomic_write(log_path, "".join(json.dumps(r) + "\n" for r in keep))

# ==============================================================================================================
# 5. Checkpoints, resume, the saved model
# ==============================================================================================================

# A run of more steps than this is checkpointed this often unless --checkpointing_steps says otherwise: a run killed
# without a signal loses at most this many steps (docs/plumbing.md: DEFAULT_CHECKPOINT_EVERY).
DEFAULT_CHECKPOINT_EVERY = 1000

def checkpoint_interval(args, max_steps: int) -> int:
    """--checkpointing_steps, or DEFAULT_CHECKPOINT_EVERY for a run longer than that (0: no periodic checkpoint)."""
    if args.checkpointing_steps is not None:
        return args.checkpointing_steps
    return DEFAULT_CHECKPOINT_EVERY if max_steps > DEFAULT_CHECKPOINT_EVERY else 0

class TrainState:
    """Steps done, the epoch and batches done in it, the run's length and what the loop carries (`best`: --save_best's
    best and the start's score), registered for checkpointing: the schedules (lr, retention weight, PAIR's alpha)
    are functions of the step and the run's length, so a resumed run must have the same length."""

    def __init__(self, max_steps: int = 0):
        self.completed_steps, self.epoch, self.batches_in_epoch, self.max_steps = 0, 0, 0, max_steps
        self.best = {}
        # the open log window (run_log.LogWindow registers itself): its sums so far travel with a checkpoint, so a
        # resumed run's first record averages the steps the uninterrupted run's does
        self.log_window, self.resumed_window = None, None

    def state_dict(self):
        out = {k: v for k, v in vars(self).items() if k not in ("log_window", "resumed_window")}
        if self.log_window is not None:
            out["log_window"] = self.log_window.state_dict()
        return out

    def load_state_dict(self, state):
        saved = int(state.get("max_steps", self.max_steps))
        if saved != self.max_steps:
            raise UserError(f"the checkpoint's run has {saved} steps, this one {self.max_steps}: resume with the "
                             "same --max_train_steps / --num_train_epochs and data")
        self.__dict__.update({k: int(v) for k, v in state.items() if k not in ("log_window", "best")})
        self.best = state.get("best") or {}
        self.resumed_window = state.get("log_window")

class StopSignals:
    """train_loop's handler of STOP_SIGNALS (common.py): the handler only notes the signal; the loop reads it after
    each optimiser step, agreed over processes (`agreed`: max, a gloo group). restore() puts the previous handlers
    back. Before the first step one process stops at once (common.Stopped)."""

    def __init__(self, accelerator):
        self.signum, self.previous, self.group = 0, {}, None
        self.at_once = accelerator.num_processes == 1  # until the first step is checked
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")
        for s in STOP_SIGNALS:
            try:
                self.previous[s] = signal.signal(s, self.note)
            except ValueError:  # not the main thread (a caller's thread): signals stay as they were
                break

    def note(self, signum, frame):
        if self.at_once or (signum == signal.SIGINT and self.signum == signal.SIGINT):  # (Ctrl-C twice: now)
            raise Stopped(signum)
        self.signum = signum
        if signum == signal.SIGINT:
            print("\nCtrl-C: the run stops after this step, with a checkpoint (Ctrl-C again: at once, without one)",
                  file=sys.stderr, flush=True)

    def check(self) -> int:
        """After an optimiser step: the stop signal's number, 0 for none (one process: the handler's note itself;
        several: agreed, so that all stop at this step)."""
        self.at_once = False
        return self.signum if self.group is None else self.agreed()

    def agreed(self) -> int:
        """The stop signal's number (0: none) any process noted, the same on every process."""
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)

    @contextlib.contextmanager
    def scoring(self):
        """Around a later scoring (one process): a signal leaves it at once, noted for check()."""
        self.at_once = self.group is None
        try:
            yield
        except Stopped as stop:
            self.signum = stop.args[0]
        self.at_once = False

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

def stop_account(args, mined=None) -> str:
    """What a stop outside the steps keeps, and the command that continues (common.on_stop)."""
    last = list_checkpoints(Path(args.output_dir) / "checkpoints")
    reuse = f" (--mined_negatives {mined} reuses the negatives mined)" if mined and mined.is_file() else ""
    return (f"kept: checkpoint {last[-1]}; the same command with --resume_from_checkpoint latest continues from it"
            if last else "no checkpoint was written yet; the same command starts the run again") + reuse

def list_checkpoints(ckpt_dir: Path):
    """Complete checkpoints (a DONE marker is written last) sorted by step."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(d.name.split("_")[1]), d) for d in ckpt_dir.glob("step_*") if (d / "DONE").exists()]
    return [d for _, d in sorted(found)]

def all_finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())

def save_checkpoint(accelerator, model, ckpt_dir: Path, step: int, keep: int):
    """save_state into checkpoints/step_N, DONE marker last, then drop all but the last `keep` checkpoints. The
    data position is TrainState's; the masks need nothing saved (SeededCollate draws them from the batch's key)."""
    with gathered_params(accelerator, model):
        finite = all_finite(accelerator.unwrap_model(model))
    if not finite:
        raise FloatingPointError(f"non-finite weights at step {step}: checkpoint not written")
    path = ckpt_dir / f"step_{step}"
    try:
        accelerator.save_state(str(path))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            # the checkpoint carries the identity of the run that wrote it: a resume is checked against it
            shutil.copyfile(ckpt_dir.parent / RUN_RECORD, path / RUN_RECORD)
            (path / "DONE").write_text(str(step))
    except BaseException as err:  # nothing partial is left: a checkpoint is whole (DONE) or absent
        full = disk_full(err, path)  # asked before the removal frees the space the write took
        shutil.rmtree(path, ignore_errors=True)
        if full:
            raise UserError(f"checkpoint {path} not written: {full}. The partial folder was removed; the earlier "
                            "checkpoints are kept (free space, then resume with --resume_from_checkpoint latest)"
                            ) from err
        raise
    if accelerator.is_main_process:
        for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()

def resume(accelerator, args, state):
    """--resume_from_checkpoint (resolved and checked by prepare_output_dir): model, optimiser, scheduler, RNGs and
    `state`, from which the data position, the masks (SeededCollate) and the schedules (functions of the step)
    follow."""
    accelerator.load_state(args.resume_from_checkpoint)
    accelerator.print(f"resumed from {args.resume_from_checkpoint} at step {state.completed_steps}")

def save_model(accelerator, model, tokenizer, dest: Path, card: str, trust_remote_code: bool = False):
    """model_folder.save_xprt_folder (atomic), said "saved" once it loads back with this model's vectors
    (check_saved_folder); non-finite weights are never written."""
    unwrapped = accelerator.unwrap_model(model)
    # every process: under ZeRO-3 a forward gathers each layer's shards from all of them (and inside
    # gathered_params below it would release them again)
    ours = probe_vectors(unwrapped, tokenizer)
    with gathered_params(accelerator, model):
        if accelerator.is_main_process:
            if not all_finite(unwrapped):
                raise FloatingPointError("non-finite weights at the end of training: model not written")
            checked = {}
            save_xprt_folder(unwrapped, str(dest), tokenizer, model_card=card, check=lambda folder: checked.update(
                check_saved_folder(folder, ours, next(unwrapped.base.parameters()).device, trust_remote_code)))
            accelerator.print(f"saved {dest} (loaded back by sentence-transformers: {checked['texts']} texts' vectors "
                              f"within {checked['max_abs_diff']:.1e} of the run's)")
    accelerator.wait_for_everyone()

def save_model_with_card(accelerator, args, model, tokenizer, card: dict, log_path, dest: Path):
    """The model folder `dest` (save_model) with its card: model_card(args, info, **card), the losses of the last
    logged step of `log_path` (train_log.jsonl, up to the step saved), this stage added to the lineage."""
    # the card's loss table: the last record with losses (score records of --eval_steps come after it)
    losses = [r for r in read_jsonl(log_path) if "loss" in r and r["step"] <= card["summary"]["steps"]
              ] if log_path else []
    summary = {**card["summary"], "last_logged_step": losses[-1] if losses else {}}
    info = accelerator.unwrap_model(model).info
    # this run's stage joins the lineage the folder records (and the card shows)
    info.lineage = [*info.lineage, {"stage": f"{card['title']}, {summary['steps']} steps ({card['script']})",
                                    "model": args.hub_model_id}]
    text = model_card(args, info, **{**card, "summary": summary})
    save_model(accelerator, model, tokenizer, dest, text, args.trust_remote_code)

def export_checkpoint(request, parse_args, build_model, script: str) -> dict:
    """--export_checkpoint (request: the parsed flags): a checkpoint's model as <--output_dir>/model, as a finished
    run writes it: the run's flags from its run.json, the model built as the run built it (build_model), the
    checkpoint's tensors loaded (strict), then save_model_with_card -> {"exported": the model folder, "step"}."""
    from accelerate import Accelerator
    from safetensors.torch import load_model as load_safetensors_into

    ckpt, out = Path(request.export_checkpoint), Path(request.output_dir)
    alone = vars(parse_args(["--export_checkpoint", str(ckpt), "--output_dir", str(out)]))
    extra = [k for k, v in vars(request).items() if v != alone.get(k) and k not in ("overwrite", "trust_remote_code")]
    if extra:
        raise UserError(f"--export_checkpoint takes the run's flags from {ckpt / RUN_RECORD}: drop --{extra[0]} (only "
                        "--output_dir, --overwrite and --trust_remote_code go with it)")
    if not (ckpt / "DONE").exists():
        raise UserError(f"--export_checkpoint {ckpt}: not a complete checkpoint (no DONE marker)")
    if not (ckpt / "model.safetensors").is_file():
        raise UserError(f"--export_checkpoint {ckpt}: no model.safetensors (a DeepSpeed checkpoint keeps its weights "
                        "in ZeRO shards: DeepSpeed's zero_to_fp32.py in it gathers them; not exported here)")
    record = read_json(ckpt / RUN_RECORD)
    inputs = record.get("inputs", {})
    if not record.get("flags") or any("paths" not in d for d in inputs.values()):
        raise UserError(f"{ckpt / RUN_RECORD}: no record of the run's flags and inputs (written by an earlier "
                        "version): resume the run with this version, or train afresh")
    step = int((ckpt / "DONE").read_text())
    argv = ["--output_dir", str(out)] + (["--trust_remote_code"] if request.trust_remote_code else [])
    for flag, d in inputs.items():
        argv += [flag, *d["paths"]]
    for name, value in record["flags"].items():
        if value is None or value is False:
            continue
        argv += [f"--{name}"] if value is True else [f"--{name}", *map(str, value if isinstance(value, list)
                                                                        else [value])]
    args = parse_args(argv)
    start = inputs.get("--model_name_or_path")
    if start and content_digest(start["paths"], {})["sha256"] != start["sha256"]:
        raise UserError(f"--model_name_or_path {start['paths'][0]} is not the start model the run of {ckpt} began "
                        "from (its content changed): the checkpoint holds the weights, the start its folder's "
                        "settings and code; restore it to export")
    previous = claim_output_folder(out, script, ["model"], {"--export_checkpoint": [real_path(ckpt)]})
    if previous and not request.overwrite:
        raise UserError(f"{out / 'model'} exists: --overwrite to replace it, or choose another --output_dir")
    record_outputs(out, script, ["model"])
    accelerator = Accelerator(cpu=True)
    model, tokenizer = build_model(accelerator, args)
    load_safetensors_into(model, str(ckpt / "model.safetensors"), strict=True)
    run_log = ckpt.parent.parent / "train_log.jsonl"
    card = {"title": f"{script.removesuffix('.py')} checkpoint step {step}", "script": script,
            "argv": argv, "summary": {"steps": step, "processes": record.get("processes"), "rows": "the run's",
                                      "unit": "rows"}}
    save_model_with_card(accelerator, args, model, tokenizer, card, run_log if run_log.exists() else None,
                         out / "model")
    return {"exported": str(out / "model"), "step": step}

# Texts the saved folder encodes to prove it loads: of different lengths (one batch pads), one with a non-ASCII
# word; the run's model encodes them too, on the same device.
PROBE_TEXTS = ("Cross-passage retrieval pre-training.", "A passage about rivers, their floods and the towns beside "
               "them, long enough to be padded against the others.", "Zürich's lake")

def probe_vectors(model, tokenizer) -> torch.Tensor:
    """The run's own vectors of PROBE_TEXTS (XPRTModel.encode's pooled vector, the start's modules after pooling,
    and the Normalize the saved folder adds, in eval mode), which check_saved_folder expects of the saved folder."""
    from sentence_transformers.sentence_transformer.modules import Normalize

    was_training = model.training
    model.eval()
    try:
        enc = tokenizer(list(PROBE_TEXTS), padding=True, return_tensors="pt")
        device = next(model.base.parameters()).device
        with torch.no_grad():
            vec = model.post_pooling(model.encode(enc["input_ids"].to(device), enc["attention_mask"].to(device))[1])
        # save_model_folder adds Normalize after the start's modules when the start normalised and had none
        if model.info.normalize and not any(isinstance(m, Normalize) for m in model.post_pooling.modules_):
            vec = torch.nn.functional.normalize(vec, dim=-1)
        return vec.float().cpu()
    finally:
        model.train(was_training)

def check_saved_folder(folder: Path, ours: torch.Tensor, device, trust_remote_code: bool) -> dict:
    """Load a just-written model folder as its users will (SentenceTransformer) and check its vectors of PROBE_TEXTS
    equal the run's own (`ours`; atol 1e-4) -> {"texts", "max_abs_diff"}; else refused before it replaces anything."""
    from sentence_transformers import SentenceTransformer

    try:
        with unpartitioned_loading():  # under ZeRO-3, transformers would partition it (unloadable by one process)
            st = SentenceTransformer(str(folder), device=str(device), trust_remote_code=trust_remote_code,
                                     local_files_only=True)
        theirs = torch.as_tensor(st.encode(list(PROBE_TEXTS), convert_to_numpy=True)).float()
    except Exception as err:
        raise RuntimeError(f"the folder written for {folder.name.split('-', 2)[-1]} does not load in "
                           f"sentence-transformers ({type(err).__name__}: {err}): not saved") from err
    diff = float((ours - theirs).abs().max())
    if not torch.allclose(ours, theirs, atol=1e-4, rtol=1e-3):
        raise RuntimeError(f"the folder written for {folder.name.split('-', 2)[-1]} loads as another model (its "
                           f"vectors differ from the run's by up to {diff:.2e}): not saved")
    return {"texts": len(PROBE_TEXTS), "max_abs_diff": diff}

def save_run(accelerator, args, model, tokenizer, finished: bool, card: dict, stopped_by=None):
    """End of a run: the loss-curve picture, for a finished run the model folder with its card, then the Hub upload
    (--push_to_hub). A run a signal stopped exits 128 + its number (143 for SIGTERM)."""
    out = Path(args.output_dir)
    log_path = out / "train_log.jsonl"
    accelerator.wait_for_everyone()
    logged = log_path.exists() and log_path.stat().st_size
    if accelerator.is_main_process and logged:
        plot_loss_curves(log_path, out / "loss_curve.png")
    if finished and not args.no_save_model:
        save_model_with_card(accelerator, args, model, tokenizer, card, log_path if logged else None, out / "model")
    accelerator.end_training()
    if finished and not args.no_save_model and args.push_to_hub and accelerator.is_main_process:
        push_to_hub(args, out / "model")
    if accelerator.is_main_process:
        release_run_lock(out / RUN_LOCK)
    if stopped_by and not finished:
        raise SystemExit(128 + signal.Signals[stopped_by].value)

# ==============================================================================================================
# 6. The flags both stages share
# ==============================================================================================================

def add_common_args(p, default_lr: float):
    """The flags train.py and finetune.py share: the start model, loss temperature, optimisation, output."""
    g = p.add_argument_group("start model")
    g.add_argument("--model_name_or_path", default=PAPER_MODEL,
                   help="starting encoder: hub id, local folder, an xprt output folder (heads restored), or the "
                        "offline alias all-MiniLM-L6-v2. The paper starts from intfloat/e5-base-unsupervised")
    g.add_argument("--trust_remote_code", action="store_true", help="allow custom model code from the hub")
    g.add_argument("--prefixes", choices=["auto", "e5", "none"], default="auto",
                   help="text prefixes: auto = the start model's own (its sentence-transformers prompts, else E5's "
                        "'query: ' / 'passage: ' when it is an E5 model, else none: common.model_prompts); "
                        "e5 / none force them. Pre-training reads passages only (the 'passage: ' prefix). Saved "
                        "with the model"),
    g.add_argument("--tau", type=positive_float, default=None,
                   help="InfoNCE temperature (default 0.05, the paper's)")
    g.add_argument("--saved_similarity", choices=["start", "cosine"], default="start",
                   help="the scoring the saved folder states: start = the start model's (its Normalize module and "
                        "similarity function: a dot-product start stays dot-product, so it is scored as it was); "
                        "cosine = Normalize + cosine. The losses train cosines either way (the paper's)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--per_device_train_batch_size", type=positive_int, default=32,
                   help="groups (pre-training) or queries (fine-tuning) per device; in-batch negatives = this x "
                        "world size")
    g.add_argument("--gradient_accumulation_steps", type=positive_int, default=1,
                   help="micro-batches per step (adds no negatives)")
    g.add_argument("--learning_rate", type=non_negative_float, default=default_lr,
                   help="peak learning rate (0: the encoder stays as it is, e.g. with --head_learning_rate)")
    g.add_argument("--weight_decay", type=non_negative_float, default=0.01,
                   help="AdamW weight decay (not on biases / LayerNorm)")
    g.add_argument("--lr_scheduler_type", default="linear", choices=scheduler_names(),
                   help="transformers.get_scheduler name")
    g.add_argument("--warmup_ratio", type=float, default=0.1, help="warmup fraction of the steps (PAIR: 0.1)")
    g.add_argument("--max_grad_norm", type=non_negative_float, default=1.0, help="gradient clipping (0 = off)")
    g.add_argument("--num_train_epochs", type=positive_int, default=1,
                   help="epochs (ignored when --max_train_steps is set)")
    g.add_argument("--max_train_steps", type=positive_int, default=None,
                   help="optimiser steps (>= 1); sets the schedule length")
    g.add_argument("--stop_after_steps", type=positive_int, default=None,
                   help="stop after this many steps without changing the schedule (as if preempted; resume tests)")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                   help="override accelerate's config (bf16 on Ampere+ GPUs)")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="trade compute for memory (use_reentrant=False)")
    g.add_argument("--gradient_cache_chunk", type=positive_int, default=None,
                   help="the gradient cache: forward and backward K groups (fine-tuning: queries) at a time, the "
                        "batch-wide terms on all of the batch's vectors (XPRTModel.cached_step), so the batch, and "
                        "with it the in-batch negatives, is no longer bound by the activations' memory; one more "
                        "forward of the encoder passes. Off by default; not under DeepSpeed"),
    g.add_argument("--compile", nargs="?", const="default", default=None,
                   choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs", "exact"],
                   help="torch.compile the Transformer layers a step runs (the encoder's, the decoder's, those of "
                        "SimLM's generator and Revela's LM), each in place (regional compilation; "
                        "training.compile_layers); a mode after the flag: reduce-overhead adds CUDA graphs on a GPU; "
                        "exact draws dropout from torch's generator as eager does (an exact A/B: the eager run's "
                        "losses), where the others draw inductor's own. Off by default (eager)")
    g.add_argument("--pad_to_multiple_of", type=positive_int, default=None,
                   help="pad every batch's width to a multiple of this, so a compiled step meets few shapes (the "
                        "padding is masked, and the masks are drawn over the real width: the same at any multiple). "
                        "Default: 8 with --compile, else 1 (each batch as long as its longest passage)")
    g.add_argument("--seed", type=int, default=42, help="seed of everything (data order, masks, init, dropout)")
    g.add_argument("--dataloader_num_workers", type=non_negative_int, default=None,
                   help="processes that collate (tokenise, mask) the next batches while the device runs the step; "
                        "default with a GPU: the machine's cores shared among its processes, one left to each "
                        "process, at most 8 (collation stays off the step's critical path); 0 on CPU (workers "
                        "would take cores from the step itself). The batches are the same for any value")
    g.add_argument("--on_nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss stops the run naming step and term, or skips that step")

    g = p.add_argument_group("output, checkpoints, logging")
    g.add_argument("--output_dir", required=True,
                   help="run folder: model/, checkpoints/, logs/, train_log.jsonl, loss_curve.png")
    g.add_argument("--overwrite", action="store_true", help="replace an existing run in --output_dir")
    g.add_argument("--checkpointing_steps", type=non_negative_int, default=None,
                   help="save_state every N optimiser steps (0 = never). Default: every "
                        f"{DEFAULT_CHECKPOINT_EVERY} steps in a run of more than {DEFAULT_CHECKPOINT_EVERY}, none in a "
                        "shorter one. A SIGTERM / SIGUSR1 / Ctrl-C writes one after the step it arrives in, in any "
                        "case")
    g.add_argument("--checkpoints_total_limit", type=non_negative_int, default=2,
                   help="keep only the last K checkpoints (0 = all)")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="'latest' (in output_dir/checkpoints) or a checkpoint folder")
    g.add_argument("--export_checkpoint", default=None, metavar="CHECKPOINT",
                   help="write a checkpoint's model as --output_dir/model (a model folder, as a finished run saves) "
                        "and exit; the run's flags and inputs come from the checkpoint's run.json, so only "
                        "--output_dir, --overwrite and --trust_remote_code go with it")
    g.add_argument("--report_to", default="tensorboard",
                   help="accelerate tracker(s): tensorboard, wandb, all, none")
    g.add_argument("--logging_steps", type=positive_int, default=10, help="log every N steps")
    g.add_argument("--no_save_model", action="store_true", help="skip writing model/ at the end (tests, benchmarks)")

    g = p.add_argument_group("scores during training (evaluate.py's tasks, mteb's metrics)")
    g.add_argument("--eval_tasks", nargs="*", default=[],
                   help="score the model on these tasks every --eval_steps and at the end: local folders "
                        "(TaskName=DIR as evaluate.py --local_tasks) or mteb task names (need the hub)")
    g.add_argument("--eval_steps", type=positive_int, default=None,
                   help="score every N optimiser steps (the final model is scored whenever --eval_tasks is given); "
                        "to trackers, train_log.jsonl and loss_curve.png")
    g.add_argument("--eval_limit", type=non_negative_int, default=500,
                   help="queries / pairs / test texts per task (seeded sample, corpus 10 x; 0 = whole tasks). Every "
                        "process runs the scoring and encodes 1/N of the texts; keep it small enough for a "
                        "scoring to take well under NCCL's 10-minute timeout")
    g.add_argument("--eval_batch_size", type=positive_int, default=64, help="texts per forward pass when scoring")

    g = p.add_argument_group("model card and the Hugging Face Hub")
    g.add_argument("--license", default=None,
                   help="licence on the model card (a Hub licence id, e.g. apache-2.0, mit). Default: the start "
                        "model's, read from its card (a derived model is bound by it); none when no card says")
    g.add_argument("--push_to_hub", action="store_true",
                   help="after saving, upload model/ to the Hub repository --hub_model_id (main process only; "
                        "created if absent)")
    g.add_argument("--hub_model_id", default=None,
                   help="Hub repository (namespace/name) of this model: the card's usage code names it, "
                        "xprt_config.json records it, --push_to_hub uploads to it")
    g.add_argument("--hub_private", action="store_true", help="create the Hub repository private")
    g.add_argument("--hub_token", default=None,
                   help="Hub token for --push_to_hub (default: $HF_TOKEN, else the token of `hf auth login`); "
                        "never written to the card")

def check_common_args(args):
    """Sanity checks of the shared flags that fail early with a clear message (the scripts check --eval_tasks'
    folders with evaluate.check_task_specs; numbers out of range are refused by their argparse types)."""
    if args.warmup_ratio is not None and not 0.0 <= args.warmup_ratio < 1.0:
        raise UserError("--warmup_ratio must be in [0, 1)")
    if args.pad_to_multiple_of is None:  # a compiled step meets one shape per width: few widths (8: tensor cores')
        args.pad_to_multiple_of = 8 if args.compile else 1
    if args.eval_steps is not None and not args.eval_tasks:
        raise UserError("--eval_steps needs --eval_tasks (the tasks to score)")
    if args.push_to_hub and not args.hub_model_id:
        raise UserError("--push_to_hub needs --hub_model_id namespace/name")
    if args.push_to_hub and args.no_save_model:
        raise UserError("--push_to_hub uploads the saved model: drop --no_save_model")
