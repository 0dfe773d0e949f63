"""Revela (revela.py) against a straight-line version of its official code: the language model's two passes written
out layer by layer from the fork's attention (TRUMANCFY/transformers, branch adapt, models/qwen2/modeling_qwen2.py
lines 722-765, the B x B x heads x L x L softmax as the fork computes it) and EncoderModel.forward (TRUMANCFY/Revela,
src/tevatron/llm_retriever/modeling/encoder.py lines 138-171). Tiny random Qwen2 and Llama configs with the MiniLM
tokenizer; dropout off; seconds each."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_same_grads, grads, rows_from_docs
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from baselines import revela as R
from modeling_xprt import XPRTModel
from plumbing.model_folder import load_mlm_encoder, load_xprt_folder, save_xprt_folder

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def build_tiny_lm(path, tokenizer_path, arch: str = "qwen2"):
    """A random causal LM of `arch` (2 layers, 32 hidden, 4 query heads over 2 key/value heads: grouped-query
    attention as Qwen2.5's 14 over 2) with the tokenizer of tokenizer_path, saved to `path`."""
    config_class, model_class = ARCHS[arch]
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    torch.manual_seed(0)
    model_class(config_class(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
                ).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny_lm(request, tmp_path_factory, tiny_bert):
    return build_tiny_lm(tmp_path_factory.mktemp(f"tiny-{request.param}"), tiny_bert, request.param)


@pytest.fixture(scope="module")
def tok(tiny_bert):
    return AutoTokenizer.from_pretrained(tiny_bert)


def make(tiny_bert, tiny_lm, **options):
    """XPRTModel for Revela, dropout off; LoRA's B made non-zero, so that the adapters change the forward."""
    torch.manual_seed(0)
    model = XPRTModel(load_mlm_encoder(str(tiny_bert))[0], objective="revela", lm_name_or_path=tiny_lm, lora_rank=4,
                      lora_dropout=0.0, **options).eval()
    with torch.no_grad():
        for name, p in model.objective.adapters.named_parameters():
            if ".B." in f".{name}":
                p.normal_(0, 0.1)
    return model


def rows_of_docs(n: int):
    """n groups from several documents (data/docs.jsonl), so that each group gets anchors of other documents."""
    rows, seen = [], {}
    for r in rows_from_docs(400):
        if seen.get(r["doc_id"], 0) < 2:
            seen[r["doc_id"]] = seen.get(r["doc_id"], 0) + 1
            rows.append(r)
        if len(rows) == n:
            break
    return rows


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def official_lm_pass(lm, ids, am, kept=None, weights=None):
    """One pass of the LM, written out layer by layer: RMSNorm, q/k/v (LoRA included: the modules' own forward),
    rotary, causal attention with the padding mask as an explicit softmax, and, given the first pass's `kept` keys and
    values and the (B, B) weights, the fork's in-batch attention (lines 722-765) as it computes it. -> (last hidden,
    [(keys, values) per layer])."""
    base = lm.base_model
    n, l = ids.shape
    x = base.embed_tokens(ids)
    pos = torch.arange(l)[None].expand(n, l)
    cos, sin = base.rotary_emb(x, pos)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, L, d)
    causal = torch.ones(l, l, dtype=torch.bool).tril()
    visible = causal[None, None] & am.bool()[:, None, None, :]  # (B, 1, L, L)
    out_kv = []
    for i, layer in enumerate(base.layers):
        a = layer.self_attn
        heads, d = lm.config.num_attention_heads, a.head_dim
        kvh = lm.config.num_key_value_heads
        h = layer.input_layernorm(x)
        q = rotate(a.q_proj(h).view(n, l, heads, d).transpose(1, 2), cos, sin)
        k = rotate(a.k_proj(h).view(n, l, kvh, d).transpose(1, 2), cos, sin)
        v = a.v_proj(h).view(n, l, kvh, d).transpose(1, 2)
        out_kv.append((k, v))
        kr, vr = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        s = (q @ kr.transpose(-1, -2)) / math.sqrt(d)
        att = s.masked_fill(~visible, torch.finfo(s.dtype).min).softmax(-1) @ vr  # (B, heads, L, d)
        if kept is not None:
            ck, cv = kept[i]
            ck, cv = ck.repeat_interleave(heads // kvh, 1), cv.repeat_interleave(heads // kvh, 1)
            w = torch.matmul(q.unsqueeze(1), ck.unsqueeze(0).transpose(-2, -1)) / math.sqrt(d)  # (B, B, h, L, L)
            pad = am.float().masked_fill(am == 0, torch.finfo(w.dtype).min).masked_fill(am == 1, 0.0)
            w = (w + pad[None, :, None, None, :]).softmax(-1)
            o = torch.matmul(w, cv.unsqueeze(0))
            o = o / (torch.matmul(w, cv.norm(dim=-1, keepdim=True)) + 1e-6)
            att = att + (o * weights[:, :, None, None, None]).sum(1)
        x = x + a.o_proj(att.transpose(1, 2).reshape(n, l, heads * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return base.norm(x), out_kv


def official_revela_loss(model, batch):
    """EncoderModel.forward, straight-line, one group at a time (the official per-device batch is one group of P):
    retriever vectors -> cosines / tau_attn, diagonal -inf, softmax (calculate_attn) -> pass 1 (kept keys and values)
    -> pass 2 with in-batch attention -> next-token cross-entropy at every non-padding target (mean over the whole
    batch's targets)."""
    obj, lm = model.objective, model.objective.lm
    ids, am = batch["input_ids"], batch["attention_mask"]
    g, p, l = ids.shape
    total, count = 0.0, 0
    for i in range(g):
        vec = model.encode(ids[i], am[i])[1]  # (P, H)
        e = F.normalize(vec, dim=-1)
        s = (e @ e.t()) / obj.attn_temperature
        A = s.masked_fill(torch.eye(p, dtype=torch.bool), float("-inf")).softmax(-1)
        lid, lam = batch["lm_input_ids"][i], batch["lm_attention_mask"][i]
        _, kept = official_lm_pass(lm, lid, lam)
        hidden, _ = official_lm_pass(lm, lid, lam, kept, A)
        logits = lm.get_output_embeddings()(hidden)[:, :-1]
        labels = lid[:, 1:].masked_fill(lam[:, 1:] == 0, -100)
        total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        count += (labels != -100).sum()
    return total / count


def test_revela_loss_and_gradients_equal_the_official_forward(tiny_bert, tiny_lm, tok):
    model = make(tiny_bert, tiny_lm, attn_temperature=0.05)  # a temperature at which A is not one-hot
    obj = model.objective
    batch = obj.make_collator(tok, max_length=48, seed=3)(rows_of_docs(6))
    assert batch["input_ids"].shape[1] == 1 + 4 + 4  # anchor, 4 related, the 4 groups of the 2 other documents
    assert batch["lm_attention_mask"].sum(-1).min() < batch["lm_attention_mask"].shape[-1]  # padding is exercised
    batch = obj.prepare(model, batch)
    _, vec = obj.encode(model, batch)
    terms = obj.row_terms(model, batch, None, vec)
    loss = terms["revela_loss"]
    loss.backward()
    params = list(model.encoder.parameters()) + list(obj.adapters.parameters())
    got = grads(params)
    for q in params:
        q.grad = None
    ref = official_revela_loss(model, batch)
    ref.backward()
    print("revela", tiny_lm.rsplit("/", 1)[-1], loss.item(), ref.item())
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["revela_loss"], ref.detach(), atol=1e-5, rtol=1e-5)
    assert_same_grads(got, grads(params), atol=1e-5)
    assert any(g is not None and g.abs().sum() > 0 for g in got[:len(list(model.encoder.parameters()))])


def test_the_retriever_learns_only_through_the_attention_weights(tiny_bert, tiny_lm, tok):
    """With A held fixed (detached) the retriever gets no gradient and the LoRA matrices the same one; with A live,
    the retriever's gradient is exactly the chain through A: d L / d theta = <d L / d A, d A / d theta>."""
    model = make(tiny_bert, tiny_lm, attn_temperature=0.05)
    obj = model.objective
    batch = obj.prepare(model, obj.make_collator(tok, max_length=20, seed=5)(rows_of_docs(4)))
    ids, am = batch["lm_input_ids"], batch["lm_attention_mask"]
    g, p, l = ids.shape
    enc, lora = list(model.encoder.parameters()), list(obj.adapters.parameters())

    def loss_with(weights):
        return R.revela_loss(obj.lm, ids.view(g * p, l), am.view(g * p, l), weights, batch["lm_index"],
                             batch["lm_targets"])

    weights = R.revela_attention_weights(obj.encode(model, batch)[1], obj.attn_temperature)
    loss_with(weights.detach()).backward()
    assert all(q.grad is None for q in enc)
    lora_fixed = grads(lora)
    model.zero_grad(set_to_none=True)
    weights = R.revela_attention_weights(obj.encode(model, batch)[1], obj.attn_temperature)
    d_weights, = torch.autograd.grad(loss_with(weights), weights, retain_graph=True)
    (weights * d_weights).sum().backward()  # the chain through A alone
    through_a = grads(enc)
    model.zero_grad(set_to_none=True)
    weights = R.revela_attention_weights(obj.encode(model, batch)[1], obj.attn_temperature)
    loss_with(weights).backward()
    assert_same_grads(grads(enc), through_a, atol=1e-7)
    assert_same_grads(grads(lora), lora_fixed, atol=1e-7)
    assert sum(float(x.abs().sum()) for x in through_a if x is not None) > 0


def test_attention_weights_exclude_the_passage_itself():
    vec = torch.randn(3, 5, 8)
    a = R.revela_attention_weights(vec, 0.05)
    assert torch.all(a.diagonal(dim1=1, dim2=2) == 0)
    torch.testing.assert_close(a.sum(-1), torch.ones(3, 5))
    e = F.normalize(vec, dim=-1)
    s = (e @ e.transpose(1, 2) / 0.05)[0, 1]
    torch.testing.assert_close(a[0, 1], s.masked_fill(torch.arange(5) == 1, float("-inf")).softmax(-1))


def test_groups_get_eleven_anchors_of_other_documents():
    rows = rows_of_docs(16)
    groups = R.revela_passages(rows, 4, 11)
    assert {len(x) for x in groups} == {16}
    for r, texts in zip(rows, groups):
        assert texts[0] == r["anchor"] and texts[1:5] == r["related"][:4]
        others = {x["anchor"]: x["doc_id"] for x in rows}
        assert all(others[t] != r["doc_id"] for t in texts[5:])
    assert {len(x) for x in R.revela_passages(rows[:6], 4, 11)} == {9}  # 3 documents: 4 other-document anchors


def test_cached_step_equals_the_plain_step(tiny_bert, tiny_lm, tok, chunk=2):
    """XPRTModel.cached_step takes Revela (a row term: each group's passages are the LM's batch): the loss, the
    retention term and every gradient of the plain step, for chunks that do not divide the batch (5 groups)."""
    from test_gradient_cache import _step, assert_equal_to_rounding

    from plumbing.model_folder import load_teacher

    model = make(tiny_bert, tiny_lm, attn_temperature=0.05)
    teacher = load_teacher(str(tiny_bert))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for q in teacher.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=gen))
    batch = model.objective.make_collator(tok, max_length=20, seed=4)(rows_of_docs(5))
    plain_out, plain_grads = _step(model, batch, teacher)
    cached_out, cached_grads = _step(model, batch, teacher, chunk)
    _, exact = _step(copy.deepcopy(model).double(), batch, copy.deepcopy(teacher).double())  # the plain step, float64
    assert set(plain_out) == set(cached_out) == {"loss", "revela_loss", "retention_loss"}
    for k in plain_out:
        torch.testing.assert_close(cached_out[k], plain_out[k], atol=1e-5, rtol=1e-5)
    assert set(plain_grads) == set(cached_grads) == set(exact)
    assert any(n.startswith("objective.adapters.") for n in plain_grads)
    assert_equal_to_rounding(cached_grads, plain_grads, exact)  # the bound: test_gradient_cache's docstring


def test_saved_folder_keeps_the_adapters_only(tiny_bert, tiny_lm, tok, tmp_path):
    """The LoRA matrices are the objective's heads (xprt_heads.safetensors) and come back with the folder; the frozen
    LM is not saved."""
    from safetensors.torch import load_file

    model = make(tiny_bert, tiny_lm)
    save_xprt_folder(model, str(tmp_path / "m"), tok)
    heads = load_file(str(tmp_path / "m" / "xprt_heads.safetensors"))
    assert {k for k in heads if not k.startswith("mlm_head.")} == {f"adapters.{k}" for k in
                                                                  model.objective.adapters.state_dict()}
    back = load_xprt_folder(XPRTModel, str(tmp_path / "m"))
    assert back.objective_name == "revela" and back.objective.lora_rank == 4
    for k, v in model.objective.adapters.state_dict().items():
        torch.testing.assert_close(back.objective.adapters.state_dict()[k], v)


@pytest.mark.slow
def test_train_runs_revela_and_its_term_moves(tiny_bert, groups, tmp_path):
    """train.py --objective revela on the test groups (select_groups.py's schema) with a tiny random Qwen2: 6 steps,
    the LM's term logged at every step and falling (the LoRA matrices learn the passages), the model saved with its
    adapters and setting."""
    from test_train import base_args, read_log, run

    lm = build_tiny_lm(tmp_path / "lm", tiny_bert, "qwen2")
    kw = {"--max_train_steps": 6, "--learning_rate": 1e-2, "--objective": "revela", "--lm_name_or_path": lm,
          "--lora_rank": 8, "--attn_temperature": 0.05, "--extra_anchors": 3}
    run(base_args(tiny_bert, groups, tmp_path / "p", **kw))
    log = read_log(tmp_path / "p")
    assert sorted(log) == [1, 2, 3, 4, 5, 6]
    print("revela_loss", [round(log[s]["revela_loss"], 4) for s in sorted(log)])
    assert sum(log[s]["revela_loss"] for s in (5, 6)) / 2 < log[1]["revela_loss"] - 0.05
    assert "retention_loss" in log[1]
    back = load_xprt_folder(XPRTModel, str(tmp_path / "p" / "model"))
    assert back.objective_name == "revela" and back.objective.extra_anchors == 3 and back.objective.lora_rank == 8


from test_train import groups  # noqa: E402,F401  (a fixture)
