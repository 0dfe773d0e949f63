"""
xPRT step 1: pick the training groups once, before training (the xPRT paper, section "How anchors
and related passages are chosen").

For every document:
  1. split it into passages (paragraph-aware packing under a token budget; the paper gives no rule,
     ours is in `split_passages` and the README),
  2. embed every passage with a frozen selection encoder (E5 in the paper; mean pooling, L2 norm),
  3. centrality = cos(passage, mean of the document's passages); anchors: centrality >= 0.825,
  4. for each anchor rank the other passages of the SAME document by RRF of the E5-cosine rank
     (weight 2) and the TF-IDF rank (weight 1), k = 10, and keep the top 4 as its related passages.
One group = (anchor, 4 related passages) = one parquet row; its columns and types are `group_schema()`
in this file. Every setting of steps 1-4 is a field of `Selection`, the one object the selecting
functions read and the key of the resume check.

Input: JSON Lines (plain, .gz, .zst: C4's .json.gz shards too), parquet, datasets save_to_disk folders (read
with datasets.load_from_disk), or a Hub dataset streamed; a title field is joined to the text as its first line
(--title_field), and the fields no flag reads are named in the log and stats.json.

Scale: documents are streamed in chunks of --chunk_docs input records; chunk c goes to process
c % world_size (torchrun / accelerate launch), is written as its own parquet file, and a finished
chunk is reused when the same command is rerun after a crash. The TF-IDF IDF is corpus-level: a
cheap first pass counts document frequencies with a HashingVectorizer (bounded memory), summed over
processes. Every chunk's result depends only on its own documents, the corpus IDF and the seed, so
1 process and N processes write the same groups. At web scale, `select_groups_datatrove.py --executor
local|slurm|ray` runs the same passes as datatrove stages (every flag of this script, and its executor's).

    python select_groups.py --input data/docs.jsonl --model_name_or_path all-MiniLM-L6-v2 \\
        --output_dir runs/groups
    torchrun --standalone --nproc_per_node 8 select_groups.py --dataset HuggingFaceFW/fineweb \\
        --dataset_config sample-10BT --max_docs 100000 --output_dir runs/groups-fw100k
"""

from __future__ import annotations

import copy
import hashlib
import html
import itertools
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import numpy as np
import regex  # Unicode properties (scripts, sentence terminals), which re lacks; a dependency of transformers

from modeling_xprt import max_seq_length
from plumbing.common import (META_DIR, ArgumentParser, UserError, atomic_path, atomic_write, check_model_name,
                             claim_output_folder, local_inputs, model_prompts, non_negative_int, on_stop,
                             pick_device_and_dtype, positive_int, record_outputs, remove_outputs, resolve_model_path,
                             run_script)
from plumbing.model_folder import (check_tokenizer_fits, load_post_pooling, read_max_seq_length,
                                   read_pooling)
from plumbing.readers import (INPUT_SUFFIXES, SKIP_REASONS, Doc, doc_id_source, first_valid_records, input_files,
                              iter_chunks, unread_splits, unused_fields)

# The paper's statistics on 100K FineWeb documents with E5-base-unsupervised (printed beside ours).
PAPER_FINEWEB_100K = {"documents_with_groups_pct": 99.0, "groups_per_document": 7.0, "passages_covered_pct": 68.0}
# Centrality histogram over [0, 1] in stats.json: lets a user see the anchor share at any threshold.
HIST_BINS = 40


@dataclass(frozen=True)
class Selection:
    """Every setting that changes which groups come out of the same records, in one place.

    Built once from the flags (Selection.from_args; each field but passage_prefix is the flag of the same name, and
    the flags take their defaults from here), handed to the functions that select, and, as dataclasses.asdict, the
    key of the resume check (run_config): a rerun reuses finished chunks only when every field is the same, so a
    chunk selected under other settings is never mixed into the output. A new knob is one field here plus its flag.
    The defaults are the paper's where it gives one (E5-base-unsupervised, 0.825, 4 related, RRF k = 10 with weights
    2 / 1) and ours where it gives none (the passage budget, the merge floor, TF-IDF's hashing space).

    Left out, because they do not change which groups come out: --batch_size and --device (how fast; embeddings
    move by float rounding only), --trust_remote_code (a permission). The records read and their chunking are keyed
    beside these (RECORD_FLAGS).
    """

    model_name_or_path: str = "intfloat/e5-base-unsupervised"
    dtype: str = "auto"
    # the prefix itself, not --prefixes: the key is what the encoder reads, whichever mode and model produced it
    passage_prefix: str = "passage: "
    passage_tokens: int = 128
    min_passage_tokens: int = 16
    centrality_threshold: float = 0.825
    anchor_share: Optional[float] = None
    calibration_docs: int = 1000
    num_related: int = 4
    ranking: str = "rrf"
    rrf_k: float = 10.0
    rrf_weight_e5: float = 2.0
    rrf_weight_tfidf: float = 1.0
    tfidf_features: int = 2**20
    # how TF-IDF cuts text into terms (tfidf_terms): words, and character bigrams inside unspaced scripts
    tfidf_terms: str = "script"
    max_groups_per_document: int = 0  # 0: every anchor makes a group, as in the paper
    per_script_anchor_share: bool = False
    seed: int = 0

    @classmethod
    def from_args(cls, args) -> "Selection":
        """The settings of parsed flags; the passage prefix by the repository's one rule (common.model_prompts:
        --prefixes auto follows the model's own prompts, else E5's 'passage: ' for an E5 model, else none), as
        train.py applies it."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != "passage_prefix"}
        return cls(**given, passage_prefix=model_prompts(args.model_name_or_path, args.prefixes)["document"])


PAPER = Selection()


# The flags that decide which records are read and where chunks begin: keyed beside Selection by the resume check.
# (--url_field is not among them: it feeds the --inspect report only.)
RECORD_FLAGS = ("input", "dataset", "dataset_config", "dataset_split", "max_docs", "id_field", "text_field",
                "title_field", "skip_bad_lines", "max_doc_chars", "chunk_docs")


def _input_flags(g):
    g.add_argument("--input", nargs="*", default=[],
                   help="Local files, folders or globs, read in the order given: JSON Lines (.jsonl, .json, "
                        "plain or .gz / .zst: C4's c4-train.*.json.gz shards), .parquet, and datasets save_to_disk "
                        "folders (datasets.load_from_disk; --dataset_split picks a DatasetDict's split). A folder "
                        "gives every such file and saved dataset under it, sorted.")
    g.add_argument("--dataset", default=None,
                   help="A Hugging Face dataset name, streamed (e.g. HuggingFaceFW/fineweb). Every process "
                        "streams it in full twice (IDF pass, then selection); --anchor_share and --inspect read "
                        "its first documents once more.")
    g.add_argument("--dataset_config", default=None, help="Config of --dataset (e.g. sample-10BT).")
    g.add_argument("--dataset_split", default="train",
                   help="Split of --dataset, or of a save_to_disk DatasetDict given to --input.")
    g.add_argument("--max_docs", type=non_negative_int, default=0,
                   help="Read at most this many input records (0 = all).")
    g.add_argument("--id_field", default="id",
                   help="Field holding the document id. A corpus whose first record has no such field (text only: "
                        "the RetroMAE / FlagEmbedding pre-training format, many Hub corpora) gets row numbers as ids "
                        "(the record's 0-based index in the input), as stats.json states; '' forces row numbers.")
    g.add_argument("--text_field", default="text", help="Field holding the document text.")
    g.add_argument("--title_field", default="title",
                   help="Field holding the document's title (Wikipedia's, BEIR's), joined to the text as its first "
                        "line, so the first passage reads 'title\\ntext...' as E5 and BEIR join title and text; a "
                        "record without it is read as its text alone. '' leaves titles out. stats.json and the log "
                        "say which fields were used and which were not.")
    g.add_argument("--url_field", default="url", help="Optional field shown in the --inspect report only.")
    g.add_argument("--skip_bad_lines", action="store_true",
                   help="Count and skip bad records (per reason in stats.json) instead of stopping with file:line.")
    g.add_argument("--max_doc_chars", type=positive_int, default=1_000_000,
                   help="A longer document is a bad record ('huge_document'): one page should not hold "
                        "millions of characters.")


def _embedding_flags(g):
    g.add_argument("--model_name_or_path", default=PAPER.model_name_or_path,
                   help="Selection encoder (paper: E5-base-unsupervised). 'all-MiniLM-L6-v2' uses the bundled "
                        "offline weights. Passages are embedded up to the model's own length limit (its "
                        "sentence_bert_config.json max_seq_length, else 512, within its position table).")
    g.add_argument("--prefixes", choices=["auto", "e5", "none"], default="auto",
                   help="Text prefix put before every passage when embedding: auto = the model's own document "
                        "prefix (its sentence-transformers prompts, else 'passage: ' for an E5 model, else none: "
                        "common.model_prompts, the rule train.py and evaluate.py follow); e5 / none force "
                        "'passage: ' / no prefix. stats.json records the prefix used (passage_prefix).")
    g.add_argument("--passage_tokens", type=positive_int, default=PAPER.passage_tokens,
                   help="Token budget of one passage (tokenizer of the selection encoder, without special tokens).")
    g.add_argument("--min_passage_tokens", type=non_negative_int, default=PAPER.min_passage_tokens,
                   help="A shorter packed passage is merged into a neighbour when that stays within the budget.")
    g.add_argument("--batch_size", type=positive_int, default=None,
                   help="Passages per embedding batch (batches are sorted by length). Default: 512 on a GPU "
                        "(FineWeb-Edu's GPU scoring batch; bench/device_check.py part 6 times 256 and 1024), 64 on "
                        "a CPU.")
    g.add_argument("--device", default=None,
                   help="cpu / cuda / cuda:1 (default: this process's GPU if any, else CPU).")
    g.add_argument("--dtype", default=PAPER.dtype, choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 (fp16 before Ampere) on GPU, fp32 on CPU.")
    g.add_argument("--trust_remote_code", action="store_true",
                   help="Allow model code from the hub (off: only built-in architectures).")


def _selection_flags(g):
    g.add_argument("--centrality_threshold", type=float, default=PAPER.centrality_threshold,
                   help="Anchors have centrality >= this (tuned for E5 on FineWeb); --anchor_share replaces it.")
    g.add_argument("--anchor_share", type=float, default=PAPER.anchor_share,
                   help="Instead of a fixed threshold: set it so this share of passages are anchors, from the "
                        "centralities of the first --calibration_docs documents (e.g. 0.6 for another encoder "
                        "or corpus).")
    g.add_argument("--calibration_docs", type=positive_int, default=PAPER.calibration_docs,
                   help="Documents used by --anchor_share.")
    g.add_argument("--num_related", type=positive_int, default=PAPER.num_related,
                   help="Related passages per anchor (a document needs num_related + 1 passages to form a group).")
    g.add_argument("--ranking", default=PAPER.ranking, choices=["rrf", "e5", "tfidf", "random"],
                   help="How related passages are ranked (paper Table 3 ablations).")
    g.add_argument("--rrf_k", type=float, default=PAPER.rrf_k,
                   help="RRF constant k (fixed by the paper's worked example).")
    g.add_argument("--rrf_weight_e5", type=float, default=PAPER.rrf_weight_e5,
                   help="Weight of the embedding-cosine rank in RRF.")
    g.add_argument("--rrf_weight_tfidf", type=float, default=PAPER.rrf_weight_tfidf,
                   help="Weight of the TF-IDF rank in RRF.")
    g.add_argument("--tfidf_features", type=positive_int, default=PAPER.tfidf_features,
                   help="Hashing space of the TF-IDF vectorizer.")
    g.add_argument("--tfidf_terms", default=PAPER.tfidf_terms, choices=list(TFIDF_TERMS),
                   help="How TF-IDF cuts text into terms: 'script' = scikit-learn's words, and character bigrams "
                        "inside runs of scripts written without spaces (Chinese, Japanese, Thai, ...), where a 'word' "
                        "would be a whole clause; 'words' = scikit-learn's words only (the former rule); 'encoder' = "
                        "the selection encoder's subword tokens (its unknown token left out). Measured in the README.")
    g.add_argument("--max_groups_per_document", type=int, default=PAPER.max_groups_per_document,
                   help="Keep at most N groups of one document (its N most central anchors; 0 = all, as in the "
                        "paper): one long page can otherwise hold most of the groups, and training masks a document's "
                        "groups out of each other's negatives. stats.json and the log count what was capped.")
    g.add_argument("--per_script_anchor_share", action="store_true",
                   help="With --anchor_share: calibrate one threshold per script (Latin, Cyrillic, Han, ...), so each "
                        "script of a mixed corpus gets that share of anchors; one threshold can favour one script "
                        "(stats.json's by_script shows each script's anchor share).")
    g.add_argument("--seed", type=int, default=PAPER.seed,
                   help="Seeds random_passage and --ranking random, per document (same under any sharding).")


def _output_flags(g):
    g.add_argument("--output_dir", required=True,
                   help="Folder of parquet shards + stats.json (load_dataset(output_dir)).")
    g.add_argument("--overwrite", action="store_true",
                   help="Replace an existing output folder (otherwise a finished one is refused; an unfinished "
                        "one with the same settings is resumed).")
    g.add_argument("--chunk_docs", type=positive_int, default=1000,
                   help="Input records per chunk (one parquet file each, none for a chunk without groups); bounds "
                        "memory and the work lost to a crash.")
    g.add_argument("--inspect", type=non_negative_int, default=0,
                   help="Also write inspect.md: every passage of the first N documents with centrality, anchors, "
                        "excluded passages and related scores.")
    g.add_argument("--inspect_only", action="store_true",
                   help="Write only the --inspect report (IDF pass + N documents), no groups: check the filter "
                        "before a long run.")
    g.add_argument("--inspect_chars", type=positive_int, default=400,
                   help="Characters of each passage shown in the report.")


def build_parser() -> ArgumentParser:
    """Every flag of the one-process command. select_groups_datatrove.py adds its executor flags to this parser; here
    their defaults are set, so code that reads args.executor, args.tasks, ... finds the one-process values."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    _input_flags(p.add_argument_group("input"))
    _embedding_flags(p.add_argument_group("passages and embedding"))
    _selection_flags(p.add_argument_group("selection (paper: threshold 0.825, RRF k = 10 with weights 2 / 1, "
                                          "4 related)"))
    _output_flags(p.add_argument_group("output"))
    # select_groups_datatrove.py's flags (--executor ...), as this process runs: no executor
    p.set_defaults(executor=None, tasks=1, workers=-1, executor_option=[], dry_run=False, gpus_per_task=None)
    return p


