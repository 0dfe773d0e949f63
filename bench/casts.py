"""The dtype-changing copies of one xPRT step under bf16 autocast, counted at the dispatcher (issue 55 item 4).

On a GPU a cast is a memory-bound kernel: it reads the tensor and writes it again in the other dtype, and the
2026-12-04 H200 profile put casts at 12.6% of kernel time. CPU bf16 autocast recasts a matmul's inputs as CUDA's
does (its lists of ops differ in places, and the vocabulary weight gradient's product is cast up only where the
device has no fp32-output GEMM, as here), so a step's casts are counted here, per source line, with their bytes:

  cast    an aten op that only changes a tensor's dtype: `_to_copy` / `to` (autocast's recasts, `.float()`,
          `.to(dtype)`), `copy_` from another dtype, `convert_element_type`, and the casts autograd makes in the
          backward of those (the gradient cast back)
  mixed   any other op whose floating output has a dtype none of its floating inputs has (a bf16 tensor plus an fp32
          one into fp32, say): a dtype change folded into arithmetic, listed apart so that a cast moved into one is
          seen, not hidden (on a CPU such an op still casts, through a temporary: torch.profiler shows aten::to under
          aten::add)
  copy    `copy_` / `clone` within one dtype: not a cast, but a pass over memory all the same (the table lists those
          of 0.05 MB or more)

Bytes are the op's output bytes (written) and its floating inputs' bytes (read). Where an op comes from: the
innermost frame of this repository's code (or of a library, where ours is not on the stack); an op of the backward
pass is put at the forward line that made its node (autograd's anomaly mode records it), marked "(backward)".

One step: XPRTModel.forward + backward (every term, the teacher, retention weight 40, train.py's default clean
student) of a random BERT-base config (vocabulary 30,522, hidden 768) on --groups groups of --max_length tokens
(bench_step's rows), under `torch.autocast("cpu", torch.bfloat16)`, as train.py's accelerator wraps a step. The last
line is `ratio: <bytes the vocabulary loss casts / bytes all casts>` (plumbing/architectures.py's share).

    python -m bench.casts                       # BERT-base config, 1 group x 128 tokens (7 minutes on 2 cores)
    python -m bench.casts --before 7472378      # also the vocabulary kernel of that revision, same model and batch
    python -m bench.casts --toy                 # seconds
    python -m bench.casts --time --before 7472378 --groups 8   # the fp32 step with each kernel, interleaved
"""

import argparse
import collections
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import ROOT, add_toy_flag, toy_sized

CAST_OPS = {"_to_copy", "to", "copy_", "copy", "convert_element_type", "_convert_element_type"}
# ops that make a tensor of another dtype without reading the input's values: not casts
FACTORIES = {"new_empty", "new_empty_strided", "new_full", "new_zeros", "new_ones", "empty_like", "zeros_like",
             "ones_like", "full_like", "rand_like", "randn_like", "randint_like"}
VOCAB_FILE = "plumbing/architectures.py"  # where the vocabulary kernel lives (_FusedLinearCE and its helpers)
ALIASES: dict = {}  # another revision's kernel, imported from a temporary file (--before): its path -> its name here


def _floats(x) -> list:
    """The floating tensors in an op's arguments or results, nested lists included."""
    if torch.is_tensor(x):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _floats(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _floats(y)]
    return []


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _ours(filename: str) -> bool:
    return filename in ALIASES or (filename.startswith(ROOT) and "site-packages" not in filename
                                   and not filename.endswith("bench/casts.py"))


def _where(frames) -> str:
    """'file:line function' of the innermost frame of this repository (else of a library, else '?'); frames are
    (filename, lineno, name) from the outermost to the innermost."""
    frames = [f for f in frames if "/torch/" not in f[0] and not f[0].endswith("bench/casts.py")]
    pick = next((f for f in reversed(frames) if _ours(f[0])), frames[-1] if frames else None)
    if pick is None:
        return "?"
    name = ALIASES.get(pick[0]) or (str(Path(pick[0]).relative_to(ROOT)) if _ours(pick[0]) else Path(pick[0]).name)
    return f"{name}:{pick[1]} {pick[2]}"


