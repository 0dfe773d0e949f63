"""
xPRT step 2: continued pre-training of the encoder on the groups that select_groups.py wrote.

Read it beside the xPRT paper ("The objective", "Experiments"). The objectives (--objective) share data, steps,
batch, schedule and the retention term (40 -> 0), as the paper gives every method the same budget:
  xprt                     L_xp + 0.1 L_cross + L_self + L_MLM + L_unif (modeling_xprt.XPRTModel)
  contrastive_random_span  Contriever-style baseline: two random crops of the anchor
  self_reconstruction      RetroMAE-style baseline: the anchor rebuilt from its own vector
and the ablations --positive random and --no_fill_in.

    accelerate launch train.py --groups_dir groups/ --output_dir runs/xprt      # paper defaults (E5, lr 1e-6)

The file reads top to bottom: flags; the retention schedule; batching; the groups; the Accelerate pieces that
finetune.py shares (accelerator, optimiser groups, checkpoints, saving, the loop); main. The losses live in
modeling_xprt.py, one function per equation; this file only feeds them. PAIR's fine-tuning stage is finetune.py,
which imports the loop from here so that resume, NaN handling and DeepSpeed behave the same in both stages.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from modeling_xprt import (PRETRAIN_OBJECTIVES, atomic_path, crop_spans, describe_prompts, read_jsonl,
                           resolve_model_path)

PAPER_MODEL = "intfloat/e5-base-unsupervised"  # the paper's starting checkpoint (needs the hub or a local copy)
DEFAULT_LR = 1e-6  # the paper's learning rate for continued pre-training from E5


# ----------------------------------------------------------------------------------------------------------------
# Arguments: the pre-training flags, then the groups both stages share (add_common_args)
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--objective", choices=PRETRAIN_OBJECTIVES, default="xprt",
                   help="pre-training objective; the baselines share data, steps, batch, schedule and retention")
    g.add_argument("--no_fill_in", action="store_true",
                   help="ablation: drop the cross/self fill-in losses (paper Table 3)")
    g.add_argument("--positive", choices=["s1", "random"], default="s1",
                   help="positive of the anchor: s1 (top related passage) or a random passage of the document "
                        "(ablation)")
    g.add_argument("--mlm_head_from", default=None,
                   help="take the MLM head from this checkpoint (e.g. bert-base-uncased) when the start has none; "
                        "default: a fresh head tied to the word embeddings")
    g.add_argument("--teacher_name_or_path", default=None,
                   help="frozen teacher of the retention term (default: the starting checkpoint, as in the paper)")

    g = p.add_argument_group("pre-training data")
    g.add_argument("--groups_dir", required=True, help="folder of parquet shards written by select_groups.py")
    g.add_argument("--num_related", type=int, default=4, help="related passages per group (paper: 4)")
    g.add_argument("--max_length", type=int, default=128,
                   help="max tokens of a passage itself; [CLS], [SEP] and the prefix come on top (select_groups.py "
                        "packs passages to --passage_tokens 128 without them, so they arrive whole)")
    g.add_argument("--encoder_mask_rate", type=float, default=None,
                   help="mask rate of the encoder passes (default: the objective's; xprt 15%% as in the paper, "
                        "self_reconstruction 30%% as RetroMAE)")
    g.add_argument("--decoder_mask_rate", type=float, default=None,
                   help="mask rate of the decoder inputs (default: the objective's; xprt 60%%, "
                        "self_reconstruction 50%%)")
    g.add_argument("--max_groups", type=int, default=None, help="use only the first N groups (debugging)")

    g = p.add_argument_group("loss weights (modeling_xprt.LossWeights; None = its defaults)")
    g.add_argument("--xp_weight", type=float, default=None, help="weight of L_xp")
    g.add_argument("--cross_weight", type=float, default=None, help="weight of L_cross (paper: 0.1)")
    g.add_argument("--self_fill_weight", type=float, default=None, help="weight of L_self (not given by the paper)")
    g.add_argument("--mlm_weight", type=float, default=None, help="weight of L_MLM (not given by the paper)")
    g.add_argument("--unif_weight", type=float, default=None, help="weight of L_unif (not given by the paper)")
    g.add_argument("--retention_weight", type=float, default=40.0,
                   help="retention weight at step 0 (paper: 40); 0 turns the term and the teacher off "
                        "(from-BERT setting)")
    g.add_argument("--retention_student", choices=["clean", "masked"], default="clean",
                   help="student vectors in the retention term: 'clean' = one extra pass on the clean anchor and "
                        "s1 (our default), 'masked' = reuse the 15%%-masked vectors (the paper's 5-pass cost; "
                        "masking noise alone gives a non-zero start)")
    g.add_argument("--retention_final_weight", type=float, default=0.0,
                   help="retention weight at the last step (paper: 0)")
    g.add_argument("--retention_schedule", choices=["linear", "cosine", "constant"], default="linear",
                   help="shape of the 40 -> 0 decay (the paper says 'decaying' only)")
    g.add_argument("--head_learning_rate", type=float, default=None,
                   help="peak lr of the parameters the start model did not train: the decoder and the MLM head's "
                        "transform and bias (the vocabulary projection is tied to the embeddings and stays with "
                        "the encoder). Default: --learning_rate, as in the paper. A fresh head (MiniLM, E5) at "
                        "1e-6 keeps the fill-in terms near ln V for thousands of steps; e.g. 1e-4 lets them learn "
                        "(not in the paper)")
    add_common_args(p, DEFAULT_LR)
    args = p.parse_args(argv)

    check_common_args(args, argv, "train.py")
    for name in ("encoder_mask_rate", "decoder_mask_rate"):
        if getattr(args, name) is not None and not 0.0 <= getattr(args, name) < 1.0:
            raise SystemExit(f"--{name} must be in [0, 1)")
    if args.retention_weight < 0 or args.retention_final_weight < 0:
        raise SystemExit("retention weights must be >= 0")
    return args


# ----------------------------------------------------------------------------------------------------------------
# The retention weight: 40 -> 0 over training
# ----------------------------------------------------------------------------------------------------------------
class RetentionSchedule:
    """Weight of the retention term at each optimiser step: the paper's 40 -> 0 decay over training.

    w(t) = w_0 + (w_T - w_0) * shape(t / T), shape = t/T (linear), (1 - cos(pi t/T)) / 2 (cosine) or 0 (constant).
    It keeps its own step counter and is registered with accelerator.register_for_checkpointing, so a resumed run
    continues the decay where it stopped. Weight 0 at both ends turns the term (and the teacher pass) off.
    """

    def __init__(self, start: float, end: float, total_steps: int, shape: str = "linear"):
        self.start, self.end, self.total_steps, self.shape, self.step_count = start, end, max(1, total_steps), shape, 0

    @property
    def enabled(self) -> bool:
        return self.start > 0 or self.end > 0

    def value(self) -> float:
        frac = min(self.step_count / self.total_steps, 1.0)
        if self.shape == "constant":
            frac = 0.0
        elif self.shape == "cosine":
            frac = 0.5 * (1 - math.cos(math.pi * frac))
        return self.start + (self.end - self.start) * frac

    def step(self):
        self.step_count += 1

    # plain ints / floats only, so the checkpoint loads without arbitrary unpickling concerns
    def state_dict(self):
        return {"start": self.start, "end": self.end, "total_steps": self.total_steps, "step_count": self.step_count}

    def load_state_dict(self, state):
        if state["total_steps"] != self.total_steps:
            raise ValueError(f"checkpoint schedule has {state['total_steps']} steps, this run {self.total_steps}: "
                             "resume with the same --max_train_steps / epochs")
        self.step_count = int(state["step_count"])


# ----------------------------------------------------------------------------------------------------------------
# Batching (both stages): length-grouped batches of rows, collated in the loop
# ----------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# Pre-training data: the groups
# ----------------------------------------------------------------------------------------------------------------
def load_groups(groups_dir: str, max_groups=None):
    """The groups folder (schema: select_groups.group_schema()) as a datasets.Dataset, in file then row order.

    It stays memory-mapped (datasets converts the parquet shards to an Arrow cache file once, under HF_HOME, and
    maps it): every process of a run shares the pages through the OS page cache, and a row becomes a Python dict
    only when RowsDataset hands it to the loader. The paper's 0.7-7M groups as Python dicts (six passages of up
    to 128 tokens each) would take GBs to tens of GBs in every process."""
    from datasets import load_dataset

    files = sorted(str(f) for f in Path(groups_dir).glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no *.parquet in {groups_dir}: run select_groups.py first")
    ds = load_dataset("parquet", data_files=files, split="train")
    # The first load converts the shards into the Arrow cache; pyarrow's allocator keeps the freed conversion
    # buffers (about 0.3 GB per 1M groups here) unless asked to hand them back. Later loads convert nothing.
    import pyarrow

    pyarrow.default_memory_pool().release_unused()
    for col in ("doc_id", "anchor", "related", "random_passage"):
        if col not in ds.column_names:
            raise ValueError(f"{groups_dir} lacks column {col!r}: not a select_groups.py output?")
    if max_groups:
        ds = ds.select(range(min(max_groups, len(ds))))
    return ds


def group_lengths(groups, num_related: int, batch_size: int = 8192) -> np.ndarray:
    """Characters of each group's anchor plus its first num_related related passages (what length grouping
    sorts by), as a numpy int64 array.

    Computed with pyarrow compute on Arrow batches of the two columns (no Python dict per row, no cache file
    written, so every process can run it at once); utf8_length counts code points like Python's len, so the
    lengths, and hence the batches, are those of the former per-row Python loop."""
    import pyarrow.compute as pc

    out = np.empty(len(groups), dtype=np.int64)
    pos = 0
    for batch in groups.select_columns(["anchor", "related"]).with_format("arrow").iter(batch_size=batch_size):
        anchor = batch["anchor"].combine_chunks()
        related = pc.list_slice(batch["related"].combine_chunks(), 0, num_related)
        flat = pc.utf8_length(pc.list_flatten(related)).to_numpy(zero_copy_only=False)
        per_group = np.bincount(pc.list_parent_indices(related).to_numpy(zero_copy_only=False), weights=flat,
                                minlength=len(anchor))  # float64: exact for sums below 2**53
        anchor_len = pc.utf8_length(anchor).to_numpy(zero_copy_only=False)
        out[pos:pos + len(anchor)] = anchor_len + per_group.astype(np.int64)
        pos += len(anchor)
    return out


def crop_lengths(groups, collator, seed: int, batch_size: int = 8192):
    """The random-span baseline's batching: (lengths for the sampler, epoch -> crop spans).

    Its views are two random crops of each anchor (XPRTCollator._crops), not the texts: grouping rows by text length
    left about half of each batch padding (padding efficiency 0.49-0.53). So the crops are drawn before batching,
    per (seed, epoch) for every row at once (modeling_xprt.crop_spans, from each anchor's token count, counted
    here once: one tokenizer pass over the anchors, an int32 per row), the sampler sorts by the crops' lengths
    (longer, shorter: two tensors, LengthGroupedBatchSampler._longest_first), and the loop hands each row its
    spans. One epoch's spans are kept at a time (16 bytes per row)."""
    num_tokens = np.empty(len(groups), dtype=np.int32)
    pos = 0
    for batch in groups.select_columns(["anchor"]).iter(batch_size=batch_size):
        ids = collator.crop_token_ids(batch["anchor"])
        num_tokens[pos:pos + len(ids)] = [len(x) for x in ids]
        pos += len(ids)
    cache = {}

    def spans_for(epoch):
        if epoch not in cache:
            cache.clear()
            cache[epoch] = crop_spans(num_tokens, seed, epoch, collator.crop_ratio)
        return cache[epoch]

    def lengths_for(epoch):  # (N, 2): the longer and the shorter crop
        k = spans_for(epoch)[:, :, 1]
        return np.stack([k.max(1), k.min(1)], axis=1)

    return lengths_for, spans_for


