"""Tests for evaluate.py: known nDCG@10 on a fake BEIR folder, the overlap analysis on hand-made data,
the multi-model table, the local formats, the cache, bad input, and the wrapper on a tiny BERT."""

import json
import math
import os
from pathlib import Path

import mteb
import numpy as np
import pytest
import torch
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction

import evaluate as ev
from plumbing import leaderboard as lb
from plumbing.common import E5_PROMPTS, NO_PROMPTS, UserError, model_prompts, resolve_model_path
from plumbing.readers import load_beir
from plumbing.model_folder import load_xprt_folder, save_xprt_folder

# ---------------------------------------------------------------- fake data and a controllable model

DOCS = {"d1": "alpha apple", "d2": "beta banana", "d3": "gamma cherry", "d4": "delta date"}
QUERIES = {"q1": "find apple", "q2": "find banana"}
QRELS = {"q1": "d1", "q2": "d2"}


def write_beir(folder: Path, docs=DOCS, queries=QUERIES, qrels=QRELS, extra_qrels=()) -> Path:
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for i, t in docs.items():
            f.write(json.dumps({"_id": i, "title": "", "text": t}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for i, t in queries.items():
            f.write(json.dumps({"_id": i, "text": t}) + "\n")
        f.write(json.dumps({"_id": "q_train", "text": "not judged in test"}) + "\n")  # like shared scifact
    with open(folder / "qrels" / "test.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for q, d in list(qrels.items()) + list(extra_qrels):
            f.write(f"{q}\t{d}\t1\n")
    return folder


class FakeEncoder(AbsEncoder):
    """Embeds a text as the vector of the first key word it contains: we choose every cosine."""

    def __init__(self, vectors: dict, name="fake/model"):
        self.vectors = vectors
        self.calls = 0
        self.seen_prompt_types = []
        self.mteb_model_meta = ModelMeta(
            loader=None, name=name, revision="1", release_date=None, languages=None, n_parameters=None,
            memory_usage_mb=None, max_tokens=None, embed_dim=4, license=None, open_weights=True,
            public_training_code=None, public_training_data=None, framework=["PyTorch"],
            similarity_fn_name=ScoringFunction.COSINE, use_instructions=False, training_datasets=None)

    def fingerprint(self):
        return self.mteb_model_meta.name + json.dumps({k: list(v) for k, v in self.vectors.items()})

    def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kw):
        self.calls += 1
        self.seen_prompt_types.append(prompt_type)
        out = []
        for batch in inputs:
            for text in batch["text"]:
                key = next(k for k in self.vectors if k in text.split())
                out.append(self.vectors[key])
        return np.asarray(out, dtype=np.float32)


ONE_HOT = {k: np.eye(4)[i] for i, k in enumerate(["apple", "banana", "cherry", "date"])}
PERFECT = dict(ONE_HOT)  # "find apple" gets the apple document's vector: rank 1 for every query


class WrongEncoder(FakeEncoder):
    """Deliberately wrong: q1 ranks d3 > d1 > others (d1 2nd); q2 ranks d4 > d3 > d2 > d1 (d2 3rd)."""

    QV = {"apple": np.array([0.5, 0.0, 0.8, 0.0]), "banana": np.array([0.0, 0.3, 0.5, 0.8])}

    def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kw):
        if prompt_type is not None and prompt_type.value == "query":
            texts = [t for b in inputs for t in b["text"]]
            return np.asarray([self.QV[t.split()[1]] for t in texts], dtype=np.float32)
        return super().encode(inputs, task_metadata=task_metadata, hf_split=hf_split, hf_subset=hf_subset,
                              prompt_type=prompt_type)


def ndcg_at_rank(rank):  # one relevant document at `rank` (1-based), binary gain
    return 1.0 / math.log2(rank + 1)


@pytest.fixture()
def beir(tmp_path):
    return write_beir(tmp_path / "fake_beir")


def factory(kind):
    return lambda name: (FakeEncoder(PERFECT, "fake/perfect") if kind == "perfect"
                         else WrongEncoder(ONE_HOT, "fake/wrong"))


# ---------------------------------------------------------------- known nDCG@10


def test_perfect_and_wrong_ranking_give_known_ndcg(beir, tmp_path):
    out = ev.run_evaluation(["perfect"], local_tasks=[f"SciFact={beir}"], encoder_factory=factory("perfect"),
                            show_progress=False)
    r = out["results"]["perfect"]["SciFact"]
    assert r["metric"] == "ndcg_at_10"
    assert r["main_score"] == pytest.approx(100.0, abs=1e-6)
    assert set(r["per_query"]) == {"q1", "q2"}  # q_train (not in the test qrels) was left out

    out = ev.run_evaluation(["wrong"], local_tasks=[f"SciFact={beir}"], encoder_factory=factory("wrong"),
                            show_progress=False)
    r = out["results"]["wrong"]["SciFact"]
    expected = 100 * (ndcg_at_rank(2) + ndcg_at_rank(3)) / 2  # (0.6309 + 0.5) / 2 = 56.55
    assert r["main_score"] == pytest.approx(expected, abs=1e-3)
    assert r["per_query"]["q1"]["ndcg_at_10"] == pytest.approx(ndcg_at_rank(2), abs=1e-4)
    assert r["per_query"]["q2"]["ndcg_at_10"] == pytest.approx(ndcg_at_rank(3), abs=1e-4)


# ---------------------------------------------------------------- overlap analysis on hand-made data


def test_word_overlap_by_hand():
    assert ev.word_overlap("The cat sat", ["a cat sat down"]) == pytest.approx(2 / 3)
    assert ev.word_overlap("the cat", ["dog", "the CAT!"]) == pytest.approx(1.0)  # union of relevant docs
    assert ev.word_overlap("xyz", ["abc"]) == 0.0
    assert ev.word_overlap("", ["abc"]) == 0.0


def test_overlap_analysis_thirds_by_hand():
    # 6 queries, overlaps 0.1 .. 0.6; model A's nDCG rises with overlap, model B is 0.1 better everywhere
    ov = {f"q{i}": 0.1 * i for i in range(1, 7)}
    a = {q: {"ndcg_at_10": 0.1 * i, "overlap": ov[q]} for i, q in enumerate(ov, 1)}
    b = {q: {"ndcg_at_10": 0.1 * i + 0.1, "overlap": ov[q]} for i, q in enumerate(ov, 1)}
    out = {"models": ["A", "B"], "tasks": [{"name": "T", "type": "Retrieval", "source": "x"}],
           "results": {"A": {"T": {"per_query": a}}, "B": {"T": {"per_query": b}}}}
    res = ev.overlap_analysis(out, "T")
    assert [r["n_queries"] for r in res["thirds"]] == [2, 2, 2]
    assert [r["third"] for r in res["thirds"]] == ["low", "mid", "high"]
    assert res["thirds"][0]["overlap_range"] == pytest.approx([0.1, 0.2])
    assert [r["ndcg_at_10"]["A"] for r in res["thirds"]] == pytest.approx([15.0, 35.0, 55.0])
    assert [r["ndcg_at_10"]["B"] - r["ndcg_at_10"]["A"] for r in res["thirds"]] == pytest.approx([10.0] * 3)


def test_overlap_from_a_real_run(beir):
    # q1 "find apple" vs d1 "alpha apple": 1 of 2 words; q2 likewise
    out = ev.run_evaluation(["perfect"], local_tasks=[f"SciFact={beir}"], encoder_factory=factory("perfect"),
                            show_progress=False)
    assert out["results"]["perfect"]["SciFact"]["per_query"]["q1"]["overlap"] == pytest.approx(0.5)


# ---------------------------------------------------------------- the multi-model table


def write_semeval_sts(folder: Path) -> Path:
    folder.mkdir(parents=True)
    pairs = [("apple", "apple", "5.0"), ("apple", "banana", "1.0"), ("apple", "cherry", ""),  # unscored: skipped
             ("banana", "banana", "4.0"), ("cherry", "date", "0.5")]
    (folder / "STS.input.toy.txt").write_text("".join(f"{a}\t{b}\n" for a, b, _ in pairs))
    (folder / "STS.gs.toy.txt").write_text("".join(f"{g}\n" for _, _, g in pairs))
    return folder


def test_multi_model_table_markdown_json_png(beir, tmp_path):
    sts = write_semeval_sts(tmp_path / "sts12")
    encoders = {"perfect": FakeEncoder(PERFECT, "fake/perfect"), "wrong": WrongEncoder(ONE_HOT, "fake/wrong")}
    out = ev.run_evaluation(["perfect", "wrong"], local_tasks=[f"SciFact={beir}", str(sts)],
                            encoder_factory=lambda n: encoders[n], show_progress=False)
    assert [t["name"] for t in out["tasks"]] == ["SciFact", "STS12"]
    # STS with one-hot vectors: cosines 1, 0, 1, 0 vs gold 5, 1, 4, 0.5 -> Spearman 0.894 for both models
    sts_score = out["results"]["perfect"]["STS12"]["main_score"]
    assert sts_score == pytest.approx(100 * 0.894427, abs=1e-3)
    rep = ev.write_report(out, tmp_path / "report", overlap_tasks=["SciFact"])
    summ = rep["summary"]
    wrong_ndcg = 100 * (ndcg_at_rank(2) + ndcg_at_rank(3)) / 2
    assert summ["delta_per_task"]["wrong"]["SciFact"] == pytest.approx(wrong_ndcg - 100, abs=1e-3)
    assert summ["delta_per_task"]["wrong"]["STS12"] == pytest.approx(0.0, abs=1e-6)
    assert summ["per_category"]["wrong"]["Retrieval"] == pytest.approx(wrong_ndcg, abs=1e-3)
    assert summ["average"]["perfect"] == pytest.approx((100 + sts_score) / 2, abs=1e-6)
    assert summ["delta_average"]["wrong"] == pytest.approx((wrong_ndcg - 100) / 2, abs=1e-3)
    md = (tmp_path / "report" / "results.md").read_text()
    assert "| SciFact | Retrieval | ndcg_at_10 | 100.00 | 56.55 | -43.45 |" in md
    assert "Overlap analysis: SciFact" in md
    js = json.loads((tmp_path / "report" / "results.json").read_text())
    assert js["summary"]["per_task"]["wrong"]["SciFact"] == pytest.approx(wrong_ndcg, abs=1e-3)
    png = (tmp_path / "report" / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    with pytest.raises(UserError):  # outputs are not overwritten silently
        ev.write_report(out, tmp_path / "report")


def test_sample_and_local_runs_say_what_they_are(beir, tmp_path):
    """results.md and results.json of a --limit run say it is a sample (with the limit and seed), and of a local
    folder that the data is a local copy: a 20-query sample's 84.91 once sat beside the published 64.5 unmarked."""
    enc = FakeEncoder(PERFECT, "fake/perfect")
    out = ev.run_evaluation(["perfect"], local_tasks=[f"SciFact={beir}"], encoder_factory=lambda n: enc,
                            show_progress=False, limit=2)
    ev.write_report(out, tmp_path / "r")
    md = (tmp_path / "r" / "results.md").read_text()
    assert "**A sample, not the full tasks**: at most 2 queries" in md and "`--limit 2`, seed 0" in md
    assert "Local task folders (`--local_tasks`): SciFact" in md
    js = json.loads((tmp_path / "r" / "results.json").read_text())
    assert js["sample"] == {"limit": 2, "corpus_limit": None, "seed": 0}
    assert js["tasks"][0]["data"] == "local copy" and js["tasks"][0]["sample"] is True
    full = ev.run_evaluation(["perfect"], local_tasks=[f"SciFact={beir}"], encoder_factory=lambda n: enc,
                             show_progress=False)
    ev.write_report(full, tmp_path / "f")
    assert "A sample" not in (tmp_path / "f" / "results.md").read_text()
    assert json.loads((tmp_path / "f" / "results.json").read_text())["sample"] is None


# ---------------------------------------------------------------- cache, limit, classification


def test_results_folder_skips_finished_tasks(beir, tmp_path):
    enc = FakeEncoder(PERFECT, "fake/perfect")
    kw = dict(local_tasks=[f"SciFact={beir}"], encoder_factory=lambda n: enc, results_dir=str(tmp_path / "c"),
              show_progress=False)
    first = ev.run_evaluation(["perfect"], **kw)
    calls = enc.calls
    assert calls >= 2  # queries and corpus
    second = ev.run_evaluation(["perfect"], **kw)
    assert enc.calls == calls  # nothing encoded again: mteb found the result in its folder
    r1, r2 = first["results"]["perfect"]["SciFact"], second["results"]["perfect"]["SciFact"]
    assert r2["main_score"] == r1["main_score"] and r2["per_query"] == r1["per_query"]  # per-query scores kept
    # a local folder is an mteb experiment named by the data's content hash
    assert "/fake__perfect/1/experiments/data_" in r1["result_file"] and Path(r1["result_file"]).is_file()
    # the key follows the data's content, not its modification time: a copy keeps the result, an edit does not
    os.utime(beir / "queries.jsonl", (1, 1))
    ev.run_evaluation(["perfect"], **kw)
    assert enc.calls == calls
    ev.run_evaluation(["perfect"], limit=1, **kw)  # different settings -> a new run
    assert enc.calls > calls
    calls = enc.calls
    write_beir(beir, docs={**DOCS, "d1": "alpha apple pie"})  # one document edited
    ev.run_evaluation(["perfect"], **kw)
    assert enc.calls > calls
    calls = enc.calls
    ev.run_evaluation(["perfect"], rerun=True, **kw)
    assert enc.calls > calls


def test_folder_hashes_are_pinned(beir, tmp_path):
    """The data fingerprint (a local task's experiment folder name) and a model folder's revision are one hash
    (files_hash) whose values are pinned: a change would orphan every finished result in a results folder."""
    assert ev.data_fingerprint(beir) == "3aa76e567542" and ev.data_fingerprint(None) == "online"
    model = tmp_path / "runs" / "x" / "model"
    (model / "1_Pooling").mkdir(parents=True)
    (model / "config.json").write_text('{"a": 1}\n')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (model / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}\n')
    (model / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    (model / "xprt_heads.safetensors").write_bytes(b"heads")
    (model / "README.md").write_text("card")
    assert lb.content_revision(str(model)) == "dba4c287f369"
    (model / "xprt_heads.safetensors").write_bytes(b"other heads")  # the decoder heads and the card are no part
    (model / "README.md").write_text("a new card")  # of the sentence vector's identity
    assert lb.content_revision(str(model)) == "dba4c287f369"
    (model / "vocab.txt").write_text("[PAD]\n[CLS]\n")
    assert lb.content_revision(str(model)) != "dba4c287f369"


def test_limit_keeps_relevant_docs(tmp_path):
    docs = {f"d{i}": f"doc {i}" for i in range(100)}
    data = {"corpus": {d: ("", t) for d, t in docs.items()},
            "queries": {f"q{i}": f"query {i}" for i in range(20)},
            "qrels": {f"q{i}": {f"d{i}": 1, f"d{i + 20}": 1} for i in range(20)}}
    sub = ev.subsample_retrieval(data, limit=5, corpus_limit=30, seed=0)
    assert len(sub["queries"]) == 5 and len(sub["corpus"]) == 30
    for q, ds in sub["qrels"].items():
        assert q in sub["queries"] and all(d in sub["corpus"] for d in ds)
    assert sub == ev.subsample_retrieval(data, limit=5, corpus_limit=30, seed=0)  # seeded


def test_banking77_layout_classification(tmp_path):
    folder = tmp_path / "banking77"
    folder.mkdir()
    labels = ["card_arrival", "exchange_rate"]
    (folder / "categories.json").write_text(json.dumps(labels))
    rows = [("my card apple", "card_arrival"), ('"rate, banana"', "exchange_rate")]
    for split, n in (("train", 10), ("test", 4)):
        with open(folder / f"{split}.csv", "w") as f:
            f.write("text,category\n")
            for i in range(n):
                t, c = rows[i % 2]
                f.write(f"{t},{c}\n")
    data = ev.load_classification_folder(folder)
    assert data["test"]["label"] == [0, 1, 0, 1] and data["train"]["text"][1] == "rate, banana"
    out = ev.run_evaluation(["perfect"], local_tasks=[str(folder)], encoder_factory=factory("perfect"),
                            show_progress=False)
    r = out["results"]["perfect"]["Banking77Classification"]
    assert r["metric"] == "accuracy" and r["main_score"] == pytest.approx(100.0)


# ---------------------------------------------------------------- local formats and bad input


def test_sts_formats(tmp_path):
    d = tmp_path / "stsbenchmark"
    d.mkdir()
    # quotes inside sentences and a 9-column row: must be read with QUOTE_NONE
    (d / "sts-test.csv").write_text('g\tf\t2012\t1\t2.5\tHe said "hi.\tShe said hi.\n'
                                    "g\tf\t2012\t2\t4.0\tA b.\tC d.\tsrc1\tsrc2\n")
    name, rows = ev.load_sts_folder(d)
    assert name == "STSBenchmark" and rows == [('He said "hi.', "She said hi.", 2.5), ("A b.", "C d.", 4.0)]
    s = write_semeval_sts(tmp_path / "sts15")
    name, rows = ev.load_sts_folder(s)
    assert name == "STS15" and len(rows) == 4 and ("apple", "cherry", 0.0) not in rows
    sick = tmp_path / "sick"
    sick.mkdir()
    (sick / "SICK.txt").write_text("pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
                                   "1\tA man\tA guy\t4.5\tNEUTRAL\n")
    assert ev.load_sts_folder(sick) == ("SICK-R", [("A man", "A guy", 4.5)])
    assert ev.parse_local_spec(str(sick))[0] == "SICK-R"


def test_bad_input_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        ev.parse_local_spec(str(tmp_path / "missing"))
    (tmp_path / "weird").mkdir()
    with pytest.raises(ValueError, match="not a known task layout"):
        ev.parse_local_spec(str(tmp_path / "weird"))
    with pytest.raises(UserError, match="mteb's STS12 is a STS task, the folder a Retrieval one"):
        ev.parse_local_spec(f"STS12={write_beir(tmp_path / 'a_beir_folder')}")
    # qrels ids absent from the corpus: counted, warned, dropped
    b = write_beir(tmp_path / "b1", extra_qrels=[("q1", "ghost1"), ("q2", "ghost2")])
    with pytest.warns(UserWarning, match="2 qrels lines point to documents absent"):
        data = load_beir(b)
    assert data["qrels"] == {"q1": {"d1": 1}, "q2": {"d2": 1}}
    # an empty judged query is an error
    b = write_beir(tmp_path / "b2", queries={"q1": "find apple", "q2": "  "})
    with pytest.raises(ValueError, match="1 judged queries have an empty text"):
        load_beir(b)
    # a folder that is not a model
    with pytest.raises(ValueError, match="not a model"):
        ev.XPRTEncoder(str(tmp_path / "weird"))
    with pytest.raises(UserError, match="no such folder"):
        ev.XPRTEncoder(str(tmp_path / "no" / "such" / "model"))


# ---------------------------------------------------------------- the real wrapper on a tiny BERT


def test_prefix_auto_rule(tmp_path, tiny_bert):
    from transformers import AutoTokenizer

    from modeling_xprt import XPRTModel

    assert model_prompts("intfloat/e5-base-unsupervised") == E5_PROMPTS
    assert model_prompts("intfloat/multilingual-e5-small") == E5_PROMPTS
    assert model_prompts("all-MiniLM-L6-v2") == NO_PROMPTS
    assert model_prompts("bert-base-uncased") == NO_PROMPTS
    assert model_prompts("some/modele5x") == NO_PROMPTS  # "e5" inside a word does not count
    assert model_prompts("all-MiniLM-L6-v2", "e5") == E5_PROMPTS and model_prompts("x/e5", "none") == NO_PROMPTS
    # a folder saved by the real producer (model_folder.save_xprt_folder) from a start model named like E5 keeps E5's
    # prefixes under any folder name: they are written where sentence-transformers reads them
    e5_start = tmp_path / "e5-tiny"
    e5_start.symlink_to(tiny_bert, target_is_directory=True)
    model = load_xprt_folder(XPRTModel, str(e5_start))
    assert model.prompts == E5_PROMPTS and model.info.start_model == str(e5_start)
    run = tmp_path / "runs" / "xprt"
    save_xprt_folder(model, str(run), AutoTokenizer.from_pretrained(tiny_bert))
    assert model_prompts(str(run)) == E5_PROMPTS
    assert json.loads((run / "xprt_config.json").read_text())["start_model"] == str(e5_start)
    assert ev.XPRTEncoder(str(run)).passage_prefix == "passage: "
    plain = tmp_path / "runs" / "plain"
    save_xprt_folder(load_xprt_folder(XPRTModel, str(tiny_bert)), str(plain), AutoTokenizer.from_pretrained(tiny_bert))
    assert model_prompts(str(plain)) == NO_PROMPTS


def test_batched_embedder_matches_one_text_at_a_time(tiny_bert):
    """embed.embed_texts (token-sorted batches, dedup, the unmasked path for unpadded batches) equals
    encoding each text alone with the plain mean-pool formula."""
    from transformers import AutoModel, AutoTokenizer

    from modeling_xprt import mean_pool
    from plumbing.embed import embed_texts

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    model = AutoModel.from_pretrained(tiny_bert).eval()
    texts = ["a short one", "a somewhat longer text with more words in it", "x", "same len a", "same len b",
             "word " * 300, "x", "a short one"]  # repeated texts are encoded once, returned twice
    ours = embed_texts(model, tok, texts, batch_size=2, max_length=64, prefix="query: ").numpy()
    ref = []
    with torch.no_grad():
        for t in texts:
            enc = tok(["query: " + t], truncation=True, max_length=64, return_tensors="pt")
            v = mean_pool(model(**enc).last_hidden_state, enc["attention_mask"])
            ref.append(torch.nn.functional.normalize(v, dim=-1)[0].numpy())
    np.testing.assert_allclose(ours, np.stack(ref), atol=1e-5)
    assert ours.shape == (8, 32) and np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(ours[6], ours[2])
    assert embed_texts(model, tok, [], batch_size=2).shape == (0, 32)


def test_wrapper_end_to_end_on_tiny_bert(tiny_bert, beir, tmp_path):
    enc = ev.XPRTEncoder(str(tiny_bert), batch_size=4)
    assert enc.prefixes == "none" and enc.query_prefix == "" and enc.max_length == 512
    assert enc.mteb_model_meta.similarity_fn_name == ScoringFunction.COSINE
    e5 = ev.XPRTEncoder(str(tiny_bert), prefixes="e5", max_length=32)
    from mteb.types import PromptType
    sts, scifact = mteb.get_task("STSBenchmark").metadata, mteb.get_task("SciFact").metadata
    assert e5.prefix_for(scifact, PromptType.query) == "query: "
    assert e5.prefix_for(scifact, PromptType.document) == "passage: "
    assert e5.prefix_for(sts, None) == "query: "  # symmetric tasks: E5's card, through mteb's task-type keys
    assert enc.settings == {} and e5.settings == {"query_prefix": "query: ", "passage_prefix": "passage: ",
                                                   "max_length": 32}  # forced settings: an mteb experiment
    rep = ev.main(["--models", str(tiny_bert), "--local_tasks", f"SciFact={beir}", "--output_dir",
                   str(tmp_path / "out"), "--results_dir", str(tmp_path / "cache"), "--overlap_analysis"])
    score = rep["summary"]["per_task"][str(tiny_bert)]["SciFact"]
    assert 0.0 < score <= 100.0
    assert rep["overlap_analysis"][0]["task"] == "SciFact"
    with pytest.raises(UserError, match="overwrite"):
        ev.main(["--models", str(tiny_bert), "--local_tasks", f"SciFact={beir}", "--output_dir",
                 str(tmp_path / "out")])


@pytest.mark.slow
def test_minilm_on_bundled_stsb(minilm_path, tmp_path):
    """all-MiniLM-L6-v2 on 300 pairs of the bundled STS-B test set: Spearman near its published 82.03."""
    root = Path(__file__).resolve().parent.parent
    out = ev.run_evaluation(["all-MiniLM-L6-v2"], local_tasks=[str(root / "data/eval/stsbenchmark")], limit=300,
                            show_progress=False)
    assert 75.0 < out["results"]["all-MiniLM-L6-v2"]["STSBenchmark"]["main_score"] < 90.0


def test_online_task_path_with_limit(monkeypatch):
    """--tasks NAME goes through mteb's own loader; simulate the hub download and check --limit on it."""
    from datasets import Dataset
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData

    def fake_hub_load(self, num_proc=None, **kw):
        corpus = Dataset.from_dict({"id": list(DOCS), "title": [""] * 4, "text": list(DOCS.values())})
        queries = Dataset.from_dict({"id": list(QUERIES), "text": list(QUERIES.values())})
        self.dataset = {"default": {"test": RetrievalSplitData(
            corpus=corpus, queries=queries, relevant_docs={q: {d: 1} for q, d in QRELS.items()}, top_ranked=None)}}
        self.data_loaded = True

    monkeypatch.setattr(AbsTaskRetrieval, "load_data", fake_hub_load)
    monkeypatch.setattr(ev, "hub_offline", lambda: False)  # the simulated Hub is reachable
    out = ev.run_evaluation(["wrong"], tasks=["SciFact"], limit=1, corpus_limit=3, encoder_factory=factory("wrong"),
                            show_progress=False)
    r = out["results"]["wrong"]["SciFact"]
    assert out["tasks"][0]["source"] == "mteb (online)"
    assert len(r["per_query"]) == 1  # --limit 1 kept one query
    (q, s), = r["per_query"].items()
    # corpus cut to 3 documents, the relevant one kept: the wrong encoder ranks it 2nd (q1) or 2nd/3rd (q2)
    assert s["ndcg_at_10"] in (pytest.approx(ndcg_at_rank(2), abs=1e-4), pytest.approx(ndcg_at_rank(3), abs=1e-4))


def test_cli_defaults_to_mteb_eng_v2():
    import mteb

    assert ev.parse_args(["--models", "m"]).benchmark == "MTEB(eng, v2)"
    assert ev.parse_args(["--models", "m", "--local_tasks", "d"]).benchmark is None
    assert len(mteb.get_benchmark(ev.DEFAULT_BENCHMARK).tasks) == 41  # the paper's 41 tasks
    with pytest.raises(UserError):
        ev.parse_args(["--models", "m", "--limit", "0"])
    # the prefix flag is spelled as train.py / finetune.py spell it; the strings override it
    args = ev.parse_args(["--models", "m"])
    assert args.prefixes == "auto" and args.query_prefix is None and args.passage_prefix is None
    assert ev.parse_args(["--models", "m", "--prefixes", "e5"]).prefixes == "e5"
    with pytest.raises(UserError):
        ev.parse_args(["--models", "m", "--prefixes", "E5"])


def test_train_run_model_folders_get_distinct_column_labels():
    """Every train.py run saves to <run>/model; the tables must still tell the runs apart, also two runs whose folders
    end alike (issue 54 item 11: A/run/model and B/run/model got one column name)."""
    from evaluate import column_labels

    models = ["all-MiniLM-L6-v2", "runs/xprt/model", "runs/contrastive/model/", "a/b/my-model"]
    assert list(column_labels(models).values()) == ["all-MiniLM-L6-v2", "xprt/model", "contrastive/model", "my-model"]
    alike = column_labels(["A/run/model", "B/run/model", "C/other/model", "x/e5"])
    assert alike == {"A/run/model": "A/run/model", "B/run/model": "B/run/model", "C/other/model": "other/model",
                     "x/e5": "e5"}


# ---------------------------------------------------------------- mteb's results folder, run names, pooling, cards


def _xprt_run_folder(tiny_bert, run_dir: Path) -> Path:
    """A model folder written by the real producer (model_folder.save_xprt_folder, as train.py does) at <run>/model."""
    from transformers import AutoTokenizer

    from modeling_xprt import XPRTModel

    save_xprt_folder(load_xprt_folder(XPRTModel, str(tiny_bert)), str(run_dir / "model"),
                     AutoTokenizer.from_pretrained(tiny_bert),
                     model_card="---\nlibrary_name: sentence-transformers\n---\n\n# run\n")
    return run_dir / "model"


def test_mteb_loader_reads_evaluate_results_folder(tiny_bert, beir, tmp_path, capsys):
    """evaluate.py on a train.py-style folder and two local tasks: mteb's own loader (ResultCache.load_results) reads
    the results folder, its scores equal evaluate.py's table; the model is named after its run; its card gets them."""
    import mteb

    model = _xprt_run_folder(tiny_bert, tmp_path / "runs" / "myrun")
    sts = write_semeval_sts(tmp_path / "sts12")
    results_dir = tmp_path / "mteb_results"
    rep = ev.main(["--models", str(model), "--local_tasks", f"SciFact={beir}", str(sts), "--output_dir",
                   str(tmp_path / "out"), "--results_dir", str(results_dir), "--batch_size", "2"])
    printed = capsys.readouterr().out
    assert "| SciFact | Retrieval | ndcg_at_10 |" in printed  # the table is still printed
    assert "mteb name local/myrun" in printed and "pooling mean + normalize" in printed
    table = rep["summary"]["per_task"][str(model)]
    js = json.loads((tmp_path / "out" / "results.json").read_text())
    name, revision = js["model_meta"][str(model)]["name"], js["model_meta"][str(model)]["revision"]
    assert name == "local/myrun" and len(revision) == 12

    loaded = mteb.ResultCache(results_dir).load_results(models=[name], tasks=["SciFact", "STS12"],
                                                        load_experiments="match_name")
    # a local folder's data is an mteb experiment (named by its content hash): one ModelResult per task here
    assert {(m.model_name, m.model_revision) for m in loaded.model_results} == {(name, revision)}
    scores = {tr.task_name: 100 * tr.get_score() for m in loaded.model_results for tr in m.task_results}
    assert scores.keys() == {"SciFact", "STS12"}
    for task, score in scores.items():
        assert score == pytest.approx(table[task], abs=1e-9)
    assert 0.0 < table["SciFact"] <= 100.0
    # the card of the xprt folder holds the scores (model_folder.add_eval_results_to_card): local folders in
    # a section of
    # their own, saying what was scored, never in the model-index under MTEB's task names, and no local path
    from huggingface_hub import ModelCard

    card = (model / "README.md").read_text()
    assert "SciFact" in card and f"{table['SciFact']:.2f}" in card and f"{table['STS12']:.2f}" in card
    assert "## Scores on local data" in card and "## Evaluation" not in card
    assert ModelCard(card).data.eval_results is None
    assert f"| SciFact | local copy {beir.name} (data_" in card and "queries |" in card
    assert str(tmp_path) not in card
    # rewriting the card does not change the model's revision (the card is not part of its identity)
    assert lb.model_name_and_revision(str(model)) == (name, revision)


def test_model_names_and_revisions(tiny_bert, tmp_path):
    model = _xprt_run_folder(tiny_bert, tmp_path / "runs" / "xprt-e5")
    name, rev = lb.model_name_and_revision(str(model))
    assert name == "local/xprt-e5"
    cfg = json.loads((model / "xprt_config.json").read_text())
    (model / "xprt_config.json").write_text(json.dumps({**cfg, "hub_model_id": "me/xprt-e5-base"}))
    assert lb.model_name_and_revision(str(model)) == ("me/xprt-e5-base", rev)  # the hub id recorded in the folder
    (model / "README.md").write_text("a new card")
    assert lb.model_name_and_revision(str(model))[1] == rev
    from safetensors.torch import load_file, save_file
    weights = load_file(str(model / "model.safetensors"))
    k = next(iter(weights))
    weights[k] = weights[k] + 1
    save_file(weights, str(model / "model.safetensors"))
    assert lb.model_name_and_revision(str(model))[1] != rev  # new weights, new revision
    assert lb.model_name_and_revision(str(tiny_bert))[0] == "local/" + tiny_bert.name
    assert lb.model_name_and_revision("all-MiniLM-L6-v2")[0] == "sentence-transformers/all-MiniLM-L6-v2"


def test_cls_pooled_model_scored_with_its_own_pooling(tmp_path, beir):
    """A BGE-style folder (CLS pooling in modules.json) is encoded with CLS pooling: evaluate.py's vectors equal
    SentenceTransformer(folder).encode and differ from mean pooling."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    from plumbing.embed import embed_texts

    raw = tmp_path / "raw"
    tok = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(raw)
    tok.save_pretrained(raw)
    transformer = Transformer(str(raw), max_seq_length=64)
    folder = tmp_path / "bge-tiny"
    SentenceTransformer(modules=[transformer, Pooling(32, "cls"), Normalize()]).save(str(folder))

    enc = ev.XPRTEncoder(str(folder), batch_size=2)
    assert enc.pooling == "cls + normalize" and enc.max_length == 64
    texts = ["a short one", "a somewhat longer text with more words in it", "x", "apple banana cherry date"]
    from mteb.types import PromptType
    ours = enc.encode([{"text": texts}], task_metadata=None, hf_split="test", hf_subset="default",
                      prompt_type=PromptType.query)
    ref = SentenceTransformer(str(folder)).encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    mean = embed_texts(AutoModel_from(raw), tok, texts, batch_size=2, max_length=64).numpy()
    cos = (ours * mean).sum(axis=1)
    assert cos.max() < 0.99  # mean pooling would give other vectors
    out = ev.run_evaluation([str(folder)], local_tasks=[f"SciFact={beir}"], show_progress=False)
    assert 0.0 < out["results"][str(folder)]["SciFact"]["main_score"] <= 100.0


def AutoModel_from(path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path).eval()


def test_card_and_results_folders_are_checked_writable_before_scoring(tiny_bert, tmp_path, monkeypatch):
    """Before any scoring (146ed67 scored, then failed writing and wrote nothing): mteb's results folder, and the
    folder of an xprt model whose card gets the scores; a read-only one (simulated: root writes through file
    modes, so the probe is made to fail as a read-only mount makes it) stops the run in one line that names
    --no_card_update, which leaves the card alone."""
    from plumbing import common
    model = _xprt_run_folder(tiny_bert, tmp_path / "runs" / "xprt")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(common.UserError, match="--results_dir .*a_file/results: cannot write there"):
        ev.check_outputs_writable([str(model)], str(tmp_path / "a_file" / "results"))
    real = common.check_writable

    def read_only_model(out, flag="--output_dir"):
        if Path(out) == model:
            raise common.UserError(f"{flag} {out}: cannot write there (Read-only file system)")
        return real(out, flag)

    monkeypatch.setattr(ev, "check_writable", read_only_model)
    with pytest.raises(common.UserError, match=r"--models .*: cannot write there \(Read-only file system\): "
                                               r"evaluate.py writes the scores into its model card .*--no_card_update"):
        ev.check_outputs_writable([str(model), str(tiny_bert)], str(tmp_path / "results"))
    ev.check_outputs_writable([], str(tmp_path / "results"))  # --no_card_update: the results folder only
    assert ev.parse_args(["--models", str(model), "--no_card_update"]).no_card_update


def test_a_task_folder_with_an_equals_sign_is_read_whole(beir, tmp_path):
    """A task flag's value is read as its writer meant it (issue 54 item 11): an existing folder whose path holds "="
    is that folder, "NAME=DIR" names a folder whose path holds "=" too, and a bare "name" is no NAME=DIR."""
    import shutil

    from plumbing.common import task_spec

    odd = tmp_path / "runs" / "lr=1e-5" / "scifact"
    shutil.copytree(beir, odd)
    assert task_spec(str(odd)) == ("", str(odd))
    assert task_spec(f"SciFact={odd}") == ("SciFact", str(odd))
    assert task_spec("SciFact") == ("", "SciFact")
    name, folder, kind = ev.parse_local_spec(str(odd))
    assert folder == odd and kind == "retrieval"
    name, folder, _ = ev.parse_local_spec(f"SciFact={odd}")
    assert (name, folder) == ("SciFact", odd)


# ---------------------------------------------------------------- a user's own task folder (issue 54 item 11)


def test_a_users_own_folder_is_a_first_class_task(tiny_bert, tmp_path):
    """A BEIR folder under a name mteb does not know (given, or the folder's own) is the user's own task: an mteb
    AbsTaskRetrieval whose TaskMetadata is the folder's (no stock task's name, dataset id or revision borrowed), scored
    by mteb's retrieval evaluator and filed by mteb under its own name. The same folder under an mteb task's name is
    that stock task on the folder's data. On the bundled SciFact sample (real SciFact documents, queries and qrels)
    the three give one nDCG@10 (one evaluator, one --limit sample), and results.md says which of the two scored
    each."""
    import shutil

    from mteb.abstasks.retrieval import AbsTaskRetrieval

    scifact = Path(__file__).resolve().parent.parent / "data" / "eval" / "scifact"
    mine = tmp_path / "my_claims"
    shutil.copytree(scifact, mine)
    assert ev.parse_local_spec(f"MyClaims={scifact}") == ("MyClaims", scifact, "retrieval")
    assert ev.parse_local_spec(str(mine)) == ("my_claims", mine, "retrieval")  # 146ed67: "cannot tell which mteb task"
    own = ev.build_task("MyClaims", local=(scifact, "retrieval"))
    stock = ev.build_task("SciFact", local=(scifact, "retrieval"))
    assert isinstance(own, AbsTaskRetrieval) and type(own).__mro__[2] is AbsTaskRetrieval  # the mix-in, then mteb's
    assert (own.metadata.name, own.metadata.dataset, own.metadata.eval_splits, own.metadata.main_score) == (
        "MyClaims", {"path": str(scifact), "revision": "local"}, ["test"], "ndcg_at_10")
    assert stock.metadata == mteb.get_task("SciFact").metadata  # the stock task, its metadata untouched

    results = tmp_path / "results"
    out = ev.run_evaluation([str(tiny_bert)], local_tasks=[f"SciFact={scifact}", f"MyClaims={scifact}", str(mine)],
                            limit=10, corpus_limit=60, results_dir=str(results), show_progress=False, batch_size=16)
    scores = {t: r["main_score"] for t, r in out["results"][str(tiny_bert)].items()}
    assert 0.0 < scores["SciFact"] < 100.0
    assert scores["MyClaims"] == pytest.approx(scores["SciFact"], abs=1e-9)
    assert scores["my_claims"] == pytest.approx(scores["SciFact"], abs=1e-9)
    assert [t["scored_by"] for t in out["tasks"]] == ["stock", "own", "own"]
    name = out["model_meta"][str(tiny_bert)]["name"]
    loaded = mteb.ResultCache(results).load_results(models=[name], include_remote=False, load_experiments="match_name")
    assert {tr.task_name: 100 * tr.get_score() for m in loaded.model_results for tr in m.task_results} == \
        pytest.approx(scores)
    ev.write_report(out, tmp_path / "report")
    md = (tmp_path / "report" / "results.md").read_text()
    assert ("Local task folders (`--local_tasks`): SciFact: the stock mteb task SciFact on the folder `scifact`'s "
            "data; MyClaims: the user's own task, from folder `scifact`, scored by mteb's retrieval evaluator "
            "(ndcg_at_10); my_claims: the user's own task, from folder `my_claims`, scored by mteb's retrieval "
            "evaluator") in md
    data = ev.data_fingerprint(scifact)
    assert (f"| SciFact | the stock mteb task SciFact on the folder `scifact`'s data | local folder `scifact` "
            f"(data_{data}), in place of mteb/scifact @ d56462d0e63a | the only id | {mteb.__version__} |") in md
    assert f"| MyClaims | the user's own task, from folder `scifact`, scored by mteb's retrieval evaluator " \
           f"(ndcg_at_10) | local folder `scifact` (data_{data}) | not an mteb task | {mteb.__version__} |" in md


def test_own_sts_and_classification_folders_score_as_their_stock_tasks(tmp_path):
    """The family beyond retrieval: a SemEval STS folder and a Banking77-layout folder under names of their own are
    own tasks of mteb's STS and classification classes, scoring what the stock tasks score on the same files
    (Spearman 89.44 of the one-hot vectors against the gold scores; accuracy 100). Two folders called alike are
    refused, not filed under one name."""
    sts = write_semeval_sts(tmp_path / "sts12")
    pairs = write_semeval_sts(tmp_path / "my_pairs")
    intents = tmp_path / "my_intents"
    intents.mkdir()
    for split, n in (("train", 10), ("test", 4)):
        rows = "".join(("my card apple,card\n", "rate banana,rate\n")[i % 2] for i in range(n))
        (intents / f"{split}.csv").write_text("text,category\n" + rows)
    out = ev.run_evaluation(["perfect"], local_tasks=[str(sts), str(pairs), f"Banking77Classification={intents}",
                                                      str(intents)], encoder_factory=factory("perfect"),
                            show_progress=False)
    r = out["results"]["perfect"]
    assert r["STS12"]["main_score"] == pytest.approx(100 * 0.894427, abs=1e-3)
    assert r["my_pairs"]["main_score"] == pytest.approx(r["STS12"]["main_score"], abs=1e-9)
    assert r["my_pairs"]["metric"] == "cosine_spearman"
    assert r["my_intents"]["main_score"] == r["Banking77Classification"]["main_score"] == pytest.approx(100.0)
    assert [(t["name"], t["scored_by"]) for t in out["tasks"]] == [
        ("STS12", "stock"), ("my_pairs", "own"), ("Banking77Classification", "stock"), ("my_intents", "own")]
    twin = write_semeval_sts(tmp_path / "b" / "my_pairs")
    with pytest.raises(UserError, match="two tasks are called my_pairs: name the local ones apart"):
        ev.task_specs([str(pairs), str(twin)], [], None)
