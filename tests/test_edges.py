"""Inputs read as their producer meant them, or refused (issue 22): a model folder whose tokenizer does not fit its
embedding matrix; the logged time per step of a shorter last window."""

import shutil
from pathlib import Path

import pytest
from test_train import base_args, groups, run  # noqa: F401  (groups: a fixture)

import evaluate
import select_groups
import train
from plumbing import common, model_folder, run_log
from plumbing import readers


@pytest.fixture
def no_tokenizer(tiny_bert, tmp_path):
    """The tiny BERT folder without its tokenizer files: transformers 5.24 loads a 5-token fallback for it."""
    folder = tmp_path / "no_tok"
    shutil.copytree(tiny_bert, folder)
    for f in folder.iterdir():
        if "token" in f.name or f.name in ("vocab.txt", "special_tokens_map.json"):
            f.unlink()
    return folder


def test_every_script_refuses_a_tokenizer_that_does_not_fit_the_model(no_tokenizer, groups, tmp_path):
    match = r"tokenizer has 5 tokens and the model's embedding matrix 30,522 rows"
    with pytest.raises(ValueError, match=match):
        train.main(base_args(str(no_tokenizer), groups, tmp_path / "t", **{"--max_train_steps": 1}))
    with pytest.raises(ValueError, match=match):
        select_groups.main(["--input", str(Path(train.__file__).parent / "data" / "docs.jsonl"),
                            "--model_name_or_path", str(no_tokenizer), "--output_dir", str(tmp_path / "s"),
                            "--max_docs", "3"])
    with pytest.raises(ValueError, match=match):
        evaluate.XPRTEncoder(str(no_tokenizer))


def test_time_per_step_counts_the_steps_of_each_window(tiny_bert, groups, tmp_path, monkeypatch):
    """5 steps logged every 3: the last window holds 2 steps, and its time per step divides by 2, not by 3."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(run_log.time, "time", lambda: clock["now"])
    orig = run_log.LogWindow.step_done

    def step_done(self, *a, **kw):  # every optimiser step takes 10 s of the fake clock
        clock["now"] += 10.0
        return orig(self, *a, **kw)

    monkeypatch.setattr(run_log.LogWindow, "step_done", step_done)
    out = tmp_path / "w"
    run(base_args(tiny_bert, groups, out, **{"--max_train_steps": 5, "--logging_steps": 3, "--max_groups": 8,
                                             "--no_save_model": True}))
    recs = [r for r in common.read_jsonl(out / "train_log.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == [3, 5]
    assert [r["time_per_step_s"] for r in recs] == [10.0, 10.0]


# ---- the BEIR reader (--beir_dir, --local_tasks): one standard with --train_data's reader ----------------------

def _beir(tmp_path, corpus=None, queries=None, qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n"):
    (tmp_path / "qrels").mkdir(parents=True, exist_ok=True)
    corpus = corpus if corpus is not None else '{"_id": "d1", "text": "alpha"}\n{"_id": "d2", "text": "beta"}\n'
    queries = queries if queries is not None else '{"_id": "q1", "text": "a?"}\n{"_id": "q2", "text": "b?"}\n'
    (tmp_path / "corpus.jsonl").write_bytes(corpus.encode("utf-8") if isinstance(corpus, str) else corpus)
    (tmp_path / "queries.jsonl").write_text(queries, encoding="utf-8")
    (tmp_path / "qrels" / "test.tsv").write_bytes(qrels.encode("utf-8") if isinstance(qrels, str) else qrels)
    return tmp_path


def test_beir_reader_reads_bom_headerless_and_trec_qrels(tmp_path):
    want = {"q1": {"d1": 1}, "q2": {"d2": 1}}
    assert readers.load_beir(_beir(tmp_path / "plain"))["qrels"] == want
    bom = _beir(tmp_path / "bom", corpus=b"\xef\xbb\xbf" + b'{"_id": "d1", "text": "alpha"}\n'
                                         b'{"_id": "d2", "text": "b"}\n',
                qrels=b"\xef\xbb\xbfquery-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    assert readers.load_beir(bom)["qrels"] == want
    assert readers.load_beir(_beir(tmp_path / "nohead", qrels="q1\td1\t1\nq2\td2\t1\n"))["qrels"] == want
    assert readers.load_beir(_beir(tmp_path / "trec", qrels="q1 0 d1 1\nq2 0 d2 1\n"))["qrels"] == want
    assert readers.load_beir(_beir(tmp_path / "trectab", qrels="q1\t0\td1\t1\nq2\t0\td2\t1\n"))["qrels"] == want


def test_beir_reader_refuses_what_it_cannot_read_naming_the_file_and_line(tmp_path):
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: a BEIR corpus record needs an \"_id\" field; found \['id'"):
        readers.load_beir(_beir(tmp_path / "id", corpus='{"_id": "d1", "text": "a"}\n{"id": "d2", "text": "b"}\n'))
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: corpus id 'd1' appears twice \(first at line 1\)"):
        readers.load_beir(_beir(tmp_path / "dup", corpus='{"_id": "d1", "text": "a"}\n{"_id": "d1", "text": "b"}\n'))
    with pytest.raises(ValueError, match=r"test.tsv: no judgements \(an empty qrels file\)"):
        readers.load_beir(_beir(tmp_path / "empty", qrels=""))
    with pytest.raises(ValueError, match=r"test.tsv:3: expected query-id, corpus-id, integer score"):
        readers.load_beir(_beir(tmp_path / "bad", qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\n"))
    with pytest.raises(ValueError, match=r"test.tsv:3: query 'q1' x document 'd1' judged twice \(first at line 2\)"):
        readers.load_beir(_beir(tmp_path / "twice", qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td1\t0\n"))


def test_a_sentence_transformers_folder_keeps_its_length_and_pooling_through_fine_tuning(tiny_bert, tmp_path):
    """A CLS-pooled folder saved by sentence-transformers 6.2 (which keeps the length limit as the tokenizer's
    model_max_length, not in sentence_bert_config.json), fine-tuned 2 steps: the saved folder loads with the same
    limit (200, not 512) and [CLS] pooling, and its vectors are [CLS]'s."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling
    from test_finetune import make_beir

    import finetune
    from plumbing.embed import embed_texts

    start = tmp_path / "st_cls"
    tr = Transformer(str(tiny_bert), max_seq_length=200)
    SentenceTransformer(modules=[tr, Pooling(tr.get_embedding_dimension(), "cls"), Normalize()]).save(str(start))
    assert model_folder.read_max_seq_length(str(start)) == 200 and model_folder.read_pooling(str(start)) == "cls"
    out = tmp_path / "ft"
    run(["--model_name_or_path", start, "--beir_dir", make_beir(tmp_path / "beir"), "--output_dir", out,
         "--max_train_steps", 2, "--per_device_train_batch_size", 4, "--report_to", "none", "--negatives_rank_min", 1,
         "--negatives_rank_max", 5], main=finetune.main)
    folder = out / "model"
    st = SentenceTransformer(str(folder), device="cpu")
    assert st.max_seq_length == 200 and st[1].get_config_dict()["pooling_mode"] == "cls"
    assert model_folder.read_pooling(str(folder)) == "cls" and model_folder.read_max_seq_length(str(folder)) == 200
    texts = ["a cls pooled model", "keeps its pooling"]
    from transformers import AutoModel, AutoTokenizer

    by_hand = embed_texts(AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), texts,
                          pooling="cls")
    assert torch.allclose(torch.from_numpy(st.encode(texts)), by_hand, atol=1e-5)
    assert "cls pooling" in (folder / "README.md").read_text()
