"""The data people have: fine-tuning pairs in FlagEmbedding, sentence-transformers, tevatron and triples formats
(JSONL, CSV, TSV, parquet, a dataset folder through datasets.load_dataset), each read to the same rows; a wrong
schema named with file, line and the accepted schemas; selection on an id-less corpus and on .jsonl.zst input."""

import csv
import json

import pytest
from test_select_groups import _docs, _rows, _run, _write_jsonl

import finetune
import select_groups as sg
from plumbing import readers

# One set of rows: q0 has two positives (FlagEmbedding / tevatron hold them in one record), every row 2 negatives.
# Texts with a comma, a double quote and an apostrophe, as real passages have.
RECORDS = [
    {"query": "what is an anchor passage?", "pos": ['The passage closest to its document\'s "mean" vector.',
                                                    "Anchors, in xPRT, are central passages."],
     "neg": ["A ship's anchor holds it in place.", "News anchors read the evening news."]},
    {"query": "how many related passages?", "pos": ["Four related passages per anchor."],
     "neg": ["Relations between countries, 1900-1950.", "Related posts: none"]},
    {"query": "temperature of InfoNCE", "pos": ["tau = 0.05 in the paper."],
     "neg": ["The temperature in Paris was 21 degrees.", "Infonce is not a word."]},
]
WANT = [{"query": r["query"], "positive": p, "negatives": r["neg"]} for r in RECORDS for p in r["pos"]]
ST_ROWS = [{"anchor": w["query"], "positive": w["positive"], "negative_1": w["negatives"][0],
            "negative_2": w["negatives"][1]} for w in WANT]


