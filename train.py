"""
xPRT step 2: continued pre-training of the encoder on the groups that select_groups.py wrote.

Read it beside the xPRT paper ("The objective", "Experiments"). The objectives (--objective) share data, steps,
batch, schedule and the retention term (40 -> 0), as the paper gives every method the same budget:
  xprt                     L_xp + 0.1 L_cross + 0.1 L_self + 0.1 L_MLM + 0.1 L_unif + w(t) L_retain
                           (modeling_xprt.XPRTObjective; the --*_weight defaults; w(t): 40 -> 0)
  the comparison arms      RetroMAE, SimLM, Contriever and random spans, Revela, the self-reconstruction ablation
                           (baselines/, one file each, imported only by the run that trains it); --baseline_setting
                           official runs the baselines as their authors do
and the ablations --positive random and --no_fill_in.

    accelerate launch train.py --groups_dir groups/ --output_dir runs/xprt      # paper defaults (E5, lr 1e-6)

The file reads top to bottom: flags in the paper's order; the groups; the model, the data and the retention
teacher; main: accelerator, model, data, optimiser and scheduler, prepare, the loop (as run_mlm_no_trainer.py
writes it, w(t) of modeling_xprt.retention_weight beside the model call), save. The losses: modeling_xprt.py;
checkpoints, resume and stop signals in plumbing/training.py; the log, the FLOP count and the memory estimate in
plumbing/run_log.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

from modeling_xprt import (objective_class, objective_flags, pretraining_objectives, retention_weight,
                           tokenize_groups)
from plumbing.architectures import weight_grad_path
from plumbing.batches import (LengthGroupedBatchSampler, batch_to_device, check_batch_fits, document_keys,
                              sampler_negatives, training_loader, with_extras)
from plumbing.common import (ArgumentParser, META_DIR, UserError, atomic_write, check_model_name, is_zero3,
                             local_inputs, non_negative_float, non_negative_int, on_stop, output_key,
                             positive_int, read_json, resolve_model_path, run_script, task_spec, tokenizer_files)
from plumbing.model_folder import load_teacher
from plumbing.run_log import EVAL_PREFIX, LogWindow, explain_oom, memory_estimate, peak_flops, step_flops
from plumbing.training import (adamw, add_common_args, check_common_args, check_input_length, engine_dtype,
                               epoch_batches, export_checkpoint, gradient_cache_step, load_model, log_score,
                               make_accelerator, prepare_output_dir, prepare_run, run_line, save_checkpoint,
                               save_model, save_run, say_stopped, stop_account, StopSignals, uncompiled,
                               unpartitioned_loading)

ROOT = Path(__file__).resolve().parent  # the repository
DEFAULT_LR = 1e-6  # the paper's learning rate for continued pre-training from E5


# ----------------------------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------------------------
def build_parser(objectives=None):
    """train.py's flags, with those of the objectives `objectives` (default: every one, as --help lists them;
    experiments/paper/run.py reads --objective's choices from here, so it never drifts)."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("the method (the xPRT paper's \"The objective\"): the objective, its positive")
    g.add_argument("--objective", choices=pretraining_objectives(), default="xprt",
                   help="pre-training objective; the baselines share data, steps, batch, schedule and retention")
    g.add_argument("--positive", choices=["s1", "random"], default="s1",
                   help="positive of the anchor: s1 (top related passage) or a random passage of the document "
                        "(ablation)")

    # Each objective's own flags (Objective.flags: xPRT's loss weights and ablation, the baselines' settings), in one
    # group per objective; a flag several objectives take sits in the first one's group and names them all
    seen, owned = set(), objective_flags(objectives)
    for name in pretraining_objectives() if objectives is None else objectives:
        cls = objective_class(name)
        mine = {f: spec for f, spec in cls.flags.items() if f not in seen}
        if not mine:
            continue
        where = cls.__module__.replace(".", "/") + ".py"
        g = p.add_argument_group(f"--objective {name}" + (f" ({where})" if cls.__module__ != "modeling_xprt" else ""))
        for flag, spec in mine.items():
            owners = owned[flag][1]
            g.add_argument(flag, default=None, **{**spec, "help": f"[{', '.join(owners)}] {spec['help']}"})
        seen.update(mine)

    g = p.add_argument_group("w(t): the retention term, a KL to the frozen start (paper: weight 40 -> 0)")
    g.add_argument("--retention_weight", type=float, default=40.0,
                   help="retention weight at step 0 (paper: 40); 0 turns the term and the teacher off "
                        "(from-BERT setting)")
    g.add_argument("--retention_final_weight", type=float, default=0.0,
                   help="w(T), the weight the decay reaches at the run's end (paper: 0; "
                        "default 0). Step t (0 .. T-1) trains with w(t), as the lr schedule does, "
                        "so the last step's weight is w(T-1)")
    g.add_argument("--retention_schedule", choices=["linear", "cosine", "constant"], default="linear",
                   help="shape of the 40 -> 0 decay (the paper says 'decaying' only)")
    g.add_argument("--retention_student", choices=["clean", "masked"], default="clean",
                   help="student vectors in the retention term: 'clean' = one extra pass on the clean anchor and "
                        "s1 (our default), 'masked' = reuse the 15%%-masked vectors (the paper's 5-pass cost; "
                        "masking noise alone gives a non-zero start)")
    g.add_argument("--teacher_name_or_path", default=None,
                   help="frozen teacher of the retention term (default: the starting checkpoint, as in the paper)")

    g = p.add_argument_group("masking (paper: 15% of the encoder's tokens, 60% of the decoder's)")
    g.add_argument("--encoder_mask_rate", type=float, default=None,
                   help="mask rate of the encoder passes (default: the objective's; xprt 15%% as in the paper, "
                        "self_reconstruction 30%% as RetroMAE)")
    g.add_argument("--decoder_mask_rate", type=float, default=None,
                   help="mask rate of the decoder inputs (default: the objective's; xprt 60%%, "
                        "self_reconstruction 50%%)")

    g = p.add_argument_group("the heads: what the start never trained (decoder, MLM head)")
    g.add_argument("--mlm_head_from", default=None,
                   help="take the MLM head from this checkpoint (e.g. bert-base-uncased) when the start has none; "
                        "default: a fresh head tied to the word embeddings")
    g.add_argument("--head_learning_rate", type=float, default=None,
                   help="peak lr of the parameters the start model did not train: the decoder and the MLM head's "
                        "transform and bias (the vocabulary projection is tied to the embeddings and stays with "
                        "the encoder). Default: --learning_rate, as in the paper. A fresh head (MiniLM, E5) at "
                        "1e-6 keeps the fill-in terms near ln V for thousands of steps; e.g. 1e-4 lets them learn "
                        "(not in the paper)")

    g = p.add_argument_group("pre-training data")
    g.add_argument("--groups_dir", default=None, help="folder of parquet shards written by select_groups.py (required)")
    g.add_argument("--num_related", type=positive_int, default=4, help="related passages per group (paper: 4)")
    g.add_argument("--max_length", type=int, default=128,
                   help="max tokens of a passage itself; [CLS], [SEP] and the prefix come on top (select_groups.py "
                        "packs passages to --passage_tokens 128 without them, so they arrive whole)")
    g.add_argument("--max_groups", type=positive_int, default=None, help="use only the first N groups (debugging)")
    g.add_argument("--spread_documents", type=positive_int, default=16,
                   help="deal each run of N length-sorted batches round-robin, so that the groups of one document "
                        "(nearly equal lengths: they share its passages) land in different batches, where they would "
                        "be masked out of each other's negatives; 1 = off (figures: bench/README.md). Objectives whose "
                        "collator groups by other lengths (random spans: the crops') ignore it")
    g.add_argument("--max_document_groups_per_batch", type=non_negative_int, default=None,
                   help="at most N groups of one document in a batch (default: half the per-device batch; 0 = no "
                        "cap): L_xp masks a document's groups out of each other's negatives, so a document that "
                        "fills a batch leaves its rows none and L_xp exactly 0. Groups over the cap wait out the epoch "
                        "(the log says how many)")
    g.add_argument("--min_in_batch_negatives", type=non_negative_float, default=None,
                   help="warn when the in-batch negatives a row keeps after the same-document mask (logged as "
                        "in_batch_negatives, the mean over rows) fall below this (default: half the global batch)")

    g = p.add_argument_group("stopping signal and speed (experiments/README.md: how to read the curves)")
    g.add_argument("--save_best", default=None, metavar="TASK",
                   help="keep the model of the best score during training in <output_dir>/best_model (best.json says "
                        "its step): an --eval_tasks task's name (its mteb main score, e.g. SciFact) or 'average' "
                        "(mean over --eval_tasks); needs --eval_tasks")
    g.add_argument("--ignore_memory_estimate", action="store_true",
                   help="go on when the memory estimate printed before the first step says the batch does not fit "
                        "in the device's free memory (a GPU's; a CPU's: the host's available memory shared by the "
                        "node's processes); without it such a run stops there in one line naming the flags to change")
    g.add_argument("--peak_tflops", type=float, default=None,
                   help="peak TFLOP/s of one device in the run's precision, for the logged MFU estimate (default: "
                        "a table of known GPUs, bf16 dense; none on CPU, where only TFLOP/s is logged)")
    add_common_args(p, DEFAULT_LR)
    return p


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    # the flags of the objective asked for only (every objective's for --help, or for a name argparse then refuses):
    # another objective's module is not imported
    named = [b for a, b in zip(argv, argv[1:]) if a == "--objective"] + [
        a.split("=", 1)[1] for a in argv if a.startswith("--objective=")]
    objective = named[-1] if named else "xprt"
    wants_help = any(a in ("-h", "--help") for a in argv)
    parser = build_parser(None if wants_help or objective not in pretraining_objectives() else [objective])
    args, unknown = parser.parse_known_args(argv)
    owners = {f: names for f, (_, names) in objective_flags().items()} if unknown else {}
    for flag in unknown:  # another objective's flag is refused, naming its objective
        if flag.split("=")[0] in owners:
            raise UserError(f"{flag.split('=')[0]}: a flag of --objective {' / '.join(owners[flag.split('=')[0]])}, "
                            f"not of {args.objective}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.export_checkpoint:  # its flags come from the checkpoint (training.export_checkpoint checks them)
        return args
    if args.groups_dir is None:
        raise UserError("the following arguments are required: --groups_dir (--help lists the flags)")

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
    model_flags = [f[2:] for f in objective_class(args.objective).model_flags]
    for flag in ["model_name_or_path", "teacher_name_or_path", "mlm_head_from", *model_flags]:
        if getattr(args, flag):
            check_model_name(getattr(args, flag), f"--{flag}", args.trust_remote_code)
    n_groups = count_groups(args.groups_dir)
    check_batch_fits(min(n_groups, args.max_groups or n_groups), args.per_device_train_batch_size,
                     int(os.environ.get("WORLD_SIZE", 1)), "groups")


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

    Memory-mapped: one Arrow cache file in HF_DATASETS_CACHE/xprt/groups-<the shards' sha256> (content_digest),
    which every process maps; rows become Python dicts only in RowsDataset."""
    from datasets import config, load_dataset
    from plumbing.training import content_digest

    # stats.json is what select_groups.py writes last: without it the selection was interrupted (rerunning its command
    # resumes it), and the folder may hold an unfinished chunk's temporary shard
    stats = Path(groups_dir) / "stats.json"
    count_groups(groups_dir)
    # the finished shards only: ".tmp-*" files are a killed run's half-written ones (common.atomic_path)
    files = sorted(str(f) for f in Path(groups_dir).glob("*.parquet") if not f.name.startswith("."))
    if not files:
        raise UserError(f"--groups_dir {groups_dir}: no *.parquet shards beside its stats.json")
    import pyarrow
    import pyarrow.parquet as pq

    for f in files:  # a truncated or foreign shard named here (its footer), not deep inside datasets' builder
        try:
            pq.ParquetFile(f).close()
        except (pyarrow.ArrowInvalid, OSError) as err:
            raise UserError(f"--groups_dir: {f} is not a readable parquet file ({str(err).split('.')[0]}): truncated "
                            "or changed after the selection; select again with --overwrite") from None
    root = Path(config.HF_DATASETS_CACHE) / "xprt"
    digest = content_digest(files, known := read_json(kept := root / "groups_digests.json"))
    if new := {f: e for f, e in digest["files"].items() if known.get(f) != e}:  # with the others' still there
        atomic_write(kept, json.dumps({f: e for f, e in {**known, **new}.items() if os.path.exists(f)}))
    ds = load_dataset("parquet", data_files=files, split="train", cache_dir=f"{root}/groups-{digest['sha256'][:16]}")
    expected = json.loads(stats.read_text()).get("groups")
    if expected is not None and len(ds) != expected:
        raise UserError(f"{groups_dir}: its shards hold {len(ds):,} groups, its stats.json {expected:,}: shards were "
                        "added or removed after the selection finished")
    # The first load converts the shards into the Arrow cache; pyarrow's allocator keeps the freed conversion
    # buffers unless asked to hand them back. Later loads convert nothing.
    pyarrow.default_memory_pool().release_unused()
    for col in ("doc_id", "anchor", "related", "random_passage"):
        if col not in ds.column_names:
            raise UserError(f"{groups_dir} lacks column {col!r}: not a select_groups.py output?")
    n = min(max_groups or len(ds), len(ds))  # the fingerprint: datasets' own (paths, mtimes, features) and the content
    return ds.select(range(n), new_fingerprint=f"{ds._fingerprint}-{digest['sha256'][:16]}-{n}")


# ----------------------------------------------------------------------------------------------------------------
# The model and the data
# ----------------------------------------------------------------------------------------------------------------
def load_pretraining_model(accelerator, args):
    """load_xprt_folder(XPRTModel, --model_name_or_path) for --objective, with the options its own flags set
    (Objective.options_from_flags), and its tokenizer (training.load_model)."""
    options = objective_class(args.objective).options_from_flags(args)
    return load_model(accelerator, args, objective=args.objective, mlm_head_from=args.mlm_head_from,
                      retention_student=args.retention_student, **options)


def check_positions(args, model, tokenizer):
    """--max_length (+ specials, prefix and the decoder's C) against the positions the model takes, before any work
    (architectures.runs_at_length); refused with the --max_length that fits. -> a line to print when the model is
    used at fewer tokens than it is trained on, else None."""
    prefix = len(tokenizer(model.prompts["document"], add_special_tokens=False)["input_ids"]) \
        if model.prompts["document"] else 0
    extra = tokenizer.num_special_tokens_to_add() + prefix
    extra += max((getattr(m, "num_condition_vectors", 0) for m in model.modules()), default=0)
    check_input_length(model, args.model_name_or_path, "--max_length", args.max_length, extra,
                       f"the passage and {extra} more: special tokens, the prefix, the decoder's conditioning vectors")
    encoder_input = args.max_length + tokenizer.num_special_tokens_to_add() + prefix
    if model.info.max_seq_length < encoder_input:
        return (f"note: {args.model_name_or_path} is used at {model.info.max_seq_length} tokens (the length its folder "
                f"states, which the saved folder keeps), and trained here on inputs of up to {encoder_input} "
                f"(--max_length {args.max_length})")
    return None


def load_data(accelerator, args, model, tokenizer):
    """The groups, the length-grouped sampler over what the objective's collator sorts by (the random-span baseline:
    its crops' lengths, and row_extras(epoch, i) hands each row its crops) and the DataLoader whose workers collate
    the batches ahead of the step (batches.SeededCollate: masks drawn from (seed, epoch, batch, process)) ->
    (rows, sampler, dataloader)."""
    rows = load_groups(args.groups_dir, args.max_groups)
    collator = model.objective.make_collator(tokenizer, num_related=args.num_related, max_length=args.max_length,
                                          encoder_mask_rate=args.encoder_mask_rate,
                                          decoder_mask_rate=args.decoder_mask_rate,
                                          passage_prefix=model.prompts["document"], positive=args.positive,
                                          seed=args.seed, pad_to_multiple_of=args.pad_to_multiple_of)
    lengths, row_extras = collator.sort_lengths(rows, args.seed)
    accelerator.print(passages_cut(rows, tokenizer, args))
    rows = tokenized(accelerator, rows, collator)
    spread = args.spread_documents if collator.spread_documents else 1
    bs, world = args.per_device_train_batch_size, accelerator.num_processes
    cap = max(bs // 2, 1) if args.max_document_groups_per_batch is None else args.max_document_groups_per_batch
    # (groups,) a group's document as an integer: its doc_id, joined with every other id that shares its anchor or
    # top related passage text (batches.document_keys); the collator reads the merged id (make_row below)
    docs, merged = document_keys(rows, positive=args.positive)
    if merged:
        accelerator.print(f"{len(merged):,} groups share an anchor or positive text with a group of another "
                          f"doc_id: {len(set(merged.values())):,} documents under several ids, each masked and spread "
                          "as one document")
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
    return rows, sampler, training_loader(accelerator, args, rows, sampler, collator,
                                          functools.partial(with_extras, merged, row_extras)
                                          if merged or row_extras else None)


def tokenized(accelerator, rows, collator, groups_per_process: int = 20_000):
    """The groups with every passage tokenised once (modeling_xprt.tokenize_groups), so the loader's workers only
    mask and pad (bench/README.md). datasets.map caches them, keyed by the groups' fingerprint, the code of
    tokenize_groups and what it calls, the library versions, the tokenizer's state (common.tokenizer_files), the
    prefix, length, words and fields."""
    import inspect
    from importlib.metadata import version
    from datasets import Sequence, Value

    fields = [f for f in collator.passage_fields if f in rows.column_names]
    if not fields:  # a collator that reads texts only (Revela)
        return rows
    features = rows.features.copy()
    for f in fields:
        one = Sequence(Value("int32"))
        for key in ("ids", "words") if collator.needs_words else ("ids",):
            features[f"{f}_{key}"] = Sequence(one) if f == "related" else one
    kwargs = dict(tokenizer=collator.tokenizer, prefix=collator.passage_prefix,
                  length=len(collator.prefix_ids) + collator.max_length, words=collator.needs_words, fields=fields)
    # one process per groups_per_process groups, up to this machine's cores shared by its processes: about 800
    # groups/s a core here (64-token passages), so the paper's 7M groups take minutes on a GPU machine's cores, once
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    procs = min(cpus // int(os.environ.get("LOCAL_WORLD_SIZE", 1)), len(rows) // groups_per_process)
    # the code that makes the tokens: these functions and every function of this repository they name, followed
    code, todo = [], [tokenize_groups, tokenize_groups.__globals__["special_template"]]
    while todo:
        fn = todo.pop()
        if fn not in code and Path(inspect.getfile(fn)).resolve().parent in (ROOT, ROOT / "plumbing"):
            code.append(fn)
            todo += filter(inspect.isfunction, map(fn.__globals__.get, fn.__code__.co_names))
    versions = [version(p) for p in ("transformers", "tokenizers", "datasets")]  # common.output_key: every cache's
    key = output_key(tokenizer_files(collator.tokenizer), [rows._fingerprint, sorted(map(inspect.getsource, code)),
                                                           versions, {**kwargs, "tokenizer": 0}])
    with accelerator.main_process_first():
        return rows.map(tokenize_groups, batched=True, fn_kwargs=kwargs, features=features,
                        num_proc=procs if procs > 1 else None, desc="tokenising each passage once",
                        new_fingerprint=key)


def passages_cut(rows, tokenizer, args, sample: int = 4096) -> str:
    """How much of the groups' text --max_length cuts with this run's tokenizer, on `sample` groups spread over the
    folder (select_groups.py packed to *its* tokenizer's --passage_tokens) -> the line the run prints."""
    picked = np.unique(np.linspace(0, len(rows) - 1, min(sample, len(rows))).astype(np.int64))
    part = rows.select(picked)
    texts = [t for a, rel in zip(part["anchor"], part["related"]) for t in (a, *rel[:args.num_related])]
    counts = np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]])
    cut = counts > args.max_length
    lost = int(np.maximum(counts - args.max_length, 0).sum())
    selected = read_json(Path(args.groups_dir) / META_DIR / "run_config.json")
    origin = (f"selected with {selected.get('model_name_or_path')}'s tokenizer at --passage_tokens "
              f"{selected.get('passage_tokens')}" if selected else "no selection record (run_config.json)")
    line = (f"passages longer than --max_length {args.max_length} tokens of this tokenizer: {int(cut.sum()):,} of "
            f"{len(texts):,} ({100 * cut.mean():.1f}%), {100 * lost / max(counts.sum(), 1):.1f}% of their tokens cut, "
            f"measured on {len(picked):,} of {len(rows):,} groups; {origin}")
    return line if not cut.any() else ("warning: " + line + ": raise --max_length, or select with this model's "
                                       "tokenizer (select_groups.py --model_name_or_path)")


