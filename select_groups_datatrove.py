"""
xPRT step 1 at web scale: select_groups.py's passes as datatrove stages, on datatrove's local, Slurm or Ray executor.

    python select_groups_datatrove.py --input corpus/ --output_dir runs/groups --executor local --tasks 8
    python select_groups_datatrove.py --input corpus/ --output_dir runs/groups --executor local --tasks 8 --workers 2
    python select_groups_datatrove.py --input /shared/fineweb/ --output_dir /shared/groups --executor slurm \\
        --tasks 512 --executor_option partition=gpu --executor_option time=04:00:00 --executor_option cpus_per_task=8

An entry point of its own: it takes every select_groups.py flag (select_groups.build_parser, checked by
select_groups.check_args) and the executor's (--executor, required; --tasks, --workers, --gpus_per_task,
--executor_option, --dry_run). Not --dataset (download it and give its files as --input) nor --max_docs (cut the
input): its tasks deal whole --input files.

The same passes as select_groups.py's own command, in four stages, each a datatrove executor that depends on the one
before (as FineWeb's MinHash chains its stages), each reading the files the stage before wrote:

  1. frequencies (--tasks tasks): task t reads every --tasks-th input file from file t (datatrove's readers deal
     files the same way) and counts its documents' terms (CorpusTfidf.add_documents), its files' records, and the
     64-bit hashes of its document ids;
  2. merge (1 task): sums the counts into the corpus IDF, gives each file the global index of its first record, and
     finds ids that repeat across tasks (the first occurrence in input order is kept, as the one-process reader
     keeps it; the later ones' terms are taken back out of the counts); --anchor_share is calibrated here;
  3. select (--tasks tasks): task t reads the same files and runs select_groups.select_chunks on its chunks (up to
     --chunk_docs records of one file, numbered as the one-process command numbers them), on the task's GPU where
     it has one: groups-<chunk>.parquet and the chunk's counters;
  4. finish (1 task): stats.json and the --inspect report, as select_groups.py writes them.

Every per-document function is select_groups.py's own (iter_records, split_passages, embed_passages, centrality,
document_groups, ...): a group depends only on its document, the corpus IDF, the threshold and the seed, so this
writes the same rows as the one-process command (tests/test_selection_stages.py checks it for 1 and 3 tasks and 2
workers). A rerun skips the tasks datatrove marked completed (and, inside an unfinished selection task, its finished
chunks); a changed --tasks or changed flags are refused (select_groups.prepare_selection_dir). Memory is flat in the
corpus size except for what select_groups.py's reader also keeps: one 8-byte hash per document id of a task (the
duplicate check), and the merge's duplicate list; the merge reads the tasks' sorted hashes in slices.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import time
from array import array
from dataclasses import dataclass

import numpy as np

import select_groups as sg
from modeling_xprt import stable_doc_hash
from plumbing.common import (UserError, atomic_path, atomic_write, check_model_name, non_negative_int, on_stop,
                             positive_int, run_script)
from plumbing.readers import (INPUT_SUFFIXES, BadInput, file_records, input_files, iter_records, row_number_ids,
                              unread_splits)

STAGES_DIR = os.path.join(sg.META_DIR, "datatrove")  # every file of the stages, and datatrove's logs and markers
STAGES = ("frequencies", "merge", "select", "finish")
FILE_BITS = 40  # a record's position: (file index << FILE_BITS) | its number in the file (up to 10^12 records a file)
HASHES_PER_SLICE = 4_000_000  # the merge sorts this many id hashes at a time (64 MB): flat in the corpus size


@dataclass
class TaskState:
    """What select_groups.py's passes read of accelerate's PartialState, for one datatrove task: the task is one
    process of its own (num_processes is the stage's task count, for stats.json)."""

    device: object
    num_processes: int = 1
    process_index: int = 0
    is_main_process: bool = True

    def print(self, *args):
        print(*args, flush=True)

    def wait_for_everyone(self):
        pass


def task_device(rank: int, cuda_devices: int):
    """The device a task embeds on: GPU rank % cuda_devices where the task sees GPUs (under Slurm or Ray with
    --gpus_per_task each task sees its own, cuda_devices 1; the local executor's tasks share the machine's), else
    the CPU."""
    import torch

    return torch.device(f"cuda:{rank % cuda_devices}" if cuda_devices else "cpu")


def stage_path(args, *name) -> str:
    return os.path.join(args.output_dir, STAGES_DIR, *name)


def position(file_index: int, record: int) -> int:
    return (file_index << FILE_BITS) | record


def task_file_indices(n_files: int, rank: int, tasks: int) -> range:
    """The input files of task `rank`: every `tasks`-th from file `rank` (datatrove's readers deal files so)."""
    return range(rank, n_files, tasks)


def read_files(args) -> list:
    return json.load(open(stage_path(args, "files.json")))


def tfidf_of(args, sel: sg.Selection, tokenizer=None) -> sg.CorpusTfidf:
    """An empty CorpusTfidf with the run's terms (the encoder's tokenizer only for --tfidf_terms encoder)."""
    if sel.tfidf_terms == "encoder" and tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(sg.resolve_model_path(sel.model_name_or_path),
                                                  trust_remote_code=args.trust_remote_code)
    return sg.CorpusTfidf(sel.tfidf_features, sg.tfidf_analyzer(sel.tfidf_terms, tokenizer))


def merged_tfidf(args, sel: sg.Selection, tokenizer=None) -> sg.CorpusTfidf:
    """The corpus IDF the merge wrote."""
    tfidf = tfidf_of(args, sel, tokenizer)
    z = np.load(stage_path(args, "merged-df.npz"))  # plain arrays: allow_pickle stays False
    tfidf.df[:], tfidf.n_docs = z["df"], int(z["n_docs"])
    return tfidf.finalize()


def merged_threshold(args):
    t = json.load(open(stage_path(args, "threshold.json")))
    return t["threshold"], t["source"]


try:  # a stage is a datatrove PipelineStep; without datatrove the module still imports (the one-process command)
    from datatrove.pipeline.base import PipelineStep
except ImportError:  # pragma: no cover
    PipelineStep = object


class SelectionStage(PipelineStep):
    """A stage of the selection: datatrove calls run(data, rank, world_size) once per task. It reads and writes
    files only (nothing flows between stages in memory), so every stage can run on another machine."""

    type = "xprt select_groups"

    def __init__(self, args, sel: sg.Selection):
        super().__init__()
        self.args, self.sel = args, sel

    def __repr__(self):
        return f"{self.type}: {self.name}"


class CountFrequencies(SelectionStage):
    """Stage 1, one task per share of the files: document frequencies (select_groups.document_frequency_pass's
    counts), the records of each file, and the sorted (id hash, position) of its documents."""

    name = "1. frequencies: terms, records and id hashes of the task's files"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        args, sel = self.args, self.sel
        files = read_files(args)
        # 8 bytes each (array, not a list of ints): what grows with the task's share of the corpus, with `seen`
        tfidf, seen, hashes, positions, records = tfidf_of(args, sel), set(), array("q"), array("q"), {}
        ids = not row_number_ids(args)  # row-number ids are unique by construction
        for fi in task_file_indices(len(files), rank, world_size):
            texts, n = [], 0
            # start: the record's position as its index, so that row-number ids (unused here) stay unique
            for d in iter_records(args, file_records(args, files[fi]), start=position(fi, 0), seen=seen):
                n += 1
                if d.skip:
                    continue
                texts.append(d.text)
                if ids:
                    hashes.append(stable_doc_hash(d.doc_id))
                    positions.append(d.index)
                if len(texts) == args.chunk_docs:  # bounded memory, as the one-process pass
                    tfidf.add_documents(texts)
                    texts = []
            tfidf.add_documents(texts)
            records[fi] = n
        order = np.lexsort((np.asarray(positions, np.int64), np.asarray(hashes, np.int64)))
        with atomic_path(stage_path(args, f"ids-t{rank:05d}.npy")) as tmp:
            np.save(tmp, np.stack([np.asarray(hashes, np.int64)[order], np.asarray(positions, np.int64)[order]]))
        with atomic_path(stage_path(args, f"df-t{rank:05d}.npz")) as tmp:
            np.savez_compressed(tmp, df=tfidf.df, n_docs=tfidf.n_docs)
        atomic_write(stage_path(args, f"records-t{rank:05d}.json"), json.dumps(records))
        print(f"frequencies task {rank}/{world_size}: {sum(records.values()):,} records of {len(records)} file(s), "
              f"{tfidf.n_docs:,} documents", flush=True)


def repeated_ids(args, tasks: int) -> np.ndarray:
    """(2, D) int64: the position of every document whose id an earlier document (in input order) of another task
    already has, and that earlier document's position. The tasks' sorted hashes are read memory-mapped, one slice
    of the hash range at a time, so memory does not grow with the corpus (only with the repeats found)."""
    parts = [np.load(stage_path(args, f"ids-t{r:05d}.npy"), mmap_mode="r") for r in range(tasks)]
    total = sum(p.shape[1] for p in parts)
    slices = max(1, -(-total // HASHES_PER_SLICE))
    edges = np.linspace(np.iinfo(np.int64).min, np.iinfo(np.int64).max, slices + 1, dtype=np.float64)
    later, first = [], []
    lo = [0] * tasks
    for s in range(slices):
        chunks = []
        for r, p in enumerate(parts):  # the slice [edge s, edge s+1) of every task's sorted hashes
            hi = p.shape[1] if s == slices - 1 else int(np.searchsorted(p[0], int(edges[s + 1]), side="left"))
            chunks.append(np.asarray(p[:, lo[r]:hi]))
            lo[r] = hi
        h, pos = np.concatenate(chunks, axis=1) if chunks else np.zeros((2, 0), np.int64)
        order = np.lexsort((pos, h))
        h, pos = h[order], pos[order]
        if not len(h):
            continue
        # a hash's first entry (the smallest position) is the one kept; each later one repeats it
        starts = np.r_[True, h[1:] != h[:-1]]
        first_pos = pos[np.maximum.accumulate(np.where(starts, np.arange(len(h)), 0))]
        later.append(pos[~starts])
        first.append(first_pos[~starts])
    if not later:
        return np.zeros((2, 0), np.int64)
    return np.stack([np.concatenate(later), np.concatenate(first)])


def record_at(args, files, pos: int):
    """(where, doc_id) of the record at position `pos` (for a message naming both places of a repeated id)."""
    fi, i = pos >> FILE_BITS, pos & ((1 << FILE_BITS) - 1)
    for k, d in enumerate(iter_records(args, file_records(args, files[fi]))):
        if k == i:
            return d.where, d.doc_id
    raise RuntimeError(f"{files[fi]}: record {i} not found")  # the file changed under the run


class MergeFrequencies(SelectionStage):
    """Stage 2, one task: the corpus IDF, the files' global record offsets, the repeated ids across tasks (their
    terms taken back out), and the centrality threshold (--anchor_share: calibrated, as select_groups.py does)."""

    name = "2. merge: corpus IDF, record offsets, ids repeated across tasks, threshold"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        args, sel = self.args, self.sel
        files, tasks = read_files(args), args.tasks
        tfidf, records = tfidf_of(args, sel), {}
        for r in range(tasks):  # one task's counts at a time: memory flat in the task count
            z = np.load(stage_path(args, f"df-t{r:05d}.npz"))
            tfidf.df += z["df"]
            tfidf.n_docs += int(z["n_docs"])
            records.update({int(k): v for k, v in json.load(open(stage_path(args, f"records-t{r:05d}.json"))).items()})
        # each file's first record's global index, and its first chunk's number (a chunk is up to --chunk_docs
        # records of one file: readers.iter_chunks), so that rows and shard names are the one-process ones
        counts = [records[fi] for fi in range(len(files))]
        chunks = [-(-n // args.chunk_docs) for n in counts]  # ceil: a file's last chunk may be short
        offsets = {"records_before": np.concatenate([[0], np.cumsum(counts)]).tolist(),
                   "chunks_before": np.concatenate([[0], np.cumsum(chunks)]).tolist()}
        repeats = repeated_ids(args, tasks)
        if repeats.shape[1] and not args.skip_bad_lines:
            k = int(np.argmin(repeats[0]))  # the first repeat in input order, as the one-process reader stops there
            where, doc_id = record_at(args, files, int(repeats[0, k]))
            first, _ = record_at(args, files, int(repeats[1, k]))
            raise BadInput(f"{where}: duplicate_id: id {doc_id!r} was already seen at {first}. Fix the input, or "
                           "pass --skip_bad_lines to count and skip such records.")
        dropped = np.sort(repeats[0])
        for fi in np.unique(dropped >> FILE_BITS):  # the repeats' terms were counted by their tasks: take them out
            mine = set((dropped[(dropped >> FILE_BITS) == fi] & ((1 << FILE_BITS) - 1)).tolist())
            texts = [d.text for d in iter_records(args, file_records(args, files[int(fi)]))
                     if d.index in mine and not d.skip]
            tfidf.add_documents(texts, sign=-1)
        with atomic_path(stage_path(args, "merged-df.npz")) as tmp:
            np.savez_compressed(tmp, df=tfidf.df, n_docs=tfidf.n_docs)
        with atomic_path(stage_path(args, "repeated-ids.npy")) as tmp:
            np.save(tmp, dropped)
        atomic_write(stage_path(args, "offsets.json"), json.dumps(offsets))
        encoder = None
        if sel.anchor_share is not None:
            import torch

            encoder = sg.load_selection_encoder(args, sel, TaskState(task_device(0, torch.cuda.device_count())))
        threshold, source = sg.calibrate_threshold(args, sel, TaskState(None), encoder, tfidf.finalize())
        atomic_write(stage_path(args, "threshold.json"), json.dumps({"threshold": threshold, "source": source}))
        print(f"merge: IDF over {tfidf.n_docs:,} documents of {offsets['records_before'][-1]:,} records in "
              f"{len(files)} file(s), "
              f"{len(dropped):,} ids repeated across tasks; centrality threshold {sg.threshold_text(threshold)} "
              f"({source})", flush=True)


class SelectChunks(SelectionStage):
    """Stage 3, one task per share of the files (the same share as stage 1): select_groups.select_chunks on chunks
    of --chunk_docs of the task's records, each chunk a groups parquet file and its counters."""

    name = "3. select: passages, embeddings, centrality, anchors, RRF-ranked related passages"

    def chunks(self, rank: int, world_size: int):
        """(chunk number, records) of the task's files: chunks of up to --chunk_docs records of one file, numbered
        as readers.iter_chunks numbers them."""
        args = self.args
        files, offsets = read_files(args), json.load(open(stage_path(args, "offsets.json")))
        repeats = np.load(stage_path(args, "repeated-ids.npy"))
        seen = set()
        for fi in task_file_indices(len(files), rank, world_size):
            mine = repeats[(repeats >> FILE_BITS) == fi] & ((1 << FILE_BITS) - 1)
            buf, c = [], offsets["chunks_before"][fi]
            for d in iter_records(args, file_records(args, files[fi]), start=offsets["records_before"][fi],
                                  seen=seen, dropped=frozenset(mine.tolist())):
                buf.append(d)
                if len(buf) == args.chunk_docs:
                    yield c, buf
                    buf, c = [], c + 1
            if buf:
                yield c, buf

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        import torch

        args, sel = self.args, self.sel
        threshold, _ = merged_threshold(args)
        done = [0, 0]  # chunks finished before a kill, chunks selected now

        def left():  # streamed: one chunk's records at a time
            for c, recs in self.chunks(rank, world_size):
                finished = sg.chunk_done(args, f"{c:06d}")
                done[0 if finished else 1] += 1
                if not finished:
                    yield f"{c:06d}", recs

        chunks = left()
        first = next(chunks, None)
        groups = 0
        if first is not None:  # the encoder loaded only for a chunk left to do
            encoder = sg.load_selection_encoder(args, sel, TaskState(task_device(rank, torch.cuda.device_count())))
            groups = sg.select_chunks(args, sel, itertools.chain([first], chunks), encoder,
                                      merged_tfidf(args, sel, encoder.tokenizer), threshold)
        print(f"select task {rank}/{world_size}: {done[1]} chunk(s) selected ({groups:,} groups), {done[0]} finished "
              "before", flush=True)


class Finish(SelectionStage):
    """Stage 4, one task: stats.json over every chunk, and the --inspect report (select_groups.py's own)."""

    name = "4. finish: stats.json and the inspect report"

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        import torch

        args, sel = self.args, self.sel
        threshold, source = merged_threshold(args)
        state = TaskState(None, num_processes=args.tasks)
        if not args.inspect_only:
            stats = sg.merge_stats(args, sel, threshold, source, state, time.time() - args.launched_at)
            print(sg.format_stats(stats), flush=True)
            if not stats["groups"]:
                raise UserError(f"no groups in {args.output_dir}: {stats['no_groups_reason']}")
            shards = sum(f.endswith(".parquet") for f in os.listdir(args.output_dir))
            print(f"groups: {args.output_dir} ({stats['groups']:,} rows in {shards} parquet shards)", flush=True)
        if args.inspect:
            encoder = sg.load_selection_encoder(args, sel, TaskState(task_device(0, torch.cuda.device_count())))
            tfidf = merged_tfidf(args, sel, encoder.tokenizer)
            path = sg.write_inspect_report(args, sel, encoder, tfidf, threshold, source)
            print(f"inspect report: {path}", flush=True)


def executor_options(pairs) -> dict:
    """--executor_option KEY=VALUE pairs -> keyword arguments (a value is read as JSON where it is JSON)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--executor_option {pair!r}: give KEY=VALUE (e.g. partition=gpu)")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def build_executors(args, sel: sg.Selection) -> list:
    """The four stages as datatrove executors of --executor, each depending on the one before: [frequencies,
    merge, select, finish]. --tasks for stages 1 and 3, one task for the merges; --gpus_per_task (slurm / ray;
    default 1) for the stages that embed; --executor_option passed to every stage."""
    from datatrove.executor import LocalPipelineExecutor, RayPipelineExecutor, SlurmPipelineExecutor

    cls = {"local": LocalPipelineExecutor, "slurm": SlurmPipelineExecutor, "ray": RayPipelineExecutor}[args.executor]
    options = executor_options(args.executor_option)
    gpus = args.gpus_per_task if args.gpus_per_task is not None else 1
    embeds = {"frequencies": False, "merge": sel.anchor_share is not None, "select": True,
              "finish": bool(args.inspect)}
    steps = {"frequencies": CountFrequencies, "merge": MergeFrequencies, "select": SelectChunks, "finish": Finish}
    executors, previous = [], None
    for name in STAGES:
        many = name in ("frequencies", "select")
        kwargs = {"pipeline": [steps[name](args, sel)], "tasks": args.tasks if many else 1,
                  "workers": args.workers if many else 1, "logging_dir": stage_path(args, "logs", name),
                  "depends": previous, **options}
        if args.executor != "local":  # the local executor's tasks share the machine's GPUs (task_device)
            kwargs["gpus_per_task"] = gpus if embeds[name] else 0
        if args.executor == "slurm":
            kwargs.setdefault("job_name", f"xprt-select-{name}")
        try:
            previous = cls(**kwargs)
        except TypeError as err:  # a required option missing (slurm: partition, time) or one the executor lacks
            raise UserError(f"--executor {args.executor}: {err} (pass the executor's options as --executor_option "
                            "KEY=VALUE)") from None
        executors.append(previous)
    return executors


def describe(executors) -> str:
    """The built stages, one paragraph each: the pipeline, tasks, dependency and resources."""
    lines = []
    for name, ex in zip(STAGES, executors):
        dep = STAGES[executors.index(ex.depends)] if ex.depends is not None else "none"
        res = {k: getattr(ex, k) for k in ("workers", "gpus_per_task", "cpus_per_task", "mem_per_cpu_gb", "partition",
                                           "time", "job_name") if hasattr(ex, k)}
        lines.append(f"stage {name}: {type(ex).__name__}, {ex.world_size} task(s), depends on {dep}")
        lines.append(f"  pipeline: {[repr(step) for step in ex.pipeline]}")
        lines.append(f"  resources: {res}")
        lines.append(f"  logs and completion markers: {ex.logging_dir.path}")
    return "\n".join(lines)


def stop_account(args) -> str:
    """What a stop keeps, and the command that continues (common.on_stop): each stage's tasks that datatrove marked
    completed (a rerun skips them), and the selection's finished chunks (a rerun reuses them)."""
    done = []
    for name in STAGES:
        marks = stage_path(args, "logs", name, "completions")
        done.append(f"{name} {len(os.listdir(marks)) if os.path.isdir(marks) else 0}")
    return f"kept: the stages' finished tasks ({', '.join(done)}) and {sg.stop_account(args)[len('kept: '):]}"


def run(args, sel: sg.Selection):
    """The command's work (main): check and claim the output folder (as the one-process command does), fix the
    input file list, build the stages and run (local) or submit (slurm, ray) the last, which runs its dependencies
    first."""
    skipped = []
    files = input_files(args.input, skipped)
    if not files:
        raise UserError(f"--input {' '.join(args.input)}: no input file found ({'/'.join(INPUT_SUFFIXES)})")
    if skipped:
        print(f"--input: {len(skipped)} file(s) of a format not read, skipped: {', '.join(skipped[:10])}"
              f"{' ...' if len(skipped) > 10 else ''}")
    for line in unread_splits(files, args.dataset_split):
        print(line)
    if args.tasks > len(files):
        print(f"warning: --tasks {args.tasks} > {len(files)} input file(s): tasks deal whole files, so "
              f"{args.tasks - len(files)} task(s) have none")
    row_number_ids(args)  # decided once here, from the input's first record, and carried to every task
    args.launched_at = time.time()
    executors = build_executors(args, sel)
    if args.dry_run:
        print(describe(executors))
        return
    # what the executor needs from this machine, before the output folder is touched
    if args.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise UserError("--executor ray: the ray package is not installed here (pip install ray); the stages run on "
                        "the cluster ray.init() connects to")
    if args.executor == "slurm" and shutil.which("sbatch") is None:
        raise UserError("--executor slurm: no sbatch on this machine's PATH: run it where jobs are submitted (a Slurm "
                        "login node), or --dry_run to see the stages")
    sg.prepare_selection_dir(args, sel, TaskState(None))
    on_stop(lambda: stop_account(args))  # a stop signal's line: the finished tasks, the command that continues
    listed = stage_path(args, "files.json")
    if os.path.exists(listed) and json.load(open(listed)) != files:  # a resumed run over changed input files
        raise UserError(f"{args.output_dir} holds an unfinished selection over other input files ({listed}): rerun "
                        "it on the same files, or pass --overwrite")
    os.makedirs(stage_path(args), exist_ok=True)
    atomic_write(listed, json.dumps(files))
    print(f"{len(files)} input file(s) dealt to {args.tasks} task(s); stages {', '.join(STAGES)} on datatrove's "
          f"{args.executor} executor (logs: {stage_path(args, 'logs')})", flush=True)
    executors[-1].run()


# ----------------------------------------------------------------------------------------------
# The command: select_groups.py's flags and checks, and the executor's.
# ----------------------------------------------------------------------------------------------

def _executor_flags(g):
    g.add_argument("--executor", choices=("local", "slurm", "ray"), required=True,
                   help="Run the selection as datatrove stages (document frequencies, merge, selection, finish) on "
                        "this executor; the input files are dealt to --tasks tasks. Without it: select_groups.py "
                        "(this process, or torchrun's processes).")
    g.add_argument("--tasks", type=positive_int, default=1,
                   help="Tasks of the document-frequency and selection stages; task t reads every --tasks-th input "
                        "file from file t. Fixed for a folder: a rerun with another count is refused.")
    g.add_argument("--workers", type=int, default=-1,
                   help="Tasks run at once (datatrove's workers; -1: all).")
    g.add_argument("--gpus_per_task", type=non_negative_int, default=None,
                   help="--executor slurm / ray: GPUs of each task of the stages that embed (selection; the merge "
                        "with --anchor_share, the finish with --inspect). Default: 1 on slurm and ray.")
    g.add_argument("--executor_option", action="append", default=[], metavar="KEY=VALUE",
                   help="An option of the datatrove executor, passed through to every stage (value read as JSON, "
                        "else as text): e.g. partition=gpu time=04:00:00 cpus_per_task=8 for slurm. Repeatable.")
    g.add_argument("--dry_run", action="store_true",
                   help="Print the stages as built (pipeline, tasks, dependencies, resources) and exit without "
                        "running them.")


def parse_args(argv=None):
    """select_groups.py's parser and checks, with the executor's flags and checks."""
    p = sg.build_parser()
    p.description = __doc__.split("\n\n")[0]
    _executor_flags(p.add_argument_group("datatrove executors (selection at web scale)"))
    args = p.parse_args(argv)
    sg.check_args(p, args)
    if args.dataset:
        p.error("--executor deals --input files to its tasks: download the --dataset and give its files as --input")
    if args.max_docs > 0:
        p.error("--executor reads every input file whole (its tasks read different files): cut the input instead of "
                "--max_docs")
    return args


def main(argv=None):
    args = parse_args(argv)
    # before anything loads, as select_groups.main
    check_model_name(args.model_name_or_path, "--model_name_or_path", args.trust_remote_code)
    return run(args, sg.Selection.from_args(args))  # the one object every selecting function reads


if __name__ == "__main__":
    run_script(main)
