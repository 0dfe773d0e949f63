"""
Each similarity-based term under bf16 autocast against fp32, on the same fp32 input vectors: the loss's and the
gradient's relative error. Emulates CUDA's bf16 autocast with the CPU's (`torch.autocast("cpu", torch.bfloat16)`),
which recasts a matmul's inputs the same way.

Inputs (the start of continued pre-training, where rounding matters most): 32 anchors and their s1 at cosine about
0.9, a student 1e-3 cosine away from the frozen teacher (retention), 32 queries with a positive and a negative.

    python -m bench.bench_autocast                                   # this tree's modeling_xprt.py
    python -m bench.bench_autocast --module /tmp/old/modeling_xprt.py # another tree's, e.g. before a change
    python -m bench.bench_autocast --toy                             # 8 vectors of 64

Last line `ratio: <largest relative gradient error>`.
"""

import argparse
import importlib.util
import sys

import torch
import torch.nn.functional as F

from bench import ROOT, add_toy_flag, toy_sized  # noqa: F401  (the repository on sys.path)


def inputs(h: int = 384, n: int = 32, seed: int = 0) -> dict:
    """E5-like vectors: every pair shares a common direction (cosine about 0.8 between groups, about 0.9 between an
    anchor and its s1, so the logits at tau = 0.05 are 14-18), and a student 1e-3 cosine from its teacher."""
    g = torch.Generator().manual_seed(seed)
    noise = lambda: torch.randn(n, h, generator=g) / h ** 0.5  # noqa: E731  (norm about 1)
    common = 2.0 * F.normalize(torch.randn(h, generator=g), dim=0)
    raw = common + noise()
    anchors, s1 = F.normalize(raw, dim=-1), F.normalize(raw + noise(), dim=-1)
    drift = lambda x: F.normalize(x + 0.045 * noise(), dim=-1)  # noqa: E731  (1 - cos = 0.045^2 / 2 = 1e-3)
    negatives = F.normalize(common + noise(), dim=-1)
    return {"anchors": anchors, "s1": s1, "student_a": drift(anchors), "student_s": drift(s1),
            "passages": torch.stack([s1, negatives], dim=1), "doc_ids": torch.arange(n)}


def terms(mx):
    """(name, function of the leaf tensors -> loss) for every similarity-based term of `mx` (a modeling_xprt) and of
    this tree's baselines/."""
    from baselines import contriever

    return [
        ("xp_loss", lambda x: mx.xp_loss(x["anchors"], x["s1"], x["doc_ids"])),
        ("contrastive_random_span", lambda x: contriever.contrastive_random_span(x["anchors"], x["s1"])),
        ("uniformity_loss", lambda x: mx.uniformity_loss(x["anchors"])),
        ("retention_loss", lambda x: mx.retention_loss(x["student_a"], x["student_s"], x["anchors"].detach(),
                                                       x["s1"].detach())),
        ("pair_q_loss", lambda x: mx.pair_q_loss(x["anchors"], x["passages"])),
        ("pair_p_loss", lambda x: mx.pair_p_loss(x["anchors"], x["passages"])),
    ]


def errors(mx, seed: int = 0, n: int = 32, h: int = 384) -> list:
    """[(term, fp32 loss, |loss error| / |loss|, |grad error| / |grad|)] of each term under CPU bf16 autocast."""
    out = []
    for name, fn in terms(mx):
        results = []
        for autocast in (False, True):
            x = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in inputs(h, n, seed).items()}
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = fn(x)
            grads = torch.autograd.grad(loss.float(), [v for v in x.values() if v.requires_grad], allow_unused=True)
            flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
            results.append((loss.detach().float(), flat))
        (l32, g32), (l16, g16) = results
        out.append((name, float(l32), float((l16 - l32).abs() / l32.abs().clamp(min=1e-12)),
                    float((g16 - g32).norm() / g32.norm().clamp(min=1e-30))))
    return out


def load(path):
    spec = importlib.util.spec_from_file_location("modeling_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", default=None, help="a modeling_xprt.py to test (default: this tree's)")
    p.add_argument("--vectors", type=int, default=32, help="anchors (and queries) per batch")
    p.add_argument("--hidden", type=int, default=384, help="vector width (MiniLM's 384)")
    add_toy_flag(p, "8 vectors of 64")
    args = toy_sized(p.parse_args(argv), vectors=8, hidden=64)
    if args.module:
        mx = load(args.module)
    else:
        import modeling_xprt as mx
    rows = errors(mx, n=args.vectors, h=args.hidden)
    print(f"{args.module or 'modeling_xprt.py'}: bf16 autocast (CPU) vs fp32, same fp32 inputs, {args.vectors} "
          f"vectors of {args.hidden}")
    print(f"{'term':26s} {'fp32 loss':>12s} {'loss rel. err.':>15s} {'grad rel. err.':>15s}")
    for name, loss, le, ge in rows:
        print(f"{name:26s} {loss:12.6g} {le:15.2e} {ge:15.2e}")
    print(f"ratio: {max(r[3] for r in rows):.4f}")
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
