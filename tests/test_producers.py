"""Issue 27: inputs as their real producers write them, read as those producers meant them or refused naming them.

Corpora written by datasets (save_to_disk), gzip (C4's .json.gz shards) and pyarrow (Wikipedia's parquet columns);
MS MARCO's TSVs laid out as MS MARCO ships them; a sentence-transformers dot-product model built from its own
modules. The model's scoring contract (pooling, normalisation, similarity) travels through training, and evaluate.py
says when two models are scored differently and can score them alike (--score_as)."""

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_select_groups import _docs, _run, _write_jsonl

import finetune
import select_groups as sg
from plumbing import common, model_folder, readers
from plumbing.model_folder import load_xprt_folder, save_xprt_folder

ROOT = Path(__file__).resolve().parent.parent


def _records(inp, *extra):
    """The valid documents select_groups reads from --input `inp` (no model: only the reader)."""
    args = sg.parse_args(["--input", *map(str, inp if isinstance(inp, list) else [inp]), "--output_dir", "unused",
                          *extra])
    return [d for d in readers.iter_records(args) if not d.skip], args


# ---- select_groups.py: corpora as datasets, gzip and pyarrow write them -------------------------------------------

def test_a_save_to_disk_folder_is_read_as_the_dataset_it_holds(tmp_path):
    """datasets' save_to_disk folder (its dataset_info.json / state.json are metadata, not JSON Lines): every row, the
    same documents as the JSONL it was made from; a DatasetDict by --dataset_split, its other splits named; a folder
    holding it as well."""
    import datasets

    docs = _docs(30)
    datasets.Dataset.from_list(docs).save_to_disk(str(tmp_path / "saved"))
    got, _ = _records(tmp_path / "saved")
    assert [(d.doc_id, d.text) for d in got] == [(r["id"], r["text"]) for r in docs]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(docs[:5]),
                          "validation": datasets.Dataset.from_list(docs[5:8])}).save_to_disk(str(tmp_path / "dict"))
    assert len(_records(tmp_path / "dict")[0]) == 5
    # the splits not read are named (a run's start-up line), from the DatasetDict datasets wrote
    assert readers.unread_splits(readers.input_files([str(tmp_path / "dict")]), "train") == [
        f"--input {tmp_path / 'dict'}: a saved DatasetDict; its split 'train' is read, not ['validation'] "
        "(--dataset_split picks the split)"]
    assert readers.unread_splits(readers.input_files([str(tmp_path / "saved")]), "train") == []
    assert len(_records(tmp_path / "dict", "--dataset_split", "validation")[0]) == 3
    with pytest.raises(readers.BadInput, match="without split 'test'.*--dataset_split"):
        _records(tmp_path / "dict", "--dataset_split", "test")
    (tmp_path / "outer").mkdir()
    datasets.Dataset.from_list(docs[:4]).save_to_disk(str(tmp_path / "outer" / "part"))
    assert [d.doc_id for d in _records(tmp_path / "outer")[0]] == [r["id"] for r in docs[:4]]


def test_a_folder_of_c4_json_gz_shards_is_read_like_its_files(tmp_path):
    """C4's layout: c4-train.0000k-of-01024.json.gz, JSON Lines of {text, timestamp, url}, no id: a folder of them
    reads as the files one by one do (row numbers as ids), and the field no flag reads (timestamp) is named."""
    docs = _docs(12)
    (tmp_path / "c4").mkdir()
    for k in range(2):
        with gzip.open(tmp_path / "c4" / f"c4-train.0000{k}-of-01024.json.gz", "wt", encoding="utf-8") as f:
            for d in docs[6 * k: 6 * k + 6]:
                f.write(json.dumps({"text": d["text"], "timestamp": "2019-04-25T12:57:54Z", "url": "https://x"}) + "\n")
    folder, args = _records(tmp_path / "c4")
    files = _records(sorted((tmp_path / "c4").iterdir()))[0]
    assert [d.text for d in folder] == [d.text for d in files] == [d["text"] for d in docs]
    assert [d.doc_id for d in folder] == [str(i) for i in range(12)]
    assert readers.unused_fields(args) == ["timestamp"]


