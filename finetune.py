"""
PAIR's two training stages: the encoder trained on (query, positive passage) pairs with PAIR's loss
(1 - alpha) L_Q + alpha L_P (modeling_xprt.pair_q_loss / pair_p_loss / pair_loss): stage 2 on labelled queries,
alpha 0 (L = L_Q: the passage-centric L_P off), by default; stage 1 with pseudo-queries (--generate_pseudo_queries),
alpha decaying from alpha_0 = 0.1 to 0 (linear), by default. An explicit --pair_alpha (and schedule) always wins.

Read it beside the PAIR paper. In the xPRT project it answers "does the pre-training gain survive fine-tuning?":
fine-tune the start model and the xPRT model the same way and compare. The steps, in the order of this file:
  1. flags
  2. PAIR's alpha: its default by stage (pair_alpha_default), its schedule (constant, as the official code; or linear
     decay, as the paper describes), and the stage said as it runs (pair_stage: the start line, the card's title)
  3. the data: labelled pairs (a BEIR folder's train qrels, MS MARCO's, or --train_data in FlagEmbedding,
     sentence-transformers, tevatron or triples format: read_pairs), or PAIR's stage 1 - pseudo-queries
     generated for corpus passages and kept when a cross-encoder agrees; hard negatives mined with the start model
  4. main: accelerator, model, data (batches without a repeated query: batches.NoDuplicatesBatchSampler), optimiser
     and scheduler, prepare, the loop, save

    accelerate launch finetune.py --model_name_or_path runs/xprt/model --beir_dir scifact/ --output_dir runs/ft

The loop is written here as train.py writes its own (checkpoints, resume, non-finite handling and the log are one
call each into plumbing/); what differs is the step's inputs: PAIR's alpha(t) where train.py has w(t), and the step's
negatives where train.py has the retention teacher.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch

from modeling_xprt import PairCollator, pair_false_negatives, pair_text_ids
from plumbing.batches import NoDuplicatesBatchSampler, batch_to_device, check_batch_fits, training_loader
from plumbing.common import (ArgumentParser, UserError, atomic_write, check_model_name, iter_jsonl, iter_parquet,
                             local_inputs, non_negative_int, on_stop, positive_int, rank_and_world, run_script,
                             task_spec)
from plumbing.embed import embed_texts
from plumbing.readers import load_beir
from plumbing.run_log import LogWindow, step_flops
from plumbing.training import (adamw, add_common_args, check_common_args, check_input_length, epoch_batches,
                               export_checkpoint, gradient_cache_step, load_model, log_score, make_accelerator,
                               prepare_output_dir, prepare_run, save_checkpoint, save_run, say_stopped,
                               stop_account, StopSignals, unpartitioned_loading)
from plumbing.training import run_line as training_run_line

DEFAULT_LR = 3e-5  # PAIR's official fine-tuning learning rate
PAIR_ALPHA_0 = 0.1  # PAIR's stage-1 alpha_0 (its official code's pre-training alpha), decayed to 0 by default


# ----------------------------------------------------------------------------------------------------------------
# 1. Flags
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("fine-tuning data")
    g.add_argument("--beir_dir", default=None,
                   help="BEIR-layout folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv): trained on its qrels; "
                        "with --train_data, only the corpus that data's rows without enough negatives are mined from "
                        "(one source is trained on)")
    g.add_argument("--qrels_split", default="train", help="qrels file used for training (never the test split)")
    g.add_argument("--train_data", "--triples_file", dest="train_data", default=None,
                   help="(query, positive[, negatives]) pairs: a file or a Hub dataset, in FlagEmbedding ({query, "
                        "pos, neg}), sentence-transformers (anchor, positive[, negative...]), tevatron ({query, "
                        "positive_passages, negative_passages}) or triples (TSV query<TAB>positive[<TAB>negative...], "
                        "JSONL {query, positive, negatives}) format, detected from the first record: .jsonl, .csv, "
                        ".tsv, .parquet or a dataset name; or MS MARCO passage ranking (the folder holding "
                        "collection.tsv, queries.<split>.tsv and qrels.<split>.tsv, or that qrels file: pairs from "
                        "the qrels, negatives mined from the collection). A headerless TSV is read by position only "
                        "when its first row holds texts (a file of ids is refused, naming its layout). Negatives in "
                        "the data are used as they are; rows with fewer than --num_negatives are mined (from "
                        "--beir_dir's corpus, else the data's own passages). A repeated (query, positive) pair trains "
                        "once")
    g.add_argument("--train_split", default="train", help="split of a --train_data Hub dataset or save_to_disk folder")
    g.add_argument("--train_config", default=None, help="config (subset) of a multi-config --train_data Hub dataset")
    g.add_argument("--train_format", default="auto", choices=["auto", *PAIR_SCHEMAS],
                   help="--train_data's schema; auto = detected from the first record's fields (an unknown layout is "
                        "refused); sentence-transformers reads any column names by position (anchor, positive, "
                        "negatives)")
    g.add_argument("--num_negatives", type=non_negative_int, default=1, help="hard negatives per query in each step")
    g.add_argument("--negatives_rank_min", type=positive_int, default=10,
                   help="mined negatives come from ranks [min, max] of the starting model (1-based); skipping the "
                        "very top avoids unlabelled true positives (false negatives)")
    g.add_argument("--negatives_rank_max", type=positive_int, default=100, help="last rank of the mining window")
    g.add_argument("--mined_negatives", default=None,
                   help="mined_negatives.json of an earlier run (same start model and data) to reuse instead of "
                        "mining, e.g. one written by --mine_only")
    g.add_argument("--mine_only", action="store_true",
                   help="mine the hard negatives (all processes share the corpus), write "
                        "<output_dir>/mined_negatives.json and exit without training: mining as its own step")
    g.add_argument("--mining_batch_size", type=positive_int, default=64, help="batch size when embedding for mining")
    g.add_argument("--mining_chunk_size", type=positive_int, default=16384,
                   help="corpus passages each process encodes and scores at a time (rounded to whole batches): "
                        "memory per process grows with it (its vectors; its scores against 256 queries at a time, "
                        "about 0.1 GB at 16384), the pools do not depend on it")
    g.add_argument("--query_max_length", type=positive_int, default=32, help="max query tokens (PAIR: 32)")
    g.add_argument("--passage_max_length", type=positive_int, default=128, help="max passage tokens (PAIR: 128)")

    g = p.add_argument_group("PAIR's loss and stage")
    g.add_argument("--pair_alpha", type=float, default=None,
                   help="alpha of (1 - alpha) L_Q + alpha L_P, the weight of the passage-centric L_P. Default by "
                        "the data, as PAIR's two stages: labelled queries -> 0 (L = L_Q: PAIR's stage 2); "
                        f"--generate_pseudo_queries -> {PAIR_ALPHA_0} decaying to 0 (PAIR's stage 1, alpha_0; "
                        "--pair_alpha_schedule linear). Given, it is used as given (its schedule constant unless "
                        "--pair_alpha_schedule says otherwise)")
    g.add_argument("--pair_alpha_schedule", choices=["constant", "linear"], default=None,
                   help="constant alpha (official code) or linear decay from --pair_alpha to 0 (PAIR's stage-1 "
                        "'dynamic decay from alpha_0'). Default: linear for stage 1's default alpha, else constant")
    g.add_argument("--pair_p_form", choices=["query", "summary"], default="query",
                   help="L_P's numerator (modeling_xprt.pair_p_loss): query = exp(f(p+, q)), the PAIR paper's "
                        "official code (default); summary = exp(-f(p+, p+)), as papers/pair.md prints it")

    g = p.add_argument_group("PAIR stage 1: pseudo-queries (needs real generator / cross-encoder weights)")
    g.add_argument("--generate_pseudo_queries", action="store_true",
                   help="generate queries for corpus passages with a seq2seq model and keep those a cross-encoder "
                        "accepts")
    g.add_argument("--generator_model", default=None, help="seq2seq generator (e.g. a doc2query T5)")
    g.add_argument("--cross_encoder_model", default=None, help="sequence-classification cross-encoder for denoising")
    g.add_argument("--pseudo_queries_per_passage", type=positive_int, default=1, help="queries sampled per passage")
    g.add_argument("--max_pseudo_passages", type=positive_int, default=1000, help="passages used for generation")
    g.add_argument("--denoise_threshold", type=float, default=0.5,
                   help="keep a pseudo pair when the cross-encoder's relevance probability is at least this")
    g.add_argument("--pseudo_query_max_length", type=positive_int, default=32, help="max generated query tokens")
    g.add_argument("--pseudo_queries_only", action="store_true",
                   help="stage 1 on the pseudo-queries alone, as the PAIR summary schedules it; without it, "
                        "--beir_dir's labelled qrels pairs are trained beside them, at the same alpha(t)")
    add_common_args(p, DEFAULT_LR)
    args = p.parse_args(argv)
    if args.export_checkpoint:  # its flags come from the checkpoint (training.export_checkpoint checks them)
        return args

    # Sanity checks that fail early with a clear message.
    check_common_args(args)
    if args.eval_tasks:
        import evaluate  # before the run seeds its generators (importing mteb draws from them)

        evaluate.check_task_specs(args.eval_tasks)
    if not (args.beir_dir or args.train_data or args.generate_pseudo_queries):
        raise UserError("finetune.py needs --beir_dir, --train_data or --generate_pseudo_queries")
    if args.generate_pseudo_queries and not (args.generator_model and args.cross_encoder_model):
        raise UserError("--generate_pseudo_queries needs --generator_model and --cross_encoder_model")
    if args.pseudo_queries_only and (args.train_data or not args.generate_pseudo_queries):
        raise UserError("--pseudo_queries_only trains stage 1's pseudo-queries alone: it needs "
                        "--generate_pseudo_queries and no --train_data")
    defaulted = args.pair_alpha is None
    args.pair_alpha, args.pair_alpha_schedule = pair_alpha_default(args.pair_alpha, args.pair_alpha_schedule,
                                                                   args.generate_pseudo_queries)
    if not 0.0 <= args.pair_alpha <= 1.0:
        raise UserError("--pair_alpha must be in [0, 1]")
    if args.pair_alpha > 0 and args.num_negatives == 0 and not args.mine_only:
        raise UserError(f"--pair_alpha {args.pair_alpha:g}{' (the stage-1 default)' if defaulted else ''}: L_P needs "
                        "hard negatives: --num_negatives >= 1, or --pair_alpha 0 (L = L_Q)")
    if not 1 <= args.negatives_rank_min <= args.negatives_rank_max:
        raise UserError("need 1 <= --negatives_rank_min <= --negatives_rank_max")
    if args.mine_only and (args.mined_negatives or not (args.beir_dir or args.generate_pseudo_queries or (
            args.train_data and msmarco_files(args.train_data, args.train_split)))):
        raise UserError("--mine_only needs a corpus to mine (--beir_dir, or MS MARCO as --train_data) and no "
                        "--mined_negatives")
    return args


def check_inputs(args):
    """What the flags point to, checked before anything loads: the models exist here (or in the offline Hub's
    cache), an MS MARCO layout is complete, a --mined_negatives file exists."""
    for flag in ("model_name_or_path", "generator_model", "cross_encoder_model"):
        if getattr(args, flag):
            check_model_name(getattr(args, flag), f"--{flag}", args.trust_remote_code)
    if args.train_data:
        msmarco_files(args.train_data, args.train_split)  # an incomplete MS MARCO layout, refused before loading
    if args.mined_negatives and not Path(args.mined_negatives).is_file():
        raise UserError(f"--mined_negatives {args.mined_negatives}: no such file")


# ----------------------------------------------------------------------------------------------------------------
# 2. PAIR's alpha
# ----------------------------------------------------------------------------------------------------------------
def pair_alpha_default(alpha, schedule, pseudo_queries: bool) -> tuple:
    """(--pair_alpha, --pair_alpha_schedule) as the run uses them; None = not given. PAIR trains in two stages:
    stage 1 on pseudo-queries with alpha decaying from alpha_0 > 0, stage 2 on labelled queries with alpha = 0. Not
    given, alpha is its stage's: PAIR_ALPHA_0, linear, with --generate_pseudo_queries; 0 (constant) without. Given,
    it is kept, with a constant schedule unless one is given: the alpha(t) a run with --pair_alpha always had."""
    if alpha is None:
        alpha, default_schedule = (PAIR_ALPHA_0, "linear") if pseudo_queries else (0.0, "constant")
    else:
        default_schedule = "constant"
    return alpha, schedule or default_schedule


def pair_stage(args) -> str:
    """Which of PAIR's two stages the run is, and what its alpha means, as the start line ("PAIR " + this) and the
    model card's title say it: stage 1 with pseudo-queries (--generate_pseudo_queries; PAIR: alpha decaying from
    alpha_0 > 0), else stage 2 on labelled queries (PAIR: alpha = 0, plain L_Q). An alpha that is not its stage's
    PAIR value (an explicit --pair_alpha) is said to be so."""
    a, first = args.pair_alpha, args.generate_pseudo_queries
    only = getattr(args, "pseudo_queries_only", False)
    stage = (f"stage 1 (pseudo-queries{' only' if only else ', with the labelled pairs'})" if first
             else "stage 2 (labelled queries)")
    form = getattr(args, "pair_p_form", "query")
    l_p = ("L_P with exp(f(p+, q)) (--pair_p_form query, the default: PAIR's code)" if form == "query"
           else "L_P with exp(-f(p+, p+)) (--pair_p_form summary: papers/pair.md's)")
    if a == 0:
        return (f"{stage}: L = L_Q (alpha 0: the passage-centric L_P off, "
                + ("unlike PAIR's first stage, whose alpha starts at alpha_0 > 0" if first
                   else "as PAIR's second stage") + f"; logged: {l_p})")
    linear = args.pair_alpha_schedule == "linear"
    alpha = f"alpha {a:g} -> 0 (linear)" if linear else f"alpha {a:g} (constant)"
    if first:
        meaning = ("the passage-centric L_P on, decaying as in PAIR's first stage" if linear
                   else "the passage-centric L_P on, constant as in PAIR's official code")
    else:
        meaning = "the passage-centric L_P on, which PAIR's second stage leaves off (alpha 0)"
    return f"{stage}: L = (1 - alpha) L_Q + alpha L_P, {alpha}: {meaning}; {l_p}"


def pair_alpha_at(step: int, total_steps: int, alpha_0: float, schedule: str) -> float:
    """PAIR's alpha in L = (1 - alpha) L_Q + alpha L_P at optimiser step `step` (0-based).

    constant: alpha_0 every step (the official code's pre-training uses 0.1);
    linear:   alpha_0 * (1 - step / total_steps), decaying to 0 (PAIR's "dynamic decay from alpha_0 > 0").
    Fine-tuning in PAIR's stage 2 is alpha = 0.
    Worked example: linear from 0.1 over 10 steps: 0.1 at step 0, 0.05 at 5, 0.01 at 9 (the last).
    """
    if schedule == "constant":
        return alpha_0
    return alpha_0 * max(0.0, 1.0 - step / max(1, total_steps))


# ----------------------------------------------------------------------------------------------------------------
# 3. Data: labelled pairs, PAIR stage-1 pseudo-queries, hard-negative mining
# ----------------------------------------------------------------------------------------------------------------
# The training-pair formats finetune.py reads, detected from the first record's fields (JSONL) or the columns (CSV /
# TSV header, parquet, a Hub dataset). Each becomes rows {query, positive, negatives}: one per (query, positive).
PAIR_SCHEMAS = {
    "tevatron": "tevatron {query_id, query, positive_passages: [{docid, title, text}], negative_passages: [...]}",
    "flagembedding": 'FlagEmbedding {query, pos: [...], neg: [...]} (also what its hard-negative miner writes)',
    "sentence-transformers": "sentence-transformers columns anchor | query, positive | answer[, negative | "
                             "negative_1, ...] (mine_hard_negatives' triplet and n-tuple)",
    "labeled-pair": "sentence-transformers labeled-pair columns anchor | query, positive | answer, label (1 / 0)",
    "labeled-list": "sentence-transformers labeled-list columns anchor | query, positive | answer: [...], "
                    "labels: [...]",
    "triples": "triples {query, positive, negatives | negative}, or TSV query<TAB>positive[<TAB>negative...]",
}
PAIR_FORMATS = (".jsonl / .jsonl.gz, .json (JSON lines, or one JSON array of objects), .csv / .tsv with a header, "
                ".parquet, a headerless triples .tsv, a datasets save_to_disk folder, or a Hub dataset name or local "
                "dataset folder (datasets.load_dataset, --train_config, --train_split)")
ANCHOR_COLUMNS, POSITIVE_COLUMNS = ("anchor", "query"), ("positive", "answer")
# fields FlagEmbedding's example data and miner write beside query / pos / neg (its examples/finetune/embedder data)
FLAGEMBEDDING_UNUSED = {"prompt", "type", "pos_scores", "neg_scores"}


def pair_schema(fields) -> str | None:
    """The PAIR_SCHEMAS entry a record's (or a table's) fields match, in their order, or None. One schema per layout:
    sentence-transformers' columns are read by position (the first the anchor, the second its positive, the rest
    negatives; label / labels mark the labeled formats), so their auto-detection asks for the names its miner and
    its Hub datasets use (--train_format sentence-transformers reads any names by position)."""
    f = list(fields)
    if {"query", "positive_passages"} <= set(f):
        return "tevatron"
    if {"query", "pos"} <= set(f):
        return "flagembedding"
    if len(f) >= 2 and f[0] in ANCHOR_COLUMNS and f[1] in POSITIVE_COLUMNS:
        rest = f[2:]
        if rest == ["label"]:
            return "labeled-pair"
        if rest == ["labels"]:
            return "labeled-list"
        if f[:2] == ["query", "positive"] and rest in ([], ["negatives"], ["negative"]):
            return "triples"  # the triples format (one negative, or a list of them); a triplet reads the same
        if all(c == "negative" or (c.startswith("negative_") and c[9:].isdigit()) for c in rest):
            return "sentence-transformers"
    if {"query", "positive"} <= set(f) and set(f) <= {"query", "positive", "negatives", "negative"}:
        return "triples"
    return None


def _as_pairs(schema: str, r: dict, where: str):
    """One record of `schema` -> (query, [positives], [negatives]); a field of the wrong shape raises naming `where`
    and the schema. Negatives present mean the file's own hard negatives are used (no mining for these rows).
    labeled-pair records are one passage each: (query, [passage], []) for label 1, (query, [], [passage]) for 0."""
    def texts(v, name):
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
            raise UserError(f"{where}: {name} must be a list of strings ({PAIR_SCHEMAS[schema]})")
        return v

    def passages(v, name):  # tevatron: [{docid, title, text}] -> 'title text', as BEIR passages are read
        if not isinstance(v, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in v):
            raise UserError(f"{where}: {name} must be a list of {{docid, title, text}} ({PAIR_SCHEMAS[schema]})")
        return [passage_text(p.get("title") or "", p["text"]) for p in v]

    cols = list(r)
    if schema == "tevatron":
        return r.get("query"), passages(r["positive_passages"], "positive_passages"), \
            passages(r.get("negative_passages") or [], "negative_passages")
    if schema == "flagembedding":
        return r.get("query"), texts(r["pos"], "pos"), texts(r.get("neg") or [], "neg")
    if schema == "labeled-pair":
        label = r[cols[2]]
        if label not in (0, 1, "0", "1"):
            raise UserError(f"{where}: label must be 1 or 0, got {label!r} ({PAIR_SCHEMAS[schema]})")
        passage = texts(r[cols[1]], cols[1])
        return r[cols[0]], passage if int(label) == 1 else [], [] if int(label) == 1 else passage
    if schema == "labeled-list":
        items, labels = r[cols[1]], r[cols[2]]
        if isinstance(labels, str) or isinstance(items, str):  # a list column written to CSV is its Python repr
            raise UserError(f"{where}: {cols[1]} / {cols[2]} hold the text {str(labels)[:30]!r}, not lists: a list "
                            "column saved as CSV cannot be read back as the list it was; save the dataset as JSONL "
                            "or parquet")
        items = texts(items, cols[1])
        if not isinstance(labels, list) or len(labels) != len(items) or any(x not in (0, 1) for x in labels):
            raise UserError(f"{where}: {cols[2]} must be one 1 / 0 per passage ({PAIR_SCHEMAS[schema]})")
        return r[cols[0]], [t for t, y in zip(items, labels) if y == 1], [t for t, y in zip(items, labels) if y == 0]
    if schema == "sentence-transformers":  # by position: anchor, positive, negatives
        negs = [r[c] for c in cols[2:] if r[c] is not None]
        return r[cols[0]], texts(r[cols[1]], cols[1]), texts(negs, "negative columns")
    negs = r["negatives"] if "negatives" in r else [r["negative"]] if "negative" in r else []
    if not isinstance(negs, list):
        raise UserError(f"{where}: negatives is not a list ({PAIR_SCHEMAS[schema]})")
    return r.get("query"), [r.get("positive")], negs


def id_columns(parts) -> str | None:
    """What a headerless TSV row is when its first two columns are not both texts, in words naming the producer's
    layout (MS MARCO's, BEIR's), or None when they are texts (a triples row: query, positive[, negatives])."""
    ids = [p.strip().isdigit() for p in parts]
    if len(parts) == 4 and all(ids):
        return "a TREC qrels row (query id, 0, passage id, relevance): MS MARCO's qrels.<split>.tsv"
    if len(parts) == 3 and all(ids):
        return ("three ids: a BEIR qrels row without its header (query id, corpus id, score), or MS MARCO's "
                "qidpidtriples (query id, positive id, negative id)")
    if len(parts) == 2 and ids[0] and not ids[1]:
        return "an id and a text: MS MARCO's collection.tsv (pid, passage) or queries.<split>.tsv (qid, query)"
    if any(ids[:2]):
        return f"an id where a text is expected (column {ids.index(True) + 1})"
    return None


def _pair_records(source: str, split: str, config=None, by_position: bool = False):
    """(where, record) pairs of a pairs source, read lazily: JSONL one line at a time, CSV / TSV one row at a time,
    parquet one 1,024-row batch at a time, a JSON array whole, a save_to_disk folder or a Hub dataset through
    datasets (memory-mapped Arrow). A headerless TSV gives records {query, positive, negatives} by position (the
    triples format) when its first row holds texts where texts are expected, or `by_position` (--train_format
    triples) says so; a row of ids (MS MARCO's qrels, collection or queries file) is refused naming its layout
    (id_columns)."""
    import csv

    p = Path(source)
    jsonl_folder = p.is_dir() and not (p / "dataset_info.json").is_file() and not (p / "dataset_dict.json").is_file() \
        and any(p.glob("*.jsonl")) and not any(p.glob("*.parquet"))
    if jsonl_folder:  # a folder of JSONL files (FlagEmbedding keeps its data so): each file read as one
        for f in sorted(p.glob("*.jsonl")):
            yield from _pair_records(str(f), split, config)
    elif p.is_file() and source.endswith(".json") and p.read_bytes()[:64].lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
        records = json.loads(p.read_text(encoding="utf-8-sig"))  # a JSON array: read whole
        for i, r in enumerate(records, 1):
            if not isinstance(r, dict):
                raise UserError(f"{source}: item {i} of the JSON array is a {type(r).__name__}, not an object")
            yield f"{source}:item {i}", r
    elif p.is_file() and source.endswith((".jsonl", ".json", ".jsonl.gz")):
        for where, r, problem in iter_jsonl(source):
            if problem:
                raise UserError(f"{where}: not valid JSON ({problem[0]}: {problem[1]})")
            if not isinstance(r, dict):
                raise UserError(f"{where}: expected a JSON object, got {type(r).__name__}")
            yield where, r
    elif p.is_file() and source.endswith((".csv", ".tsv")):
        with open(source, encoding="utf-8-sig", newline="") as f:
            delim = "\t" if source.endswith(".tsv") else ","
            # TSV's quoting is off: a passage may hold a double quote (the triples TSV never quoted fields)
            rows = csv.reader(f, delimiter=delim, quoting=csv.QUOTE_NONE if delim == "\t" else csv.QUOTE_MINIMAL)
            header = None
            for parts in rows:
                line_no = rows.line_num
                if not any(x.strip() for x in parts):
                    continue
                if header is None:
                    header = parts if pair_schema(parts) else []
                    if header or delim == ",":
                        if not header:
                            raise UserError(f"{source}:{line_no}: CSV header {parts} matches no accepted schema "
                                            f"(accepted: {'; '.join(PAIR_SCHEMAS.values())})")
                        continue
                    layout = None if by_position else id_columns(parts)
                    if layout:
                        raise UserError(
                            f"{source}:{line_no}: a headerless TSV is read as triples (query, positive[, negatives] "
                            f"as texts), but its first row {parts[:4]} is {layout}. MS MARCO: pass the folder holding "
                            "collection.tsv, queries.train.tsv and qrels.train.tsv, or its qrels.train.tsv, as "
                            "--train_data (read_msmarco); --train_format triples reads the columns by position anyway")
                if header:
                    yield f"{source}:{line_no}", dict(zip(header, parts))
                else:
                    yield f"{source}:{line_no}", {"query": parts[0], "positive": parts[1] if len(parts) > 1 else None,
                                                  "negatives": parts[2:]}
    elif p.is_file() and source.endswith(".parquet"):
        yield from iter_parquet(source)
    elif p.exists() and not p.is_dir():
        raise UserError(f"{source}: unknown file type; accepted: {PAIR_FORMATS}")
    else:
        import datasets

        if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(source)  # a save_to_disk folder
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"{source}: no split {split!r} (it has {list(ds)}): pass --train_split")
                ds = ds[split]
        else:  # a Hub dataset name, or a local dataset folder: datasets resolves both the same way
            ds = datasets.load_dataset(source, config, split=split)
        for i, r in enumerate(ds, 1):
            yield f"{source}:row {i}", r


def read_pairs(source: str, split: str = "train", config=None, schema: str | None = None):
    """Rows {query, positive, negatives} from any PAIR_SCHEMAS format in any PAIR_FORMATS container, yielded as they
    are read (labeled-pair files, whose passages of one query come in rows of their own, once read whole). The
    schema is `schema` (--train_format), else that of the first record (or the columns); a record that does not fit
    it stops with `file:line: reason (accepted schemas)`. A record with several positives (FlagEmbedding's pos,
    tevatron's positive_passages, a labeled-list) gives one row per positive, all with the record's negatives; blank
    lines are skipped. FlagEmbedding's per-record prompt / type fields are counted and said (the model's own
    prefixes are used)."""
    n, unused, unused_fields, grouped = 0, 0, set(), {}
    for where, r in _pair_records(source, split, config, by_position=schema == "triples"):
        if schema is None:
            schema = pair_schema(r)
            if schema is None:
                raise UserError(f"{where}: fields {list(r)} match no accepted schema; accepted: "
                                f"{'; '.join(PAIR_SCHEMAS.values())} (--train_format sentence-transformers reads "
                                "any column names by position)")
        elif pair_schema(r) not in (schema, None if schema == "sentence-transformers" else schema) \
                and not (schema == "triples" and {"query", "positive"} <= set(r)):
            raise UserError(f"{where}: fields {list(r)} do not fit the file's schema, {PAIR_SCHEMAS[schema]} "
                            f"(from its first record; accepted: {'; '.join(PAIR_SCHEMAS.values())})")
        extra = set(r) & FLAGEMBEDDING_UNUSED if schema == "flagembedding" else set()
        unused, unused_fields = unused + bool(extra), unused_fields | extra
        query, positives, negatives = _as_pairs(schema, r, where)
        if schema == "labeled-pair":  # a query's positive and negatives come in rows of their own
            pos, neg = grouped.setdefault(query, ([], []))
            pos += positives
            neg += negatives
            continue
        bad = ["query"] if not isinstance(query, str) or not query.strip() else []
        if not positives or any(not isinstance(t, str) or not t.strip() for t in positives):
            bad.append("positive")
        if bad:
            raise UserError(f"{where}: empty or missing {' and '.join(bad)} (expected {PAIR_SCHEMAS[schema]})")
        for pos in positives:
            n += 1
            yield {"query": query, "positive": pos, "negatives": list(negatives)}
    for query, (positives, negatives) in grouped.items():
        if not positives:
            raise UserError(f"{source}: query {query[:60]!r} has no passage labelled 1 ({PAIR_SCHEMAS[schema]})")
        for pos in positives:
            n += 1
            yield {"query": query, "positive": pos, "negatives": list(negatives)}
    if unused:
        print(f"{source}: {unused} FlagEmbedding records carry {', '.join(sorted(unused_fields))}, which finetune.py "
              "does not use (the model's own prefixes stand for prompt; pos_scores / neg_scores are distillation "
              "targets, and PAIR's losses have none)", flush=True)
    if not n:
        raise UserError(f"no (query, positive) rows in {source}")


load_triples = read_pairs  # the triples reader's name in scripts that read TSV / JSONL triples only


def passage_text(title: str, text: str) -> str:
    """A BEIR document as the encoder reads it: 'title text'."""
    return (title + " " + text).strip()


def msmarco_files(source: str, split: str = "train") -> dict | None:
    """MS MARCO passage ranking's files behind a --train_data path, or None when it is not that layout: the folder
    holding collection.tsv (pid, passage), queries.<split>.tsv (qid, query) and qrels.<split>.tsv (qid, 0, pid, 1),
    or that folder's qrels.<split>.tsv itself (the split from its name). A path with some of them missing is refused
    naming what is missing."""
    p = Path(source)
    if p.is_file() and p.name.startswith("qrels.") and p.name.endswith(".tsv"):
        p, split = p.parent, p.name[len("qrels."):-len(".tsv")]
    elif not (p.is_dir() and (p / "collection.tsv").is_file()):
        return None
    files = {"collection": p / "collection.tsv", "queries": p / f"queries.{split}.tsv",
             "qrels": p / f"qrels.{split}.tsv"}
    missing = [f.name for f in files.values() if not f.is_file()]
    if missing:
        raise UserError(f"{source}: MS MARCO's layout needs {missing} in {p} (collection.tsv, queries.{split}.tsv, "
                        f"qrels.{split}.tsv; --train_split names the split)")
    return files


def read_id_text_tsv(path: Path, what: str, keep=None) -> dict:
    """{id: text} of an MS MARCO id<TAB>text file (collection.tsv, queries.<split>.tsv); keep: the ids to keep (None:
    all). A line that is not an id and a text, or an id given twice, is refused naming the file and line."""
    out = {}
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            rid, sep, text = line.rstrip("\n").partition("\t")
            if not sep or not rid.strip() or not text.strip():
                raise UserError(f"{path}:{line_no}: expected {what} id<TAB>text, found {line.strip()[:80]!r}")
            if keep is not None and rid not in keep:
                continue
            if rid in out:
                raise UserError(f"{path}:{line_no}: {what} id {rid!r} appears twice")
            out[rid] = text
    return out


def read_msmarco(files: dict) -> dict:
    """MS MARCO passage ranking (msmarco_files) -> load_beir's {"corpus": {pid: ("", passage)}, "queries": {qid:
    query}, "qrels": {qid: {pid: relevance}}}: PAIR's own fine-tuning data, the pairs from its qrels, their texts
    from the queries and the collection. The whole collection is read (it is the corpus the negatives are mined
    from, as a BEIR folder's corpus.jsonl is: 8.8M passages, about 3 GB of text); qrels whose query or passage is
    absent are refused naming the id."""
    from plumbing.readers import read_qrels

    qrels = {q: {d: s for d, s in ds.items() if s > 0} for q, ds in read_qrels(files["qrels"]).items()}
    qrels = {q: ds for q, ds in qrels.items() if ds}
    queries = read_id_text_tsv(files["queries"], "query", keep=set(qrels))
    corpus = {pid: ("", t) for pid, t in read_id_text_tsv(files["collection"], "passage").items()}
    for q, ds in qrels.items():
        if q not in queries:
            raise UserError(f"{files['qrels']}: query {q!r} is absent from {files['queries']}")
        bad = next((d for d in ds if d not in corpus), None)
        if bad is not None:
            raise UserError(f"{files['qrels']}: passage {bad!r} (query {q!r}) is absent from {files['collection']}")
    return {"corpus": corpus, "queries": queries, "qrels": qrels}


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
        enc = gen_tokenizer(chunk, truncation=True, max_length=passage_max_length, padding=True,
                            return_tensors="pt").to(device)
        ids = generator.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=True,
                                 top_k=10, max_new_tokens=max_new_tokens, num_return_sequences=num_per_passage)
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


def pseudo_query_pairs(args, accelerator, corpus: dict):
    """PAIR stage 1 on the first --max_pseudo_passages corpus passages: [(passage id, query)] that the
    cross-encoder keeps."""
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification, AutoTokenizer

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
    return [(ids[pi], q) for pi, q in kept]


def _gather_arrays(arr: np.ndarray, world: int) -> np.ndarray:
    """Every process's numpy array, concatenated in rank order (the array itself when alone)."""
    if world == 1:
        return arr
    parts = [None] * world
    torch.distributed.all_gather_object(parts, arr)
    return np.concatenate(parts)


_LOW = 2 ** 32  # corpus indices live in the low 32 bits of a ranking key


def _ranking_keys(scores: torch.Tensor, corpus_index: torch.Tensor) -> torch.Tensor:
    """int64 keys that order candidates by score, then corpus index, both descending.

    The high 32 bits hold the float32 score's bits made order-preserving (negative floats have their magnitude
    bits flipped), the low 32 bits the corpus index. No two candidates share a key, so topk on the keys is exact
    and deterministic: equal scores (a duplicated passage, or a coincidence) always rank the higher corpus index
    first, whether the corpus is scored in one piece or in chunks, by one process or several (a plain torch.topk
    leaves the order of equal scores unspecified: on CPU it put the higher index first in most rows, not all)."""
    keys = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 and 0.0 get the same key
    keys = torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys)  # negative floats: a larger magnitude sorts lower
    return keys.mul_(_LOW).add_(corpus_index)


