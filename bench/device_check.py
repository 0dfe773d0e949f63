"""
The device check: one command for a GPU this project is lent (a few minutes on one GPU: it runs before the
harness's arms in the same 15-minute run), and the same code at toy size on a CPU (`--toy`, kept working by
tests/test_device_check.py and, with the GPU machine's packages, tests/test_device_env.py).

    python -m bench.device_check               # on a GPU
    python -m bench.device_check --toy         # on a CPU: toy sizes, same code

It prints, in order:
  1. torch / CUDA / transformers / accelerate versions and the device;
  2. train.py's own loop (train.main in this process: its loader and workers, the one move to the device, the step,
     its logging) in bf16 at two sizes: the paper's BERT-base step (128 tokens, 128 groups, retention on) and the
     harness's gpu scale (4 x 192, 64 tokens, 256 groups), random weights, the bundled tokenizer, the bundled
     documents' real passages: seconds per step, MFU (train.py's own FLOP count over run_log.PEAK_BF16_TFLOPS), the
     share of the time waiting for data, host syncs and aten ops per steady step (bench_step_ops' counter), the
     peak memory, the top kernels (torch.profiler), and a stock BertForMaskedLM step of the same config in the same
     run as the peer (train.py's MFU over the stock step's); `--memory_sweep` adds the bf16 xPRT step at doubling
     groups per step until the memory is full;
  3. the vocabulary loss of a step's rows three ways in bf16 autocast: ours fused (linear_cross_entropy), torch's
     chunked F.linear_cross_entropy (where that torch has it), plain full logits: time and agreement with plain;
  4. host syncs in one optimiser step (torch.cuda.set_sync_debug_mode; CUDA only);
  5. select_groups.py -> `accelerate launch --mixed_precision bf16 train.py` -> evaluate.py on the bundled SciFact
     sample, with a small random model: the pipeline end to end in bf16, ending in a scored model folder;
  6. selection's speed on the device: select_groups.select_documents (split, embed, centrality, TF-IDF, ranks) with an
     E5-base-size encoder (BERT-base config, random weights) in bf16 over the bundled documents, against its embedding
     pass alone, at two batch sizes: passages/s and tokens/s, beside FineWeb-Edu's classifier (about 0.69M tokens/s
     per H100) and the goal (1M per H200).

A GPU machine without datasets or mteb (the lent one has torch, transformers, accelerate, sentence-transformers):
run `bash bench/device_wheels.sh` here first and carry bench/wheels; this check installs them offline
(pip --no-index --no-deps) when it finds them missing. Proven here first in the device's own environment:
`python -m bench.device_env run -- python -m bench.device_check --toy` (tests/test_device_env.py). Last line
`ratio: <train.py's BERT-base step's MFU over the stock step's>` (TFLOP/s on a CPU).
"""

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from bench import ROOT  # noqa: F401  (the repository on sys.path; offline defaults)

