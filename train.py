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
EVAL_PREFIX = "eval_"  # train_log.jsonl keys of --eval_tasks scores: eval_<task name>


# ----------------------------------------------------------------------------------------------------------------
# Arguments: the pre-training flags, then the groups both stages share (add_common_args)
# ----------------------------------------------------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser, default_lr: float):
    """The flags train.py and finetune.py share: the start model, loss temperature, optimisation, output."""
    g = p.add_argument_group("start model")
    g.add_argument("--model_name_or_path", default=PAPER_MODEL,
                   help="starting encoder: hub id, local folder, an xprt output folder (heads restored), or the "
                        "offline alias all-MiniLM-L6-v2. The paper starts from intfloat/e5-base-unsupervised")
    g.add_argument("--trust_remote_code", action="store_true", help="allow custom model code from the hub")
    g.add_argument("--prefixes", choices=["auto", "e5", "none"], default="auto",
                   help="text prefixes: auto = the start model's own (its sentence-transformers prompts, else E5's "
                        "'query: ' / 'passage: ' when it is an E5 model, else none: modeling_xprt.model_prompts); "
                        "e5 / none force them. Pre-training reads passages only (the 'passage: ' prefix). Saved "
                        "with the model"),
    g.add_argument("--tau", type=float, default=None, help="InfoNCE temperature (paper: 0.05)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--per_device_train_batch_size", type=int, default=32,
                   help="groups (pre-training) or queries (fine-tuning) per device; in-batch negatives = this x "
                        "world size")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1,
                   help="micro-batches per step (adds no negatives)")
    g.add_argument("--learning_rate", type=float, default=default_lr, help="peak learning rate")
    g.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (not on biases / LayerNorm)")
    g.add_argument("--lr_scheduler_type", default="linear", help="transformers.get_scheduler name")
    g.add_argument("--warmup_ratio", type=float, default=0.1, help="warmup fraction of the steps (PAIR: 0.1)")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    g.add_argument("--num_train_epochs", type=int, default=1, help="epochs (ignored when --max_train_steps is set)")
    g.add_argument("--max_train_steps", type=int, default=None, help="optimiser steps; sets the schedule length")
    g.add_argument("--stop_after_steps", type=int, default=None,
                   help="stop after this many steps without changing the schedule (as if preempted; resume tests)")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                   help="override accelerate's config (bf16 on Ampere+ GPUs)")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="trade compute for memory (use_reentrant=False)")
    g.add_argument("--seed", type=int, default=42, help="seed of everything (data order, masks, init, dropout)")
    g.add_argument("--on_nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss stops the run naming step and term, or skips that step")

    g = p.add_argument_group("output, checkpoints, logging")
    g.add_argument("--output_dir", required=True,
                   help="run folder: model/, checkpoints/, logs/, train_log.jsonl, loss_curve.png")
    g.add_argument("--overwrite", action="store_true", help="replace an existing run in --output_dir")
    g.add_argument("--checkpointing_steps", type=int, default=None, help="save_state every N steps")
    g.add_argument("--checkpoints_total_limit", type=int, default=2, help="keep only the last K checkpoints")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="'latest' (in output_dir/checkpoints) or a checkpoint folder")
    g.add_argument("--report_to", default="tensorboard",
                   help="accelerate tracker(s): tensorboard, wandb, all, none")
    g.add_argument("--logging_steps", type=int, default=10, help="log every N steps")
    g.add_argument("--no_save_model", action="store_true", help="skip writing model/ at the end (tests, benchmarks)")

    g = p.add_argument_group("scores during training (evaluate.py's tasks, mteb's metrics)")
    g.add_argument("--eval_tasks", nargs="*", default=[],
                   help="score the model on these tasks every --eval_steps and at the end: local folders "
                        "(TaskName=DIR as evaluate.py --local_tasks) or mteb task names (need the hub)")
    g.add_argument("--eval_steps", type=int, default=None,
                   help="score every N optimiser steps (the final model is scored whenever --eval_tasks is given); "
                        "to trackers, train_log.jsonl and loss_curve.png")
    g.add_argument("--eval_limit", type=int, default=500,
                   help="queries / pairs / test texts per task (seeded sample, corpus 10 x; 0 = whole tasks). Every "
                        "process runs the scoring and encodes 1/N of the texts; keep it small enough for a "
                        "scoring to take well under NCCL's 10-minute timeout")
    g.add_argument("--eval_batch_size", type=int, default=64, help="texts per forward pass when scoring")

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