def test_wikipedia_parquet_titles_are_joined_and_said(tmp_path):
    """Wikipedia's parquet (id, url, title, text; pyarrow): the title is the text's first line by default (as E5 and
    BEIR join title and text), left out with --title_field '' and then named among the unused fields."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "12", "url": "https://en.wikipedia.org/wiki?curid=12", "title": "Anarchism",
             "text": "Anarchism is a political philosophy.\nHistory.\nThe earliest anarchist themes..."},
            {"id": "25", "url": "https://en.wikipedia.org/wiki?curid=25", "title": "Autism",
             "text": "Autism is a developmental disorder."}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "wiki.parquet")
    got, args = _records(tmp_path / "wiki.parquet")
    assert [d.text for d in got] == [f"{r['title']}\n{r['text']}" for r in rows] and readers.unused_fields(args) == []
    got, args = _records(tmp_path / "wiki.parquet", "--title_field", "")
    assert [d.text for d in got] == [r["text"] for r in rows] and readers.unused_fields(args) == ["title"]
    # a text that already starts with its title (WikiExtractor kept the title line) is not given it twice
    assert readers.with_title("Autism", "Autism\nAutism is ...") == "Autism\nAutism is ..."


def test_a_repeated_block_is_never_an_anchors_related_passage_and_html_is_counted(tmp_path, tiny_bert):
    """A page that repeats a block (a newsletter box 6 times between 6 body paragraphs): no group relates a passage
    to its own copy (the pair a repeated block gave: cosine 1.0), the pairs kept out are counted in stats.json; a
    page of raw HTML is counted and said."""
    body = [f"Paragraph {i} about river {i} in the valley, its fish, its bridges and the towns along it, "
            f"with the history of trade number {i} and the floods recorded in year {1900 + i}." for i in range(6)]
    box = "Subscribe to our newsletter for the latest news, offers and updates delivered to your inbox every week."
    page = "\n".join(p for b in body for p in (b, box))
    html = "<html><body><div class='post'><p>" + "</p>\n<p>".join(body) + "</p></div></body></html>"
    inp = _write_jsonl(tmp_path / "docs.jsonl", [{"id": "page", "text": page}, {"id": "html", "text": html}])
    stats = _run(tiny_bert, inp, tmp_path / "out", "--passage_tokens", "40", "--min_passage_tokens", "0",
                 "--centrality_threshold", "0.0")
    from test_select_groups import _rows

    groups = [g for g in _rows(tmp_path / "out") if g["doc_id"] == "page"]
    assert groups, "the page gives groups"
    norm = lambda t: " ".join(t.split())  # noqa: E731
    for g in groups:
        assert all(norm(r) != norm(g["anchor"]) for r in g["related"]), g
        assert norm(g["random_passage"]) != norm(g["anchor"])
    # six copies of the box: each box anchor has five copies kept out
    assert stats["repeat_pairs_excluded"] == 6 * 5
    assert stats["documents_with_html"] == 1
    assert sg.looks_like_html(html) and not sg.looks_like_html(page)


# ---- finetune.py: MS MARCO's files, and one source ----------------------------------------------------------------

def _msmarco(folder: Path) -> Path:
    """MS MARCO passage ranking's files as it ships them: headerless, tab-separated; collection.tsv (pid, passage),
    queries.train.tsv (qid, query), qrels.train.tsv (qid, 0, pid, 1), triples.train.small.tsv (query, positive,
    negative texts). Query i's relevant passage is passage 2i; query 1 has two."""
    folder.mkdir(parents=True, exist_ok=True)
    paras = [p for d in _docs(40) for p in d["text"].split("\n") if len(p) > 80][:24]
    (folder / "collection.tsv").write_text("".join(f"{i}\t{p}\n" for i, p in enumerate(paras)))
    queries = {1000 + i: " ".join(paras[2 * i].split()[:6]) for i in range(8)}
    (folder / "queries.train.tsv").write_text("".join(f"{q}\t{t}\n" for q, t in queries.items()))
    qrels = [(1000 + i, 2 * i) for i in range(8)] + [(1001, 5)]
    (folder / "qrels.train.tsv").write_text("".join(f"{q}\t0\t{p}\t1\n" for q, p in qrels))
    (folder / "triples.train.small.tsv").write_text(
        "".join(f"{queries[1000 + i]}\t{paras[2 * i]}\t{paras[2 * i + 1]}\n" for i in range(8)))
    return folder


def _ft_args(**kw):
    argv = ["--output_dir", "unused", "--report_to", "none"]
    for k, v in kw.items():
        argv += [k, str(v)]
    return finetune.parse_args(argv)


