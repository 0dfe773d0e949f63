"""
Peak memory of the two paths that grow with the paper's data, each at 1x and 10x, measured in the same run:

1. train.py's data path: load_groups (the groups stay memory-mapped Arrow) + group_lengths + the length-grouped
   sampler + a few batches through the DataLoader (RowsDataset) and XPRTCollator, on synthetic groups
   (--groups, then 10x). The model is left out: its memory does not depend on the number of groups. The first
   load_groups of a folder converts the parquet shards into datasets' Arrow cache (once; later runs and the other
   processes of a run map it): that conversion runs first, in a process of its own, and its peak is printed as
   well, but the goal is on the data path of a run.
2. finetune.py's hard-negative mining (mine_hard_negatives, one process) with --queries queries against
   --passages passages, then 10x the passages; the corpus is read through a lazy view of a memory-mapped Arrow
   file, as a caller with a large corpus would pass it.

Goal: growth <= 1.3x for both. Each measurement runs in a fresh process that reports
  - peak RSS (VmHWM, what getrusage's ru_maxrss gives), and
  - peak private memory (RssAnon, sampled every 5 ms by a thread): the memory a process owns. RSS also counts the
    pages of memory-mapped files it has read, which are the OS page cache, shared by the processes of a run and
    dropped under memory pressure; the 10x run reads 10x the file, so VmHWM grows with the data even when the
    process holds nothing more.
Synthetic text: words drawn from data/docs.jsonl, passages of 8-16 words; 0.1% of the passages are exact copies of
another one (as MS MARCO has), so mining's duplicate path is measured too. The encoder is a random BertModel
(hidden 32, 2 layers) with the MiniLM tokenizer: 1M short passages encode in a few minutes on 2 CPU cores.

From the repository root:

    python -m bench.bench_memory               # 100K / 1M groups, 100K / 1M passages x 1,000 queries
    python -m bench.bench_memory --scale 0.1   # 10K / 100K of each: about a minute
    python -m bench.bench_memory --toy         # seconds: 20 / 40 of each, 4 queries

Printed: each run's peaks and time, `train_rss_growth: <x>` and `mining_rss_growth: <x>` (growth of the peak
private memory, the goal's measure; the VmHWM growth is printed beside it), and last `ratio: <the larger>`.

3. `--only estimate`: train.py's memory estimate (run_log.memory_estimate) against the measured peak of the step it
   estimates, over the family: two random BERTs (64 x 2 and 128 x 4, MiniLM's 30,522 words) at 32 tokens, fp32 and
   bf16 autocast, batches of 8-32 groups, accumulation, the gradient cache, retention on and off. Each case runs in a
   fresh process: the model, teacher, optimiser and batch made, the estimate taken (the point where train.py reads the
   free memory), the peak reset (/proc/self/clear_refs), two optimiser steps run as train.py runs them; measured = the
   peak RSS (VmHWM) less the RSS at the estimate. `--estimate_from OTHER/plumbing/run_log.py` prints that file's
   estimate beside this tree's (1fbaae3's counts the resident weights and teacher again). Last line
   `ratio: <the largest |estimate / measured - 1| of this tree's>`. About 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from bench import ROOT, add_toy_flag, build_tiny, toy_sized  # importing bench also sets the offline defaults


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies --groups and --passages (0.1: a quick run at 10K / 100K)")
    p.add_argument("--groups", type=int, default=100_000, help="groups of the 1x train data run")
    p.add_argument("--passages", type=int, default=100_000, help="corpus passages of the 1x mining run")
    p.add_argument("--factor", type=int, default=10, help="the large runs use this many times the data")
    p.add_argument("--queries", type=int, default=1000, help="mining queries (the same at 1x and 10x)")
    p.add_argument("--train_batches", type=int, default=5, help="batches collated in the train data runs")
    p.add_argument("--batch_size", type=int, default=32, help="groups per batch in the train data runs")
    p.add_argument("--mining_batch_size", type=int, default=256, help="encoding batch size of mining")
    p.add_argument("--mining_chunk_size", type=int, default=16384, help="passages encoded and scored at a time")
    p.add_argument("--only", choices=["train", "mining", "estimate"], default=None,
                   help="run one part only (estimate: the memory estimate against the measured peak, not run "
                        "unless asked)")
    p.add_argument("--estimate_from", default=None,
                   help="a run_log.py of another checkout: its memory estimate printed beside this tree's")
    p.add_argument("--workdir", default=None, help="folder for the synthetic data (default: a temp dir, removed)")
    add_toy_flag(p, "20 -> 40 groups and passages, 4 queries, batches of 4")
    p.add_argument("--_child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return toy_sized(p.parse_args(argv), scale=1.0, groups=20, passages=20, factor=2, queries=4, train_batches=1,
                     batch_size=4, mining_batch_size=8, mining_chunk_size=16)


# ----------------------------------------------------------------------------------------------------------------
# Memory of this process
# ----------------------------------------------------------------------------------------------------------------
def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    return float("nan")


class AnonPeak:
    """Highest RssAnon seen by a thread that reads /proc/self/status every `every` seconds (Linux keeps no peak
    of it). Allocations that matter here take longer than 5 ms to fill, so the sampling misses little."""

    def __init__(self, every=0.005):
        self.peak, self.every, self.stop = status_mb("RssAnon"), every, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, status_mb("RssAnon"))
            time.sleep(self.every)

    def finish(self) -> float:
        self.stop.set()
        self.thread.join()
        return max(self.peak, status_mb("RssAnon"))


# ----------------------------------------------------------------------------------------------------------------
# Synthetic data (written by the parent; only the children are measured)
# ----------------------------------------------------------------------------------------------------------------
def vocabulary():
    words = set()
    with open(os.path.join(ROOT, "data", "docs.jsonl"), encoding="utf-8") as f:
        for line in f:
            words.update(w for w in json.loads(line)["text"].split() if w.isalpha())
    return sorted(words)


def passages(rng, words, n):
    """n passages of 8-16 words."""
    return [" ".join(rng.choices(words, k=rng.randint(8, 16))) for _ in range(n)]


def write_groups(folder, n, words, shard=100_000):
    """n groups in select_groups.py's schema, in parquet shards of `shard` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from select_groups import group_schema

    os.makedirs(folder, exist_ok=True)
    rng = random.Random(0)
    for s in range(0, n, shard):
        m = min(shard, n - s)
        anchors, related, rand = passages(rng, words, m), passages(rng, words, 4 * m), passages(rng, words, m)
        table = pa.table({
            "doc_id": [f"doc{(s + i) // 7}" for i in range(m)], "group_index": [(s + i) % 7 for i in range(m)],
            "anchor_index": [0] * m, "anchor": anchors, "anchor_centrality": [0.9] * m,
            "related": [related[4 * i:4 * i + 4] for i in range(m)], "related_index": [[1, 2, 3, 4]] * m,
            "related_cosine": [[0.8] * 4] * m, "related_tfidf": [[0.3] * 4] * m, "related_rrf": [[0.2] * 4] * m,
            "random_passage": rand, "num_passages": [9] * m}, schema=group_schema())
        pq.write_table(table, os.path.join(folder, f"shard-{s // shard:05d}.parquet"))
    with open(os.path.join(folder, "stats.json"), "w") as f:  # a finished selection's marker (train.load_groups)
        json.dump({"groups": n}, f)


