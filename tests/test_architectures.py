"""Every encoder family AutoModelForMaskedLM loads, through the scripts: architectures.py's parts measured against each
encoder's own forward, one training step of every objective per architecture through train.main on select_groups.py's
own output, and one non-BERT model end to end (select -> train -> finetune -> evaluate). Tiny random models built from
transformers configs, with the MiniLM tokenizer (vocab_size matching it): no other tokenizer is at hand offline."""

import json
import math
import os

import pytest
import torch
from conftest import ROOT, cli_args

import modeling_xprt as mx
from plumbing import architectures as A
from plumbing import model_folder
from plumbing.model_folder import load_xprt_folder
from plumbing import embed

ARCHS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "modernbert", "mpnet", "deberta-v2")
_SPECIAL = dict(pad_token_id=0, bos_token_id=101, eos_token_id=102)


def tiny_config(kind: str, vocab_size: int, **extra):
    """A tiny config of each family: 2-3 layers, hidden 32 (ELECTRA: embedding 32 projected up to hidden 64),
    special ids of the MiniLM tokenizer. RoBERTa-style position tables hold 514 (512 + the padding offset of 2)."""
    import transformers as T

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    cfg = {
        "bert": (T.BertConfig, small),
        "roberta": (T.RobertaConfig, {**small, "max_position_embeddings": 514, **_SPECIAL}),
        "xlm-roberta": (T.XLMRobertaConfig, {**small, "max_position_embeddings": 514, **_SPECIAL}),
        "distilbert": (T.DistilBertConfig, dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, pad_token_id=0)),
        "electra": (T.ElectraConfig, {**small, "embedding_size": 32, "hidden_size": 64, "intermediate_size": 128}),
        # 3 layers: ModernBERT's global layer 0 and two sliding-window layers (local_attention 16)
        "modernbert": (T.ModernBertConfig, {**small, "num_hidden_layers": 3, "local_attention": 16, **_SPECIAL,
                                            "cls_token_id": 101, "sep_token_id": 102}),
        "mpnet": (T.MPNetConfig, {**small, "max_position_embeddings": 514, **_SPECIAL}),
        # DeBERTa-v3's layout: relative attention both ways, no absolute positions
        "deberta-v2": (T.DebertaV2Config, {**small, "relative_attention": True, "position_buckets": 16,
                                           "max_relative_positions": -1, "pos_att_type": ["p2c", "c2p"],
                                           "position_biased_input": False, "pad_token_id": 0}),
    }[kind]
    return cfg[0](vocab_size=vocab_size, **{**cfg[1], **extra})


def build_tiny(kind: str, path, seed: int = 0, **extra):
    """A random *ForMaskedLM of `kind` with the MiniLM tokenizer saved to `path`."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from plumbing.common import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    torch.manual_seed(seed)
    AutoModelForMaskedLM.from_config(tiny_config(kind, tok.vocab_size, **extra)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {k: str(build_tiny(k, root / k)) for k in ARCHS}


@pytest.fixture(scope="module")
def groups(tiny_bert, tmp_path_factory):
    """select_groups.py's own output on 12 bundled documents (the groups every training run reads)."""
    from test_select_groups import _docs, _write_jsonl

    import select_groups

    tmp = tmp_path_factory.mktemp("arch_groups")
    docs = _write_jsonl(tmp / "docs.jsonl", _docs(12))
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir",
                        str(tmp / "groups"), "--centrality_threshold", "-1"])
    return tmp / "groups"


def _batch(tok, texts):
    return tok(texts, padding=True, return_tensors="pt")


# every term of each objective, the retention term included, is in its step's log record
TERMS = {"xprt": {"xp_loss", "cross_fill_loss", "self_fill_loss", "mlm_loss", "uniformity_loss", "retention_loss"},
         "contrastive_random_span": {"contrastive_loss", "retention_loss"},
         "self_reconstruction": {"recon_loss", "mlm_loss", "retention_loss"},
         "retromae": {"decoder_loss", "mlm_loss", "retention_loss"},
         "simlm": {"encoder_rlm_loss", "decoder_rlm_loss", "retention_loss"},
         "contriever": {"contrastive_loss", "retention_loss"},
         "revela": {"revela_loss", "retention_loss"}}
