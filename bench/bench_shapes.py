"""How many input shapes an epoch of train.py's batches has, by --pad_to_multiple_of: each distinct shape is one graph
a compiled step (--compile) builds, and one CUDA graph under reduce-overhead.

    python -m bench.bench_shapes                  # the bundled documents' real passages, MiniLM, 128 tokens, 32 groups
    python -m bench.bench_shapes --groups_dir outputs/demo/groups --max_length 64 --per_device_train_batch_size 8
    python -m bench.bench_shapes --toy            # seconds: 64 groups at 32 tokens

Builds the batches as train.py does (its load_data: the objective's collator over the length-grouped sampler, the
groups tokenised once), for one epoch, at each --multiples value, and prints the distinct widths of the encoder's
inputs and the distinct shape sets of a batch's inputs, and the padding efficiency (real tokens over processed) --
the cost of the rounding, as a ratio against the unpadded epoch's. Last line: `ratio: <shapes at the largest multiple
over shapes unpadded>`."""

import argparse
import sys

import tempfile
from pathlib import Path

from bench import ROOT, add_toy_flag, toy_sized  # noqa: F401  (the repository on sys.path; offline defaults)


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--groups_dir", default=None,
                   help="a select_groups.py output folder (default: groups of the bundled documents' real passages, "
                        "device_check.loop_groups)")
    p.add_argument("--max_groups", type=int, default=4096, help="groups of the default folder")
    p.add_argument("--model_name_or_path", default="all-MiniLM-L6-v2", help="the start (its tokenizer)")
    p.add_argument("--objective", default="xprt", help="train.py --objective")
    p.add_argument("--max_length", type=int, default=128, help="train.py --max_length")
    p.add_argument("--per_device_train_batch_size", type=int, default=32, help="groups per batch")
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 8, 16], help="--pad_to_multiple_of values")
    add_toy_flag(p, "64 groups at 32 tokens, batches of 8")
    args = toy_sized(p.parse_args(argv), max_groups=64, max_length=32, per_device_train_batch_size=8)
    import torch

    import train
    from plumbing.batches import padding_efficiency
    from plumbing.training import make_accelerator

    if args.groups_dir is None:
        from bench.device_check import loop_groups, real_rows

        n = min(args.max_groups, len(real_rows(args.max_length)))
        args.groups_dir = str(loop_groups(Path(tempfile.mkdtemp(prefix="xprt_shapes_")), args.max_length, n))
    rows = {}
    for m in args.multiples:
        targs = train.parse_args(["--model_name_or_path", args.model_name_or_path, "--groups_dir", args.groups_dir,
                                  "--output_dir", "/dev/null", "--objective", args.objective, "--max_length",
                                  str(args.max_length), "--per_device_train_batch_size",
                                  str(args.per_device_train_batch_size), "--pad_to_multiple_of", str(m),
                                  "--report_to", "none", "--retention_weight", "0", "--retention_final_weight", "0"])
        accelerator = make_accelerator(targs, find_unused_parameters=False)
        model, tokenizer = train.load_pretraining_model(accelerator, targs)
        _, sampler, loader = train.load_data(accelerator, targs, model, tokenizer)
        widths, shapes, real, proc, n = set(), set(), 0, 0, 0
        for batch in loader:
            widths.add(batch["input_ids"].shape[-1] if "input_ids" in batch else None)
            shapes.add(tuple((k, tuple(v.shape)) for k, v in batch.items() if k.endswith("input_ids")
                             and torch.is_tensor(v)))
            r, q = padding_efficiency(batch)
            real, proc, n = real + r, proc + q, n + 1
        rows[m] = {"batches": n, "widths": len(widths), "shapes": len(shapes), "padding_efficiency": real / proc}
    base = rows[args.multiples[0]]
    print(f"{'multiple':>8} {'batches':>8} {'widths':>7} {'shapes':>7} {'padding eff.':>13} {'tokens vs x1':>13}")
    for m, r in rows.items():
        print(f"{m:8d} {r['batches']:8d} {r['widths']:7d} {r['shapes']:7d} {r['padding_efficiency']:13.3f} "
              f"{base['padding_efficiency'] / r['padding_efficiency']:13.3f}")
    print(f"ratio: {rows[max(rows)]['shapes'] / base['shapes']:.4f}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