# ----------------------------------------------------------------------------------------------------------------
# Accelerate pieces shared with finetune.py: accelerator, run folder, model loading, optimiser groups
# ----------------------------------------------------------------------------------------------------------------


def load_model(accelerator, args, objective: str, **kw):
    """XPRTModel.from_pretrained(--model_name_or_path) and its tokenizer, loaded whole (see whole_weights): the
    fine-tuning start model mines negatives before prepare; DeepSpeed partitions it at prepare."""
    from transformers import AutoTokenizer

    from modeling_xprt import LossWeights, XPRTModel

    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
    weight_flags = [("xp", "xp_weight"), ("cross", "cross_weight"), ("self_fill", "self_fill_weight"),
                    ("mlm", "mlm_weight"), ("unif", "unif_weight"), ("tau", "tau")]
    weights = LossWeights(**{f: getattr(args, a) for f, a in weight_flags if getattr(args, a, None) is not None})
    with whole_weights():
        # the name as given, not the resolved path: the start model (and its prefixes) are recorded by name
        model = XPRTModel.from_pretrained(args.model_name_or_path, objective=objective, weights=weights,
                                          trust_remote_code=args.trust_remote_code, prefixes=args.prefixes, **kw)
    # recorded in xprt_config.json: a model trained from this one names it
    model.hub_model_id = getattr(args, "hub_model_id", None)
    accelerator.print(f"model: {model.load_message}")
    accelerator.print(f"{describe_prompts(model.prompts)} (--prefixes {args.prefixes}; start model "
                      f"{model.start_model})")
    if zero3(accelerator):
        # The tied vocabulary projection (= the word embeddings) and its bias are read in XPRTModel.forward outside
        # the modules that own them: ZeRO-3 must keep them gathered for the whole forward and backward.
        import deepspeed

        for p in model.projection():
            deepspeed.zero.register_external_parameter(model, p)
    if args.gradient_checkpointing:
        model.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints and output