def _forward_frames(node) -> list:
    """The forward stack that made autograd node `node`, from anomaly mode's record (a list of formatted frames)."""
    lines = node.metadata.get("traceback_") if node is not None else None
    out = []
    for entry in lines or ():
        head = entry.strip().splitlines()[0]  # 'File "x.py", line 12, in name'
        try:
            file_part, line_part, name_part = head.split(", ", 2)
            out.append((file_part[6:-1], int(line_part[5:]), name_part[3:]))
        except ValueError:
            continue
    return out


class CastCounter(TorchDispatchMode):
    """Counts, while `on`, the casts, the mixed-dtype ops and the same-dtype copies among the aten ops dispatched, per
    (kind, where, op and dtypes): self.ops[key] = [count, bytes read, bytes written]."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.ops = collections.defaultdict(lambda: [0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            self._record(func, args, kwargs or {}, out)
        return out

    def _record(self, func, args, kwargs, out):
        name = func.overloadpacket.__name__
        ins, outs = _floats(args) + _floats(kwargs), _floats(out)
        if not ins or not outs or name in FACTORIES:
            return
        if name in CAST_OPS or name == "clone":
            src = ins[-1] if name in ("copy_", "copy") else ins[0]  # copy_(self, src)
            if src.dtype == outs[0].dtype and name not in ("copy_", "copy", "clone"):
                return  # _to_copy within one dtype: a move between devices or layouts, not counted
            kind = "cast" if src.dtype != outs[0].dtype else "copy"
            read, first = _nbytes(src), src
        elif {t.dtype for t in outs} - {t.dtype for t in ins}:
            kind, read, first = "mixed", sum(_nbytes(t) for t in ins), ins[0]
        else:
            return
        node = torch._C._current_autograd_node()
        if node is not None:
            where = _where(_forward_frames(node)) + " (backward)"
        else:
            where = _where([(f.filename, f.lineno, f.name) for f in traceback.extract_stack()[:-3]])
        dtypes = f"{str(first.dtype)[6:]}->{str(outs[0].dtype)[6:]}"
        rec = self.ops[(kind, where, f"{name} {dtypes}")]
        rec[0] += 1
        rec[1] += read
        rec[2] += sum(_nbytes(t) for t in outs)


def build(args):
    """(model, teacher, batch): bench_step's random BERT-base config (tiny with --toy) and its rows."""
    import modeling_xprt as mx
    from bench.bench_step import build as build_encoder
    from bench.bench_step import make_rows

    tok, mlm, teacher, _ = build_encoder(args.model)
    torch.manual_seed(0)
    model = mx.XPRTModel(mlm).train()
    batch = mx.XPRTCollator(tok, max_length=args.max_length, seed=0)(make_rows(tok, args.groups, args.max_length))
    return model, teacher, batch


def count_step(model, teacher, batch) -> dict:
    """One step (forward + backward under CPU bf16 autocast) with the counter on: {(kind, where, op): [n, read,
    written]}. The kernel's one-time probe (_fp32_out_gemm) runs outside any mode, so a first step counts as any."""
    counter = CastCounter()
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Anomaly Detection")  # on for the backward's forward lines, on purpose
        with counter, torch.autograd.detect_anomaly(check_nan=False):
            counter.on = True
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch, teacher=teacher, retention_weight=40.0)["loss"]
            loss.backward()
            counter.on = False
    return dict(counter.ops)


def totals(ops: dict, kind: str = "cast", vocab_only: bool = False) -> int:
    """Bytes written by the ops of `kind` (of the vocabulary kernel only: vocab_only)."""
    return sum(w for (k, where, _), (_, _, w) in ops.items() if k == kind and (not vocab_only or VOCAB_FILE in where))


def report(ops: dict, title: str):
    mb = 1e6
    print(f"\n== {title}: {totals(ops) / mb:.1f} MB written by casts "
          f"({totals(ops, vocab_only=True) / mb:.1f} MB in {VOCAB_FILE}), {totals(ops, 'mixed') / mb:.1f} MB by "
          f"mixed-dtype arithmetic ({totals(ops, 'mixed', True) / mb:.1f} MB in it), {totals(ops, 'copy') / mb:.1f} "
          f"MB by same-dtype copies ({totals(ops, 'copy', True) / mb:.1f} MB in it) ==")
    print(f"  {'kind':5s} {'n':>5s} {'read MB':>9s} {'written MB':>11s}  op, where")
    for (kind, where, op), (n, r, w) in sorted(ops.items(), key=lambda kv: -kv[1][2]):
        if w >= 0.05 * mb or (kind == "cast" and w > 0):
            print(f"  {kind:5s} {n:5d} {r / mb:9.1f} {w / mb:11.1f}  {op:34s} {where}")
    by_dir = collections.Counter()
    for (kind, _, op), (_, _, w) in ops.items():
        if kind == "cast":
            by_dir[op.split()[1]] += w
    print("  casts by direction (MB written): " + ", ".join(f"{d} {w / mb:.1f}" for d, w in by_dir.most_common()))


