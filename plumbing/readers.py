"""Reading select_groups.py's input (xPRT step 1's plumbing; no paper step owns it): JSON Lines (plain, .gz, .zst),
parquet, datasets save_to_disk folders, or a Hub dataset streamed. Every input record gets a global index and a
"file:line", so an error or a skip names it; a record becomes a Doc (its id, text and where it came from), or a
counted skip (SKIP_REASONS) with --skip_bad_lines. iter_chunks deals the documents out in chunks that never span
files, chunk c to process c % world_size.
"""

from __future__ import annotations

import collections
import glob
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from modeling_xprt import stable_doc_hash
from plumbing.common import UserError, iter_jsonl, iter_parquet

# Why an input record can be skipped (with --skip_bad_lines) or refused (without it).
SKIP_REASONS = ("invalid_utf8", "malformed_json", "not_an_object", "missing_id", "missing_text",
                "non_string_text", "empty_text", "duplicate_id", "huge_document")



class BadInput(UserError):
    """A bad input record when --skip_bad_lines is off."""


# What a folder given to --input is searched for: JSON Lines (plain, gzip, zstd; C4 ships *.json.gz) and parquet.
INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst", ".parquet")


def is_saved_dataset(path) -> bool:
    """Whether `path` is a folder written by datasets' save_to_disk (a Dataset: state.json + dataset_info.json beside
    its .arrow files; a DatasetDict: dataset_dict.json): read with datasets.load_from_disk, never as JSON Lines."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json"))))


def input_files(patterns, skipped=None):
    """The inputs of --input in order: files, and save_to_disk folders (is_saved_dataset) as one input each. A
    folder gives, sorted, every INPUT_SUFFIXES file and every saved dataset under it (a saved dataset's own .json
    files are its metadata, not records); `skipped`, a list, receives the other files of such a folder (a .csv, a
    .txt: not a format read), so that they can be named."""
    files = []
    for pat in patterns:
        found = []
        if is_saved_dataset(pat):
            found = [pat]
        elif os.path.isdir(pat):
            for root, dirs, names in os.walk(pat):
                dirs.sort()
                if is_saved_dataset(root):
                    found.append(root)
                    dirs.clear()
                    continue
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [os.path.join(root, n) for n in names if n.endswith(INPUT_SUFFIXES)
                          and not n.startswith(".")]
                if skipped is not None:
                    skipped += [os.path.join(root, n) for n in sorted(names)
                                if not n.endswith(INPUT_SUFFIXES) and not n.startswith(".")]
            found.sort()
        else:
            found = sorted(glob.glob(pat)) or ([pat] if os.path.exists(pat) else [])
        if not found and os.path.isdir(pat):  # a folder that exists but holds nothing this script reads
            others = collections.Counter(os.path.splitext(n)[1] or n for _, _, names in os.walk(pat) for n in names
                                         if not n.startswith("."))
            held = ", ".join(f"{k} {v}" for k, v in others.most_common(5)) or "nothing"
            raise UserError(f"--input {pat!r}: a folder with no {'/'.join(INPUT_SUFFIXES)} file or datasets "
                            f"save_to_disk folder under it (it holds: {held}); write the documents as JSON Lines, "
                            'one {"id": ..., "text": ...} per line')
        if not found:
            raise UserError(f"--input {pat!r}: no such file")
        files += found
    return files


def _iter_hf_dataset(name, config, split):
    import datasets

    ds = datasets.load_dataset(name, config, split=split, streaming=True)
    for i, row in enumerate(ds, 1):
        yield f"{name}:row {i}", row, None, ""


def unread_splits(files, split) -> list:
    """A line per save_to_disk DatasetDict among the inputs whose other splits are not read: the split read is
    --dataset_split's, and the others are named (from its dataset_dict.json), not left out silently."""
    notes = []
    for f in files:
        meta = os.path.join(f, "dataset_dict.json")
        if os.path.isdir(f) and os.path.isfile(meta):
            with open(meta, encoding="utf-8") as fh:
                others = [s for s in json.load(fh).get("splits", []) if s != split]
            if others:
                notes.append(f"--input {f}: a saved DatasetDict; its split {split!r} is read, not {others} "
                             "(--dataset_split picks the split)")
    return notes