HERE = Path(__file__).resolve().parent
ROOT_DIR = HERE.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy", action="store_true", help="toy sizes (a CPU, the test): 2 layers x 64 hidden, 16 tokens")
    p.add_argument("--max_length", type=int, default=None, help="tokens per passage (default 128; toy 16)")
    p.add_argument("--max_groups", type=int, default=None, help="largest groups per step tried (default 2048; toy 8)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/xprt_device_check"),
                   help="folder for the end-to-end run's outputs and device_check.json (default: $OUT)")
    p.add_argument("--loop_sizes", nargs="+", default=list(LOOP_SIZES), choices=list(LOOP_SIZES),
                   help="part 2's sizes of train.py's own loop (default both: the paper's BERT-base step, the "
                        "harness's gpu scale)")
    p.add_argument("--modes", nargs="+", default=["eager", "default", "reduce-overhead", "stock-compiled"],
                   choices=["eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "stock-compiled"],
                   help="part 2's table: train.py's loop eager and under these --compile modes (reduce-overhead, CUDA "
                        "graphs, at the harness's size only), and the stock step whole-model compiled")
    p.add_argument("--memory_sweep", action="store_true",
                   help="also the bf16 xPRT step at doubling groups per step until the memory is full (minutes)")
    p.add_argument("--skip_e2e", action="store_true", help="skip part 5 (select -> train -> evaluate)")
    p.add_argument("--skip_selection", action="store_true", help="skip part 6 (selection's speed)")
    p.add_argument("--selection_docs", type=int, default=None,
                   help="documents of part 6 (the bundled 300 repeated under new ids; default 1500; toy 4)")
    p.add_argument("--wheels", default=str(HERE / "wheels"),
                   help="carried wheels installed (--no-deps) when datasets / mteb are missing "
                        "(bench/device_wheels.sh)")
    return p.parse_args(argv)


def ensure_packages(wheels: Path):
    """datasets and mteb from the carried wheelhouse (bench/wheels) when this machine lacks them: every wheel installed
    into <wheels>/../site without dependency resolution (--no-index --no-deps: the machine's own packages stand, and one
    pin of a carried package that they do not meet, e.g. datasets 5.2's fsspec<=2026.9.0, cannot abort the check)."""
    missing = [m for m in ("datasets", "mteb") if importlib.util.find_spec(m) is None]
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if missing and found:
        site = wheels.parent / "site"
        print(f"installing {missing} offline from {wheels} into {site} (--no-deps)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, found)], check=True)
        sys.path.insert(0, str(site))  # this process; the subprocesses of part 5 through PYTHONPATH
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        importlib.invalidate_caches()
    return [m for m in ("datasets", "mteb") if importlib.util.find_spec(m) is None]


def versions(device):
    import accelerate
    import torch
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"== 1. torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
          f"accelerate {accelerate.__version__}; device {name}", flush=True)
    return name


def build_model(toy: bool, device):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    import modeling_xprt as mx

    tok = AutoTokenizer.from_pretrained(str(HERE / "tokenizer"))
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if toy else {}
    cfg = BertConfig(vocab_size=tok.vocab_size, attn_implementation="sdpa", **small)
    torch.manual_seed(0)
    model = mx.XPRTModel(BertForMaskedLM(cfg)).to(device).train()
    teacher = BertForMaskedLM(cfg).bert.to(device).eval().requires_grad_(False)
    return tok, model, teacher


def real_rows(max_length, seed=0):
    """Groups of real text, as train.py reads them: the bundled documents (data/docs.jsonl) cut into passages at
    paragraph ends, each at most about max_length words (so passages have their real, uneven lengths and batches their
    real padding); a group = a passage, 4 other passages of its document (related), one of another document."""
    import random

    rng = random.Random(seed)
    docs = []
    for line in (ROOT_DIR / "data" / "docs.jsonl").read_text(encoding="utf-8").splitlines():
        words, passages = [], []
        for para in json.loads(line)["text"].split("\n"):
            w = para.split()
            if words and len(words) + len(w) > max_length:
                passages.append(" ".join(words))
                words = []
            words += w[:max_length]
        if words:
            passages.append(" ".join(words))
        if len(passages) >= 5:
            docs.append(passages)
    rows = []
    for d, passages in enumerate(docs):
        for i, anchor in enumerate(passages):
            others = passages[:i] + passages[i + 1:]
            rows.append({"doc_id": f"d{d}", "anchor": anchor, "related": rng.sample(others, 4),
                         "random_passage": rng.choice(docs[(d + 1) % len(docs)])})
    return rows


def grouped_batches(rows, groups, seed=0):
    """Batches of `groups` rows as train.py draws them (batches.LengthGroupedBatchSampler over the anchor and related
    passages' characters: similar lengths together, as little padding as the data allows), repeated when the data is
    smaller than the batch."""
    from plumbing import batches
    rows = rows * -(-groups * 4 // len(rows))  # at least four batches
    lengths = [len(r["anchor"]) + sum(len(x) for x in r["related"]) for r in rows]
    return [[rows[i] for i in b] for b in batches.LengthGroupedBatchSampler(lengths, groups, seed)]


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def step_bench(tok, model, teacher, device, args, peak):
    """Part 2: what train.py runs, a step at doubling groups until memory runs out -> the largest that fits: real
    batches (length-grouped, their padding), collated inside the timed step (train.py collates in its loop), moved to
    the device, forward, backward, optimiser; MFU from run_log.step_flops, which counts the padded tokens the device
    computes, over the whole step's time, collation included."""
    import torch

    import modeling_xprt as mx
    from plumbing import batches, run_log
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    collator = mx.XPRTCollator(tok, max_length=args.max_length, seed=0)
    rows = real_rows(args.max_length)
    best, groups = None, 8 if not args.toy else 2
    print(f"== 2b. the bf16 xPRT step (autocast, fp32 weights), {'toy config' if args.toy else 'BERT-base config'}, "
          f"at most {args.max_length} tokens per passage, retention on; real batches of data/docs.jsonl "
          f"({len(rows)} groups), length-grouped, collated inside the step", flush=True)
    while groups <= args.max_groups:
        todo = grouped_batches(rows, groups)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            clock = {"collate": 0.0}

            def step(rows_b):
                t0 = time.perf_counter()
                cpu_batch = collator(rows_b)
                clock["collate"] += time.perf_counter() - t0
                batch = batches.batch_to_device(cpu_batch, device)
                with amp:
                    out = model(batch, teacher=teacher, retention_weight=40.0)
                out["loss"].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return cpu_batch, out

            step(todo[0])  # warm-up
            sync(device)
            clock["collate"], times, flops, real, proc = 0.0, [], 0.0, 0, 0
            for rows_b in todo[1:4]:
                t0 = time.perf_counter()
                cpu_batch, out = step(rows_b)
                sync(device)
                times.append(time.perf_counter() - t0)
                flops += run_log.step_flops(model, cpu_batch, retention=True)
                r, p = batches.padding_efficiency(cpu_batch)
                real, proc = real + r, proc + p
        except torch.cuda.OutOfMemoryError:
            print(f"  {groups:5d} groups: out of memory", flush=True)
            break
        t, n = sum(times), len(times)
        mem = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        mfu = flops / t / peak if peak else None  # None: the device's peak is not known (a CPU)
        best = {"groups": groups, "step_s": t / n, "collate_s": clock["collate"] / n, "tokens_per_s": real / t,
                "padding_efficiency": real / proc, "tflops_per_s": flops / t / 1e12, "mfu": mfu,
                "peak_memory_gib": mem, "loss": out["loss"].item()}
        print(f"  {groups:5d} groups: {t / n:7.3f} s/step (collation {clock['collate'] / n:6.3f} s of it), "
              f"{real / t:10.0f} real tokens/s ({real / proc:.0%} of the processed), {flops / t / 1e12:7.2f} TFLOP/s, "
              f"MFU {'n/a' if mfu is None else f'{mfu:.3f}'}, peak memory "
              f"{'n/a' if mem is None else f'{mem:.1f} GiB'}, loss {best['loss']:.4f}", flush=True)
        del out, cpu_batch
        groups *= 2
    return best, collator(grouped_batches(rows, min(best["groups"], 64 if not args.toy else 4))[0])


# train.py's own loop at two sizes: (hidden, layers, heads, intermediate, tokens per passage, groups per step,
# retention weight). The paper's step (the 2026-12-04 check ran 64 and 128 groups) and experiments/paper's gpu
# scale; --toy shrinks both to a 2-layer model.
LOOP_SIZES = {"bert-base": (768, 12, 12, 3072, 128, 128, 40.0), "harness": (192, 4, 3, 768, 64, 256, 0.0)}
TOY_LOOP_SIZES = {"bert-base": (64, 2, 2, 128, 16, 4, 40.0), "harness": (32, 2, 2, 64, 16, 8, 0.0)}


def loop_groups(folder: Path, max_length: int, n: int) -> Path:
    """n groups of the bundled documents' real passages (real_rows: their uneven lengths, their padding) in
    select_groups.py's schema, the rows repeated under new document ids where the documents hold fewer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from select_groups import group_schema

    rows = real_rows(max_length)
    rows = [{**rows[i % len(rows)], "doc_id": f"{rows[i % len(rows)]['doc_id']}-{i // len(rows)}", "group_index": i,
             "anchor_index": 0, "anchor_centrality": 0.9, "related_index": [1, 2, 3, 4], "related_cosine": [0.8] * 4,
             "related_tfidf": [0.3] * 4, "related_rrf": [0.2] * 4, "num_passages": 6} for i in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), folder / "shard-00000.parquet")
    (folder / "stats.json").write_text(json.dumps({"groups": len(rows)}))
    return folder


def stock_step(cfg, device, rows: int, tokens: int, peak, steps: int = 6, compiled: bool = False) -> dict:
    """The peer: a stock transformers BertForMaskedLM step of the same config in bf16 autocast (on a GPU), on `rows`
    full sequences of `tokens` (the passages xPRT's encoder reads a step), 15% of positions labelled, forward with the
    full vocabulary logits, backward, AdamW as train.py builds it (fused on CUDA) -> seconds per step, TFLOP/s
    (FlopCounterMode's count, on an eager step), MFU; compiled: the whole model torch.compile'd (its first step's
    seconds are compile_s, apart from the timed steps)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BertForMaskedLM

    from plumbing import training
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **training.adamw_kernel(device.type))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, cfg.vocab_size, (rows, tokens), generator=g)
    labels = ids.masked_fill(torch.rand(rows, tokens, generator=g) >= 0.15, -100)
    ids, labels = ids.to(device), labels.to(device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:  # eager: a module first met under the counter never compiles
        step()
    flops = counter.get_total_flops()
    if compiled:
        model.compile()
    t0 = time.perf_counter()
    step()  # compiles, when compiled
    sync(device)
    compile_s = time.perf_counter() - t0 if compiled else 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    return {"step_s": dt, "tflops_per_s": flops / dt / 1e12, "mfu": flops / dt / peak if peak else None,
            "compile_s": compile_s}


def train_py_loop(args, device, size: str, peak) -> dict:
    """Part 2: train.py's own loop (train.main in this process: its loader and workers, one move to the device, the
    step, its FLOP count), bf16 on a GPU, at one size of LOOP_SIZES, on real length-grouped groups. Three runs:
      timed     24 steps logged every 6 (toy: 12, every 3): windows 2 and 3 give seconds per step, MFU (train.py's
                own count, its FlopCounterMode step included: one a window), the share of the time the loop waited
                for data (data_wait_share); two steps of window 4 run under torch.profiler (the top kernels); the
                peak memory
      counted   3 steps under bench_step_ops' counter: host syncs and aten ops of the steady step
      stock     a stock BertForMaskedLM step of the same config on the passages xPRT's encoder reads (stock_step)"""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    import train
    from bench.bench_step_ops import count_steps
    from plumbing import run_log

    hidden, layers, heads, inner, max_length, groups, retention = (TOY_LOOP_SIZES if args.toy else LOOP_SIZES)[size]
    every = 3 if args.toy else 6  # logging steps: 4 windows, the first warms up, the last is profiled
    steps = 4 * every
    work = Path(args.out) / f"loop_{size}"
    tok = AutoTokenizer.from_pretrained(str(HERE / "tokenizer"))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=inner, attn_implementation="sdpa")
    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    data = loop_groups(work / "groups", max_length, groups * (steps + 1))
    argv = ["--model_name_or_path", str(work / "model"), "--groups_dir", str(data), "--max_length", str(max_length),
            "--per_device_train_batch_size", str(groups), "--retention_weight", str(retention), "--seed", "0",
            "--max_document_groups_per_batch", "0", "--no_save_model", "--report_to", "none", "--overwrite",
            "--learning_rate", "1e-5", "--pad_to_multiple_of", "8"] + (["--mixed_precision", "bf16"]
                                                                       if device.type == "cuda" else [])
    print(f"== 2. train.py's own loop, {size} ({layers} x {hidden}, {max_length} tokens, {groups} groups a step, "
          f"retention {retention:g}{', bf16' if device.type == 'cuda' else ''}): {steps} steps", flush=True)
    # two steps of the last window that neither count FLOPs (its first step: train_loop's FlopCounterMode) nor log
    profiled, top = (3 * every + 2, 4 * every - 1), []
    step_done, prof = run_log.LogWindow.step_done, torch.profiler.profile(activities=[
        torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda"
                                                else []))

    def done(window, state, *a, **kw):  # the profiler over two steady steps that are not logging steps
        if state.completed_steps == profiled[0] - 1:
            prof.__enter__()
        out = step_done(window, state, *a, **kw)
        if state.completed_steps == profiled[1]:
            sync(device)
            prof.__exit__(None, None, None)
        return out

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run_log.LogWindow.step_done = done
    t0 = time.time()
    try:
        train.main(argv + ["--output_dir", str(work / "timed"), "--max_train_steps", str(steps), "--logging_steps",
                           str(every)])
    finally:
        run_log.LogWindow.step_done = step_done
    wall = time.time() - t0
    memory = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    log = [json.loads(line) for line in (work / "timed" / "train_log.jsonl").read_text().splitlines()]
    steady = [r for r in log if every < r["step"] <= 3 * every]  # windows 2 and 3: after the warm-up, unprofiled
    mean = {k: sum(r.get(k) or 0 for r in steady) / len(steady)
            for k in ("time_per_step_s", "tflops_per_s", "mfu", "data_wait_share", "padding_efficiency")}
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))
    total = sum(getattr(e, key) for e in events) or 1
    top = [(e.key, getattr(e, key) / total) for e in events[:8]]
    counted = count_steps(argv + ["--output_dir", str(work / "counted"), "--max_train_steps", "3", "--logging_steps",
                                  "3"], 3)
    syncs, aten = counted[1][0], counted[1][1]
    peer = stock_step(cfg, device, groups * 5, max_length + 2, peak)
    rate = "mfu" if peak else "tflops_per_s"
    out = {"size": size, "groups": groups, "steps": steps, "wall_s": round(wall, 1), **mean,
           "host_syncs_per_step": syncs, "aten_ops_per_step": aten, "peak_memory_gib": memory, "top": top,
           "stock": peer, "vs_stock": mean[rate] / peer[rate] if peer[rate] else None}
    out["modes"] = compiled_modes(args, device, size, argv, work, steps, every, mean, peer, cfg, groups, max_length,
                                  peak)
    print(f"  {mean['time_per_step_s'] * 1000:8.1f} ms/step, {mean['tflops_per_s']:.3f} TFLOP/s, MFU "
          f"{'n/a' if not peak else f'{mean[rate]:.3f}'}; waiting for data {mean['data_wait_share']:.1%} of the time; "
          f"padding efficiency {mean['padding_efficiency']:.2f}; host syncs {syncs} and aten ops {aten} per steady "
          f"step; peak memory {'n/a' if memory is None else f'{memory:.1f} GiB'}", flush=True)
    print(f"  stock BertForMaskedLM step ({groups * 5} x {max_length + 2} tokens): {peer['step_s'] * 1000:.1f} ms, "
          f"{peer['tflops_per_s']:.3f} TFLOP/s{'' if not peak else f', MFU {peer[rate]:.3f}'}: train.py's step at "
          f"{out['vs_stock']:.2f}x its {'MFU' if peak else 'TFLOP/s'}", flush=True)
    steps_named = f"step {profiled[0]}" if profiled[0] == profiled[1] else f"steps {profiled[0]}-{profiled[1]}"
    print(f"  top kernels of {steps_named} ({key}): "
          + "; ".join(f"{name} {share:.0%}" for name, share in top), flush=True)
    return out


