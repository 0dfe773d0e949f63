"""finetune.py: BEIR loading, hard-negative mining, PAIR stage-1 generation + denoising on tiny random
models, and a few fine-tuning steps whose loss falls."""

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import cli_args
from test_train import read_log
from test_train import run as run_main

import finetune
from plumbing.common import UserError
from plumbing.readers import load_beir
from plumbing.model_folder import load_xprt_folder, save_xprt_folder

ROOT = Path(__file__).resolve().parent.parent


def make_beir(out: Path, num_docs: int = 60, num_queries: int = 16) -> Path:
    """A BEIR-layout folder from bundled paragraphs: query i = the first words of passage i (its positive); query 0
    has two positives; passage dup-1 is an exact copy of passage 1 (a duplicated corpus entry)."""
    paras = []
    with open(ROOT / "data" / "docs.jsonl", encoding="utf-8") as f:
        for line in f:
            paras += [p for p in json.loads(line)["text"].split("\n") if len(p) > 80]
            if len(paras) >= num_docs:
                break
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    corpus = [{"_id": f"d{i}", "title": "", "text": p} for i, p in enumerate(paras[:num_docs])]
    corpus.append({"_id": "dup-1", "title": "", "text": paras[1]})
    queries = [{"_id": f"q{i}", "text": " ".join(paras[i].split()[:8])} for i in range(num_queries)]
    (out / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in corpus) + "\n")
    (out / "queries.jsonl").write_text("\n".join(json.dumps(q) for q in queries) + "\n")
    lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in range(num_queries)] + ["q0\td5\t1"]
    (out / "qrels" / "train.tsv").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def beir(tmp_path_factory):
    return make_beir(tmp_path_factory.mktemp("beir"))


def run(argv):
    return run_main(argv, main=finetune.main)


def read_beir(folder, split):
    """load_beir as finetune.py reads it: passages as 'title text', the relevant (score > 0) qrels."""
    data = load_beir(folder, split)
    corpus = {d: finetune.passage_text(*tt) for d, tt in data["corpus"].items()}
    qrels = {q: {d: s for d, s in ds.items() if s > 0} for q, ds in data["qrels"].items()}
    return corpus, data["queries"], qrels


def test_load_beir_reads_train_qrels(beir):
    corpus, queries, qrels = read_beir(str(beir), "train")
    assert len(corpus) == 61 and len(queries) == 16
    assert qrels["q0"] == {"d0": 1, "d5": 1} and sum(len(v) for v in qrels.values()) == 17


def test_mined_negatives_never_include_a_positive_of_the_same_query(beir, tiny_bert):
    """With the window covering the whole corpus every positive is inside it, so exclusion is really exercised:
    each pool must be the corpus minus exactly that query's positives (and the copy of q1's positive)."""
    from transformers import AutoModel, AutoTokenizer

    from plumbing.embed import embed_texts

    corpus, queries, qrels = read_beir(str(beir), "train")
    model, tok = AutoModel.from_pretrained(tiny_bert), AutoTokenizer.from_pretrained(tiny_bert)
    qids, cids = sorted(qrels), sorted(corpus)
    args = (model, tok, [queries[q] for q in qids], [set(qrels[q]) for q in qids], cids, [corpus[c] for c in cids])
    pools = finetune.mine_hard_negatives(*args, rank_min=1, rank_max=len(cids))
    for q, pool in zip(qids, pools):
        assert not set(pool) & set(qrels[q]), q
        dup = {"dup-1", "d1"} if q == "q1" else set()
        assert set(pool) == set(cids) - set(qrels[q]) - dup, q
    # a window [10, 30] keeps, in rank order, ranks 10..30 of an independent ranking, minus positives
    deep = finetune.mine_hard_negatives(*args, rank_min=10, rank_max=30)
    q = embed_texts(model, tok, [queries[x] for x in qids], max_length=32)
    c = embed_texts(model, tok, [corpus[x] for x in cids], max_length=128)
    top = (q @ c.T).topk(30, dim=1).indices.tolist()
    for x, row, pool in zip(qids, top, deep):
        want = [cids[j] for j in row[9:30] if cids[j] not in qrels[x] and not (x == "q1" and cids[j] == "dup-1")]
        assert pool == want, x