def with_kernel(mod):
    """Point the equations at vocabulary module `mod`'s linear_cross_entropy / linear_kl_div; returns the undo."""
    import modeling_xprt as mx
    old = mx.linear_cross_entropy, mx.linear_kl_div
    mx.linear_cross_entropy, mx.linear_kl_div = mod.linear_cross_entropy, mod.linear_kl_div

    def undo():
        mx.linear_cross_entropy, mx.linear_kl_div = old
    return undo


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["bert-base", "tiny"], default="bert-base",
                   help="a random BERT-base config (30,522 words x 768) or bench_step's tiny one")
    p.add_argument("--groups", type=int, default=1, help="groups in the step")
    p.add_argument("--max_length", type=int, default=128, help="tokens per passage")
    p.add_argument("--before", default=None,
                   help="a git revision whose vocabulary kernel (plumbing/architectures.py) is counted too, on the "
                        "same model and batch (bench_vocab_bf16.kernel_at)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--time", action="store_true",
                   help="time the step instead (needs --before): its kernel's and this tree's, interleaved, fastest of "
                        "--repeats, in fp32 as bench_step times it (--bf16: under CPU bf16 autocast); the last line "
                        "is then `ratio: <this tree / before>`")
    p.add_argument("--bf16", action="store_true", help="with --time: under CPU bf16 autocast")
    p.add_argument("--repeats", type=int, default=3, help="with --time: timed steps per kernel")
    add_toy_flag(p, "the tiny model, 2 groups x 16 tokens")
    return toy_sized(p.parse_args(argv), model="tiny", groups=2, max_length=16, repeats=1)


def time_steps(model, teacher, batch, old, args) -> dict:
    """{"before": s, "after": s}: the step with `old`'s kernel and this tree's, interleaved (before, after, before,
    ...) after one warm-up each, fastest of args.repeats (the minimum: other processes only ever add time)."""
    import time

    kernels = {"before": old, "after": None}
    times = {k: [] for k in kernels}

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(batch, teacher=teacher, retention_weight=40.0)["loss"]
        loss.backward()

    for timed in [False] + [True] * args.repeats:
        for k, mod in kernels.items():
            undo = with_kernel(mod) if mod is not None else (lambda: None)
            try:
                t0 = time.perf_counter()
                step()
                if timed:
                    times[k].append(time.perf_counter() - t0)
            finally:
                undo()
    for k, v in times.items():
        print(f"  {k:6s} {min(v):8.2f} s   (runs: {', '.join(f'{x:.2f}' for x in v)})")
    return {k: min(v) for k, v in times.items()}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, teacher, batch = build(args)
    if args.time:
        if not args.before:
            raise SystemExit("--time: name the kernel to time against with --before REV")
        from bench.bench_vocab_bf16 import kernel_at
        print(f"{args.model} config, {args.groups} groups x 5 passages x {args.max_length} tokens, the step (forward "
              f"+ backward, {'CPU bf16 autocast' if args.bf16 else 'fp32'}, {torch.get_num_threads()} threads), "
              f"vocabulary kernel of {args.before} and of this tree, interleaved, fastest of {args.repeats}")
        t = time_steps(model, teacher, batch, kernel_at(args.before), args)
        print(f"ratio: {t['after'] / t['before']:.3f}")
        return t
    print(f"{args.model} config, {args.groups} groups x 5 passages x {args.max_length} tokens, one step under CPU "
          "bf16 autocast (forward + backward)")
    if args.before:
        from bench.bench_vocab_bf16 import kernel_at
        old = kernel_at(args.before)
        ALIASES[old.__file__] = f"{VOCAB_FILE}@{args.before}"
        undo = with_kernel(old)
        try:
            report(count_step(model, teacher, batch), f"vocabulary kernel of {args.before}")
        finally:
            undo()
    ops = count_step(model, teacher, batch)
    report(ops, "this tree")
    print(f"ratio: {totals(ops, vocab_only=True) / max(totals(ops), 1):.3f}")
    return ops


if __name__ == "__main__":
    main()