def vocab_three_ways(model, batch, device):
    """Part 3: the step's L_MLM + L_cross rows through the tied projection in bf16 autocast, three ways."""
    import torch
    import torch.nn.functional as F

    from plumbing import batches
    from plumbing.architectures import linear_cross_entropy

    batch = batches.batch_to_device(batch, device)
    g, p, l = batch["input_ids"].shape
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        hidden, vec = model.encode(batch["input_ids"].view(g * p, l), batch["attention_mask"].view(g * p, l))
        dec = model.objective.decode(model, vec.view(g, p, -1), batch, batch["attention_mask"])
        rows = model.transform(torch.cat([hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["mlm_index"]),
                                          dec.index_select(0, batch["cross_rows"])]))
    targets = torch.cat([batch["mlm_targets"], batch["cross_targets"]])
    w, b = model.projection()
    x = rows.detach().clone().requires_grad_(True)
    ways = ["ours fused", "plain"] + (["torch chunked"] if hasattr(F, "linear_cross_entropy") else [])

    def run(how):
        x.grad = w.grad = b.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if how == "torch chunked":
                opts = torch.nn.LinearCrossEntropyOptions() if hasattr(torch.nn, "LinearCrossEntropyOptions") else None
                loss = F.linear_cross_entropy(x, w, targets, linear_bias=b, options=opts)
            else:
                loss = linear_cross_entropy(x, w, b, targets, fused=how == "ours fused")
        loss.float().backward()
        return loss.item(), x.grad.float().clone()

    res = {k: run(k) for k in ways}  # warm-up, and the values
    times = {k: [] for k in ways}
    for _ in range(3):
        for k in ways:
            sync(device)
            t0 = time.perf_counter()
            run(k)
            sync(device)
            times[k].append(time.perf_counter() - t0)
    ref_loss, ref_grad = res["plain"]
    print(f"== 3. vocabulary CE, {x.shape[0]} rows x {x.shape[1]} x {w.shape[0]} words, bf16 autocast, forward + "
          "backward, fastest of 3 interleaved", flush=True)
    out = {}
    for k in ways:
        loss, grad = res[k]
        out[k] = {"s": min(times[k]), "loss": loss, "max_grad_diff_vs_plain": float((grad - ref_grad).abs().max())}
        print(f"  {k:14s} {min(times[k]):8.4f} s  loss {loss:.6f} (plain {ref_loss:.6f})  max |grad - plain| "
              f"{out[k]['max_grad_diff_vs_plain']:.1e}", flush=True)
    return out


