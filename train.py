"""
xPRT step 2: continued pre-training of the encoder on the groups that select_groups.py wrote.

Read it beside the xPRT paper ("The objective", "Experiments"). The objectives (--objective) share data, steps,
batch, schedule and the retention term (40 -> 0), as the paper gives every method the same budget:
  xprt                     L_xp + 0.1 L_cross + L_self + L_MLM + L_unif (modeling_xprt.XPRTObjective)
  the comparison arms      random spans, RetroMAE, SimLM, Contriever, the self-reconstruction ablation (baselines.py),
                           Revela (revela.py); --baseline_setting official runs the baselines as their authors do
and the ablations --positive random and --no_fill_in.

    accelerate launch train.py --groups_dir groups/ --output_dir runs/xprt      # paper defaults (E5, lr 1e-6)

The file reads top to bottom: flags; the retention schedule; the groups; the FLOP count behind the logged MFU; main,
which reads accelerator, model, data, optimiser and scheduler, prepare, the loop, save. The losses live in
modeling_xprt.py, one function per equation; the plumbing (checkpoints, logs, the model card) in support.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

from architectures import head_multiply_adds, layer_multiply_adds, load_teacher
import baselines  # noqa: F401  (registers the comparison objectives as --objective choices)
from modeling_xprt import LossWeights, XPRTModel, objective_class, pretraining_objectives
from support import (EVAL_PREFIX, ArgumentParser, LengthGroupedBatchSampler, LogWindow, RowsDataset, TrainState,
                     UserError, add_common_args, atomic_write, batch_to_device, check_batch_fits, check_common_args,
                     check_model_name, engine_dtype, epoch_batches, explain_oom, gradient_cache_step,
                     in_batch_negatives, load_model, local_inputs, make_accelerator, memory_estimate, optimizer_groups,
                     positive_int, prepare_output_dir, read_json, resolve_model_path, resume, run_script,
                     sampler_negatives, save_checkpoint, save_model, save_run, whole_weights, write_log_record, zero3)

DEFAULT_LR = 1e-6  # the paper's learning rate for continued pre-training from E5
# Dense bf16 peak of one device (vendor figures), for the MFU estimate; --peak_tflops for any other device.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


# ----------------------------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------------------------
def build_parser():
    """train.py's flags (experiments/paper/run.py reads --objective's choices from here, so it never drifts)."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--objective", choices=pretraining_objectives(), default="xprt",
                   help="pre-training objective; the baselines share data, steps, batch, schedule and retention")
    g.add_argument("--no_fill_in", action="store_true",
                   help="xprt ablation: drop the cross fill-in loss L_cross (the paper's 'without the fill-in loss', "
                        "Table 3); L_self stays")
    g.add_argument("--positive", choices=["s1", "random"], default="s1",
                   help="positive of the anchor: s1 (top related passage) or a random passage of the document "
                        "(ablation)")
    g.add_argument("--mlm_head_from", default=None,
                   help="take the MLM head from this checkpoint (e.g. bert-base-uncased) when the start has none; "
                        "default: a fresh head tied to the word embeddings")
    g.add_argument("--teacher_name_or_path", default=None,
                   help="frozen teacher of the retention term (default: the starting checkpoint, as in the paper)")
    g.add_argument("--generator_name_or_path", default=None,
                   help="simlm: the frozen generator that samples the replaced tokens (default: SimLM's, "
                        "google/electra-base-generator); it must share the start model's vocabulary")

    g.add_argument("--baseline_setting", choices=["paper", "official"], default=None,
                   help="retromae, simlm, contriever: 'official' runs each as its authors' code does ([CLS] vector "
                        "for RetroMAE and SimLM, saved as the folder's pooling; dot products of unnormalised vectors "
                        "for Contriever; SimLM's generator with dropout), 'paper' pools and scores every arm as the "
                        "start model (default; baselines.BASELINE_SETTINGS lists every choice)")
    g = p.add_argument_group("revela (revela.py; defaults: the official run's, TRUMANCFY/Revela train.sh)")
    g.add_argument("--lm_name_or_path", default=None,
                   help="revela: the causal language model the retriever trains through (default Qwen/Qwen2.5-0.5B, "
                        "as the xPRT paper runs Revela)")
    g.add_argument("--lora_rank", type=int, default=None, help="revela: LoRA rank of the language model (default 256)")
    g.add_argument("--lora_alpha", type=float, default=None, help="revela: LoRA alpha (default 64)")
    g.add_argument("--lora_dropout", type=float, default=None, help="revela: LoRA dropout (default 0.1)")
    g.add_argument("--lora_target_modules", default=None,
                   help="revela: comma-separated module names LoRA adapts (default every linear layer of the "
                        "blocks: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    g.add_argument("--attn_temperature", type=float, default=None,
                   help="revela: temperature of the softmax over the retriever's cosines that weights the in-batch "
                        "attention (default 1e-4)")
    g.add_argument("--extra_anchors", type=int, default=None,
                   help="revela: anchors of other documents added to each group's anchor and related passages "
                        "(default 11: 16 passages per group, as the xPRT paper runs it)")

    g = p.add_argument_group("pre-training data")
    g.add_argument("--groups_dir", required=True, help="folder of parquet shards written by select_groups.py")
    g.add_argument("--num_related", type=positive_int, default=4, help="related passages per group (paper: 4)")
    g.add_argument("--max_length", type=int, default=128,
                   help="max tokens of a passage itself; [CLS], [SEP] and the prefix come on top (select_groups.py "
                        "packs passages to --passage_tokens 128 without them, so they arrive whole)")
    g.add_argument("--encoder_mask_rate", type=float, default=None,
                   help="mask rate of the encoder passes (default: the objective's; xprt 15%% as in the paper, "
                        "self_reconstruction 30%% as RetroMAE)")
    g.add_argument("--decoder_mask_rate", type=float, default=None,
                   help="mask rate of the decoder inputs (default: the objective's; xprt 60%%, "
                        "self_reconstruction 50%%)")
    g.add_argument("--max_groups", type=positive_int, default=None, help="use only the first N groups (debugging)")
    g.add_argument("--spread_documents", type=positive_int, default=16,
                   help="deal each run of N length-sorted batches round-robin, so that the groups of one document "
                        "(nearly equal lengths: they share its passages) land in different batches, where they would "
                        "be masked out of each other's negatives; 1 = off (figures: bench/README.md). Objectives whose "
                        "collator groups by other lengths (random spans: the crops') ignore it")
    g.add_argument("--max_document_groups_per_batch", type=int, default=None,
                   help="at most N groups of one document in a batch (default: half the per-device batch; 0 = no "
                        "cap): L_xp masks a document's groups out of each other's negatives, so a document that "
                        "fills a batch leaves its rows none and L_xp exactly 0. Groups over the cap wait out the epoch "
                        "(the log says how many)")
    g.add_argument("--min_in_batch_negatives", type=float, default=None,
                   help="warn when the in-batch negatives a row keeps after the same-document mask (logged as "
                        "in_batch_negatives, the mean over rows) fall below this (default: half the global batch)")

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
    g.add_argument("--peak_tflops", type=float, default=None,
                   help="peak TFLOP/s of one device in the run's precision, for the logged MFU estimate (default: "
                        "a table of known GPUs, bf16 dense; none on CPU, where only TFLOP/s is logged)")
    g = p.add_argument_group("stopping signal (experiments/README.md: how to read the curves)")
    g.add_argument("--save_best", default=None, metavar="TASK",
                   help="keep the model of the best score during training in <output_dir>/best_model (best.json says "
                        "its step): an --eval_tasks task's name (its mteb main score, e.g. SciFact) or 'average' "
                        "(mean over --eval_tasks); needs --eval_tasks")
    add_common_args(p, DEFAULT_LR)
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)

    check_common_args(args)
    if args.save_best and not args.eval_tasks:
        raise UserError("--save_best needs --eval_tasks (the scores it picks the best model by)")
    if args.eval_tasks:
        # imported before the run seeds its generators (importing mteb draws from them); a local folder that is
        # no known task stops the run now rather than after the first N steps
        import evaluate

        evaluate.check_task_specs(args.eval_tasks)
    for name in ("encoder_mask_rate", "decoder_mask_rate"):
        if getattr(args, name) is not None and not 0.0 <= getattr(args, name) < 1.0:
            raise UserError(f"--{name} must be in [0, 1)")
    if args.retention_weight < 0 or args.retention_final_weight < 0:
        raise UserError("retention weights must be >= 0")
    if args.positive == "random" and args.retention_student == "masked" and args.retention_weight > 0:
        raise UserError("--positive random with --retention_student masked: the masked pass's slot 1 holds the "
                        "random passage, while every method's retention pairs are anchor x s1; use the clean student")
    return args