class _Printer:
    """What build_finetune_rows asks of an accelerator when nothing is mined: its printing, whether it is the main
    process and how many there are (the batch-size check)."""

    is_main_process = True
    num_processes = 1

    def __init__(self):
        self.lines = []

    def print(self, *a):
        self.lines.append(" ".join(map(str, a)))


def test_msmarco_files_are_read_as_msmarco_or_refused_naming_it(tmp_path):
    """qrels.train.tsv read by position used to give query '1000', positive '0': now the folder (or its qrels file)
    reads as MS MARCO (pairs from the qrels, texts from queries and collection); its queries or collection file alone
    is refused naming the layout; triples.train.small.tsv, texts in every column, reads as triples."""
    ms = _msmarco(tmp_path / "msmarco")
    collection = dict(line.split("\t", 1) for line in (ms / "collection.tsv").read_text().splitlines())
    queries = dict(line.split("\t", 1) for line in (ms / "queries.train.tsv").read_text().splitlines())
    for source in (ms, ms / "qrels.train.tsv"):
        data, trained_on_qrels, name = finetune.labelled_source(_ft_args(**{"--train_data": source}))
        assert trained_on_qrels and name == "MS MARCO qrels.train.tsv"
        assert data["qrels"]["1001"] == {"2": 1, "5": 1} and data["queries"]["1003"] == queries["1003"]
        assert data["corpus"]["6"] == ("", collection["6"]) and len(data["corpus"]) == len(collection)
    for name, layout in [("queries.train.tsv", "an id and a text"), ("collection.tsv", "an id and a text"),
                         ("qrels.train.tsv", "TREC qrels")]:
        with pytest.raises(ValueError, match=f"{name}:1: .*{layout}.*MS MARCO"):
            list(finetune.read_pairs(str(ms / name)))
    forced = list(finetune.read_pairs(str(ms / "qrels.train.tsv"), schema="triples"))  # asked for by position
    assert forced[0] == {"query": "1000", "positive": "0", "negatives": ["0", "1"]}
    triples = list(finetune.read_pairs(str(ms / "triples.train.small.tsv")))
    assert triples[0] == {"query": queries["1000"], "positive": collection["0"], "negatives": [collection["1"]]}
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "collection.tsv").write_text("0\tx\n")
    with pytest.raises(ValueError, match=r"MS MARCO's layout needs \['queries.train.tsv', 'qrels.train.tsv'\]"):
        finetune.msmarco_files(str(tmp_path / "partial"))


def test_msmarco_fine_tuning_end_to_end(tmp_path, tiny_bert, capsys):
    """finetune.py --train_data <MS MARCO folder>: 9 (query, passage) pairs of 8 queries, negatives mined from the
    collection; the log counts rows and queries apart."""
    ms = _msmarco(tmp_path / "msmarco")
    finetune.main(["--model_name_or_path", str(tiny_bert), "--train_data", str(ms), "--output_dir",
                   str(tmp_path / "ft"), "--max_train_steps", "1", "--per_device_train_batch_size", "4",
                   "--report_to", "none", "--negatives_rank_min", "1", "--negatives_rank_max", "5",
                   "--no_save_model"])
    out = capsys.readouterr().out
    assert "MS MARCO qrels.train.tsv: 9 (query, relevant passage) pairs of 8 queries; corpus 24 passages" in out
    assert "9 (query, positive) rows of 8 queries" in out


def test_train_data_with_beir_dir_trains_on_one_source_and_each_pair_once(tmp_path):
    """--train_data with --beir_dir: the rows are the data's (the BEIR qrels are not added: 38 pairs used to become
    76 rows); a pair the data repeats is counted and trained once."""
    from test_finetune import make_beir

    beir = make_beir(tmp_path / "beir")
    pairs = [{"query": f"query {i}", "positive": f"passage {i}", "negatives": [f"other {i}"]} for i in range(5)]
    data = _write_jsonl(tmp_path / "pairs.jsonl", pairs + pairs[:2])
    args = _ft_args(**{"--train_data": data, "--beir_dir": beir, "--per_device_train_batch_size": 4})
    printer = _Printer()
    rows = finetune.build_finetune_rows(args, printer, None, None, common.NO_PROMPTS)
    assert [(r["query"], r["positive"]) for r in rows] == [(p["query"], p["positive"]) for p in pairs]
    assert any("2 repeated (query, positive) rows dropped" in line for line in printer.lines)
    assert any("is not trained on (one source: --train_data)" in line for line in printer.lines)