def host_syncs(model, teacher, batch, device):
    """Part 4: synchronising CUDA calls in one optimiser step, as torch.cuda.set_sync_debug_mode reports them."""
    import torch

    from plumbing import batches
    if device.type != "cuda":
        print("== 4. host syncs: n/a (no CUDA)", flush=True)
        return None
    batch = batches.batch_to_device(batch, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(batch, teacher=teacher, retention_weight=40.0)
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"== 4. host syncs in one step: {len(syncs)}", flush=True)
    for s in sorted(set(syncs)):
        print(f"  {syncs.count(s)} x {s[:150]}", flush=True)
    return len(syncs)


def end_to_end(args, device):
    """Part 5: select_groups.py -> accelerate launch --mixed_precision bf16 train.py -> evaluate.py, small random
    model, bundled data; returns the score of the trained folder."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    out = Path(args.out)
    model_dir = out / "start"
    tok = AutoTokenizer.from_pretrained(str(HERE / "tokenizer"))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    env = {**os.environ, "HF_HOME": str(out / "hf"), "MTEB_CACHE": str(out / "mteb"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    py = sys.executable
    steps = [
        [py, "select_groups.py", "--input", "data/docs.jsonl", "--model_name_or_path", str(model_dir),
         "--anchor_share", "0.5", "--max_docs", "40" if args.toy else "300", "--output_dir", str(out / "groups"),
         "--overwrite"],
        [py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "bf16"]
        + (["--cpu"] if device.type != "cuda" else []) +
        ["train.py", "--model_name_or_path", str(model_dir), "--groups_dir", str(out / "groups"), "--output_dir",
         str(out / "run"), "--max_train_steps", "4" if args.toy else "20", "--per_device_train_batch_size",
         "4" if args.toy else "32", "--max_length", "32" if args.toy else "128", "--learning_rate", "1e-4",
         "--logging_steps", "2", "--report_to", "none", "--overwrite"],
        [py, "evaluate.py", "--models", str(out / "run" / "model"), "--local_tasks", "data/eval/scifact",
         "--output_dir", str(out / "eval"), "--overwrite"] + (["--limit", "20"] if args.toy else []),
    ]
    print("== 5. select -> train (accelerate launch, bf16) -> evaluate, a random 2-layer model", flush=True)
    for name, cmd in zip(("select_groups.py", "accelerate launch train.py", "evaluate.py"), steps):
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT_DIR, env=env, capture_output=True, text=True)
        print(f"  {name}: rc {proc.returncode} ({time.time() - t0:.0f} s)", flush=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    log = [json.loads(line) for line in (out / "run" / "train_log.jsonl").read_text().splitlines()]
    results = json.loads((out / "eval" / "results.json").read_text())
    score = next(iter(next(iter(results["results"].values())).values()))["main_score"]  # in percent
    print(f"  train.py: {len(log)} logged steps, last loss {log[-1].get('loss'):.4f}, mixed precision bf16; "
          f"saved {out / 'run' / 'model'}; evaluate.py SciFact sample nDCG@10 {score:.2f}", flush=True)
    return {"last_loss": log[-1].get("loss"), "scifact": score}


def selection_speed(args, device):
    """Part 6: select_groups.select_documents against its embedding pass alone, E5-base size, bf16 on a GPU."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    import select_groups as sg
    from plumbing import readers

    tok = AutoTokenizer.from_pretrained(str(HERE / "tokenizer"))
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if args.toy else {}
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # select_groups.selection_device's choice
    model = BertModel(BertConfig(vocab_size=tok.vocab_size, attn_implementation="sdpa", **small)).to(device, dtype)
    lines = (ROOT_DIR / "data" / "docs.jsonl").read_text(encoding="utf-8").splitlines()
    n = args.selection_docs or (4 if args.toy else 1500)
    docs = [readers.Doc(index=k, where=f"docs.jsonl:{k % len(lines) + 1}", doc_id=f"{k}",
                        text=json.loads(lines[k % len(lines)])["text"]) for k in range(n)]
    tfidf = sg.CorpusTfidf()
    tfidf.add_documents([d.text for d in docs])
    tfidf.finalize()
    passages = [p for ps in sg.split_passages([d.text for d in docs], tok) for p in ps]
    n_tokens = sum(len(x) for x in tok(passages, truncation=True, max_length=512)["input_ids"])
    print(f"== 6. selection on {device.type} ({dtype}): {n} documents, {len(passages):,} passages, {n_tokens:,} "
          f"tokens, a {'toy' if args.toy else 'BERT-base (E5-base size)'} encoder", flush=True)
    out = {}
    for batch_size in ((8,) if args.toy else (256, 1024)):
        enc = sg.Encoder(tok, model.eval(), 512, batch_size)
        with torch.inference_mode():
            sg.embed_passages(enc, passages[:batch_size], "")  # warm-up: kernels chosen, memory pooled
            sync(device)
            t = time.perf_counter()
            sg.embed_passages(enc, passages, "")
            sync(device)
            embed_s = time.perf_counter() - t
            t = time.perf_counter()
            res = sg.select_documents(docs, enc, tfidf, sg.PAPER.centrality_threshold, sg.PAPER)
            sync(device)
            select_s = time.perf_counter() - t
        row = {"batch_size": batch_size, "embed_s": round(embed_s, 3), "select_s": round(select_s, 3),
               "embed_tokens_per_s": round(n_tokens / embed_s), "tokens_per_s": round(n_tokens / select_s),
               "passages_per_s": round(len(passages) / select_s), "groups": sum(len(r.groups) for r in res)}
        print(f"  batch {batch_size:5d}: embedding alone {row['embed_tokens_per_s']:>12,} tokens/s; selection "
              f"{row['tokens_per_s']:>12,} tokens/s, {row['passages_per_s']:,} passages/s ({select_s / embed_s:.2f}x "
              f"the embedding's time; FineWeb-Edu's classifier: about 690,000 tokens/s per H100; goal 1,000,000 per "
              "H200)", flush=True)
        out[str(batch_size)] = row
    return out