def check_inputs(args):
    """What the flags point to, checked before anything loads: the models exist here (or in the offline Hub's
    cache), the groups folder is a finished selection with enough groups for one step (WORLD_SIZE: the processes
    torchrun / accelerate launch start)."""
    for flag in ("model_name_or_path", "teacher_name_or_path", "mlm_head_from", "generator_name_or_path"):
        if getattr(args, flag):
            check_model_name(getattr(args, flag), f"--{flag}")
    n_groups = count_groups(args.groups_dir)
    check_batch_fits(min(n_groups, args.max_groups or n_groups), args.per_device_train_batch_size,
                     int(os.environ.get("WORLD_SIZE", 1)), "groups")


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
# Pre-training data: the groups
# ----------------------------------------------------------------------------------------------------------------
def count_groups(groups_dir: str) -> int:
    """The number of groups a finished selection holds (its stats.json, which select_groups.py writes last): refused
    when the folder holds no finished selection, or one with no groups (naming why, from its counts)."""
    stats = Path(groups_dir) / "stats.json"
    if not stats.is_file():
        what = "no such folder" if not Path(groups_dir).is_dir() else "no stats.json, which select_groups.py writes " \
            "when it has finished: an interrupted selection (rerun its command to finish it) or no groups folder"
        raise UserError(f"--groups_dir {groups_dir}: {what}")
    groups = read_json(stats).get("groups")
    if groups == 0:
        raise UserError(f"--groups_dir {groups_dir}: the selection found no groups ({stats}: "
                        f"{read_json(stats).get('no_groups_reason', 'see its counts')}); select again")
    return groups or 0


