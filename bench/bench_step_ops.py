"""What train.py's step asks of a GPU, counted on a CPU (issue 42): host syncs, aten ops, collation per group.

A GPU comes rarely, and on it a small model's step is bound by what the host does between kernels: every read of a
device value (`.item()`, `.tolist()`, `if tensor:`, a data-dependent shape: `nonzero`, `masked_select`, a boolean
index) makes the host wait for the queue to drain, and every aten op is at least one kernel launch. Both are the same
on a CPU, so they are counted here, in train.py's own loop (train.main, in this process), for every objective it
offers, at two sizes (those of bench_collation):
  gpu        the gpu scale of experiments/paper: 4 layers x 192, passages of 64 tokens, retention off
  bert-base  12 layers x 768, passages of 128 tokens, retention on (40, the clean student)

  syncs      host reads of a device value per optimiser step, between the batch's move to the device and the step's
             end (forward, backward, clip, AdamW, the loop's bookkeeping): Python-level reads (TorchFunctionMode:
             tolist, item, bool, int, float, numpy, cpu) plus the aten ops whose output shape depends on the data
             (TorchDispatchMode: nonzero, masked_select, a boolean index, unique, ...) that no such read made. A copy
             to the CPU cannot be told from a CPU tensor on a CPU: `.cpu()` counts as a read, `.to(device)` does not;
             reads inside torch.optim do not (AdamW's step counts live on the host unless it is fused).
  aten ops   the aten ops of that step that are not views (each launches at least one kernel on a GPU)
  collate    CPU milliseconds per group of the objective's collator (mask, pad), in this process on one thread,
             reading the rows as a loader worker does: from the rows train.py hands the loader (each passage
             tokenised once at load: train.tokenized) and, for comparison, from the texts (tokenised in every
             batch, as before)
AdamW is the one train.py builds on this CPU (torch's default: one tensor at a time); `--adamw cuda` builds the one it
builds on CUDA (fused: training.adamw_kernel) on the CPU instead, so the aten ops are those a GPU step launches.

Steps: the first (its one-time probes and the FLOP count) and the logging step (--logging_steps reads the window's
sums on purpose) are reported apart from the steady steps between them. Where each steady-step sync comes from (the
first frame outside torch) is printed under the table. The last line is `ratio: <steady syncs per step, the mean over
objectives and sizes>`; the goal is 0.

    python -m bench.bench_step_ops                            # both sizes, every objective (~10 min on 2 CPU cores)
    python -m bench.bench_step_ops --sizes gpu --objectives xprt
"""

import argparse
import collections
import contextlib
import io
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from bench import ROOT, add_toy_flag, toy_sized
from bench.bench_collation import SIZES, passage_rows
from bench.bench_step import tiny_causal_lm
from plumbing import model_folder

# aten ops whose output's shape (or a Python value) depends on the data: on a GPU each waits for the queue
DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                  "unique_consecutive", "is_nonzero", "equal", "masked_scatter_", "bincount", "histc"}
# Tensor methods that hand a device value to Python
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}


def host_side_by_design(stack) -> bool:
    """A read inside torch.optim: AdamW's step counts, CPU tensors on every device unless the optimiser is fused or
    capturable, so reading them waits for nothing."""
    return any("/torch/optim/" in frame.filename for frame in stack)


def where_from(stack) -> str:
    """Who asked for the read: the innermost frame outside torch, this file and the standard library, and the
    innermost frame of this repository's code above it when that is another (a library's check, called by us)."""
    frames = [f for f in reversed(stack[:-2]) if "/torch/" not in f.filename and not f.filename.endswith(
        "bench_step_ops.py") and not ("/lib/python3" in f.filename and "site-packages" not in f.filename)]
    if not frames:
        return "?"
    ours = next((f for f in frames if f.filename.startswith(ROOT) and "site-packages" not in f.filename), None)
    where = _frame(frames[0])
    return where if ours is None or ours is frames[0] else f"{where} <- {_frame(ours)}"


def _frame(f) -> str:
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


