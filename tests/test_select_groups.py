"""Tests of select_groups.py: the paper's formulas on hand-made numbers, then the script end to end
on bundled documents with the tiny random BERT (fast), bad input, resume, and 1 vs 2 processes."""

import dataclasses
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import select_groups as sg
from plumbing import readers
from plumbing.common import UserError

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "data" / "docs.jsonl"


def _docs(n):
    with open(DOCS, encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(n), fh)]


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


def _rows(out):
    """All groups of an output folder, sorted by (doc_id, group_index)."""
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(Path(out) / "*.parquet"), split="train")
    return sorted(ds.to_list(), key=lambda r: (r["doc_id"], r["group_index"]))


def _run(tiny_bert, inp, out, *extra):
    sg.main(["--input", str(inp), "--model_name_or_path", str(tiny_bert), "--output_dir", str(out), *extra])
    return json.load(open(Path(out) / "stats.json"))


# ---- the paper's numbers ------------------------------------------------------------------------

def test_rrf_worked_example():
    # Paper: A is 1st by E5 and 6th by TF-IDF, B is 2nd on both; A = 0.244 < B = 0.250 with k = 10.
    a, b = sg.rrf_score(1, 6), sg.rrf_score(2, 2)
    assert a == pytest.approx(2 / 11 + 1 / 16) and round(float(a), 3) == 0.244
    assert b == pytest.approx(0.25)
    assert a < b


def _example_rows():
    # passage 0 is the anchor; candidates 1..6. Passage 1 = A (cos rank 1, TF-IDF rank 6),
    # passage 2 = B (rank 2 on both), passage 3 = TF-IDF rank 1, cos rank 3.
    cos = np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    tfidf = np.array([1.0, 0.05, 0.8, 0.9, 0.7, 0.6, 0.5])
    return cos, tfidf


def _sel_args(**kw):
    """rank_related's keyword arguments: the paper's settings, overridden by `kw`."""
    base = dict(rrf_k=10.0, rrf_weight_e5=2.0, rrf_weight_tfidf=1.0, num_related=4, ranking="rrf")
    base.update(kw)
    return base


def test_rank_related_each_mode():
    cos, tfidf = _example_rows()
    idx, cs, ts, rrf = sg.rank_related(0, cos, tfidf, **_sel_args(ranking="rrf"))
    # B (0.2500) > passage 3 (2/13 + 1/11 = 0.2448) > A (0.2443) > passage 4 (2/14 + 1/13)
    assert idx.tolist() == [2, 3, 1, 4]
    np.testing.assert_allclose(rrf, [3 / 12, 2 / 13 + 1 / 11, 2 / 11 + 1 / 16, 2 / 14 + 1 / 13])
    np.testing.assert_allclose(cs, cos[[2, 3, 1, 4]])
    np.testing.assert_allclose(ts, tfidf[[2, 3, 1, 4]])
    assert sg.rank_related(0, cos, tfidf, **_sel_args(ranking="e5"))[0].tolist() == [1, 2, 3, 4]
    assert sg.rank_related(0, cos, tfidf, **_sel_args(ranking="tfidf"))[0].tolist() == [3, 2, 4, 5]

    def random_order(seed):
        rng = sg.derived_rng(seed, "doc", "ranking")
        return sg.rank_related(0, cos, tfidf, **_sel_args(ranking="random"), rng=rng)[0]

    r1, r2 = random_order(0), random_order(0)
    assert r1.tolist() == r2.tolist() and 0 not in r1 and len(set(r1.tolist())) == 4
    draws = {tuple(random_order(s)) for s in range(20)}
    assert len(draws) > 5  # really random across seeds
    # weights and k are parameters: TF-IDF-only weight makes the order the TF-IDF order
    assert sg.rank_related(0, cos, tfidf, **_sel_args(rrf_weight_e5=0.0))[0].tolist() == [3, 2, 4, 5]


def test_ranks_are_one_based_with_shared_ties():
    assert sg.ranks_descending([0.9, 0.1, 0.5, 0.0, 0.0]).tolist() == [1, 3, 2, 4, 4]


