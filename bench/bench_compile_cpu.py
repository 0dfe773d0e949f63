"""Is `train.py --compile` worth it on a CPU? The compiled xPRT step against the eager one, interleaved in one run.

Per size, two copies of one model (the same weights, the same decoder, the same batch), one with train.py's regional
compilation (training.compile_layers, mode default), one eager, each training with AdamW on the same batch of the
groups (train.py's batches: plumbing.batches.document_batches, padded to a multiple of 8 as --compile pads), with
the retention term on (train.py's default: the frozen teacher's pass and the clean student's). The compiled copy's
first step compiles (on a fresh inductor cache: a new machine's cost); then the steps alternate eager / compiled,
the order swapped each round, so that other processes on a shared CPU slow both sides alike. Reported per size: the
median ms a step of each, the compile seconds (dynamo's timers: run_log.compile_seconds, wall; beside them the
process's CPU seconds in that first step, the step included: it compiles in one thread here, so other processes'
share of a shared CPU is left out), and the steps a run must take to win the wall seconds back (compile s / the time
a compiled step saves; "never" when it saves none). The widths a run meets each compile once more (the demo's epoch:
3 input shapes, docs/steps.md), not counted here.

    python -m bench.bench_compile_cpu --groups_dir /work/demo_groups                 # demo size and BERT-base
    python -m bench.bench_compile_cpu --groups_dir /work/demo_groups --sizes minilm  # the demo's size only

Sizes: minilm, the demo's (all-MiniLM-L6-v2, 8 groups, --max_length 64); bert-base, a random BERT-base from its
config with the MiniLM tokenizer (nothing downloaded), at the same batch. Figures: bench/README.md.
"""

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch

from bench import ROOT, add_toy_flag, toy_sized  # noqa: F401  (the repository on sys.path; offline)


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups_dir", default=None, help="a select_groups.py folder (the demo's: experiments/demo.sh; "
                   "default: groups of the bundled documents' real passages, device_check.loop_groups)")
    p.add_argument("--sizes", nargs="+", default=["minilm", "bert-base"], choices=["minilm", "bert-base", "tiny"],
                   help="minilm: the bundled all-MiniLM-L6-v2; bert-base: a random BERT-base config; tiny: --toy's")
    p.add_argument("--groups", type=int, default=8, help="groups a batch (the demo's 8)")
    p.add_argument("--max_length", type=int, default=64, help="tokens a passage (the demo's 64)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each side after the compiling one")
    p.add_argument("--warm_cache", action="store_true",
                   help="use TORCHINDUCTOR_CACHE_DIR as it is (default: a fresh cache, so compiling is timed whole)")
    add_toy_flag(p, "a 2-layer 32-wide BERT, 2 groups, 16 tokens, 1 step")
    return toy_sized(p.parse_args(argv), sizes=["tiny"], groups=2, max_length=16, steps=1, warm_cache=True)


def build(size: str):
    """-> (tokenizer, AutoModelForMaskedLM) of `size`, seeded."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from plumbing.common import resolve_model_path
    from plumbing.model_folder import load_mlm_encoder

    path = resolve_model_path("all-MiniLM-L6-v2")
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    if size == "minilm":
        return tok, load_mlm_encoder(path)[0]
    cfg = BertConfig(vocab_size=tok.vocab_size) if size == "bert-base" else BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    return tok, BertForMaskedLM(cfg)


def bench_size(size: str, args) -> dict:
    import train
    from modeling_xprt import XPRTModel
    from plumbing.batches import document_batches
    from plumbing.run_log import compile_seconds
    from plumbing.training import compile_layers

    tok, mlm = build(size)
    sides = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(1)  # the same fresh heads (decoder, MLM transform) on both sides
        model = XPRTModel(copy.deepcopy(mlm)).train()
        if name == "compiled":
            compile_layers(model, "default")
        sides[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    teacher = copy.deepcopy(mlm.base_model).eval().requires_grad_(False)
    collator = sides["eager"][0].objective.make_collator(tok, max_length=args.max_length, pad_to_multiple_of=8)
    groups = train.load_groups(args.groups_dir)
    rows = next(document_batches(groups, collator, args.groups))  # train.py's first batch
    batch = collator(rows)

    def step(name) -> float:
        model, opt = sides[name]
        t0 = time.perf_counter()
        model(batch, teacher=teacher, retention_weight=40.0)["loss"].backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    before, cpu = compile_seconds(), time.process_time()
    first = step("compiled")  # compiles the forward, and the backward at its first call
    compile_s, compile_cpu = compile_seconds() - before, time.process_time() - cpu
    times = {"eager": [], "compiled": []}
    step("eager")  # warm-up: lazy inits, the allocator
    for i in range(args.steps):
        for name in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            times[name].append(step(name))
    eager, compiled = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
    saved = (eager - compiled) / 1e3
    return {"size": size, "eager_ms": eager, "compiled_ms": compiled, "compile_s": compile_s,
            "compile_cpu_s": compile_cpu, "first_compiled_step_s": first,
            "break_even_steps": compile_s / saved if saved > 0 else None,
            "tokens": int(batch["input_ids"].numel()), "threads": torch.get_num_threads()}


def main(argv=None):
    args = parse_args(argv)
    if not args.warm_cache:  # a fresh cache: what compiling costs on a new machine
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # compiled in this process: its CPU seconds count the whole compile
    if args.groups_dir is None:
        from pathlib import Path

        from bench.device_check import loop_groups

        args.groups_dir = str(loop_groups(Path(tempfile.mkdtemp(prefix="xprt_compile_")), args.max_length, 64))
    print(f"{'size':10} {'eager ms':>9} {'compiled ms':>11} {'speed-up':>8} {'compile s':>9} {'(CPU s)':>8} "
          f"{'break-even steps':>16}")
    rows = []
    for size in args.sizes:  # each row as it is measured
        rows.append(r := bench_size(size, args))
        even = f"{r['break_even_steps']:.0f}" if r["break_even_steps"] is not None else "never"
        print(f"{r['size']:10} {r['eager_ms']:9.0f} {r['compiled_ms']:11.0f} {r['eager_ms'] / r['compiled_ms']:8.2f} "
              f"{r['compile_s']:9.1f} {r['compile_cpu_s']:8.1f} {even:>16}", flush=True)
    print(f"ratio: {rows[-1]['eager_ms'] / rows[-1]['compiled_ms']:.3f}")  # the last size's speed-up
    return rows


if __name__ == "__main__":
    main()