MAIN_TERM = {"xprt": "xp_loss", "contrastive_random_span": "contrastive_loss", "self_reconstruction": "recon_loss",
             "retromae": "decoder_loss", "simlm": "decoder_rlm_loss", "contriever": "contrastive_loss",
             "revela": "revela_loss"}
# RetroMAE's enhanced decoding splits BERT's attention layout into two streams and adds absolute position embeddings of
# the hidden size to the query stream: the families without them (ELECTRA's are embedding-sized) are refused at load
RETROMAE_REFUSED = {"distilbert", "electra", "modernbert", "mpnet", "deberta-v2"}
TEXTS = ["the cat sat on the mat", "a short one", "passages of uneven length make padding"]


# ---------------------------------------------------------------------------------------------------------------
# The parts, against each encoder's own forward
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ARCHS)
def test_parts_reproduce_the_encoder(tiny, kind):
    """Per architecture: the encoder's own layers re-run by run_layers on token_embeddings reproduce its output, so do
    copies of all its layers (copy_last_layers, SimLM's decoder); mlm_head's transform + projection reproduces its
    logits and carries gradient to the hidden states; decoder_layers are fresh layers of its own class."""
    from transformers import AutoTokenizer

    mlm, msg = model_folder.load_mlm_encoder(tiny[kind])
    mlm.eval()
    base = mlm.base_model
    tok = AutoTokenizer.from_pretrained(tiny[kind])
    b = _batch(tok, TEXTS)
    ids, mask = b["input_ids"], b["attention_mask"]
    owner, attr, stack = A.layer_stack(base)
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask)[0]
        emb = A.token_embeddings(base, ids, mask)
        assert emb.shape == want.shape  # hidden-size vectors, ELECTRA's projected up from 32 to 64
        own = A.run_layers(base, stack, emb, mask, (owner, attr))
        copies = A.run_layers(base, A.copy_last_layers(mlm, len(stack)), emb, mask, (owner, attr))
        logits = mlm(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(own[real], want[real], atol=1e-5)
    assert torch.allclose(copies[real], want[real], atol=1e-5)
    head = A.mlm_head(mlm)
    h = want.detach().requires_grad_()
    split = torch.nn.functional.linear(head.transform(h), head.weight, head.bias)
    assert torch.allclose(split, logits, atol=1e-4)
    split[0, 1].logsumexp(-1).backward()
    assert h.grad[0, 1].abs().sum() > 0 and h.grad[1].abs().sum() == 0
    fresh = A.decoder_layers(mlm, 2)
    assert len(fresh) == 2 and all(type(layer) is type(stack[0]) for layer in fresh)
    p_fresh, p_enc = dict(fresh[0].named_parameters()), dict(stack[0].named_parameters())
    assert set(p_fresh) == set(p_enc)
    assert any(not torch.equal(p_fresh[k], p_enc[k]) for k in p_enc if p_enc[k].dim() == 2)  # re-initialised
    if kind == "electra":  # the vocabulary side stays at the embedding size
        assert head.weight.shape == (tok.vocab_size, 32) and head.transform(h).shape[-1] == 32


PREPARED_MASK = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet"}  # measured by the load's probe


@pytest.mark.parametrize("kind", ARCHS)
def test_the_prepared_mask_gives_the_encoders_own_output(tiny, kind):
    """The load says which attention mask the encoder runs with (probe_prepared_mask). Where it is the one made per call
    (mask_for_layers: no host sync), the encoder's states on a padded batch longer than ModernBERT's 16-token window
    equal those of its own mask. ModernBERT keeps its 2D mask: forced to take a prepared one, its sliding-window
    layers would see the whole passage (the output moves); DeBERTa-v2 refuses one."""
    from transformers import AutoTokenizer

    mlm, msg = model_folder.load_mlm_encoder(tiny[kind])
    base = mlm.base_model.eval()
    assert ("attention mask: prepared per call" in msg) == (kind in PREPARED_MASK), msg
    tok = AutoTokenizer.from_pretrained(tiny[kind])
    b = _batch(tok, [" ".join(TEXTS * 3), TEXTS[0]])
    ids, mask = b["input_ids"], b["attention_mask"]
    assert ids.shape[1] > 40 and not mask.all()
    real = mask.bool()
    with torch.no_grad():
        want = base(input_ids=ids, attention_mask=mask)[0]
        got = base(input_ids=ids, attention_mask=A.mask_for_layers(base, mask))[0]
        assert torch.allclose(got[real], want[real], atol=1e-5)
        if kind == "modernbert":
            base.xprt_prepared_mask = True
            forced = base(input_ids=ids, attention_mask=A.mask_for_layers(base, mask))[0]
            assert not torch.allclose(forced[real], want[real], atol=1e-3)


def test_attention_falls_back_where_the_architecture_has_no_sdpa(tiny):
    """MPNet and DeBERTa-v2 have no SDPA attention in transformers: they load with their own, and the messages say so;
    BERT keeps SDPA."""
    for kind in ("mpnet", "deberta-v2"):
        mlm, msg = model_folder.load_mlm_encoder(tiny[kind])
        assert "has no SDPA attention: using its own (eager)" in msg
        assert mlm.config._attn_implementation == "eager"
        assert "has no SDPA attention" in model_folder.load_teacher(tiny[kind]).xprt_load_message
    mlm, msg = model_folder.load_mlm_encoder(tiny["bert"])
    assert mlm.config._attn_implementation == "sdpa" and "SDPA" not in msg


def test_teacher_load_states_the_facts_without_transformers_report(tiny, caplog):
    """A start saved with an MLM head loads as the teacher without transformers' LOAD REPORT; the teacher's message
    names the left-out head tensors instead."""
    import logging

    with caplog.at_level(logging.INFO):
        teacher = model_folder.load_teacher(tiny["distilbert"])
    assert "LOAD REPORT" not in caplog.text
    assert "5 checkpoint tensors it has no module for (e.g. vocab_layer_norm.bias" in teacher.xprt_load_message
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training


def test_pooler_message_says_what_it_is_kept_for(tiny_bert, tmp_path):
    """The start's pooler is kept for the saved folder; the message names the sentence vector of the model's own
    pooling, not "mean pooling" for a [CLS]-pooled start."""
    from transformers import AutoModel

    folder = tmp_path / "with_pooler"
    AutoModel.from_pretrained(tiny_bert).save_pretrained(folder)  # BertModel: has a pooler, no MLM head
    _, mean_msg = model_folder.load_mlm_encoder(str(folder))
    _, cls_msg = model_folder.load_mlm_encoder(str(folder), pooling="cls")
    assert "pooler.dense.bias, pooler.dense.weight unchanged so the saved folder is a complete BertModel" in mean_msg
    assert "the sentence vector is the mean of the token vectors" in mean_msg
    assert "the sentence vector is the [CLS] token's last hidden state" in cls_msg
    assert "mean pooling" not in cls_msg


def test_an_encoder_that_reads_its_embeddings_outside_its_layers_is_refused(tmp_path):
    """DeBERTa-v2 with a convolution (conv_kernel_size > 0: deberta-v2-xlarge) adds a convolution of its embedding
    output after its first layer: a decoder layer run on the decoder's input cannot be run as the encoder runs its
    own, so loading refuses, naming the architecture and what fails; train.py refuses before it reads any data (its
    groups are only counted before the model loads)."""
    from test_train import base_args, make_groups

    import train

    path = build_tiny("deberta-v2", tmp_path / "conv", conv_kernel_size=3)
    refusal = r"DebertaV2Model does not run its layers on what it hands its first layer alone .*cannot be built for it"
    with pytest.raises(ValueError, match=refusal):
        model_folder.load_mlm_encoder(str(path))
    with pytest.raises(ValueError, match=refusal):
        train.main(base_args(str(path), make_groups(tmp_path / "groups", 8), tmp_path / "out"))


def test_non_legacy_deberta_head_projects_with_a_bare_matmul(tmp_path):
    """DeBERTa-v2's non-legacy head multiplies by the word embeddings itself (its get_output_embeddings names a
    (H, H) layer): mlm_head finds the vocabulary matrix and its bias all the same."""
    mlm, _ = model_folder.load_mlm_encoder(str(build_tiny("deberta-v2", tmp_path / "nl", legacy=False)))
    head = A.mlm_head(mlm)
    assert head.weight is mlm.get_input_embeddings().weight
    assert head.bias is mlm.lm_predictions.lm_head.bias


def test_flop_count_reads_layer_shapes_off_the_modules(tiny):
    """layer_multiply_adds: BERT's 4 h^2 + 2 h inner; DistilBERT's (named dim / hidden_dim / n_layers) the same
    numbers; ModernBERT's gated MLP counts its 2 x inner input matrix."""
    for kind, n, per_token in (("bert", 2, 4 * 32 * 32 + 2 * 32 * 64), ("distilbert", 2, 4 * 32 * 32 + 2 * 32 * 64),
                               ("modernbert", 3, 3 * 32 * 32 + 32 * 32 + 32 * 128 + 64 * 32)):
        mlm, _ = model_folder.load_mlm_encoder(tiny[kind])
        assert A.layer_multiply_adds(mlm) == (n, per_token, 32)
        assert A.head_multiply_adds(mlm) == 32 * 32 + 32 * mlm.config.vocab_size


# ---------------------------------------------------------------------------------------------------------------
# Through the scripts
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ARCHS)
def test_every_objective_trains_and_the_folder_round_trips(tiny, groups, kind, tmp_path):
    """train.main, one step of each pre-training objective (xprt, contrastive_random_span, self_reconstruction) with
    the retention term, on select_groups.py's groups; finite losses. The xprt run's saved folder loads back as an
    XPRTModel with its decoder restored and in AutoModel with the same vectors."""
    from test_baselines import build_tiny_generator
    from test_revela import build_tiny_lm
    from test_train import base_args, read_log
    from transformers import AutoModel, AutoTokenizer

    import train

    generator = build_tiny_generator(tmp_path / "generator")
    lm = build_tiny_lm(tmp_path / "lm", tiny[kind])  # Revela's language model, with the encoder's tokenizer
    assert set(mx.pretraining_objectives()) <= set(TERMS)
    for objective in mx.pretraining_objectives():
        out = tmp_path / objective
        argv = base_args(tiny[kind], groups, out, **{"--objective": objective, "--max_train_steps": 1,
                                                      "--no_save_model": objective != "xprt",
                                                      "--generator_name_or_path": generator if objective == "simlm"
                                                      else None,
                                                      "--lm_name_or_path": lm if objective == "revela" else None})
        if objective == "retromae" and kind in RETROMAE_REFUSED:
            with pytest.raises(ValueError, match="RetroMAE's enhanced decoding needs"):
                train.main(argv)
            assert not (out / "train_log.jsonl").exists()  # refused before any step
            continue
        train.main(argv)
        step = read_log(out)[1]
        print(kind, objective, {k: round(v, 4) for k, v in step.items() if k.endswith("loss")})
        assert TERMS[objective] <= set(step), (objective, step)
        assert all(math.isfinite(step[k]) for k in TERMS[objective] | {"loss"})
        assert step[MAIN_TERM[objective]] > 0.1  # groups of several documents meet
    folder = tmp_path / "xprt" / "model"
    again = load_xprt_folder(mx.XPRTModel, str(folder))
    assert "xprt heads restored" in again.load_message
    tok = AutoTokenizer.from_pretrained(folder)
    auto = AutoModel.from_pretrained(folder).eval()
    assert torch.allclose(embed.embed_texts(auto, tok, TEXTS), embed.embed_texts(again.encoder.eval(), tok, TEXTS),
                          atol=1e-5)