def _distinct_texts_longest_first(tokenizer, corpus_texts, passage_prefix, passage_max_length, chunk_size,
                                  rank, world):
    """Mining step 1: the corpus's distinct texts, in the order one embed_texts call over the whole corpus would
    encode them (first occurrence, then longest first). Each process hashes and tokenises a slice; the arrays are
    shared. Returns (first, text_of, order): the corpus index of distinct text u, the distinct-text number of each
    corpus index, and the distinct texts in encoding order."""
    n = len(corpus_texts)
    lo, hi = n * rank // world, n * (rank + 1) // world
    digests, tokens = [np.empty(0, dtype="V16")], [np.empty(0, dtype=np.int64)]
    for s in range(lo, hi, chunk_size):
        texts = [corpus_texts[j] for j in range(s, min(s + chunk_size, hi))]
        # 128-bit hashes: a collision among 10^7 texts has odds of about 10^-25
        digests.append(np.frombuffer(b"".join(hashlib.blake2b(t.encode("utf-8"), digest_size=16).digest()
                                              for t in texts), dtype="V16"))
        # the call embed_texts makes, so the counts (and the order below) are its own
        ids = tokenizer([passage_prefix + t for t in texts], truncation=True, max_length=passage_max_length,
                        add_special_tokens=True, return_attention_mask=False)["input_ids"]
        tokens.append(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)))
    digest, n_tokens = _gather_arrays(np.concatenate(digests), world), _gather_arrays(np.concatenate(tokens), world)
    del digests, tokens
    _, first, inverse = np.unique(digest, return_index=True, return_inverse=True)
    del digest
    # distinct texts numbered in order of first occurrence (embed_texts' dict.fromkeys), then sorted longest
    # first with a stable sort (embed_texts' sorted(..., key=-length))
    by_first = np.argsort(first, kind="stable")
    renumber = np.empty_like(by_first)
    renumber[by_first] = np.arange(len(by_first))
    first = first[by_first]  # corpus index of distinct text u
    text_of = renumber[inverse].reshape(-1)  # corpus index -> distinct text number
    del inverse, renumber, by_first
    order = np.argsort(-n_tokens[first], kind="stable")
    del n_tokens
    return first, text_of, order