def test_centrality_hand_made_vectors():
    v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    # mean = (2/3, 1/3): cos to (1,0) = 2/sqrt(5), to (0,1) = 1/sqrt(5)
    np.testing.assert_allclose(sg.centrality(v), [2 / 5**0.5, 1 / 5**0.5, 2 / 5**0.5])
    # an off-topic vector among four near-identical ones scores low, the body high
    body = np.array([[1.0, 0.1, 0.0], [1.0, 0.0, 0.1], [1.0, 0.05, 0.05], [1.0, 0.0, 0.0]])
    c = sg.centrality(np.vstack([body / np.linalg.norm(body, axis=1, keepdims=True), [[0.0, 0.0, 1.0]]]))
    assert c[:4].min() > 0.95 and c[4] < 0.3


def test_split_passages_budget_and_text(minilm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    long_doc = "Title\n\n" + "A sentence of eight words in a row. " * 80 + "\nShare this\nA. B. C."
    texts = [d["text"] for d in _docs(30)] + [long_doc, "word " * 700]
    for t, ps in zip(texts, sg.split_passages(texts, tok, max_tokens=64, min_tokens=8)):
        lens = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in ps]
        assert max(lens) <= 64 + 2  # the budget (+2 for sub-word joins across pieces)
        # nothing lost or reordered: the passages spell out the document's words
        assert " ".join(" ".join(ps).split()) == " ".join(t.split())
    long, words = sg.split_passages(texts[-2:], tok, max_tokens=64, min_tokens=8)
    assert long[0].startswith("Title\nA sentence")  # the short heading is packed with the next sentences
    assert long[-1].endswith("Share this\nA. B. C.")  # short trailing lines merged into the last passage
    assert all(p.endswith("row.") for p in long[:-1])  # a long paragraph is cut at sentence ends
    assert len(words) == 11 and all(p.startswith("word") and p.endswith("word") for p in words)  # token windows


# ---- reading and bad input ----------------------------------------------------------------------

BAD_LINES = {
    "malformed_json": b'{"id": "x", "text": "unterminated\n',
    "invalid_utf8": b'{"id": "x", "text": "caf\xe9 au lait"}\n',
    "not_an_object": b'["a", "list"]\n',
    "missing_id": b'{"text": "no id here"}\n',
    "missing_text": b'{"id": "x"}\n',
    "non_string_text": b'{"id": "x", "text": 42}\n',
    "empty_text": b'{"id": "x", "text": "  \\n "}\n',
    "duplicate_id": None,  # filled in: the id of line 1
    "huge_document": b'{"id": "x", "text": "' + b"a" * 20001 + b'"}\n',
}


def _bad_file(tmp_path, reason):
    good = [json.dumps({"id": d["id"], "text": d["text"]}).encode() + b"\n" for d in _docs(4)]
    bad = BAD_LINES[reason] or json.dumps({"id": _docs(1)[0]["id"], "text": "again"}).encode() + b"\n"
    path = tmp_path / f"{reason}.jsonl"
    path.write_bytes(good[0] + good[1] + bad + good[2] + good[3])  # the bad record is on line 3
    return path


@pytest.mark.parametrize("reason", list(BAD_LINES))
def test_bad_input_names_file_and_line(tmp_path, tiny_bert, reason):
    path = _bad_file(tmp_path, reason)
    with pytest.raises(readers.BadInput, match=f"{path}:3: {reason}"):
        _run(tiny_bert, path, tmp_path / "out", "--max_doc_chars", "20000")


def test_bad_input_skipped_and_counted(tmp_path, tiny_bert):
    good = [json.dumps({"id": d["id"], "text": d["text"]}).encode() + b"\n" for d in _docs(6)]
    lines = good[:]
    for reason, raw in BAD_LINES.items():
        lines.append(raw or good[0])
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(lines) + b"\n\n")  # trailing blank lines are not documents
    stats = _run(tiny_bert, path, tmp_path / "out", "--skip_bad_lines", "--max_doc_chars", "20000", "--chunk_docs", "4")
    assert stats["documents_read"] == 6 + len(BAD_LINES)
    assert stats["documents_valid"] == 6
    assert stats["documents_skipped_by_reason"] == {r: 1 for r in readers.SKIP_REASONS}
    assert stats["documents_valid"] + stats["documents_skipped"] == stats["documents_read"]
    assert {r["doc_id"] for r in _rows(tmp_path / "out")} <= {d["id"] for d in _docs(6)}