class StepCounter(TorchFunctionMode):
    """Counts, while `on`: host reads (Python level), data-dependent aten ops no read made, and non-view aten ops.
    The dispatch half is the inner mode `ops`, entered with this one."""

    def __init__(self):
        super().__init__()
        self.on, self.reading = False, 0
        self.reads, self.aten = collections.Counter(), 0
        counter = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.on:
                    name = func.overloadpacket.__name__
                    if not func.is_view:
                        counter.aten += 1
                    bool_index = name in ("index", "index_put_", "index_put") and any(
                        torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None)
                    if not counter.reading and (name in DATA_DEPENDENT or bool_index or (
                            name == "repeat_interleave" and kwargs and kwargs.get("output_size") is None)):
                        stack = traceback.extract_stack()
                        if not host_side_by_design(stack):
                            counter.reads[f"aten.{name} <- {where_from(stack)}"] += 1
                return func(*args, **(kwargs or {}))

        self.ops = Ops()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.on and not self.reading and name in HOST_READS:
            stack = traceback.extract_stack()
            if not host_side_by_design(stack):
                self.reads[f"{name} <- {where_from(stack)}"] += 1
            self.reading += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.reading -= 1
        return func(*args, **(kwargs or {}))

    def take(self):
        out = (sum(self.reads.values()), self.aten, dict(self.reads))
        self.reads, self.aten = collections.Counter(), 0
        return out


