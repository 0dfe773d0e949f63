"""
xPRT step 1: pick the training groups once, before training (paper: "How anchors and related
passages are chosen"). Read it beside ../shared/papers/xprt.md.

For every document:
  1. split it into passages (paragraph-aware packing under a token budget; the paper gives no rule,
     ours is in `split_passages` and the README),
  2. embed every passage with a frozen selection encoder (E5 in the paper; mean pooling, L2 norm),
  3. centrality = cos(passage, mean of the document's passages); anchors: centrality >= 0.825,
  4. for each anchor rank the other passages of the SAME document by RRF of the E5-cosine rank
     (weight 2) and the TF-IDF rank (weight 1), k = 10, and keep the top 4 as its related passages.
One group = (anchor, 4 related passages) = one parquet row (schema in INTERFACE.md / `GROUP_SCHEMA`).

Scale: documents are streamed in chunks of --chunk_docs input records; chunk c goes to process
c % world_size (torchrun / accelerate launch), is written as its own parquet file, and a finished
chunk is reused when the same command is rerun after a crash. The TF-IDF IDF is corpus-level: a
cheap first pass counts document frequencies with a HashingVectorizer (bounded memory), summed over
processes. Every chunk's result depends only on its own documents, the corpus IDF and the seed, so
1 process and N processes write the same groups.

    python select_groups.py --input data/docs.jsonl --model_name_or_path all-MiniLM-L6-v2 --output_dir runs/groups
    torchrun --standalone --nproc_per_node 8 select_groups.py --dataset HuggingFaceFW/fineweb \
        --dataset_config sample-10BT --max_docs 100000 --output_dir runs/groups-fw100k
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import html
import json
import math
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

# The paper's statistics on 100K FineWeb documents with E5-base-unsupervised (printed beside ours).
PAPER_FINEWEB_100K = {"documents_with_groups_pct": 99.0, "groups_per_document": 7.0, "passages_covered_pct": 68.0}
# Why an input record can be skipped (with --skip_bad_lines) or refused (without it).
SKIP_REASONS = ("invalid_utf8", "malformed_json", "not_an_object", "missing_id", "missing_text",
                "non_string_text", "empty_text", "duplicate_id", "huge_document")
HIST_BINS = 40  # centrality histogram over [0, 1] in stats.json: lets a user see the anchor share at any threshold
META_DIR = ".xprt"  # run config, document frequencies, chunk stats; hidden so load_dataset(out) ignores it


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="*", default=[], help="Local .jsonl / .jsonl.gz / .parquet files, folders or globs, read in the order given.")
    g.add_argument("--dataset", default=None, help="A Hugging Face dataset name, streamed (e.g. HuggingFaceFW/fineweb). Every process streams it (twice: IDF pass, then selection).")
    g.add_argument("--dataset_config", default=None, help="Config of --dataset (e.g. sample-10BT).")
    g.add_argument("--dataset_split", default="train", help="Split of --dataset.")
    g.add_argument("--max_docs", type=int, default=0, help="Read at most this many input records (0 = all).")
    g.add_argument("--id_field", default="id", help="Field holding the document id.")
    g.add_argument("--text_field", default="text", help="Field holding the document text.")
    g.add_argument("--url_field", default="url", help="Optional field shown in the --inspect report only.")
    g.add_argument("--skip_bad_lines", action="store_true", help="Count and skip bad records (per reason in stats.json) instead of stopping with file:line.")
    g.add_argument("--max_doc_chars", type=int, default=1_000_000, help="A longer document is a bad record ('huge_document'): one page should not hold millions of characters.")
    g = p.add_argument_group("passages and embedding")
    g.add_argument("--model_name_or_path", default="intfloat/e5-base-unsupervised", help="Selection encoder (paper: E5-base-unsupervised). 'all-MiniLM-L6-v2' uses the bundled offline weights.")
    g.add_argument("--passage_prefix", default=None, help="Prefix put before every passage when embedding. Default: 'passage: ' when the model name contains 'e5' (E5 convention), else ''.")
    g.add_argument("--passage_tokens", type=int, default=128, help="Token budget of one passage (tokenizer of the selection encoder, without special tokens).")
    g.add_argument("--min_passage_tokens", type=int, default=16, help="A shorter packed passage is merged into a neighbour when that stays within the budget.")
    g.add_argument("--batch_size", type=int, default=64, help="Passages per embedding batch (batches are sorted by length).")
    g.add_argument("--device", default=None, help="cpu / cuda / cuda:1 (default: this process's GPU if any, else CPU).")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="auto: bf16 (fp16 before Ampere) on GPU, fp32 on CPU.")
    g.add_argument("--trust_remote_code", action="store_true", help="Allow model code from the hub (off: only built-in architectures).")
    g = p.add_argument_group("selection (paper: threshold 0.825, RRF k = 10 with weights 2 / 1, 4 related)")
    g.add_argument("--centrality_threshold", type=float, default=0.825, help="Anchors have centrality >= this (tuned for E5 on FineWeb).")
    g.add_argument("--anchor_share", type=float, default=None, help="Instead of a fixed threshold: set it so this share of passages are anchors, from the centralities of the first --calibration_docs documents (e.g. 0.6 for another encoder or corpus).")
    g.add_argument("--calibration_docs", type=int, default=1000, help="Documents used by --anchor_share.")
    g.add_argument("--num_related", type=int, default=4, help="Related passages per anchor (a document needs num_related + 1 passages to form a group).")
    g.add_argument("--ranking", default="rrf", choices=["rrf", "e5", "tfidf", "random"], help="How related passages are ranked (paper Table 3 ablations).")
    g.add_argument("--rrf_k", type=float, default=10.0, help="RRF constant k (fixed by the paper's worked example).")
    g.add_argument("--rrf_weight_e5", type=float, default=2.0, help="Weight of the embedding-cosine rank in RRF.")
    g.add_argument("--rrf_weight_tfidf", type=float, default=1.0, help="Weight of the TF-IDF rank in RRF.")
    g.add_argument("--tfidf_features", type=int, default=2**20, help="Hashing space of the TF-IDF vectorizer.")
    g.add_argument("--seed", type=int, default=0, help="Seeds random_passage and --ranking random, per document (same under any sharding).")
    g = p.add_argument_group("output")
    g.add_argument("--output_dir", required=True, help="Folder of parquet shards + stats.json (load_dataset(output_dir)).")
    g.add_argument("--overwrite", action="store_true", help="Replace an existing output folder (otherwise a finished one is refused; an unfinished one with the same settings is resumed).")
    g.add_argument("--chunk_docs", type=int, default=1000, help="Input records per chunk (one parquet file each); bounds memory and the work lost to a crash.")
    g.add_argument("--inspect", type=int, default=0, help="Also write inspect.md: every passage of the first N documents with centrality, anchors, excluded passages and related scores.")
    g.add_argument("--inspect_only", action="store_true", help="Write only the --inspect report (IDF pass + N documents), no groups: check the filter before a long run.")
    g.add_argument("--inspect_chars", type=int, default=400, help="Characters of each passage shown in the report.")
    args = p.parse_args(argv)

    # Sanity checks, early and with the fix in the message.
    if bool(args.input) == bool(args.dataset):
        p.error("give exactly one of --input (local files) or --dataset (a Hugging Face dataset)")
    if args.passage_tokens < 8 or args.min_passage_tokens < 0 or args.min_passage_tokens >= args.passage_tokens:
        p.error("need --passage_tokens >= 8 and 0 <= --min_passage_tokens < --passage_tokens")
    if args.num_related < 1:
        p.error("--num_related must be >= 1")
    if args.anchor_share is not None and not 0.0 < args.anchor_share <= 1.0:
        p.error("--anchor_share must be in (0, 1]")
    if args.inspect_only and args.inspect < 1:
        p.error("--inspect_only needs --inspect N with N >= 1")
    if args.chunk_docs < 1 or args.rrf_k <= 0:
        p.error("--chunk_docs must be >= 1 and --rrf_k > 0")
    if args.passage_prefix is None:
        args.passage_prefix = "passage: " if "e5" in args.model_name_or_path.lower() else ""
    return args


# ----------------------------------------------------------------------------------------------
# 1. Reading: every input record gets a global index and a "file:line" so errors can name it.
# ----------------------------------------------------------------------------------------------

class BadInput(ValueError):
    """A bad input record when --skip_bad_lines is off."""


def input_files(patterns):
    files = []
    for pat in patterns:
        if os.path.isdir(pat):
            found = sorted(f for ext in ("*.jsonl", "*.jsonl.gz", "*.json", "*.parquet") for f in glob.glob(os.path.join(pat, "**", ext), recursive=True))
        else:
            found = sorted(glob.glob(pat)) or ([pat] if os.path.exists(pat) else [])
        if not found:
            raise FileNotFoundError(f"--input {pat!r}: no such file (or no .jsonl/.jsonl.gz/.parquet in that folder)")
        files += found
    return files


def iter_raw_records(args):
    """Yield (where, obj_or_reason, detail): a dict, or a SKIP_REASONS string for unreadable records."""
    n = 0
    if args.dataset:
        import datasets
        ds = datasets.load_dataset(args.dataset, args.dataset_config, split=args.dataset_split, streaming=True)
        for i, row in enumerate(ds, 1):
            yield f"{args.dataset}:row {i}", row, ""
            n += 1
            if n == args.max_docs:
                return
        return
    for path in input_files(args.input):
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq
            pf = pq.ParquetFile(path)
            cols = [c for c in (args.id_field, args.text_field, args.url_field) if c in pf.schema_arrow.names]
            row = 0
            for batch in pf.iter_batches(batch_size=1024, columns=cols):  # bounded memory
                for rec in batch.to_pylist():
                    row += 1
                    yield f"{path}:row {row}", rec, ""
                    n += 1
                    if n == args.max_docs:
                        return
            continue
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as fh:  # bytes: we decode ourselves to catch invalid UTF-8 per line
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue  # blank lines are not documents
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    yield where, "invalid_utf8", str(err)
                else:
                    try:
                        yield where, json.loads(line), ""
                    except json.JSONDecodeError as err:
                        yield where, "malformed_json", str(err)
                n += 1
                if n == args.max_docs:
                    return


@dataclass
class Doc:
    index: int  # global record index (0-based) over all input records, good or bad
    where: str
    doc_id: str = ""
    text: str = ""
    url: str = ""
    skip: str = ""  # a SKIP_REASONS entry when the record is bad
    detail: str = ""


def iter_records(args):
    """Every input record, validated: a Doc with doc_id/text, or with .skip set.

    Every process reads ALL records (cheap next to embedding) so that record indices, chunk
    boundaries and duplicate-id checks are the same whatever the number of processes. Duplicates
    are found with a set of 64-bit id hashes: the only state that grows with the corpus (~100 bytes
    per document).
    """
    seen = set()
    for i, (where, obj, detail) in enumerate(iter_raw_records(args)):
        d = Doc(index=i, where=where)
        if isinstance(obj, str):
            d.skip, d.detail = obj, detail
        elif not isinstance(obj, dict):
            d.skip, d.detail = "not_an_object", f"a JSON {type(obj).__name__}, not an object"
        elif obj.get(args.id_field) is None or not isinstance(obj[args.id_field], (str, int)) or str(obj[args.id_field]) == "":
            d.skip, d.detail = "missing_id", f"no usable {args.id_field!r} field (--id_field)"
        elif args.text_field not in obj or obj[args.text_field] is None:
            d.skip, d.detail = "missing_text", f"no {args.text_field!r} field (--text_field)"
        elif not isinstance(obj[args.text_field], str):
            d.skip, d.detail = "non_string_text", f"{args.text_field!r} is a {type(obj[args.text_field]).__name__}"
        elif not obj[args.text_field].strip():
            d.skip, d.detail = "empty_text", "text is empty or whitespace"
        elif len(obj[args.text_field]) > args.max_doc_chars:
            d.skip, d.detail = "huge_document", f"{len(obj[args.text_field]):,} chars > --max_doc_chars {args.max_doc_chars:,}"
        else:
            d.doc_id, d.text = str(obj[args.id_field]), obj[args.text_field]
            try:  # JSON escapes can smuggle lone surrogates in, which no tokenizer or parquet file accepts
                d.text.encode("utf-8")
            except UnicodeEncodeError as err:
                d.skip, d.detail = "invalid_utf8", str(err)
            url = obj.get(args.url_field)
            d.url = url if isinstance(url, str) else ""
        if not d.skip:
            h = int.from_bytes(hashlib.blake2b(d.doc_id.encode("utf-8"), digest_size=8).digest(), "little")
            if h in seen:
                d.skip, d.detail = "duplicate_id", f"id {d.doc_id!r} was already seen"
            seen.add(h)
        if d.skip and not args.skip_bad_lines:
            raise BadInput(f"{d.where}: {d.skip}: {d.detail}. Fix the input, or pass --skip_bad_lines to count and skip such records.")
        yield d


def iter_chunks(args, rank=0, world=1):
    """Yield (chunk_id, records) for the chunks this process owns: chunk c -> process c % world."""
    buf, c = [], 0
    for d in iter_records(args):
        buf.append(d)
        if len(buf) == args.chunk_docs:
            if c % world == rank:
                yield c, buf
            buf, c = [], c + 1
    if buf and c % world == rank:
        yield c, buf


# ----------------------------------------------------------------------------------------------
# 2. Passages: paragraph-aware packing under a token budget (our rule; the paper gives none).
# ----------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_passages(texts, tokenizer, max_tokens=128, min_tokens=16):
    """Documents -> lists of passages, each at most `max_tokens` tokens of `tokenizer` (no specials).

    Rule: paragraphs are the non-empty lines (whitespace collapsed). A paragraph over the budget is
    cut at sentence ends, and a sentence over the budget at token boundaries. Consecutive pieces
    are packed greedily into a passage while it fits; a piece that does not fit starts a new one,
    so a paragraph is split only when it alone exceeds the budget. A passage under `min_tokens`
    (a lone heading, a "Share this" line) is merged into the shorter neighbour it fits into;
    otherwise it stays. Pieces of one paragraph are joined by a space, paragraphs by a newline.
    """
    paras = [[" ".join(line.split()) for line in t.split("\n")] for t in texts]
    paras = [[p for p in ps if p] for ps in paras]
    flat = [p for ps in paras for p in ps]
    # One batched call for the whole chunk: the fast tokenizer runs in Rust, in parallel.
    lengths = [len(x) for x in tokenizer(flat, add_special_tokens=False, verbose=False)["input_ids"]] if flat else []
    out, pos = [], 0
    for ps in paras:
        pieces = []  # (text, tokens, paragraph number)
        for j, para in enumerate(ps):
            n = lengths[pos]
            pos += 1
            if n <= max_tokens:
                pieces.append((para, n, j))
            else:
                pieces += [(s, k, j) for s, k in _cut_long(para, tokenizer, max_tokens)]
        out.append(_pack(pieces, max_tokens, min_tokens))
    return out


def _cut_long(para, tokenizer, max_tokens):
    """A paragraph over the budget -> sentences, and over-long sentences -> token windows."""
    sents = [s for s in _SENTENCE_END.split(para) if s]
    res = []
    for s, n in zip(sents, (len(x) for x in tokenizer(sents, add_special_tokens=False, verbose=False)["input_ids"])):
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


def _pack(pieces, max_tokens, min_tokens):
    packs = []  # each: [list of (text, paragraph), tokens]
    for text, n, para in pieces:
        if packs and packs[-1][1] + n <= max_tokens:
            packs[-1][0].append((text, para))
            packs[-1][1] += n
        else:
            packs.append([[(text, para)], n])
    i = 0
    while i < len(packs) and len(packs) > 1:  # merge short fragments into a neighbour that has room
        parts, n = packs[i]
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

    def join(parts):
        s = parts[0][0]
        for (t, para), (_, prev) in zip(parts[1:], parts[:-1]):
            s += (" " if para == prev else "\n") + t
        return s

    return [join(parts) for parts, _ in packs]


# ----------------------------------------------------------------------------------------------
# 3. Centrality and RRF: one function per formula of the paper.
# ----------------------------------------------------------------------------------------------

def centrality(vectors):
    """centrality_i = cos(e_i, mean_j e_j) over the document's L2-normalised passage vectors.

    Paper: body-text passages score high; off-topic blocks (music-video links, press contacts)
    0.46-0.51; anchors are those >= 0.825 (tuned for E5 on FineWeb). (P, H) -> (P,).
    """
    v = np.asarray(vectors, dtype=np.float64)
    m = v.mean(axis=0)
    return v @ m / max(np.linalg.norm(m), 1e-12) / np.maximum(np.linalg.norm(v, axis=1), 1e-12)


def ranks_descending(scores):
    """1-based ranks, best (highest) first; ties share the best rank ('min'), e.g. all zero TF-IDF."""
    from scipy.stats import rankdata
    return rankdata(-np.asarray(scores, dtype=np.float64), method="min").astype(np.int64)


def rrf_score(rank_e5, rank_tfidf, k=10.0, w_e5=2.0, w_tfidf=1.0):
    """RRF = w_e5 / (k + rank_E5) + w_tfidf / (k + rank_TFIDF), ranks 1-based.

    Paper: the E5 rank weighted twice the TF-IDF rank; its worked example fixes k = 10:
    A (1st by E5, 6th by TF-IDF) = 2/11 + 1/16 = 0.2443 < B (2nd on both) = 3/12 = 0.2500.
    """
    return w_e5 / (k + np.asarray(rank_e5, dtype=np.float64)) + w_tfidf / (k + np.asarray(rank_tfidf, dtype=np.float64))


def rank_related(anchor, cos_row, tfidf_row, args, rng=None):
    """Order the document's other passages for `anchor`; return (indices, cos, tfidf, rrf) of the top num_related.

    --ranking rrf (paper), e5 (cosine only: -2.3 points in Table 3), tfidf (level with rrf), random.
    Ties are broken by cosine, then by passage order, so the result is deterministic.
    """
    cand = np.array([j for j in range(len(cos_row)) if j != anchor])
    cs, ts = np.asarray(cos_row)[cand], np.asarray(tfidf_row)[cand]
    rrf = rrf_score(ranks_descending(cs), ranks_descending(ts), args.rrf_k, args.rrf_weight_e5, args.rrf_weight_tfidf)
    if args.ranking == "random":
        order = rng.permutation(len(cand))
    else:
        primary = {"rrf": rrf, "e5": cs, "tfidf": ts}[args.ranking]
        order = np.lexsort((np.arange(len(cand)), -cs, -primary))  # last key is the primary one
    top = order[: args.num_related]
    return cand[top], cs[top], ts[top], rrf[top]


def derived_rng(seed, doc_id, salt):
    """A generator seeded by (seed, doc_id, salt): the same in any process, whatever the sharding."""
    digest = hashlib.sha256(f"{seed}\x00{doc_id}\x00{salt}".encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


# ----------------------------------------------------------------------------------------------
# 4. Corpus-level TF-IDF: IDF from document frequencies over the whole corpus, streamed.
# ----------------------------------------------------------------------------------------------

class CorpusTfidf:
    """scikit-learn's TF-IDF with the IDF fitted on the corpus, not per document, in bounded memory.

    A HashingVectorizer needs no vocabulary, so document frequencies are one fixed-size vector that
    processes add up. idf = ln((1 + n) / (1 + df)) + 1 (TfidfTransformer's smooth_idf), counted over
    documents (a word in every page, like "privacy", weighs little). Passage vectors: raw counts x idf,
    L2-normalised, so the dot product of two passages is their TF-IDF cosine.
    """

    def __init__(self, n_features=2**20):
        from sklearn.feature_extraction.text import HashingVectorizer
        self.vec = HashingVectorizer(n_features=n_features, alternate_sign=False, norm=None)
        self.df = np.zeros(n_features, dtype=np.int64)
        self.n_docs = 0
        self.idf = None

    def add_documents(self, texts):
        if not texts:  # a chunk of bad records only
            return
        x = self.vec.transform(texts)
        x.data[:] = 1  # presence, not counts
        self.df += np.asarray(x.sum(axis=0)).ravel().astype(np.int64)
        self.n_docs += len(texts)

    def finalize(self):
        self.idf = np.log((1.0 + self.n_docs) / (1.0 + self.df)) + 1.0
        return self

    def transform(self, passages):
        from sklearn.preprocessing import normalize
        x = self.vec.transform(passages).astype(np.float64)
        return normalize(x.multiply(self.idf).tocsr(), norm="l2")


# ----------------------------------------------------------------------------------------------
# 5. Selection of one batch of documents.
# ----------------------------------------------------------------------------------------------

@dataclass
class DocResult:
    doc: Doc
    passages: list
    centrality: np.ndarray = None
    groups: list = field(default_factory=list)
    status: str = ""  # "groups", "too_few_passages", "no_anchor"


def select_documents(docs, tokenizer, model, tfidf, threshold, args, desc="embedding", show_progress=False):
    """Passages, centralities and groups of `docs` (valid Docs). Returns one DocResult per doc."""
    from modeling_xprt import embed_texts

    passages = split_passages([d.text for d in docs], tokenizer, args.passage_tokens, args.min_passage_tokens)
    flat = [p for ps in passages for p in ps]
    # One embedding call per chunk: length sorting works across documents, so batches stay full.
    vecs = embed_texts(model, tokenizer, flat, batch_size=args.batch_size, max_length=512,
                       prefix=args.passage_prefix, show_progress=show_progress, desc=desc).numpy()
    results, pos = [], 0
    for d, ps in zip(docs, passages):
        v = vecs[pos : pos + len(ps)].astype(np.float64)  # (P, H)
        pos += len(ps)
        r = DocResult(d, ps, centrality(v) if len(ps) else np.zeros(0))
        results.append(r)
        if len(ps) < args.num_related + 1:
            r.status = "too_few_passages"
            continue
        anchors = np.flatnonzero(r.centrality >= threshold)
        if len(anchors) == 0:
            r.status = "no_anchor"
            continue
        r.status = "groups"
        cos = v @ v.T  # (P, P) cosines: vectors are unit length
        t = tfidf.transform(ps)
        tf = (t @ t.T).toarray()  # (P, P) TF-IDF cosines
        rank_rng, pick_rng = derived_rng(args.seed, d.doc_id, "ranking"), derived_rng(args.seed, d.doc_id, "random_passage")
        for gi, a in enumerate(anchors):
            idx, cs, ts, rrf = rank_related(a, cos[a], tf[a], args, rank_rng)
            j = int(pick_rng.integers(len(ps) - 1))  # uniform over the passages other than the anchor
            j += j >= a
            r.groups.append({
                "doc_id": d.doc_id, "group_index": gi, "anchor_index": int(a), "anchor": ps[a],
                "anchor_centrality": float(r.centrality[a]),
                "related": [ps[i] for i in idx], "related_index": [int(i) for i in idx],
                "related_cosine": [float(x) for x in cs], "related_tfidf": [float(x) for x in ts],
                "related_rrf": [float(x) for x in rrf], "random_passage": ps[j], "num_passages": len(ps),
            })
    return results


def group_schema():
    import pyarrow as pa
    return pa.schema([
        ("doc_id", pa.string()), ("group_index", pa.int32()), ("anchor_index", pa.int32()), ("anchor", pa.string()),
        ("anchor_centrality", pa.float32()), ("related", pa.list_(pa.string())), ("related_index", pa.list_(pa.int32())),
        ("related_cosine", pa.list_(pa.float32())), ("related_tfidf", pa.list_(pa.float32())),
        ("related_rrf", pa.list_(pa.float32())), ("random_passage", pa.string()), ("num_passages", pa.int32()),
    ])


def empty_counts():
    return {"records": 0, "valid": 0, "skipped": {}, "with_groups": 0, "too_few_passages": 0, "no_anchor": 0,
            "groups": 0, "passages": 0, "covered": 0, "anchors": 0, "above_threshold": 0, "centrality_hist": [0] * HIST_BINS}


def count_results(counts, results, threshold):
    for r in results:
        counts["above_threshold"] += int((r.centrality >= threshold).sum())
        counts["valid"] += 1
        counts["passages"] += len(r.passages)
        counts[{"groups": "with_groups", "too_few_passages": "too_few_passages", "no_anchor": "no_anchor"}[r.status]] += 1
        counts["groups"] += len(r.groups)
        counts["anchors"] += len(r.groups)
        covered = {g["anchor_index"] for g in r.groups} | {i for g in r.groups for i in g["related_index"]}
        counts["covered"] += len(covered)
        h = np.histogram(np.clip(r.centrality, 0, 1), bins=HIST_BINS, range=(0, 1))[0]
        counts["centrality_hist"] = [a + int(b) for a, b in zip(counts["centrality_hist"], h)]


# ----------------------------------------------------------------------------------------------
# 6. Output: atomic files, run config for resume, merged stats, the inspect report.
# ----------------------------------------------------------------------------------------------

def atomic_write_text(path, text):
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{os.path.basename(path)}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def atomic_write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{os.path.basename(path)}")
    pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), tmp)
    os.replace(tmp, path)


def run_config(args):
    """Everything the groups depend on: a rerun resumes only when this is identical."""
    keys = ("input", "dataset", "dataset_config", "dataset_split", "max_docs", "id_field", "text_field", "skip_bad_lines",
            "max_doc_chars", "model_name_or_path", "passage_prefix", "passage_tokens", "min_passage_tokens",
            "centrality_threshold", "anchor_share", "calibration_docs", "num_related", "ranking", "rrf_k",
            "rrf_weight_e5", "rrf_weight_tfidf", "tfidf_features", "seed", "chunk_docs", "dtype")
    return {k: getattr(args, k) for k in keys}


def prepare_output_dir(args, state):
    """Refuse a finished output unless --overwrite; resume an unfinished one made with the same settings."""
    out, meta = args.output_dir, os.path.join(args.output_dir, META_DIR)
    cfg_path = os.path.join(meta, "run_config.json")
    finished = os.path.exists(os.path.join(out, "stats.json"))
    fresh = args.overwrite or not os.path.exists(out) or not os.listdir(out)
    if not fresh:
        if finished:
            raise FileExistsError(f"{out} holds a finished run (stats.json): pass --overwrite to replace it, or choose another --output_dir")
        old = json.load(open(cfg_path)) if os.path.exists(cfg_path) else None
        if old != run_config(args):
            raise FileExistsError(f"{out} exists and was not made by this exact command (see {cfg_path}): pass --overwrite or another --output_dir")
    state.wait_for_everyone()  # every process checked before process 0 changes anything
    if state.is_main_process:
        if fresh and os.path.exists(out):
            shutil.rmtree(out)
        os.makedirs(meta, exist_ok=True)
        for f in os.listdir(out) + [os.path.join(META_DIR, f) for f in os.listdir(meta)]:
            if os.path.basename(f).startswith(".tmp-"):
                os.remove(os.path.join(out, f))  # leftovers of a crash mid-write
        if fresh:
            atomic_write_text(cfg_path, json.dumps(run_config(args), indent=1))
        else:
            done = len([f for f in os.listdir(meta) if f.startswith("chunk-")])
            print(f"resuming {out}: {done} finished chunk(s) will be reused")
    state.wait_for_everyone()


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
        tmp = os.path.join(meta, f".tmp-df-{state.process_index}.npz")
        np.savez_compressed(tmp, df=tfidf.df, n_docs=tfidf.n_docs)
        os.replace(tmp, mine)
    state.wait_for_everyone()
    tfidf.df[:] = 0
    tfidf.n_docs = 0
    for r in range(state.num_processes):
        z = np.load(os.path.join(meta, f"df-r{r}-w{state.num_processes}.npz"))  # plain arrays: allow_pickle stays False
        tfidf.df += z["df"]
        tfidf.n_docs += int(z["n_docs"])
    return tfidf.finalize()


def calibrate_threshold(args, state, tokenizer, model, tfidf):
    """--anchor_share s: threshold = the (1 - s) quantile of centrality over the first documents."""
    if args.anchor_share is None:
        return args.centrality_threshold, "flag --centrality_threshold"
    path = os.path.join(args.output_dir, META_DIR, "calibration.json")
    if state.is_main_process and not os.path.exists(path):
        docs = []
        for d in iter_records(args):
            if not d.skip:
                docs.append(d)
            if len(docs) == args.calibration_docs:
                break
        res = select_documents(docs, tokenizer, model, tfidf, 1.0, args, desc="calibration", show_progress=True)
        c = np.concatenate([r.centrality for r in res])
        thr = float(np.quantile(c, 1.0 - args.anchor_share)) if len(c) else args.centrality_threshold
        atomic_write_text(path, json.dumps({"threshold": thr, "passages": int(len(c)), "documents": len(docs)}))
    state.wait_for_everyone()
    cal = json.load(open(path))
    return cal["threshold"], f"--anchor_share {args.anchor_share} over {cal['documents']} documents ({cal['passages']} passages)"


def merge_stats(args, threshold, source, state, wall):
    meta = os.path.join(args.output_dir, META_DIR)
    total = empty_counts()
    files = sorted(f for f in os.listdir(meta) if f.startswith("chunk-"))
    for f in files:
        c = json.load(open(os.path.join(meta, f)))
        for k, v in c.items():
            if k == "skipped":
                for r, n in v.items():
                    total["skipped"][r] = total["skipped"].get(r, 0) + n
            elif k == "centrality_hist":
                total[k] = [a + b for a, b in zip(total[k], v)]
            elif k in total:
                total[k] += v
    skipped = sum(total["skipped"].values())
    if total["records"] != total["valid"] + skipped:  # every input record is accounted for
        raise RuntimeError(f"accounting error: {total['records']} records != {total['valid']} valid + {skipped} skipped")
    pct = lambda a, b: round(100.0 * a / b, 2) if b else 0.0
    div = lambda a, b: round(a / b, 3) if b else 0.0
    hist = np.array(total["centrality_hist"])
    edges = np.linspace(0, 1, HIST_BINS + 1)
    stats = {
        "documents_read": total["records"], "documents_valid": total["valid"],
        "documents_skipped": skipped, "documents_skipped_by_reason": {r: total["skipped"].get(r, 0) for r in SKIP_REASONS},
        "documents_with_groups": total["with_groups"], "documents_with_groups_pct": pct(total["with_groups"], total["valid"]),
        "documents_too_few_passages": total["too_few_passages"], "documents_no_anchor": total["no_anchor"],
        "groups": total["groups"], "groups_per_document": div(total["groups"], total["valid"]),
        "groups_per_document_with_groups": div(total["groups"], total["with_groups"]),
        "passages": total["passages"], "passages_per_document": div(total["passages"], total["valid"]),
        "passages_covered": total["covered"], "passages_covered_pct": pct(total["covered"], total["passages"]),
        "anchor_share_pct": pct(total["anchors"], total["passages"]),
        # passages with centrality >= threshold, including those of documents too short to form a group
        "passages_above_threshold_pct": pct(total["above_threshold"], total["passages"]),
        "centrality_threshold": threshold, "threshold_source": source,
        # share of passages that WOULD be anchors at other thresholds (from the histogram; bin width 0.025)
        "anchor_share_pct_at_threshold": {f"{t:.3f}": pct(int(hist[edges[:-1] >= t - 1e-9].sum()), total["passages"])
                                          for t in (0.5, 0.6, 0.7, 0.75, 0.8, 0.825, 0.85, 0.9)},
        "centrality_histogram": {"bin_edges": [round(e, 3) for e in edges], "counts": total["centrality_hist"]},
        "paper_fineweb_100k": PAPER_FINEWEB_100K,
        "model_name_or_path": args.model_name_or_path, "passage_prefix": args.passage_prefix, "ranking": args.ranking,
        "num_related": args.num_related, "rrf_k": args.rrf_k, "rrf_weights": [args.rrf_weight_e5, args.rrf_weight_tfidf],
        "passage_tokens": args.passage_tokens, "min_passage_tokens": args.min_passage_tokens,
        "idf": "corpus-level: document frequencies of every valid document (HashingVectorizer, smooth idf)",
        "seed": args.seed, "world_size": state.num_processes, "chunks": len(files), "wall_seconds": round(wall, 1),
    }
    atomic_write_text(os.path.join(args.output_dir, "stats.json"), json.dumps(stats, indent=1))
    return stats


def format_stats(s):
    p = s["paper_fineweb_100k"]
    lines = [
        f"documents read {s['documents_read']:,}: valid {s['documents_valid']:,}, skipped {s['documents_skipped']:,} "
        f"{ {k: v for k, v in s['documents_skipped_by_reason'].items() if v} or ''}",
        f"centrality threshold {s['centrality_threshold']:.4f} ({s['threshold_source']}); anchors {s['anchor_share_pct']}% of passages",
        f"{'':34s}{'this run':>12s}{'paper (FineWeb-100K, E5)':>28s}",
        f"{'documents with >= 1 group':34s}{s['documents_with_groups_pct']:>11.1f}%{p['documents_with_groups_pct']:>27.0f}%",
        f"{'groups per document':34s}{s['groups_per_document']:>12.2f}{p['groups_per_document']:>28.1f}",
        f"{'passages covered by a group':34s}{s['passages_covered_pct']:>11.1f}%{p['passages_covered_pct']:>27.0f}%",
        f"{'passages per document':34s}{s['passages_per_document']:>12.2f}{'(not given)':>28s}",
        f"no group: {s['documents_too_few_passages']:,} docs with < {s['num_related'] + 1} passages, {s['documents_no_anchor']:,} with no anchor",
    ]
    return "\n".join(lines)


def write_inspect_report(args, tokenizer, model, tfidf, threshold, source):
    """The paper's advice "check the filter on your own corpus" as one Markdown file."""
    docs = []
    for d in iter_records(args):
        if not d.skip:
            docs.append(d)
        if len(docs) == args.inspect:
            break
    res = select_documents(docs, tokenizer, model, tfidf, threshold, args, desc="inspect")
    clip = lambda s: html.escape(" ".join(s.split()))[: args.inspect_chars] + ("…" if len(s) > args.inspect_chars else "")
    n_p = sum(len(r.passages) for r in res)
    n_a = sum(len(r.groups) for r in res)
    out = [f"# Group selection report: {len(res)} documents", "",
           f"Encoder `{args.model_name_or_path}`, ranking `{args.ranking}`, centrality threshold **{threshold:.4f}** ({source}). "
           f"{n_p} passages, {n_a} anchors ({100 * n_a / max(n_p, 1):.1f}%). Roles: **ANCHOR** (centrality >= threshold), "
           "*related* (in some anchor's top related), ~~excluded~~ (in no group). Look for navigation, footers and "
           "boilerplate among the excluded and body text among the anchors.", ""]
    for k, r in enumerate(res):
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
            rel = ", ".join(f"{i} (cos {c:.3f}, tfidf {t:.3f}, rrf {s:.4f})" for i, c, t, s in
                            zip(g["related_index"], g["related_cosine"], g["related_tfidf"], g["related_rrf"]))
            out.append(f"- anchor {g['anchor_index']} -> {rel}")
        out.append("")
    path = os.path.join(args.output_dir, "inspect.md")
    atomic_write_text(path, "\n".join(out))
    return path


def main(argv=None):
    args = parse_args(argv)
    import torch
    from accelerate import PartialState
    from tqdm.auto import tqdm
    from transformers import AutoModel, AutoTokenizer

    from modeling_xprt import pick_device_and_dtype, resolve_model_path

    t0 = time.time()
    # torchrun / accelerate launch: one process per device (gloo between CPU processes); plain python: one.
    # cpu=True is what makes accelerate see several CPU processes instead of one process each.
    state = PartialState(cpu=not torch.cuda.is_available() or (args.device or "").startswith("cpu"))
    rank, world = state.process_index, state.num_processes
    prepare_output_dir(args, state)

    device = args.device or (str(state.device) if state.device.type == "cuda" else None)
    device, dtype = pick_device_and_dtype(device, args.dtype)
    path = resolve_model_path(args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if not tokenizer.is_fast:
        raise ValueError(f"{path}: selection needs a fast tokenizer (offsets) to cut long paragraphs")
    model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=args.trust_remote_code).to(device).eval()
    state.print(f"selection encoder {args.model_name_or_path} on {device} ({dtype}), {world} process(es), "
                f"passage prefix {args.passage_prefix!r}, budget {args.passage_tokens} tokens")

    tfidf = document_frequency_pass(args, state, CorpusTfidf(args.tfidf_features))
    threshold, source = calibrate_threshold(args, state, tokenizer, model, tfidf)
    state.print(f"IDF over {tfidf.n_docs:,} documents; centrality threshold {threshold:.4f} ({source})")

    meta = os.path.join(args.output_dir, META_DIR)
    if not args.inspect_only:
        bar = tqdm(desc=f"selecting (process {rank})", unit="doc", disable=not state.is_main_process)
        for c, recs in iter_chunks(args, rank, world):
            done = os.path.join(meta, f"chunk-{c:06d}.json")
            if os.path.exists(done):  # finished before a crash: its parquet file is already in place
                bar.update(len(recs))
                continue
            counts = empty_counts()
            counts["records"] = len(recs)
            for d in recs:
                if d.skip:
                    counts["skipped"][d.skip] = counts["skipped"].get(d.skip, 0) + 1
            res = select_documents([d for d in recs if not d.skip], tokenizer, model, tfidf, threshold, args,
                                   desc=f"embedding chunk {c}", show_progress=False)
            count_results(counts, res, threshold)
            rows = [g for r in res for g in r.groups]
            if rows:
                atomic_write_parquet(os.path.join(args.output_dir, f"groups-{c:06d}.parquet"), rows)
            atomic_write_text(done, json.dumps(counts))  # written last: marks the chunk finished
            bar.update(len(recs))
            bar.set_postfix(groups=sum(len(r.groups) for r in res))
        bar.close()
    state.wait_for_everyone()
    if state.is_main_process:
        if not args.inspect_only:
            stats = merge_stats(args, threshold, source, state, time.time() - t0)
            print(format_stats(stats))
            print(f"groups: {args.output_dir} ({stats['groups']:,} rows in {sum(f.endswith('.parquet') for f in os.listdir(args.output_dir))} parquet shards)")
        if args.inspect:
            print(f"inspect report: {write_inspect_report(args, tokenizer, model, tfidf, threshold, source)}")
    state.wait_for_everyone()


if __name__ == "__main__":
    try:
        main()
    except (BadInput, FileExistsError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
