"""
xPRT step 2: continued pre-training of the encoder on the selected groups, and PAIR fine-tuning.

Read it beside ../shared/papers/xprt.md ("The objective", "Experiments") and papers/pair.md. One script,
one visible Accelerate loop, two stages:

  --stage pretrain (default)  groups from select_groups.py -> XPRTModel(objective=xprt | contrastive_random_span |
                              self_reconstruction), every objective with the same retention term (40 -> 0).
  --stage finetune            labelled (query, positive) pairs (BEIR train qrels or a triples file), hard negatives
                              mined with the starting model, PAIR's loss (1 - alpha) L_Q + alpha L_P.

    accelerate launch train.py --groups_dir groups/ --output_dir runs/xprt          # paper defaults (E5, lr 1e-6)
    accelerate launch train.py --stage finetune --beir_dir ../shared/data/scifact --output_dir runs/ft

main() reads top to bottom: accelerator, data, model, optimiser and scheduler, prepare, (resume), loop, save.
The losses themselves live in modeling_xprt.py, one function per equation; this file only feeds them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from modeling_xprt import E5_PASSAGE_PREFIX, E5_QUERY_PREFIX, resolve_model_path

PAPER_MODEL = "intfloat/e5-base-unsupervised"  # the paper's starting checkpoint (needs the hub or a local copy)


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--stage", choices=["pretrain", "finetune"], default="pretrain",
                   help="pretrain: xPRT / baselines on selected groups; finetune: PAIR loss on labelled pairs")
    g.add_argument("--model_name_or_path", default=PAPER_MODEL,
                   help="starting encoder: hub id, local folder, an xprt output folder (heads restored), or the "
                        "offline alias all-MiniLM-L6-v2. The paper starts from intfloat/e5-base-unsupervised")
    g.add_argument("--mlm_head_from", default=None,
                   help="take the MLM head from this checkpoint (e.g. bert-base-uncased) when the start has none; "
                        "default: a fresh head tied to the word embeddings")
    g.add_argument("--teacher_name_or_path", default=None,
                   help="frozen teacher of the retention term (default: the starting checkpoint, as in the paper)")
    g.add_argument("--trust_remote_code", action="store_true", help="allow custom model code from the hub")
    g.add_argument("--objective", choices=["xprt", "contrastive_random_span", "self_reconstruction"], default="xprt",
                   help="pre-training objective; the baselines share data, steps, batch, schedule and retention")
    g.add_argument("--no_fill_in", action="store_true", help="ablation: drop the cross/self fill-in losses (paper Table 3)")
    g.add_argument("--positive", choices=["s1", "random"], default="s1",
                   help="positive of the anchor: s1 (top related passage) or a random passage of the document (ablation)")
    g.add_argument("--e5_prefixes", action="store_true",
                   help="prefix texts with 'query: ' / 'passage: ' (E5 convention; pre-training uses 'passage: ')")

    g = p.add_argument_group("pre-training data")
    g.add_argument("--groups_dir", default=None, help="folder of parquet shards written by select_groups.py")
    g.add_argument("--num_related", type=int, default=4, help="related passages per group (paper: 4)")
    g.add_argument("--max_length", type=int, default=128, help="max tokens per passage")
    g.add_argument("--encoder_mask_rate", type=float, default=None,
                   help="mask rate of the encoder passes (default: the objective's; xprt 15%% as in the paper, "
                        "self_reconstruction 30%% as RetroMAE)")
    g.add_argument("--decoder_mask_rate", type=float, default=None,
                   help="mask rate of the decoder inputs (default: the objective's; xprt 60%%, self_reconstruction 50%%)")
    g.add_argument("--max_groups", type=int, default=None, help="use only the first N groups (debugging)")

    g = p.add_argument_group("fine-tuning data (--stage finetune)")
    g.add_argument("--beir_dir", default=None, help="BEIR-layout folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)")
    g.add_argument("--qrels_split", default="train", help="qrels file used for training (never the test split)")
    g.add_argument("--triples_file", default=None,
                   help="TSV (query<TAB>positive[<TAB>negative...]) or JSONL ({query, positive, negatives}) of pairs")
    g.add_argument("--num_negatives", type=int, default=1, help="hard negatives per query in each step")
    g.add_argument("--negatives_rank_min", type=int, default=10,
                   help="mined negatives come from ranks [min, max] of the starting model (1-based); skipping the "
                        "very top avoids unlabelled true positives (false negatives)")
    g.add_argument("--negatives_rank_max", type=int, default=100, help="last rank of the mining window")
    g.add_argument("--mined_negatives", default=None,
                   help="mined_negatives.json of an earlier run (same start model and data) to reuse instead of mining")
    g.add_argument("--mining_batch_size", type=int, default=64, help="batch size when embedding for mining")
    g.add_argument("--query_max_length", type=int, default=32, help="max query tokens (PAIR: 32)")
    g.add_argument("--passage_max_length", type=int, default=128, help="max passage tokens (PAIR: 128)")
    g.add_argument("--pair_alpha", type=float, default=0.0,
                   help="alpha of (1 - alpha) L_Q + alpha L_P; 0 = plain fine-tuning (PAIR stage 2), 0.1 = official code")
    g.add_argument("--pair_alpha_schedule", choices=["constant", "linear"], default="constant",
                   help="constant alpha (official code) or linear decay from --pair_alpha to 0 (PAIR's description)")

    g = p.add_argument_group("PAIR stage 1: pseudo-queries (needs real generator / cross-encoder weights to be useful)")
    g.add_argument("--generate_pseudo_queries", action="store_true",
                   help="generate queries for corpus passages with a seq2seq model and keep those a cross-encoder accepts")
    g.add_argument("--generator_model", default=None, help="seq2seq generator (e.g. a doc2query T5)")
    g.add_argument("--cross_encoder_model", default=None, help="sequence-classification cross-encoder for denoising")
    g.add_argument("--pseudo_queries_per_passage", type=int, default=1, help="queries sampled per passage")
    g.add_argument("--max_pseudo_passages", type=int, default=1000, help="passages used for generation")
    g.add_argument("--denoise_threshold", type=float, default=0.5,
                   help="keep a pseudo pair when the cross-encoder's relevance probability is at least this")
    g.add_argument("--pseudo_query_max_length", type=int, default=32, help="max generated query tokens")

    g = p.add_argument_group("loss weights (modeling_xprt.LossWeights; None = its defaults)")
    g.add_argument("--xp_weight", type=float, default=None, help="weight of L_xp")
    g.add_argument("--cross_weight", type=float, default=None, help="weight of L_cross (paper: 0.1)")
    g.add_argument("--self_fill_weight", type=float, default=None, help="weight of L_self (not given by the paper)")
    g.add_argument("--mlm_weight", type=float, default=None, help="weight of L_MLM (not given by the paper)")
    g.add_argument("--unif_weight", type=float, default=None, help="weight of L_unif (not given by the paper)")
    g.add_argument("--tau", type=float, default=None, help="InfoNCE temperature (paper: 0.05)")
    g.add_argument("--retention_weight", type=float, default=None,
                   help="retention weight at step 0 (paper: 40, the pretrain default); 0 turns the term and the teacher "
                        "off (from-BERT setting). Fine-tuning has no retention term (default 0 there)")
    g.add_argument("--retention_student", choices=["clean", "masked"], default="clean",
                   help="student vectors in the retention term: 'clean' = one extra pass on the clean anchor and s1 "
                        "(0 at step 0; our default), 'masked' = reuse the 15%%-masked vectors (the paper's 5-pass cost; "
                        "masking noise alone gives a non-zero start)")
    g.add_argument("--retention_final_weight", type=float, default=0.0, help="retention weight at the last step (paper: 0)")
    g.add_argument("--retention_schedule", choices=["linear", "cosine", "constant"], default="linear",
                   help="shape of the 40 -> 0 decay (the paper says 'decaying' only)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--per_device_train_batch_size", type=int, default=32,
                   help="groups (pretrain) or queries (finetune) per device; in-batch negatives = this x world size")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per step (adds no negatives)")
    g.add_argument("--learning_rate", type=float, default=None, help="peak lr (default: 1e-6 pretrain, paper; 3e-5 finetune, PAIR)")
    g.add_argument("--head_learning_rate", type=float, default=None,
                   help="peak lr of the parameters the start model did not train: the decoder and the MLM head's "
                        "transform and bias (the vocabulary projection is tied to the embeddings and stays with the "
                        "encoder). Default: --learning_rate, as in the paper. A fresh head (MiniLM, E5) at 1e-6 keeps the "
                        "fill-in terms near ln V for thousands of steps; e.g. 1e-4 lets them learn (not in the paper)")
    g.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (not on biases / LayerNorm)")
    g.add_argument("--lr_scheduler_type", default="linear", help="transformers.get_scheduler name")
    g.add_argument("--warmup_ratio", type=float, default=0.1, help="warmup fraction of the steps (PAIR: 0.1)")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    g.add_argument("--num_train_epochs", type=int, default=1, help="epochs (ignored when --max_train_steps is set)")
    g.add_argument("--max_train_steps", type=int, default=None, help="optimiser steps; sets the schedule length")
    g.add_argument("--stop_after_steps", type=int, default=None,
                   help="stop after this many steps without changing the schedule (as if preempted; for resume tests)")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                   help="override accelerate's config (bf16 on Ampere+ GPUs)")
    g.add_argument("--gradient_checkpointing", action="store_true", help="trade compute for memory (use_reentrant=False)")
    g.add_argument("--seed", type=int, default=42, help="seed of everything (data order, masks, init, dropout)")
    g.add_argument("--on_nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss stops the run naming step and term, or skips that step")

    g = p.add_argument_group("output, checkpoints, logging")
    g.add_argument("--output_dir", required=True, help="run folder: model/, checkpoints/, logs/, train_log.jsonl, loss_curve.png")
    g.add_argument("--overwrite", action="store_true", help="replace an existing run in --output_dir")
    g.add_argument("--checkpointing_steps", type=int, default=None, help="save_state every N steps")
    g.add_argument("--checkpoints_total_limit", type=int, default=2, help="keep only the last K checkpoints")
    g.add_argument("--resume_from_checkpoint", default=None, help="'latest' (in output_dir/checkpoints) or a checkpoint folder")
    g.add_argument("--report_to", default="tensorboard", help="accelerate tracker(s): tensorboard, wandb, all, none")
    g.add_argument("--logging_steps", type=int, default=10, help="log every N steps")
    g.add_argument("--no_save_model", action="store_true", help="skip writing model/ at the end (tests, benchmarks)")
    args = p.parse_args(argv)

    # Sanity checks that fail early with a clear message.
    if args.learning_rate is None:
        args.learning_rate = 1e-6 if args.stage == "pretrain" else 3e-5
    if args.stage == "pretrain" and not args.groups_dir:
        raise SystemExit("--stage pretrain needs --groups_dir (the folder written by select_groups.py)")
    if args.stage == "finetune" and not (args.beir_dir or args.triples_file or args.generate_pseudo_queries):
        raise SystemExit("--stage finetune needs --beir_dir, --triples_file or --generate_pseudo_queries")
    if args.generate_pseudo_queries and not (args.generator_model and args.cross_encoder_model):
        raise SystemExit("--generate_pseudo_queries needs --generator_model and --cross_encoder_model")
    for name in ("encoder_mask_rate", "decoder_mask_rate", "warmup_ratio"):
        if getattr(args, name) is not None and not 0.0 <= getattr(args, name) < 1.0:
            raise SystemExit(f"--{name} must be in [0, 1)")
    if not 0.0 <= args.pair_alpha <= 1.0:
        raise SystemExit("--pair_alpha must be in [0, 1]")
    if args.retention_weight is None:
        args.retention_weight = 40.0 if args.stage == "pretrain" else 0.0
    if args.stage == "finetune" and (args.retention_weight > 0 or args.retention_final_weight > 0):
        raise SystemExit("--stage finetune: PAIR's loss has no retention term; leave --retention_weight at 0")
    if args.retention_weight < 0 or args.retention_final_weight < 0:
        raise SystemExit("retention weights must be >= 0")
    if not 1 <= args.negatives_rank_min <= args.negatives_rank_max:
        raise SystemExit("need 1 <= --negatives_rank_min <= --negatives_rank_max")
    if args.stage == "finetune" and args.num_negatives < 0:
        raise SystemExit("--num_negatives must be >= 0")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Schedules: retention weight 40 -> 0 and PAIR's alpha
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


def pair_alpha_at(step: int, total_steps: int, alpha_0: float, schedule: str) -> float:
    """PAIR's alpha in L = (1 - alpha) L_Q + alpha L_P at optimiser step `step` (0-based).

    constant: alpha_0 every step (the official code's pre-training uses 0.1);
    linear:   alpha_0 * (1 - step / total_steps), decaying to 0 (PAIR's "dynamic decay from alpha_0 > 0").
    Fine-tuning in PAIR's stage 2 is alpha = 0.
    """
    if schedule == "constant":
        return alpha_0
    return alpha_0 * max(0.0, 1.0 - step / max(1, total_steps))


class TrainState:
    """Steps done and the epoch, registered for checkpointing next to the schedule and the collator."""

    def __init__(self):
        self.completed_steps, self.epoch, self.batches_in_epoch = 0, 0, 0

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        self.__dict__.update({k: int(v) for k, v in state.items()})


# ----------------------------------------------------------------------------------------------------------------
# Length-grouped batching
# ----------------------------------------------------------------------------------------------------------------
class LengthGroupedBatchSampler(torch.utils.data.Sampler):
    """Batches of similar length, in a random order that depends only on (seed, epoch).

    Shuffle, cut into mega-batches of 50 batches, sort each mega-batch by length, cut into batches, shuffle the
    batches: padding drops a lot while each batch still mixes documents (in-batch negatives stay random enough).
    Incomplete last batches are dropped so every step has the same number of negatives. Being a function of
    (seed, epoch) is what makes skip_first_batches land on the same data after a resume.
    """

    def __init__(self, lengths, batch_size: int, seed: int, group_by_length: bool = True, mega: int = 50):
        self.lengths, self.batch_size, self.seed, self.group, self.mega = list(lengths), batch_size, seed, group_by_length, mega
        self.epoch, self.drop_last = 0, True
        if len(self.lengths) < batch_size:
            raise ValueError(f"{len(self.lengths)} examples cannot fill one batch of {batch_size}")

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def batches(self):
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        if self.group:
            span = self.batch_size * self.mega
            order = [i for s in range(0, len(order), span) for i in sorted(order[s:s + span], key=lambda i: -self.lengths[i])]
        out = [order[s:s + self.batch_size] for s in range(0, len(order) - self.batch_size + 1, self.batch_size)]
        rng.shuffle(out)
        return out

    def __iter__(self):
        return iter(self.batches())

    def __len__(self):
        return len(self.lengths) // self.batch_size


class RowsDataset(torch.utils.data.Dataset):
    """Rows as plain dicts. Collation happens in the training loop, not in the DataLoader: the DataLoader
    prefetches a batch ahead, which would advance the collator's mask RNG past a checkpoint and break exact resume."""

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
# Data: pre-training groups
# ----------------------------------------------------------------------------------------------------------------
def load_groups(groups_dir: str, max_groups=None):
    """The groups folder (INTERFACE.md schema) as a list of row dicts."""
    from datasets import load_dataset

    files = sorted(str(f) for f in Path(groups_dir).glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no *.parquet in {groups_dir}: run select_groups.py first")
    ds = load_dataset("parquet", data_files=files, split="train")
    for col in ("doc_id", "anchor", "related", "random_passage"):
        if col not in ds.column_names:
            raise ValueError(f"{groups_dir} lacks column {col!r}: not a select_groups.py output?")
    if max_groups:
        ds = ds.select(range(min(max_groups, len(ds))))
    return ds.to_list()


# ----------------------------------------------------------------------------------------------------------------
# Data: fine-tuning pairs, hard-negative mining, PAIR stage-1 pseudo-queries
# ----------------------------------------------------------------------------------------------------------------
def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_beir(beir_dir: str, split: str):
    """corpus {id: 'title text'}, queries {id: text}, qrels {qid: {did: score>0}} of a BEIR-layout folder."""
    root = Path(beir_dir)
    corpus = {str(d["_id"]): (d.get("title", "") + " " + d["text"]).strip() for d in read_jsonl(root / "corpus.jsonl")}
    queries = {str(q["_id"]): q["text"] for q in read_jsonl(root / "queries.jsonl")}
    qrels: dict[str, dict[str, int]] = {}
    with open(root / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
        for n, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if n == 0 and not parts[-1].lstrip("-").isdigit():
                continue  # header
            qid, did, score = parts[0], parts[1], int(parts[-1])
            if score > 0:
                qrels.setdefault(qid, {})[did] = score
    missing = [q for q in qrels if q not in queries] + [d for r in qrels.values() for d in r if d not in corpus]
    if missing:
        raise ValueError(f"{len(missing)} qrels ids missing from queries/corpus, e.g. {missing[:3]}")
    return corpus, queries, qrels


def load_triples(path: str):
    """Rows {query, positive, negatives} from TSV (query, positive, negatives...) or JSONL."""
    rows = []
    if path.endswith((".jsonl", ".json")):
        for r in read_jsonl(path):
            negs = r.get("negatives", [r["negative"]] if "negative" in r else [])
            rows.append({"query": r["query"], "positive": r["positive"], "negatives": list(negs)})
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 2:
                    rows.append({"query": parts[0], "positive": parts[1], "negatives": parts[2:]})
    if not rows:
        raise ValueError(f"no (query, positive) rows in {path}")
    return rows


@torch.no_grad()
def mine_hard_negatives(encoder, tokenizer, query_texts, positive_ids, corpus_ids, corpus_texts, rank_min, rank_max,
                        query_max_length=32, passage_max_length=128, query_prefix="", passage_prefix="", batch_size=64):
    """For each query, corpus ids ranked rank_min..rank_max (1-based) by the starting model, minus its positives.

    Hard negatives are what PAIR and RocketQA train on; the very top ranks are skipped because on sparsely judged
    data (one or two positives per query) they are often unlabelled positives. A passage whose text equals one of
    the query's positives is excluded as well (duplicated corpus entries). positive_ids[i] is the set of ALL
    positives of query i, so no query ever gets one of its own positives as a negative.
    """
    from modeling_xprt import embed_texts

    q = embed_texts(encoder, tokenizer, query_texts, batch_size, query_max_length, query_prefix, desc="mining: queries")
    c = embed_texts(encoder, tokenizer, corpus_texts, batch_size, passage_max_length, passage_prefix,
                    show_progress=True, desc="mining: corpus")
    text_of = dict(zip(corpus_ids, corpus_texts))
    k = min(rank_max, len(corpus_ids))
    top = (q @ c.T).topk(k, dim=1).indices  # (queries, k), best first
    pools = []
    for i, row in enumerate(top.tolist()):
        pos_texts = {text_of.get(d) for d in positive_ids[i]}
        window = [corpus_ids[j] for j in row[rank_min - 1:k]]
        pools.append([d for d in window if d not in positive_ids[i] and text_of[d] not in pos_texts])
    return pools


@torch.no_grad()
def generate_pseudo_queries(generator, gen_tokenizer, passages, num_per_passage=1, max_new_tokens=32,
                            passage_max_length=256, batch_size=16, seed=0):
    """PAIR stage 1, part 1: sample queries for passages with a seq2seq generator (docT5query-style top-k sampling).

    Returns [(passage_index, query)], num_per_passage per passage. Useful only with real generator weights
    (e.g. a doc2query T5); random weights give random tokens (that is what the tests use).
    """
    torch.manual_seed(seed)
    device = next(generator.parameters()).device
    out = []
    for s in range(0, len(passages), batch_size):
        chunk = passages[s:s + batch_size]
        enc = gen_tokenizer(chunk, truncation=True, max_length=passage_max_length, padding=True, return_tensors="pt").to(device)
        ids = generator.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=True, top_k=10, max_new_tokens=max_new_tokens,
                                 num_return_sequences=num_per_passage)
        texts = gen_tokenizer.batch_decode(ids, skip_special_tokens=True)
        out += [(s + j // num_per_passage, t.strip()) for j, t in enumerate(texts)]
    return out


@torch.no_grad()
def cross_encoder_scores(cross_encoder, ce_tokenizer, queries, passages, max_length=256, batch_size=32):
    """Relevance probability of each (query, passage): sigmoid of a 1-logit head, else softmax[:, -1]."""
    device = next(cross_encoder.parameters()).device
    scores = []
    for s in range(0, len(queries), batch_size):
        enc = ce_tokenizer(queries[s:s + batch_size], passages[s:s + batch_size], truncation=True,
                           max_length=max_length, padding=True, return_tensors="pt").to(device)
        logits = cross_encoder(**enc).logits.float()
        scores.append(torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else logits.softmax(-1)[:, -1])
    return torch.cat(scores).cpu() if scores else torch.empty(0)


def denoise_pseudo_queries(pairs, passages, scores, threshold):
    """PAIR stage 1, part 2: keep (passage_index, query) pairs whose cross-encoder probability >= threshold."""
    return [(pi, q) for (pi, q), s in zip(pairs, scores.tolist()) if s >= threshold and q]


def build_finetune_rows(args, accelerator, encoder, tokenizer):
    """Rows {query, positive, negative_pool | negatives} for --stage finetune; mining runs on the main process."""
    qp = E5_QUERY_PREFIX if args.e5_prefixes else ""
    pp = E5_PASSAGE_PREFIX if args.e5_prefixes else ""
    rows = []
    corpus = {}
    if args.triples_file:
        rows += load_triples(args.triples_file)
    mine_q, mine_pos = [], []  # rows that still need negatives: (query text, set of positive ids)
    mine_rows = []
    if args.beir_dir:
        corpus, queries, qrels = load_beir(args.beir_dir, args.qrels_split)
        for qid in sorted(qrels):
            for did in sorted(qrels[qid]):
                r = {"query": queries[qid], "positive": corpus[did]}
                rows.append(r)
                mine_rows.append(r)
                mine_q.append(queries[qid])
                mine_pos.append(set(qrels[qid]))
    if args.generate_pseudo_queries:
        from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification, AutoTokenizer

        if not corpus:
            raise SystemExit("--generate_pseudo_queries needs a corpus: pass --beir_dir")
        ids = sorted(corpus)[: args.max_pseudo_passages]
        texts = [corpus[d] for d in ids]
        gen_tok = AutoTokenizer.from_pretrained(args.generator_model)
        gen = AutoModelForSeq2SeqLM.from_pretrained(args.generator_model).to(accelerator.device).eval()
        pairs = generate_pseudo_queries(gen, gen_tok, texts, args.pseudo_queries_per_passage,
                                        args.pseudo_query_max_length, seed=args.seed)
        ce_tok = AutoTokenizer.from_pretrained(args.cross_encoder_model)
        ce = AutoModelForSequenceClassification.from_pretrained(args.cross_encoder_model).to(accelerator.device).eval()
        scores = cross_encoder_scores(ce, ce_tok, [q for _, q in pairs], [texts[i] for i, _ in pairs])
        kept = denoise_pseudo_queries(pairs, texts, scores, args.denoise_threshold)
        accelerator.print(f"pseudo-queries: {len(pairs)} generated, {len(kept)} kept by the cross-encoder "
                          f"(threshold {args.denoise_threshold})")
        for pi, q in kept:
            r = {"query": q, "positive": texts[pi]}
            rows.append(r)
            mine_rows.append(r)
            mine_q.append(q)
            mine_pos.append({ids[pi]})
    if mine_rows:
        cache = Path(args.output_dir) / "mined_negatives.json"
        if args.mined_negatives:  # reuse pools mined by an earlier run with the same start model and data
            pools = json.loads(Path(args.mined_negatives).read_text())
            if len(pools) != len(mine_rows):
                raise SystemExit(f"{args.mined_negatives}: {len(pools)} pools for {len(mine_rows)} queries: "
                                 "mined for other data; drop --mined_negatives to mine again")
            if accelerator.is_main_process:
                tmp = cache.with_suffix(".tmp")
                tmp.write_text(json.dumps(pools))
                os.replace(tmp, cache)
        elif accelerator.is_main_process:
            cids = sorted(corpus)
            pools = mine_hard_negatives(encoder, tokenizer, mine_q, mine_pos, cids, [corpus[d] for d in cids],
                                        args.negatives_rank_min, args.negatives_rank_max, args.query_max_length,
                                        args.passage_max_length, qp, pp, args.mining_batch_size)
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(pools))
            os.replace(tmp, cache)
        accelerator.wait_for_everyone()
        pools = json.loads(cache.read_text())
        short = sum(len(p) < args.num_negatives for p in pools)
        if short:
            raise SystemExit(f"{short} queries have fewer than {args.num_negatives} mined negatives in ranks "
                             f"{args.negatives_rank_min}-{args.negatives_rank_max}: widen the window")
        for r, pool in zip(mine_rows, pools):
            r["negative_pool"] = [corpus[d] for d in pool]
    for r in rows:
        if "negative_pool" not in r and len(r.get("negatives", [])) < args.num_negatives:
            raise SystemExit(f"a triple has fewer than {args.num_negatives} negatives and no corpus to mine from")
    return rows


def pick_negatives(row, num, seed, epoch):
    """The step's hard negatives for one row: a sample of its mined pool, a function of (seed, epoch, row) only,
    so a resumed run draws the same negatives."""
    if "negative_pool" not in row:
        return list(row.get("negatives", []))[:num]
    rng = random.Random(f"{seed}-{epoch}-{row['__index__']}")
    return rng.sample(row["negative_pool"], num)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints and output
# ----------------------------------------------------------------------------------------------------------------
def list_checkpoints(ckpt_dir: Path):
    """Complete checkpoints (a DONE marker is written last) sorted by step."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(d.name.split("_")[1]), d) for d in ckpt_dir.glob("step_*") if (d / "DONE").exists()]
    return [d for _, d in sorted(found)]


def all_finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def model_card(args, summary) -> str:
    cfg = {k: v for k, v in sorted(vars(args).items())}
    return (
        "---\nlibrary_name: sentence-transformers\npipeline_tag: sentence-similarity\ntags: [xprt, retrieval]\n---\n\n"
        f"# xprt {args.stage} ({args.objective if args.stage == 'pretrain' else 'PAIR loss'})\n\n"
        f"Trained with train.py from `{args.model_name_or_path}`. Mean pooling, L2-normalise for cosine"
        f"{'; prefix queries with `query: ` and passages with `passage: `' if args.e5_prefixes else ''}.\n\n"
        f"## Result\n\n```json\n{json.dumps(summary, indent=1)}\n```\n\n"
        f"## Configuration (train.py flags)\n\n```json\n{json.dumps(cfg, indent=1, default=str)}\n```\n")


def plot_loss_curves(log_path: Path, png_path: Path):
    """One panel per logged quantity (loss terms, lr, retention weight), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = {}
    for r in read_jsonl(log_path):
        recs[r["step"]] = r  # a resumed run rewrites steps: keep the last
    steps = sorted(recs)
    keys = [k for k in recs[steps[-1]] if k.endswith("loss") or k in ("lr", "head_lr", "retention_weight")]
    if any(recs[s].get("pair_alpha") for s in steps):  # only fine-tuning runs have an alpha to show
        keys.append("pair_alpha")
    fig, axes = plt.subplots(math.ceil(len(keys) / 3), 3, figsize=(13, 3 * math.ceil(len(keys) / 3)), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        xs = [s for s in steps if k in recs[s]]
        ax.plot(xs, [recs[s][k] for s in xs])
        ax.set_title(k)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png_path)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
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


def head_parameters(model) -> list:
    """The parameters the start model never trained: everything outside the encoder's base model (the decoder, the
    MLM head's transform and output bias). The tied vocabulary projection IS the word-embedding matrix, so it counts
    as the encoder's."""
    base = {id(p) for p in model.encoder.base_model.parameters()}
    return [p for p in model.parameters() if id(p) not in base]


def optimizer_groups(model, args):
    """AdamW parameter groups: no decay on biases and LayerNorm weights (BERT recipe); the parameters
    outside the encoder's base model (the decoder, the MLM head's transform and bias) at
    --head_learning_rate. The tied vocabulary projection IS the word-embedding matrix: named_parameters
    lists it once, under the encoder, so it keeps the encoder's lr. Empty groups are dropped."""
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
    head_ids = {id(p) for p in head_parameters(model)}
    head_lr = args.head_learning_rate if args.head_learning_rate is not None else args.learning_rate
    groups = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_head = id(p) in head_ids
        decay = 0.0 if n.endswith(no_decay) else args.weight_decay
        key = (is_head, decay)
        groups.setdefault(key, {"params": [], "weight_decay": decay, "name": "heads" if is_head else "encoder",
                                "lr": head_lr if is_head else args.learning_rate})["params"].append(p)
    return [g for _, g in sorted(groups.items())]


def main(argv=None):
    args = parse_args(argv)
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, get_scheduler

    from modeling_xprt import LossWeights, PairCollator, XPRTCollator, XPRTModel, load_mlm_encoder, load_teacher, read_max_seq_length

    out = Path(args.output_dir)
    ckpt_dir, log_path = out / "checkpoints", out / "train_log.jsonl"
    # ---- accelerator: some pre-training objectives leave heads unused (no decoder without fill-in), which DDP only
    # tolerates with find_unused_parameters. Fine-tuning freezes its idle heads below, so it needs no search.
    all_used = args.stage == "finetune" or (args.objective == "xprt" and not args.no_fill_in)
    # Without a GPU, accelerate only forms a multi-process (gloo) group when told cpu=True; DeepSpeed's own CPU
    # path must not get it (cpu=True would silently turn DeepSpeed off).
    no_gpu_ddp = not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true"
    accelerator = Accelerator(
        cpu=no_gpu_ddp,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=str(out / "logs"),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=not all_used)],
    )
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        # our DataLoader has a batch_sampler (no batch_size attribute), so DeepSpeed's "auto" cannot infer it
        ds_cfg = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_cfg["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        if ds_cfg.get("gradient_clipping") == "auto":
            ds_cfg["gradient_clipping"] = args.max_grad_norm
    resuming = args.resume_from_checkpoint is not None
    if accelerator.is_main_process:
        if (out / "model").exists() and not args.overwrite:
            raise SystemExit(f"{out / 'model'} exists: pass --overwrite to replace it")
        if not resuming and list_checkpoints(ckpt_dir) and not args.overwrite:
            raise SystemExit(f"{ckpt_dir} has checkpoints: --resume_from_checkpoint latest, or --overwrite")
        if args.overwrite and not resuming:
            for name in ("checkpoints", "logs", "model", "train_log.jsonl", "loss_curve.png", "mined_negatives.json"):
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    set_seed(args.seed)

    # ---- model and tokenizer
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
    objective = "pair" if args.stage == "finetune" else args.objective
    weights = LossWeights(**{f: getattr(args, a) for f, a in [("xp", "xp_weight"), ("cross", "cross_weight"),
                          ("self_fill", "self_fill_weight"), ("mlm", "mlm_weight"), ("unif", "unif_weight"), ("tau", "tau")]
                          if getattr(args, a) is not None})
    # Loaded whole (not ZeRO-3-partitioned at load, see whole_weights): fine-tuning mines negatives with it before
    # prepare; DeepSpeed partitions it at prepare.
    with whole_weights():
        if os.path.exists(os.path.join(model_path, "xprt_heads.safetensors")):  # continue from an xprt output
            model = XPRTModel.from_pretrained(model_path, objective=objective, weights=weights, fill_in=not args.no_fill_in,
                                               retention_student=args.retention_student)
            accelerator.print(f"model: xprt folder {model_path} (heads restored)")
        else:
            mlm, msg = load_mlm_encoder(model_path, mlm_head_from=args.mlm_head_from, trust_remote_code=args.trust_remote_code)
            accelerator.print(f"model: {msg}")
            model = XPRTModel(mlm, objective=objective, weights=weights, fill_in=not args.no_fill_in,
                              retention_student=args.retention_student)
    model.max_seq_length = read_max_seq_length(model_path)  # carried into the saved sentence_bert_config.json
    if args.stage == "finetune":
        # PAIR's losses read only the pooled encoder vectors: the decoder and the MLM head's own parameters (transform,
        # output bias; the tied projection is the word embeddings and stays trainable) get no gradient. Frozen, they
        # stay out of the optimiser and DDP's reducer, and are saved unchanged for a later pre-training run.
        for p in head_parameters(model):
            p.requires_grad_(False)
    if zero3(accelerator):
        # The tied vocabulary projection (= the word embeddings) and its bias are read in XPRTModel.forward outside
        # the modules that own them: ZeRO-3 must keep them gathered for the whole forward and backward.
        import deepspeed

        for p in model.projection():
            deepspeed.zero.register_external_parameter(model, p)
    if args.gradient_checkpointing:
        model.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # ---- data
    qp = E5_QUERY_PREFIX if args.e5_prefixes else ""
    pp = E5_PASSAGE_PREFIX if args.e5_prefixes else ""
    if args.stage == "pretrain":
        rows = load_groups(args.groups_dir, args.max_groups)
        lengths = [len(r["anchor"]) + sum(len(t) for t in r["related"][: args.num_related]) for r in rows]
        # different mask RNG per process, same across restarts
        collator = XPRTCollator(tokenizer, objective=args.objective, num_related=args.num_related,
                                max_length=args.max_length, encoder_mask_rate=args.encoder_mask_rate,
                                decoder_mask_rate=args.decoder_mask_rate, passage_prefix=pp, positive=args.positive,
                                seed=args.seed + accelerator.process_index)
    else:
        model.encoder.to(accelerator.device)  # mining runs on the accelerator
        with whole_weights():  # the generator and cross-encoder too
            rows = build_finetune_rows(args, accelerator, model.encoder, tokenizer)
        lengths = [len(r["query"]) + len(r["positive"]) for r in rows]
        collator = PairCollator(tokenizer, query_max_length=args.query_max_length,
                                passage_max_length=args.passage_max_length, query_prefix=qp, passage_prefix=pp,
                                num_negatives=args.num_negatives)
    # per-device batches: accelerate hands whole batches to the processes in turn
    batch_sampler = LengthGroupedBatchSampler(lengths, args.per_device_train_batch_size, args.seed)
    # generator: the DataLoader draws its base seed from it, not from the global RNG that drives dropout
    dataloader = torch.utils.data.DataLoader(RowsDataset(rows), batch_sampler=batch_sampler, collate_fn=list,
                                             generator=torch.Generator().manual_seed(args.seed))

    # ---- teacher for the retention term (frozen; not prepared: it never trains)
    teacher = None
    if args.retention_weight > 0 or args.retention_final_weight > 0:
        with whole_weights():
            teacher = load_teacher(resolve_model_path(args.teacher_name_or_path or args.model_name_or_path),
                                   trust_remote_code=args.trust_remote_code).to(accelerator.device)

    param_groups = optimizer_groups(model, args)
    trainable = sum(p.numel() for g in param_groups for p in g["params"])
    accelerator.print(f"trainable parameters: {trainable:,} ({', '.join(sorted({g['name'] for g in param_groups}))})")
    optimizer = torch.optim.AdamW(param_groups, lr=args.learning_rate)

    # ---- prepare, then the step count (the prepared loader is sharded: len is per process)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    steps_per_epoch = math.ceil(len(dataloader) / args.gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise SystemExit("not enough data for one step per process: lower the batch size")
    max_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_steps / steps_per_epoch)
    # AcceleratedScheduler steps once per process per optimiser step: scale like the HF no_trainer examples
    lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                                 num_warmup_steps=int(args.warmup_ratio * max_steps) * accelerator.num_processes,
                                 num_training_steps=max_steps * accelerator.num_processes)
    lr_scheduler = accelerator.prepare(lr_scheduler)
    retention = RetentionSchedule(args.retention_weight, args.retention_final_weight, max_steps, args.retention_schedule)
    state = TrainState()
    # Same state on every process: registered with accelerate (saved once, by the main process).
    for obj in (retention, state):
        accelerator.register_for_checkpointing(obj)
    # The collator's mask RNG differs per process, and accelerate saves custom objects from the main process only,
    # so each process writes its own (collator_state_<rank>.safetensors; see save_checkpoint).

    # ---- resume: model, optimiser, scheduler, RNGs, schedule, collator RNG, then the data position
    if resuming:
        path = None
        if args.resume_from_checkpoint == "latest":
            found = list_checkpoints(ckpt_dir)
            path = found[-1] if found else None
            if path is None:
                accelerator.print(f"no complete checkpoint in {ckpt_dir}: starting from scratch")
        else:
            path = Path(args.resume_from_checkpoint)
            if not (path / "DONE").exists():
                raise SystemExit(f"{path} is not a complete checkpoint (no DONE marker)")
        if path is not None:
            accelerator.load_state(str(path))
            load_collator_state(collator, path, accelerator.process_index)
            accelerator.print(f"resumed from {path} at step {state.completed_steps}")

    world = accelerator.num_processes
    unit = "groups" if args.stage == "pretrain" else "queries"
    accelerator.print(
        f"{accelerator.distributed_type} x {world}, mixed precision {accelerator.mixed_precision}; "
        f"stage {args.stage}, objective {objective}: {len(rows)} {unit}, {max_steps} steps x "
        f"{args.per_device_train_batch_size} per device x {world} processes x {args.gradient_accumulation_steps} "
        f"accumulation; in-batch negatives per step = {args.per_device_train_batch_size * world} "
        f"(accumulation adds none); lr {args.learning_rate} (heads {args.learning_rate if args.head_learning_rate is None else args.head_learning_rate}), retention {args.retention_weight} -> "
        f"{args.retention_final_weight}")
    if accelerator.is_main_process:
        cfg = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in vars(args).items()}
        accelerator.init_trackers("xprt", config=cfg)

    # ---- loop
    model.train()
    t_log, real_log, proc_log, sums, n_micro, n_skipped = time.time(), 0, 0, {}, 0, 0
    first_step_printed = False
    progress = tqdm(total=max_steps, initial=state.completed_steps, disable=not accelerator.is_local_main_process, desc="train")
    stop_at = min(max_steps, args.stop_after_steps or max_steps)
    log_f = open(log_path, "a", encoding="utf-8") if accelerator.is_main_process else None
    for epoch in range(state.epoch, num_epochs):
        if state.completed_steps >= stop_at:
            break
        # accelerate's loader re-sets the sampler's epoch from its own iteration counter on every __iter__; a resumed
        # run must move that counter too, or epochs after the resumed one would replay epoch 0's order
        dataloader.set_epoch(epoch)
        batch_sampler.set_epoch(epoch)
        skip = state.batches_in_epoch if epoch == state.epoch else 0
        state.epoch, state.batches_in_epoch = epoch, skip
        # skip_first_batches skips at the sampler level: no collation, no RNG drawn for the skipped batches
        active = accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        for rows_b in active:
            if args.stage == "finetune":
                rows_b = [{"query": r["query"], "positive": r["positive"],
                           "negatives": pick_negatives(r, args.num_negatives, args.seed, epoch)} for r in rows_b]
            else:
                rows_b = [{k: v for k, v in r.items() if k != "__index__"} for r in rows_b]
            batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in collator(rows_b).items()}
            real, proc = padding_efficiency(batch, skip=() if teacher is not None else ("retain_",))
            real_log, proc_log = real_log + real, proc_log + proc
            if not first_step_printed:
                accelerator.print(f"tokens per step: ~{real * args.gradient_accumulation_steps * world} real, "
                                  f"{proc * args.gradient_accumulation_steps * world} processed (first batch)")
                first_step_printed = True
            with accelerator.accumulate(model):
                w = retention.value() if teacher is not None else 0.0
                alpha = pair_alpha_at(state.completed_steps, max_steps, args.pair_alpha, args.pair_alpha_schedule)
                outputs = model(batch, teacher=teacher, retention_weight=w, pair_alpha=alpha)
                loss = outputs["loss"]
                terms = {k: v for k, v in outputs.items() if torch.is_tensor(v) and v.dim() == 0}
                # a NaN on any process must stop (or skip on) every process together, or DDP would hang
                bad = [k for k, v in terms.items() if not torch.isfinite(v)]
                n_bad = accelerator.reduce(torch.tensor(float(len(bad)), device=accelerator.device), "sum").item()
                if n_bad:
                    where = f"step {state.completed_steps + 1} (epoch {epoch}), term(s) {bad or 'on another process'}"
                    if args.on_nonfinite == "stop":
                        raise FloatingPointError(f"non-finite loss at {where}; nothing was saved from this state. "
                                                 "Lower --learning_rate or use --on_nonfinite skip")
                    accelerator.print(f"skipping non-finite loss at {where}")
                    optimizer.zero_grad()  # drops this step's accumulated gradients too: nothing non-finite is applied
                    n_skipped += 1
                else:
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and args.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    for k, v in terms.items():
                        sums[k] = sums.get(k, 0.0) + v.item()  # note: .item() is a device sync point
                    n_micro += 1
            state.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            # ---- one optimiser step done
            state.completed_steps += 1
            retention.step()
            progress.update(1)
            if state.completed_steps % args.logging_steps == 0 or state.completed_steps == stop_at:
                dt = time.time() - t_log
                # mean over micro-batches and processes
                keys = sorted(sums)
                vals = accelerator.reduce(torch.tensor([sums[k] / max(n_micro, 1) for k in keys] +
                                                       [real_log, proc_log], device=accelerator.device, dtype=torch.float64), "sum")
                rec = {"step": state.completed_steps, "epoch": epoch}
                rec.update({k: vals[i].item() / world for i, k in enumerate(keys)})
                rec.update({"lr": lr_scheduler.get_last_lr()[0], "retention_weight": w, "pair_alpha": alpha,
                            "padding_efficiency": vals[-2].item() / max(vals[-1].item(), 1),
                            "tokens_per_s": vals[-2].item() / dt, "time_per_step_s": dt / args.logging_steps})
                if args.head_learning_rate is not None:
                    lrs = lr_scheduler.get_last_lr()  # one per optimiser group, in order
                    rec["head_lr"] = next(lr for lr, g in zip(lrs, optimizer.param_groups) if g["name"] == "heads")
                if n_skipped:
                    rec["skipped_nonfinite_micro_batches"] = n_skipped
                accelerator.log({k: v for k, v in rec.items() if k != "step"}, step=state.completed_steps)
                if log_f:
                    log_f.write(json.dumps(rec) + "\n")
                    log_f.flush()
                progress.set_postfix(loss=f"{rec.get('loss', float('nan')):.4f}", s_per_step=f"{rec['time_per_step_s']:.2f}")
                t_log, real_log, proc_log, sums, n_micro, n_skipped = time.time(), 0, 0, {}, 0, 0
            if args.checkpointing_steps and state.completed_steps % args.checkpointing_steps == 0:
                save_checkpoint(accelerator, model, collator, ckpt_dir, state.completed_steps, args.checkpoints_total_limit)
            if state.completed_steps >= stop_at:
                break
        else:
            state.batches_in_epoch = 0  # epoch finished: the next one starts at its first batch
            continue
        break
    progress.close()
    if log_f:
        log_f.close()

    # ---- save
    accelerator.wait_for_everyone()
    finished = state.completed_steps >= max_steps
    if accelerator.is_main_process and log_path.exists() and log_path.stat().st_size:
        plot_loss_curves(log_path, out / "loss_curve.png")
    if finished and not args.no_save_model:
        save_model(accelerator, model, tokenizer, out / "model", args, log_path)
    accelerator.end_training()
    return {"completed_steps": state.completed_steps, "max_steps": max_steps, "output_dir": str(out),
            "trainable_parameters": trainable}