def write_groups(folder: Path, max_length: int, n: int) -> Path:
    """n groups of about max_length-token passages (bench_collation.passage_rows) in select_groups.py's schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from select_groups import group_schema

    rows = [{**r, "group_index": i, "anchor_index": 0, "anchor_centrality": 0.9, "related_index": [1, 2, 3, 4],
             "related_cosine": [0.8] * 4, "related_tfidf": [0.3] * 4, "related_rrf": [0.2] * 4, "num_passages": 6}
            for i, r in enumerate(passage_rows(max_length, n))]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), folder / "shard-00000.parquet")
    (folder / "stats.json").write_text(json.dumps({"groups": len(rows)}))
    return folder


def count_steps(argv: list, steps: int, adamw: str = "default") -> list:
    """train.main(argv) with the counter on from each batch's move to the device to the end of its optimiser step:
    [(syncs, aten ops, {where: count})] per step. adamw "cuda": the AdamW train.py builds on CUDA
    (training.adamw_kernel), built here on the CPU (torch's fused AdamW runs on both). The batch's move is patched
    where train.py's loop calls it (train.batch_to_device: train.py imports the name from plumbing.batches)."""
    from accelerate.state import AcceleratorState, GradientState

    import train
    from plumbing import run_log, training
    counter, per_step = StepCounter(), []
    move, step_done, kernel = train.batch_to_device, run_log.LogWindow.step_done, training.adamw_kernel
    if adamw == "cuda":
        training.adamw_kernel = lambda device_type: kernel("cuda")

    def moved(batch, device):
        out = move(batch, device)
        counter.on = True  # the step starts once its batch is on the device
        return out

    def done(window, *a, **kw):
        counter.on = False
        per_step.append(counter.take())
        return step_done(window, *a, **kw)

    train.batch_to_device, run_log.LogWindow.step_done = moved, done
    AcceleratorState._reset_state(True)  # one run after another in this process
    GradientState._reset_state()
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    try:  # train.py's own lines and bars kept out of the table
        with counter, counter.ops, quiet[0], quiet[1]:
            train.main(argv)
    finally:
        train.batch_to_device, run_log.LogWindow.step_done, training.adamw_kernel = move, step_done, kernel
    assert len(per_step) == steps, (len(per_step), steps)
    return per_step


def collate_ms_per_group(objective: str, folder: Path, tok, rows, max_length: int, options: dict, repeats: int):
    """CPU milliseconds per group of the objective's collator over `rows` (a datasets.Dataset), best of `repeats`,
    the rows' reading from the Arrow table included, on one thread, as a loader worker does: -> (from the texts, as
    every batch was collated before train.py tokenised each passage once; from the rows train.py hands the loader,
    train.tokenized)."""
    from accelerate import PartialState

    import modeling_xprt as mx
    import train
    from plumbing.batches import RowsDataset

    with contextlib.redirect_stderr(io.StringIO()):  # the loading and map bars
        mlm, _ = model_folder.load_mlm_encoder(str(folder))
        collator = mx.XPRTModel(mlm, objective=objective, **options).objective.make_collator(tok, max_length=max_length)
        tokens = train.tokenized(PartialState(), rows, collator)
    _, extras = collator.sort_lengths(rows, 0)
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker (torch gives each one thread)
    for table in (rows, tokens):
        best, keys = float("inf"), [(0, 0, i) for i in range(len(table))]
        for _ in range(repeats):
            c0 = time.process_time()
            read = RowsDataset(table).__getitems__(keys)  # as the DataLoader's fetcher reads a batch
            collator([row if extras is None else {**row, **extras(0, i)} for (_, _, i), row in read])
            best = min(best, time.process_time() - c0)
        out.append(1000 * best / len(rows))
    torch.set_num_threads(threads)
    return tuple(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["gpu", "bert-base"], choices=list(SIZES), help="model sizes")
    p.add_argument("--objectives", nargs="+", default=None, help="default: every train.py --objective")
    p.add_argument("--groups", type=int, default=2, help="groups per step (the counts hardly depend on it)")
    p.add_argument("--steps", type=int, default=3,
                   help="optimiser steps per run: the first, the steady ones, the logging one")
    p.add_argument("--collate_groups", type=int, default=64, help="groups collated for the per-group collation time")
    p.add_argument("--adamw", choices=["default", "cuda"], default="default",
                   help="the AdamW train.py builds on this CPU (default) or the one it builds on CUDA (fused; "
                        "training.adamw_kernel), built on the CPU")
    p.add_argument("--json", default=None, help="also write the records to this JSON file")
    add_toy_flag(p, "a 2-layer 32-wide BERT, 2 groups, 3 steps, 8 groups collated")
    return toy_sized(p.parse_args(argv), sizes=["toy"], groups=2, steps=3, collate_groups=8)


def main(argv=None):
    args = parse_args(argv)
    if args.steps < 3:
        raise SystemExit("--steps: at least 3 (the first step, a steady one, the logging step)")
    import datasets
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    import train

    tok = AutoTokenizer.from_pretrained(str(Path(ROOT) / "bench" / "tokenizer"))
    objectives = args.objectives or train.pretraining_objectives()
    work = Path(tempfile.mkdtemp(prefix="bench_step_ops-"))
    results, origins = [], collections.Counter()
    print(f"{'size':>9} {'objective':<24} {'syncs: first':>12} {'steady':>7} {'logging':>8} "
          f"{'aten ops: first':>15} {'steady':>7} {'collate ms/group: text':>23} {'tokens':>7}", flush=True)
    for size in args.sizes:
        hidden, layers, heads, inner, max_length, retention = SIZES[size]
        folder = work / size / "model"
        torch.manual_seed(0)
        BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, intermediate_size=inner)).save_pretrained(folder)
        tok.save_pretrained(folder)
        n = args.groups * args.steps
        groups = write_groups(work / size / "groups", max_length, max(n, args.collate_groups))
        rows = datasets.Dataset.from_list(passage_rows(max_length, args.collate_groups))
        lm = tiny_causal_lm(work / size / "lm", tok)  # Revela's language model
        for objective in objectives:
            options = ({"generator_name_or_path": str(folder)} if objective == "simlm" else
                       {"lm_name_or_path": lm} if objective == "revela" else {})
            argv = ["--groups_dir", str(groups), "--model_name_or_path", str(folder), "--objective", objective,
                    "--output_dir", str(work / size / objective), "--overwrite", "--no_save_model",
                    "--per_device_train_batch_size", str(args.groups), "--max_train_steps", str(args.steps),
                    "--logging_steps", str(args.steps), "--max_length", str(max_length), "--seed", "0",
                    "--retention_weight", str(retention), "--dataloader_num_workers", "0", "--report_to", "none"]
            for k, v in options.items():
                argv += [f"--{k}", v]
            per_step = count_steps(argv, args.steps, args.adamw)
            steady = per_step[1:-1]
            rec = {"size": size, "objective": objective, "groups": args.groups, "adamw": args.adamw,
                   "syncs_first": per_step[0][0], "syncs_steady": sum(s for s, _, _ in steady) / len(steady),
                   "syncs_logging": per_step[-1][0], "aten_first": per_step[0][1],
                   "aten_steady": sum(a for _, a, _ in steady) / len(steady),
                   }
            rec["collate_text_ms_per_group"], rec["collate_ms_per_group"] = collate_ms_per_group(
                objective, folder, tok, rows, max_length, options, 3)
            for _, _, where in steady:
                origins.update({f"{k}  [{size} {objective}]": v / len(steady) for k, v in where.items()})
            results.append(rec)
            print(f"{size:>9} {objective:<24} {rec['syncs_first']:>12} {rec['syncs_steady']:>7.1f} "
                  f"{rec['syncs_logging']:>8} {rec['aten_first']:>15} {rec['aten_steady']:>7.0f} "
                  f"{rec['collate_text_ms_per_group']:>23.2f} {rec['collate_ms_per_group']:>7.2f}", flush=True)
    if origins:
        print("\nwhere the steady steps' syncs come from (per step):")
        for k, v in sorted(origins.items(), key=lambda kv: -kv[1]):
            print(f"  {v:5.1f}  {k}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"ratio: {sum(r['syncs_steady'] for r in results) / len(results):.2f}")
    return results


if __name__ == "__main__":
    main()