# the suite runs one non-BERT architecture end to end; XPRT_E2E_ALL_ARCHS=1 runs every one (the README's matrix)
E2E = ARCHS if os.environ.get("XPRT_E2E_ALL_ARCHS") else ("modernbert",)


@pytest.mark.slow
@pytest.mark.parametrize("kind", E2E)
def test_end_to_end(tiny, tmp_path, kind):
    """A start of the architecture (by default ModernBERT: pre-norm, rotary, sliding-window layers, a gated MLP)
    through every script: select_groups.py with it, train.py (xprt), finetune.py from the trained folder,
    evaluate.py on the bundled SciFact sample; every stage's model folder loads in sentence-transformers."""
    from sentence_transformers import SentenceTransformer
    from test_finetune import make_beir
    from test_select_groups import _docs, _write_jsonl
    from test_train import base_args

    import evaluate
    import finetune
    import select_groups
    import train

    start = tiny[kind]
    docs = _write_jsonl(tmp_path / "docs.jsonl", _docs(12))
    select_groups.main(["--input", str(docs), "--model_name_or_path", start, "--output_dir", str(tmp_path / "groups"),
                        "--centrality_threshold", "-1"])
    train.main(base_args(start, tmp_path / "groups", tmp_path / "pre", **{"--max_document_groups_per_batch": 0,
                                                                          "--max_train_steps": 2,
                                                                          "--max_groups": 8}))
    pre = tmp_path / "pre" / "model"
    beir = make_beir(tmp_path / "beir")
    finetune.main(cli_args({"--model_name_or_path": str(pre), "--beir_dir": str(beir),
                            "--output_dir": str(tmp_path / "ft"), "--per_device_train_batch_size": 4,
                            "--max_train_steps": 2, "--num_negatives": 1, "--negatives_rank_min": 1,
                            "--negatives_rank_max": 5, "--report_to": "none"}))
    tuned = tmp_path / "ft" / "model"
    for folder in (pre, tuned):
        hidden = json.loads((folder / "config.json").read_text()).get("hidden_size", 32)
        assert SentenceTransformer(str(folder), device="cpu").encode(TEXTS).shape == (3, hidden)
    evaluate.main(["--models", str(tuned), "--local_tasks", str(ROOT / "data" / "eval" / "scifact"), "--output_dir",
                   str(tmp_path / "eval"), "--device", "cpu", "--batch_size", "64"])
    result = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "SciFact" in json.dumps(result)