def _iter_saved_dataset(path, split, columns):
    """(where, row) of a save_to_disk folder (datasets.load_from_disk, memory-mapped Arrow); a DatasetDict's `split`
    (--dataset_split); columns: the ones to read (those it lacks are left out; None: all)."""
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise BadInput(f"{path}: a saved DatasetDict without split {split!r} (it has {list(ds)}): pass "
                           "--dataset_split")
        ds = ds[split]
    if columns is not None:
        ds = ds.select_columns([c for c in columns if c in ds.column_names])
    for i, row in enumerate(ds, 1):
        yield f"{path}:row {i}", row


def _iter_local_files(patterns, columns, split="train"):
    """common.py's readers in select_groups' (where, obj, skip, detail) form: a JSONL line that is not UTF-8 JSON
    comes back as a SKIP_REASONS entry ("invalid_utf8" / "malformed_json") to count or refuse, not an error.
    columns: the fields parquet and saved datasets read (None: all); split: a saved DatasetDict's."""
    for path in input_files(patterns):
        if is_saved_dataset(path):
            for where, rec in _iter_saved_dataset(path, split, columns):
                yield where, rec, None, ""
        elif path.endswith(".parquet"):
            for where, rec in iter_parquet(path, columns):  # only the fields used: bounded memory
                yield where, rec, None, ""
        else:
            for where, rec, problem in iter_jsonl(path):
                yield (where, rec, None, "") if problem is None else (where, None, *problem)


def file_records(args, path):
    """One input file's (or save_to_disk folder's) raw records, in the form of iter_raw_records."""
    return _iter_local_files([path], record_fields(args), args.dataset_split)


class _Counted:
    """An iterator that counts what it yields (input_sources: the records a file gave under --max_docs)."""

    def __init__(self, it):
        self.it, self.n = it, 0

    def __iter__(self):
        for x in self.it:
            self.n += 1
            yield x


def input_sources(args):
    """The input as one iterator of raw records per input file (one for a Hub dataset), in order, at most
    --max_docs records in all: chunks never span two files (iter_chunks), so a datatrove task that reads whole
    files cuts the same chunks (select_groups_datatrove.py)."""
    left = args.max_docs if args.max_docs > 0 else None
    if args.dataset:
        opens = [lambda: _iter_hf_dataset(args.dataset, args.dataset_config, args.dataset_split)]
    else:
        opens = [lambda path=path: file_records(args, path) for path in input_files(args.input)]
    for open_source in opens:
        if left == 0:
            return
        source = _Counted(itertools.islice(open_source(), left))
        yield source
        if left is not None:
            left -= source.n


def iter_raw_records(args):
    """Yield (where, obj, skip, detail): the decoded record and skip None, or obj None and a SKIP_REASONS entry
    for a record that could not be decoded. (A line that decodes to a JSON string or number is a record of the
    wrong type, not a reader's failure: it is yielded, and parse_record skips it as not_an_object.)

    At most --max_docs records (blank lines are not records) when it is positive.
    """
    return itertools.chain.from_iterable(input_sources(args))


def record_fields(args) -> list:
    """The fields a record is read for: id, text, title (when --title_field names one) and url (--inspect)."""
    return [f for f in (args.id_field, args.text_field, args.title_field, args.url_field) if f]


def unused_fields(args) -> list:
    """The fields of the input's first record that no flag reads (said in the log and stats.json, so a column left
    out, such as a title under --title_field '', is left out knowingly)."""
    if args.dataset:
        raw = _iter_hf_dataset(args.dataset, args.dataset_config, args.dataset_split)
    else:
        raw = _iter_local_files(args.input, None, args.dataset_split)
    first = next((obj for _, obj, skip, _ in itertools.islice(raw, 100) if not skip and isinstance(obj, dict)), {})
    return [k for k in first if k not in record_fields(args)]