def write_corpus(path, n, words, shard=100_000):
    """n passages as an Arrow IPC file with one column `text`; every 1000th passage copies the one before it."""
    import pyarrow as pa

    rng = random.Random(1)
    schema = pa.schema([("text", pa.string())])
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for s in range(0, n, shard):
            texts = passages(rng, words, min(shard, n - s))
            for i in range(1, len(texts)):
                if (s + i) % 1000 == 0:
                    texts[i] = texts[i - 1]
            writer.write_table(pa.table({"text": texts}, schema=schema))


# ----------------------------------------------------------------------------------------------------------------
# The measured children
# ----------------------------------------------------------------------------------------------------------------
class ArrowColumn:
    """A read-only sequence over one string column of a memory-mapped Arrow IPC file: item i is read when asked
    for, so the passages are never Python strings all at once."""

    def __init__(self, path, column="text"):
        import pyarrow as pa

        self.col = pa.ipc.open_file(pa.memory_map(path)).read_all().column(column)

    def __len__(self):
        return len(self.col)

    def __getitem__(self, i):
        return self.col[int(i)].as_py()


class PassageIds:
    """Corpus ids p0, p1, ... made when asked for."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f"p{i}"


def child_convert(groups_dir):
    import train

    before, peak = status_mb("VmHWM"), AnonPeak()
    rows = train.load_groups(groups_dir)
    return {"rows": len(rows), "before_mb": before}, peak


def child_train(groups_dir, model, batches, batch_size):
    import torch
    from transformers import AutoTokenizer

    import train
    from modeling_xprt import XPRTCollator, group_lengths
    from plumbing.batches import LengthGroupedBatchSampler, RowsDataset

    tok = AutoTokenizer.from_pretrained(model)
    before, peak = status_mb("VmHWM"), AnonPeak()
    rows = train.load_groups(groups_dir)
    lengths = group_lengths(rows, 4)
    sampler = LengthGroupedBatchSampler(lengths, batch_size, seed=0)
    loader = torch.utils.data.DataLoader(RowsDataset(rows), batch_sampler=sampler, collate_fn=list,
                                         generator=torch.Generator().manual_seed(0))
    collator = XPRTCollator(tok, num_related=4, max_length=128)
    tokens = 0
    for b, rows_b in enumerate(loader):
        batch = collator([r for _, r in rows_b])
        tokens += int(batch["attention_mask"].sum())
        if b + 1 == batches:
            break
    return {"rows": len(rows), "tokens": tokens, "before_mb": before}, peak


def child_mining(corpus_path, model, queries, batch_size, chunk_size):
    from transformers import AutoModel, AutoTokenizer

    import finetune

    tok = AutoTokenizer.from_pretrained(model)
    encoder = AutoModel.from_pretrained(model).eval()
    before, peak = status_mb("VmHWM"), AnonPeak()
    texts = ArrowColumn(corpus_path)
    ids = PassageIds(len(texts))
    rng = random.Random(2)
    # query i: 5 words of its positive passage, so the ranking is not pure noise; a second positive at random
    pos = [(37 * i + 1) % len(texts) for i in range(queries)]
    qtexts = [" ".join(texts[j].split()[:5]) for j in pos]
    positives = [{f"p{j}", f"p{rng.randrange(len(texts))}"} for j in pos]
    pools = finetune.mine_hard_negatives(encoder, tok, qtexts, positives, ids, texts, 10, 100,
                                         batch_size=batch_size, chunk_size=chunk_size)
    return {"rows": len(texts), "pool_sizes": sum(map(len, pools)), "before_mb": before}, peak


# (name, hidden, layers, precision, groups, accumulation, gradient_cache_chunk, retention)
ESTIMATE_CASES = [("S", 64, 2, "no", 8, 1, 0, 0), ("S", 64, 2, "no", 32, 1, 0, 0), ("S", 64, 2, "bf16", 32, 1, 0, 0),
                  ("M", 128, 4, "no", 8, 1, 0, 0), ("M", 128, 4, "no", 24, 1, 0, 0), ("M", 128, 4, "bf16", 24, 1, 0, 0),
                  ("M", 128, 4, "no", 16, 2, 0, 0), ("M", 128, 4, "no", 32, 1, 8, 0), ("M", 128, 4, "no", 32, 1, 4, 0),
                  ("M", 128, 4, "no", 16, 1, 0, 1),
                  ("M", 128, 4, "bf16", 16, 1, 0, 1)]


def build_bert(path, hidden, layers):
    """A random BertForMaskedLM of this width and depth with MiniLM's tokenizer and vocabulary, saved to path."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from plumbing.common import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=max(hidden // 32, 1), intermediate_size=4 * hidden)
                    ).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def child_estimate(model_path, precision, groups, accumulation, chunk, retention, other, max_length=32):
    """One case of the estimate's table: both estimates, then the measured step (module docstring, part 3)."""
    import importlib.util
    import types

    import torch
    from transformers import AutoTokenizer

    import modeling_xprt as mx
    from bench.bench_step import make_rows
    from plumbing import model_folder, run_log

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = mx.XPRTModel(model_folder.load_mlm_encoder(model_path)[0]).train()
    teacher = model_folder.load_teacher(model_path) if retention else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batches = [mx.XPRTCollator(tok, max_length=max_length, seed=i)(make_rows(tok, groups, max_length, seed=i))
               for i in range(2 * accumulation)]
    acc = types.SimpleNamespace(device=torch.device("cpu"), mixed_precision=precision, state=types.SimpleNamespace(),
                                print=lambda *a: None)
    args = argparse.Namespace(per_device_train_batch_size=groups, gradient_cache_chunk=chunk or None,
                              ignore_memory_estimate=True)
    out = {}
    for name, module in (("estimate", run_log), ("other", other)):
        if module == "" or module is None:
            continue
        if isinstance(module, str):
            spec = importlib.util.spec_from_file_location("other_run_log", module)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        note = module.memory_estimate(acc, args, model, batches[0], teacher, max_length)
        out[name + "_mb"] = note["batch_gib"] * 1024  # what the step adds to the memory in use when it is read
    rss = status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: the estimate's probes are done
        f.write("5")
    weight = 40.0 if retention else 0.0
    for step in range(2):
        for batch in batches[step * accumulation:(step + 1) * accumulation]:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                if chunk:
                    model.cached_step(batch, chunk, lambda loss: loss.backward(), teacher=teacher,
                                      retention_weight=weight)
                else:
                    model(batch, teacher=teacher, retention_weight=weight)["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out.update({"measured_mb": status_mb("VmHWM") - rss, "rss_at_estimate_mb": rss})
    return out


def estimate_table(args, work, env, cases=None):
    """Part 3: the estimate against the measured peak, case by case; returns the largest |estimate / measured - 1|."""
    models, worst = {}, 0.0
    print(f"{'case':44s} {'estimate':>9s} {'measured':>9s} {'ratio':>6s}"
          + (f" {'other':>9s} {'ratio':>6s}" if args.estimate_from else ""), flush=True)
    for name, hidden, layers, precision, groups, accum, chunk, retention in cases or ESTIMATE_CASES:
        if name not in models:
            models[name] = build_bert(os.path.join(work, f"bert_{name}"), hidden, layers)
        r = measure(["estimate", models[name], precision, groups, accum, chunk, retention,
                     args.estimate_from or ""], env)
        case = (f"{name} ({hidden} x {layers}) {'bf16' if precision == 'bf16' else 'fp32'} {groups} groups"
                + (f" accum {accum}" if accum > 1 else "") + (f" cache {chunk}" if chunk else "")
                + (" retention" if retention else ""))
        ratio = r["estimate_mb"] / r["measured_mb"]
        worst = max(worst, abs(ratio - 1))
        print(f"{case:44s} {r['estimate_mb']:7.0f}MB {r['measured_mb']:7.0f}MB {ratio:6.2f}"
              + (f" {r['other_mb']:7.0f}MB {r['other_mb'] / r['measured_mb']:6.2f}" if "other_mb" in r else ""),
              flush=True)
    return worst


def child(argv):
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    kind, *rest = argv
    t = time.perf_counter()
    if kind == "convert":
        out, peak = child_convert(rest[0])
    elif kind == "estimate":
        m, prec, g, acc, ch, ret, other = rest
        print(json.dumps(child_estimate(m, prec, int(g), int(acc), int(ch), int(ret), other)))
        return
    elif kind == "train":
        out, peak = child_train(rest[0], rest[1], int(rest[2]), int(rest[3]))
    else:
        out, peak = child_mining(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
    out.update({"peak_anon_mb": peak.finish(), "vmhwm_mb": status_mb("VmHWM"), "seconds": time.perf_counter() - t})
    print(json.dumps(out))


def measure(argv, env):
    res = subprocess.run([sys.executable, "-m", "bench.bench_memory", "--_child", *map(str, argv)], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parse_args(argv)
    if args._child is not None:
        return child(args._child)
    work = args.workdir or tempfile.mkdtemp(prefix="bench-memory-")
    os.makedirs(work, exist_ok=True)
    # the Arrow cache of the groups goes to the work folder, not to HF_HOME
    env = {**os.environ, "HF_DATASETS_CACHE": os.path.join(work, "datasets_cache")}
    sys.path.insert(0, ROOT)
    model = build_tiny(os.path.join(work, "tiny"))
    words = vocabulary()
    growth = {}
    try:
        if args.only == "estimate":  # --toy: the first case alone
            return print(f"ratio: {estimate_table(args, work, env, ESTIMATE_CASES[:1] if args.toy else None):.3f}")
        for part in ("train", "mining"):
            if args.only and part != args.only:
                continue
            base = int((args.groups if part == "train" else args.passages) * args.scale)
            res = {}
            for n in (base, base * args.factor):
                t = time.perf_counter()
                if part == "train":
                    data = os.path.join(work, f"groups_{n}")
                    if not os.path.isdir(data):
                        write_groups(data, n, words)
                    made = time.perf_counter() - t
                    conv = measure(["convert", data], env)
                    print(f"first load {n:>9,} groups (parquet -> Arrow cache, once per folder): peak private "
                          f"{conv['peak_anon_mb']:7.0f} MB, peak RSS {conv['vmhwm_mb']:7.0f} MB, "
                          f"{conv['seconds']:.0f} s", flush=True)
                    res[n] = measure(["train", data, model, args.train_batches, args.batch_size], env)
                else:
                    data = os.path.join(work, f"corpus_{n}.arrow")
                    if not os.path.exists(data):
                        write_corpus(data, n, words)
                    made = time.perf_counter() - t
                    res[n] = measure(["mining", data, model, args.queries, args.mining_batch_size,
                                      args.mining_chunk_size], env)
                r = res[n]
                what = "groups" if part == "train" else f"passages x {args.queries} queries"
                print(f"{part:6s} {n:>9,} {what}: peak private (RssAnon) {r['peak_anon_mb']:7.0f} MB, peak RSS "
                      f"(VmHWM) {r['vmhwm_mb']:7.0f} MB (after imports {r['before_mb']:.0f} MB); measured part "
                      f"{r['seconds']:.0f} s, data written in {made:.0f} s", flush=True)
            small, large = res[base], res[base * args.factor]
            growth[part] = large["peak_anon_mb"] / small["peak_anon_mb"]
            print(f"{part}_vmhwm_growth: {large['vmhwm_mb'] / small['vmhwm_mb']:.3f} (includes the page cache of the "
                  f"memory-mapped files read)")
            print(f"{part}_rss_growth: {growth[part]:.3f} (peak private memory, {args.factor}x the data; goal <= 1.3)",
                  flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"ratio: {max(growth.values()):.3f}")


if __name__ == "__main__":
    main()