# ----------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# Scores during training (--eval_tasks, --eval_steps)
# ----------------------------------------------------------------------------------------------------------------
def load_eval_tasks(accelerator, args) -> list:
    """evaluate.py's tasks for --eval_tasks, loaded once by every process (each scores, each encodes a share)."""
    if not args.eval_tasks:
        return []
    import evaluate  # the repository's evaluate.py (mteb); imported only when asked for

    tasks = evaluate.load_training_eval_tasks(args.eval_tasks, args.eval_limit or None, seed=args.seed)
    accelerator.print(f"scores during training: {', '.join(t.metadata.name for t in tasks)} every "
                      f"{args.eval_steps or '-'} steps and at the end, at most {args.eval_limit or 'all'} "
                      f"queries / pairs each, the texts split across {accelerator.num_processes} process(es)")
    return tasks


def score_model(accelerator, args, model, tokenizer, tasks, step: int, epoch: int) -> dict:
    """One scoring of the model being trained: a train_log.jsonl record {"step", "epoch", "eval_<task>": score x100,
    "scoring_time_s"}, also sent to the trackers. Dropout off and no gradient inside, training mode restored after."""
    import evaluate

    unwrapped = accelerator.unwrap_model(model)
    t0 = time.time()
    max_length = unwrapped.max_seq_length or min(512, getattr(unwrapped.encoder.config, "max_position_embeddings", 512))
    with _gathered(accelerator, model):  # ZeRO-3: the whole weights for the scoring's forward passes (no-op else)
        scores = evaluate.score_during_training(model, tokenizer, tasks, unwrapped.prompts, max_length,
                                                args.eval_batch_size, accelerator)
    rec = {"step": step, "epoch": epoch, **{EVAL_PREFIX + k: v for k, v in scores.items()},
           "scoring_time_s": time.time() - t0}
    accelerator.log({k: v for k, v in rec.items() if k != "step"}, step=step)
    accelerator.print("step {}: {} ({:.1f} s)".format(step, ", ".join(f"{k} {v:.2f}" for k, v in scores.items()),
                                                      rec["scoring_time_s"]))
    return rec


