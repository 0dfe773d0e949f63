"""Every equation's worked example, as its docstring states it, computed through the real function:
the paper map's 14 equation functions (modeling_xprt.py's 12, select_groups.py's centrality and
rrf_score) and finetune.py's pair_alpha_at. test_every_equation_carries_its_example checks that
each docstring still states the number asserted here."""

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

import finetune
import modeling_xprt as mx
import select_groups as sg

E = torch.eye(7)


def head(weight, fused):
    """A model as the vocabulary terms see it: an identity transform, then W, b (V, H), (V,)."""
    return SimpleNamespace(transform=lambda h: h, vocab_weight=weight,
                           vocab_bias=torch.zeros(weight.shape[0]), fused_vocab_loss=fused)


def test_mean_pool():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]])
    assert mx.mean_pool(hidden, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]


def test_info_nce():
    loss = mx.info_nce(E[:1], E[:2], torch.tensor([0]), tau=1.0)
    assert loss.item() == pytest.approx(-math.log(math.e / (math.e + 1)))
    assert round(loss.item(), 4) == 0.3133
    same = torch.ones(1, 3)  # K = 3 keys at one cosine
    loss = mx.info_nce(same, same.repeat(3, 1), torch.tensor([1]), 0.05)
    assert loss.item() == pytest.approx(math.log(3))


def three_groups():
    """3 anchors and their s1 with cos 0.8 to the own and 0.5 to the others (unit vectors in 7 dims:
    a_i = r u + r v_i, s_i = r u + r (0.6 v_i + 0.8 z_i), r = 1/sqrt(2))."""
    r = 1 / math.sqrt(2)
    anchors = torch.stack([r * E[0] + r * E[1 + i] for i in range(3)])
    s1 = torch.stack([r * E[0] + r * (0.6 * E[1 + i] + 0.8 * E[4 + i]) for i in range(3)])
    return anchors, s1


def test_xp_loss_paper_example():
    anchors, s1 = three_groups()
    cos = mx.cosines(anchors, s1)
    assert torch.allclose(cos, torch.full((3, 3), 0.5) + 0.3 * torch.eye(3), atol=1e-6)
    loss = mx.xp_loss(anchors, s1, torch.tensor([0, 1, 2]), tau=0.05).item()
    p = math.exp(16) / (math.exp(16) + 2 * math.exp(10))
    assert math.exp(-loss) == pytest.approx(p, abs=1e-5)
    assert round(math.exp(-loss), 3) == 0.995
    assert loss == pytest.approx(math.log(1 + 2 * math.exp(-6)), abs=1e-5)
    assert round(loss, 4) == 0.0049


@pytest.mark.parametrize("fused", [False, True])
def test_cross_fill_loss_uniform_logits_give_ln_v(fused):
    v, h = 30522, 8
    targets = torch.randint(0, v, (5,))
    loss = mx.cross_fill_loss(head(torch.zeros(v, h), fused), torch.randn(5, h), targets)
    assert loss.item() == pytest.approx(math.log(v), abs=1e-4)
    assert round(loss.item(), 3) == 10.326


@pytest.mark.parametrize("fused", [False, True])
def test_self_fill_loss_equal_distributions_give_zero(fused):
    hidden = torch.randn(6, 8)
    loss = mx.self_fill_loss(head(torch.randn(50, 8), fused), hidden, hidden.clone())
    assert loss.item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_mlm_loss(fused):
    weight = torch.tensor([[math.log(2)], [0.0], [0.0], [0.0]])  # V = 4, H = 1: (ln 2, 0, 0, 0)
    loss = mx.mlm_loss(head(weight, fused), torch.ones(1, 1), torch.tensor([0]))
    assert loss.item() == pytest.approx(-math.log(2 / 5), abs=1e-5)
    assert round(loss.item(), 3) == 0.916


def test_uniformity_loss():
    assert mx.uniformity_loss(E[:2]).item() == pytest.approx(-4.0)
    assert mx.uniformity_loss(E[:1].repeat(2, 1)).item() == pytest.approx(0.0, abs=1e-6)