# ---- the model's scoring contract ----------------------------------------------------------------------------------

def _st_folder(tiny_bert, path: Path, normalize: bool, similarity: str) -> Path:
    """A sentence-transformers folder built with its own modules: Transformer, mean Pooling[, Normalize]."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    tr = Transformer(str(tiny_bert), max_seq_length=64)
    modules = [tr, Pooling(tr.get_embedding_dimension(), "mean")] + ([Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, similarity_fn_name=similarity).save(str(path))
    return path


def test_a_dot_product_start_is_saved_as_a_dot_product_model(tiny_bert, tmp_path):
    """A dot-product start (no Normalize, similarity "dot", as TAS-B and the msmarco -dot- models): its ModelInfo
    says so, and the folder save_pretrained writes loads with the start's modules and similarity and, with the
    weights unchanged, encodes exactly as the start does; --saved_similarity cosine (ModelInfo changed) saves cosine."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    import modeling_xprt as mx

    start = _st_folder(tiny_bert, tmp_path / "dot", normalize=False, similarity="dot")
    assert model_folder.read_scoring(str(start)) == {"pooling": "mean", "normalize": False, "similarity_fn_name": "dot"}
    assert model_folder.read_scoring(str(tiny_bert)) == {"pooling": "mean", "normalize": True,
                                                    "similarity_fn_name": "cosine"}  # no modules: the method's
    # the same folder as a Hub repository (huggingface_hub's download stands in for the Hub): read alike
    import huggingface_hub

    def from_hub(repo_id, filename):
        assert repo_id == "someone/tas-b-like"
        if not (start / filename).is_file():
            raise huggingface_hub.errors.EntryNotFoundError(filename)
        return str(start / filename)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub, "hf_hub_download", from_hub)
        assert model_folder.read_scoring("someone/tas-b-like") == model_folder.read_scoring(str(start))
    model = load_xprt_folder(mx.XPRTModel, str(start))
    tok = AutoTokenizer.from_pretrained(str(start))
    save_xprt_folder(model, str(tmp_path / "saved"), tok)
    a, b = SentenceTransformer(str(start)), SentenceTransformer(str(tmp_path / "saved"))
    assert [type(m).__name__ for m in b] == ["Transformer", "Pooling"] and b.similarity_fn_name == "dot"
    texts = ["a dot product model", "keeps its norms"]
    np.testing.assert_allclose(a.encode(texts), b.encode(texts), atol=1e-5)
    assert np.linalg.norm(b.encode(texts), axis=1).min() > 1.5  # not unit length: the norms take part in the score
    model.info.normalize, model.info.similarity_fn_name = True, "cosine"
    save_xprt_folder(model, str(tmp_path / "cos"), tok)
    c = SentenceTransformer(str(tmp_path / "cos"))
    assert [type(m).__name__ for m in c][-1] == "Normalize" and c.similarity_fn_name == "cosine"


def test_scores_during_training_use_the_saved_folders_scoring(tiny_bert, tmp_path):
    """train.py's --eval_tasks encoder scores a dot-product start as its saved folder is scored: unnormalised vectors,
    mteb's dot product; the vectors equal what SentenceTransformer makes of the folder."""
    from mteb.models.model_meta import ScoringFunction
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    import evaluate
    import modeling_xprt as mx

    start = _st_folder(tiny_bert, tmp_path / "dot", normalize=False, similarity="dot")
    model = load_xprt_folder(mx.XPRTModel, str(start)).eval()
    tok = AutoTokenizer.from_pretrained(str(start))
    info = model.info
    enc = evaluate.TrainingEncoder(model.encoder, tok, model.prompts, 64, 8, None, info.pooling, info.normalize,
                                   info.similarity_fn_name)
    assert enc.mteb_model_meta.similarity_fn_name == ScoringFunction.DOT_PRODUCT
    texts = ["a dot product model", "keeps its norms"]
    ours = enc.encode([{"text": texts}], task_metadata=None, hf_split="test", hf_subset="default")
    np.testing.assert_allclose(ours, SentenceTransformer(str(start)).encode(texts), atol=1e-5)
    assert np.linalg.norm(ours, axis=1).min() > 1.5