def load_groups(groups_dir: str, max_groups=None):
    """The groups folder (schema: select_groups.group_schema()) as a datasets.Dataset, in file then row order.

    It stays memory-mapped (datasets converts the parquet shards to an Arrow cache file once, under HF_HOME, and
    maps it): every process of a run shares the pages through the OS page cache, and a row becomes a Python dict
    only when RowsDataset hands it to the loader. The paper's 0.7-7M groups as Python dicts (six passages of up
    to 128 tokens each) would take GBs to tens of GBs in every process."""
    from datasets import load_dataset

    # stats.json is what select_groups.py writes last: without it the selection was interrupted (rerunning its command
    # resumes it), and the folder may hold an unfinished chunk's temporary shard
    stats = Path(groups_dir) / "stats.json"
    count_groups(groups_dir)
    # the finished shards only: ".tmp-*" files are a killed run's half-written ones (support.atomic_path)
    files = sorted(str(f) for f in Path(groups_dir).glob("*.parquet") if not f.name.startswith("."))
    if not files:
        raise UserError(f"--groups_dir {groups_dir}: no *.parquet shards beside its stats.json")
    ds = load_dataset("parquet", data_files=files, split="train")
    expected = json.loads(stats.read_text()).get("groups")
    if expected is not None and len(ds) != expected:
        raise UserError(f"{groups_dir}: its shards hold {len(ds):,} groups, its stats.json {expected:,}: shards were "
                        "added or removed after the selection finished")
    # The first load converts the shards into the Arrow cache; pyarrow's allocator keeps the freed conversion
    # buffers unless asked to hand them back. Later loads convert nothing.
    import pyarrow

    pyarrow.default_memory_pool().release_unused()
    for col in ("doc_id", "anchor", "related", "random_passage"):
        if col not in ds.column_names:
            raise UserError(f"{groups_dir} lacks column {col!r}: not a select_groups.py output?")
    if max_groups:
        ds = ds.select(range(min(max_groups, len(ds))))
    return ds