# ----------------------------------------------------------------------------------------------------------------
# The loop (both stages)
# ----------------------------------------------------------------------------------------------------------------


def prepare_run(accelerator, args, model, rows, lengths, collator, schedules, param_groups, batch_keys=None):
    """The loader (length-grouped batches), AdamW, accelerator.prepare, the lr schedule, the checkpointed state,
    and --resume_from_checkpoint. Returns what the loop needs, as a dict."""
    from transformers import get_scheduler

    # per-device batches: accelerate hands whole batches to the processes in turn
    batch_sampler = LengthGroupedBatchSampler(lengths, args.per_device_train_batch_size, args.seed, keys=batch_keys)
    # generator: the DataLoader draws its base seed from it, not from the global RNG that drives dropout
    dataloader = torch.utils.data.DataLoader(RowsDataset(rows), batch_sampler=batch_sampler, collate_fn=list,
                                             generator=torch.Generator().manual_seed(args.seed))
    param_groups = param_groups or optimizer_groups(model, args.learning_rate, None, args.weight_decay)
    trainable = sum(p.numel() for g in param_groups for p in g["params"])
    names = ", ".join(sorted({g["name"] for g in param_groups}))
    accelerator.print(f"trainable parameters: {trainable:,} ({names})")
    optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate)

    # ---- prepare, then the step count (the prepared loader is sharded: len is per process)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    steps_per_epoch = math.ceil(len(dataloader) / args.gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise SystemExit("not enough data for one step per process: lower the batch size")
    max_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    # AcceleratedScheduler steps once per process per optimiser step: scale like the HF no_trainer examples
    world = accelerator.num_processes
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                                 num_warmup_steps=int(args.warmup_ratio * max_steps) * world,
                                 num_training_steps=max_steps * world)
    lr_scheduler = accelerator.prepare(lr_scheduler)
    for s in schedules:
        s.total_steps = max(1, max_steps)  # the schedules decay over the run's real length
    state = TrainState()
    # Same state on every process: registered with accelerate (saved once, by the main process). The collator's
    # mask RNG differs per process, so each process writes its own (save_checkpoint).
    for obj in (*schedules, state):
        accelerator.register_for_checkpointing(obj)
    if args.resume_from_checkpoint is not None:
        resume(accelerator, args, collator, state)
    return {"model": model, "optimizer": optimizer, "dataloader": dataloader, "batch_sampler": batch_sampler,
            "lr_scheduler": lr_scheduler, "state": state, "max_steps": max_steps, "trainable": trainable,
            "num_epochs": math.ceil(max_steps / steps_per_epoch)}


