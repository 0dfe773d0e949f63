"""The vocabulary kernel's dtype-changing copies under autocast (issue 55 item 4), counted at the dispatcher by
bench/casts.py: they do not come back, none hides in mixed-dtype arithmetic, and the kernel stays finite and close to
fp32 under fp16 autocast, where the padded words once made the KL a NaN."""

import pytest
import torch

from bench import bench_vocab_bf16 as bv
from bench import casts
from plumbing import architectures

# Bytes written by casts in plumbing/architectures.py in one xPRT step under CPU bf16 autocast at toy size
# (`python -m bench.casts --toy --before 7472378`: a 2-layer 32-wide BERT with the 30,522-word vocabulary, 2 groups
# x 16 tokens): 73,642,820 with 7472378's kernel, 64,501,596 after; 64,502,336 since L_self's row values are combined
# in float64 (issue 65: 20 bytes a row, 37 rows).
BEFORE, AFTER = 73_642_820, 64_502_336


def test_the_vocabulary_kernel_casts_no_more_than_measured():
    """The step's casts in the kernel are at most the figure measured after the change, below the one before it, and
    no mixed-dtype op in the kernel does a cast's work unseen."""
    model, teacher, batch = casts.build(casts.parse_args(["--toy"]))
    ops = casts.count_step(model, teacher, batch)
    vocab = casts.totals(ops, vocab_only=True)
    print(f"casts in the vocabulary kernel: {vocab:,} bytes written (before {BEFORE:,}, after {AFTER:,})")
    assert AFTER < BEFORE
    assert 0 < vocab <= AFTER, vocab
    assert casts.totals(ops, "mixed", vocab_only=True) == 0


@pytest.mark.parametrize("grad", [True, False])
def test_the_kl_casts_down_only_w_its_bias_and_the_gradient(grad):
    """L_self's kernel (one chunk of 40 soft rows, bf16 rows as the encoder hands them, 1,000 words padded to 1,024)
    under bf16 autocast writes fp32 -> bf16 exactly: W and b once, and, where a gradient is wanted, g (40 x 1,024)
    once. Before, autocast also recast the KL's two fp32 row sums' inputs: four more (40 x 1,024) casts."""
    g = torch.Generator().manual_seed(0)
    r, hdim, v, vp = 40, 32, 1000, 1024
    hidden = torch.randn(r, hdim, generator=g).bfloat16().requires_grad_(grad)
    teacher = torch.randn(r, hdim, generator=g).bfloat16()
    weight = torch.randn(v, hdim, generator=g).requires_grad_(grad)
    bias = torch.randn(v, generator=g).requires_grad_(grad)
    counter = casts.CastCounter()
    with torch.set_grad_enabled(grad), counter, torch.autocast("cpu", dtype=torch.bfloat16):
        counter.on = True
        architectures.linear_kl_div(hidden, teacher, weight, bias, chunk_size=64)
    down = sum(w for (kind, _, op), (_, _, w) in counter.ops.items()
               if kind == "cast" and op.endswith("float32->bfloat16"))
    assert down == 2 * (v * hdim + v + (r * vp if grad else 0)), down  # W and b into the padded ones' first v rows


def test_the_kernel_under_fp16_autocast_is_finite_and_near_fp32():
    """fp16 autocast with a vocabulary that is padded (1,000 words): the padded words' bias is fp16's lowest finite
    value, not -1e30 (which fp16 rounds to -inf; 0 x -inf made the KL a NaN before). Loss and every gradient within
    1% of fp32, as tests/test_bf16.py asks of bf16."""
    args = bv.parse_args(["--toy"])
    hidden, teacher, weight, bias, targets, n_ce = bv.inputs(args)

    def run(dtype):
        h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            total = (architectures.linear_cross_entropy(h[:n_ce], w, b, targets, chunk_size=args.chunk_size)
                     + architectures.linear_kl_div(h[n_ce:], teacher, w, b, chunk_size=args.chunk_size))
        total.backward()
        return total.detach(), h.grad, w.grad, b.grad

    ref, low = run(None), run(torch.float16)
    assert all(torch.isfinite(t).all() for t in low)
    errs = [bv.rel(a, b) for a, b in zip(low, ref)]
    print("fp16: loss, rows, weight, bias relative errors:", errs)
    assert all(e <= 1e-2 for e in errs), errs