def check_common_args(args, argv=None, script="train.py"):
    """Sanity checks of the shared flags that fail early with a clear message; records the command line for the
    model card (args.argv, args.script)."""
    args.argv, args.script = [str(a) for a in (sys.argv[1:] if argv is None else argv)], script
    if args.warmup_ratio is not None and not 0.0 <= args.warmup_ratio < 1.0:
        raise SystemExit("--warmup_ratio must be in [0, 1)")
    if args.eval_steps is not None and (args.eval_steps < 1 or not args.eval_tasks):
        raise SystemExit("--eval_steps needs a value >= 1 and --eval_tasks")
    if args.eval_limit < 0 or args.eval_batch_size < 1:
        raise SystemExit("--eval_limit must be >= 0 and --eval_batch_size >= 1")
    if args.eval_tasks:
        # Imported here, before the run seeds its generators (importing mteb draws from them), and a local folder
        # that is no known task stops the run now rather than after the first N steps.
        import evaluate

        for spec in args.eval_tasks:
            if os.path.isdir(spec.rpartition("=")[2]) or os.path.isdir(spec):
                try:
                    evaluate.parse_local_spec(spec)
                except (ValueError, FileNotFoundError) as err:
                    raise SystemExit(f"--eval_tasks {spec}: {err}") from None
    if args.push_to_hub and not args.hub_model_id:
        raise SystemExit("--push_to_hub needs --hub_model_id namespace/name")
    if args.push_to_hub and args.no_save_model:
        raise SystemExit("--push_to_hub uploads the saved model: drop --no_save_model")


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
class LengthGroupedBatchSampler(torch.utils.data.Sampler):
    """Batches of similar length, in a random order that depends only on (seed, epoch).

    Shuffle, cut into mega-batches of 50 batches, sort each mega-batch by length, cut into batches, shuffle the
    batches: padding drops a lot while each batch still mixes documents (in-batch negatives stay random enough).
    Incomplete last batches are dropped so every step has the same number of negatives. Being a function of
    (seed, epoch) is what makes skip_first_batches land on the same data after a resume.
    keys (fine-tuning: each row's query): no two rows of one batch share a key (sentence-transformers'
    NoDuplicatesBatchSampler rule; _cut_without_repeats); None (pre-training) cuts the order as it is.
    """

    def __init__(self, lengths, batch_size: int, seed: int, group_by_length: bool = True, mega: int = 50,
                 keys=None):
        # a numpy int64 array, not a list: 8 bytes per row, whatever the number of groups (a list of Python ints
        # costs about 36). A callable epoch -> lengths: lengths that change with the epoch (the random-span
        # baseline's crops, drawn per (seed, epoch): crop_spans); (N, 2) lengths: the longer and the shorter of two
        # views padded separately (batch_matrix)
        self.lengths_for_epoch = lengths if callable(lengths) else None
        lengths = lengths(0) if callable(lengths) else lengths
        self.lengths, self.batch_size, self.seed = np.asarray(lengths, dtype=np.int64), batch_size, seed
        self.group, self.mega = group_by_length, mega
        self.epoch, self.drop_last = 0, True
        self.keys = None if keys is None else list(keys)
        if len(self.lengths) < batch_size:
            raise ValueError(f"{len(self.lengths)} examples cannot fill one batch of {batch_size}")
        if self.keys is not None and len(self.keys) != len(self.lengths):
            raise ValueError(f"{len(self.keys)} keys for {len(self.lengths)} examples")

    def set_epoch(self, epoch: int):
        if self.lengths_for_epoch is not None and epoch != self.epoch:
            self.lengths = np.asarray(self.lengths_for_epoch(epoch), dtype=np.int64)
        self.epoch = epoch

    def batch_matrix(self) -> np.ndarray:
        """The epoch's batches as a (batches, batch_size) int64 array of row indices.

        The draws are those of the first (list-based) version, so a (seed, epoch) gives the same batches as
        before and old runs resume and reproduce: random.shuffle of range(n) (shuffle accepts any mutable
        sequence; an array.array holds the ints in 8 bytes each), a *stable* sort by -length inside each
        mega-batch (Python's sorted is stable too), then random.shuffle of the batch list, done here on a list of
        batch numbers: the same number of draws on a list of the same length gives the same permutation.
        """
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        n, bs = len(self.lengths), self.batch_size
        order = array.array("q", range(n))
        rng.shuffle(order)
        order = np.frombuffer(order, dtype=np.int64)  # a view: no copy
        if self.group:
            span = bs * self.mega
            for s in range(0, n, span):
                part = order[s:s + span]
                order[s:s + span] = part[self._longest_first(self.lengths[part])]
        if self.keys is None:
            batches = order[: (n // bs) * bs].reshape(n // bs, bs)
        else:  # fine-tuning: no key twice in a batch (a list walk; fine-tuning sets are far smaller than the groups)
            batches = np.asarray(self._cut_without_repeats(order.tolist()), dtype=np.int64).reshape(-1, bs)
        perm = list(range(n // bs))
        rng.shuffle(perm)
        return batches[perm]

    @staticmethod
    def _longest_first(lengths, buckets: int = 10) -> np.ndarray:
        """Stable order, longest first. (N, 2) lengths [longer view, shorter view], two tensors each padded to its
        own longest: by the longer view, then, in each of `buckets` runs of it, by the shorter, so that both tensors
        of a batch are tight (random-span crops of the compare groups at batch 16: padding efficiency 0.917; 0.834
        sorting by the longer alone)."""
        if lengths.ndim == 1:
            return np.argsort(-lengths, kind="stable")
        order = np.argsort(-lengths[:, 0], kind="stable")
        return np.concatenate([p[np.argsort(-lengths[p, 1], kind="stable")] for p in np.array_split(order, buckets)])

    def batches(self) -> list:
        return self.batch_matrix().tolist()

    def _cut_without_repeats(self, order):
        """Cut `order` into len(self) full batches in which no key repeats, keeping close to the order (so to the
        length grouping). Rows are taken in order. A row whose key the batch already holds trades places with the
        last row of the previous batch that the batch can take (its neighbour in length) when that batch lacks its
        key; otherwise it waits at the head of the queue for the next batch. Trading costs less padding than
        waiting: the traded row is one place out of order, a waiting row up to a batch. When only waiting rows are
        left to fill the last batches, they trade with earlier batches (the nearest first). Deterministic in
        `order`."""
        from collections import deque

        keys, bs = self.keys, self.batch_size
        queue, out = deque(order), []

        def trade(i, b, held):  # put row i into earlier batch b for b's last row the current batch can take
            if keys[i] in {keys[j] for j in b}:
                return None
            pos = next((pos for pos in reversed(range(len(b))) if keys[b[pos]] not in held), None)
            if pos is None:
                return None
            b[pos], taken = i, b[pos]
            return taken

        while len(out) < len(self):
            batch, held, waiting = [], set(), []
            while queue and len(batch) < bs:
                i = queue.popleft()
                if keys[i] in held:
                    taken = trade(i, out[-1], held) if out else None
                    if taken is None:
                        waiting.append(i)
                        continue
                    i = taken
                batch.append(i)
                held.add(keys[i])
            for i in list(waiting):  # the queue ran dry (only near the end): trade with any earlier batch
                if len(batch) == bs:
                    break
                for b in reversed(out):
                    taken = trade(i, b, held)
                    if taken is not None:
                        waiting.remove(i)
                        batch.append(taken)
                        held.add(keys[taken])
                        break
            if len(batch) < bs:
                raise ValueError(f"cannot cut {len(self.lengths)} rows into {len(self)} batches of {bs} without "
                                 "repeating a key (a key with more rows than batches?): lower the batch size")
            out.append(batch)
            queue.extendleft(reversed(waiting))  # first in line for the next batch
        return out

    def __iter__(self):
        # one batch at a time as a list of Python ints (what the DataLoader and accelerate's samplers expect)
        return (b.tolist() for b in self.batch_matrix())

    def __len__(self):
        return len(self.lengths) // self.batch_size


class RowsDataset(torch.utils.data.Dataset):
    """Rows as plain dicts, from a list of dicts (fine-tuning) or a datasets.Dataset (the groups: memory-mapped
    Arrow, one row converted to a dict when the loader asks for it, so memory does not grow with the number of
    groups). Collation happens in the training loop, not in the DataLoader: the DataLoader prefetches a batch
    ahead, which would advance the collator's mask RNG past a checkpoint and break exact resume."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"__index__": i, **self.rows[i]}


def padding_efficiency(batch, skip=()) -> tuple[int, int]:
    """(real tokens, processed tokens) over every *attention_mask tensor of a collated batch (keys starting with
    one of `skip` left out: the retention inputs are not processed when retention is off)."""
    real = proc = 0
    for k, v in batch.items():
        if k.endswith("attention_mask") and torch.is_tensor(v) and not k.startswith(tuple(skip)):
            real += int(v.sum())
            proc += v.numel()
    return real, proc


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
def make_accelerator(args, find_unused_parameters: bool):
    """The Accelerator of a run: trackers in <output_dir>/logs, DDP told whether some parameters go unused
    (objectives without a decoder pass), DeepSpeed given the micro-batch size it cannot infer."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # Without a GPU, accelerate only forms a multi-process (gloo) group when told cpu=True; DeepSpeed's own CPU
    # path must not get it (cpu=True would silently turn DeepSpeed off).
    deepspeed_on = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available() and not deepspeed_on,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=str(Path(args.output_dir) / "logs"),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)],
    )
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        # our DataLoader has a batch_sampler (no batch_size attribute), so DeepSpeed's "auto" cannot infer it
        ds_cfg = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_cfg["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        if ds_cfg.get("gradient_clipping") == "auto":
            ds_cfg["gradient_clipping"] = args.max_grad_norm
    return accelerator


def prepare_output_dir(accelerator, args, extra_outputs=()):
    """Refuse to clobber a finished run or its checkpoints unless --overwrite (or resuming); with --overwrite,
    clear the previous run's outputs. The main process decides; the others wait."""
    out = Path(args.output_dir)
    resuming = args.resume_from_checkpoint is not None
    if accelerator.is_main_process:
        if (out / "model").exists() and not args.overwrite:
            raise SystemExit(f"{out / 'model'} exists: pass --overwrite to replace it")
        if not resuming and list_checkpoints(out / "checkpoints") and not args.overwrite:
            raise SystemExit(f"{out / 'checkpoints'} has checkpoints: --resume_from_checkpoint latest, or --overwrite")
        if args.overwrite and not resuming:
            for name in ("checkpoints", "logs", "model", "train_log.jsonl", "loss_curve.png", *extra_outputs):
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()


@contextlib.contextmanager
def whole_weights():
    """Load models whole inside this block, even under DeepSpeed ZeRO-3.

    Under ZeRO-3, accelerate registers its DeepSpeed config with transformers, whose from_pretrained then
    partitions every model it loads (deepspeed.zero.Init), whatever zero3_init_flag says. Only prepared models get
    the hooks that gather their shards back, so a model we use ourselves (the frozen retention teacher; the
    fine-tuning start model while it mines negatives before prepare) would run on empty shards."""
    from transformers.integrations import deepspeed as hf_ds

    registered = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = registered


def zero3(accelerator) -> bool:
    """True under DeepSpeed ZeRO stage 3 (every parameter partitioned across the processes)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def _gathered(accelerator, model):
    """Context that gathers ZeRO-3 partitioned parameters (a no-op otherwise)."""
    if zero3(accelerator):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


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


def optimizer_groups(model, learning_rate: float, head_learning_rate=None, weight_decay: float = 0.01):
    """AdamW parameter groups: no decay on biases and LayerNorm weights (BERT recipe); the heads
    (XPRTModel.head_parameters: the decoder, the MLM head's transform and bias) at head_learning_rate (None: the
    encoder's). The tied vocabulary projection IS the word-embedding matrix: named_parameters lists it once,
    under the encoder, so it keeps the encoder's lr. Frozen parameters and empty groups are left out."""
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


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints and output
# ----------------------------------------------------------------------------------------------------------------
class TrainState:
    """Steps done and the epoch, registered for checkpointing next to the schedules and the collator."""

    def __init__(self):
        self.completed_steps, self.epoch, self.batches_in_epoch = 0, 0, 0

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        self.__dict__.update({k: int(v) for k, v in state.items()})


def list_checkpoints(ckpt_dir: Path):
    """Complete checkpoints (a DONE marker is written last) sorted by step."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(d.name.split("_")[1]), d) for d in ckpt_dir.glob("step_*") if (d / "DONE").exists()]
    return [d for _, d in sorted(found)]


def all_finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def save_checkpoint(accelerator, model, collator, ckpt_dir: Path, step: int, keep: int):
    """save_state into checkpoints/step_N plus each process's collator RNG, DONE marker last, then drop all but
    the last `keep` checkpoints."""
    with _gathered(accelerator, model):
        finite = all_finite(accelerator.unwrap_model(model))
    if not finite:
        raise FloatingPointError(f"non-finite weights at step {step}: checkpoint not written")
    path = ckpt_dir / f"step_{step}"
    accelerator.save_state(str(path))
    if hasattr(collator, "state_dict"):
        from safetensors.torch import save_file

        save_file(collator.state_dict(), str(path / f"collator_state_{accelerator.process_index}.safetensors"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / "DONE").write_text(str(step))
        for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def load_collator_state(collator, path: Path, rank: int):
    """Restore this process's collator RNG (a no-op for stateless collators such as PairCollator)."""
    f = path / f"collator_state_{rank}.safetensors"
    if hasattr(collator, "load_state_dict"):
        if not f.exists():
            raise FileNotFoundError(f"{f} missing: was the checkpoint written with a different number of processes?")
        from safetensors.torch import load_file

        collator.load_state_dict(load_file(str(f)))


def resume(accelerator, args, collator, state):
    """--resume_from_checkpoint: model, optimiser, scheduler, RNGs, the registered schedules and the collator
    RNG; the data position follows from `state`."""
    ckpt_dir = Path(args.output_dir) / "checkpoints"
    if args.resume_from_checkpoint == "latest":
        found = list_checkpoints(ckpt_dir)
        if not found:
            accelerator.print(f"no complete checkpoint in {ckpt_dir}: starting from scratch")
            return
        path = found[-1]
    else:
        path = Path(args.resume_from_checkpoint)
        if not (path / "DONE").exists():
            raise SystemExit(f"{path} is not a complete checkpoint (no DONE marker)")
    accelerator.load_state(str(path))
    load_collator_state(collator, path, accelerator.process_index)
    accelerator.print(f"resumed from {path} at step {state.completed_steps}")


# Flags whose values are local paths: the card's command and flags show a placeholder instead (a path of the training
# machine means nothing to a reader, and may say more than its owner wants). Secrets never reach the card.
LOCAL_PATH_FLAGS = ("--output_dir", "--groups_dir", "--beir_dir", "--triples_file", "--mined_negatives")
SECRET_FLAGS = ("--hub_token",)


def _public_value(flag: str, value):
    """A flag's value as the card shows it: a local path (any value of LOCAL_PATH_FLAGS; any other value that exists
    on disk or is absolute) becomes the flag's name in capitals (GROUPS_DIR); a Hub id or a plain value stays."""
    if not isinstance(value, str):
        return value
    if flag in LOCAL_PATH_FLAGS or os.path.isabs(value) or os.path.exists(value):
        return flag.lstrip("-").upper()
    return value


def public_command(script: str, argv) -> str:
    """The command line that trained the model, for its card: the flags as given, local paths as placeholders
    (_public_value), --hub_token dropped."""
    import shlex

    words, flag, skip = [f"python {script}"], "", False
    for tok in argv:
        if tok.startswith("--"):
            flag, _, value = tok.partition("=")
            skip = flag in SECRET_FLAGS
            if not skip:
                words.append(flag if not value else f"{flag}={shlex.quote(str(_public_value(flag, value)))}")
        elif not skip:
            words.append(shlex.quote(str(_public_value(flag, tok))))
    return " ".join(words)


def model_card(args, title: str, summary, model=None) -> str:
    """The saved folder's README.md: Hub metadata (huggingface_hub.ModelCardData: base_model, datasets, language,
    licence, library, pipeline, tags), usage code for sentence-transformers (with the saved prompts) and for plain
    transformers (prefix + mean pooling + L2), the training command without local paths, and a loss summary.
    evaluate.py adds the evaluation table (modeling_xprt.add_eval_results_to_card).
    summary: {"steps", "processes", "rows", "unit", "last_logged_step"}; model: the unwrapped XPRTModel."""
    from huggingface_hub import ModelCard, ModelCardData

    from modeling_xprt import card_license

    prompts = getattr(args, "prompts", None) or {"query": "", "document": ""}
    base_model = getattr(model, "base_model", None)
    # the start folder's own card first (local, and it carries an xprt start's licence on), then the Hub's
    hub_id, script = getattr(args, "hub_model_id", None), getattr(args, "script", "train.py")
    license_ = getattr(args, "license", None) or card_license(args.model_name_or_path) or card_license(base_model)
    model_id = hub_id or f"path/to/{Path(args.output_dir).name}/model"
    data = ModelCardData(base_model=base_model, datasets=getattr(args, "card_datasets", None) or None,
                         language="en", license=license_, library_name="sentence-transformers",
                         pipeline_tag="sentence-similarity",
                         tags=["sentence-transformers", "sentence-similarity", "feature-extraction", "xprt",
                               "retrieval"])
    # as save_pretrained writes it into sentence_bert_config.json
    max_len = getattr(model, "max_seq_length", None) or (
        min(512, getattr(model.encoder.config, "max_position_embeddings", 512)) if model is not None else 512)
    q, d = prompts["query"], prompts["document"]
    start = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a local checkpoint"
    prefixes = (f"Prefixes: queries `{json.dumps(q)}`, documents `{json.dumps(d)}`, saved as the `query` / "
                "`document` prompts, so "
                "`encode_query` / `encode_document` add them; with plain transformers, add them yourself."
                if q or d else "No prefixes (the start model uses none).")
    last = summary.get("last_logged_step") or {}
    terms = {k: v for k, v in last.items() if k == "loss" or k.endswith("_loss")}
    loss_rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in terms.items())
    hidden = {"argv", "script", "hub_token", "prompts", "card_datasets"}
    cfg = {k: _public_value(f"--{k}", v) for k, v in sorted(vars(args).items()) if k not in hidden}
    body = f"""
# {hub_id or Path(args.output_dir).name}

{title}, trained from {start} with this repository's `{script}`. A sentence-transformers model: mean pooling,
L2-normalised vectors, cosine similarity (`config_sentence_transformers.json`), at most {max_len} tokens. {prefixes}

## Usage (sentence-transformers)

```python
from sentence_transformers import SentenceTransformer

model_id = "{model_id}"
model = SentenceTransformer(model_id)
queries = model.encode_query(["which passages does an anchor retrieve?"])
documents = model.encode_document(["Anchors are the passages closest to their document's mean vector."])
print(model.similarity(queries, documents))
```

## Usage (transformers)

```python
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

model_id = "{model_id}"
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModel.from_pretrained(model_id).eval()
texts = [{json.dumps(q + "which passages does an anchor retrieve?")},
         {json.dumps(d + "Anchors are the passages closest to their document's mean vector.")}]
batch = tokenizer(texts, padding=True, truncation=True, max_length={max_len}, return_tensors="pt")
with torch.no_grad():
    hidden = model(**batch).last_hidden_state
mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
embeddings = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)  # mean pooling, then L2
print(embeddings[0] @ embeddings[1])
```

## Training

```bash
{public_command(script, getattr(args, "argv", []))}
```

{summary.get("steps")} optimiser step(s) over {summary.get("rows")} {summary.get("unit")}; batch
{args.per_device_train_batch_size} per device x {summary.get("processes")} process(es) x
{args.gradient_accumulation_steps} accumulation; peak learning rate {args.learning_rate}. Losses at the last logged
step ({last.get("step", "none")}):

| term | value |
|---|---|
{loss_rows}

## Configuration (flags; local paths as placeholders)

```json
{json.dumps(cfg, indent=1, default=str)}
```
"""
    return str(ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n" + body))


def push_to_hub(args, folder: Path):
    """Upload the saved model folder to --hub_model_id (huggingface_hub: create_repo, then upload_folder). Run by the
    main process after training has ended, with no barrier after it: an upload that outlasts NCCL's 10-minute
    timeout cannot stall the other processes."""
    from huggingface_hub import HfApi

    api = HfApi(token=args.hub_token)  # None: $HF_TOKEN, else the stored login
    repo = api.create_repo(args.hub_model_id, private=args.hub_private or None, exist_ok=True)
    commit = api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder),
                               commit_message=f"xprt {args.script}: upload {folder.name}/")
    print(f"pushed {folder} to https://huggingface.co/{repo.repo_id}")
    return commit


def save_model(accelerator, model, tokenizer, dest: Path, card: str):
    """XPRTModel.save_pretrained (atomic: a reader never sees half a model); a model with non-finite weights is
    never written."""
    with _gathered(accelerator, model):
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            if not all_finite(unwrapped):
                raise FloatingPointError("non-finite weights at the end of training: model not written")
            unwrapped.save_pretrained(str(dest), tokenizer, model_card=card)
            accelerator.print(f"saved {dest}")
    accelerator.wait_for_everyone()


def plot_loss_curves(log_path: Path, png_path: Path):
    """One panel per logged quantity (loss terms, lr, retention weight), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = {}
    for r in read_jsonl(log_path):
        # a resumed run rewrites steps: keep the last; a step's loss record and score record are merged
        recs.setdefault(r["step"], {}).update(r)
    steps = sorted(recs)
    seen = list(dict.fromkeys(k for s in steps for k in recs[s]))
    keys = [k for k in seen if k.endswith("loss") or k in ("lr", "head_lr", "retention_weight")]
    if any(recs[s].get("pair_alpha") for s in steps):  # only fine-tuning runs have an alpha to show
        keys.append("pair_alpha")
    evals = [k for k in seen if k.startswith(EVAL_PREFIX)]
    panels = keys + (["scores"] if evals else [])
    rows = math.ceil(len(panels) / 3)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3 * rows), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        xs = [s for s in steps if k in recs[s]]
        ax.plot(xs, [recs[s][k] for s in xs])
        ax.set_title(k)
        ax.set_xlabel("step")
    if evals:  # --eval_steps: mteb's main score (x100) of each task, next to the losses
        ax = list(axes.flat)[len(keys)]
        for k in evals:
            xs = [s for s in steps if k in recs[s]]
            ax.plot(xs, [recs[s][k] for s in xs], marker="o", label=k[len(EVAL_PREFIX):])
        ax.set_title("scores during training (main score x100)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)


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
def finite_everywhere(accelerator, terms: dict, where: str) -> bool:
    """--on_nonfinite skip: True when every loss term is finite on every process, decided before this micro-batch's
    backward. A NaN on any process must skip on every process together, or DDP would hang. This costs one
    device-to-host sync per micro-batch, which is why only the skip mode does it (LogWindow watches on the device
    otherwise)."""
    bad = [k for k, v in terms.items() if not torch.isfinite(v)]
    n_bad = accelerator.reduce(torch.tensor(float(len(bad)), device=accelerator.device), "sum").item()
    if n_bad:
        accelerator.print(f"skipping non-finite loss at {where}, term(s) {bad or 'on another process'}")
    return not n_bad


class LogWindow:
    """The loss terms, token counts and non-finite flags since the last logging step, kept ON THE DEVICE: a step
    adds to them without reading anything back (a `.item()` per term per step would stall a GPU on the host every
    step). `check_finite` and `record` read them once per logging step (and before a checkpoint)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.t0, self.real, self.proc, self.sums, self.n_micro, self.n_skipped = time.time(), 0, 0, {}, 0, 0
        self.bad, self.first_bad = {}, None  # per-term "was ever non-finite"; the first step that was

    def add_terms(self, terms: dict, step: int):
        """Add one micro-batch's detached loss terms (0-dim device tensors); `step` is the optimiser step (1-based)
        they belong to, remembered on the device if a term is non-finite."""
        for k, v in terms.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
            bad = ~torch.isfinite(v)
            self.bad[k] = self.bad[k] | bad if k in self.bad else bad
            step_t = torch.where(bad, step, torch.iinfo(torch.int64).max)
            self.first_bad = step_t if self.first_bad is None else torch.minimum(self.first_bad, step_t)
        self.n_micro += 1

    def check_finite(self, accelerator, epoch: int):
        """Raise, on every process together, when a loss term was non-finite on any process since the last check,
        naming the first such step and the terms. Checked at logging steps only, so the run may go on for up to
        --logging_steps - 1 steps after the bad one (no checkpoint or model is written from them: this check runs
        before each)."""
        if not self.bad:
            return
        keys = sorted(self.bad)
        # max over processes: a flag set anywhere, and (negated) the earliest bad step
        flags = torch.stack([self.bad[k].double() for k in keys] + [-self.first_bad.double()])
        flags = accelerator.reduce(flags, "max").tolist()  # the one read-back
        bad = [k for k, f in zip(keys, flags) if f > 0]
        if bad:
            first = int(-flags[-1])
            raise FloatingPointError(
                f"non-finite loss at step {first} (epoch {epoch}; found at the logging step after it), term(s) "
                f"{bad}; nothing was saved from this state. Lower --learning_rate or use --on_nonfinite skip")

    def record(self, accelerator, args, step: int, epoch: int, lr_scheduler, optimizer, scalars: dict) -> dict:
        world, dt = accelerator.num_processes, time.time() - self.t0
        keys = sorted(self.sums)
        device = accelerator.device
        means = [self.sums[k].double() / max(self.n_micro, 1) for k in keys]
        counts = torch.tensor([self.real, self.proc], device=device, dtype=torch.float64)
        vals = accelerator.reduce(torch.cat([torch.stack(means).to(device), counts]) if means else counts, "sum")
        vals = vals.tolist()  # the one read-back of the window
        rec = {"step": step, "epoch": epoch}
        rec.update({k: vals[i] / world for i, k in enumerate(keys)})
        rec.update({"lr": lr_scheduler.get_last_lr()[0], **scalars,
                    "padding_efficiency": vals[-2] / max(vals[-1], 1),
                    "tokens_per_s": vals[-2] / dt, "time_per_step_s": dt / args.logging_steps})
        if getattr(args, "head_learning_rate", None) is not None:
            lrs = lr_scheduler.get_last_lr()  # one per optimiser group, in order
            rec["head_lr"] = next(lr for lr, g in zip(lrs, optimizer.param_groups) if g["name"] == "heads")
        if self.n_skipped:
            rec["skipped_nonfinite_micro_batches"] = self.n_skipped
        self.reset()
        return rec


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


def batch_to_device(batch, device):
    """The collated CPU tensors to the accelerator, without waiting. Pinned first on CUDA: a copy from pageable
    memory may make the driver wait for the stream (a host sync per step)."""
    pin = device.type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in batch.items()}


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