# part 2's alternatives to the eager step, each a train.py --compile mode (CUDA graphs at the small size only: the
# big step's launches are a small share of its time, and its graphs would hold a copy of its activations)
MODES = {"bert-base": ("default",), "harness": ("default", "reduce-overhead")}


def compiled_modes(args, device, size, argv, work, steps, every, eager, peer, cfg, groups, max_length, peak) -> dict:
    """Part 2's table at one size: train.py's loop eager (the timed run above), and under each --compile mode of
    MODES[size] (timed as the eager run is: windows 2 and 3; the compile seconds and graphs from its own log), beside
    the stock BertForMaskedLM step eager and whole-model compiled -> {mode: {ms a step, MFU or TFLOP/s, compile s,
    graphs, the ratio to the stock eager step}}, printed as a table. All of train.py's runs pad batches to a multiple
    of 8 (--pad_to_multiple_of: the compiled runs' default), so the modes differ in how they compute only."""
    import train

    rate = "mfu" if peak else "tflops_per_s"
    rows = {"eager": {"ms_per_step": eager["time_per_step_s"] * 1000, rate: eager[rate], "compile_s": 0.0,
                      "graphs": 0}}
    for mode in ([] if args.modes == ["eager"] else MODES[size]):
        if mode not in args.modes:
            continue
        out = work / f"compiled_{mode}"
        train.main(argv + ["--output_dir", str(out), "--max_train_steps", str(steps), "--logging_steps", str(every),
                           "--compile", mode])
        log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
        steady = [r for r in log if every < r["step"] <= 3 * every]
        rows[mode] = {"ms_per_step": 1000 * sum(r["time_per_step_s"] for r in steady) / len(steady),
                      rate: sum(r.get(rate) or 0 for r in steady) / len(steady),
                      "compile_s": sum(r.get("compile_s", 0) for r in log), "graphs": log[-1].get("compiled_graphs")}
    stock_compiled = stock_step(cfg, device, groups * 5, max_length + 2, peak, compiled=True) \
        if "stock-compiled" in args.modes else None
    rows["stock eager"] = {"ms_per_step": peer["step_s"] * 1000, rate: peer[rate], "compile_s": 0.0, "graphs": None}
    if stock_compiled:
        rows["stock compiled"] = {"ms_per_step": stock_compiled["step_s"] * 1000, rate: stock_compiled[rate],
                                  "compile_s": stock_compiled["compile_s"], "graphs": None}
    for row in rows.values():
        row["vs_stock"] = row[rate] / peer[rate] if peer[rate] else None
    print(f"  {size}: {'mode':<16} {'ms/step':>9} {rate:>12} {'compile s':>10} {'graphs':>7} {'vs stock':>9}")
    for mode, row in rows.items():
        print(f"  {size}: {mode:<16} {row['ms_per_step']:9.1f} {row[rate] or 0:12.4f} {row['compile_s']:10.1f} "
              f"{'-' if row['graphs'] is None else row['graphs']:>7} {row['vs_stock'] or 0:9.3f}", flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not args.toy and not torch.cuda.is_available():  # its sizes are a GPU's: on a CPU it would swap, then be killed
        raise SystemExit("device_check measures a GPU (BERT-base and the harness's size, bf16) and this machine has "
                         "none: run it on the GPU machine, or with --toy here (its toy sizes, minutes on a CPU)")
    args.max_length = args.max_length or (16 if args.toy else 128)
    args.max_groups = args.max_groups or (8 if args.toy else 2048)
    still_missing = ensure_packages(Path(args.wheels))

    import modeling_xprt as mx
    from plumbing import run_log, training
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    training.matmul_precision_policy()  # train.py's (make_accelerator): fp32 products IEEE, TF32 off
    name = versions(device)
    peak = next((t * 1e12 for k, t in run_log.PEAK_BF16_TFLOPS.items() if k in name), None)
    report = {"device": name, "torch": torch.__version__,
              "loop": {size: train_py_loop(args, device, size, peak) for size in args.loop_sizes}}
    tok, model, teacher = build_model(args.toy, device)
    if args.memory_sweep:
        report["step"], _ = step_bench(tok, model, teacher, device, args, peak)
    batch = mx.XPRTCollator(tok, max_length=args.max_length, seed=0)(grouped_batches(real_rows(args.max_length),
                                                                                      4 if args.toy else 64)[0])
    report.update(vocab=vocab_three_ways(model, batch, device), host_syncs=host_syncs(model, teacher, batch, device))
    if not args.skip_e2e:
        if still_missing:
            print(f"== 5. skipped: {still_missing} missing from this machine and from {args.wheels} "
                  "(bash bench/device_wheels.sh)")
            report["e2e"] = {"skipped": f"{still_missing} missing"}
        else:
            report["e2e"] = end_to_end(args, device)
    if not args.skip_selection:
        report["selection"] = selection_speed(args, device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "device_check.json").write_text(json.dumps(report, indent=1))
    first = report["loop"][args.loop_sizes[0]]
    print(f"ratio: {first['vs_stock']:.4f}")  # train.py's step over the stock step, MFU (TFLOP/s on a CPU)
    return report


if __name__ == "__main__":
    main()
