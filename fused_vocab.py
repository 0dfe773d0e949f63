"""
How the vocabulary terms compute (not in the paper): L_MLM, L_cross and L_self (modeling_xprt.py) each project their
rows onto the vocabulary and take a cross-entropy or a KL; linear_cross_entropy and linear_kl_div do it chunk by chunk
in one fused pass (_FusedLinearCE), never holding the (rows x V) logits. The math is that of plain F.linear +
F.cross_entropy / F.kl_div (fused=False; tests/test_modeling.py compares them with allclose).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy(hidden, weight, bias, targets, fused: bool = True, chunk_size: int = 1024):
    """mean_i -log softmax(hidden_i W^T + b)[targets_i] = F.cross_entropy(F.linear(hidden, W, b), targets).

    hidden (N, D), weight (V, D), bias (V,), targets (N,). 0 (with a zero gradient) for N = 0."""
    if fused:
        return _FusedLinearCE.apply(hidden, weight, bias, targets, None, chunk_size, torch.is_grad_enabled())[0]
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)


def linear_kl_div(hidden, teacher_hidden, weight, bias, fused: bool = True, chunk_size: int = 1024):
    """mean_i KL(softmax(t_i W^T + b) || softmax(hidden_i W^T + b)), t = teacher_hidden (a target: no gradient).

    hidden, teacher_hidden (N, D), weight (V, D), bias (V,). 0 (with a zero gradient) for N = 0."""
    if fused:
        return _FusedLinearCE.apply(hidden, weight, bias, None, teacher_hidden.detach(), chunk_size,
                                    torch.is_grad_enabled())[0]
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0
    with torch.no_grad():
        t_logp = F.log_softmax(F.linear(teacher_hidden.detach(), weight, bias).float(), dim=-1)
    return F.kl_div(F.log_softmax(F.linear(hidden, weight, bias).float(), -1), t_logp, log_target=True,
                    reduction="batchmean")


# Scratch (chunk, V) fp32 buffers kept across calls and steps, per device and slot: on CPU a fresh 125 MB tensor costs
# its page faults on every touch (glibc maps and unmaps blocks this large each time). Only the forward of
# _FusedLinearCE writes them, and nothing that outlives the call points into them. On a GPU the caching allocator
# reuses memory anyway; this only keeps the peak from being handed back between steps.
_SCRATCH: dict = {}


def _scratch(slot: str, rows: int, cols: int, device) -> torch.Tensor:
    key = (slot, str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < rows * cols:
        _SCRATCH[key] = buf = None  # free the old one before the bigger one is made
        _SCRATCH[key] = buf = torch.empty(rows * cols, dtype=torch.float32, device=device)
    return buf[: rows * cols].view(rows, cols)


def _logits_into(out, h, weight, bias):
    """out (r, V) fp32 <- h W^T + b. The bias is added in place after the matmul writes straight into the reused
    buffer (addmm(bias, ..., out=buf) first copies the broadcast bias into the buffer, an extra pass over it); in low
    precision (or under autocast) the matmul runs in its own dtype and is copied up, as .float() would."""
    if h.dtype == weight.dtype == out.dtype and not torch.is_autocast_enabled(h.device.type):
        return torch.mm(h, weight.t(), out=out).add_(bias)
    return out.copy_(torch.addmm(bias, h, weight.t()))


# The vocabulary rows padded inside the kernel to a multiple of this (tensor-core tiles want leading dimensions that are
# multiples of 8; MosaicBERT pads BERT's 30,522 words to 30,528 = 64 x 477). Padded words have a zero weight row and
# a bias of -1e30: probability exactly 0, so they add nothing to a loss or a gradient, and their gradient rows are cut.
_PAD = 64
_PAD_BIAS = -1e30


def _padded(weight, bias, dtype):
    """(W, b) once per call: W in the compute dtype (one cast, not one per chunk) and, in low precision or on CUDA,
    the vocabulary padded to a multiple of _PAD -> (W' (V', H), b' (V',))."""
    w = weight.to(dtype) if dtype is not None else weight
    v = weight.shape[0]
    vp = -(-v // _PAD) * _PAD
    if vp == v or (dtype is None and weight.device.type != "cuda"):  # fp32 on a CPU: no tiles to fill
        return w, bias
    w_pad = w.new_zeros((vp, w.shape[1]))
    w_pad[:v] = w
    b_pad = bias.new_full((vp,), _PAD_BIAS)
    b_pad[:v] = bias
    return w_pad, b_pad


_FP32_OUT: dict = {}


def _fp32_out_gemm(device) -> bool:
    """Whether this device's addmm takes low-precision inputs into an fp32 output (out_dtype: CUDA; the CPU has no
    such kernel). Probed once per device type on an 8 x 8 product, outside any dispatch mode: a FLOP counter or a
    profiler active at the first call must not decide the kernel's path for the whole run (torch 2.11's
    FlopCounterMode raised TypeError on this op, and the run kept the slower path). weight_grad_path probes it at
    start-up and says which path was chosen."""
    from torch.utils._python_dispatch import _disable_current_modes

    if device.type not in _FP32_OUT:
        with _disable_current_modes():
            try:
                a = torch.ones(8, 8, dtype=torch.bfloat16, device=device)
                c = torch.zeros(8, 8, dtype=torch.float32, device=device)
                torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
                _FP32_OUT[device.type] = bool(c[0, 0].item() == 8.0)
            except (RuntimeError, TypeError, NotImplementedError):
                _FP32_OUT[device.type] = False
    return _FP32_OUT[device.type]


def weight_grad_path(device) -> str:
    """The vocabulary weight gradient's path on this device in low precision (_add_weight_grad), probed now: a
    run's start-up line."""
    if _fp32_out_gemm(torch.device(device)):
        return "bf16 inputs into the fp32 accumulator in one GEMM (addmm out_dtype)"
    return "one bf16 product per chunk added in fp32 (this device has no fp32-output GEMM)"