@dataclass
class Doc:
    index: int  # global record index (0-based) over all input records, good or bad
    where: str
    doc_id: str = ""
    text: str = ""
    url: str = ""
    skip: str = ""  # a SKIP_REASONS entry when the record is bad
    detail: str = ""


def row_number_ids(args) -> bool:
    """Whether document ids are row numbers: --id_field '' asks for it, and a corpus whose first record (the first
    that decodes to an object) has no --id_field field gets it (text-only corpora). Decided once, from the input's
    first record, so every record and every process get the same rule; a later record without an id in a corpus
    that has ids is still a missing_id."""
    if "_row_number_ids" not in vars(args):
        first = next((obj for _, obj, skip, _ in iter_raw_records(args) if not skip and isinstance(obj, dict)), None)
        args._row_number_ids = args.id_field == "" or (first is not None and args.id_field not in first)
    return args._row_number_ids


def doc_id_source(args) -> str:
    """How documents got their ids, for stats.json and the log."""
    if row_number_ids(args):
        return ("row number: the record's 0-based index over the whole input, in the order read (the input has no "
                f"{args.id_field!r} field)" if args.id_field else "row number (--id_field '')")
    return f"the {args.id_field!r} field"


def parse_record(index, where, obj, *, id_field, text_field, url_field, max_doc_chars, title_field=""):
    """One decoded input record -> a Doc with doc_id/text/url, or with .skip and .detail set. id_field None: the
    id is the record's index (row_number_ids). A non-empty title (title_field) becomes the text's first line, unless
    the text already starts with it (with_title).

    The duplicate-id check needs the records before this one: iter_records does it.
    """
    d = Doc(index=index, where=where)
    if not isinstance(obj, dict):
        d.skip, d.detail = "not_an_object", f"a JSON {type(obj).__name__}, not an object"
        return d
    doc_id, text = (obj.get(id_field) if id_field is not None else index), obj.get(text_field)
    if doc_id is None or not isinstance(doc_id, (str, int)) or str(doc_id) == "":
        d.skip, d.detail = "missing_id", f"no usable {id_field!r} field (--id_field)"
    elif text is None:
        d.skip, d.detail = "missing_text", f"no {text_field!r} field (--text_field)"
    elif not isinstance(text, str):
        d.skip, d.detail = "non_string_text", f"{text_field!r} is a {type(text).__name__}"
    elif not text.strip():
        d.skip, d.detail = "empty_text", "text is empty or whitespace"
    elif len(text) > max_doc_chars:
        d.skip, d.detail = "huge_document", f"{len(text):,} chars > --max_doc_chars {max_doc_chars:,}"
    else:
        d.doc_id, d.text = str(doc_id), with_title(obj.get(title_field) if title_field else None, text)
        try:  # JSON escapes can smuggle lone surrogates in, which no tokenizer or parquet file accepts
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            d.skip, d.detail = "invalid_utf8", str(err)
        url = obj.get(url_field)
        d.url = url if isinstance(url, str) else ""
    return d


def with_title(title, text: str) -> str:
    """'title\ntext': the title as the document's first line (a paragraph of its own to split_passages, packed with
    what follows when it fits), as E5 and BEIR read a titled document; the text alone when there is no title or the
    text's first line is the title (WikiExtractor output that kept its title line). A text whose first sentence
    begins with the title's words ("Anarchism is a ...") still gets it."""
    if not isinstance(title, str) or not title.strip() or text.lstrip().split("\n", 1)[0].strip() == title.strip():
        return text
    return f"{title.strip()}\n{text}"


