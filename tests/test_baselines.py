"""The baselines (baselines.py) against straight-line versions of their official code: RetroMAE's enhanced decoding,
SimLM's replaced language modelling, Contriever's crops and in-batch InfoNCE; and the whole-word masking rule both
MAE baselines use. Tiny random models (conftest) with the MiniLM tokenizer; dropout off (eval mode); seconds each."""

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from transformers import AutoTokenizer

from baselines import contriever, retromae, shared, simlm
from modeling_xprt import XPRTModel
from plumbing import model_folder
from plumbing.model_folder import load_mlm_encoder, load_xprt_folder, save_xprt_folder


def rows_from_docs(n: int, min_chars: int = 40):
    """Groups rows (select_groups.py's schema, the fields the collators read) from data/docs.jsonl's paragraphs."""
    rows = []
    with open(ROOT / "data" / "docs.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            paras = [p for p in d["text"].split("\n") if len(p) > min_chars]
            for a in range(len(paras) - 1):
                rows.append({"doc_id": d["id"], "anchor": paras[a], "related": [paras[a + 1]] * 4,
                             "random_passage": paras[0]})
                if len(rows) == n:
                    return rows
    return rows


@pytest.fixture(scope="module")
def tok(tiny_bert):
    return AutoTokenizer.from_pretrained(tiny_bert)


def make(tiny_bert, objective, **options):
    """XPRTModel for `objective`, dropout off (eval mode): the comparisons are exact."""
    torch.manual_seed(0)
    return XPRTModel(load_mlm_encoder(str(tiny_bert))[0], objective=objective, **options).eval()


def dense(batch, rows):
    """A Layout row set's flat targets (<rows>_index, <rows>_targets) back as a (G, L) tensor, -100 elsewhere."""
    out = torch.full_like(batch["input_ids"], -100).view(-1)
    out[batch[f"{rows}_index"]] = batch[f"{rows}_targets"]
    return out.view(batch["input_ids"].shape)


def grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def assert_same_grads(a, b, atol=1e-6):
    assert len(a) == len(b)
    assert sum(x is not None for x in a) > 0
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, atol=atol, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# whole-word masking
# ---------------------------------------------------------------------------------------------------------------
def official_whole_word_mask(words: list, n_tokens: int, rate: float, order: list, max_predictions: int = 512):
    """DataCollatorForWholeWordMask._whole_word_mask / SimLM's whole_word_mask, line by line, with the shuffled order
    of the candidate words given (random.shuffle's result). words: the token positions of each word."""
    cand = [words[i] for i in order]
    num_to_predict = min(max_predictions, max(1, int(round(n_tokens * rate))))
    masked, covered = [], set()
    for index_set in cand:
        if len(masked) >= num_to_predict:
            break
        if len(masked) + len(index_set) > num_to_predict:
            continue
        for i in index_set:
            covered.add(i)
            masked.append(i)
    return covered


def test_word_ids_follow_the_wordpiece_rule(tok):
    """The baselines' collators group tokens into words as the official "##" rule does ([CLS] / [SEP] never
    candidates), on real passages."""
    rows = rows_from_docs(20)
    enc = shared.AnchorCollator(tok, max_length=94)._tokenize([r["anchor"] for r in rows])
    got = enc["word_ids"]
    for i in range(len(rows)):
        tokens = tok.convert_ids_to_tokens(enc["input_ids"][i])
        official, w = [], -1
        for t in tokens:
            if t in ("[CLS]", "[SEP]", "[PAD]"):
                official.append(None)
            elif t.startswith("##") and w >= 0:
                official.append(w)
            else:
                w += 1
                official.append(w)
        # the same partition into words (ids may differ by an offset)
        pairs = {(o, g) for o, g in zip(official, got[i].tolist()) if o is not None}
        assert len({o for o, _ in pairs}) == len(pairs) == len({g for _, g in pairs})
        assert all((o is None) == (g == -1) for o, g in zip(official, got[i].tolist()))


def test_whole_word_mask_equals_the_official_greedy_rule():
    """Random word layouts (words of 1-4 tokens, padding, non-candidates): the mask equals the official loop run over
    the same shuffled order of the words, for several rates."""
    g = torch.Generator().manual_seed(1)
    n, l = 64, 40
    word_ids = torch.full((n, l), -1, dtype=torch.long)
    num_tokens = torch.zeros(n, dtype=torch.long)
    for r in range(n):
        length = int(torch.randint(3, l, (), generator=g))
        pos, w = 1, 0
        while pos < length - 1:
            k = min(int(torch.randint(1, 5, (), generator=g)), length - 1 - pos)
            word_ids[r, pos:pos + k] = w
            pos, w = pos + k, w + 1
        num_tokens[r] = length
    for rate in (0.15, 0.3, 0.5):
        seed = int(rate * 100)
        got = shared.whole_word_mask(word_ids, num_tokens, rate, torch.Generator().manual_seed(seed))
        # the draws whole_word_mask makes: over the word slots in use, whatever the padding (unpadded_rand)
        keys = torch.rand(n, int(word_ids.max()) + 1, generator=torch.Generator().manual_seed(seed))
        for r in range(n):
            ids = word_ids[r].tolist()
            words = [[j for j, x in enumerate(ids) if x == w] for w in range(max(ids) + 1)]
            order = sorted(range(len(words)), key=lambda w: keys[r, w].item())
            want = official_whole_word_mask(words, int(num_tokens[r]), rate, order)
            assert set(got[r].nonzero().squeeze(1).tolist()) == want, (rate, r)


def test_whole_word_mask_rates_on_real_passages(tok):
    """On real anchors the masks cover round(rate * n) tokens (n with [CLS] and [SEP]) to within one word's overshoot,
    whole words only, never a special token or the prefix: RetroMAE's and SimLM's 30% and 50%."""
    c = shared.AnchorCollator(tok, max_length=64, passage_prefix="passage: ")
    batch = c.anchors(rows_from_docs(64))
    wid, n = batch["word_ids"], batch["num_tokens"]
    for rate in (0.3, 0.5):
        m = shared.whole_word_mask(wid, n, rate, torch.Generator().manual_seed(0))
        budget = (n.double() * rate).round().long()
        count = m.sum(1)
        assert (count <= budget).all()
        assert ((budget - count) <= 3).all()  # the greedy fills the budget but for words too long to fit
        frac = (count.sum() / n.sum()).item()
        assert abs(frac - rate) < 0.01, frac
        assert not (m & (wid < 0)).any()  # specials, padding and the prefix never
        for r in range(len(wid)):  # whole words: every token of a touched word
            touched = set(wid[r][m[r]].tolist())
            assert all(bool(m[r, j]) == (int(wid[r, j]) in touched) for j in range(wid.shape[1]) if wid[r, j] >= 0)


# ---------------------------------------------------------------------------------------------------------------
# RetroMAE
# ---------------------------------------------------------------------------------------------------------------
def test_enhanced_decoding_masks_follow_the_official_collator(tok):
    """Row i never sees itself; [CLS] (the sentence vector) and [SEP] are visible to every other row; padding to none;
    what row i does not see besides itself is one whole-word 50% sample of the passage, from a pool of at most
    min(n, 256) samples per passage."""
    c = retromae.RetroMAECollator(tok, max_length=48)
    batch = c(rows_from_docs(16))
    assert batch["decoder_mask_rate"] == 0.5
    torch.manual_seed(0)
    vis = retromae.enhanced_decoding_masks(batch["word_ids"], batch["num_tokens"], batch["attention_mask"], 0.5)
    g, l = batch["input_ids"].shape
    assert vis.shape == (g, l, l)
    am = batch["attention_mask"].bool()
    wid = batch["word_ids"]
    fracs = []
    for p in range(g):
        n = int(am[p].sum())
        assert not vis[p, :, n:].any()  # padding is never visible
        samples = set()
        for i in range(n):
            assert not vis[p, i, i]
            for j in (0, n - 1):  # [CLS], [SEP]
                assert vis[p, i, j] or j == i
            hidden = (~vis[p, i, :n]).clone()
            hidden[i] = False  # the row's own position aside, the rest is its sample
            budget = max(1, round(n * 0.5))
            assert budget - 4 <= int(hidden.sum()) <= budget  # (i itself may have been in the sample)
            words = set(wid[p][:n][hidden].tolist())
            assert -1 not in words
            assert all(bool(hidden[j]) == (int(wid[p, j]) in words) for j in range(n) if wid[p, j] >= 0 and j != i)
            samples.add(tuple(hidden.tolist()))
            fracs.append(hidden.sum().item() / n)
        assert len(samples) <= min(n, 256)
    assert abs(sum(fracs) / len(fracs) - 0.5) < 0.02


def official_retromae_loss(model, obj, batch, setting="paper"):
    """RetroMAEForPretraining.forward (src/pretrain/modeling.py lines 30-70), straight-line, with the decoder's
    attention computed row by row from the layer's weights (enhancedDecoder.py's BertLayerForDecoder): the [CLS]
    state of the
    last layer (line 40, `hidden_states[-1][:, :1]`) in the official setting, the paper setting's mean-pooled vector
    in its place."""
    lm = model.encoder
    out = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=dense(batch, "mlm"),
             output_hidden_states=True)
    last = out.hidden_states[-1]
    am = batch["attention_mask"]
    cls = ((last * am[..., None]).sum(1) / am.sum(1, keepdim=True))[:, None]  # (G, 1, H)
    if setting == "official":
        cls = last[:, :1]  # modeling.py line 40
    emb = lm.bert.embeddings
    l = batch["clean_ids"].shape[1]
    hiddens = torch.cat([cls, emb(input_ids=batch["clean_ids"])[:, 1:]], dim=1)
    query = emb.position_embeddings(emb.position_ids[:, :l]) + cls
    layer = obj.decoder
    sa = layer.attention.self
    heads, d = sa.num_attention_heads, sa.attention_head_size
    rows = []
    for g in range(query.shape[0]):
        for i in range(l):
            q = sa.query(query[g, i]).view(heads, d)
            k = sa.key(hiddens[g]).view(l, heads, d)
            v = sa.value(hiddens[g]).view(l, heads, d)
            s = torch.einsum("hd,lhd->hl", q, k) / math.sqrt(d)
            s = s + (1.0 - batch["visible"][g, i].float()) * torch.finfo(s.dtype).min  # get_extended_attention_mask
            ctx = torch.einsum("hl,lhd->hd", s.softmax(-1), v).reshape(-1)
            a = layer.attention.output(ctx[None], query[g, i][None])
            rows.append(layer.output(layer.intermediate(a), a)[0])
    dec = torch.stack(rows).view(query.shape)
    dec_loss = F.cross_entropy(lm.cls(dec).view(-1, lm.config.vocab_size), dense(batch, "dec").view(-1))
    return dec_loss + out.loss, dec_loss, out.loss