def _add_weight_grad(grad_w, g, hs, first: bool):
    """grad_w (V', H) fp32 (+)= g^T hs: the step's largest matrix product. In fp32 (g fp32) in place. In
    low precision (g bf16, under autocast) it must not stay an in-place addmm_, which autocast never casts (an fp32
    GEMM at a fifteenth of the bf16 rate): the product runs on bf16 inputs, accumulated in fp32 inside the GEMM, and
    lands in the fp32 accumulator directly where the device can (CUDA's out_dtype), else through one bf16 product per
    chunk added in fp32 (one rounding of 2^-9 per chunk, tests/test_bf16.py bounds the result)."""
    beta = 0.0 if first else 1.0  # beta 0: the accumulator starts as uninitialised memory
    if g.dtype == torch.float32:
        return grad_w.addmm_(g.t(), hs.float(), beta=beta)
    with torch.autocast(g.device.type, enabled=False):  # the dtypes are chosen here
        hs = hs.to(g.dtype)
        if _fp32_out_gemm(g.device):
            return torch.addmm(grad_w, g.t(), hs, beta=beta, out_dtype=torch.float32, out=grad_w)
        part = torch.mm(g.t(), hs)
        return grad_w.copy_(part) if first else grad_w.add_(part)


def _softmax_(z):
    """z (r, V) <- softmax(z) IN PLACE; returns log-sum-exp (r,) of the input rows."""
    m = z.amax(dim=-1, keepdim=True)
    z.sub_(m).exp_()
    s = z.sum(dim=-1, keepdim=True)
    z.div_(s)
    return (m + s.log()).squeeze(1)