def iter_records(args, raw=None, start=0, seen=None, dropped=frozenset()):
    """Every input record, validated: a Doc with doc_id/text, or with .skip set.

    Every process reads ALL records (cheap next to embedding) so that record indices, chunk
    boundaries and duplicate-id checks are the same whatever the number of processes. Duplicates
    are found with a set of 64-bit id hashes: the only state that grows with the corpus (~100 bytes
    per document).

    A datatrove task (select_groups_datatrove.py) reads only its own files: raw, one file's records; start, the global
    index of its first record; seen, the task's id hashes so far; dropped, the record numbers within raw that the
    merge found to repeat an id of an earlier file of another task (the first occurrence is kept, as here).
    """
    seen = set() if seen is None else seen
    id_field = None if row_number_ids(args) else args.id_field
    for i, (where, obj, skip, detail) in enumerate(iter_raw_records(args) if raw is None else raw):
        if skip:  # the reader could not decode the record (a SKIP_REASONS entry)
            d = Doc(index=start + i, where=where, skip=skip, detail=detail)
        else:
            d = parse_record(start + i, where, obj, id_field=id_field, text_field=args.text_field,
                             title_field=args.title_field, url_field=args.url_field, max_doc_chars=args.max_doc_chars)
        if not d.skip:
            h = stable_doc_hash(d.doc_id)
            if h in seen or i in dropped:
                d.skip, d.detail = "duplicate_id", f"id {d.doc_id!r} was already seen"
            seen.add(h)
        if d.skip and not args.skip_bad_lines:
            raise BadInput(f"{d.where}: {d.skip}: {d.detail}. "
                           "Fix the input, or pass --skip_bad_lines to count and skip such records.")
        yield d


def iter_chunks(args, rank=0, world=1):
    """Yield (chunk_id, records) for the chunks this process owns: chunk c -> process c % world. A chunk is up to
    --chunk_docs consecutive records of one input file, never of two: a chunk's passages are embedded together
    (their batches, and so the last bits of their vectors, depend on the chunk), and a datatrove task that reads
    whole files (select_groups_datatrove.py) cuts the same chunks, so it writes the same rows."""
    seen, start, c = set(), 0, 0
    for source in input_sources(args):
        buf = []
        for d in iter_records(args, source, start=start, seen=seen):
            buf.append(d)
            if len(buf) == args.chunk_docs:
                if c % world == rank:
                    yield c, buf
                buf, c = [], c + 1
        if buf:
            if c % world == rank:
                yield c, buf
            c += 1
        start += source.n


def first_valid_records(args, n):
    """The first `n` valid records (fewer if the input has fewer)."""
    docs = []
    for d in iter_records(args):
        if not d.skip:
            docs.append(d)
        if len(docs) == n:
            break
    return docs


# ==============================================================================================================
# The BEIR layout (finetune.py's and evaluate.py's folders): corpus.jsonl, queries.jsonl, qrels/<split>.tsv
# ==============================================================================================================


def read_beir_jsonl(path, what: str) -> dict:
    """{id: record} of a BEIR corpus.jsonl / queries.jsonl: every record a JSON object with a string or integer
    "_id" (BEIR's field; a file keyed otherwise is refused, naming the field it has), each id once."""
    out, first_line = {}, {}
    for where, record, problem in iter_jsonl(path):
        if problem:
            raise UserError(f"{where}: not valid JSON ({problem[0]}: {problem[1]})")
        if not isinstance(record, dict) or "_id" not in record:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise UserError(f"{where}: a BEIR {what} record needs an \"_id\" field; found {fields}")
        rid = str(record["_id"])
        if rid in out:
            raise UserError(f"{where}: {what} id {rid!r} appears twice (first at line {first_line[rid]}): a BEIR "
                            "folder holds each id once")
        out[rid], first_line[rid] = record, where.rsplit(":", 1)[1]
    if not out:
        raise UserError(f"{path}: no {what} records")
    return out