def _write_all_formats(tmp_path):
    """{format name: path} of one file per accepted format, all written from RECORDS."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {"flagembedding.jsonl": _write_jsonl(tmp_path / "fe.jsonl", RECORDS)}
    files["tevatron.jsonl"] = _write_jsonl(tmp_path / "tev.jsonl", [
        {"query_id": str(i), "query": r["query"],
         "positive_passages": [{"docid": f"p{i}-{j}", "title": "", "text": t} for j, t in enumerate(r["pos"])],
         "negative_passages": [{"docid": f"n{i}-{j}", "title": "", "text": t} for j, t in enumerate(r["neg"])]}
        for i, r in enumerate(RECORDS)])
    files["sentence-transformers.jsonl"] = _write_jsonl(tmp_path / "st.jsonl", ST_ROWS)
    with open(tmp_path / "st.csv", "w", encoding="utf-8", newline="") as f:  # quoted where a comma or quote is
        w = csv.DictWriter(f, fieldnames=list(ST_ROWS[0]))
        w.writeheader()
        w.writerows(ST_ROWS)
    files["sentence-transformers.csv"] = tmp_path / "st.csv"
    (tmp_path / "st.tsv").write_text("\n".join("\t".join(r) for r in [list(ST_ROWS[0])] +
                                               [list(r.values()) for r in ST_ROWS]) + "\n")  # TSV: never quoted
    files["sentence-transformers.tsv"] = tmp_path / "st.tsv"
    pq.write_table(pa.Table.from_pylist(ST_ROWS), tmp_path / "st.parquet")
    files["sentence-transformers.parquet"] = tmp_path / "st.parquet"
    (tmp_path / "st_dataset").mkdir()  # a dataset folder: datasets.load_dataset resolves it as it does a Hub name
    pq.write_table(pa.Table.from_pylist(ST_ROWS), tmp_path / "st_dataset" / "train.parquet")
    files["sentence-transformers dataset (load_dataset)"] = tmp_path / "st_dataset"
    files["triples.jsonl"] = _write_jsonl(tmp_path / "tr.jsonl", [{"query": w["query"], "positive": w["positive"],
                                                                   "negatives": w["negatives"]} for w in WANT])
    (tmp_path / "tr.tsv").write_text("".join("\t".join([w["query"], w["positive"], *w["negatives"]]) + "\n"
                                             for w in WANT))
    files["triples.tsv"] = tmp_path / "tr.tsv"
    return files


def test_every_pair_format_is_read_to_the_same_rows(tmp_path):
    files = _write_all_formats(tmp_path)
    assert len(files) == 9
    for name, path in files.items():
        assert list(finetune.read_pairs(str(path))) == WANT, name
    assert finetune.pair_schema(RECORDS[0]) == "flagembedding"
    assert finetune.pair_schema(ST_ROWS[0]) == "sentence-transformers"


def test_a_wrong_schema_names_the_file_the_line_and_the_accepted_schemas(tmp_path):
    bad = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError) as err:
        list(finetune.read_pairs(str(bad)))
    msg = str(err.value)
    assert msg.startswith(f"{bad}:1: fields ['question', 'answer'] match no accepted schema")
    for schema in ("FlagEmbedding {query, pos: [...], neg: [...]}", "sentence-transformers columns anchor",
                   "tevatron {query_id, query, positive_passages", "triples {query, positive"):
        assert schema in msg
    # a later record that does not fit the first one's schema; a field of the wrong shape
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [RECORDS[0], RECORDS[1], {"anchor": "a", "positive": "p"}])
    with pytest.raises(ValueError, match=r"mixed\.jsonl:3: fields \['anchor', 'positive'\] do not fit the file's "
                                         r"schema, FlagEmbedding"):
        list(finetune.read_pairs(str(mixed)))
    shape = _write_jsonl(tmp_path / "shape.jsonl", [{"query": "q", "pos": [1, 2]}])
    with pytest.raises(ValueError, match=r"shape\.jsonl:1: pos must be a list of strings \(FlagEmbedding"):
        list(finetune.read_pairs(str(shape)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"sentence1": "a", "sentence2": "b"}]), tmp_path / "sts.parquet")
    with pytest.raises(ValueError, match=r"sts\.parquet:row 1: fields \['sentence1', 'sentence2'\] match no"):
        list(finetune.read_pairs(str(tmp_path / "sts.parquet")))
    (tmp_path / "h.csv").write_text("question,answer\nq,a\n")
    with pytest.raises(ValueError, match=r"h\.csv:1: CSV header \['question', 'answer'\] matches no accepted"):
        list(finetune.read_pairs(str(tmp_path / "h.csv")))


def test_id_less_corpus_is_selected_with_row_numbers_as_ids(tmp_path, tiny_bert):
    """{"text"} only (RetroMAE / FlagEmbedding pre-training format): the record's index is its id, stats.json says
    so, and the groups are those of the same corpus with those ids written out."""
    docs = _docs(16)
    bare = _write_jsonl(tmp_path / "bare.jsonl", [{"text": d["text"]} for d in docs])
    numbered = _write_jsonl(tmp_path / "numbered.jsonl", [{"id": str(i), "text": d["text"]}
                                                          for i, d in enumerate(docs)])
    stats = _run(tiny_bert, bare, tmp_path / "out", "--anchor_share", "0.5", "--passage_tokens", "96")
    assert stats["doc_ids"].startswith("row number: the record's 0-based index") and "no 'id' field" in stats["doc_ids"]
    assert stats["documents_valid"] == 16 and stats["documents_skipped"] == 0 and stats["groups"] > 0
    ref = _run(tiny_bert, numbered, tmp_path / "ref", "--anchor_share", "0.5", "--passage_tokens", "96")
    assert ref["doc_ids"] == "the 'id' field"
    assert _rows(tmp_path / "out") == _rows(tmp_path / "ref")
    # a corpus WITH ids still refuses a record without one
    (tmp_path / "holes.jsonl").write_text(json.dumps({"id": "a", "text": "x"}) + "\n" + json.dumps({"text": "y"})
                                          + "\n")
    args = sg.parse_args(["--input", str(tmp_path / "holes.jsonl"), "--output_dir", "o", "--skip_bad_lines"])
    assert [d.skip for d in readers.iter_records(args)] == ["", "missing_id"]


def test_zst_input_reads_the_same_documents_as_the_plain_file(tmp_path):
    import zstandard

    docs = [{"id": d["id"], "text": d["text"]} for d in _docs(9)]
    plain = _write_jsonl(tmp_path / "a.jsonl", docs)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    got = {}
    for inp in (plain, tmp_path / "z" / "a.jsonl.zst", tmp_path / "z"):  # a file, and a folder holding .zst
        args = sg.parse_args(["--input", str(inp), "--output_dir", "x"])
        got[str(inp)] = [(d.doc_id, d.text, d.skip) for d in readers.iter_records(args)]
    want = [(d["id"], d["text"], "") for d in docs]
    assert all(v == want for v in got.values()), got.keys()


def test_pairs_without_negatives_are_mined_from_the_datas_own_passages(tmp_path, tiny_bert):
    """FlagEmbedding records without "neg" get mined pools, from the file's own passages when there is no BEIR
    corpus (as FlagEmbedding's miner does without a candidate pool); never a query's own positive."""
    from test_train import run

    rows = [{"query": w["query"], "pos": [w["positive"]]} for w in WANT] + \
        [{"query": f"query number {i}", "pos": [f"passage number {i} about topic {i % 3}"]} for i in range(8)]
    path = _write_jsonl(tmp_path / "no_neg.jsonl", rows)
    out = tmp_path / "ft"
    res = run(["--model_name_or_path", tiny_bert, "--train_data", path, "--output_dir", out, "--max_train_steps", 1,
               "--per_device_train_batch_size", 4, "--report_to", "none", "--negatives_rank_min", 2,
               "--no_save_model"], main=finetune.main)
    assert res["completed_steps"] == 1
    pools = json.loads((out / "mined_negatives.json").read_text())
    corpus = finetune.data_corpus(list(finetune.read_pairs(str(path))))
    assert len(pools) == len(WANT) + 8 == len(corpus)  # one row per positive; every passage is some row's positive
    flat = [(r["query"], p) for r in rows for p in r["pos"]]
    for (query, positive), pool in zip(flat, pools):
        own = {p for q, p in flat if q == query}
        assert pool and not own & {corpus[d] for d in pool}


# ---- files written by the real producer: sentence-transformers' mine_hard_negatives, every output format and container

@pytest.fixture(scope="module")
def mined(tmp_path_factory):
    """mine_hard_negatives (sentence-transformers 6.2) with all-MiniLM-L6-v2 on 24 (query, positive) pairs
    of the bundled
    SciFact sample, 3 negatives each, in each output format, written as JSONL, CSV, parquet and a save_to_disk folder:
    {(format, container): path}, and the pairs."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, util

    from plumbing import common
    root = tmp_path_factory.mktemp("mined")
    beir = readers.load_beir(common.Path(__file__).resolve().parent.parent / "data" / "eval" / "scifact")
    pairs = [(beir["queries"][q], beir["corpus"][d][1]) for q, ds in sorted(beir["qrels"].items()) for d in ds][:24]
    model = SentenceTransformer(common.resolve_model_path("all-MiniLM-L6-v2"))
    data = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [p for _, p in pairs]})
    files = {}
    for fmt in ("triplet", "n-tuple", "labeled-pair", "labeled-list"):
        out = util.mine_hard_negatives(data, model, num_negatives=3, output_format=fmt, verbose=False)
        name = fmt.replace("-", "_")
        out.to_json(str(root / f"{name}.jsonl"))
        out.to_csv(str(root / f"{name}.csv"), index=False)
        out.to_parquet(str(root / f"{name}.parquet"))
        out.save_to_disk(str(root / f"{name}_disk"))
        files.update({(fmt, "jsonl"): root / f"{name}.jsonl", (fmt, "csv"): root / f"{name}.csv",
                      (fmt, "parquet"): root / f"{name}.parquet", (fmt, "save_to_disk"): root / f"{name}_disk"})
    return files, pairs