class _FusedLinearCE(torch.autograd.Function):
    """Vocabulary projection + cross-entropy (hard targets) and/or KL (soft targets), chunk by chunk.

    Never holds the (N, V) logits: each chunk's logits give its loss and, at once, its gradients
    w.r.t. hidden, weight and bias (the "fused linear cross-entropy" of Liger-Kernel); backward
    only scales them by the incoming scalar. Same matmul count as plain forward + backward, much
    less memory traffic on (tokens x 30,522) tensors: every chunk reuses one fp32 (chunk, V) buffer
    (two for KL, kept across calls: _scratch) and the softmax runs in place in it.
    Rows: hidden[:len(targets)] have hard targets, the rest soft ones (teacher_hidden); row_scale (N,) is each row's
    weight in the total (1 / N). Returns (total, per-row losses (N,), no gradient).

    Why our own and not torch's chunked F.linear_cross_entropy: it has no KL form (L_self), and on CPU ours measured
    faster on the step's own rows (`python -m bench.bench_step --vocab`; figures in bench/README.md).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher_hidden, chunk_size, compute_grad):
        n = hidden.shape[0]
        row_scale = torch.full((n,), 1.0 / max(n, 1), dtype=torch.float32, device=hidden.device)  # the mean
        n_ce = 0 if targets is None else targets.shape[0]
        # no gradient work at all under torch.no_grad (evaluation)
        need = [compute_grad and x for x in ctx.needs_input_grad[:3]]
        row_loss = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        if n == 0:
            ctx.grads = (torch.zeros_like(hidden) if need[0] else None, None, None)
            ctx.mark_non_differentiable(row_loss)
            return hidden.new_zeros((), dtype=torch.float32), row_loss
        v = weight.shape[0]
        # the matrix products run in autocast's dtype (bf16 / fp16) where it is on, else in the weight's own (None)
        lowp = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else None
        w, b = _padded(weight, bias, lowp)  # (V', H) in the compute dtype, V' a multiple of _PAD
        vp = w.shape[0]
        grad_h = torch.empty_like(hidden) if need[0] else None
        grad_w = torch.empty((vp, weight.shape[1]), dtype=torch.float32, device=hidden.device) if need[1] else None
        grad_b = torch.zeros((vp,), dtype=torch.float32, device=hidden.device) if need[2] else None
        rows = min(chunk_size, n)
        buf = _scratch("logits", rows, vp, hidden.device)
        tbuf = _scratch("teacher", rows, vp, hidden.device) if teacher_hidden is not None else None
        first = True
        # chunks never straddle the hard/soft boundary
        starts = [(s, min(s + chunk_size, n_ce)) for s in range(0, n_ce, chunk_size)]
        starts += [(s, min(s + chunk_size, n)) for s in range(n_ce, n, chunk_size)]
        for s, e in starts:
            h = hidden[s:e]
            r = e - s
            scale = row_scale[s:e]
            if s < n_ce:  # hard targets: CE = lse - logit[target]
                tgt = targets[s:e]
                z = _logits_into(buf[:r], h, w, b)
                z_tgt = z.gather(1, tgt.unsqueeze(1)).squeeze(1)
                row_loss[s:e] = _softmax_(z) - z_tgt
                g = z  # softmax - one_hot(target)
                g[torch.arange(r, device=g.device), tgt] -= 1.0
            else:  # soft targets p = softmax(teacher logits): KL(p || q) = sum p z_t - lse_t - (sum p z - lse)
                zt = _logits_into(tbuf[:r], teacher_hidden[s - n_ce : e - n_ce], w, b)
                p = buf[:r].copy_(zt)
                lse_t = _softmax_(p)
                # sum p log p, before tbuf is reused for the student (a padded word: p = 0 times -1e30, 0)
                # row-wise dot products through a batched matmul: no (r, V) temporary
                kl = torch.bmm(p.unsqueeze(1), zt.unsqueeze(2)).view(-1) - lse_t
                z = _logits_into(tbuf[:r], h, w, b)
                kl -= torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1) - _softmax_(z)  # - sum p log q
                row_loss[s:e] = kl
                g = z.sub_(p)  # softmax(student) - p
            if grad_b is not None:  # fp32, from the fp32 g
                grad_b.addmv_(g.t(), scale)
            g_mm = g if lowp is None else g.to(lowp)  # one cast of the (r, V') gradient, read by both products
            if grad_h is not None:
                gh = g_mm.to(w.dtype) @ w  # (r, H): small
                grad_h[s:e] = gh * scale.unsqueeze(1).to(gh.dtype)
            if grad_w is not None:  # the rows' scales go on the small (r, H) side, never on the (r, V) one
                _add_weight_grad(grad_w, g_mm, h.float() * scale.unsqueeze(1), first)
            first = False
        total = (row_loss * row_scale).sum()
        gw = None if grad_w is None else grad_w[:v].to(weight.dtype)  # the padded words' rows cut
        gb = None if grad_b is None else grad_b[:v].to(bias.dtype)
        # The gradients are intermediates (neither inputs nor outputs), so they may live on ctx; backward hands
        # them over (scaled in place) instead of allocating a scaled copy of the (V, H) weight gradient.
        ctx.grads = (grad_h, gw, gb)
        ctx.mark_non_differentiable(row_loss)
        return total, row_loss

    @staticmethod
    def backward(ctx, grad_out, _grad_rows):
        if ctx.grads is None:
            raise RuntimeError("backward ran twice through the fused vocabulary loss (retain_graph=True): "
                               "its gradients were handed over the first time; use fused=False for that")
        grads, ctx.grads = ctx.grads, None
        return (*(None if g is None else g.mul_(grad_out) for g in grads), None, None, None, None)
