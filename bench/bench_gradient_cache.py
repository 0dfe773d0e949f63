"""
The gradient cache (--gradient_cache_chunk) against the plain step: peak memory of one xPRT step at 16, 64 and 256
groups with chunks of 8, and the step time with and without the cache at the same batch. all-MiniLM-L6-v2's
weights (--model), CPU fp32, retention on (the clean student and the teacher), random word passages filling
--max_length.

    python -m bench.bench_gradient_cache                      # MiniLM, 32 tokens per passage, batches 16 64 256
    python -m bench.bench_gradient_cache --max_length 128 --groups 16 64
    python -m bench.bench_gradient_cache --toy      # seconds: 4 groups of 8 tokens, chunks of 2

Each (batch, cache or not) runs in a fresh process (its peak resident memory, ru_maxrss, is the step's, plus the
weights and Python, the same for every run): a warm-up step, then --repeats timed steps, the fastest kept. A plain
step that does not fit (out of memory) is reported as such. Last line `ratio: <cached / plain step time>` at the
largest batch both ran.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench import ROOT, add_toy_flag, build_tiny, toy_sized  # the repository on sys.path; offline defaults
from plumbing import model_folder


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, nargs="+", default=[16, 64, 256], help="groups per step")
    p.add_argument("--chunk", type=int, default=8, help="--gradient_cache_chunk")
    p.add_argument("--max_length", type=int, default=32, help="tokens per passage")
    p.add_argument("--model", default="all-MiniLM-L6-v2",
                   help="the encoder ('tiny': a random 2-layer, 32-wide BERT with MiniLM's tokenizer)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per run (the fastest is kept)")
    add_toy_flag(p, "the tiny encoder, 4 groups of 8 tokens, chunks of 2, 1 repeat")
    p.add_argument("--one", nargs=2, metavar=("GROUPS", "CHUNK"), help=argparse.SUPPRESS)  # a child run
    return toy_sized(p.parse_args(argv), model="tiny", groups=[4], chunk=2, max_length=8, repeats=1)


def child(groups: int, chunk: int, args):
    import resource

    import torch
    from transformers import AutoTokenizer

    import modeling_xprt as mx
    from bench.bench_step import make_rows
    from plumbing.common import resolve_model_path

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = mx.XPRTModel(model_folder.load_mlm_encoder(path)[0]).train()
    teacher = model_folder.load_teacher(path)
    batch = mx.XPRTCollator(tok, max_length=args.max_length, seed=0)(make_rows(tok, groups, args.max_length))

    def step():
        model.zero_grad(set_to_none=True)
        if chunk:
            model.cached_step(batch, chunk, lambda loss: loss.backward(), teacher=teacher, retention_weight=40.0)
        else:
            model(batch, teacher=teacher, retention_weight=40.0)["loss"].backward()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB: the weights, the batch, Python
    step()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"groups": groups, "chunk": chunk, "peak_mb": peak, "before_step_mb": before,
                      "step_s": min(times)}))


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        return child(int(args.one[0]), int(args.one[1]), args)
    tmp = None
    if args.model == "tiny":
        tmp = tempfile.mkdtemp(prefix="bench-gradient-cache-")
        args.model = build_tiny(os.path.join(tmp, "tiny"))
    rows = {}
    for g in args.groups:
        for chunk in (0, args.chunk):
            cmd = [sys.executable, "-m", "bench.bench_gradient_cache", "--one", str(g), str(chunk),
                   "--max_length", str(args.max_length), "--repeats", str(args.repeats), "--model", args.model]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            rows[g, chunk] = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
            r = rows[g, chunk]
            print(f"{g:4d} groups, {'cache ' + str(chunk) if chunk else 'plain':8s}: "
                  + (f"peak {r['peak_mb']:8.0f} MB (before the step {r['before_step_mb']:.0f}), "
                     f"step {r['step_s']:7.2f} s" if r else f"did not run (rc {proc.returncode}: out of memory?)"),
                  flush=True)
    cached = [rows[g, args.chunk] for g in args.groups if rows[g, args.chunk]]
    if len(cached) > 1:
        print(f"cache peak growth {args.groups[0]} -> {cached[-1]['groups']} groups: "
              f"{cached[-1]['peak_mb'] / cached[0]['peak_mb']:.2f}x")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    both = [g for g in args.groups if rows[g, 0] and rows[g, args.chunk]]
    g = both[-1]
    print(f"ratio: {rows[g, args.chunk]['step_s'] / rows[g, 0]['step_s']:.3f}")


if __name__ == "__main__":
    main()