def train_loop(accelerator, args, model, tokenizer, rows, lengths, collator, step_inputs, *, schedules=(),
               param_groups=None, skip_keys=(), unit="rows", card_title="xprt", batch_keys=None):
    """Prepare, (resume), loop, save: the Accelerate part of both stages.

    rows / lengths: the training rows and their lengths (for length-grouped batches; LengthGroupedBatchSampler takes
    a callable epoch -> lengths too); collator: rows -> batch.
    step_inputs(rows, epoch, step, max_steps) -> (rows to collate, model kwargs, scalars to log) is where the
    stages differ (pre-training: the retention weight and teacher; fine-tuning: the step's negatives and PAIR's
    alpha). schedules: objects with step() / state_dict() stepped once per optimiser step and checkpointed (the
    retention schedule); their total_steps is set here, once the prepared loader gives the run's length.
    batch_keys: one key per row that no batch may repeat (fine-tuning: the query; LengthGroupedBatchSampler).
    Returns {"completed_steps", "max_steps", "output_dir", "trainable_parameters"}.
    """
    from tqdm.auto import tqdm

    out = Path(args.output_dir)
    ckpt_dir, log_path = out / "checkpoints", out / "train_log.jsonl"
    run = prepare_run(accelerator, args, model, rows, lengths, collator, schedules, param_groups, batch_keys)
    model, optimizer, dataloader, lr_scheduler = run["model"], run["optimizer"], run["dataloader"], run["lr_scheduler"]
    state, max_steps, world = run["state"], run["max_steps"], accelerator.num_processes

    accelerator.print(
        f"{accelerator.distributed_type} x {world}, mixed precision {accelerator.mixed_precision}; "
        f"{card_title}: {len(rows)} {unit}, {max_steps} steps x {args.per_device_train_batch_size} per device x "
        f"{world} processes x {args.gradient_accumulation_steps} accumulation; in-batch negatives per step = "
        f"{args.per_device_train_batch_size * world} (accumulation adds none); lr {args.learning_rate}")
    if accelerator.is_main_process:
        cfg = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in vars(args).items()}
        accelerator.init_trackers("xprt", config=cfg)

    eval_tasks = load_eval_tasks(accelerator, args)
    last_scored = -1

    def log_record(rec):
        if log_f:
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()

    model.train()
    window, first_step_printed = LogWindow(), False
    progress = tqdm(total=max_steps, initial=state.completed_steps, disable=not accelerator.is_local_main_process,
                    desc="train")
    stop_at = min(max_steps, args.stop_after_steps or max_steps)
    log_f = open(log_path, "a", encoding="utf-8") if accelerator.is_main_process else None
    for epoch in range(state.epoch, run["num_epochs"]):
        if state.completed_steps >= stop_at:
            break
        # accelerate's loader re-sets the sampler's epoch from its own iteration counter on every __iter__; a resumed
        # run must move that counter too, or epochs after the resumed one would replay epoch 0's order
        dataloader.set_epoch(epoch)
        run["batch_sampler"].set_epoch(epoch)
        skip = state.batches_in_epoch if epoch == state.epoch else 0
        state.epoch, state.batches_in_epoch = epoch, skip
        # skip_first_batches skips at the sampler level: no collation, no RNG drawn for the skipped batches
        active = accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        for rows_b in active:
            rows_b, model_kw, scalars = step_inputs(rows_b, epoch, state.completed_steps, max_steps)
            batch = collator(rows_b)
            real, proc = padding_efficiency(batch, skip=skip_keys)  # on the CPU tensors: no device sync
            batch = batch_to_device(batch, accelerator.device)
            window.real, window.proc = window.real + real, window.proc + proc
            if not first_step_printed:
                accum = args.gradient_accumulation_steps * world
                accelerator.print(f"tokens per step: ~{real * accum} real, {proc * accum} processed (first batch)")
                first_step_printed = True
            with accelerator.accumulate(model):
                outputs = model(batch, **model_kw)
                terms = {k: v for k, v in outputs.items() if torch.is_tensor(v) and v.dim() == 0}
                where = f"step {state.completed_steps + 1} (epoch {epoch})"
                if args.on_nonfinite == "stop" or finite_everywhere(accelerator, terms, where):
                    accelerator.backward(outputs["loss"])
                    if accelerator.sync_gradients and args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    window.add_terms(terms, state.completed_steps + 1)
                else:
                    optimizer.zero_grad()  # drops this step's accumulated gradients too: nothing non-finite applied
                    window.n_skipped += 1
            state.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            # ---- one optimiser step done
            state.completed_steps += 1
            for s in schedules:
                s.step()
            progress.update(1)
            log_now = state.completed_steps % args.logging_steps == 0 or state.completed_steps == stop_at
            ckpt_now = args.checkpointing_steps and state.completed_steps % args.checkpointing_steps == 0
            if args.on_nonfinite == "stop" and (log_now or ckpt_now):
                window.check_finite(accelerator, epoch)  # --on_nonfinite stop: before anything is logged or saved
            if log_now:
                rec = window.record(accelerator, args, state.completed_steps, epoch, lr_scheduler, optimizer, scalars)
                accelerator.log({k: v for k, v in rec.items() if k != "step"}, step=state.completed_steps)
                log_record(rec)
                progress.set_postfix(loss=f"{rec.get('loss', float('nan')):.4f}",
                                     s_per_step=f"{rec['time_per_step_s']:.2f}")
            if eval_tasks and args.eval_steps and state.completed_steps % args.eval_steps == 0:
                scored = score_model(accelerator, args, model, tokenizer, eval_tasks, state.completed_steps, epoch)
                log_record(scored)
                window.t0 += scored["scoring_time_s"]  # tokens/s and time per step count training only
                last_scored = state.completed_steps
            if ckpt_now:
                save_checkpoint(accelerator, model, collator, ckpt_dir, state.completed_steps,
                                args.checkpoints_total_limit)
            if state.completed_steps >= stop_at:
                break
        else:
            state.batches_in_epoch = 0  # epoch finished: the next one starts at its first batch
            continue
        break
    progress.close()
    if eval_tasks and last_scored != state.completed_steps:  # the final model (or where the run stopped)
        log_record(score_model(accelerator, args, model, tokenizer, eval_tasks, state.completed_steps, state.epoch))
    if log_f:
        log_f.close()

    save_run(accelerator, args, model, tokenizer, state.completed_steps >= max_steps, out, log_path,
             {"steps": state.completed_steps, "processes": world, "rows": len(rows), "unit": unit}, card_title)
    return {"completed_steps": state.completed_steps, "max_steps": max_steps, "output_dir": str(out),
            "trainable_parameters": run["trainable"]}