@pytest.mark.parametrize("setting", ["paper", "official"])
def test_retromae_loss_and_gradients_equal_the_official_forward(tok, tiny_bert, setting):
    model = make(tiny_bert, "retromae", baseline_setting=setting)
    assert model.info.pooling == ("cls" if setting == "official" else "mean")
    obj = model.objective
    c = obj.make_collator(tok, max_length=24, seed=3)
    torch.manual_seed(0)
    batch = obj.prepare(model, c(rows_from_docs(4)))
    assert dense(batch, "dec")[:, 0].eq(-100).all()  # [CLS] is no decoder target
    states, vec = obj.encode(model, batch)
    assert vec.shape[1] == 0
    terms = obj.row_terms(model, batch, states, vec)
    loss = obj.total(terms)
    loss.backward()
    params = list(model.parameters())
    got = grads(params)
    for p in params:
        p.grad = None
    ref, ref_dec, ref_mlm = official_retromae_loss(model, obj, batch, setting)
    ref.backward()
    print("retromae", setting, loss.item(), ref.item())
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["decoder_loss"], ref_dec.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["mlm_loss"], ref_mlm.detach(), atol=1e-5, rtol=1e-5)
    assert_same_grads(got, grads(params))
    # 30% whole-word masking of the encoder's input, with BERT's 80/10/10
    masked = dense(batch, "mlm") >= 0
    assert abs(masked.sum().item() / batch["num_tokens"].sum().item() - 0.3) < 0.03
    assert (batch["input_ids"][masked] == tok.mask_token_id).float().mean() > 0.6