def test_lone_surrogate_is_invalid_utf8(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "a", "text": "bad \\ud800 text"}\n')
    args = sg.parse_args(["--input", str(path), "--output_dir", str(tmp_path / "o"), "--skip_bad_lines"])
    assert [d.skip for d in readers.iter_records(args)] == ["invalid_utf8"]


def test_readers_agree_jsonl_gz_parquet_and_hf_streaming(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [{"id": d["id"], "text": d["text"], "url": d.get("url", "")} for d in _docs(7)]
    _write_jsonl(tmp_path / "a.jsonl", docs)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(d) + "\n" for d in docs)
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "pq" / "a.parquet")
    want = [(d["id"], d["text"]) for d in docs][:5]
    for inp in (["--input", str(tmp_path / "a.jsonl")], ["--input", str(tmp_path / "a.jsonl.gz")],
                ["--input", str(tmp_path / "pq" / "a.parquet")], ["--dataset", str(tmp_path / "pq")]):
        args = sg.parse_args(inp + ["--output_dir", "x", "--max_docs", "5"])
        assert [(d.doc_id, d.text) for d in readers.iter_records(args)] == want, inp
    # field names are flags
    _write_jsonl(tmp_path / "b.jsonl", [{"doc": d["id"], "body": d["text"]} for d in docs])
    args = sg.parse_args(["--input", str(tmp_path / "b.jsonl"), "--output_dir", "x",
                          "--id_field", "doc", "--text_field", "body"])
    assert [d.doc_id for d in readers.iter_records(args)] == [d["id"] for d in docs]