def test_evaluate_says_when_models_are_scored_differently_and_score_as_isolates_training(tiny_bert, tmp_path):
    """The same weights saved as a dot-product model and as a cosine one: as each is used their SciFact scores
    differ, which is no training at all, and the report says that the scoring differs (normalize, similarity);
    --score_as the cosine one scores both alike, and the Δ is exactly 0."""
    from test_finetune import make_beir

    import evaluate as ev

    beir = make_beir(tmp_path / "beir", num_docs=40, num_queries=12)
    dot = _st_folder(tiny_bert, tmp_path / "dot", normalize=False, similarity="dot")
    cos = _st_folder(tiny_bert, tmp_path / "cos", normalize=True, similarity="cosine")
    (beir / "qrels" / "test.tsv").write_text((beir / "qrels" / "train.tsv").read_text())
    task = [f"SciFact={beir}"]
    out = ev.run_evaluation([str(dot), str(cos)], local_tasks=task, show_progress=False)
    scores = [out["results"][str(m)]["SciFact"]["main_score"] for m in (dot, cos)]
    assert scores[0] != pytest.approx(scores[1], abs=1e-6)
    assert set(ev.contract_differences(out)) == {"normalize", "similarity"}
    md = ev.to_markdown(out, ev.summarize(out))
    assert "**The models are scored differently, not only trained differently** (normalize: dot False, cos True; " \
           "similarity: dot 'dot', cos 'cosine')" in md and "`--score_as MODEL`" in md
    alike = ev.run_evaluation([str(dot), str(cos)], local_tasks=task, show_progress=False, score_as=str(cos))
    s = [alike["results"][str(m)]["SciFact"]["main_score"] for m in (dot, cos)]
    assert s[0] == pytest.approx(s[1], abs=1e-9) and s[1] == pytest.approx(scores[1], abs=1e-9)
    assert ev.contract_differences(alike) == {}
    assert "**Every model is scored as cos is** (`--score_as`)" in ev.to_markdown(alike, ev.summarize(alike))


def test_the_cards_language_is_the_start_models(tiny_bert, tmp_path):
    """The card's language comes from the start model's card (a multilingual start stays multilingual), and is
    left out when the start's card says none (it was hard-coded "en")."""
    import shutil

    from huggingface_hub import ModelCard

    start = tmp_path / "multi"
    shutil.copytree(tiny_bert, start)
    (start / "README.md").write_text("---\nlanguage:\n- de\n- fr\nlicense: apache-2.0\n---\n# multi\n")
    args = argparse.Namespace(model_name_or_path=str(start), license=None, hub_model_id=None,
                              output_dir=str(tmp_path / "run"), per_device_train_batch_size=4,
                              gradient_accumulation_steps=1, learning_rate=1e-5)
    import modeling_xprt as mx

    info = mx.ModelInfo(start_model=str(start))
    summary = {"steps": 1, "processes": 1, "rows": 4, "unit": "groups"}
    card = ModelCard(model_folder.model_card(args, info, "t", "train.py", [], summary))
    assert card.data.language == ["de", "fr"] and card.data.license == "apache-2.0"
    args.model_name_or_path = str(tiny_bert)  # no card
    assert ModelCard(model_folder.model_card(args, info, "t", "train.py", [], summary)).data.language is None


# ---- DeepSpeed on CPU with two processes ----------------------------------------------------------------------------

@pytest.mark.slow
def test_cpu_deepspeed_with_two_processes_is_refused_before_loading(tiny_bert, tmp_path):
    """accelerate forms no multi-process state for DeepSpeed on CPU (each process says rank 0 of 1), and DeepSpeed
    stopped at prepare after loading everything (train_batch_size 4 != 4 * 1 * 2): refused, naming why, when the
    accelerator is made, before the model is loaded (the flags' paths are checked first, so they are real here)."""
    from test_train import make_groups

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate_cpu_deepspeed_zero2.yaml"), "--num_processes", "2",
           str(ROOT / "train.py"), "--model_name_or_path", str(tiny_bert), "--groups_dir",
           str(make_groups(tmp_path / "groups", 8)), "--per_device_train_batch_size", "2",
           "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "DeepSpeed with 2 processes, but accelerate sees 1 (cpu)" in proc.stdout + proc.stderr