def check_args(p: ArgumentParser, args) -> None:
    """Sanity checks, early and with the fix in the message (select_groups_datatrove.py adds its executor's)."""
    if bool(args.input) == bool(args.dataset):
        p.error("give exactly one of --input (local files) or --dataset (a Hugging Face dataset)")
    if args.passage_tokens < 8 or not 0 <= args.min_passage_tokens < args.passage_tokens:
        p.error("need --passage_tokens >= 8 and 0 <= --min_passage_tokens < --passage_tokens")
    if args.anchor_share is not None and not 0.0 < args.anchor_share <= 1.0:
        p.error("--anchor_share must be in (0, 1]")
    if args.inspect_only and args.inspect < 1:
        p.error("--inspect_only needs --inspect N with N >= 1")
    if args.rrf_k <= 0:
        p.error("--rrf_k must be > 0")
    if args.max_groups_per_document < 0:
        p.error("--max_groups_per_document must be >= 0 (0 = no cap)")
    if args.per_script_anchor_share and args.anchor_share is None:
        p.error("--per_script_anchor_share needs --anchor_share")


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


# ----------------------------------------------------------------------------------------------
# 1. Passages: paragraph-aware packing under a token budget (our rule; the paper gives none).
# ----------------------------------------------------------------------------------------------

def _wide_sentence_terminals() -> str:
    """Unicode's sentence terminals (property Sentence_Terminal) of full or wide width: 。！？ and the like, which
    Chinese and Japanese write with no space after them."""
    import unicodedata

    stop = regex.compile(r"\p{Sentence_Terminal}")
    return "".join(c for c in map(chr, range(0x3000, 0x10000))
                   if stop.match(c) and unicodedata.east_asian_width(c) in ("W", "F"))


# A sentence ends after any script's terminal (Unicode Sentence_Terminal: . ! ? 。 ！ ？ । ؟ ። ...), with the closing
# quotes and brackets that follow it, where a space follows; after a wide terminal (。！？) also where none does.
# "3.14" and "e.g.x" are not cut.
_CLOSERS = r"[\p{Pe}\p{Pf}\"']*"
_SENTENCE_END = regex.compile(rf"(?<=\p{{Sentence_Terminal}}{_CLOSERS})\s+"
                              rf"|(?<=[{_wide_sentence_terminals()}]{_CLOSERS})(?![\s\p{{Pe}}\p{{Pf}}\"'])")


def _token_counts(tokenizer, texts):
    """Tokens of each text without special tokens; one batched call (the fast tokenizer runs in Rust)."""
    if not texts:
        return []
    return [len(x) for x in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]