# ----------------------------------------------------------------------------------------------------------------
# The FLOP count behind the logged MFU (docs/notes.md: BERT-base at 128 tokens is about 87M multiply-adds per token
# in the encoder and 24M in the MLM head; 2 FLOPs per multiply-add; a backward costs twice its forward)
# ----------------------------------------------------------------------------------------------------------------
def step_flops(model, batch, retention: bool) -> float:
    """Model FLOPs of one collated micro-batch: every trained pass forward and backward (3x its forward), the frozen
    teacher and L_self's teacher rows forward only. Padded tokens count (the device computes them); embedding
    lookups, norms and softmaxes do not."""
    # one layer's weight matrices read off its modules (BERT: QKV + output 4 h^2, FFN 2 h inner), whatever the
    # config calls them (DistilBERT: n_layers, hidden_dim)
    n_enc, per_token, h = layer_multiply_adds(model.encoder)

    def layers(ids, n, extra=0):  # multiply-adds of n Transformer layers over an (..., L) tensor (L + extra wide)
        length = ids.shape[-1] + extra
        tokens = ids.numel() // ids.shape[-1] * length
        return n * tokens * (per_token + 2 * length * h)  # weight matrices, attention scores and sums

    trained, forward = 0, 0
    head = head_multiply_adds(model.encoder)  # the MLM head's transform and vocabulary projection, per row
    if hasattr(model.method, "multiply_adds"):  # an objective that counts its own passes (baselines.py)
        trained, forward = model.method.multiply_adds(model, batch, layers, head)
    else:
        for key in ("input_ids", "short_input_ids", "query_input_ids", "passage_input_ids"):
            if key in batch:
                trained += layers(batch[key], n_enc)
        if "dec_input_ids" in batch:  # a conditioned decoder (xPRT, the self-reconstruction ablation)
            dec = model.method.decoder
            trained += layers(batch["dec_input_ids"], len(dec.layers), dec.num_condition_vectors)
        trained += head * sum(batch[k].numel() for k in ("mlm_index", "cross_rows", "self_rows", "dec_rows")
                              if k in batch)
        forward += head * batch["self_enc_index"].numel() if "self_enc_index" in batch else 0
    if retention:
        teacher = layers(batch["retain_input_ids"], n_enc)
        forward += teacher
        if model.retention_student == "clean":
            trained += teacher  # the clean student pass
    return 2.0 * (3 * trained + forward)