def test_a_byte_order_mark_on_line_1_is_not_part_of_the_first_record(tmp_path):
    """Windows exports start with a UTF-8 byte-order mark; the first record reads like the others (common.iter_jsonl
    drops the mark), rather than failing as malformed JSON."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "text": "first"}\n{"id": "b", "text": "second"}\n')
    args = sg.parse_args(["--input", str(path), "--output_dir", str(tmp_path / "o")])
    assert [(d.doc_id, d.text, d.skip) for d in readers.iter_records(args)] == [("a", "first", ""), ("b", "second", "")]


# ---- settings -----------------------------------------------------------------------------------

def _selection(*flags):
    return sg.Selection.from_args(sg.parse_args(["--input", "x", "--output_dir", "o", *flags]))


def test_prefixes_flag_gives_the_passage_prefix():
    """--prefixes is train.py's flag and rule (common.model_prompts): the model's own document prefix by default,
    e5 / none force one. One spelling across the scripts, so --passage_prefix is not a flag here."""
    minilm = ["--model_name_or_path", "all-MiniLM-L6-v2"]
    assert _selection().passage_prefix == "passage: "  # the default encoder is E5
    assert _selection(*minilm).passage_prefix == ""
    assert _selection(*minilm, "--prefixes", "e5").passage_prefix == "passage: "
    assert _selection("--prefixes", "none").passage_prefix == ""
    with pytest.raises(UserError):
        sg.parse_args(["--input", "x", "--output_dir", "o", "--passage_prefix", "p: "])


# Flags the resume check leaves out, and why: a rerun that changes only these may reuse finished chunks.
NOT_KEYED = {
    "url_field": "shown in the --inspect report only",
    "prefixes": "keyed as the prefix it gives (Selection.passage_prefix)",
    "batch_size": "speed; embeddings move by float rounding only",
    "device": "speed; embeddings move by float rounding only",
    "trust_remote_code": "a permission, not a setting",
    "output_dir": "where, not what", "overwrite": "what to do with an old output",
    "inspect": "the report", "inspect_only": "the report", "inspect_chars": "the report",
    "executor": "the engine: the same rows (tests/test_selection_stages.py); a folder's config says which",
    "tasks": "keyed as datatrove_tasks under --executor", "workers": "speed", "gpus_per_task": "placement",
    "executor_option": "placement and scheduling", "dry_run": "runs nothing",
}


def test_every_flag_is_in_the_resume_key_or_left_out_on_purpose():
    """A setting that changes the groups is a field of Selection or a RECORD_FLAGS entry, so run_config (the resume
    key) holds it and a rerun with another value never reuses chunks made with the old one. A new flag fails here
    until it is one or the other."""
    args = sg.parse_args(["--input", "x", "--output_dir", "o"])
    keyed = {f.name for f in dataclasses.fields(sg.Selection)} | set(sg.RECORD_FLAGS)
    assert set(vars(args)) - keyed == set(NOT_KEYED)
    assert keyed - set(vars(args)) == {"passage_prefix"}  # the one derived field
    sel = sg.Selection.from_args(args)
    assert sel == sg.PAPER  # the flags' defaults are the dataclass's
    config = sg.run_config(args, sel)
    assert set(config) == keyed | {"chunks"}  # and the rule that cuts chunks (iter_chunks)
    for f in dataclasses.fields(sg.Selection):  # every field keys the check
        other = dataclasses.replace(sel, **{f.name: "changed"})
        assert sg.run_config(args, other) != config, f.name


def test_embedding_length_is_the_models_own_limit(minilm_path, tiny_bert, capsys):
    """model_folder.max_seq_length: MiniLM states 256, a folder that states none gets 512; a passage budget the limit
    cannot hold is said at the start, not found in odd centralities."""
    from types import SimpleNamespace

    import torch

    state = SimpleNamespace(device=torch.device("cpu"), num_processes=1, print=print)
    for model, want in ((minilm_path, 256), (str(tiny_bert), 512)):
        args = sg.parse_args(["--input", "x", "--output_dir", "o", "--model_name_or_path", model])
        assert sg.load_selection_encoder(args, sg.Selection.from_args(args), state).max_length == want
    assert "warning" not in capsys.readouterr().out
    args = sg.parse_args(["--input", "x", "--output_dir", "o", "--model_name_or_path", minilm_path,
                          "--passage_tokens", "300"])
    sg.load_selection_encoder(args, sg.Selection.from_args(args), state)
    assert "are cut to 256 when embedded" in capsys.readouterr().out


# ---- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    return _write_jsonl(tmp_path_factory.mktemp("corpus") / "docs.jsonl", _docs(16))


def test_groups_schema_and_same_document(tmp_path, tiny_bert, small_corpus, minilm_path):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    stats = _run(tiny_bert, small_corpus, out, "--anchor_share", "0.5", "--inspect", "2", "--passage_tokens", "96")
    rows = _rows(out)
    assert len(rows) == stats["groups"] > 0
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    docs = {d["id"]: d["text"] for d in _docs(16)}
    for r in rows:
        ps = sg.split_passages([docs[r["doc_id"]]], tok, 96, 16)[0]
        assert r["num_passages"] == len(ps) and r["anchor"] == ps[r["anchor_index"]]
        # related passages: exactly num_related, all from the SAME document, never the anchor itself
        assert len(r["related"]) == 4 and r["anchor_index"] not in r["related_index"]
        assert r["related"] == [ps[i] for i in r["related_index"]]
        assert r["random_passage"] in ps and r["random_passage"] != r["anchor"] or ps.count(r["anchor"]) > 1
        assert r["related_rrf"] == sorted(r["related_rrf"], reverse=True)  # rank order, best first
        assert r["anchor_centrality"] >= stats["centrality_threshold"] - 1e-6
    # --anchor_share 0.5 over all 16 documents: half the passages are at or above the threshold
    assert stats["passages_above_threshold_pct"] == pytest.approx(50.0, abs=100.0 / stats["passages"] + 1e-9)
    assert "anchor_share" in stats["threshold_source"]
    report = (out / "inspect.md").read_text()
    assert report.count("| ") > 10 and "**ANCHOR**" in report and "centrality" in report
    # the schema train.py reads (select_groups.group_schema()), with load_dataset(out) on the folder itself
    import datasets
    ds = datasets.load_dataset(str(out), split="train")
    assert ds.features["related_index"].feature.dtype == "int32"
    assert ds.features["anchor_centrality"].dtype == "float32"
    assert set(ds.column_names) == set(sg.group_schema().names)
    assert ds.features == datasets.Features.from_arrow_schema(sg.group_schema())  # every column's type


@pytest.mark.parametrize("mode,key", [("e5", "related_cosine"), ("tfidf", "related_tfidf"), ("random", None)])
def test_ranking_modes_end_to_end(tmp_path, tiny_bert, small_corpus, mode, key):
    _run(tiny_bert, small_corpus, tmp_path / "out", "--ranking", mode, "--anchor_share", "0.5",
         "--calibration_docs", "4")
    rows = _rows(tmp_path / "out")
    assert rows
    if key:
        assert all(r[key] == sorted(r[key], reverse=True) for r in rows)
    else:  # random order: not sorted by RRF for a good share of groups
        assert np.mean([r["related_rrf"] != sorted(r["related_rrf"], reverse=True) for r in rows]) > 0.3


def test_resume_after_crash_gives_identical_output(tmp_path, tiny_bert, small_corpus, monkeypatch):
    extra = ["--chunk_docs", "4", "--centrality_threshold", "0.0"]
    ref = _run(tiny_bert, small_corpus, tmp_path / "ref", *extra)
    # a crash while writing the third chunk
    real, calls = sg.write_group_shard, []

    def crashing(path, rows):
        calls.append(path)
        if len(calls) == 3:
            # what common.atomic_path leaves of a shard when the process dies mid-write
            open(os.path.join(os.path.dirname(path), ".tmp-123-" + os.path.basename(path)), "w").close()
            raise RuntimeError("simulated crash")
        real(path, rows)

    monkeypatch.setattr(sg, "write_group_shard", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tiny_bert, small_corpus, tmp_path / "out", *extra)
    assert not (tmp_path / "out" / "stats.json").exists()
    finished = sorted((tmp_path / "out").glob("groups-*.parquet"))
    mtimes = [p.stat().st_mtime_ns for p in finished]
    assert len(finished) == 2
    monkeypatch.setattr(sg, "write_group_shard", real)
    # a different command is refused rather than mixed into the unfinished run
    with pytest.raises(UserError, match="made with other settings"):
        _run(tiny_bert, small_corpus, tmp_path / "out", "--chunk_docs", "5", "--centrality_threshold", "0.0")
    with pytest.raises(UserError, match="made with other settings"):  # a selection setting too
        _run(tiny_bert, small_corpus, tmp_path / "out", *extra, "--rrf_weight_tfidf", "0.5")
    stats = _run(tiny_bert, small_corpus, tmp_path / "out", *extra)  # the same command again
    assert [p.stat().st_mtime_ns for p in finished] == mtimes  # finished chunks were reused, not redone
    assert not list((tmp_path / "out").glob(".tmp-*"))
    a, b = _rows(tmp_path / "ref"), _rows(tmp_path / "out")
    assert a == b and len(a) == ref["groups"]
    drop = lambda s: {k: v for k, v in s.items() if k != "wall_seconds"}
    assert drop(stats) == drop(ref)
    # a finished output is refused without --overwrite, replaced with it
    with pytest.raises(UserError, match="--overwrite"):
        _run(tiny_bert, small_corpus, tmp_path / "out", *extra)
    again = _run(tiny_bert, small_corpus, tmp_path / "out", *extra, "--overwrite")
    assert drop(again) == drop(ref)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, tiny_bert, small_corpus):
    """torchrun with 2 processes writes the same groups (and stats) as 1 process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    common = ["select_groups.py", "--input", str(small_corpus), "--model_name_or_path", str(tiny_bert),
              "--chunk_docs", "3", "--anchor_share", "0.5", "--calibration_docs", "8"]
    one = subprocess.run([sys.executable, *common, "--output_dir", str(tmp_path / "one")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          *common, "--output_dir", str(tmp_path / "two")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    s1, s2 = (json.load(open(tmp_path / d / "stats.json")) for d in ("one", "two"))
    assert s1["world_size"] == 1 and s2["world_size"] == 2  # really two processes
    assert s2["chunks"] == 6  # 16 docs in chunks of 3, shared by both processes
    assert s1["centrality_threshold"] == pytest.approx(s2["centrality_threshold"], abs=1e-6)
    for k in ("documents_read", "documents_valid", "groups", "passages", "passages_covered", "documents_with_groups"):
        assert s1[k] == s2[k], k
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        for k in ("doc_id", "group_index", "anchor_index", "anchor", "related", "related_index", "random_passage",
                  "num_passages"):
            assert x[k] == y[k], k
        for k in ("anchor_centrality", "related_cosine", "related_tfidf", "related_rrf"):
            np.testing.assert_allclose(x[k], y[k], atol=1e-5)


def test_a_plain_json_string_record_is_not_an_object(tmp_path):
    """A line that decodes to a JSON string is a record of the wrong type, counted under not_an_object. The reader's
    own skip reasons travel in a slot of their own, so a record whose text is a reason's name is not taken for one."""
    path = tmp_path / "s.jsonl"
    path.write_text('"hello"\n"malformed_json"\n')
    args = sg.parse_args(["--input", str(path), "--output_dir", str(tmp_path / "o"), "--skip_bad_lines"])
    assert [d.skip for d in readers.iter_records(args)] == ["not_an_object", "not_an_object"]


@pytest.mark.parametrize("terms", ["script", "encoder"])
def test_pipelined_chunks_equal_one_chunk_at_a_time(tmp_path, tiny_bert, terms):
    """select_chunks splits the next chunk and ranks the last in threads beside the encoder: its rows equal
    select_documents run on each chunk in turn, with TF-IDF terms of scikit-learn's analyzer or of the encoder's
    tokenizer (a copy per thread)."""
    from types import SimpleNamespace

    import torch

    inp = _write_jsonl(tmp_path / "docs.jsonl", _docs(12))
    flags = ["--input", str(inp), "--model_name_or_path", str(tiny_bert), "--chunk_docs", "3", "--tfidf_terms", terms]
    sg.main([*flags, "--output_dir", str(tmp_path / "out")])
    args = sg.parse_args([*flags, "--output_dir", str(tmp_path / "unused")])
    sel = sg.Selection.from_args(args)
    state = SimpleNamespace(device=torch.device("cpu"), num_processes=1, print=lambda *a: None)
    encoder = sg.load_selection_encoder(args, sel, state)
    tfidf = sg.CorpusTfidf(sel.tfidf_features, sg.tfidf_analyzer(terms, encoder.tokenizer))
    tfidf.add_documents([d["text"] for d in _docs(12)])
    tfidf.finalize()
    want = [g for _, recs in readers.iter_chunks(args) for r in sg.select_documents(recs, encoder, tfidf, 0.825, sel)
            for g in r.groups]
    assert len(want) > 20
    import pyarrow as pa

    want = pa.Table.from_pylist(want, schema=sg.group_schema()).to_pylist()  # the file's float32 columns
    assert _rows(tmp_path / "out") == sorted(want, key=lambda r: (r["doc_id"], r["group_index"]))


@pytest.mark.parametrize("calibration_docs", [4, 6])
def test_each_passage_is_embedded_once_and_the_groups_are_those_of_embedding_twice(calibration_docs, tiny_bert,
                                                                                  tmp_path, monkeypatch):
    """--anchor_share calibrates on the first documents' chunks, embedded as the selection embeds them, and the
    selection takes those chunks' vectors instead of embedding them again (before, 1fbaae3: every calibration passage
    was embedded twice, 74 s + 73 s for 40 documents). Counted: each passage is embedded once; the groups are, to
    the bit, the ones the selection writes when it embeds every chunk itself (the calibration's chunks again)."""
    inp = _write_jsonl(tmp_path / "docs.jsonl", _docs(12))
    flags = ["--anchor_share", "0.5", "--calibration_docs", str(calibration_docs), "--chunk_docs", "4"]
    counted, real = [], sg.embed_passages
    monkeypatch.setattr(sg, "embed_passages", lambda enc, texts, *a, **k: counted.append(len(texts)) or real(
        enc, texts, *a, **k))
    once = _run(tiny_bert, inp, tmp_path / "once", *flags)
    embedded_once = sum(counted)
    real_select = sg.select_chunks
    monkeypatch.setattr(sg, "select_chunks", lambda *a, embedded=None, **k: real_select(*a, **k))  # every chunk again
    counted.clear()
    twice = _run(tiny_bert, inp, tmp_path / "twice", *flags)
    assert embedded_once == once["passages"]
    assert sum(counted) > embedded_once  # the calibration's chunks embedded a second time
    assert once["centrality_threshold"] == twice["centrality_threshold"]
    assert _rows(tmp_path / "once") == _rows(tmp_path / "twice")