@torch.no_grad()
def mine_hard_negatives(encoder, tokenizer, query_texts, positive_ids, corpus_ids, corpus_texts, rank_min, rank_max,
                        query_max_length=32, passage_max_length=128, query_prefix="", passage_prefix="",
                        batch_size=64, chunk_size=16384, query_block=256, pooling="mean", post_pooling=None):
    """For each query, corpus ids ranked rank_min..rank_max (1-based) by the starting model, minus its positives.

    Hard negatives are what PAIR and RocketQA train on; the very top ranks are skipped because on sparsely judged
    data (one or two positives per query) they are often unlabelled positives. A passage whose text equals one of
    the query's positives is excluded as well (duplicated corpus entries). positive_ids[i] is the set of ALL
    positives of query i, so no query ever gets one of its own positives as a negative. Equal scores rank the
    higher corpus index first (_ranking_keys).

    Built for MS MARCO's scale (8.8M passages, 0.5M queries): the corpus vectors are never held whole and no
    queries x corpus matrix exists. Every process of a torch.distributed run (accelerate, torchrun) takes part:
      1. each process hashes and tokenises a contiguous slice of the corpus; the (text hash, token count) arrays
         are shared, giving every process the distinct texts and embed_texts' order (longest first), exactly as
         one embed_texts call on the whole corpus would batch them;
      2. the encoding batches of that order are dealt round-robin to the processes (balanced: the first batches
         hold the longest passages); each process encodes chunk_size passages at a time (rounded to whole
         batches) with embed_texts, scores them against all queries (query_block queries at a time), keeps a
         running top-rank_max per query and drops the chunk;
      3. the per-process top lists are merged (all_gather, query_block queries at a time), so every process
         returns the same pools.
    Each encoding batch is the one a single embed_texts call would form, and the scores are float64 products
    rounded to float32 (see below), so the vectors, the scores and hence the pools are the same for any
    chunk_size and any number of processes (tested, on CPU); one float32 q @ c.T with topk would order scores
    within float32 rounding of each other by that product's rounding and topk's unspecified tie order. Memory per
    process: the query vectors, the running top (queries x rank_max int64), one chunk and its scores against
    query_block queries, plus a few 8-byte integers per passage.

    corpus_texts / corpus_ids can be any sequence indexed by int (a list, or a lazy view of an Arrow column).
    """
    from tqdm.auto import tqdm

    rank, world = rank_and_world()
    n, k = len(corpus_ids), min(rank_max, len(corpus_ids))
    if n > _LOW:
        raise ValueError(f"{n} passages: the ranking keys hold corpus indices below 2**32")
    device = next(getattr(encoder, "base_model", encoder).parameters()).device
    # every process encodes all queries (one call): short texts, and the same vectors everywhere
    q = embed_texts(encoder, tokenizer, query_texts, batch_size, query_max_length, query_prefix,
                    desc="mining: queries", pooling=pooling,
                    post_pooling=post_pooling).to(device)
    chunk_size = max(1, chunk_size // batch_size) * batch_size  # whole encoding batches

    # ---- 1. distinct texts and their token counts (hash and tokenise a slice each, then share)
    first, text_of, order = _distinct_texts_longest_first(tokenizer, corpus_texts, passage_prefix,
                                                          passage_max_length, chunk_size, rank, world)
    n_distinct, has_copies = len(first), len(first) < n
    if has_copies:  # the corpus indices of each distinct text: members[starts[u]:starts[u + 1]]
        members = np.argsort(text_of, kind="stable")
        starts = np.concatenate([[0], np.cumsum(np.bincount(text_of, minlength=n_distinct))])

    # ---- 2. this process's batches, chunk by chunk: encode, score against every query, keep the running top
    mine = np.arange(rank, -(-n_distinct // batch_size), world)  # batch numbers dealt round-robin
    per_chunk = chunk_size // batch_size
    # ranking keys, best first; the lowest int64 fills places no passage has reached yet (and stays where a process
    # holds fewer than k passages). Allocated once: a new one per chunk would fragment the heap as it grows.
    top = torch.full((len(query_texts), k), torch.iinfo(torch.int64).min, dtype=torch.int64, device=device)
    chunks = range(0, len(mine), per_chunk)
    for c in tqdm(chunks, desc="mining: corpus chunks", disable=rank != 0 or len(chunks) < 2):
        distinct = np.concatenate([order[b * batch_size:(b + 1) * batch_size] for b in mine[c:c + per_chunk]])
        # already in embed_texts' order, so it re-forms exactly these batches
        vecs = embed_texts(encoder, tokenizer, [corpus_texts[first[u]] for u in distinct], batch_size,
                           passage_max_length, passage_prefix, pooling=pooling,
                           post_pooling=post_pooling).to(device)
        if has_copies:  # a duplicated text scores once and is copied to each of its corpus entries
            cnt = starts[distinct + 1] - starts[distinct]
            column = np.repeat(np.arange(len(distinct)), cnt)
            within = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
            corpus_index = members[np.repeat(starts[distinct], cnt) + within]
        else:
            column, corpus_index = None, first[distinct]
        corpus_index = torch.from_numpy(corpus_index).to(device)
        column = None if column is None else torch.from_numpy(column).to(device)
        _score_into_top(top, q, vecs, column, corpus_index, query_block)
        del vecs  # drop the chunk before encoding the next one

    # ---- 3. merge the processes' top lists (every process gets the result)
    if world > 1:
        for qs in range(0, len(query_texts), query_block):
            parts = [torch.empty_like(top[qs:qs + query_block]) for _ in range(world)]
            torch.distributed.all_gather(parts, top[qs:qs + query_block].contiguous())
            top[qs:qs + query_block] = torch.cat(parts, dim=1).topk(k).values
    ranked = (top & (_LOW - 1)).cpu().numpy()  # (queries, k) corpus indices, best first
    return _window_pools(ranked, rank_min, corpus_ids, positive_ids, text_of)


def _score_into_top(top, q, vecs, column, corpus_index, query_block: int):
    """One chunk's passage vectors scored against every query (query_block at a time), merged into the running top
    ranking keys in place. column: each corpus entry's row of vecs (a duplicated text is encoded once), or None.

    Scores as float64 products rounded to float32. A float32 product's last bit depends on how BLAS blocks it (the
    matrix shapes, the kernel: about 1 in 3 scores moved by up to 3e-7 between one product and per-batch products
    in a test here), which would let near-ties swap between chunk sizes or process counts. Float64 orders differ by
    ~1e-16, so the rounded scores agree (but for ~1e-9 of them, at a rounding boundary). Outside autocast: a bf16
    run (accelerator.autocast) speeds up the encoder only."""
    k = top.shape[1]
    with torch.autocast(vecs.device.type, enabled=False):
        vecs = vecs.double()
        for qs in range(0, len(q), query_block):
            scores = (q[qs:qs + query_block].double() @ vecs.T).float()
            keys = _ranking_keys(scores if column is None else scores[:, column], corpus_index)
            top[qs:qs + query_block] = torch.cat([top[qs:qs + query_block], keys], dim=1).topk(k).values


def _window_pools(ranked, rank_min: int, corpus_ids, positive_ids, text_of) -> list:
    """Each query's ranks rank_min..k (ranked: (queries, k) corpus indices, best first), minus the query's positives
    and any passage with a positive's text -> the pools of corpus ids."""
    wanted = set().union(*positive_ids) if len(positive_ids) else set()
    where = {d: j for j, d in enumerate(corpus_ids) if d in wanted}
    pools = []
    for i, row in enumerate(ranked):
        pos_texts = {int(text_of[where[d]]) for d in positive_ids[i] if d in where}
        window = row[rank_min - 1:]
        pools.append([corpus_ids[j] for j, t in zip(window.tolist(), text_of[window].tolist())
                      if corpus_ids[j] not in positive_ids[i] and t not in pos_texts])
    return pools


def negative_pools(args, accelerator, encoder, tokenizer, prompts, corpus, queries, positives, pooling="mean",
                   post_pooling=None):
    """The mined pool of every (query, positives) row: reused from --mined_negatives, or mined by all processes
    together (mine_hard_negatives shards the corpus). Written to <output_dir>/mined_negatives.json either way."""
    cache = Path(args.output_dir) / "mined_negatives.json"
    if args.mined_negatives:  # reuse pools mined by an earlier run with the same start model and data
        pools = json.loads(Path(args.mined_negatives).read_text())
        if len(pools) != len(queries):
            raise UserError(f"{args.mined_negatives}: {len(pools)} pools for {len(queries)} queries: "
                            "mined for other data; drop --mined_negatives to mine again")
        accelerator.print(f"hard negatives: {len(pools):,} pools read from --mined_negatives {args.mined_negatives}")
        if accelerator.is_main_process and Path(args.mined_negatives).resolve() != cache.resolve():
            atomic_write(cache, json.dumps(pools))
    else:
        cids = sorted(corpus)
        qp, pp = prompts["query"], prompts["document"]
        accelerator.print(f"mining hard negatives with the start model: ranks {args.negatives_rank_min}-"
                          f"{args.negatives_rank_max} of {len(cids):,} passages for {len(queries):,} queries, "
                          f"into {cache}")
        with accelerator.autocast():  # the encoder in the run's --mixed_precision (bf16 on GPUs); scores in fp32
            pools = mine_hard_negatives(encoder, tokenizer, queries, positives, cids, [corpus[d] for d in cids],
                                        args.negatives_rank_min, args.negatives_rank_max, args.query_max_length,
                                        args.passage_max_length, qp, pp, args.mining_batch_size,
                                        args.mining_chunk_size, pooling=pooling,
                                        post_pooling=post_pooling)
        if accelerator.is_main_process:
            atomic_write(cache, json.dumps(pools))
        accelerator.print(f"mined {len(pools):,} pools of hard negatives ({sum(map(len, pools)):,} passages) into "
                          f"{cache}: --mined_negatives {cache} reuses them")
    accelerator.wait_for_everyone()
    short = sum(len(p) < args.num_negatives for p in pools)
    if short:
        raise UserError(f"{short} queries have fewer than {args.num_negatives} mined negatives in ranks "
                        f"{args.negatives_rank_min}-{args.negatives_rank_max}: widen the window")
    return pools


def labelled_source(args):
    """The labelled corpus of the run, in load_beir's layout, or None: --beir_dir's qrels/<split>.tsv, or MS MARCO
    given as --train_data (msmarco_files, read_msmarco); and whether its qrels are the pairs trained on (True) or it
    is only the corpus --train_data's rows are mined from (False: --train_data with --beir_dir trains on one source,
    the data's rows, as the README says)."""
    ms = msmarco_files(args.train_data, args.train_split) if args.train_data else None
    if ms and args.beir_dir:
        raise UserError(f"--train_data {args.train_data} is MS MARCO, which brings its own corpus (collection.tsv): "
                        "drop --beir_dir")
    if ms:
        return read_msmarco(ms), True, f"MS MARCO {ms['qrels'].name}"
    if args.beir_dir:
        return load_beir(args.beir_dir, args.qrels_split), not args.train_data, f"qrels/{args.qrels_split}.tsv"
    return None, False, ""


def drop_repeated_pairs(rows, accelerator) -> list:
    """The rows with each (query, positive) pair once, the first kept: a pair given twice (a file that repeats
    one, FlagEmbedding's pos holding a passage twice) would be trained twice as often as the others. The dropped
    rows are counted and said."""
    seen, kept = set(), []
    for r in rows:
        key = (r["query"], r["positive"])
        if key not in seen:
            seen.add(key)
            kept.append(r)
    if len(kept) < len(rows):
        accelerator.print(f"{len(rows) - len(kept)} repeated (query, positive) rows dropped: each pair trains once")
    return kept


def build_finetune_rows(args, accelerator, encoder, tokenizer, prompts, pooling="mean", post_pooling=None):
    """Rows {query, positive, negative_pool | negatives} of one labelled source: --train_data's pairs (their own
    negatives, or pools mined from --beir_dir's corpus, else from the data's own passages), or the labelled
    corpus's qrels (--beir_dir, MS MARCO as --train_data: one row per (query, relevant passage), pools mined from
    its corpus), then the kept pseudo-queries; each (query, positive) pair once (drop_repeated_pairs)."""
    beir, train_on_qrels, qrels_name = labelled_source(args)
    from_data = args.train_data and not train_on_qrels
    rows = list(read_pairs(args.train_data, args.train_split, args.train_config,
                           None if args.train_format == "auto" else args.train_format)) if from_data else []
    rows = drop_repeated_pairs(rows, accelerator)
    needy = [r for r in rows if len(r["negatives"]) < args.num_negatives]
    rows = [r for r in rows if len(r["negatives"]) >= args.num_negatives]
    corpus = {d: passage_text(*tt) for d, tt in beir["corpus"].items()} if beir else {}
    mined = []  # (row, query text, set of positive ids): rows that still need negatives
    if from_data and args.beir_dir:
        accelerator.print(f"--beir_dir {args.beir_dir}: the corpus the --train_data rows without enough negatives "
                          f"({len(needy)}) are mined from; its {qrels_name} is not trained on (one source: "
                          "--train_data)")
    if beir and train_on_qrels and not args.pseudo_queries_only:
        qrels = {q: {d for d, s in ds.items() if s > 0} for q, ds in beir["qrels"].items()}
        for qid in sorted(qrels):
            for did in sorted(qrels[qid]):
                mined.append(({"query": beir["queries"][qid], "positive": corpus[did]}, beir["queries"][qid],
                              qrels[qid]))
        accelerator.print(f"{qrels_name}: {len(mined)} (query, relevant passage) pairs of {len(qrels)} queries; "
                          f"corpus {len(corpus):,} passages")
    if args.generate_pseudo_queries:
        if not corpus:
            raise UserError("--generate_pseudo_queries needs a corpus: pass --beir_dir")
        with unpartitioned_loading():  # the generator and cross-encoder are ours to run, never prepared
            kept = pseudo_query_pairs(args, accelerator, corpus)
        accelerator.print(f"stage 1's rows: {len(kept)} pseudo-query pairs" + (
            " alone (--pseudo_queries_only)" if args.pseudo_queries_only else
            f" + {len(rows) + len(mined)} labelled pairs of {qrels_name if train_on_qrels else '--train_data'}, "
            "trained together at alpha(t) "
            f"(--pseudo_queries_only: the pseudo-queries alone, as the PAIR summary's stage 1)"))
        mined += [({"query": q, "positive": corpus[pid]}, q, {pid}) for pid, q in kept]
    if needy:
        corpus = corpus or data_corpus(rows + needy)
        mined += mine_data_rows(needy, rows + needy, corpus)
    if not args.mine_only:  # too little data for one step: said before the mining, not after
        check_batch_fits(len(rows) + len(mined), args.per_device_train_batch_size, accelerator.num_processes,
                         "(query, positive) rows", len({r["query"] for r in rows} | {q for _, q, _ in mined}))
    if mined:
        pools = negative_pools(args, accelerator, encoder, tokenizer, prompts, corpus, [q for _, q, _ in mined],
                               [pos for _, _, pos in mined], pooling, post_pooling)
        for (r, _, _), pool in zip(mined, pools):
            r["negative_pool"] = [corpus[d] for d in pool]
        rows += [r for r, _, _ in mined]
    return add_relevant(drop_repeated_pairs(rows, accelerator))


def data_corpus(rows) -> dict:
    """A corpus to mine --train_data's missing negatives from when there is no --beir_dir: the distinct passages of
    the data itself (every positive and negative), as FlagEmbedding's hard-negative miner does without a candidate
    pool. Ids: "data-<index of first appearance>"."""
    texts = dict.fromkeys(t for r in rows for t in [r["positive"], *r["negatives"]])
    return {f"data-{i}": t for i, t in enumerate(texts)}


def mine_data_rows(needy, all_rows, corpus) -> list:
    """(row, query text, positive ids) for the --train_data rows that brought fewer than --num_negatives negatives
    (FlagEmbedding records without "neg", triples without negatives): their pools are mined like the BEIR rows'.
    A query's positives are every positive the data gives it, as ids of the corpus passages with the same text, so
    mining never hands a query its own positive."""
    ids_of = {}
    for d, t in corpus.items():
        ids_of.setdefault(t, set()).add(d)
    positives = {}
    for r in all_rows:
        positives.setdefault(r["query"], set()).update(ids_of.get(r["positive"], ()))
    return [({"query": r["query"], "positive": r["positive"]}, r["query"], positives[r["query"]]) for r in needy]


def add_relevant(rows):
    """Give every row "relevant": the texts of every passage labelled relevant to its query, i.e. the positives of
    all rows with the same query text (a BEIR row: all qrels positives of its query; a triple or pseudo-query row:
    its positive, and those of rows with the identical query). The losses keep them out of the row's negatives
    (modeling_xprt.pair_false_negatives). Rows of one query share one list. Returns `rows`."""
    relevant = {}
    for r in rows:
        relevant.setdefault(r["query"], {})[r["positive"]] = None  # a dict: ordered, no repeats
    lists = {q: list(texts) for q, texts in relevant.items()}
    for r in rows:
        r["relevant"] = lists[r["query"]]
    return rows


def pick_negatives(row, index: int, num, seed, epoch):
    """The step's hard negatives for one row (its place `index` in the rows): a sample of its mined pool, a function
    of (seed, epoch, index) only, so a resumed run draws the same negatives."""
    if "negative_pool" not in row:
        return list(row.get("negatives", []))[:num]
    rng = random.Random(f"{seed}-{epoch}-{index}")
    return rng.sample(row["negative_pool"], num)


def count_false_negatives(rows, batches, num_negatives, seed, epoch=0, world=1) -> dict:
    """What PAIR's losses will mask in one epoch, counted exactly without the model: the in-batch candidates of L_Q
    (every passage slot of the step; L_P's candidates are the negative slots, a subset) that
    modeling_xprt.pair_false_negatives excludes for each row, with the ids and negatives the training step uses.

    batches: the sampler's batches (row indices) of `epoch`; accelerate deals batch t to process t mod world, so one
    step's gathered candidates are `world` consecutive batches (an incomplete last step is left out).
    Returns {"steps", "rows", "candidates", "masked", "masked_own_positive", "rows_with_masked"}: masked counts
    (row, candidate) pairs, masked_own_positive those that are a copy of the row's own positive.
    """

    out = dict.fromkeys(("steps", "rows", "candidates", "masked", "masked_own_positive", "rows_with_masked"), 0)
    for s in range(0, len(batches) - world + 1, world):
        step = [{**rows[i], "negatives": pick_negatives(rows[i], i, num_negatives, seed, epoch)}
                for b in batches[s:s + world] for i in b]
        passage_ids, relevant_ids = pair_text_ids(step, num_negatives)
        b, k = passage_ids.shape
        candidates = passage_ids.reshape(b * k)
        exclude = pair_false_negatives(candidates, relevant_ids, torch.arange(b) * k)  # (B, B * k)
        own = exclude & (candidates.unsqueeze(0) == passage_ids[:, :1])
        out["steps"] += 1
        out["rows"] += b
        out["candidates"] += b * (b * k - 1)
        out["masked"] += int(exclude.sum())
        out["masked_own_positive"] += int(own.sum())
        out["rows_with_masked"] += int(exclude.any(dim=1).sum())
    return out


def print_false_negatives(c: dict):
    """finetune.py's start-up line: what count_false_negatives found for the first epoch."""
    print(f"false negatives masked in epoch 0 (exact count over its {c['steps']} steps): {c['masked']} of "
          f"{c['candidates']} in-batch candidates ({c['masked_own_positive']} copies of the row's own positive, "
          f"{c['masked'] - c['masked_own_positive']} other passages labelled relevant to its query); "
          f"{c['rows_with_masked']} of {c['rows']} rows ({100 * c['rows_with_masked'] / max(1, c['rows']):.1f}%) "
          "had at least one", flush=True)


def run_line(accelerator, args, data: str, max_steps: int) -> str:
    """The run's shape at its start, training.run_line's with PAIR's in-batch negatives: L_Q's candidates are every
    passage of the step (each row's positive and hard negatives, gathered across processes), L_P's the step's hard
    negatives; the mask PAIR's losses apply is pair_false_negatives' (copies of a row's positive and passages
    labelled relevant to its query, counted by print_false_negatives), not train.py's same-document mask."""
    world = accelerator.num_processes
    rows, n = args.per_device_train_batch_size * world, args.num_negatives
    negatives = (f"{rows * (1 + n) - 1} for L_Q (the passages of the step's {rows} rows, a positive and {n} hard "
                 "negatives each, but the row's own positive)")
    if args.pair_alpha > 0:
        negatives += f", {rows * n} for L_P (the step's hard negatives)"
    return training_run_line(accelerator, args, data, max_steps, (
        f"per query = {negatives} (accumulation adds none; the false-negative mask leaves fewer: a copy of the row's "
        "positive or of another passage labelled relevant to its query is not its negative, counted above)"))


# ----------------------------------------------------------------------------------------------------------------
# 4. Main: accelerator, model, data, optimiser and scheduler, prepare, the loop, save
# ----------------------------------------------------------------------------------------------------------------
def pair_model(accelerator, args):
    """The model fine-tuned: --model_name_or_path as an XPRTModel with PAIR's objective, and its tokenizer
    (training.load_model); --export_checkpoint builds a checkpoint's model with it too."""
    return load_model(accelerator, args, objective="pair")


def main(argv=None):
    args = parse_args(argv)
    if args.export_checkpoint:  # a checkpoint's model as a model folder, and nothing else
        return export_checkpoint(args, parse_args, pair_model, "finetune.py")
    check_inputs(args)
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # the card shows the command
    from accelerate.utils import set_seed

    # ---- accelerator. The idle heads are frozen below, so every trainable parameter gets a gradient: no
    # unused-parameter search.
    accelerator = make_accelerator(args, find_unused_parameters=False)
    # --mined_negatives may be this folder's own mined_negatives.json (--mine_only, then train): read back, kept
    mined_file = Path(args.output_dir) / "mined_negatives.json"
    reused = args.mined_negatives and Path(args.mined_negatives).resolve() == mined_file.resolve()
    resumed = args.resume_from_checkpoint if args.resume_from_checkpoint != "latest" else None
    prepare_output_dir(accelerator, args, "finetune.py", local_inputs(
        model_name_or_path=args.model_name_or_path, beir_dir=args.beir_dir, train_data=args.train_data,
        mined_negatives=args.mined_negatives, generator_model=args.generator_model,
        cross_encoder_model=args.cross_encoder_model, eval_tasks=[task_spec(t)[1] for t in args.eval_tasks],
        resume_from_checkpoint=resumed), extra_outputs=("mined_negatives.json",), reuse=[mined_file] if reused else [])
    on_stop(lambda: stop_account(args, mined_file))  # a signal outside the steps (mining): what it keeps, in one line
    set_seed(args.seed)

    # ---- model: loaded whole, even under ZeRO-3 (the start model mines negatives before prepare)
    model, tokenizer = pair_model(accelerator, args)
    for flag in ("query_max_length", "passage_max_length"):  # the prefix and special tokens count in these lengths
        check_input_length(model, args.model_name_or_path, f"--{flag}", getattr(args, flag))
    # PAIR's losses read only the pooled encoder vectors: the decoder and the MLM head's own parameters (transform,
    # output bias; the tied projection is the word embeddings and stays trainable) get no gradient. Frozen, they
    # stay out of the optimiser and DDP's reducer, and are saved unchanged for a later pre-training run.
    for p in model.head_parameters():
        p.requires_grad_(False)

    # ---- data: the start model mines the hard negatives, on the accelerator
    model.encoder.to(accelerator.device)
    rows = build_finetune_rows(args, accelerator, model.encoder, tokenizer, model.prompts, model.info.pooling,
                               model.post_pooling)  # mined with the model's own vectors (its modules after pooling)
    if args.mine_only:
        accelerator.print(f"--mine_only: wrote {mined_file}; train with --mined_negatives {mined_file}")
        return {"mined_negatives": str(mined_file), "completed_steps": 0}
    lengths = [len(r["query"]) + len(r["positive"]) for r in rows]
    collator = PairCollator(tokenizer, query_max_length=args.query_max_length,
                            passage_max_length=args.passage_max_length, query_prefix=model.prompts["query"],
                            passage_prefix=model.prompts["document"], num_negatives=args.num_negatives,
                            pad_to_multiple_of=args.pad_to_multiple_of)
    # No batch holds two rows of one query, and the losses mask every in-batch copy of a row's positive or other
    # passage labelled relevant to its query. The exact count of what they will mask in the first epoch:
    keys = [r["query"] for r in rows]
    sampler = NoDuplicatesBatchSampler(lengths, args.per_device_train_batch_size, args.seed, keys)
    if accelerator.is_main_process:
        print_false_negatives(count_false_negatives(rows, sampler.batches(), args.num_negatives, args.seed, 0,
                                                    accelerator.num_processes))
    # each row with the epoch's negatives, drawn per (seed, epoch, row), collated ahead of the step
    # (batches.SeededCollate)
    def with_negatives(epoch, i, r):
        return {"query": r["query"], "positive": r["positive"], "relevant": r.get("relevant"),
                "negatives": pick_negatives(r, i, args.num_negatives, args.seed, epoch)}

    dataloader = training_loader(accelerator, args, rows, sampler, collator, with_negatives)

    # ---- optimiser
    optimizer, trainable = adamw(accelerator, model, args)

    # ---- prepare; the run's steps and the scheduler (10% warmup, then linear decay: PAIR's); resume
    model, optimizer, dataloader, lr_scheduler, state, steps_per_epoch = prepare_run(accelerator, args, model,
                                                                                     optimizer, dataloader)
    max_steps, world = state.max_steps, accelerator.num_processes
    accelerator.print(f"PAIR {pair_stage(args)}")
    accelerator.print(run_line(accelerator, args, f"{len(rows)} (query, positive) rows of {len(set(keys))} queries",
                               max_steps))
    scorer = None
    if args.eval_tasks:
        import evaluate

        scorer = evaluate.TrainingScorer(accelerator, args, tokenizer)

    # ---- the loop, train.py's with PAIR's alpha(t) where train.py has w(t): accumulate, the step, backward, clip,
    # optimiser and lr steps; per optimiser step, log, score and checkpoint on their steps
    model.train()
    window = LogWindow(accelerator, args, lr_scheduler, optimizer, max_steps, state=state,
                       hand_count=lambda batch: step_flops(accelerator.unwrap_model(model), batch, retention=False))
    stop_at = min(max_steps, args.stop_after_steps or max_steps)
    stop, stopped = StopSignals(accelerator), 0  # SIGTERM / SIGUSR1 / Ctrl-C: a checkpoint after the step, stop
    if scorer and state.completed_steps == 0:  # the start is scored too: every later score is read against it
        log_score(accelerator, args, scorer, model, 0, state.epoch, window)
    try:
        for epoch in range(state.epoch, math.ceil(max_steps / steps_per_epoch)):
            if stopped or state.completed_steps >= stop_at:
                break
            for batch in window.timed(epoch_batches(accelerator, dataloader, sampler, state, epoch)):
                with window.measured(batch, ("retain_",)):  # its tokens, and its FLOPs on a window's first batch
                    batch = batch_to_device(batch, accelerator.device)
                    # alpha(t): the weight of the passage-centric L_P in (1 - alpha) L_Q + alpha L_P
                    alpha = pair_alpha_at(state.completed_steps, max_steps, args.pair_alpha, args.pair_alpha_schedule)
                    if args.compile == "reduce-overhead":  # CUDA graphs: a new step, the last one's outputs done
                        torch.compiler.cudagraph_mark_step_begin()
                    with accelerator.accumulate(model):
                        if args.gradient_cache_chunk:  # forward and backward chunk by chunk (the gradient cache)
                            outputs = gradient_cache_step(accelerator, model, batch, args.gradient_cache_chunk,
                                                          pair_alpha=alpha, pair_p_form=args.pair_p_form)
                        else:
                            outputs = model(batch, pair_alpha=alpha, pair_p_form=args.pair_p_form)
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
                # ---- one optimiser step done: log, score, checkpoint
                state.completed_steps += 1
                step = state.completed_steps
                window.step_done(state, epoch, {"pair_alpha": alpha})
                if scorer and args.eval_steps and step % args.eval_steps == 0:
                    with stop.scoring():  # a signal leaves the scoring: the step's checkpoint below
                        log_score(accelerator, args, scorer, model, step, epoch, window)
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
    if scorer and not stopped and scorer.last_step != state.completed_steps:  # the final model (or where it stopped)
        log_score(accelerator, args, scorer, model, state.completed_steps, state.epoch)

    # ---- save
    # a Hub dataset given as --train_data is named in the model card's metadata (a local file is not)
    hub_data = [args.train_data] if args.train_data and not Path(args.train_data).exists() else None
    title = f"xprt finetune (PAIR loss, {pair_stage(args)})"  # "xprt finetune (PAIR loss" first: the lineage's name
    save_run(accelerator, args, model, tokenizer, state.completed_steps >= max_steps,
             {"title": title, "script": "finetune.py", "argv": argv, "datasets": hub_data,
              "summary": {"steps": state.completed_steps, "processes": world, "rows": len(rows),
                          "unit": f"(query, positive) rows of {len(set(keys))} queries"}}, stopped_by)
    return {"completed_steps": state.completed_steps, "max_steps": max_steps, "output_dir": args.output_dir,
            "trainable_parameters": trainable}


if __name__ == "__main__":
    run_script(main)