def test_retromae_decoder_is_fresh_and_owned(tiny_bert):
    """The decoder layer is built from the encoder's layer 0 (architectures.decoder_layers) and re-initialised as
    RetroMAE's c_head.apply(lm._init_weights): not layer 0's weights, and its weight matrices spread as BERT's init
    (normal, std initializer_range 0.02; biases 0, LayerNorm 1)."""
    model = make(tiny_bert, "retromae")
    obj = model.objective
    names = [n for n, _ in obj.named_parameters()]
    assert names and all(n.startswith("decoder.") for n in names)
    first = dict(model.encoder.bert.encoder.layer[0].named_parameters())
    std = model.encoder.config.initializer_range
    for n, p in obj.decoder.named_parameters():
        assert p.shape == first[n].shape, n
        if p.dim() == 2:
            assert not torch.equal(p, first[n]), n
            assert abs(p.std().item() - std) < 0.25 * std and abs(p.mean().item()) < 0.25 * std, (n, p.std())
        elif n.endswith("LayerNorm.weight"):
            assert torch.equal(p, torch.ones_like(p))
        else:
            assert torch.equal(p, torch.zeros_like(p)), n


# ---------------------------------------------------------------------------------------------------------------
# SimLM
# ---------------------------------------------------------------------------------------------------------------
def build_tiny_generator(path):
    """A tiny random ELECTRA generator with the MiniLM tokenizer (the official one is google/electra-base-generator),
    saved to `path`; the global random state is left as it was."""
    from transformers import AutoTokenizer, ElectraConfig, ElectraForMaskedLM

    from plumbing import common
    tok = AutoTokenizer.from_pretrained(common.resolve_model_path("all-MiniLM-L6-v2"))
    cfg = ElectraConfig(vocab_size=tok.vocab_size, embedding_size=16, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ElectraForMaskedLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_generator(tmp_path_factory):
    return build_tiny_generator(tmp_path_factory.mktemp("tiny-electra"))


def test_simlm_masks_reach_30_and_50_percent(tok):
    c = simlm.SimLMCollator(tok, max_length=64)
    batch = c(rows_from_docs(64))
    n = batch["num_tokens"].sum().item()
    enc, dec = batch["enc_masked"], batch["dec_masked"]
    assert (dec | ~enc).all()  # the decoder's mask contains the encoder's
    assert abs(enc.sum().item() / n - 0.3) < 0.02
    # 0.3 + 0.7 x with x = 0.2857: 0.5 in expectation, the second mask independent of the first
    assert abs(dec.sum().item() / n - 0.5) < 0.03
    assert (batch["enc_input_ids"][enc] == tok.mask_token_id).all()  # --all_use_mask_token True
    assert (batch["enc_input_ids"][~enc] == batch["input_ids"][~enc]).all()
    t = dense(batch, "tok")  # every non-special token of the passage is a target, masked or not
    special = torch.isin(batch["input_ids"], torch.tensor(tok.all_special_ids))
    assert ((t >= 0) == (batch["word_ids"] >= 0) & ~special).all()


def test_simlm_generator_is_frozen_and_not_registered(tiny_bert, tiny_generator):
    model = make(tiny_bert, "simlm", generator_name_or_path=tiny_generator)
    obj = model.objective
    assert all(n.startswith("decoder.") for n, _ in obj.named_parameters())
    assert not any("generator" in k for k in model.state_dict())
    assert not any("generator" in k for k in model_folder.heads_state_dict(model))
    assert obj.config() == {"generator_name_or_path": tiny_generator, "decoder_layers": 2, "baseline_setting": "paper"}
    assert not obj.generator.training and not any(p.requires_grad for p in obj.generator.parameters())
    # the official setting: the generator samples in train mode while the model trains (rlm.py line 40 undone by
    # the Trainer's model.train()), in eval mode while it does not; the paper's: eval mode always
    batch = obj.make_collator(AutoTokenizer.from_pretrained(tiny_bert), max_length=16)(rows_from_docs(2))
    for setting, train_mode in (("paper", False), ("official", True)):
        m = make(tiny_bert, "simlm", generator_name_or_path=tiny_generator, baseline_setting=setting).train()
        m.objective.prepare(m, batch)
        assert m.objective.generator.training == train_mode
        m.eval().objective.prepare(m, batch)
        assert not m.objective.generator.training
    # the decoder is a copy of the encoder's last two layers, not the layers themselves
    last = model.encoder.bert.encoder.layer[-2:]
    for a, b in zip(obj.decoder.parameters(), last.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_simlm_replacements_are_samples_of_the_generator(tok, tiny_bert, tiny_generator):
    """Only masked positions change, and there the tokens follow the generator's softmax (temperature 1): the
    replacements' mean log-probability under the generator equals its expectation, sum p log p."""
    model = make(tiny_bert, "simlm", generator_name_or_path=tiny_generator)
    obj = model.objective
    gen = obj.generator
    c = obj.make_collator(tok, max_length=32)
    batch = c(rows_from_docs(16))
    torch.manual_seed(0)
    out = obj.prepare(model, batch)
    for k, m in (("enc_input_ids", "enc_masked"), ("dec_input_ids", "dec_masked")):
        assert (out[k][~batch[m]] == batch[k][~batch[m]]).all()
    with torch.no_grad():
        logp = gen(input_ids=batch["enc_input_ids"], attention_mask=batch["attention_mask"]).logits.log_softmax(-1)
    m = batch["enc_masked"]
    drawn = logp.gather(-1, out["enc_input_ids"].unsqueeze(-1)).squeeze(-1)[m]
    expected = (logp.exp() * logp).sum(-1)[m]
    assert abs(drawn.mean() - expected.mean()) < 3 * drawn.std() / math.sqrt(drawn.numel())
    assert (out["enc_input_ids"][m] != batch["input_ids"][m]).float().mean() > 0.9  # a random generator rarely keeps


def official_simlm_loss(model, obj, batch, setting="paper"):
    """ReplaceLM.forward (simlm/src/models/rlm.py lines 48-93), straight-line, after the replacements: the encoder's MLM
    loss with labels at every position, the decoder (the copied layers) on [vector; embeddings of the decoder's text]
    (line 79), the shared MLM head (line 116). The vector: the last layer's [CLS] state (line 76) in the official
    setting, the mean-pooled vector in the paper's."""
    lm = model.encoder
    am = batch["attention_mask"]
    targets = dense(batch, "tok")
    out = lm(input_ids=batch["enc_input_ids"], attention_mask=am, labels=targets, output_hidden_states=True)
    last = out.hidden_states[-1]
    cls = ((last * am[..., None]).sum(1) / am.sum(1, keepdim=True))[:, None]
    if setting == "official":
        cls = last[:, :1]  # rlm.py line 76
    h = torch.cat([cls, lm.bert.embeddings(batch["dec_input_ids"])[:, 1:]], dim=1)
    ext = (1.0 - am[:, None, None, :].float()) * torch.finfo(h.dtype).min  # get_extended_attention_mask
    for layer in obj.decoder:
        h = layer(h, ext)
    dec_loss = F.cross_entropy(lm.cls(h).view(-1, lm.config.vocab_size), targets.view(-1))
    return dec_loss + out.loss, dec_loss, out.loss


@pytest.mark.parametrize("setting", ["paper", "official"])
def test_simlm_loss_and_gradients_equal_the_official_forward(tok, tiny_bert, tiny_generator, setting):
    model = make(tiny_bert, "simlm", generator_name_or_path=tiny_generator, baseline_setting=setting)
    obj = model.objective
    c = obj.make_collator(tok, max_length=32, seed=5)
    raw = c(rows_from_docs(6))
    torch.manual_seed(0)
    batch = obj.prepare(model, raw)
    # the replacement itself, as rlm.py draws it: Categorical over the generator's logits at every position
    torch.manual_seed(0)
    with torch.no_grad():
        logits = obj.generator(input_ids=raw["enc_input_ids"], attention_mask=raw["attention_mask"]).logits
        sampled = torch.distributions.Categorical(logits=logits).sample()
    is_mask = raw["enc_masked"].long()
    assert torch.equal(batch["enc_input_ids"], raw["enc_input_ids"] * (1 - is_mask) + sampled * is_mask)
    states, vec = obj.encode(model, batch)
    terms = obj.row_terms(model, batch, states, vec)
    loss = obj.total(terms)
    loss.backward()
    params = list(model.parameters())
    got = grads(params)
    for p in params:
        p.grad = None
    ref, ref_dec, ref_enc = official_simlm_loss(model, obj, batch, setting)
    ref.backward()
    print("simlm", setting, loss.item(), ref.item())
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["decoder_rlm_loss"], ref_dec.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms["encoder_rlm_loss"], ref_enc.detach(), atol=1e-5, rtol=1e-5)
    assert_same_grads(got, grads(params))


# ---------------------------------------------------------------------------------------------------------------
# Contriever
# ---------------------------------------------------------------------------------------------------------------
def test_contriever_crops_and_deletion_follow_data_py(tok):
    """Crop length int(n r), r ~ U[0.1, 0.5], then each token deleted with p 0.1: the mean kept share of a passage of n
    tokens is 0.9 E[floor(n r)] / n ~ 0.9 (0.3 - 0.5 / n); the views are independent and wrapped in
    [CLS] prefix ... [SEP]."""
    c = contriever.ContrieverCollator(tok, max_length=64, passage_prefix="passage: ")
    rows = rows_from_docs(200)
    toks = tok([r["anchor"] for r in rows], add_special_tokens=False, truncation=True, max_length=64)["input_ids"]
    n = torch.tensor([len(t) for t in toks], dtype=torch.float)
    batch = c(rows)
    extra = 2 + len(c.prefix_ids)
    share = {v: (batch[f"{v}_attention_mask"].sum(1) - extra) / n for v in "qk"}
    expected = (0.9 * (0.3 - 0.5 / n)).mean().item()
    for v in "qk":
        assert abs(share[v].mean().item() - expected) < 0.015, (share[v].mean(), expected)
        ids = batch[f"{v}_input_ids"]
        assert (ids[:, 0] == tok.cls_token_id).all()
        assert (ids[:, 1:1 + len(c.prefix_ids)] == torch.tensor(c.prefix_ids)).all()
    assert (share["q"] != share["k"]).float().mean() > 0.8


def test_random_crop_is_data_py_randomcrop():
    g = torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(2000):
        start, length = contriever.random_crop(37, (0.1, 0.5), g)
        assert 0 <= start <= 37 - length
        lengths.append(length)
    assert min(lengths) == 3 and max(lengths) == 18  # int(3.7) .. int(18.5): floor, as int() in data.py
    assert abs(sum(lengths) / len(lengths) - 0.3 * 37 + 0.5) < 0.3  # E[floor(37 r)] ~ 11.1 - 0.5


def test_contriever_scores_as_the_start_model_does(tok, tiny_bert):
    """Contriever's default (normalize=None) follows the start's similarity: cosines for a cosine start (the tiny BERT:
    sentence-transformers' default), the official dot products for a dot-product start."""
    model = make(tiny_bert, "contriever")
    batch = model.objective.make_collator(tok, max_length=32)(rows_from_docs(8))
    _, vec = model.objective.encode(model, batch)
    loss = model.objective.batch_terms(model, vec, batch)["contrastive_loss"]
    torch.testing.assert_close(loss, contriever.contriever_loss(vec[:, 0], vec[:, 1], 0.05, normalize=True))
    model.info.similarity_fn_name = "dot"
    torch.testing.assert_close(model.objective.batch_terms(model, vec, batch)["contrastive_loss"],
                               contriever.contriever_loss(vec[:, 0], vec[:, 1], 0.05, normalize=False))


def test_contriever_loss_and_gradients_equal_a_loop(tok, tiny_bert):
    """The official setting's scores with in-batch negatives (--contrastive_mode inbatch; the setting's own is moco):
    the README run's scores (--norm_query / --norm_doc off), InBatch.forward
    (src/inbatch.py lines 59-75): dot products / 0.05 of the mean-pooled vectors, cross-entropy to j = i."""
    model = make(tiny_bert, "contriever", baseline_setting="official", contrastive_mode="inbatch")
    assert model.objective.normalize is False and model.info.similarity_fn_name == "dot" and not model.info.normalize
    obj = model.objective
    batch = obj.make_collator(tok, max_length=32)(rows_from_docs(8))
    _, vec = obj.encode(model, batch)
    terms = obj.batch_terms(model, vec, batch)
    loss = obj.total(terms)
    loss.backward()
    got = grads(model.parameters())
    for p in model.parameters():
        p.grad = None
    q = [model.encode(batch["q_input_ids"][i:i + 1], batch["q_attention_mask"][i:i + 1])[1][0] for i in range(8)]
    k = [model.encode(batch["k_input_ids"][i:i + 1], batch["k_attention_mask"][i:i + 1])[1][0] for i in range(8)]
    ref = 0
    for i in range(8):  # inbatch.py: scores = q_i / T . k_j, cross-entropy to j = i
        s = torch.stack([(q[i] / 0.05) @ k[j] for j in range(8)])
        ref = ref - torch.log_softmax(s, 0)[i] / 8
    ref.backward()
    print("contriever official", loss.item(), ref.item())
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
    assert_same_grads(got, grads(model.parameters()), atol=1e-4)  # dot products / 0.05: logits in the hundreds


class OfficialMoCo(torch.nn.Module):
    """Contriever's MoCo as facebookresearch/contriever src/moco.py writes it (class MoCo: __init__,
    _momentum_update_key_encoder, _dequeue_and_enqueue, _compute_logits, forward), transcribed for one process (its
    gather_nograd is the identity there) with the retriever of src/contriever.py (Contriever.forward, pooling
    "average"). The queue's randn draws from a generator seeded as ours (moco.py: the global generator), so both start
    from the same queue."""

    def __init__(self, retriever, queue_size, momentum, temperature, dim, seed, label_smoothing=0.0, normalize=False):
        super().__init__()
        import copy

        self.queue_size, self.momentum, self.temperature = queue_size, momentum, temperature
        self.norm_query = self.norm_doc = normalize  # --norm_query, --norm_doc (off in the README's run)
        self.label_smoothing = label_smoothing  # options.py's default, 0.0
        self.encoder_q = retriever
        self.encoder_k = copy.deepcopy(retriever)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        queue = torch.randn(dim, queue_size, generator=torch.Generator().manual_seed(seed))
        self.register_buffer("queue", F.normalize(queue, dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @staticmethod
    def embed(encoder, ids, mask, normalize):  # src/contriever.py Contriever.forward, pooling "average"
        last_hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        last_hidden = last_hidden.masked_fill(~mask[..., None].bool(), 0.0)
        emb = last_hidden.sum(dim=1) / mask.sum(dim=1)[..., None]
        return F.normalize(emb, dim=-1) if normalize else emb

    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.momentum + param_q.data * (1.0 - self.momentum)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.queue_size % batch_size == 0
        self.queue[:, ptr:ptr + batch_size] = keys.T
        self.queue_ptr[0] = (ptr + batch_size) % self.queue_size

    def forward(self, q_tokens, q_mask, k_tokens, k_mask):
        q = self.embed(self.encoder_q, q_tokens, q_mask, self.norm_query)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = self.embed(self.encoder_k, k_tokens, k_mask, self.norm_doc)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.temperature
        labels = torch.zeros(q.shape[0], dtype=torch.long)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        self._dequeue_and_enqueue(k)
        return loss


@pytest.mark.parametrize("setting", ["official", "paper"])
def test_contriever_moco_equals_the_official_moco(tok, tiny_bert, setting):
    """--baseline_setting official is the README's run, MoCo (the defaults: 65,536 keys, momentum 0.9995). Three SGD
    steps of 4 groups against OfficialMoCo (src/moco.py), a queue of 8 (the pointer wraps) and momentum 0.9 (the key
    encoder moves visibly), in the official setting (dot products of unnormalised vectors: with the tiny BERT's
    similar vectors the positive's logit dominates and some steps' loss is 0) and in the paper setting with
    --contrastive_mode moco (cosines, --norm_query / --norm_doc on: a loss of a few nats every step): the loss of
    each step, the query and key encoders' weights, the queue and its pointer
    agree to 1e-5; no gradient reaches the keys; the key encoder and queue are no part of the model (its parameters,
    state dict, heads); the FLOP count has the key pass forward-only."""
    from plumbing.model_folder import load_mlm_encoder as load

    defaults = make(tiny_bert, "contriever", baseline_setting="official").objective
    defaults_model_keys = make(tiny_bert, "contriever").state_dict().keys()  # in-batch: no MoCo state at all
    assert (defaults.contrastive_mode, defaults.moco_queue_size, defaults.moco_momentum) == ("moco", 65536, 0.9995)
    assert make(tiny_bert, "contriever").objective.contrastive_mode == "inbatch"  # the paper setting
    model = make(tiny_bert, "contriever", baseline_setting=setting, contrastive_mode="moco", moco_queue_size=8,
                 moco_momentum=0.9)
    obj = model.objective
    ref = OfficialMoCo(load(str(tiny_bert))[0].base_model, 8, 0.9, 0.05, 32, obj.moco.seed,
                       normalize=setting == "paper").eval()
    collate = obj.make_collator(tok, max_length=32, seed=3)
    rows = rows_from_docs(12)
    batches = [collate(rows[i:i + 4]) for i in range(0, 12, 4)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.SGD(ref.encoder_q.parameters(), lr=1e-3)
    for step, b in enumerate(batches):
        out = model(b)
        out["loss"].backward()
        keys = obj.moco.key_encoder
        assert all(not p.requires_grad and p.grad is None for p in keys.parameters())  # no gradient to the keys
        want = ref(b["q_input_ids"], b["q_attention_mask"], b["k_input_ids"], b["k_attention_mask"])
        want.backward()
        print(setting, "moco step", step + 1, out["loss"].item(), want.item(), abs(out["loss"].item() - want.item()))
        torch.testing.assert_close(out["loss"].detach(), want.detach(), atol=1e-5, rtol=1e-5)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    got_k, want_k = obj.moco.key_encoder.state_dict(), ref.encoder_k.state_dict()
    assert got_k.keys() == want_k.keys()
    diff = max((got_k[n] - want_k[n]).abs().max().item() for n in got_k)
    moved = max((got_k[n] - model.base.state_dict()[n]).abs().max().item() for n in got_k)
    print("key encoder: max |ours - official|", diff, "; max |w_k - w_q|", moved)
    assert diff < 1e-5 and moved > 1e-4
    for n, p in model.base.state_dict().items():
        torch.testing.assert_close(p, ref.encoder_q.state_dict()[n], atol=1e-5, rtol=1e-5)
    print("queue: max |ours - official|", (obj.moco.queue - ref.queue).abs().max().item(), "ptr", obj.moco.ptr)
    torch.testing.assert_close(obj.moco.queue, ref.queue, atol=1e-5, rtol=1e-5)
    assert obj.moco.ptr == int(ref.queue_ptr) == 4
    # the model is the query encoder only: the optimiser, DDP and the saved folder never see the key encoder or queue
    ids = {id(p) for p in model.parameters()}
    assert not any(id(p) in ids for p in keys.parameters())
    assert not dict(obj.state_dict()) and model.state_dict().keys() == defaults_model_keys
    # FLOPs: the first crop trained, the second the key encoder's forward only
    b = batches[0]
    trained, forward = obj.multiply_adds(model, b, lambda ids, n: ids.numel() * n, 0)
    assert (trained, forward) == (b["q_input_ids"].numel() * 2, b["k_input_ids"].numel() * 2)


def test_unk_is_never_masked(tok):
    """[UNK] is never masked (never_unk: the official collators zero the mask at every special token), at any rate."""
    rows = [{**r, "anchor": "\u2603 " + r["anchor"].replace(" ", " \u2603 ", 3)} for r in rows_from_docs(8)]
    unk = tok.unk_token_id
    for rate in (0.3, 0.9):
        for cls, keys in ((retromae.RetroMAECollator, ["mlm"]), (simlm.SimLMCollator, ["enc_masked", "dec_masked"])):
            c = cls(tok, max_length=32, encoder_mask_rate=rate, decoder_mask_rate=max(rate, 0.5), seed=1)
            for _ in range(5):
                b = c(rows)
                ids = b.get("clean_ids", b["input_ids"])
                assert (ids == unk).sum() >= 8
                for k in keys:
                    masked = dense(b, k) >= 0 if k == "mlm" else b[k]
                    assert masked.any() and not masked[ids == unk].any(), (cls, k)


@pytest.mark.parametrize("objective,pooling,normalize,similarity", [("retromae", "cls", True, "cosine"),
                                                                    ("contriever", "mean", False, "dot")])
def test_official_setting_is_what_the_saved_folder_states(tok, tiny_bert, tmp_path, objective, pooling, normalize,
                                                          similarity):
    """A folder saved under --baseline_setting official pools and scores as the objective trained: the [CLS] vector
    for RetroMAE (SimLM the same), dot products without Normalize for Contriever; its setting recorded."""
    from sentence_transformers import SentenceTransformer

    model = make(tiny_bert, objective, baseline_setting="official")
    save_xprt_folder(model, str(tmp_path / "m"), tok)
    cfg = json.loads((tmp_path / "m" / "xprt_config.json").read_text())
    assert cfg["heads"]["baseline_setting"] == "official"
    pool = json.loads((tmp_path / "m" / "1_Pooling" / "config.json").read_text())
    assert pool["pooling_mode_cls_token"] == (pooling == "cls")
    assert pool["pooling_mode_mean_tokens"] == (pooling == "mean")
    modules = [m["type"] for m in json.loads((tmp_path / "m" / "modules.json").read_text())]
    assert any(m.endswith("Normalize") for m in modules) == normalize
    st = SentenceTransformer(str(tmp_path / "m"), device="cpu")
    assert st.similarity_fn_name == similarity
    text = rows_from_docs(1)[0]["anchor"]
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        ours = model.encode(enc["input_ids"], enc["attention_mask"])[1][0]
    ours = F.normalize(ours, dim=-1) if normalize else ours
    torch.testing.assert_close(torch.as_tensor(st.encode([text]))[0], ours, atol=1e-5, rtol=1e-5)
    back = load_xprt_folder(XPRTModel, str(tmp_path / "m"))
    assert back.objective.baseline_setting == "official" and back.info.pooling == pooling


def test_collators_emit_the_retention_fields(tok):
    rows = rows_from_docs(5)
    ref = shared.AnchorCollator(tok, max_length=32).retention_fields(rows)
    for cls in (retromae.RetroMAECollator, simlm.SimLMCollator, contriever.ContrieverCollator):
        b = cls(tok, max_length=32)(rows)
        for k in ("doc_ids", "retain_input_ids", "retain_attention_mask"):
            assert torch.equal(b[k], ref[k]), (cls, k)


@pytest.mark.parametrize("name", ["retromae", "simlm"])
def test_row_terms_of_chunks_add_up_to_the_batch(name, tok, tiny_bert, tiny_generator):
    """row_terms on the Layout's chunks of a batch sum to row_terms on the whole batch, loss, logged terms and
    gradients: each term is a mean over the whole batch's tokens (the gradient cache's contract)."""
    model = make(tiny_bert, name, **({"generator_name_or_path": tiny_generator} if name == "simlm" else {}))
    obj = model.objective
    torch.manual_seed(0)
    batch = obj.prepare(model, obj.make_collator(tok, max_length=24)(rows_from_docs(5)))
    params = list(model.parameters())

    def run(part):
        states, vec = obj.encode(model, part)
        terms = obj.row_terms(model, part, states, vec)
        loss = obj.total(terms)
        loss.backward()
        return loss.detach(), terms

    whole, whole_terms = run(batch)
    want = grads(params)
    for p in params:
        p.grad = None
    total, summed = 0, {}
    for _, part in batch["layout"].chunks(batch, 2):
        loss, terms = run(part)
        total = total + loss
        for k, v in terms.items():
            summed[k] = summed.get(k, 0) + v
    torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)
    for k in whole_terms:
        torch.testing.assert_close(summed[k], whole_terms[k], atol=1e-5, rtol=1e-5)
    assert_same_grads(grads(params), want, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# wired in: the gradient cache and train.py
# ---------------------------------------------------------------------------------------------------------------
from test_gradient_cache import _step, no_dropout_bert, positional_dropout  # noqa: E402,F401  (fixtures)
from test_train import base_args, groups, read_log, run  # noqa: E402,F401  (groups: a fixture)


def options_for(objective, generator):
    return {"generator_name_or_path": generator} if objective == "simlm" else {}


def _assert_same_step(plain_out, plain_grads, cached_out, cached_grads):
    """The cached step's loss, logged terms (with the retention term) and gradients equal the plain step's."""
    assert set(plain_out) == set(cached_out) and "retention_loss" in plain_out
    for k in plain_out:
        torch.testing.assert_close(cached_out[k], plain_out[k], atol=1e-5, rtol=1e-5)
    assert set(plain_grads) == set(cached_grads)
    for n in plain_grads:
        torch.testing.assert_close(cached_grads[n], plain_grads[n], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("objective", ["retromae", "simlm", "contriever"])
def test_cached_step_equals_the_plain_step(tiny_bert, tok, tiny_generator, positional_dropout, objective, chunk=2):
    """XPRTModel.cached_step over the baselines' methods: the loss, every logged term and every gradient of the plain
    step, retention included, for chunks that do not divide the batch (5 groups: 2 + 2 + 1). Dropout is made
    batch-independent (test_gradient_cache.positional_dropout), prepare's draws equal by the same seed on both sides."""
    from plumbing.model_folder import load_teacher

    torch.manual_seed(0)
    model = XPRTModel(load_mlm_encoder(str(tiny_bert))[0], objective=objective,
                      **options_for(objective, tiny_generator)).train()
    teacher = load_teacher(str(tiny_bert))
    with torch.no_grad():  # a teacher the student has drifted from: a retention term with a real gradient
        g = torch.Generator().manual_seed(1)
        for q in teacher.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=g))
    batch = model.objective.make_collator(tok, max_length=24, seed=4)(rows_from_docs(5))
    torch.manual_seed(3)
    plain_out, plain_grads = _step(model, batch, teacher)
    torch.manual_seed(3)
    cached_out, cached_grads = _step(model, batch, teacher, chunk)
    _assert_same_step(plain_out, plain_grads, cached_out, cached_grads)


TERMS = {"retromae": ["mlm_loss", "decoder_loss"], "simlm": ["encoder_rlm_loss", "decoder_rlm_loss"],
         "contriever": ["contrastive_loss"]}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["retromae", "simlm", "contriever"])
def test_train_runs_the_baseline_and_its_terms_move(tiny_bert, tiny_generator, groups, tmp_path, objective):
    """train.py --objective <baseline> on the test groups (select_groups.py's schema): 6 steps, every term of the
    objective logged at every step, the vocabulary terms falling, the contrastive term moving (8 steps: with the
    masks drawn per (seed, epoch, batch), RetroMAE's MLM term fell 0.048 by steps 5-6)."""
    kw = {"--max_train_steps": 8, "--learning_rate": 1e-3, "--objective": objective, "--no_save_model": True,
          "--generator_name_or_path": tiny_generator if objective == "simlm" else None}
    run(base_args(tiny_bert, groups, tmp_path / "p", **kw))
    log = read_log(tmp_path / "p")
    assert sorted(log) == [1, 2, 3, 4, 5, 6, 7, 8]
    for t in TERMS[objective]:
        first, last = log[1][t], sum(log[s][t] for s in (7, 8)) / 2
        print(objective, t, [round(log[s][t], 3) for s in sorted(log)])
        if objective == "contriever":
            assert first != last
        else:
            assert last < first - 0.05, (t, first, last)
    assert "retention_loss" in log[1]


@pytest.mark.slow
def test_train_with_the_cache_logs_the_plain_runs_losses(no_dropout_bert, groups, tmp_path, objective="retromae"):
    """As test_gradient_cache's test of the same name, through train.py's step and its prepare (the decoder's masks
    drawn once per step, before the chunks): 2 steps of 5 groups, chunks of 2, accumulation 2; the first step's terms
    equal the plain run's. (The other baselines: test_cached_step_equals_the_plain_step.)"""
    kw = {"--max_train_steps": 2, "--max_groups": 40, "--per_device_train_batch_size": 5, "--learning_rate": 1e-3,
          "--gradient_accumulation_steps": 2, "--objective": objective, "--no_save_model": True}
    run(base_args(no_dropout_bert, groups, tmp_path / "p", **kw))
    run(base_args(no_dropout_bert, groups, tmp_path / "c", **{**kw, "--gradient_cache_chunk": 2}))
    plain, cached = read_log(tmp_path / "p"), read_log(tmp_path / "c")
    for k in plain[1]:
        if k.endswith("loss"):
            assert cached[1][k] == pytest.approx(plain[1][k], rel=1e-5, abs=1e-7), k
    assert cached[2]["loss"] == pytest.approx(plain[2]["loss"], rel=1e-3)


def test_train_contriever_official_runs_moco_and_resumes_exactly(tiny_bert, groups, tmp_path):
    """train.py --objective contriever --baseline_setting official: MoCo (65,536 keys, momentum 0.9995), a moving
    loss; stopped at step 2 and resumed, its logged losses equal the uninterrupted 4 steps' (the key encoder and the
    queue are in the checkpoint: accelerate's custom_checkpoint_0.pkl); the saved folder is the query encoder only
    (its heads file holds the MLM head, its config the mode)."""
    from safetensors.torch import load_file

    kw = {"--max_train_steps": 4, "--learning_rate": 1e-3, "--objective": "contriever",
          "--baseline_setting": "official", "--checkpointing_steps": 2}
    run(base_args(tiny_bert, groups, tmp_path / "a", **kw))
    run(base_args(tiny_bert, groups, tmp_path / "b", **{**kw, "--stop_after_steps": 2, "--no_save_model": True}))
    state = torch.load(tmp_path / "b" / "checkpoints" / "step_2" / "custom_checkpoint_0.pkl", weights_only=False)
    assert state["queue"].shape == (32, 65536) and int(state["ptr"]) == 8  # 2 steps of 4 keys
    run(base_args(tiny_bert, groups, tmp_path / "b", **{**kw, "--resume_from_checkpoint": "latest",
                                                        "--no_save_model": True}))
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    print("contriever moco", [round(a[s]["contrastive_loss"], 4) for s in range(1, 5)],
          [round(b[s]["contrastive_loss"], 4) for s in range(1, 5)])
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in range(1, 5):
        for k in ("loss", "contrastive_loss", "retention_loss"):
            assert a[s][k] == pytest.approx(b[s][k], rel=1e-5, abs=1e-6), (s, k, a[s][k], b[s][k])
    assert len({round(a[s]["contrastive_loss"], 6) for s in range(1, 5)}) > 1  # the loss moves
    folder = tmp_path / "a" / "model"
    heads = load_file(folder / "xprt_heads.safetensors")
    assert all(k.startswith("mlm_head.") for k in heads)
    cfg = json.loads((folder / "xprt_config.json").read_text())["heads"]
    assert (cfg["contrastive_mode"], cfg["moco_queue_size"], cfg["moco_momentum"]) == ("moco", 65536, 0.9995)
    weights = load_file(folder / "model.safetensors")
    assert not any("key_encoder" in k or "queue" in k for k in weights)


def test_objective_flags_belong_to_their_objectives():
    """Every objective declares its own flags (Objective.flags); train.py offers them all, and one given with an
    objective that does not take it is refused in one line naming the flag and its objectives (never ignored, never a
    traceback from the constructor). Each flag parses for the objectives that take it, and hands them its value."""
    import train
    from modeling_xprt import objective_class, objective_flags
    from plumbing.common import UserError

    base = ["--groups_dir", "g", "--model_name_or_path", "m", "--output_dir", "o"]
    flags = objective_flags()
    assert {"--no_fill_in", "--xp_weight", "--baseline_setting", "--generator_name_or_path", "--contrastive_mode",
            "--moco_queue_size", "--moco_momentum", "--lm_name_or_path", "--lora_rank"} <= set(flags)
    for flag, (spec, owners) in flags.items():
        value = [] if spec.get("action") == "store_true" else [spec["choices"][-1]] if "choices" in spec else None
        for text in ("1", "0.5", "x") if value is None else ():  # the first value the flag's type accepts
            try:
                (spec.get("type") or str)(text)
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
            value = [text]
            break
        for objective in ("xprt", "retromae", "contriever", "revela"):
            argv = base + ["--objective", objective, flag, *value]
            if objective in owners:
                args = train.parse_args(argv)
                assert getattr(args, flag[2:]) is not None
                assert objective_class(objective).options_from_flags(args), (flag, objective)
            else:
                with pytest.raises(UserError, match=f"{flag}: a flag of --objective {' / '.join(owners)}, not of"):
                    train.parse_args(argv)


def test_moco_flag_values_are_checked_at_parse_time():
    """--moco_queue_size >= 1, --moco_momentum in (0, 1], --contrastive_mode one of its choices: one line each."""
    import train
    from plumbing.common import UserError

    base = ["--groups_dir", "g", "--model_name_or_path", "m", "--output_dir", "o", "--objective", "contriever"]
    for bad in (["--moco_queue_size", "0"], ["--moco_momentum", "-1"], ["--contrastive_mode", "queue"]):
        with pytest.raises(UserError):
            train.parse_args(base + bad)
    with pytest.raises(UserError, match=r"--moco_momentum: 1.5 is not a number in \(0, 1\]"):
        train.parse_args(base + ["--moco_momentum", "1.5"])
    assert train.parse_args(base + ["--moco_momentum", "1"]).moco_momentum == 1.0
    args = train.parse_args(base + ["--contrastive_mode", "moco"])
    assert (args.contrastive_mode, args.moco_queue_size, args.moco_momentum) == ("moco", None, None)


def test_moco_queue_must_hold_whole_batches(tiny_bert, groups, tmp_path):
    """A queue that the global batch does not divide is refused before the first step, naming the flag (moco.py
    asserts it in its first enqueue)."""
    from plumbing.common import UserError

    with pytest.raises(UserError, match="--moco_queue_size 10 is no multiple"):
        run(base_args(tiny_bert, groups, tmp_path / "q", **{"--max_train_steps": 1, "--objective": "contriever",
                                                            "--contrastive_mode": "moco", "--moco_queue_size": 10}))


def test_contriever_moco_cached_step_equals_the_plain_step(tiny_bert, tok, positional_dropout, chunk=2):
    """Under the gradient cache (encode called twice per chunk) the momentum update and the enqueue happen once per
    step, as in the plain step: from the same MoCo state, the loss, the terms and every gradient agree, and so do
    the key encoder, queue and pointer after the step. Dropout batch-independent (positional_dropout), the key
    encoder in train mode as the official one."""
    import copy

    from plumbing.model_folder import load_teacher

    torch.manual_seed(0)
    model = XPRTModel(load_mlm_encoder(str(tiny_bert))[0], objective="contriever", baseline_setting="official",
                      moco_queue_size=10).train()
    teacher = load_teacher(str(tiny_bert))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for q in teacher.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=g))
    collate = model.objective.make_collator(tok, max_length=24, seed=4)
    model(collate(rows_from_docs(10)[5:]))  # a first step: the queue holds keys, the pointer is at 5
    moco = model.objective.moco
    start = copy.deepcopy(moco.state_dict())
    batch = collate(rows_from_docs(5))
    plain_out, plain_grads = _step(model, batch, teacher)
    after_plain = copy.deepcopy(moco.state_dict())
    moco.load_state_dict(copy.deepcopy(start))
    cached_out, cached_grads = _step(model, batch, teacher, chunk)
    after_cached = moco.state_dict()
    assert int(after_plain["ptr"]) == int(after_cached["ptr"]) == 0
    _assert_same_step(plain_out, plain_grads, cached_out, cached_grads)
    torch.testing.assert_close(after_cached["queue"], after_plain["queue"], atol=1e-6, rtol=1e-5)
    for n, w in after_plain["key_encoder"].items():
        torch.testing.assert_close(after_cached["key_encoder"][n], w, atol=0, rtol=0)
