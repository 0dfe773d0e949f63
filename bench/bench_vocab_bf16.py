"""
The fused vocabulary kernel (plumbing/architectures.py's chunked linear_cross_entropy / linear_kl_div; fused_vocab.py
before the move to plumbing/) under bf16 autocast, this tree's against an earlier revision's, in one run: speed
(forward + backward, interleaved, fastest of --repeats) and each one's error against fp32 (the same rows without
autocast): the loss, and the gradients of the rows, the weight and the bias (relative: ||g_bf16 - g_fp32|| /
||g_fp32||).

    python -m bench.bench_vocab_bf16                       # BERT-base's head: 768 wide, 30,522 words, 1,024 rows
    python -m bench.bench_vocab_bf16 --before 7d71bbd      # the revision to compare with (its kernel: kernel_at)
    python -m bench.bench_vocab_bf16 --toy                 # seconds

Rows: 3/4 hard-target (L_MLM, L_cross), 1/4 soft-target (L_self's KL to teacher rows), as one sweep. The last line is
`ratio: <after / before seconds>`. On a CPU this says what the change costs there; what it buys is on a GPU (the
weight gradient's GEMM in bf16 instead of fp32, the padded vocabulary): bench/README.md's time model.
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import ROOT, add_toy_flag, toy_sized


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="7d71bbd",
                   help="git revision whose vocabulary kernel is the 'before' (plumbing/architectures.py, or "
                        "fused_vocab.py before the move; default: the main this change started from)")
    p.add_argument("--rows", type=int, default=1024, help="rows through the vocabulary (3/4 hard, 1/4 soft)")
    p.add_argument("--hidden", type=int, default=768, help="hidden width")
    p.add_argument("--vocab", type=int, default=30522, help="vocabulary size (BERT's 30,522: not a multiple of 64)")
    p.add_argument("--chunk_size", type=int, default=1024, help="rows per chunk of the kernel (its default)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (the fastest is reported)")
    add_toy_flag(p, "256 rows x 64 wide x 1,000 words, chunks of 64")
    return toy_sized(p.parse_args(argv), rows=256, hidden=64, vocab=1000, chunk_size=64, repeats=2)


KERNEL_FILES = ("plumbing/architectures.py", "fused_vocab.py")  # where the kernel lives, newest layout first
KERNEL_DEFS = ("def linear_cross_entropy(", "def vocab_sweep(")  # its entry points, newest first (run)


def kernel_at(rev: str):
    """The vocabulary kernel as of git revision rev, imported as its own module: the first of KERNEL_FILES that exists
    at rev and defines the kernel (plumbing/architectures.py, which imports no file of the repository; fused_vocab.py
    before the move to plumbing/, when architectures.py held only the encoder's parts)."""
    tried = []
    for where in KERNEL_FILES:
        src = subprocess.run(["git", "show", f"{rev}:{where}"], cwd=ROOT, capture_output=True, text=True)
        if src.returncode:
            tried.append(f"{where}: " + (src.stderr.strip().splitlines() or ["not found"])[-1])
        elif any(d in src.stdout for d in KERNEL_DEFS):
            break
        else:
            tried.append(f"{where}: defines no vocabulary kernel ({' / '.join(KERNEL_DEFS)})")
    else:
        raise SystemExit(f"--before {rev}: " + "; ".join(tried))
    path = Path(tempfile.mkdtemp()) / f"fused_vocab_{rev}.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(args):
    g = torch.Generator().manual_seed(0)
    n_ce = args.rows * 3 // 4
    hidden = torch.randn(args.rows, args.hidden, generator=g)
    teacher = hidden[n_ce:] + 0.3 * torch.randn(args.rows - n_ce, args.hidden, generator=g)
    weight = torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5 * 2
    bias = torch.randn(args.vocab, generator=g) * 0.1
    targets = torch.randint(args.vocab, (n_ce,), generator=g)
    return hidden, teacher, weight, bias, targets, n_ce


def run(mod, data, args, bf16: bool):
    """The hard-target term plus the soft-target term through `mod`'s fused kernel (linear_cross_entropy +
    linear_kl_div; an older tree's vocab_sweep), forward + backward -> (loss, grads of rows, weight, bias)."""
    hidden, teacher, weight, bias, targets, n_ce = data
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if hasattr(mod, "linear_cross_entropy"):
            total = (mod.linear_cross_entropy(h[:n_ce], w, b, targets, chunk_size=args.chunk_size)
                     + mod.linear_kl_div(h[n_ce:], teacher, w, b, chunk_size=args.chunk_size))
        else:
            total, _ = mod.vocab_sweep(w, b, ce=[(h[:n_ce], targets, 1.0)], kl=[(h[n_ce:], teacher, 1.0)],
                                       chunk_size=args.chunk_size)
    total.backward()
    return total.detach().float(), h.grad, w.grad, b.grad


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, ROOT)
    from plumbing import architectures as fused_vocab
    data = inputs(args)
    kernels = {"before": kernel_at(args.before), "after": fused_vocab}
    ref = run(fused_vocab, data, args, bf16=False)  # fp32, no autocast: the reference for both
    times = {k: [] for k in kernels}
    for k, mod in kernels.items():  # warm-up
        run(mod, data, args, bf16=True)
    for _ in range(args.repeats):
        for k, mod in kernels.items():
            t0 = time.perf_counter()
            run(mod, data, args, bf16=True)
            times[k].append(time.perf_counter() - t0)
    print(f"vocabulary kernel, {args.rows} rows ({args.rows * 3 // 4} hard, {args.rows - args.rows * 3 // 4} soft) x "
          f"{args.hidden} x {args.vocab} words, chunks of {args.chunk_size}, bf16 autocast on CPU "
          f"({torch.get_num_threads()} threads), fastest of {args.repeats}; errors against fp32")
    out = {}
    for k, mod in kernels.items():
        loss, gh, gw, gb = run(mod, data, args, bf16=True)
        out[k] = {"s": min(times[k]), "loss_rel": rel(loss, ref[0]), "grad_rows_rel": rel(gh, ref[1]),
                  "grad_weight_rel": rel(gw, ref[2]), "grad_bias_rel": rel(gb, ref[3]), "grad_weight_dtype":
                  str(gw.dtype)}
        print(f"  {k:7s} ({args.before if k == 'before' else 'this tree'}): {out[k]['s']:7.3f} s   loss rel. err. "
              f"{out[k]['loss_rel']:.1e}   grad rel. err.: rows {out[k]['grad_rows_rel']:.1e}, weight "
              f"{out[k]['grad_weight_rel']:.1e}, bias {out[k]['grad_bias_rel']:.1e}", flush=True)
    print(f"ratio: {out['after']['s'] / out['before']['s']:.3f}")
    return out


if __name__ == "__main__":
    main()