def save_run(accelerator, args, model, tokenizer, finished, out, log_path, summary, card_title):
    """End of a run: the loss-curve picture, and for a finished run the model folder with its card (then the Hub)."""
    accelerator.wait_for_everyone()
    logged = log_path.exists() and log_path.stat().st_size
    if accelerator.is_main_process and logged:
        plot_loss_curves(log_path, out / "loss_curve.png")
    if finished and not args.no_save_model:
        # the card's loss table: the last record with losses (score records of --eval_steps come after it)
        losses = [r for r in read_jsonl(log_path) if "loss" in r] if logged else []
        summary = {**summary, "last_logged_step": losses[-1] if losses else {}}
        card = model_card(args, card_title, summary, accelerator.unwrap_model(model))
        save_model(accelerator, model, tokenizer, out / "model", card)
    accelerator.end_training()
    if finished and not args.no_save_model and getattr(args, "push_to_hub", False) and accelerator.is_main_process:
        push_to_hub(args, out / "model")


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    from accelerate.utils import set_seed

    from modeling_xprt import XPRTCollator, load_teacher

    # Some objectives leave heads unused (no decoder without fill-in), which DDP only tolerates with
    # find_unused_parameters.
    all_used = args.objective == "xprt" and not args.no_fill_in
    accelerator = make_accelerator(args, find_unused_parameters=not all_used)
    prepare_output_dir(accelerator, args)
    set_seed(args.seed)

    model, tokenizer = load_model(accelerator, args, args.objective, mlm_head_from=args.mlm_head_from,
                                  fill_in=not args.no_fill_in, retention_student=args.retention_student)
    args.prompts = model.prompts  # recorded in the model card

    # ---- data: the groups; a different mask RNG per process, the same across restarts
    rows = load_groups(args.groups_dir, args.max_groups)
    # the Hub dataset the groups were selected from (select_groups.py --dataset), for the card's metadata
    stats = Path(args.groups_dir) / "stats.json"
    source = json.loads(stats.read_text()).get("dataset") if stats.is_file() else None
    args.card_datasets = [source] if source else None
    collator = XPRTCollator(tokenizer, objective=args.objective, num_related=args.num_related,
                            max_length=args.max_length, encoder_mask_rate=args.encoder_mask_rate,
                            decoder_mask_rate=args.decoder_mask_rate,
                            passage_prefix=model.prompts["document"], positive=args.positive,
                            seed=args.seed + accelerator.process_index)
    if args.objective == "contrastive_random_span":
        lengths, spans_for = crop_lengths(rows, collator, args.seed)
    else:
        lengths, spans_for = group_lengths(rows, args.num_related), None

    # ---- the retention term: a frozen teacher (never prepared: it never trains) and the 40 -> 0 weight, whose
    # length train_loop sets once it knows the run's
    retention = RetentionSchedule(args.retention_weight, args.retention_final_weight, 1, args.retention_schedule)
    teacher = None
    if retention.enabled:
        with whole_weights():
            teacher_path = resolve_model_path(args.teacher_name_or_path or args.model_name_or_path)
            teacher = load_teacher(teacher_path, trust_remote_code=args.trust_remote_code).to(accelerator.device)
    accelerator.print(f"retention {args.retention_weight} -> {args.retention_final_weight} "
                      f"({args.retention_schedule}); heads lr {args.head_learning_rate or args.learning_rate}")

    def step_inputs(rows_b, epoch, step, max_steps):
        w = retention.value() if teacher is not None else 0.0
        if spans_for is not None:  # the crops the batch sampler grouped the rows by
            spans = spans_for(epoch)
            rows_b = [{**r, "crop_spans": spans[r["__index__"]]} for r in rows_b]
        rows_b = [{k: v for k, v in r.items() if k != "__index__"} for r in rows_b]
        return rows_b, {"teacher": teacher, "retention_weight": w}, {"retention_weight": w, "pair_alpha": 0.0}

    param_groups = optimizer_groups(model, args.learning_rate, args.head_learning_rate, args.weight_decay)
    title = f"xprt pretrain ({args.objective})"
    return train_loop(accelerator, args, model, tokenizer, rows, lengths, collator, step_inputs,
                      schedules=(retention,), param_groups=param_groups, unit="groups", card_title=title,
                      skip_keys=() if teacher is not None else ("retain_",))


if __name__ == "__main__":
    main()
