"""The gradient cache (XPRTModel.cached_step, --gradient_cache_chunk): one step with it equals one step without it, the
loss and every gradient, for every objective, for chunks that do and do not divide the batch; its replayed random
state gives each chunk's second pass the dropout of its first.

Exactness needs the same dropout on both sides, while a chunk draws its masks apart from the whole batch's: here
dropout (and attention dropout) is a fixed function of each element's position past the first dimension, the same
whatever the rows around it, so both steps drop the same elements."""

import math

import pytest
import torch
import torch.nn.functional as F

import modeling_xprt as mx
from test_modeling import make_model, tok, toy_rows  # noqa: F401  (tok: a fixture)


def _position_mask(shape, p, device):
    n = math.prod(shape)
    u = torch.frac(torch.sin(torch.arange(n, dtype=torch.float64) * 12.9898 + 78.233) * 43758.5453).abs()
    return (u.view(shape) >= p).to(device)


@pytest.fixture
def positional_dropout(monkeypatch):
    """Dropout as a fixed mask over every dimension but the first (batch-independent), in F.dropout and in SDPA."""
    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        return x * _position_mask(x.shape[1:], p, x.device).to(x.dtype) / (1 - p)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        att = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if attn_mask is not None:
            att = att.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else att + attn_mask
        return dropout(att.softmax(-1), dropout_p) @ v

    monkeypatch.setattr(F, "dropout", dropout)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)


def _step(model, batch, teacher, cached_chunk=None):
    model.zero_grad(set_to_none=True)
    kw = dict(teacher=teacher, retention_weight=40.0, pair_alpha=0.1)
    if cached_chunk:
        out = model.cached_step(batch, cached_chunk, lambda loss: loss.backward(), **kw)
    else:
        out = model(batch, **kw)
        out["loss"].backward()
    return {k: v.detach() for k, v in out.items()}, {n: q.grad.clone() for n, q in model.named_parameters()
                                                     if q.grad is not None}


def _batch(tok, objective, fill_in=True):
    if objective == "pair":
        rows = [{"query": " ".join(r["anchor"].split()[:3]), "positive": r["anchor"],
                 "negatives": [r["random_passage"]]} for r in toy_rows(5)]
        return mx.PairCollator(tok, num_negatives=1)(rows)
    return mx.XPRTCollator(tok, objective=objective, seed=4, fill_in=fill_in)(toy_rows(5, docs=[0, 0, 1, 2, 3]))


@pytest.mark.parametrize("objective,fill_in,retention_student", [
    ("xprt", True, "clean"), ("xprt", True, "masked"), ("xprt", False, "clean"),
    ("contrastive_random_span", True, "clean"), ("self_reconstruction", True, "clean"), ("pair", True, "clean")])
@pytest.mark.parametrize("chunk", [2, 3])  # 5 groups: chunks of 2 + 2 + 1, 3 + 2
def test_cached_step_equals_the_plain_step(tiny_bert, tok, positional_dropout, objective, fill_in, retention_student,
                                            chunk):
    model = make_model(tiny_bert, objective, fill_in=fill_in, retention_student=retention_student).train()
    teacher = mx.load_teacher(str(tiny_bert))
    with torch.no_grad():  # a teacher the student has drifted from: a retention term with a real gradient
        g = torch.Generator().manual_seed(1)
        for q in teacher.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=g))
    batch = _batch(tok, objective, fill_in)
    plain_out, plain_grads = _step(model, batch, teacher)
    cached_out, cached_grads = _step(model, batch, teacher, chunk)
    assert set(plain_out) == set(cached_out)
    for k in plain_out:
        assert torch.allclose(plain_out[k], cached_out[k], atol=1e-5, rtol=1e-5), (k, plain_out[k], cached_out[k])
    assert set(plain_grads) == set(cached_grads)
    for n in plain_grads:
        assert torch.allclose(plain_grads[n], cached_grads[n], atol=1e-6, rtol=1e-4), n


def test_each_chunk_replays_its_dropout(tiny_bert, tok, monkeypatch):
    """Real dropout: a chunk's pass with gradient sees the vectors its pass without gradient gave (the random state
    replayed), so the cached vector gradients belong to the vectors they are applied to."""
    model = make_model(tiny_bert).train()
    first, second = [], []
    orig_vectors, orig_terms = model._chunk_vectors, model._chunk_terms
    monkeypatch.setattr(model, "_chunk_vectors", lambda part: first.append(orig_vectors(part)) or first[-1])

    def terms(part, batch):
        out = orig_terms(part, batch)
        second.append(out[2].detach())
        return out

    monkeypatch.setattr(model, "_chunk_terms", terms)
    model.cached_step(_batch(tok, "xprt"), 2, lambda loss: loss.backward())
    assert len(first) == len(second) == 3
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    # and dropout is on: a second cached step (other random states) gives other vectors
    before = [v.clone() for v in first]
    first.clear()
    model.cached_step(_batch(tok, "xprt"), 2, lambda loss: loss.backward())
    assert not torch.equal(before[0], first[0])