def _cut_long(para, tokenizer, max_tokens):
    """A paragraph over the budget -> sentences, and over-long sentences -> token windows."""
    sents = [s.strip() for s in _SENTENCE_END.split(para) if s.strip()]
    res = []
    for s, n in zip(sents, _token_counts(tokenizer, sents)):
        if n <= max_tokens:
            res.append((s, n))
            continue
        enc = tokenizer(s, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offs, a = enc["offset_mapping"], 0
        while a < len(offs):
            b = min(a + max_tokens, len(offs))
            if b < len(offs):  # prefer to cut where there is a space, not inside a word like "352,392"
                b = next((j for j in range(b, a + max_tokens // 2, -1) if offs[j][0] > offs[j - 1][1]), b)
            res.append((s[offs[a][0] : offs[b - 1][1]].strip(), b - a))
            a = b
    return [(s, n) for s, n in res if s]


def _merge_short(packs, max_tokens, min_tokens):
    """Merge each pack under `min_tokens` into the shorter neighbour it fits into (in place)."""
    i = 0
    while i < len(packs) and len(packs) > 1:
        n = packs[i][1]
        if n < min_tokens:
            cands = [j for j in (i - 1, i + 1) if 0 <= j < len(packs) and packs[j][1] + n <= max_tokens]
            if cands:
                j = min(cands, key=lambda j: packs[j][1])
                lo, hi = min(i, j), max(i, j)
                packs[lo] = [packs[lo][0] + packs[hi][0], packs[lo][1] + packs[hi][1]]
                del packs[hi]
                i = max(lo - 1, 0)
                continue
        i += 1


def _join_parts(parts):
    """[(text, paragraph number), ...] -> one passage: a space within a paragraph, a newline between."""
    s = parts[0][0]
    for (t, para), (_, prev) in zip(parts[1:], parts[:-1]):
        s += (" " if para == prev else "\n") + t
    return s


def _pack(pieces, max_tokens, min_tokens):
    """[(text, tokens, paragraph number), ...] -> passages: greedy packing, then short ones merged."""
    packs = []  # each: [list of (text, paragraph), tokens]
    for text, n, para in pieces:
        if packs and packs[-1][1] + n <= max_tokens:
            packs[-1][0].append((text, para))
            packs[-1][1] += n
        else:
            packs.append([[(text, para)], n])
    _merge_short(packs, max_tokens, min_tokens)
    return [_join_parts(parts) for parts, _ in packs]


def unknown_tokens(tokenizer, ids) -> int:
    """How many of these token ids are the tokenizer's unknown token (0 for a byte-level tokenizer, which has none)."""
    unk = tokenizer.unk_token_id
    return 0 if unk is None else sum(x.count(unk) for x in ids)


def split_passages(texts, tokenizer, max_tokens=128, min_tokens=16, tokens=None):
    """Documents -> lists of passages, each at most `max_tokens` tokens of `tokenizer` (no specials).

    Rule: paragraphs are the non-empty lines (whitespace collapsed). A paragraph over the budget is
    cut at sentence ends, and a sentence over the budget at token boundaries. Consecutive pieces
    are packed greedily into a passage while it fits; a piece that does not fit starts a new one,
    so a paragraph is split only when it alone exceeds the budget. A passage under `min_tokens`
    (a lone heading, a "Share this" line) is merged into the shorter neighbour it fits into;
    otherwise it stays. Pieces of one paragraph are joined by a space, paragraphs by a newline.
    tokens: a list that gets, per document, (tokens, unknown tokens) of its text (the encoder's vocabulary coverage).
    """
    paras = [[" ".join(line.split()) for line in t.split("\n")] for t in texts]
    paras = [[p for p in ps if p] for ps in paras]
    # One batched call for the whole chunk: the fast tokenizer runs in Rust, in parallel.
    flat = [p for ps in paras for p in ps]
    ids = tokenizer(flat, add_special_tokens=False, verbose=False)["input_ids"] if flat else []
    lengths = iter([len(x) for x in ids])
    if tokens is not None:
        pos = 0
        for ps in paras:
            doc = ids[pos:pos + len(ps)]
            tokens.append((sum(len(x) for x in doc), unknown_tokens(tokenizer, doc)))
            pos += len(ps)
    out = []
    for ps in paras:
        pieces = []  # (text, tokens, paragraph number)
        for j, para in enumerate(ps):
            n = next(lengths)
            if n <= max_tokens:
                pieces.append((para, n, j))
            else:
                pieces += [(s, k, j) for s, k in _cut_long(para, tokenizer, max_tokens)]
        out.append(_pack(pieces, max_tokens, min_tokens))
    return out


# ----------------------------------------------------------------------------------------------
# 2. Centrality and RRF: one function per formula of the paper.
# ----------------------------------------------------------------------------------------------

def centrality(vectors):
    """centrality_i = cos(e_i, mean_j e_j) over the document's L2-normalised passage vectors.

    Paper: body-text passages score high; off-topic blocks (music-video links, press contacts)
    0.46-0.51; anchors are those >= 0.825 (tuned for E5 on FineWeb). (P, H) -> (P,).
    Worked example: two passages along e1, one along e2: 2/sqrt(5) = 0.894 and 1/sqrt(5) = 0.447.
    """
    v = np.asarray(vectors, dtype=np.float64)
    m = v.mean(axis=0)
    return v @ m / max(np.linalg.norm(m), 1e-12) / np.maximum(np.linalg.norm(v, axis=1), 1e-12)


def anchor_share_threshold(centralities, anchor_share, default):
    """The centrality threshold that makes `anchor_share` of these passages anchors: their (1 - share)
    quantile (--anchor_share); `default` when there are no passages."""
    c = np.asarray(centralities)
    return float(np.quantile(c, 1.0 - anchor_share)) if len(c) else default


def ranks_descending(scores):
    """1-based ranks, best (highest) first; ties share the best rank ('min'), e.g. all zero TF-IDF."""
    from scipy.stats import rankdata

    return rankdata(-np.asarray(scores, dtype=np.float64), method="min").astype(np.int64)


def rrf_score(rank_e5, rank_tfidf, k=10.0, w_e5=2.0, w_tfidf=1.0):
    """RRF = w_e5 / (k + rank_E5) + w_tfidf / (k + rank_TFIDF), ranks 1-based.

    Paper: the E5 rank weighted twice the TF-IDF rank; its worked example fixes k = 10:
    A (1st by E5, 6th by TF-IDF) = 2/11 + 1/16 = 0.2443 < B (2nd on both) = 3/12 = 0.2500.
    """
    rank_e5 = np.asarray(rank_e5, dtype=np.float64)
    rank_tfidf = np.asarray(rank_tfidf, dtype=np.float64)
    return w_e5 / (k + rank_e5) + w_tfidf / (k + rank_tfidf)


def rank_related(anchor, cos_row, tfidf_row, *, ranking, num_related, rrf_k, rrf_weight_e5, rrf_weight_tfidf,
                 rng=None, candidates=None):
    """Order the document's other passages for `anchor`; return (indices, cos, tfidf, rrf) of the top
    `num_related`. candidates: the passage indices that may be related (default: every passage but the anchor;
    document_groups leaves out the anchor's exact repeats).

    `ranking`: "rrf" (paper; RRF with constant `rrf_k` and the two weights), "e5" (cosine only:
    -2.3 points in Table 3), "tfidf" (level with rrf), "random" (a permutation drawn from `rng`).
    Ties are broken by cosine, then by passage order, so the result is deterministic.
    """
    cand = np.array([j for j in range(len(cos_row)) if j != anchor] if candidates is None else candidates,
                    dtype=np.int64)
    cs, ts = np.asarray(cos_row)[cand], np.asarray(tfidf_row)[cand]
    rrf = rrf_score(ranks_descending(cs), ranks_descending(ts), rrf_k, rrf_weight_e5, rrf_weight_tfidf)
    if ranking == "random":
        order = rng.permutation(len(cand))
    else:
        primary = {"rrf": rrf, "e5": cs, "tfidf": ts}[ranking]
        order = np.lexsort((np.arange(len(cand)), -cs, -primary))  # last key is the primary one
    top = order[:num_related]
    return cand[top], cs[top], ts[top], rrf[top]


def derived_rng(seed, doc_id, salt):
    """A generator seeded by (seed, doc_id, salt): the same in any process, whatever the sharding."""
    digest = hashlib.sha256(f"{seed}\x00{doc_id}\x00{salt}".encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


# ----------------------------------------------------------------------------------------------
# 3. Corpus-level TF-IDF: IDF from document frequencies over the whole corpus, streamed.
# ----------------------------------------------------------------------------------------------

# Scripts written without spaces between words: a run of them is one "word" to a space- or \w-based tokenizer, a
# whole clause, which shares no term with any other passage. Unicode's script property names them, not a list of
# code points.
_UNSPACED = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}\p{Tibetan}"
_UNSPACED_RUN = regex.compile(rf"[{_UNSPACED}\u30fc]+")  # ー (prolonged sound mark) is Common, inside katakana words
_WORD = re.compile(r"(?u)\b\w\w+\b")  # scikit-learn's token_pattern


def script_terms(text: str) -> list:
    """TF-IDF terms of any script (--tfidf_terms script): scikit-learn's words (lowercased, 2+ word characters) in
    spaced scripts, and the character bigrams of each run of an unspaced script (a lone character as itself), as
    Lucene's CJK bigram filter does. Text without unspaced characters gets exactly scikit-learn's terms.
    '数学是一门学科' -> 数学 学是 是一 一门 门学 学科."""
    text = text.lower()
    runs = _UNSPACED_RUN.findall(text)
    terms = _WORD.findall(_UNSPACED_RUN.sub(" ", text) if runs else text)
    for r in runs:
        terms += [r] if len(r) == 1 else [r[i:i + 2] for i in range(len(r) - 1)]
    return terms


class EncoderTerms:
    """TF-IDF terms = the selection encoder's subword tokens (--tfidf_terms encoder), its unknown token left out (a
    term every unknown word would share)."""

    def __init__(self, tokenizer):
        # its own copy: select_chunks runs TF-IDF in a thread beside the encoder's tokenising, and a fast tokenizer's
        # truncation settings are state that two threads must not share
        self.tokenizer = copy.deepcopy(tokenizer)

    def __call__(self, text: str) -> list:
        unk = self.tokenizer.unk_token
        return [t for t in self.tokenizer.tokenize(text.lower()) if t != unk]


TFIDF_TERMS = {"script": "words, and character bigrams in unspaced scripts", "words": "scikit-learn's words",
               "encoder": "the selection encoder's subword tokens"}


def tfidf_analyzer(terms: str, tokenizer=None):
    """The HashingVectorizer analyzer of --tfidf_terms (None: scikit-learn's own word analyzer)."""
    return {"script": script_terms, "words": None, "encoder": EncoderTerms(tokenizer) if tokenizer else None}[terms]


class CorpusTfidf:
    """scikit-learn's TF-IDF with the IDF fitted on the corpus, not per document, in bounded memory.

    A HashingVectorizer needs no vocabulary, so document frequencies are one fixed-size vector that
    processes add up. idf = ln((1 + n) / (1 + df)) + 1 (TfidfTransformer's smooth_idf), counted over
    documents (a word in every page, like "privacy", weighs little). Passage vectors: raw counts x idf,
    L2-normalised, so the dot product of two passages is their TF-IDF cosine.
    """

    def __init__(self, n_features=2**20, analyzer=None):
        from sklearn.feature_extraction.text import HashingVectorizer

        # analyzer: text -> terms (tfidf_analyzer); None: scikit-learn's words
        self.vec = HashingVectorizer(n_features=n_features, alternate_sign=False, norm=None,
                                     **({"analyzer": analyzer} if analyzer is not None else {}))
        self.df = np.zeros(n_features, dtype=np.int64)
        self.n_docs = 0
        self.idf = None

    def add_documents(self, texts, sign=1):
        """Count the terms present in each of `texts`; sign -1 takes documents back out (the datatrove merge's
        duplicates, counted by a task before the merge saw the whole corpus)."""
        if not texts:  # a chunk of bad records only
            return
        x = self.vec.transform(texts)
        x.data[:] = 1  # presence, not counts
        self.df += sign * np.asarray(x.sum(axis=0)).ravel().astype(np.int64)
        self.n_docs += sign * len(texts)

    def finalize(self):
        self.idf = np.log((1.0 + self.n_docs) / (1.0 + self.df)) + 1.0
        return self

    def transform(self, passages):
        from sklearn.preprocessing import normalize

        x = self.vec.transform(passages).astype(np.float64)
        return normalize(x.multiply(self.idf).tocsr(), norm="l2")

    def cosines(self, passages):
        """(P, P) TF-IDF cosines of one document's passages."""
        t = self.transform(passages)
        return (t @ t.T).toarray()


# ----------------------------------------------------------------------------------------------
# 4. Selection of one batch of documents.
# ----------------------------------------------------------------------------------------------

def group_schema():
    """The parquet schema of a group row: the one definition of the columns and their types."""
    import pyarrow as pa

    return pa.schema([
        ("doc_id", pa.string()),
        ("group_index", pa.int32()),
        ("anchor_index", pa.int32()),
        ("anchor", pa.string()),
        ("anchor_centrality", pa.float32()),
        ("related", pa.list_(pa.string())),
        ("related_index", pa.list_(pa.int32())),
        ("related_cosine", pa.list_(pa.float32())),
        ("related_tfidf", pa.list_(pa.float32())),
        ("related_rrf", pa.list_(pa.float32())),
        ("random_passage", pa.string()),
        ("num_passages", pa.int32()),
    ])


_LETTER = regex.compile(r"\p{L}")


def dominant_script(text: str, sample_chars: int = 4000) -> str:
    """The Unicode script of most letters in the document's first `sample_chars` characters (Latin, Cyrillic, Han,
    Arabic, ...; kana with Han is 'Japanese', Hangul with Han 'Korean'): what the per-script report and
    --per_script_anchor_share group documents by. A script, not a language: German and English are both Latin."""
    import unicodedata

    counts = {}
    for c in _LETTER.findall(text[:sample_chars]):
        name = unicodedata.name(c, "")
        script = name.split(" ")[0] if name else "?"
        script = {"CJK": "Han", "HIRAGANA": "Japanese", "KATAKANA": "Japanese", "HANGUL": "Korean"}.get(
            script, script.title())
        counts[script] = counts.get(script, 0) + 1
    if not counts:
        return "none"
    if counts.get("Japanese", 0) >= 0.1 * sum(counts.values()):  # kana among Han: Japanese
        return "Japanese"
    return max(counts, key=counts.get)


@dataclass
class DocResult:
    doc: Doc
    passages: list
    centrality: np.ndarray = None
    groups: list = field(default_factory=list)
    status: str = ""  # "groups", "too_few_passages", "no_anchor"
    repeats: dict = field(default_factory=dict)  # document_groups' repeat counters
    script: str = ""  # dominant_script of the text
    tokens: tuple = (0, 0)  # (tokens, unknown tokens) of the text under the selection encoder's tokenizer
    threshold: float = 0.0  # the centrality threshold its anchors met


def document_groups(doc_id, passages, vectors, cent, tfidf, threshold, sel: Selection):
    """(status, groups, repeats) of one document: one group row (group_schema()) per anchor.

    vectors (P, H) unit-length passage vectors, cent (P,) their centralities; threshold the centrality an anchor
    needs (sel.centrality_threshold, or the one --anchor_share calibrated); status is "groups", "too_few_passages"
    (fewer than num_related + 1 passages, or no anchor with num_related passages other than its repeats) or
    "no_anchor". A passage with the anchor's exact text (whitespace aside: a page that repeats a block) is never
    its related or random passage: the pair would teach nothing (cosine 1.0) and the fill-in would be a copy.
    repeats: {"repeat_pairs_excluded": such (anchor, passage) pairs, "anchors_without_distinct_related": anchors
    left with fewer than num_related other passages, so without a group, "groups_capped": anchors left out by
    sel.max_groups_per_document (the least central)}.
    """
    repeats = {"repeat_pairs_excluded": 0, "anchors_without_distinct_related": 0, "groups_capped": 0}
    if len(passages) < sel.num_related + 1:
        return "too_few_passages", [], repeats
    anchors = np.flatnonzero(cent >= threshold)
    if len(anchors) == 0:
        return "no_anchor", [], repeats
    if sel.max_groups_per_document and len(anchors) > sel.max_groups_per_document:
        # the most central anchors, in passage order (--max_groups_per_document); counted in stats.json
        repeats["groups_capped"] = len(anchors) - sel.max_groups_per_document
        anchors = np.sort(anchors[np.argsort(-cent[anchors], kind="stable")[: sel.max_groups_per_document]])
    cos = vectors @ vectors.T  # (P, P) cosines: vectors are unit length
    tf = tfidf.cosines(passages)  # (P, P)
    rank_rng = derived_rng(sel.seed, doc_id, "ranking")
    pick_rng = derived_rng(sel.seed, doc_id, "random_passage")
    norm = [" ".join(p.split()) for p in passages]
    groups = []
    for a in anchors:
        cand = [j for j in range(len(passages)) if j != a and norm[j] != norm[a]]
        repeats["repeat_pairs_excluded"] += len(passages) - 1 - len(cand)
        if len(cand) < sel.num_related:
            repeats["anchors_without_distinct_related"] += 1
            continue
        idx, cs, ts, rrf = rank_related(a, cos[a], tf[a], ranking=sel.ranking, num_related=sel.num_related,
                                        rrf_k=sel.rrf_k, rrf_weight_e5=sel.rrf_weight_e5,
                                        rrf_weight_tfidf=sel.rrf_weight_tfidf, rng=rank_rng, candidates=cand)
        j = cand[int(pick_rng.integers(len(cand)))]  # uniform over the passages that may be related
        groups.append({
            "doc_id": doc_id,
            "group_index": len(groups),
            "anchor_index": int(a),
            "anchor": passages[a],
            "anchor_centrality": float(cent[a]),
            "related": [passages[i] for i in idx],
            "related_index": [int(i) for i in idx],
            "related_cosine": [float(x) for x in cs],
            "related_tfidf": [float(x) for x in ts],
            "related_rrf": [float(x) for x in rrf],
            "random_passage": passages[j],
            "num_passages": len(passages),
        })
    return ("groups" if groups else "too_few_passages"), groups, repeats


@dataclass
class Encoder:
    """The frozen selection encoder as select_documents runs it (load_selection_encoder builds it)."""

    tokenizer: object
    model: object
    # modeling_xprt.max_seq_length, the repository's one length rule: the limit the model's folder states, else 512.
    # Passages are packed to --passage_tokens (128) first, so at the defaults nothing reaches it.
    max_length: int
    batch_size: int  # passages per forward pass: speed only
    # the model's own sentence vector: its pooling (model_folder.read_pooling) and its sentence-transformers modules
    # after pooling (model_folder.load_post_pooling: Dense, Normalize, truncate_dim, ...), so selection embeds as the
    # model does
    pooling: str = "mean"
    post_pooling: object = None


def embed_passages(encoder: Encoder, texts, prefix: str, show_progress: bool = False, desc: str = "embedding"):
    """The selection encoder's L2-normalised sentence vectors of `texts` (N, D): the model's own pooling and its
    modules after pooling, as SentenceTransformer(model).encode makes them, then normalised (centrality and the E5
    ranking are cosines)."""
    from plumbing.embed import embed_texts

    return embed_texts(encoder.model, encoder.tokenizer, texts, batch_size=encoder.batch_size,
                       max_length=encoder.max_length, prefix=prefix, show_progress=show_progress, desc=desc,
                       pooling=encoder.pooling, post_pooling=encoder.post_pooling)


def split_documents(docs, tokenizer, sel: Selection):
    """(passages per doc, (tokens, unknown) per doc) of `docs` (valid Docs): split_passages under the selection
    encoder's tokenizer."""
    tokens = []
    passages = split_passages([d.text for d in docs], tokenizer, sel.passage_tokens, sel.min_passage_tokens, tokens)
    return passages, tokens


def embed_documents(docs, encoder: Encoder, sel: Selection, *, desc="embedding", show_progress=False, split=None):
    """The encoder's half of select_documents: (passages per doc, (tokens, unknown) per doc, (N, D) passage vectors)
    of `docs` (valid Docs). split: split_documents' output when it was made beforehand (select_chunks)."""
    passages, tokens = split or split_documents(docs, encoder.tokenizer, sel)
    flat = [p for ps in passages for p in ps]
    # One embedding call per chunk: length sorting works across documents, so batches stay full.
    return passages, tokens, embed_passages(encoder, flat, sel.passage_prefix, show_progress, desc).numpy()


def group_documents(docs, passages, tokens, vecs, tfidf, threshold, sel: Selection):
    """The CPU's half of select_documents: one DocResult per doc from embed_documents' passages and vectors
    (centrality, anchors, TF-IDF, ranks); it needs no encoder, so it can run beside the next chunk's embedding."""
    results, pos = [], 0
    for d, ps, tok in zip(docs, passages, tokens):
        v = vecs[pos : pos + len(ps)].astype(np.float64)  # (P, H)
        pos += len(ps)
        r = DocResult(d, ps, centrality(v) if len(ps) else np.zeros(0), script=dominant_script(d.text), tokens=tok)
        # threshold: one number, or {script: number} with "*" for the rest (--per_script_anchor_share)
        r.threshold = threshold.get(r.script, threshold["*"]) if isinstance(threshold, dict) else threshold
        r.status, r.groups, r.repeats = document_groups(d.doc_id, ps, v, r.centrality, tfidf, r.threshold, sel)
        results.append(r)
    return results


def select_documents(docs, encoder: Encoder, tfidf, threshold, sel: Selection, *, desc="embedding",
                     show_progress=False):
    """Passages, centralities and groups of `docs` (valid Docs). Returns one DocResult per doc."""
    return group_documents(docs, *embed_documents(docs, encoder, sel, desc=desc, show_progress=show_progress), tfidf,
                           threshold, sel)


# Per-chunk counters (summed into stats.json); STATUS_KEY maps a DocResult.status to its counter.
STATUS_KEY = {"groups": "with_groups", "too_few_passages": "too_few_passages", "no_anchor": "no_anchor"}


def empty_counts():
    return {"records": 0, "valid": 0, "skipped": {}, "with_groups": 0, "too_few_passages": 0, "no_anchor": 0,
            "groups": 0, "passages": 0, "covered": 0, "anchors": 0, "above_threshold": 0,
            "centrality_hist": [0] * HIST_BINS, "repeat_pairs_excluded": 0, "anchors_without_distinct_related": 0,
            "html_documents": 0, "groups_capped": 0, "documents_capped": 0, "most_groups_one_document": 0,
            "tokens": 0, "unknown_tokens": 0, "by_script": {}}


SCRIPT_COUNTS = ("documents", "passages", "anchors", "groups", "tokens", "unknown_tokens")


# Markup a web page's raw HTML holds and extracted text does not: a document with several such tags was not
# converted to text, and its passages would carry the tags into the encoder.
_HTML_TAG = re.compile(r"</?(?:html|head|body|div|span|p|a|br|li|ul|ol|table|tr|td|script|style|h[1-6])\b"
                       r"[^<>]{0,500}>", re.IGNORECASE)


def looks_like_html(text: str, min_tags: int = 3) -> bool:
    """Whether a document holds raw HTML (at least `min_tags` tags of _HTML_TAG): counted in stats.json and said in
    the log; such a corpus wants its text extracted first (e.g. trafilatura, as FineWeb did)."""
    return sum(1 for _ in itertools.islice(_HTML_TAG.finditer(text), min_tags)) >= min_tags


def count_results(counts, results):
    for r in results:
        counts["above_threshold"] += int((r.centrality >= r.threshold).sum())
        by = counts["by_script"].setdefault(r.script, dict.fromkeys(SCRIPT_COUNTS, 0))
        for k, v in zip(SCRIPT_COUNTS, (1, len(r.passages), int((r.centrality >= r.threshold).sum()), len(r.groups),
                                        *r.tokens)):
            by[k] += v
        counts["tokens"] += r.tokens[0]
        counts["unknown_tokens"] += r.tokens[1]
        counts["documents_capped"] += r.repeats.get("groups_capped", 0) > 0
        counts["most_groups_one_document"] = max(counts["most_groups_one_document"], len(r.groups))
        counts["valid"] += 1
        counts["passages"] += len(r.passages)
        counts[STATUS_KEY[r.status]] += 1
        counts["groups"] += len(r.groups)
        counts["anchors"] += len(r.groups)
        covered = {g["anchor_index"] for g in r.groups} | {i for g in r.groups for i in g["related_index"]}
        counts["covered"] += len(covered)
        for k, v in r.repeats.items():
            counts[k] += v
        counts["html_documents"] += looks_like_html(r.doc.text)
        h = np.histogram(np.clip(r.centrality, 0, 1), bins=HIST_BINS, range=(0, 1))[0]
        counts["centrality_hist"] = [a + int(b) for a, b in zip(counts["centrality_hist"], h)]


def sum_counts(chunk_counts):
    """Add up per-chunk counters (empty_counts() layout)."""
    total = empty_counts()
    for c in chunk_counts:
        for k, v in c.items():
            if k == "skipped":
                for r, n in v.items():
                    total["skipped"][r] = total["skipped"].get(r, 0) + n
            elif k == "centrality_hist":
                total[k] = [a + b for a, b in zip(total[k], v)]
            elif k == "by_script":
                for script, c in v.items():
                    t = total[k].setdefault(script, dict.fromkeys(SCRIPT_COUNTS, 0))
                    for name, n in c.items():
                        t[name] += n
            elif k == "most_groups_one_document":
                total[k] = max(total[k], v)
            elif k in total:
                total[k] += v
    return total


def _pct(a, b):
    return round(100.0 * a / b, 2) if b else 0.0


def _ratio(a, b):
    return round(a / b, 3) if b else 0.0


def threshold_text(threshold) -> str:
    """A threshold as the log prints it: one number, or the corpus's with each script's (--per_script_anchor_share)."""
    if not isinstance(threshold, dict):
        return f"{threshold:.4f}"
    return f"{threshold['*']:.4f} (" + ", ".join(f"{k} {v:.4f}" for k, v in threshold.items() if k != "*") + ")"


def summary_stats(total, threshold, source):
    """The corpus numbers of stats.json from the summed counters (the paper's three among them)."""
    skipped = sum(total["skipped"].values())
    if total["records"] != total["valid"] + skipped:  # every input record is accounted for
        raise RuntimeError(f"accounting error: {total['records']} records != {total['valid']} valid + "
                           f"{skipped} skipped")
    hist = np.array(total["centrality_hist"])
    edges = np.linspace(0, 1, HIST_BINS + 1)
    # share of passages that WOULD be anchors at other thresholds (from the histogram; bin width 0.025)
    share_at = {f"{t:.3f}": _pct(int(hist[edges[:-1] >= t - 1e-9].sum()), total["passages"])
                for t in (0.5, 0.6, 0.7, 0.75, 0.8, 0.825, 0.85, 0.9)}
    return {
        "documents_read": total["records"],
        "documents_valid": total["valid"],
        "documents_skipped": skipped,
        "documents_skipped_by_reason": {r: total["skipped"].get(r, 0) for r in SKIP_REASONS},
        "documents_with_groups": total["with_groups"],
        "documents_with_groups_pct": _pct(total["with_groups"], total["valid"]),
        "documents_too_few_passages": total["too_few_passages"],
        "documents_no_anchor": total["no_anchor"],
        "groups": total["groups"],
        "groups_per_document": _ratio(total["groups"], total["valid"]),
        "groups_per_document_with_groups": _ratio(total["groups"], total["with_groups"]),
        "passages": total["passages"],
        "passages_per_document": _ratio(total["passages"], total["valid"]),
        # a page that repeats a block: its copies are never an anchor's related passages (document_groups)
        "repeat_pairs_excluded": total.get("repeat_pairs_excluded", 0),
        "anchors_without_distinct_related": total.get("anchors_without_distinct_related", 0),
        "documents_with_html": total.get("html_documents", 0),
        # --max_groups_per_document: anchors left out (the least central of their document) and their documents
        "groups_capped": total.get("groups_capped", 0),
        "documents_capped": total.get("documents_capped", 0),
        "most_groups_one_document": total.get("most_groups_one_document", 0),
        # the selection encoder's vocabulary on this corpus: a high share means it reads much of it as one token
        "tokens": total.get("tokens", 0),
        "unknown_token_pct": _pct(total.get("unknown_tokens", 0), total.get("tokens", 0)),
        # per dominant script of a document: one threshold can give scripts very different anchor shares
        "by_script": {k: {**v, "anchor_share_pct": _pct(v["anchors"], v["passages"]),
                          "unknown_token_pct": _pct(v["unknown_tokens"], v["tokens"])}
                      for k, v in sorted(total.get("by_script", {}).items(), key=lambda kv: -kv[1]["documents"])},
        "passages_covered": total["covered"],
        "passages_covered_pct": _pct(total["covered"], total["passages"]),
        "anchor_share_pct": _pct(total["anchors"], total["passages"]),
        # passages with centrality >= threshold, including those of documents too short to form a group
        "passages_above_threshold_pct": _pct(total["above_threshold"], total["passages"]),
        "centrality_threshold": threshold["*"] if isinstance(threshold, dict) else threshold,
        "centrality_threshold_by_script": threshold if isinstance(threshold, dict) else None,
        "threshold_source": source,
        "anchor_share_pct_at_threshold": share_at,
        "centrality_histogram": {"bin_edges": [round(e, 3) for e in edges], "counts": total["centrality_hist"]},
    }


UNKNOWN_TOKEN_WARN_PCT = 5.0  # above this share of [UNK] tokens the encoder cannot read the corpus


def unknown_token_warning(pct: float, model: str, by_script=None) -> list:
    """The log's warning when the selection encoder reads more than UNKNOWN_TOKEN_WARN_PCT of the corpus's tokens as
    its unknown token: their passages' vectors, so the centralities and the related ranks, carry little of the text."""
    if pct <= UNKNOWN_TOKEN_WARN_PCT:
        return []
    worst = ", ".join(f"{k} {v['unknown_token_pct']:.1f}%" for k, v in (by_script or {}).items()
                      if v["unknown_token_pct"] > UNKNOWN_TOKEN_WARN_PCT)
    return [f"warning: {model} reads {pct:.1f}% of this corpus's tokens as its unknown token"
            + (f" ({worst})" if worst else "") + ": its vocabulary does not cover the corpus's script; choose an "
            "encoder that does (e.g. intfloat/multilingual-e5-base) with --model_name_or_path"]


def format_stats(s):
    p = s["paper_fineweb_100k"]
    skipped = {k: v for k, v in s["documents_skipped_by_reason"].items() if v}
    lines = [
        f"documents read {s['documents_read']:,}: valid {s['documents_valid']:,}, "
        f"skipped {s['documents_skipped']:,} { skipped or ''}",
        f"centrality threshold {threshold_text(s['centrality_threshold_by_script'] or s['centrality_threshold'])} "
        f"({s['threshold_source']}); "
        f"anchors {s['anchor_share_pct']}% of passages",
        f"{'':34s}{'this run':>12s}{'paper (FineWeb-100K, E5)':>28s}",
        f"{'documents with >= 1 group':34s}{s['documents_with_groups_pct']:>11.1f}%"
        f"{p['documents_with_groups_pct']:>27.0f}%",
        f"{'groups per document':34s}{s['groups_per_document']:>12.2f}{p['groups_per_document']:>28.1f}",
        f"{'passages covered by a group':34s}{s['passages_covered_pct']:>11.1f}%{p['passages_covered_pct']:>27.0f}%",
        f"{'passages per document':34s}{s['passages_per_document']:>12.2f}{'(not given)':>28s}",
        f"no group: {s['documents_too_few_passages']:,} docs with < {s['num_related'] + 1} passages, "
        f"{s['documents_no_anchor']:,} with no anchor",
    ]
    if s.get("repeat_pairs_excluded"):
        lines.append(f"repeated blocks: {s['repeat_pairs_excluded']:,} (anchor, exact copy) pairs kept out of the "
                     f"groups; {s['anchors_without_distinct_related']:,} anchors had too few other passages")
    if s.get("groups_capped"):
        lines.append(f"--max_groups_per_document {s['max_groups_per_document']}: {s['groups_capped']:,} groups of "
                     f"{s['documents_capped']:,} documents left out (their least central anchors)")
    if s["groups"] and s.get("most_groups_one_document", 0) > 0.25 * s["groups"]:
        lines.append(f"warning: one document holds {s['most_groups_one_document']:,} of the {s['groups']:,} groups: "
                     "training masks a document's groups out of each other's negatives, so batches of it teach L_xp "
                     "nothing; pass --max_groups_per_document (train.py also caps a document's groups per batch)")
    scripts = s.get("by_script", {})
    if len(scripts) > 1:
        lines.append("per script (of each document's letters; --per_script_anchor_share: one threshold each):")
        lines += [f"  {k:12s} {v['documents']:>7,} documents {v['passages']:>9,} passages {v['groups']:>8,} groups, "
                  f"anchors {v['anchor_share_pct']:5.1f}% of passages, unknown tokens {v['unknown_token_pct']:.1f}%"
                  for k, v in scripts.items()]
        shares = [v["anchor_share_pct"] for v in scripts.values() if v["documents"] >= 10]
        if len(shares) > 1 and max(shares) > 2 * max(min(shares), 0.1):
            lines.append("warning: the scripts' anchor shares differ by more than 2x under one threshold: centrality "
                         "depends on the script and the encoder; --anchor_share with --per_script_anchor_share gives "
                         "each script the same share")
    lines += unknown_token_warning(s.get("unknown_token_pct", 0.0), s["model_name_or_path"], s.get("by_script"))
    if s.get("documents_with_html"):
        lines.append(f"warning: {s['documents_with_html']:,} documents hold raw HTML tags, which went into their "
                     "passages as text: extract the text first (e.g. trafilatura)")
    return "\n".join(lines)


def inspect_markdown(results, *, threshold, source, model_name, ranking, max_chars):
    """The --inspect report of `results` (DocResults) as Markdown: every passage with its role."""

    def clip(s):
        return html.escape(" ".join(s.split()))[:max_chars] + ("…" if len(s) > max_chars else "")

    n_p = sum(len(r.passages) for r in results)
    n_a = sum(len(r.groups) for r in results)
    out = [f"# Group selection report: {len(results)} documents", "",
           f"Encoder `{model_name}`, ranking `{ranking}`, centrality threshold **{threshold_text(threshold)}** "
           f"({source}). "
           f"{n_p} passages, {n_a} anchors ({100 * n_a / max(n_p, 1):.1f}%). Roles: **ANCHOR** (centrality >= "
           "threshold), *related* (in some anchor's top related), ~~excluded~~ (in no group). Look for "
           "navigation, footers and boilerplate among the excluded and body text among the anchors.", ""]
    for k, r in enumerate(results):
        anchors = {g["anchor_index"] for g in r.groups}
        related = {i for g in r.groups for i in g["related_index"]}
        out += [f"## {k + 1}. `{r.doc.doc_id}`", "", f"{r.doc.url}  " if r.doc.url else "",
                f"{len(r.passages)} passages, {len(r.groups)} groups, status: {r.status}", "",
                "| # | centrality | role | passage |", "|---:|---:|---|---|"]
        for i, ptxt in enumerate(r.passages):
            role = "**ANCHOR**" if i in anchors else ("*related*" if i in related else "~~excluded~~")
            out.append(f"| {i} | {r.centrality[i]:.3f} | {role} | {clip(ptxt).replace('|', '&#124;')} |")
        out.append("")
        for g in r.groups:
            scores = zip(g["related_index"], g["related_cosine"], g["related_tfidf"], g["related_rrf"])
            rel = ", ".join(f"{i} (cos {c:.3f}, tfidf {t:.3f}, rrf {s:.4f})" for i, c, t, s in scores)
            out.append(f"- anchor {g['anchor_index']} -> {rel}")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# 5. The passes: output folder and resume, IDF pass, threshold, selection, stats, inspect report.
#    Every file is written atomically (common.atomic_path: a '.tmp-' sibling renamed into
#    place), so a reader or a resumed run sees a whole file or none.
# ----------------------------------------------------------------------------------------------

def write_group_shard(path, rows):
    """One chunk's group rows as a parquet file (group_schema()), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), tmp)


def run_config(args, sel: Selection):
    """Everything the groups depend on, the key of the resume check: the records read (RECORD_FLAGS) and every
    selection setting (the fields of Selection, whole). A rerun resumes only when this is identical. Under
    `select_groups_datatrove.py --executor`, the task count too: a task's files are every --tasks-th input file, so
    another count would pair finished tasks with other files (datatrove: "do not change the total number of
    tasks")."""
    # "chunks": the rule that cuts chunks (iter_chunks); a folder cut by another rule is not resumed
    config = {**{k: getattr(args, k) for k in RECORD_FLAGS}, **asdict(sel), "chunks": "per input file"}
    if args.executor:
        config["datatrove_tasks"] = args.tasks
    return config


# What select_groups.py writes in --output_dir (common.claim_output_folder: nothing else there is ever removed)
SELECTION_OUTPUTS = ("stats.json", "inspect.md", "groups-*.parquet", f"{META_DIR}/run_config.json",
                     f"{META_DIR}/chunk-*.json", f"{META_DIR}/df-r*-w*.npz", f"{META_DIR}/calibration.json",
                     f"{META_DIR}/datatrove")  # select_groups_datatrove.py: its stages' files, datatrove's logs


def prepare_selection_dir(args, sel: Selection, state):
    """Make --output_dir ready for this run, deleting nothing select_groups.py did not write there: inputs kept out
    of it and the folder checked for writing before any work (common.claim_output_folder). A finished selection is
    refused unless --overwrite; an unfinished one is resumed only when run_config matches (its finished chunks are
    then reused); otherwise this script's own outputs are replaced, stats.json first (train.py reads a folder only
    once stats.json says it is finished), and a stranger's files are left. Leftover temporaries of a crash go too.
    (train.py / finetune.py have training.prepare_output_dir, for run folders.)"""
    out, meta = args.output_dir, os.path.join(args.output_dir, META_DIR)
    cfg_path = os.path.join(meta, "run_config.json")
    config = run_config(args, sel)
    inputs = local_inputs(input=[*args.input, *input_files(args.input)] if args.input else [],
                          model_name_or_path=args.model_name_or_path)
    previous = claim_output_folder(out, "select_groups.py", SELECTION_OUTPUTS, inputs)
    finished = os.path.exists(os.path.join(out, "stats.json"))
    fresh = args.overwrite or not previous
    if not fresh:
        if finished:
            raise UserError(f"{out} holds a finished selection (stats.json): pass --overwrite to replace it (only "
                            "select_groups.py's own outputs are removed), or choose another --output_dir")
        # compared as saved, through JSON (a tuple field would come back a list)
        old = json.load(open(cfg_path)) if os.path.exists(cfg_path) else None
        if old is not None and old != json.loads(json.dumps(config)):
            changed = sorted(k for k in set(old) | set(config) if old.get(k) != json.loads(json.dumps(config)).get(k))
            raise UserError(f"{out} holds an unfinished selection made with other settings ({', '.join(changed)} "
                            f"differ; {cfg_path}): rerun that command to finish it, pass --overwrite to replace it, "
                            "or choose another --output_dir")
        fresh = old is None  # killed before its settings were written: nothing to resume
    state.wait_for_everyone()  # every process checked before process 0 changes anything
    if state.is_main_process:
        record_outputs(out, "select_groups.py", SELECTION_OUTPUTS)
        if fresh:  # stats.json first: the folder stops being a finished selection before its shards go
            remove_outputs(out, "select_groups.py", sorted(previous, key=lambda p: p.name != "stats.json"))
        else:
            remove_outputs(out, "select_groups.py", [])  # the '.tmp-' leftovers of a crash mid-write
        os.makedirs(meta, exist_ok=True)
        if fresh:
            atomic_write(cfg_path, json.dumps(config, indent=1))
        else:
            done = len([f for f in os.listdir(meta) if f.startswith("chunk-")])
            print(f"resuming {out}: {done} finished chunk(s) will be reused")
    state.wait_for_everyone()


def stop_account(args) -> str:
    """What a stopped selection keeps, and the command that continues (common.on_stop): its finished chunks."""
    meta = os.path.join(args.output_dir, META_DIR)
    done = len([f for f in os.listdir(meta) if f.startswith("chunk-")]) if os.path.isdir(meta) else 0
    return (f"kept: {done} finished chunk(s) of groups in {args.output_dir}; the same command"
            + (" without --overwrite (which starts over)" if args.overwrite else "") + " continues from them")


def document_frequency_pass(args, state, tfidf):
    """Pass 1: document frequencies of this process's chunks, saved, then summed over processes."""
    from tqdm.auto import tqdm

    meta = os.path.join(args.output_dir, META_DIR)
    mine = os.path.join(meta, f"df-r{state.process_index}-w{state.num_processes}.npz")
    if not os.path.exists(mine):
        bar = tqdm(desc="reading (IDF pass)", unit="doc", disable=not state.is_main_process)
        for c, recs in iter_chunks(args, state.process_index, state.num_processes):
            tfidf.add_documents([d.text for d in recs if not d.skip])
            bar.update(len(recs))
        bar.close()
        with atomic_path(mine) as tmp:  # tmp ends in .npz, so numpy adds no second suffix
            np.savez_compressed(tmp, df=tfidf.df, n_docs=tfidf.n_docs)
    state.wait_for_everyone()
    tfidf.df[:] = 0
    tfidf.n_docs = 0
    for r in range(state.num_processes):
        # plain arrays: allow_pickle stays False
        z = np.load(os.path.join(meta, f"df-r{r}-w{state.num_processes}.npz"))
        tfidf.df += z["df"]
        tfidf.n_docs += int(z["n_docs"])
    return tfidf.finalize()


def calibrate_threshold(args, sel: Selection, state, encoder, tfidf, embedded=None):
    """--anchor_share s: threshold = the (1 - s) quantile of centrality over the first documents. Their chunks are
    embedded as the selection pass embeds them (embed_documents, one call per chunk: the same batches, so the same
    vectors); `embedded` ({chunk name: embed_documents' output}) keeps those of this process's chunks, which the
    selection pass then takes instead of embedding them again."""
    if sel.anchor_share is None:
        return sel.centrality_threshold, "flag --centrality_threshold"
    path = os.path.join(args.output_dir, META_DIR, "calibration.json")
    if state.is_main_process and not os.path.exists(path):
        docs, res = [], []
        for c, recs in iter_chunks(args):  # every chunk, in order, until the first calibration_docs valid ones
            valid = [d for d in recs if not d.skip]
            passages, tokens, vecs = chunk = embed_documents(valid, encoder, sel, desc="calibration",
                                                             show_progress=True)
            n = min(len(valid), sel.calibration_docs - len(docs))
            first = (passages[:n], tokens[:n], vecs[: sum(map(len, passages[:n]))])
            res += group_documents(valid[:n], *first, tfidf, 1.0, sel)
            docs += valid[:n]
            if embedded is not None and c % state.num_processes == state.process_index:
                embedded[f"{c:06d}"] = chunk
            if len(docs) == sel.calibration_docs:
                break
        # no valid record in the whole input: no passage to calibrate on; the selection then finds no group and
        # says why (the records skipped), as it does without --anchor_share
        c = np.concatenate([r.centrality for r in res]) if res else np.zeros(0)
        thr = anchor_share_threshold(c, sel.anchor_share, default=sel.centrality_threshold)
        cal = {"threshold": thr, "passages": int(len(c)), "documents": len(docs)}
        if sel.per_script_anchor_share:  # one quantile per script; "*": the corpus's, for scripts not seen here
            scripts = sorted({r.script for r in res})
            cal["threshold"] = {"*": thr, **{k: anchor_share_threshold(
                np.concatenate([r.centrality for r in res if r.script == k]), sel.anchor_share, thr) for k in scripts}}
        atomic_write(path, json.dumps(cal))
    state.wait_for_everyone()
    cal = json.load(open(path))
    source = (f"--anchor_share {sel.anchor_share}{' per script' if sel.per_script_anchor_share else ''} over "
              f"{cal['documents']} documents ({cal['passages']} passages)")
    return cal["threshold"], source


def chunk_done(args, name: str) -> bool:
    """Whether chunk `name` finished before a crash (its counters are written last; its parquet file is in place)."""
    return os.path.exists(os.path.join(args.output_dir, META_DIR, f"chunk-{name}.json"))


def finish_chunk(args, sel: Selection, name: str, recs, embedded, tfidf, threshold):
    """The CPU's half of a chunk: groups from its embedded documents (embed_documents' output), its parquet file,
    then its counters (written last: they mark the chunk finished). -> the chunk's group count."""
    counts = empty_counts()
    counts["records"] = len(recs)
    for d in recs:
        if d.skip:
            counts["skipped"][d.skip] = counts["skipped"].get(d.skip, 0) + 1
    res = group_documents([d for d in recs if not d.skip], *embedded, tfidf, threshold, sel)
    count_results(counts, res)
    rows = [g for r in res for g in r.groups]
    if rows:
        write_group_shard(os.path.join(args.output_dir, f"groups-{name}.parquet"), rows)
    atomic_write(os.path.join(args.output_dir, META_DIR, f"chunk-{name}.json"), json.dumps(counts))
    return counts["groups"]


def select_chunks(args, sel: Selection, chunks, encoder, tfidf, threshold, on_done=None, embedded=None):
    """Pass 2 over `chunks`, (name, records) pairs: each chunk's groups parquet file and counters. Three chunks at a
    time: while the encoder embeds chunk k here, one thread splits chunk k+1 into passages (split_documents, the
    tokenising) and another does the CPU's half of chunk k-1 (finish_chunk: centrality, TF-IDF, ranks, writing), so
    on a GPU the encoder waits neither for the tokenising nor for the ranking. The rows are those of one chunk after
    another. on_done(records, groups): called for each finished chunk (a progress bar). embedded: chunks the
    calibration embedded (calibrate_threshold), taken from there, not embedded again. -> groups written."""
    from concurrent.futures import ThreadPoolExecutor

    total, pending = 0, None
    splitter = copy.deepcopy(encoder.tokenizer)  # a fast tokenizer's settings are state: one copy per thread
    valid = lambda recs: [d for d in recs if not d.skip]  # noqa: E731

    def settle():
        nonlocal total
        recs, future = pending
        groups = future.result()  # the thread's error, if any, is raised here
        total += groups
        if on_done:
            on_done(recs, groups)

    with ThreadPoolExecutor(1, thread_name_prefix="split") as ahead, \
            ThreadPoolExecutor(1, thread_name_prefix="finish_chunk") as behind:
        items = iter(chunks)
        nxt = next(items, None)
        split = nxt and ahead.submit(split_documents, valid(nxt[1]), splitter, sel)
        while nxt is not None:
            (name, recs), passages = nxt, split.result()
            nxt = next(items, None)  # the next chunk's records read, and its splitting started, before the encoder
            split = nxt and ahead.submit(split_documents, valid(nxt[1]), splitter, sel)
            vectors = (embedded or {}).pop(name, None) or embed_documents(
                valid(recs), encoder, sel, desc=f"embedding chunk {name}", split=passages)
            if pending:
                settle()
            pending = recs, behind.submit(finish_chunk, args, sel, name, recs, vectors, tfidf, threshold)
        if pending:
            settle()
    return total


def selection_pass(args, sel: Selection, state, encoder, tfidf, threshold, embedded=None):
    """Pass 2: every chunk this process owns, skipping those finished before a crash; embedded: the chunks the
    calibration embedded (select_chunks)."""
    from tqdm.auto import tqdm

    rank, world = state.process_index, state.num_processes
    bar = tqdm(desc=f"selecting (process {rank})", unit="doc", disable=not state.is_main_process)

    def todo():
        for c, recs in iter_chunks(args, rank, world):
            if chunk_done(args, f"{c:06d}"):  # finished before a crash: its parquet file is already in place
                bar.update(len(recs))
            else:
                yield f"{c:06d}", recs

    def done(recs, groups):
        bar.set_postfix(groups=groups, refresh=False)
        bar.update(len(recs))

    select_chunks(args, sel, todo(), encoder, tfidf, threshold, on_done=done, embedded=embedded)
    bar.close()


def no_groups_reason(s) -> str:
    """Why a selection found no group, read off its stats.json counts, and which flag to change."""
    need = s["num_related"] + 1
    if not s["documents_valid"]:
        return (f"none of the {s['documents_read']:,} records read is a valid document (skipped: "
                f"{ {k: v for k, v in s['documents_skipped_by_reason'].items() if v} })")
    if s["documents_too_few_passages"] == s["documents_valid"]:
        return (f"each of the {s['documents_valid']:,} documents splits into fewer than {need} passages (a group is an "
                f"anchor and --num_related {s['num_related']} others): give longer documents, or lower "
                "--passage_tokens or --num_related")
    hist = s["centrality_histogram"]
    top = max((hist["bin_edges"][i + 1] for i, c in enumerate(hist["counts"]) if c), default=0.0)
    return (f"{s['documents_too_few_passages']:,} documents split into fewer than {need} passages and "
            f"{s['documents_no_anchor']:,} have no passage with centrality >= {s['centrality_threshold']:.4f} "
            f"({s['threshold_source']}; every centrality is below {top:.3f}): lower --centrality_threshold, or set "
            "--anchor_share")


def merge_stats(args, sel: Selection, threshold, source, state, wall):
    """stats.json: the chunks' counters summed, with the paper's numbers and the settings beside them."""
    meta = os.path.join(args.output_dir, META_DIR)
    files = sorted(f for f in os.listdir(meta) if f.startswith("chunk-"))
    stats = summary_stats(sum_counts(json.load(open(os.path.join(meta, f))) for f in files), threshold, source)
    stats.update({
        "paper_fineweb_100k": PAPER_FINEWEB_100K,
        "dataset": args.dataset,  # the Hub dataset read (None: local files); train.py's model card names it
        "doc_ids": doc_id_source(args),
        "text_field": args.text_field,
        "title_field": args.title_field or None,  # joined as the first line of the text (with_title)
        "fields_not_used": unused_fields(args),
        "model_name_or_path": sel.model_name_or_path,
        "passage_prefix": sel.passage_prefix,  # the prefix itself, whichever --prefixes mode gave it
        "ranking": sel.ranking,
        "num_related": sel.num_related,
        "rrf_k": sel.rrf_k,
        "rrf_weights": [sel.rrf_weight_e5, sel.rrf_weight_tfidf],
        "passage_tokens": sel.passage_tokens,
        "min_passage_tokens": sel.min_passage_tokens,
        "tfidf_terms": f"{sel.tfidf_terms}: {TFIDF_TERMS[sel.tfidf_terms]}",
        "max_groups_per_document": sel.max_groups_per_document,
        "idf": "corpus-level: document frequencies of every valid document (HashingVectorizer, smooth idf)",
        "seed": sel.seed,
        "world_size": state.num_processes,
        "executor": (f"datatrove {args.executor} executor, {args.tasks} tasks" if args.executor
                     else "select_groups.py's processes"),
        "chunks": len(files),
        "wall_seconds": round(wall, 1),
    })
    if not stats["groups"]:
        stats["no_groups_reason"] = no_groups_reason(stats)
    atomic_write(os.path.join(args.output_dir, "stats.json"), json.dumps(stats, indent=1))
    return stats


def write_inspect_report(args, sel: Selection, encoder, tfidf, threshold, source):
    """The paper's advice "check the filter on your own corpus" as one Markdown file."""
    docs = first_valid_records(args, args.inspect)
    res = select_documents(docs, encoder, tfidf, threshold, sel, desc="inspect")
    text = inspect_markdown(res, threshold=threshold, source=source, model_name=sel.model_name_or_path,
                            ranking=sel.ranking, max_chars=args.inspect_chars)
    path = os.path.join(args.output_dir, "inspect.md")
    atomic_write(path, text)
    return path


def selection_device(requested, process_device, dtype, bf16=None):
    """(device, dtype) of a process's selection encoder: --device, else the GPU accelerate gave this process (one
    per process under torchrun), else the CPU; bf16 on a GPU that has it (common.pick_device_and_dtype)."""
    on_gpu = process_device.type == "cuda"
    return pick_device_and_dtype(requested or (str(process_device) if on_gpu else None), dtype, cuda=on_gpu,
                                 bf16=bf16)


def selection_batch_size(requested, device) -> int:
    """Passages per embedding batch: --batch_size, else 512 on a GPU (FineWeb-Edu's batch for its BERT-base-size
    scorer; bench/device_check.py part 6 times 256 and 1024) and 64 on a CPU."""
    return requested or (512 if device.type == "cuda" else 64)


def load_selection_encoder(args, sel: Selection, state) -> Encoder:
    """The frozen selection encoder on this process's device, with its length limit (modeling_xprt.max_seq_length)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    device, dtype = selection_device(args.device, state.device, sel.dtype)
    path = resolve_model_path(sel.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if not tokenizer.is_fast:
        raise UserError(f"{path}: selection needs a fast tokenizer (offsets) to cut long paragraphs")
    model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=args.trust_remote_code)
    check_tokenizer_fits(tokenizer, model.config, sel.model_name_or_path)
    model = model.to(device).eval()
    post = load_post_pooling(path, model.config.hidden_size, args.trust_remote_code).to(device)
    encoder = Encoder(tokenizer, model, max_seq_length(model.config, read_max_seq_length(path), model),
                      selection_batch_size(args.batch_size, torch.device(device)),
                      read_pooling(path), post)
    vector = ", ".join([f"{encoder.pooling} pooling", *post.describe()])
    state.print(f"selection encoder {sel.model_name_or_path} on {device} ({dtype}), {state.num_processes} "
                f"process(es), passage prefix {sel.passage_prefix!r}, budget {sel.passage_tokens} tokens, "
                f"embedded up to {encoder.max_length}; vectors: {vector}, {post.dim(model.config.hidden_size)}-d")
    # A passage longer than the limit, with its prefix and special tokens, would be embedded cut: its centrality
    # and cosines would be those of its beginning. (+2: the budget counts pieces, and re-tokenising the joined
    # pieces can add a token or two.)
    prefix_tokens = len(tokenizer(sel.passage_prefix, add_special_tokens=False)["input_ids"])
    longest = sel.passage_tokens + 2 + prefix_tokens + tokenizer.num_special_tokens_to_add()
    if longest > encoder.max_length:
        state.print(f"warning: passages of up to {longest} tokens (--passage_tokens {sel.passage_tokens} with the "
                    f"prefix and special tokens) are cut to {encoder.max_length} when embedded: lower "
                    "--passage_tokens")
    return encoder


def first_documents_unknown_tokens(args, encoder: Encoder, model_name: str, n_docs: int = 200) -> list:
    """The unknown-token warning (unknown_token_warning) from the first `n_docs` documents, said before the long
    passes; stats.json and the closing log count every document."""
    tokens = []
    docs = first_valid_records(args, n_docs)
    split_passages([d.text for d in docs], encoder.tokenizer, 1 << 30, 0, tokens)  # counts only: no cutting
    total, unknown = sum(t for t, _ in tokens), sum(u for _, u in tokens)
    return [line.replace("this corpus's tokens", f"the tokens of the first {len(docs)} documents")
            for line in unknown_token_warning(_pct(unknown, total), model_name)]


def main(argv=None):
    args = parse_args(argv)
    # before anything loads
    check_model_name(args.model_name_or_path, "--model_name_or_path", args.trust_remote_code)
    sel = Selection.from_args(args)  # the one object every selecting function reads its settings from
    import torch
    from accelerate import PartialState

    t0 = time.time()
    # torchrun / accelerate launch: one process per device (gloo between CPU processes); plain python: one.
    # cpu=True is what makes accelerate see several CPU processes instead of one process each.
    state = PartialState(cpu=not torch.cuda.is_available() or (args.device or "").startswith("cpu"))
    prepare_selection_dir(args, sel, state)
    on_stop(lambda: stop_account(args))  # a stop signal's line: the chunks kept, the command that continues
    skipped = []
    for line in unread_splits(input_files(args.input, skipped), args.dataset_split):
        state.print(line)
    if skipped:  # a folder of mixed formats: what is not read is said, not silently left out
        state.print(f"--input: {len(skipped)} file(s) of a format not read ({'/'.join(INPUT_SUFFIXES)} are), skipped: "
                    f"{', '.join(skipped[:10])}{' ...' if len(skipped) > 10 else ''}")
    encoder = load_selection_encoder(args, sel, state)
    state.print(f"document ids: {doc_id_source(args)}; text: {args.text_field!r}"
                + (f"; title: {args.title_field!r}, joined as the first line where a record has one" if args.title_field
                   else "; no title (--title_field '')"))
    unused = unused_fields(args)
    if unused:
        state.print(f"input fields not used: {unused} (--id_field, --text_field, --title_field and --url_field "
                    "name the fields read)")

    analyzer = tfidf_analyzer(sel.tfidf_terms, encoder.tokenizer)
    for line in first_documents_unknown_tokens(args, encoder, sel.model_name_or_path):  # before the long passes
        state.print(line)
    tfidf = document_frequency_pass(args, state, CorpusTfidf(sel.tfidf_features, analyzer))
    embedded = {}  # each passage embedded once: the chunks the calibration embedded serve the selection
    threshold, source = calibrate_threshold(args, sel, state, encoder, tfidf, embedded)
    state.print(f"IDF over {tfidf.n_docs:,} documents; centrality threshold {threshold_text(threshold)} ({source})")

    if not args.inspect_only:
        selection_pass(args, sel, state, encoder, tfidf, threshold, embedded)
    state.wait_for_everyone()
    if state.is_main_process:
        if not args.inspect_only:
            stats = merge_stats(args, sel, threshold, source, state, time.time() - t0)
            print(format_stats(stats))
            if not stats["groups"]:
                raise UserError(f"no groups in {args.output_dir}: {stats['no_groups_reason']}")
            shards = sum(f.endswith(".parquet") for f in os.listdir(args.output_dir))
            print(f"groups: {args.output_dir} ({stats['groups']:,} rows in {shards} parquet shards)")
        if args.inspect:
            print(f"inspect report: {write_inspect_report(args, sel, encoder, tfidf, threshold, source)}")
    state.wait_for_everyone()


if __name__ == "__main__":
    run_script(main)