def test_retention_loss():
    teacher = E[:2]  # cos(anchor_i, related_j) = 1 if i == j else 0
    student = E[:1].repeat(2, 1)  # every cosine 1
    loss = mx.retention_loss(student, student, teacher, teacher, tau=0.05).item()
    assert loss == pytest.approx(math.log(2), abs=1e-6)
    assert round(loss, 3) == 0.693
    equal = mx.retention_loss(teacher, teacher, teacher, teacher)
    assert equal.item() == pytest.approx(0.0, abs=1e-6)


def test_retention_weight_start_middle_end():
    w = [mx.retention_weight(t, 6, 40.0, 0.0) for t in range(7)]
    assert (w[0], w[3], round(w[5], 2), w[6]) == (40.0, 20.0, 6.67, 0.0)
    assert mx.retention_weight(3, 6, 40.0, 0.0, "cosine") == pytest.approx(20.0)


def pair_vectors():
    """q = e1; p+ = 0.8 e1 + 0.6 e2 (cos 0.8 to q); p- = 0.5 e1 + sqrt(0.75) e3 (0.5 to q, 0.4 to
    p+)."""
    q = E[:1]
    positive, negative = 0.8 * E[0] + 0.6 * E[1], 0.5 * E[0] + math.sqrt(0.75) * E[2]
    passages = torch.stack([positive, negative]).unsqueeze(0)  # (B = 1, 1 + n = 2, H)
    return q, passages


def test_pair_q_loss():
    q, passages = pair_vectors()
    loss = mx.pair_q_loss(q, passages, tau=0.05).item()
    assert loss == pytest.approx(math.log(1 + math.exp(-6)), rel=1e-4)
    assert round(loss, 4) == 0.0025


def test_pair_p_loss():
    q, passages = pair_vectors()
    assert mx.cosines(passages[0, :1], passages[0, 1:]).item() == pytest.approx(0.4)
    loss = mx.pair_p_loss(q, passages, tau=0.05).item()
    assert loss == pytest.approx(math.log(1 + math.exp(-8)), rel=1e-3)
    assert round(loss, 5) == 0.00034


def test_pair_loss():
    assert mx.pair_loss(torch.tensor(2.0), torch.tensor(4.0), 0.1).item() == pytest.approx(2.2)


def test_centrality():
    c = sg.centrality([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert c == pytest.approx([2 / math.sqrt(5), 2 / math.sqrt(5), 1 / math.sqrt(5)])
    assert [round(x, 3) for x in c] == [0.894, 0.894, 0.447]


def test_rrf_score_paper_example():
    a, b = sg.rrf_score(1, 6), sg.rrf_score(2, 2)
    assert (round(float(a), 4), round(float(b), 4)) == (0.2443, 0.25)
    assert a < b


def test_pair_alpha_at():
    alphas = [finetune.pair_alpha_at(t, 10, 0.1, "linear") for t in (0, 5, 9)]
    assert alphas == pytest.approx([0.1, 0.05, 0.01])
    assert finetune.pair_alpha_at(9, 10, 0.1, "constant") == 0.1


EXAMPLES = {mx.mean_pool: "(2, 3)", mx.info_nce: "0.3133", mx.xp_loss: "0.0049",
            mx.cross_fill_loss: "10.326", mx.self_fill_loss: "L_self = 0", mx.mlm_loss: "0.916",
            mx.uniformity_loss: "= -4", mx.retention_loss: "0.693", mx.retention_weight: "6.67",
            mx.pair_q_loss: "0.0025", mx.pair_p_loss: "0.00034", mx.pair_loss: "2.2",
            sg.centrality: "0.894", sg.rrf_score: "0.2443", finetune.pair_alpha_at: "0.01 at 9"}


@pytest.mark.parametrize("fn", EXAMPLES, ids=lambda f: f.__name__)
def test_every_equation_carries_its_example(fn):
    doc = " ".join(inspect.getdoc(fn).split())
    assert "worked example" in doc.lower() and EXAMPLES[fn] in doc, \
        f"{fn.__name__}'s docstring lost its example"