def load_teacher_model(accelerator, args):
    """The retention term's frozen start model (never prepared: it never trains), or None when the weight is 0 at
    both ends."""
    teacher = None
    if args.retention_weight > 0 or args.retention_final_weight > 0:
        with unpartitioned_loading():
            teacher_path = resolve_model_path(args.teacher_name_or_path or args.model_name_or_path)
            teacher = load_teacher(teacher_path, trust_remote_code=args.trust_remote_code)
        # the student's precision: under DeepSpeed bf16 the student's weights are bf16, and an fp32 teacher would put
        # a precision gap into the retention term from step 0 (under autocast both run inside the same autocast)
        teacher.to(accelerator.device, dtype=engine_dtype(accelerator))
    accelerator.print(f"retention {args.retention_weight} -> {args.retention_final_weight} "
                      f"({args.retention_schedule}); heads lr {args.head_learning_rate or args.learning_rate}")
    return teacher


# ----------------------------------------------------------------------------------------------------------------
# The stopping signal: the drift from the start model beside the scores, and the best model by a score
# ----------------------------------------------------------------------------------------------------------------
def teacher_cosine(model, teacher, batch) -> torch.Tensor:
    """Drift from the start model: the mean cosine between the trained encoder's and the frozen start model's vectors
    of the batch's clean anchors and top related passages (the retention term's pairs and passes: no dropout, here no
    gradient). 1.0 at step 0. Computed on logging steps only (one extra forward of 2 x groups passages) and left on
    the device: the logging step's one read-back (LogWindow.record) averages it over the processes' batches."""
    with torch.no_grad(), uncompiled():
        s, t = model.post_pooling(model.clean_student(batch)), model.teacher_vectors(batch, teacher)
    return torch.nn.functional.cosine_similarity(s.float(), t.float(), dim=-1).mean()