def test_the_longest_input_is_measured_as_each_family_applies_its_positions():
    """architectures.longest_input (train.py's --max_length check): a position table of 512 rows takes 512 tokens;
    RoBERTa-style tables start after the padding index (here 0: 514 rows take 513; 1 in the real models: 512);
    MPNet's 514 rows take 512; rotary (ModernBERT) and relative-only (DeBERTa-v3) positions have no table, so the
    probe's bound (600) comes back."""
    from transformers import AutoModel

    from plumbing.architectures import longest_input

    want = {"bert": 512, "roberta": 513, "xlm-roberta": 513, "distilbert": 512, "electra": 512, "modernbert": 600,
            "mpnet": 512, "deberta-v2": 600}
    for kind in ARCHS:
        torch.manual_seed(0)
        assert longest_input(AutoModel.from_config(tiny_config(kind, 30522)), 600) == want[kind], kind


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta", "mpnet"])
def test_every_length_limit_is_the_one_the_model_takes(kind, tmp_path):
    """modeling_xprt.max_seq_length with the loaded model measures what its position table holds (issue 54 item 8:
    a RoBERTa-family table of 66 rows, padding index 0, holds 65 tokens, and select_groups.py indexed position 66).
    Over every family with a table: the limit XPRTModel records and the one select_groups.py embeds at are tokens
    the model takes, and a selection with such a start runs."""
    import json

    from transformers import AutoModel

    import modeling_xprt as mx
    import select_groups
    from plumbing.architectures import runs_at_length
    from test_select_groups import _docs, _write_jsonl

    folder = build_tiny(kind, tmp_path / kind, max_position_embeddings=66)
    base = AutoModel.from_pretrained(folder)
    limit = mx.max_seq_length(base.config, None, base)
    assert limit <= 66 and runs_at_length(base, limit) and not runs_at_length(base, limit + 1)
    assert load_xprt_folder(mx.XPRTModel, str(folder)).max_seq_length == limit
    docs = tmp_path / "docs.jsonl"
    _write_jsonl(docs, _docs(6))
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(folder), "--output_dir",
                        str(tmp_path / "groups"), "--centrality_threshold", "-1", "--passage_tokens", "48"])
    assert json.loads((tmp_path / "groups" / "stats.json").read_text())["groups"] > 0