def _gathered(accelerator, model):
    """Context that gathers ZeRO-3 partitioned parameters (a no-op otherwise)."""
    if zero3(accelerator):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def zero3(accelerator) -> bool:
    """True under DeepSpeed ZeRO stage 3 (every parameter partitioned across the processes)."""
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None and accelerator.state.deepspeed_plugin.zero_stage == 3


def load_collator_state(collator, path: Path, rank: int):
    """Restore this process's collator RNG (a no-op for stateless collators such as PairCollator)."""
    f = path / f"collator_state_{rank}.safetensors"
    if hasattr(collator, "load_state_dict"):
        if not f.exists():
            raise FileNotFoundError(f"{f} missing: was the checkpoint written with a different number of processes?")
        from safetensors.torch import load_file

        collator.load_state_dict(load_file(str(f)))


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


def save_model(accelerator, model, tokenizer, dest: Path, args, log_path: Path):
    """XPRTModel.save_pretrained into a temp folder, then rename: a reader never sees half a model, and a model
    with non-finite weights is never written."""
    with _gathered(accelerator, model):
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            if not all_finite(unwrapped):
                raise FloatingPointError("non-finite weights at the end of training: model not written")
            last = {}
            if log_path.exists():
                for r in read_jsonl(log_path):
                    last = r
            tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            unwrapped.save_pretrained(str(tmp), tokenizer, model_card=model_card(args, {"last_logged_step": last}))
            if dest.exists():  # --overwrite was checked at start
                old = dest.parent / f".{dest.name}.old-{os.getpid()}"
                os.replace(dest, old)
                os.replace(tmp, dest)
                shutil.rmtree(old)
            else:
                os.replace(tmp, dest)
            accelerator.print(f"saved {dest}")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