def keep_best(accelerator, args, model, tokenizer, rec: dict, state):
    """--save_best: when a scoring record (TrainingScorer's) beats the best so far (state.best, which checkpoints
    carry, with the start's score: a resumed run keeps the uninterrupted run's best), the model goes to
    <output_dir>/best_model (atomically, as model/) and best.json names its step and score."""
    if not args.save_best:
        return
    scores = {k[len(EVAL_PREFIX):]: v for k, v in rec.items() if k.startswith(EVAL_PREFIX)}
    if args.save_best not in scores and args.save_best != "average":
        raise UserError(f"--save_best {args.save_best!r}: the scored tasks are {sorted(scores)} (or 'average')")
    score = sum(scores.values()) / len(scores) if args.save_best == "average" else scores[args.save_best]
    if state.best and score <= state.best["score"]:
        return
    state.best = {"step": rec["step"], "by": args.save_best, "score": score, "scores": scores,
                  "start": state.best.get("start", score)}  # the start's score (step 0, scored first)
    out = Path(args.output_dir)
    card = (f"# best model of {out.name}\n\nStep {rec['step']} of the run, the best {args.save_best} score during "
            f"training ({score:.2f}; train.py --save_best). The finished run's model and card are in model/.\n")
    save_model(accelerator, model, tokenizer, out / "best_model", card, args.trust_remote_code)
    if accelerator.is_main_process:
        atomic_write(out / "best.json", json.dumps(state.best, indent=1))