def read_qrels(path) -> dict:
    """{query id: {corpus id: score}} of a BEIR qrels TSV (query-id, corpus-id, score; a header line is skipped when
    its score field is not an integer) or a TREC qrels file (query-id, iteration, corpus-id, score), tab- or
    space-separated; a UTF-8 byte-order mark is dropped. A line that fits neither, a judgement given twice, or a file
    with no judgement is refused, naming the file and line."""
    qrels: dict[str, dict[str, int]] = {}
    seen: dict[tuple, int] = {}
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t") if "\t" in line else line.split()
            parts = [p.strip() for p in parts]
            if not any(parts):
                continue
            if line_no == 1 and not parts[-1].lstrip("-").isdigit():
                continue  # the "query-id corpus-id score" header
            if len(parts) == 4:  # TREC: qid iteration docid score
                parts = [parts[0], parts[2], parts[3]]
            if len(parts) != 3 or not parts[2].lstrip("-").isdigit():
                raise UserError(f"{path}:{line_no}: expected query-id, corpus-id, integer score (BEIR) or query-id, "
                                f"iteration, corpus-id, score (TREC); found {line.strip()[:80]!r}")
            qid, did, score = parts[0], parts[1], int(parts[2])
            if (qid, did) in seen:
                raise UserError(f"{path}:{line_no}: query {qid!r} x document {did!r} judged twice (first at line "
                                f"{seen[qid, did]})")
            seen[qid, did] = line_no
            qrels.setdefault(qid, {})[did] = score
    if not qrels:
        raise UserError(f"{path}: no judgements (an empty qrels file)")
    return qrels


def load_beir(folder, split: str = "test") -> dict:
    """A BEIR-layout folder -> {"corpus": {id: (title, text)}, "queries": {id: text}, "qrels": {qid: {did: score}}}.

    The one BEIR reader: evaluate.py scores its test split, finetune.py trains on its train split; its files are read
    by read_beir_jsonl and read_qrels (BOM, header, TREC qrels, the id field, duplicates, empty files). Only the
    queries judged in qrels/<split>.tsv are kept (SciFact's queries.jsonl holds the 809 train claims and the 300
    test ones), and only those with at least one relevant (score > 0) document. qrels ids missing from the corpus
    or the queries are counted, warned about and dropped (MTEB's ArguAna has 5); a judged query with an empty
    text is an error, because a blank query scores as noise.
    """
    import warnings

    folder = Path(folder)
    for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv"):
        if not (folder / name).is_file():
            raise UserError(f"{folder}: BEIR layout needs {name} (corpus.jsonl, queries.jsonl, "
                            f"qrels/{split}.tsv)")
    corpus = {i: (r.get("title") or "", r.get("text") or "")
              for i, r in read_beir_jsonl(folder / "corpus.jsonl", "corpus").items()}
    all_queries = {i: r.get("text") or "" for i, r in read_beir_jsonl(folder / "queries.jsonl", "query").items()}
    qrels = read_qrels(folder / "qrels" / f"{split}.tsv")
    missing_docs = [(q, d) for q, ds in qrels.items() for d in ds if d not in corpus]
    if missing_docs:
        warnings.warn(f"{folder}: {len(missing_docs)} qrels lines point to documents absent from corpus.jsonl "
                      f"(e.g. {missing_docs[0][1]!r}); they are dropped")
        for q, d in missing_docs:
            del qrels[q][d]
    missing_q = [q for q in qrels if q not in all_queries]
    if missing_q:
        warnings.warn(f"{folder}: {len(missing_q)} judged query ids are absent from queries.jsonl "
                      f"(e.g. {missing_q[0]!r}); they are dropped")
    qrels = {q: ds for q, ds in qrels.items() if q in all_queries and any(s > 0 for s in ds.values())}
    if not qrels:
        raise UserError(f"{folder}: qrels/{split}.tsv judges no query of queries.jsonl relevant to a document of "
                        "corpus.jsonl")
    queries = {q: all_queries[q] for q in qrels}
    empty = [q for q, t in queries.items() if not t.strip()]
    if empty:
        raise UserError(f"{folder}: {len(empty)} judged queries have an empty text (e.g. id {empty[0]!r})")
    return {"corpus": corpus, "queries": queries, "qrels": qrels}