def peak_flops(accelerator, args):
    """One device's peak FLOP/s for the MFU estimate: --peak_tflops, else a known GPU's bf16 peak, else None."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if accelerator.device.type == "cuda":
        name = torch.cuda.get_device_name(accelerator.device)
        return next((t * 1e12 for k, t in PEAK_BF16_TFLOPS.items() if k in name), None)
    return None


# ----------------------------------------------------------------------------------------------------------------
# The model and the data
# ----------------------------------------------------------------------------------------------------------------
def load_pretraining_model(accelerator, args):
    """XPRTModel.from_pretrained(--model_name_or_path) for --objective, with the options of it the flags set (an
    option the objective does not take is refused, naming it), and its tokenizer (support.load_model)."""
    weight_flags = [("xp", "xp_weight"), ("cross", "cross_weight"), ("self_fill", "self_fill_weight"),
                    ("mlm", "mlm_weight"), ("unif", "unif_weight")]
    options = {}
    if any(getattr(args, a) is not None for _, a in weight_flags):
        options["weights"] = LossWeights(**{f: getattr(args, a) for f, a in weight_flags
                                            if getattr(args, a) is not None})
    if args.no_fill_in:
        options["fill_in"] = False
    if args.generator_name_or_path:
        options["generator_name_or_path"] = args.generator_name_or_path
    # an objective's own flags, given only when set (an option its objective does not take is refused, naming it)
    for flag in ("baseline_setting", "lm_name_or_path", "lora_rank", "lora_alpha", "lora_dropout", "attn_temperature",
                 "extra_anchors"):
        if getattr(args, flag) is not None:
            options[flag] = getattr(args, flag)
    if args.lora_target_modules:
        options["lora_target_modules"] = args.lora_target_modules.split(",")
    return load_model(accelerator, args, XPRTModel, objective=args.objective, mlm_head_from=args.mlm_head_from,
                      retention_student=args.retention_student, **options)


def load_data(accelerator, args, model, tokenizer):
    """The groups, the objective's collator (a different mask RNG per process, the same across restarts) and the
    length-grouped sampler over what the collator sorts by (the random-span baseline: its crops' lengths, and
    row_extras(epoch, i) hands each row its crops) -> (rows, collator, sampler, row_extras)."""
    rows = load_groups(args.groups_dir, args.max_groups)
    collator = model.method.make_collator(tokenizer, num_related=args.num_related, max_length=args.max_length,
                                          encoder_mask_rate=args.encoder_mask_rate,
                                          decoder_mask_rate=args.decoder_mask_rate,
                                          passage_prefix=model.prompts["document"], positive=args.positive,
                                          seed=args.seed + accelerator.process_index)
    lengths, row_extras = collator.sort_lengths(rows, args.seed)
    spread = args.spread_documents if collator.spread_documents else 1
    bs, world = args.per_device_train_batch_size, accelerator.num_processes
    cap = max(bs // 2, 1) if args.max_document_groups_per_batch is None else args.max_document_groups_per_batch
    docs = np.unique(rows["doc_id"], return_inverse=True)[1]  # (groups,) a group's document as an integer
    sampler = LengthGroupedBatchSampler(lengths, bs, args.seed, spread=spread, keys=docs, max_per_key=cap)
    neg, floor = sampler_negatives(sampler, docs), args.min_in_batch_negatives or bs * world // 2
    accelerator.print(f"in-batch negatives left by the same-document mask (epoch 0, exact, per process's batch of "
                      f"{bs}): mean {neg['mean']:.2f} per row, min {neg['min']}, {neg['rows_without']} of "
                      f"{neg['rows']} rows with none; at most {cap or 'any'} groups of one document per batch "
                      f"(--max_document_groups_per_batch) left {sampler.rows_left_out:,} of {len(rows):,} groups "
                      "out of each epoch")
    if neg["mean"] * world < floor:
        accelerator.print(f"warning: a row keeps {neg['mean']:.2f} in-batch negatives on average (< "
                          f"--min_in_batch_negatives {floor}): few documents fill the batches; lower "
                          "--max_document_groups_per_batch or select from more documents")
    return rows, collator, sampler, row_extras


def load_retention(accelerator, args):
    """The retention term: its 40 -> 0 weight and the frozen start model (never prepared: it never trains; None when
    the weight is 0 at both ends) -> (retention, teacher)."""
    retention = RetentionSchedule(args.retention_weight, args.retention_final_weight, 1, args.retention_schedule)
    teacher = None
    if retention.enabled:
        with whole_weights():
            teacher_path = resolve_model_path(args.teacher_name_or_path or args.model_name_or_path)
            teacher = load_teacher(teacher_path, trust_remote_code=args.trust_remote_code)
        # the student's precision: under DeepSpeed bf16 the student's weights are bf16, and an fp32 teacher would put
        # a precision gap into the retention term from step 0 (under autocast both run inside the same autocast)
        teacher.to(accelerator.device, dtype=engine_dtype(accelerator))
    accelerator.print(f"retention {args.retention_weight} -> {args.retention_final_weight} "
                      f"({args.retention_schedule}); heads lr {args.head_learning_rate or args.learning_rate}")
    return retention, teacher


# ----------------------------------------------------------------------------------------------------------------
# The stopping signal: the drift from the start model beside the scores, and the best model by a score
# ----------------------------------------------------------------------------------------------------------------
def teacher_cosine(model, teacher, batch) -> torch.Tensor:
    """Drift from the start model: the mean cosine between the trained encoder's and the frozen start model's vectors
    of the batch's clean anchors and top related passages (the retention term's pairs and passes: no dropout, here no
    gradient). 1.0 at step 0. Computed on logging steps only (one extra forward of 2 x groups passages) and left on
    the device: the logging step's one read-back (LogWindow.record) averages it over the processes' batches."""
    with torch.no_grad():
        s, t = model.sentence_vectors(model._clean_vectors(batch)), model.teacher_vectors(batch, teacher)
    return torch.nn.functional.cosine_similarity(s.float(), t.float(), dim=-1).mean()


def keep_best(accelerator, args, model, tokenizer, rec: dict, best: dict) -> dict:
    """--save_best: when a scoring record (TrainingScorer's) beats the best so far, the model goes to
    <output_dir>/best_model (atomically, as model/) and best.json names its step and score -> the best record."""
    scores = {k[len(EVAL_PREFIX):]: v for k, v in rec.items() if k.startswith(EVAL_PREFIX)}
    if args.save_best not in scores and args.save_best != "average":
        raise UserError(f"--save_best {args.save_best!r}: the scored tasks are {sorted(scores)} (or 'average')")
    score = sum(scores.values()) / len(scores) if args.save_best == "average" else scores[args.save_best]
    if best and score <= best["score"]:
        return best
    best = {"step": rec["step"], "by": args.save_best, "score": score, "scores": scores}
    out = Path(args.output_dir)
    card = (f"# best model of {out.name}\n\nStep {rec['step']} of the run, the best {args.save_best} score during "
            f"training ({score:.2f}; train.py --save_best). The finished run's model and card are in model/.\n")
    save_model(accelerator, model, tokenizer, out / "best_model", card)
    if accelerator.is_main_process:
        atomic_write(out / "best.json", json.dumps(best, indent=1))
    return best


# ----------------------------------------------------------------------------------------------------------------
# Main: accelerator, model, data, optimiser and scheduler, prepare, the loop, save
# ----------------------------------------------------------------------------------------------------------------
@explain_oom
def main(argv=None):
    args = parse_args(argv)
    check_inputs(args)
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # the card shows the command
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    # ---- accelerator. Some objectives leave heads unused (random spans never read the MLM head), which DDP only
    # tolerates with find_unused_parameters.
    accelerator = make_accelerator(args, find_unused_parameters=not objective_class(args.objective).trains_every_head)
    resumed = args.resume_from_checkpoint if args.resume_from_checkpoint != "latest" else None
    prepare_output_dir(accelerator, args, "train.py", local_inputs(
        groups_dir=args.groups_dir, model_name_or_path=args.model_name_or_path,
        teacher_name_or_path=args.teacher_name_or_path, mlm_head_from=args.mlm_head_from,
        generator_name_or_path=args.generator_name_or_path, eval_tasks=[t.rpartition("=")[2] for t in args.eval_tasks],
        resume_from_checkpoint=resumed))
    set_seed(args.seed)

    # ---- model
    model, tokenizer = load_pretraining_model(accelerator, args)

    # ---- data: the groups, length-grouped batches; then the retention term's frozen teacher and its weight
    rows, collator, sampler, row_extras = load_data(accelerator, args, model, tokenizer)
    retention, teacher = load_retention(accelerator, args)
    # collate_fn=list: rows are collated in the loop, not in the DataLoader, whose prefetching would advance the
    # collator's mask RNG past a checkpoint; generator: its base seed, not the global RNG that drives dropout
    dataloader = torch.utils.data.DataLoader(RowsDataset(rows), batch_sampler=sampler, collate_fn=list,
                                             generator=torch.Generator().manual_seed(args.seed))

    # ---- optimiser (AdamW; the heads at --head_learning_rate) and, once the prepared loader gives the run's length,
    # the scheduler (10% warmup, then linear decay)
    param_groups = optimizer_groups(model, args.learning_rate, args.head_learning_rate, args.weight_decay)
    trainable = sum(p.numel() for g in param_groups for p in g["params"])
    accelerator.print(f"trainable parameters: {trainable:,} "
                      f"({', '.join(sorted({g['name'] for g in param_groups}))})")
    optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate)

    # ---- prepare (the prepared loader is sharded: its length is per process)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    steps_per_epoch = math.ceil(len(dataloader) / args.gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise UserError("not enough data for one step per process: lower --per_device_train_batch_size")
    max_steps = args.max_train_steps if args.max_train_steps is not None else args.num_train_epochs * steps_per_epoch
    world = accelerator.num_processes
    # AcceleratedScheduler steps once per process per optimiser step: scaled like the HF no_trainer examples
    lr_scheduler = accelerator.prepare(get_scheduler(args.lr_scheduler_type, optimizer,
                                                     num_warmup_steps=int(args.warmup_ratio * max_steps) * world,
                                                     num_training_steps=max_steps * world))
    retention.total_steps = max(1, max_steps)  # the 40 -> 0 decay runs over the run's real length
    state = TrainState()
    for obj in (retention, state):  # the same on every process: saved once; the collator RNG by each process
        accelerator.register_for_checkpointing(obj)
    if args.resume_from_checkpoint is not None:
        resume(accelerator, args, collator, state)
    accelerator.print(
        f"{accelerator.distributed_type} x {world}, mixed precision {accelerator.mixed_precision}; {len(rows)} "
        f"groups, {max_steps} steps x {args.per_device_train_batch_size} per device x {world} processes x "
        f"{args.gradient_accumulation_steps} accumulation; in-batch negatives per step = "
        f"{args.per_device_train_batch_size * world} (accumulation adds none; the same-document mask leaves fewer: "
        f"in_batch_negatives in the log); lr {args.learning_rate}")
    if accelerator.is_main_process:
        accelerator.init_trackers("xprt", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                  for k, v in vars(args).items()})
    scorer = None
    if args.eval_tasks:  # evaluate.py's tasks and mteb's metrics, every --eval_steps and at the end
        import evaluate

        scorer = evaluate.TrainingScorer(accelerator, args, tokenizer)

    # ---- the loop
    model.train()
    window = LogWindow(accelerator, args, lr_scheduler, optimizer, max_steps, peak_flops(accelerator, args))
    stop_at = min(max_steps, args.stop_after_steps or max_steps)
    skip_keys = () if teacher is not None else ("retain_",)  # tokens retention never reads are not counted
    log_path, first_batch, best = Path(args.output_dir) / "train_log.jsonl", True, {}
    for epoch in range(state.epoch, math.ceil(max_steps / steps_per_epoch)):
        if state.completed_steps >= stop_at:
            break
        for indexed in epoch_batches(accelerator, dataloader, sampler, state, epoch):  # [(row index, row)]
            rows_b = [r for _, r in indexed]
            if row_extras is not None:  # e.g. the crops the batch sampler grouped the rows by
                rows_b = [{**r, **row_extras(epoch, i)} for i, r in indexed]
            batch = collator(rows_b)
            real, proc = window.count(batch, skip_keys, step_flops(accelerator.unwrap_model(model), batch,
                                                                   teacher is not None))
            if first_batch:
                first_batch = False
                accum = args.gradient_accumulation_steps * world
                accelerator.print(f"tokens per step: ~{real * accum} real, {proc * accum} processed (first batch); "
                                  f"{window.flops * accum / 1e12:.3f} TFLOP per step")
                memory_estimate(accelerator, args, accelerator.unwrap_model(model), batch, teacher, args.max_length)
            batch = batch_to_device(batch, accelerator.device)  # on the CPU tensors above: no device sync
            w = retention.value() if teacher is not None else 0.0
            with accelerator.accumulate(model):
                if args.gradient_cache_chunk:  # forward and backward chunk by chunk (the gradient cache)
                    outputs = gradient_cache_step(accelerator, model, batch, args.gradient_cache_chunk,
                                                  teacher=teacher, retention_weight=w)
                else:
                    outputs = model(batch, teacher=teacher, retention_weight=w)
                if "doc_ids" in batch:  # what the same-document mask left: logged, warned on below a floor
                    outputs = {**outputs, "in_batch_negatives": in_batch_negatives(accelerator, batch["doc_ids"])}
                if window.keep(accelerator, args.on_nonfinite, outputs, state.completed_steps + 1, epoch):
                    if not args.gradient_cache_chunk:
                        accelerator.backward(outputs["loss"])
                    if accelerator.sync_gradients and args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    lr_scheduler.step()
                optimizer.zero_grad()  # a skipped micro-batch drops the step's accumulated gradients too
            state.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            # ---- one optimiser step done: log, score and checkpoint on their steps
            state.completed_steps += 1
            retention.step()
            scalars = {"retention_weight": w, "pair_alpha": 0.0}
            if teacher is not None and not zero3(accelerator) and (  # the drift, on logging steps (whole weights)
                    state.completed_steps % args.logging_steps == 0 or state.completed_steps == stop_at):
                scalars["teacher_cosine"] = teacher_cosine(accelerator.unwrap_model(model), teacher, batch)
            window.step_done(state, epoch, scalars)
            if scorer and args.eval_steps and state.completed_steps % args.eval_steps == 0:
                rec = scorer(model, state.completed_steps, epoch, window)
                write_log_record(accelerator, log_path, rec)
                best = keep_best(accelerator, args, model, tokenizer, rec, best) if args.save_best else best
            if args.checkpointing_steps and state.completed_steps % args.checkpointing_steps == 0:
                save_checkpoint(accelerator, model, collator, Path(args.output_dir) / "checkpoints",
                                state.completed_steps, args.checkpoints_total_limit)
            if state.completed_steps >= stop_at:
                break
        else:
            state.batches_in_epoch = 0  # epoch finished: the next one starts at its first batch
    window.close()
    if scorer and scorer.last_step != state.completed_steps:  # the final model (or where the run stopped)
        rec = scorer(model, state.completed_steps, state.epoch, window)
        write_log_record(accelerator, log_path, rec)
        best = keep_best(accelerator, args, model, tokenizer, rec, best) if args.save_best else best
    if best:
        accelerator.print(f"best {best['by']} {best['score']:.2f} at step {best['step']}: "
                          f"{Path(args.output_dir) / 'best_model'}")

    # ---- save: the loss curve; a finished run's model folder and card (then --push_to_hub)
    source = read_json(Path(args.groups_dir) / "stats.json").get("dataset")  # select_groups.py --dataset
    save_run(accelerator, args, model, tokenizer, state.completed_steps >= max_steps,
             {"title": f"xprt pretrain ({args.objective})", "script": "train.py", "argv": argv,
              "summary": {"steps": state.completed_steps, "processes": world, "rows": len(rows), "unit": "groups"},
              "datasets": [source] if source else None})
    return {"completed_steps": state.completed_steps, "max_steps": max_steps, "output_dir": args.output_dir,
            "trainable_parameters": trainable, "best": best}


if __name__ == "__main__":
    run_script(main)