# ----------------------------------------------------------------------------------------------------------------
# Main: accelerator, model, data, optimiser and scheduler, prepare, the loop, save
# ----------------------------------------------------------------------------------------------------------------
@explain_oom
def main(argv=None):
    args = parse_args(argv)
    if args.export_checkpoint:  # a checkpoint's model as a model folder, and nothing else
        return export_checkpoint(args, parse_args, load_pretraining_model, "train.py")
    check_inputs(args)
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # the card shows the command
    from accelerate.utils import set_seed

    # ---- accelerator. Some objectives leave heads unused (random spans never read the MLM head), which DDP only
    # tolerates with find_unused_parameters.
    accelerator = make_accelerator(args, find_unused_parameters=not objective_class(args.objective).trains_every_head)
    resumed = args.resume_from_checkpoint if args.resume_from_checkpoint != "latest" else None
    prepare_output_dir(accelerator, args, "train.py", local_inputs(
        groups_dir=args.groups_dir, model_name_or_path=args.model_name_or_path,
        teacher_name_or_path=args.teacher_name_or_path, mlm_head_from=args.mlm_head_from,
        **{f[2:]: getattr(args, f[2:]) for f in objective_class(args.objective).model_flags},
        eval_tasks=[task_spec(t)[1] for t in args.eval_tasks], resume_from_checkpoint=resumed))
    on_stop(lambda: stop_account(args))  # a signal outside the steps: the line names the last checkpoint
    set_seed(args.seed)

    # ---- model
    model, tokenizer = load_pretraining_model(accelerator, args)
    note = check_positions(args, model, tokenizer)
    if note:
        accelerator.print(note)

    # ---- data: the groups, length-grouped batches collated ahead of the step; the retention term's frozen teacher
    rows, sampler, dataloader = load_data(accelerator, args, model, tokenizer)
    teacher = load_teacher_model(accelerator, args)

    # ---- Contriever's MoCo state (the key encoder and the queue: no part of the model) goes into the checkpoints,
    # registered before prepare_run resumes
    moco = getattr(model.objective, "moco", None)
    if moco is not None:
        keys = args.per_device_train_batch_size * accelerator.num_processes  # enqueued per forward (all processes)
        if moco.queue_size % keys:
            raise UserError(f"--moco_queue_size {moco.queue_size} is no multiple of the keys a forward enqueues "
                            f"({args.per_device_train_batch_size} per device x {accelerator.num_processes} "
                            "processes), as MoCo requires (src/moco.py asserts it)")
        accelerator.register_for_checkpointing(moco)

    # ---- optimiser (AdamW; the heads at --head_learning_rate)
    optimizer, trainable = adamw(accelerator, model, args, args.head_learning_rate)

    # ---- prepare; then, from the prepared (sharded) loader's length, the run's steps and the scheduler (10% warmup,
    # then linear decay); resume
    model, optimizer, dataloader, lr_scheduler, state, steps_per_epoch = prepare_run(accelerator, args, model,
                                                                                     optimizer, dataloader)
    max_steps, world = state.max_steps, accelerator.num_processes
    # L_xp: a row's anchor against every s1 of the step (gathered across processes) but its own
    accelerator.print(run_line(accelerator, args, f"{len(rows)} groups", max_steps, (
        f"per row = {args.per_device_train_batch_size * world - 1} (accumulation adds none; the same-document mask "
        "leaves fewer: in_batch_negatives in the log)")))
    # every group an epoch leaves out, with its reason: the cap, the last partial batch, batches the processes cannot
    # share evenly (accelerate's sharding drops them)
    bs, trained = args.per_device_train_batch_size, len(dataloader) * args.per_device_train_batch_size * world
    if trained < len(rows):
        accelerator.print(
            f"each epoch trains {trained:,} of {len(rows):,} groups; left out: {sampler.rows_left_out:,} over the "
            f"per-document cap, {len(rows) - sampler.rows_left_out - sampler.num_batches * bs:,} in the last partial "
            f"batch" + (f", {(sampler.num_batches - len(dataloader) * world) * bs:,} in batches the {world} "
                        "processes cannot share evenly" if world > 1 else ""))
    if accelerator.mixed_precision != "no":  # probed here, before any step, outside any FLOP counter
        accelerator.print(f"vocabulary weight gradient: {weight_grad_path(accelerator.device)}")
    scorer = None
    if args.eval_tasks:  # evaluate.py's tasks and mteb's metrics, every --eval_steps and at the end
        import evaluate

        scorer = evaluate.TrainingScorer(accelerator, args, tokenizer)

    # ---- the loop, as run_mlm_no_trainer.py writes it: accumulate, the step with the retention weight w(t), backward,
    # clip, optimiser and lr steps; per optimiser step, log, score and checkpoint on their steps
    model.train()
    window = LogWindow(accelerator, args, lr_scheduler, optimizer, max_steps, peak_flops(accelerator, args), state,
                       functools.partial(step_flops, accelerator.unwrap_model(model), retention=teacher is not None))
    stop_at = min(max_steps, args.stop_after_steps or max_steps)
    stop, stopped = StopSignals(accelerator), 0  # SIGTERM / SIGUSR1 / Ctrl-C: a checkpoint after the step, stop
    skip_tokens = () if teacher is not None else ("retain_",)  # masks a step computes nothing of
    if scorer and state.completed_steps == 0:  # the start is scored too: every later score is read against it
        rec = log_score(accelerator, args, scorer, model, 0, state.epoch, window)
        keep_best(accelerator, args, model, tokenizer, rec, state)
    try:
        for epoch in range(state.epoch, math.ceil(max_steps / steps_per_epoch)):
            if stopped or state.completed_steps >= stop_at:
                break
            for batch in window.timed(epoch_batches(accelerator, dataloader, sampler, state, epoch)):
                if window.flops_per_token is None:  # the memory a step takes, printed before the first one
                    memory_estimate(accelerator, args, accelerator.unwrap_model(model), batch, teacher, args.max_length)
                with window.measured(batch, skip_tokens):  # its tokens, and its FLOPs on a window's first micro-batch
                    batch = batch_to_device(batch, accelerator.device)
                    # w(t): 40 -> 0 over the run, the paper's retention weight (0 throughout without a teacher)
                    w = retention_weight(state.completed_steps, max_steps, args.retention_weight,
                                         args.retention_final_weight, args.retention_schedule)
                    if args.compile == "reduce-overhead":  # CUDA graphs: a new step, the last one's outputs done
                        torch.compiler.cudagraph_mark_step_begin()
                    with accelerator.accumulate(model):
                        if args.gradient_cache_chunk:  # forward and backward chunk by chunk (the gradient cache)
                            outputs = gradient_cache_step(accelerator, model, batch, args.gradient_cache_chunk,
                                                          teacher=teacher, retention_weight=w)
                        else:
                            outputs = model(batch, teacher=teacher, retention_weight=w)
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
                # ---- one optimiser step done: log (with the drift from the start), score, checkpoint
                state.completed_steps += 1
                step, scalars = state.completed_steps, {"retention_weight": w}
                if teacher is not None and not is_zero3(accelerator) and (step % args.logging_steps == 0
                                                                          or step == stop_at):
                    scalars["teacher_cosine"] = teacher_cosine(accelerator.unwrap_model(model), teacher, batch)
                window.step_done(state, epoch, scalars)
                if scorer and args.eval_steps and step % args.eval_steps == 0:
                    with stop.scoring():  # a signal leaves the scoring: the step's checkpoint below
                        rec = log_score(accelerator, args, scorer, model, step, epoch, window)
                        keep_best(accelerator, args, model, tokenizer, rec, state)
                stopped = stop.check()
                if stopped or (args.checkpointing_steps and step % args.checkpointing_steps == 0):
                    save_checkpoint(accelerator, model, Path(args.output_dir) / "checkpoints", step,
                                    args.checkpoints_total_limit)
                if stopped or step >= stop_at:
                    break
            else:
                state.batches_in_epoch = 0  # epoch finished: the next one starts at its first batch
    finally:
        stop.restore()
    window.close()
    stopped_by = say_stopped(accelerator, args, stopped, state) if stopped else None
    # a finished run's final model (one stopped early is part of a run, as if preempted: not scored as finished)
    if scorer and state.completed_steps >= max_steps and scorer.last_step != state.completed_steps:
        rec = log_score(accelerator, args, scorer, model, state.completed_steps, state.epoch)
        keep_best(accelerator, args, model, tokenizer, rec, state)
    best = state.best
    if best:
        accelerator.print(f"best {best['by']} {best['score']:.2f} at step {best['step']}: "
                          f"{Path(args.output_dir) / 'best_model'}" + (
                              " holds the start model: no step of training scored above it" if best["step"] == 0
                              else f" (the start: {best['start']:.2f})"))

    # ---- save: the loss curve; a finished run's model folder and card (then --push_to_hub)
    source = read_json(Path(args.groups_dir) / "stats.json").get("dataset")  # select_groups.py --dataset
    save_run(accelerator, args, model, tokenizer, state.completed_steps >= max_steps,
             {"title": f"xprt pretrain ({args.objective})", "script": "train.py", "argv": argv,
              "summary": {"steps": state.completed_steps, "processes": world, "rows": len(rows), "unit": "groups"},
              "datasets": [source] if source else None}, stopped_by)
    return {"completed_steps": state.completed_steps, "max_steps": max_steps, "output_dir": args.output_dir,
            "trainable_parameters": trainable, "best": best}


if __name__ == "__main__":
    run_script(main)