def tiny_seq2seq_and_cross_encoder(tmp: Path):
    """Random tiny T5 generator and BERT cross-encoder, built from configs, with the MiniLM (BERT) tokenizer."""
    from transformers import (AutoTokenizer, BertConfig, BertForSequenceClassification, T5Config,
                              T5ForConditionalGeneration)

    from plumbing.common import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=tok.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                             num_heads=2, decoder_start_token_id=tok.pad_token_id,
                                             pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id))
    ce = BertForSequenceClassification(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=64, num_labels=1))
    t5.save_pretrained(tmp / "gen")
    tok.save_pretrained(tmp / "gen")
    ce.save_pretrained(tmp / "ce")
    tok.save_pretrained(tmp / "ce")
    return tmp / "gen", tmp / "ce"


def test_pseudo_query_generation_and_denoising_on_tiny_random_models(tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification, AutoTokenizer

    gen_path, ce_path = tiny_seq2seq_and_cross_encoder(tmp_path)
    tok = AutoTokenizer.from_pretrained(gen_path)
    gen = AutoModelForSeq2SeqLM.from_pretrained(gen_path).eval()
    passages = ["The heart pumps blood through the body.", "Rain falls from clouds.", "Stocks rose on Monday."]
    pairs = finetune.generate_pseudo_queries(gen, tok, passages, num_per_passage=2, max_new_tokens=6, batch_size=2)
    assert [pi for pi, _ in pairs] == [0, 0, 1, 1, 2, 2]
    assert all(isinstance(q, str) for _, q in pairs)
    assert pairs == finetune.generate_pseudo_queries(gen, tok, passages, 2, 6, batch_size=2)  # seeded sampling
    ce = AutoModelForSequenceClassification.from_pretrained(ce_path).eval()
    qs, ps = [q or "empty" for _, q in pairs], [passages[pi] for pi, _ in pairs]
    scores = finetune.cross_encoder_scores(ce, tok, qs, ps, batch_size=4)
    # independent computation: one pair at a time
    with torch.no_grad():
        ref = torch.stack([torch.sigmoid(ce(**tok(q, p, return_tensors="pt")).logits[0, 0]) for q, p in zip(qs, ps)])
    assert torch.allclose(scores, ref, atol=1e-5)
    thr = scores.median().item()
    kept = finetune.denoise_pseudo_queries(list(zip([pi for pi, _ in pairs], qs)), passages, scores, thr)
    assert kept == [(pi, q) for pi, q, s in zip([p for p, _ in pairs], qs, scores.tolist()) if s >= thr]
    assert 0 < len(kept) < len(pairs)


def ft_args(model, beir, out, **kw):
    args = {"--model_name_or_path": model, "--beir_dir": beir, "--output_dir": out,
            "--per_device_train_batch_size": 4, "--report_to": "none", "--logging_steps": 1, "--seed": 3,
            "--negatives_rank_min": 2, "--negatives_rank_max": 20, "--learning_rate": 2e-3, "--warmup_ratio": 0.0,
            "--lr_scheduler_type": "constant"}
    args.update(kw)
    return cli_args(args)


@pytest.mark.parametrize("alpha,schedule", [pytest.param(None, None, marks=pytest.mark.slow), (0.1, "constant"),
                                            pytest.param(0.5, "linear", marks=pytest.mark.slow)])
def test_finetune_stage_runs_and_its_loss_falls(tiny_bert, beir, tmp_path, capsys, alpha, schedule):
    """4 queries per step, one mined negative each; 17 pairs -> 4 steps per epoch; the loss averaged over the first
    epoch is above the last epoch's. The start-up line counts the false negatives the losses mask in epoch 0; the
    next ones name PAIR's stage and the in-batch negatives with the mask the losses have; the card's title the stage.
    alpha None: no --pair_alpha, labelled queries -> PAIR's stage 2, alpha 0."""
    out = tmp_path / "ft"
    res = run(ft_args(tiny_bert, beir, out, **{"--pair_alpha": alpha, "--pair_alpha_schedule": schedule,
                                               "--num_train_epochs": 4}))
    lines = capsys.readouterr().out.splitlines()
    printed = next(line for line in lines if line.startswith("false negatives"))
    stage = next(line for line in lines if line.startswith("PAIR stage"))
    shape = lines[lines.index(stage) + 1]
    if alpha is None:
        alpha, schedule = 0.0, "constant"
        assert stage == ("PAIR stage 2 (labelled queries): L = L_Q (alpha 0: the passage-centric L_P off, as PAIR's "
                         "second stage; logged: L_P with exp(f(p+, q)) (--pair_p_form query, the default: PAIR's "
                         "code))")
    else:  # explicit: kept, and said to differ from PAIR's stage 2
        assert stage.startswith(f"PAIR stage 2 (labelled queries): L = (1 - alpha) L_Q + alpha L_P, alpha {alpha:g} ")
        assert stage.endswith("which PAIR's second stage leaves off (alpha 0)"
                              "; L_P with exp(f(p+, q)) (--pair_p_form query, the default: PAIR's code)")
    # the run's shape: L_Q's negatives are the step's 4 x (1 + 1) passages but the row's own positive; no
    # same-document mask (train.py's), the false-negative mask instead
    assert "in-batch negatives per query = 7 for L_Q" in shape and "same-document" not in shape, shape
    assert ("4 for L_P" in shape) == (alpha > 0) and "labelled relevant to its query" in shape
    # recount from the rows as build_finetune_rows makes them (BEIR order, the mined pools) and the sampler
    from plumbing.batches import NoDuplicatesBatchSampler

    corpus, queries, qrels = read_beir(str(beir), "train")
    pools = json.loads((out / "mined_negatives.json").read_text())
    rows = [{"query": queries[q], "positive": corpus[d]} for q in sorted(qrels) for d in sorted(qrels[q])]
    rows = finetune.add_relevant([{**r, "negative_pool": [corpus[d] for d in p]} for r, p in zip(rows, pools)])
    assert rows[0]["relevant"] == [corpus["d0"], corpus["d5"]]  # q0's two positives
    keys = [r["query"] for r in rows]
    batches = NoDuplicatesBatchSampler([len(r["query"]) + len(r["positive"]) for r in rows], 4, 3, keys=keys).batches()
    c = finetune.count_false_negatives(rows, batches, 1, 3)
    assert f"{c['masked']} of {c['candidates']} in-batch candidates" in printed, (printed, c)
    assert f"{c['rows_with_masked']} of {c['rows']} rows" in printed, (printed, c)
    assert res["completed_steps"] == 16
    log = read_log(out)
    first = sum(log[s]["loss"] for s in range(1, 5)) / 4
    last = sum(log[s]["loss"] for s in range(13, 17)) / 4
    assert last < first, (first, last)
    assert "pair_q_loss" in log[1]
    want = [finetune.pair_alpha_at(s - 1, 16, alpha, schedule) for s in (1, 8, 16)]
    assert [log[s]["pair_alpha"] for s in (1, 8, 16)] == pytest.approx(want)
    if alpha > 0:
        assert "pair_p_loss" in log[1]
    # mined negatives were written and exclude each pair's positives
    pools = json.loads((out / "mined_negatives.json").read_text())
    assert len(pools) == 17 and all(len(p) >= 1 for p in pools)
    assert (out / "model" / "model.safetensors").exists()
    card = (out / "model" / "README.md").read_text()
    assert f"xprt finetune (PAIR loss, {stage.removeprefix('PAIR ')}), trained from" in card


@pytest.mark.slow
def test_finetune_with_pseudo_queries_end_to_end(tiny_bert, beir, tmp_path, capsys):
    """PAIR's stage 1 with its defaults: alpha decays from 0.1 (alpha_0) to 0, said at the start."""
    gen_path, ce_path = tiny_seq2seq_and_cross_encoder(tmp_path)
    out = tmp_path / "ft"
    res = run(ft_args(tiny_bert, beir, out, **{"--generate_pseudo_queries": True, "--generator_model": gen_path,
                                               "--cross_encoder_model": ce_path, "--max_pseudo_passages": 20,
                                               "--denoise_threshold": 0.0, "--pseudo_query_max_length": 8,
                                               "--max_train_steps": 3, "--no_save_model": True}))
    assert res["completed_steps"] == 3
    assert len(json.loads((out / "mined_negatives.json").read_text())) == 17 + 20  # threshold 0 keeps every pseudo pair
    printed = capsys.readouterr().out
    assert ("PAIR stage 1 (pseudo-queries, with the labelled pairs): L = (1 - alpha) L_Q + alpha L_P, alpha 0.1 -> 0 "
            "(linear): the passage-centric L_P on, decaying as in PAIR's first stage") in printed
    assert "stage 1's rows: 20 pseudo-query pairs + 17 labelled pairs of qrels/train.tsv, trained together" in printed
    log = read_log(out)
    assert [log[s]["pair_alpha"] for s in (1, 2, 3)] == pytest.approx([0.1, 0.1 * 2 / 3, 0.1 / 3])
    # issue 65: the PAIR summary's stage 1, the pseudo-queries alone (its L_P form too)
    only = tmp_path / "ft_only"
    run(ft_args(tiny_bert, beir, only, **{"--generate_pseudo_queries": True, "--generator_model": gen_path,
                                          "--cross_encoder_model": ce_path, "--max_pseudo_passages": 20,
                                          "--denoise_threshold": 0.0, "--pseudo_query_max_length": 8,
                                          "--max_train_steps": 2, "--no_save_model": True,
                                          "--pseudo_queries_only": True, "--pair_p_form": "summary"}))
    assert len(json.loads((only / "mined_negatives.json").read_text())) == 20
    printed = capsys.readouterr().out
    assert "stage 1's rows: 20 pseudo-query pairs alone (--pseudo_queries_only)" in printed
    assert "PAIR stage 1 (pseudo-queries only)" in printed and "exp(-f(p+, p+))" in printed


def test_finetune_trains_the_encoder_and_leaves_the_idle_heads_untouched(tiny_bert, beir, tmp_path):
    """PAIR's losses never reach the decoder or the MLM head's transform / bias: fine-tuning freezes them (out of the
    optimiser, no DDP unused-parameter search) and saves them bit-identical, so the fine-tuned folder can go back into
    pre-training with its heads. The encoder (tied projection = word embeddings included) does move."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from modeling_xprt import XPRTModel

    start = tmp_path / "start"
    save_xprt_folder(load_xprt_folder(XPRTModel, str(tiny_bert)), str(start), AutoTokenizer.from_pretrained(tiny_bert))
    out = tmp_path / "ft"
    res = run(ft_args(start, beir, out, **{"--max_train_steps": 2}))
    h0, h1 = load_file(str(start / "xprt_heads.safetensors")), load_file(str(out / "model" / "xprt_heads.safetensors"))
    assert set(h0) == set(h1) and any(k.startswith("decoder.") for k in h0) and any(k.startswith("mlm_head.")
                                                                                    for k in h0)
    for k in h0:
        assert torch.equal(h0[k], h1[k]), k
    e0, e1 = load_file(str(start / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    # the encoder's, nothing else (the saved pooler is the start's, kept for AutoModel and never trained)
    assert res["trainable_parameters"] == sum(v.numel() for k, v in e0.items() if not k.startswith("pooler."))
    assert all(torch.equal(e0[k], e1[k]) for k in e0 if k.startswith("pooler."))
    emb = next(k for k in e0 if k.endswith("word_embeddings.weight"))
    assert not torch.equal(e0[emb], e1[emb])
    assert sum(not torch.equal(e0[k], e1[k]) for k in e0) > len(e0) // 2


@pytest.mark.slow
def test_finetune_under_deepspeed_zero3_one_cpu_process(tiny_bert, beir, tmp_path):
    """Under ZeRO-3 the start model mines its negatives before prepare, so it must be loaded whole (not partitioned);
    the mined pools and the losses then equal the plain loop's."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out, plain = tmp_path / "ds", tmp_path / "plain"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "configs" / "accelerate_cpu_deepspeed_zero3.yaml"), str(root / "finetune.py")]
    proc = subprocess.run(cmd + ft_args(tiny_bert, beir, out, **{"--max_train_steps": 3}), cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "DistributedType.DEEPSPEED x 1" in proc.stdout + proc.stderr
    run(ft_args(tiny_bert, beir, plain, **{"--max_train_steps": 3, "--no_save_model": True}))
    assert (json.loads((out / "mined_negatives.json").read_text())
            == json.loads((plain / "mined_negatives.json").read_text()))
    a, b = read_log(out), read_log(plain)
    for s in (1, 2, 3):
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-4), s
    assert (out / "model" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------
# false negatives: no repeated query in a batch, every relevant passage masked
# ---------------------------------------------------------------------------------------------------------------
def test_sampler_never_repeats_a_query_in_a_batch_and_stays_length_grouped():
    """604 rows of 250 queries with 1-5 positives each, drawn from 300 passages (length = query + positive, as
    finetune.py measures it). keys: no batch holds a query twice; full batches, len(sampler) of them; a function of
    (seed, epoch); padding within a point of the keyless sampler's."""
    from plumbing.batches import NoDuplicatesBatchSampler

    rng = random.Random(0)
    passages = [rng.randint(100, 1500) for _ in range(300)]
    keys, lengths = [], []
    for q in range(250):
        query_length = rng.randint(20, 120)
        for p in rng.sample(range(300), rng.choice([1, 1, 2, 3, 5])):
            keys.append(f"q{q}")
            lengths.append(query_length + passages[p])
    n = len(keys)
    s = NoDuplicatesBatchSampler(lengths, 16, seed=5, keys=keys)
    b0 = s.batches()
    from plumbing.batches import LengthGroupedBatchSampler

    plain = LengthGroupedBatchSampler(lengths, 16, seed=5).batches()
    assert sum(len({keys[i] for i in b}) < len(b) for b in plain) > len(plain) // 2  # the problem is real
    assert len(b0) == len(s) == n // 16 and all(len(b) == 16 for b in b0)
    assert all(len({keys[i] for i in b}) == 16 for b in b0)
    flat = [i for b in b0 for i in b]
    assert len(set(flat)) == len(flat)
    assert b0 == NoDuplicatesBatchSampler(lengths, 16, seed=5, keys=keys).batches()
    s.set_epoch(1)
    b1 = s.batches()
    assert b1 != b0 and all(len({keys[i] for i in b}) == 16 for b in b1)

    def eff(batches):  # real / processed, each batch padded to its longest member
        return sum(lengths[i] for b in batches for i in b) / sum(max(lengths[i] for i in b) * len(b) for b in batches)

    shuffled = NoDuplicatesBatchSampler(lengths, 16, seed=5, group_by_length=False, keys=keys).batches()
    assert eff(b0) > 0.95 and eff(b0) > eff(plain) - 0.01 and eff(shuffled) < 0.75, (eff(b0), eff(plain), eff(shuffled))
    # distinct keys: nothing waits, the batches are the keyless sampler's
    assert NoDuplicatesBatchSampler(lengths, 16, 5, keys=range(n)).batches() == plain


def test_sampler_fills_the_last_batches_by_swapping_and_refuses_the_impossible():
    """One query has as many rows as there are batches, all shorter than every other row: length sorting puts them at
    the end, where only they are left; swaps with earlier batches still give every batch exactly one of them."""
    from plumbing.batches import NoDuplicatesBatchSampler

    lengths = [1000 - i for i in range(30)] + [10 - i for i in range(10)]
    keys = [f"u{i}" for i in range(30)] + ["heavy"] * 10
    batches = NoDuplicatesBatchSampler(lengths, 4, seed=1, keys=keys).batches()
    assert len(batches) == 10 and all(len(b) == 4 for b in batches)
    assert [sum(keys[i] == "heavy" for i in b) for b in batches] == [1] * 10
    assert len({i for b in batches for i in b}) == 40
    with pytest.raises(ValueError, match="without repeating a key"):
        NoDuplicatesBatchSampler(lengths, 4, seed=1, keys=keys[:29] + ["heavy"] * 11).batches()


def hand_rows():
    """qa has two positives, A and B; qb's positive is B too and its negative is A; qc is unrelated."""
    return finetune.add_relevant([{"query": "qa", "positive": "A", "negatives": ["X"]},
                                  {"query": "qa", "positive": "B", "negatives": ["Y"]},
                                  {"query": "qb", "positive": "B", "negatives": ["A"]},
                                  {"query": "qc", "positive": "C", "negatives": ["Z"]}])


def test_rows_carry_every_passage_labelled_relevant_to_their_query():
    rows = hand_rows()
    assert [r["relevant"] for r in rows] == [["A", "B"], ["A", "B"], ["B"], ["C"]]


def test_count_false_negatives_by_hand():
    """Batches [0, 2] and [1, 3], one negative each. One process: row 0 (qa: A, B) meets B (row 2's positive) and A
    (row 2's negative, a copy of its own positive): 2 masked, 1 a copy; rows 1-3 meet nothing of theirs. Two
    processes (one step, candidates A X B A B Y C Z): row 0 masks B, A, B (one copy of A); row 2 (qb: B) masks
    row 1's B (a copy); row 1 (qa, label B at column 4) masks A, B, A (B at column 2 a copy); row 3 nothing."""
    rows = hand_rows()
    one = finetune.count_false_negatives(rows, [[0, 2], [1, 3]], num_negatives=1, seed=0)
    assert one == {"steps": 2, "rows": 4, "candidates": 4 * 3, "masked": 2, "masked_own_positive": 1,
                   "rows_with_masked": 1}
    two = finetune.count_false_negatives(rows, [[0, 2], [1, 3]], num_negatives=1, seed=0, world=2)
    assert two == {"steps": 1, "rows": 4, "candidates": 4 * 7, "masked": 7, "masked_own_positive": 3,
                   "rows_with_masked": 3}
    # no hard negatives: only the positive slots count
    assert finetune.count_false_negatives(rows, [[0, 2], [1, 3]], 0, 0)["masked"] == 1


def test_pair_alpha_schedule_values():
    assert [finetune.pair_alpha_at(t, 10, 0.1, "constant") for t in (0, 5, 9)] == [0.1, 0.1, 0.1]
    lin = [finetune.pair_alpha_at(t, 10, 0.5, "linear") for t in range(11)]
    assert lin[0] == 0.5 and lin[5] == pytest.approx(0.25) and lin[10] == 0.0
    assert all(a > b for a, b in zip(lin, lin[1:]))


def test_pair_alpha_defaults_to_its_stage_and_an_explicit_alpha_wins():
    """No --pair_alpha: labelled queries -> PAIR's stage 2 (alpha 0, constant); --generate_pseudo_queries -> PAIR's
    stage 1 (alpha_0 = 0.1, linear decay). A given --pair_alpha (and schedule) is kept as given, constant unless
    a schedule is given: the alpha(t) such a run always had."""
    base = ["--output_dir", "x", "--beir_dir", "b"]
    pseudo = base + ["--generate_pseudo_queries", "--generator_model", "g", "--cross_encoder_model", "c"]

    def alpha(argv):
        a = finetune.parse_args(argv)
        return a.pair_alpha, a.pair_alpha_schedule

    assert alpha(base) == (0.0, "constant")
    assert alpha(base + ["--train_data", "t.jsonl"]) == (0.0, "constant")
    assert alpha(pseudo) == (finetune.PAIR_ALPHA_0, "linear") == (0.1, "linear")
    assert alpha(base + ["--pair_alpha", "0.1"]) == (0.1, "constant")
    assert alpha(base + ["--pair_alpha", "0.5", "--pair_alpha_schedule", "linear"]) == (0.5, "linear")
    assert alpha(pseudo + ["--pair_alpha", "0"]) == (0.0, "constant")
    assert alpha(pseudo + ["--pair_alpha", "0.3"]) == (0.3, "constant")
    assert alpha(pseudo + ["--pair_alpha_schedule", "constant"]) == (0.1, "constant")  # the official code's
    assert alpha(base + ["--pair_alpha_schedule", "linear"]) == (0.0, "linear")  # 0 every step
    assert finetune.pair_alpha_default(None, None, False) == (0.0, "constant")
    assert finetune.pair_alpha_default(0.2, None, True) == (0.2, "constant")
    # L_P needs hard negatives: the stage-1 default or a given alpha > 0 without any is refused, naming the way out
    with pytest.raises(UserError, match=r"--pair_alpha 0.1 \(the stage-1 default\).*--num_negatives >= 1"):
        finetune.parse_args(pseudo + ["--num_negatives", "0"])
    with pytest.raises(UserError, match=r"--pair_alpha 0.2: L_P needs"):
        finetune.parse_args(base + ["--pair_alpha", "0.2", "--num_negatives", "0"])
    assert alpha(base + ["--num_negatives", "0"]) == (0.0, "constant")
    with pytest.raises(UserError, match=r"\[0, 1\]"):
        finetune.parse_args(base + ["--pair_alpha", "1.5"])


def test_pair_stage_says_the_stage_and_what_alpha_means():
    from types import SimpleNamespace

    def said(argv):
        return finetune.pair_stage(finetune.parse_args(["--output_dir", "x", "--beir_dir", "b", *argv]))

    pseudo = ["--generate_pseudo_queries", "--generator_model", "g", "--cross_encoder_model", "c"]
    query = "L_P with exp(f(p+, q)) (--pair_p_form query, the default: PAIR's code)"
    assert said([]) == ("stage 2 (labelled queries): L = L_Q (alpha 0: the passage-centric L_P off, as PAIR's second "
                        f"stage; logged: {query})")
    assert said(pseudo) == ("stage 1 (pseudo-queries, with the labelled pairs): L = (1 - alpha) L_Q + alpha L_P, "
                            "alpha 0.1 -> 0 (linear): the passage-centric L_P on, decaying as in PAIR's first stage; "
                            + query)
    assert said(["--pair_alpha", "0.1"]) == ("stage 2 (labelled queries): L = (1 - alpha) L_Q + alpha L_P, alpha 0.1 "
                                             "(constant): the passage-centric L_P on, which PAIR's second stage leaves "
                                             f"off (alpha 0); {query}")
    assert said([*pseudo, "--pair_alpha_schedule", "constant"]).endswith(
        f"alpha 0.1 (constant): the passage-centric L_P on, constant as in PAIR's official code; {query}")
    assert said([*pseudo, "--pair_alpha", "0"]) == (
        "stage 1 (pseudo-queries, with the labelled pairs): L = L_Q (alpha 0: the passage-centric L_P off, unlike "
        f"PAIR's first stage, whose alpha starts at alpha_0 > 0; logged: {query})")
    # issue 65: the summary's form and its stage 1 on pseudo-queries alone, said; the latter refused without stage 1
    assert said([*pseudo, "--pseudo_queries_only", "--pair_p_form", "summary"]) == (
        "stage 1 (pseudo-queries only): L = (1 - alpha) L_Q + alpha L_P, alpha 0.1 -> 0 (linear): the passage-centric "
        "L_P on, decaying as in PAIR's first stage; L_P with exp(-f(p+, p+)) (--pair_p_form summary: papers/pair.md's)")
    for bad in (["--pseudo_queries_only"], [*pseudo, "--pseudo_queries_only", "--train_data", "t.jsonl"]):
        with pytest.raises(UserError, match="--pseudo_queries_only"):
            finetune.parse_args(["--output_dir", "x", "--beir_dir", "b", *bad])
    # the run's shape: 2 processes x 4 rows x (1 positive + 3 negatives); the mask the losses have, no other
    args = finetune.parse_args(["--output_dir", "x", "--beir_dir", "b", "--per_device_train_batch_size", "4",
                                "--num_negatives", "3", "--pair_alpha", "0.1"])
    acc = SimpleNamespace(num_processes=2, distributed_type="MULTI_CPU", mixed_precision="no")
    line = finetune.run_line(acc, args, "16 (query, positive) rows of 12 queries", 10)
    assert line.startswith("MULTI_CPU x 2, mixed precision no; 16 (query, positive) rows of 12 queries, 10 steps")
    assert "in-batch negatives per query = 31 for L_Q" in line and "24 for L_P" in line
    assert "same-document" not in line and "copy of the row's positive" in line
    args.pair_alpha = 0.0
    assert "for L_P" not in finetune.run_line(acc, args, "rows", 10)


def test_flags_fail_early():
    with pytest.raises(UserError):
        finetune.parse_args(["--output_dir", "x"])  # no data
    ft = finetune.parse_args(["--output_dir", "x", "--beir_dir", "b"])
    assert ft.learning_rate == 3e-5 and ft.warmup_ratio == 0.1
    assert not hasattr(ft, "retention_weight")  # PAIR's loss has no retention term: not even a flag
    assert (ft.query_max_length, ft.passage_max_length) == (32, 128)


# ---------------------------------------------------------------------------------------------------------------
# mining at scale: chunks, processes, a step of its own; triples read lazily
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_beir(tmp_path_factory):
    return make_beir(tmp_path_factory.mktemp("big_beir"), num_docs=100, num_queries=30)


def test_mining_in_small_chunks_gives_the_pools_of_one_chunk(big_beir, tiny_bert):
    """Chunks of 1 and 3 encoding batches give the pools of one chunk, which equal an independent ranking of the
    whole score matrix by (score, corpus index), both descending: equal scores (the copy dup-1 of d1) rank the
    higher corpus index first whatever the chunking. Scores are float64 products rounded to float32, as in mining
    (a float32 product's last bit depends on the matrix shapes)."""
    from transformers import AutoModel, AutoTokenizer

    from plumbing.embed import embed_texts

    corpus, queries, qrels = read_beir(str(big_beir), "train")
    model, tok = AutoModel.from_pretrained(tiny_bert), AutoTokenizer.from_pretrained(tiny_bert)
    qids, cids = sorted(qrels), sorted(corpus)
    args = (model, tok, [queries[q] for q in qids], [set(qrels[q]) for q in qids], cids, [corpus[c] for c in cids])
    kw = {"batch_size": 8, "passage_max_length": 48}  # passages cut at 48 tokens: quicker, lengths still vary
    q, c = embed_texts(model, tok, args[2], 8, 32).double(), embed_texts(model, tok, args[5], 8, 48).double()
    scores = (q @ c.T).float().tolist()

    def independent(rank_min, rank_max):
        out = []
        for i, x in enumerate(qids):
            ranked = sorted(range(len(cids)), key=lambda j: (scores[i][j], j), reverse=True)[rank_min - 1:rank_max]
            skip = set(qrels[x]) | ({"dup-1"} if x == "q1" else set())
            out.append([cids[j] for j in ranked if cids[j] not in skip])
        return out

    one = finetune.mine_hard_negatives(*args, 1, len(cids), chunk_size=10_000, **kw)
    assert one == independent(1, len(cids))
    for chunk in (8, 24):  # 13 chunks of 1 batch; 5 of 3
        assert finetune.mine_hard_negatives(*args, 1, len(cids), chunk_size=chunk, **kw) == one
    # a window deeper in the ranking, from chunks of 2 batches (18 is rounded down to whole batches)
    assert finetune.mine_hard_negatives(*args, 5, 40, chunk_size=18, **kw) == independent(5, 40)
    both = [p for p in one if "d1" in p]
    assert len(both) == len(qids) - 1 and all(p.index("dup-1") == p.index("d1") - 1 for p in both)


def test_ranking_keys_order_by_score_then_index():
    scores = torch.tensor([[0.5, -0.25, 0.5, 0.0, -0.0, -1.0, 1e-30, -1e-30]])
    keys = finetune._ranking_keys(scores, torch.arange(8))
    order = keys.topk(8).indices[0].tolist()
    assert order == [2, 0, 6, 4, 3, 7, 1, 5]  # equal scores (0.5; 0.0 and -0.0): higher index first
    assert ((keys & (2 ** 32 - 1)) == torch.arange(8)).all()


def test_two_process_mining_equals_one_process(beir, tiny_bert, tmp_path):
    """`finetune.py --mine_only` under torchrun with 2 CPU processes (gloo), each encoding its share of the corpus
    in chunks of 2 batches, writes the pools of a 1-process run that scores the corpus in one chunk; no model, no
    training log."""
    import subprocess
    import sys

    def args(out, **kw):
        return ft_args(tiny_bert, beir, out, **{"--mine_only": True, "--mining_batch_size": 4, **kw})

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "finetune.py")]
    proc = subprocess.run(cmd + args(tmp_path / "two", **{"--mining_chunk_size": 8}), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = run(args(tmp_path / "one", **{"--mining_chunk_size": 100_000}))
    assert res["completed_steps"] == 0 and not (tmp_path / "one" / "train_log.jsonl").exists()
    one = json.loads((tmp_path / "one" / "mined_negatives.json").read_text())
    two = json.loads((tmp_path / "two" / "mined_negatives.json").read_text())
    assert len(one) == 17 and all(len(p) >= 15 for p in one)  # ranks 2-20 minus at most the positives and a copy
    assert two == one
    assert not (tmp_path / "two" / "model").exists()


def test_mine_only_then_a_run_that_reuses_the_pools(tiny_bert, beir, tmp_path):
    """Mining as its own step: --mine_only writes mined_negatives.json; a training run in the same folder reads it
    with --mined_negatives (even with --overwrite, which clears the rest) and gets the losses of a run that mines."""
    out, ref = tmp_path / "ft", tmp_path / "ref"
    run(ft_args(tiny_bert, beir, out, **{"--mine_only": True}))
    pools = (out / "mined_negatives.json").read_text()
    res = run(ft_args(tiny_bert, beir, out, **{"--mined_negatives": out / "mined_negatives.json", "--overwrite": True,
                                               "--max_train_steps": 2, "--no_save_model": True}))
    run(ft_args(tiny_bert, beir, ref, **{"--max_train_steps": 2, "--no_save_model": True}))
    assert res["completed_steps"] == 2 and (out / "mined_negatives.json").read_text() == pools
    assert json.loads(pools) == json.loads((ref / "mined_negatives.json").read_text())
    a, b = read_log(out), read_log(ref)
    assert [a[s]["loss"] for s in (1, 2)] == [b[s]["loss"] for s in (1, 2)]
    with pytest.raises(UserError):
        finetune.parse_args(["--output_dir", "x", "--triples_file", "t.tsv", "--mine_only"])  # nothing to mine


def test_triples_are_read_one_line_at_a_time_and_bad_lines_are_named(tmp_path):
    tsv = tmp_path / "t.tsv"
    tsv.write_text("what is a cat\ta small animal\ta car\ta tree\n\nhow tall\tvery tall\nbroken line\n")
    rows = finetune.load_triples(str(tsv))
    assert next(rows) == {"query": "what is a cat", "positive": "a small animal", "negatives": ["a car", "a tree"]}
    assert next(rows) == {"query": "how tall", "positive": "very tall", "negatives": []}  # the blank line skipped
    with pytest.raises(ValueError, match=r"t\.tsv:4: empty or missing positive"):
        next(rows)  # read lazily: the bad line 4 only stops the reader when it gets there
    jl = tmp_path / "t.jsonl"
    jl.write_text("\ufeff" + json.dumps({"query": "q", "positive": "p", "negative": "n"}) + "\n"
                  + json.dumps({"query": "q2", "positive": "p2", "negatives": ["a", "b"]}) + "\n{oops\n")
    rows = finetune.load_triples(str(jl))
    assert [next(rows), next(rows)] == [{"query": "q", "positive": "p", "negatives": ["n"]},
                                        {"query": "q2", "positive": "p2", "negatives": ["a", "b"]}]
    with pytest.raises(ValueError, match=r"t\.jsonl:3: not valid JSON"):
        next(rows)
    (tmp_path / "e.tsv").write_text("\n")
    with pytest.raises(ValueError, match="no \\(query, positive\\) rows"):
        list(finetune.load_triples(str(tmp_path / "e.tsv")))