def _by_query(rows):
    out = {}
    for r in rows:
        pos, neg = out.setdefault(r["query"], (set(), set()))
        pos.add(r["positive"])
        neg.update(r["negatives"])
    return out


def test_mine_hard_negatives_outputs_are_read_as_sentence_transformers_meant_them(mined):
    """n-tuple, labeled-pair and labeled-list of the same mining: 24 rows, one per query and positive, each with its 3
    mined negatives (labeled formats read by their labels: a label-0 passage is a negative, never a positive); the
    triplet format: one row per (query, positive, negative), 72; every container gives the same rows. A labeled-list
    saved as CSV (its lists become Python reprs) is refused."""
    files, pairs = mined
    want = None
    for (fmt, container), path in sorted(files.items()):
        if (fmt, container) == ("labeled-list", "csv"):
            with pytest.raises(ValueError, match="not lists: a list column saved as CSV"):
                list(finetune.read_pairs(str(path)))
            continue
        rows = list(finetune.read_pairs(str(path)))
        assert {r["query"] for r in rows} == {q for q, _ in pairs}, (fmt, container)
        assert all(r["positive"] not in r["negatives"] for r in rows)
        if fmt == "triplet":
            assert len(rows) == 72 and all(len(r["negatives"]) == 1 for r in rows), (fmt, container)
        else:
            assert len(rows) == 24 and all(len(r["negatives"]) == 3 for r in rows), (fmt, container)
            assert [(r["query"], r["positive"]) for r in rows] == pairs, (fmt, container)
        grouped = _by_query(rows)
        want = want or grouped
        assert grouped == want, (fmt, container)  # the same positives and negatives per query, whatever the format


def test_json_arrays_and_explicit_formats(tmp_path):
    """A .json array of records reads as its JSON lines do; --train_format sentence-transformers reads any column
    names by position (what sentence-transformers' trainer does), which auto-detection refuses as unknown."""
    arr = tmp_path / "pairs.json"
    arr.write_text(json.dumps(ST_ROWS))
    assert list(finetune.read_pairs(str(arr))) == WANT
    named = [{"question": r["anchor"], "doc": r["positive"], "hard": r["negative_1"], "hard2": r["negative_2"]}
             for r in ST_ROWS]
    path = _write_jsonl(tmp_path / "named.jsonl", named)
    with pytest.raises(ValueError, match="match no accepted schema"):
        list(finetune.read_pairs(str(path)))
    assert list(finetune.read_pairs(str(path), schema="sentence-transformers")) == WANT


def test_a_folder_of_flagembedding_files_with_different_optional_fields(tmp_path, capsys):
    """FlagEmbedding keeps its data as a folder of JSONL files whose optional fields differ (prompt, type): read file
    by file (datasets.load_dataset would stop with a CastError naming no file), the prompt / type fields counted and
    said, not applied."""
    folder = tmp_path / "fe"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", RECORDS[:2])
    # the fields FlagEmbedding's own example data carry beside query / pos / neg (FlagOpen/FlagEmbedding,
    # examples/finetune/embedder/example_data/retrieval/msmarco.jsonl: pos_scores, neg_scores, prompt, type)
    _write_jsonl(folder / "b.jsonl", [{**RECORDS[2], "pos_scores": [96.7], "neg_scores": [90.5, 89.0],
                                       "prompt": "Given a web search query, retrieve relevant passages.",
                                       "type": "normal"}])
    assert list(finetune.read_pairs(str(folder))) == WANT
    out = capsys.readouterr().out
    assert "1 FlagEmbedding records carry neg_scores, pos_scores, prompt, type, which finetune.py does not use" in out
