"""train.py: schedules, batching, every objective and ablation, resume, NaN handling, saving,
and DeepSpeed ZeRO-2 under `accelerate launch`.

Runs use the tiny random BERT (conftest) on a small groups folder built here from the bundled sample documents in
the groups schema of select_groups.group_schema(), so they take seconds each on a CPU.
"""

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_args

import train
from modeling_xprt import group_lengths, retention_weight
from plumbing import batches, common, run_log, training
from plumbing.common import UserError
from plumbing.model_folder import load_xprt_folder
from select_groups import group_schema

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def make_groups(out: Path, num_groups: int, num_related: int = 4, seed: int = 0) -> Path:
    """A groups folder in select_groups.py's schema, from the paragraphs of data/docs.jsonl (anchor = a paragraph,
    related = the next ones; the ranking is not what these tests check)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    with open(ROOT / "data" / "docs.jsonl", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    for d in docs:
        paras = [p for p in d["text"].split("\n") if len(p) > 40]
        if len(paras) < num_related + 2:
            continue
        for gi, a in enumerate(range(0, min(2, len(paras) - num_related))):
            rel_idx = list(range(a + 1, a + 1 + num_related))
            others = [i for i in range(len(paras)) if i != a]
            rows.append(dict(
                doc_id=d["id"], group_index=gi, anchor_index=a, anchor=paras[a], anchor_centrality=0.9,
                related=[paras[i] for i in rel_idx], related_index=rel_idx,
                related_cosine=[0.8] * num_related, related_tfidf=[0.3] * num_related, related_rrf=[0.2] * num_related,
                random_passage=paras[rng.choice(others)], num_passages=len(paras)))
            if len(rows) == num_groups:
                break
        if len(rows) == num_groups:
            break
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), out / "shard-00000.parquet")
    (out / "stats.json").write_text(json.dumps({"groups": len(rows)}))
    return out


def reset_accelerate():
    """Several runs in one test process: accelerate's state singletons must start fresh each time."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run(argv, main=train.main):
    reset_accelerate()
    try:
        return main([str(a) for a in argv])
    finally:
        reset_accelerate()


def read_log(out: Path):
    recs = {}
    for line in (out / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs[r["step"]] = r
    return recs


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return make_groups(tmp_path_factory.mktemp("groups"), 24)


def base_args(model, groups, out, **kw):
    args = {"--model_name_or_path": model, "--groups_dir": groups, "--output_dir": out, "--max_length": 32,
            "--per_device_train_batch_size": 4, "--report_to": "none", "--logging_steps": 1, "--seed": 7}
    args.update(kw)
    return cli_args(args)


# ---------------------------------------------------------------------------------------------------------------
# schedules and batching
# ---------------------------------------------------------------------------------------------------------------
def test_retention_weight_decays_40_to_0():
    vals = [retention_weight(t, 10) for t in range(11)]
    assert vals[0] == 40.0 and vals[5] == pytest.approx(20.0) and vals[10] == 0.0 and vals[3] == pytest.approx(28.0)
    assert all(a > b for a, b in zip(vals, vals[1:]))
    assert retention_weight(5, 10, shape="cosine") == pytest.approx(20.0)  # cosine passes the midpoint at T/2
    assert retention_weight(2, 10, shape="cosine") == pytest.approx(20 * (1 + math.cos(math.pi * 0.2)))
    assert retention_weight(7, 10, 40.0, 10.0, "constant") == 40.0
    assert retention_weight(12, 10) == 0.0  # past the end: the final weight


def test_length_grouped_batches_are_deterministic_complete_and_pad_less():
    rng = random.Random(0)
    lengths = [rng.randint(10, 500) for _ in range(1000)]
    s = train.LengthGroupedBatchSampler(lengths, batch_size=8, seed=3)
    b0 = s.batches()
    assert b0 == train.LengthGroupedBatchSampler(lengths, 8, seed=3).batches()  # (seed, epoch) fixes the order
    s.set_epoch(1)
    assert s.batches() != b0
    flat = [i for b in b0 for i in b]
    assert len(flat) == len(set(flat)) == 1000 and all(len(b) == 8 for b in b0) and len(s) == 125

    def eff(batches):  # real / processed, with each batch padded to its longest member
        return sum(lengths[i] for b in batches for i in b) / sum(max(lengths[i] for i in b) * len(b) for b in batches)

    plain = train.LengthGroupedBatchSampler(lengths, 8, seed=3, group_by_length=False).batches()
    assert eff(b0) > 0.95 and eff(plain) < 0.7, (eff(b0), eff(plain))


def test_groups_are_read_only_from_a_finished_selection(tiny_bert, tmp_path):
    """select_groups.py's real output: a killed run's leftover .tmp-* shard is not read, a folder without the
    stats.json that select_groups.py writes last is refused, shards added afterwards are refused by count, and a
    truncated shard is named (146ed67: datasets' DatasetGenerationError, without the file)."""
    import shutil

    import select_groups

    docs = tmp_path / "docs.jsonl"
    with open(ROOT / "data" / "docs.jsonl", encoding="utf-8") as f, open(docs, "w", encoding="utf-8") as out:
        out.writelines(line for _, line in zip(range(12), f))
    groups = tmp_path / "groups"
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir", str(groups),
                        "--centrality_threshold", "-1"])
    n = json.loads((groups / "stats.json").read_text())["groups"]
    shard = next(groups.glob("groups-*.parquet"))
    shutil.copy(shard, groups / f".tmp-123-{shard.name}")  # a killed run's half-written shard
    assert len(train.load_groups(str(groups))) == n
    shutil.copy(shard, groups / "groups-999999.parquet")
    with pytest.raises(ValueError, match="its stats.json"):
        train.load_groups(str(groups))
    (groups / "groups-999999.parquet").unlink()
    data = shard.read_bytes()  # a shard cut short (a full disk, a partial copy): named, with what to do
    shard.write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError, match=rf"--groups_dir: {re.escape(str(shard))} is not a readable parquet file "
                                        r"\(Parquet magic bytes not found in footer\): truncated"):
        train.load_groups(str(groups))
    shard.write_bytes(data)
    (groups / "stats.json").unlink()
    with pytest.raises(UserError, match="no stats.json"):
        train.load_groups(str(groups))


def test_spread_puts_one_documents_groups_into_different_batches():
    """Groups of one document have nearly equal lengths and sort next to each other; spread deals each run of
    `spread` sorted batches round-robin: 24 documents x 8 groups of equal length, batch 8, spread 8 -> no batch holds
    two groups of one document (unspread: most do), the same rows in batches of the same length ranges."""
    doc = np.repeat(np.arange(24), 8)
    lengths = 1000 + 10 * doc  # a document's groups: one length
    plain = train.LengthGroupedBatchSampler(lengths, 8, seed=3, mega=24).batch_matrix()
    spread = train.LengthGroupedBatchSampler(lengths, 8, seed=3, mega=24, spread=8).batch_matrix()
    assert sum(len(set(doc[b])) < 8 for b in plain) > len(plain) // 2
    assert all(len(set(doc[b])) == 8 for b in spread)
    assert sorted(spread.ravel().tolist()) == sorted(plain.ravel().tolist())
    # each batch spans at most `spread` batches' worth of the sorted lengths
    assert max(np.ptp(lengths[b]) for b in spread) <= 10 * 8


def write_groups(folder: Path, rows: list) -> Path:
    """select_groups.py's rows (edited by a test) written back as a finished groups folder: one shard, stats.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=group_schema()), folder / "shard-00000.parquet")
    (folder / "stats.json").write_text(json.dumps({"groups": len(rows)}))
    return folder


def test_the_same_text_under_another_doc_id_is_one_document(tiny_bert, tmp_path, capsys):
    """A groups folder where 3 groups were copied under new doc ids ("mirror-*": a page crawled twice) and one
    group of another document repeats a group's top related passage: before, each copy was an in-batch negative of
    its original (its own anchor and positive among a row's negatives). document_keys joins them: the copies and
    the repeater carry their original's key and doc id, every other group keeps np.unique's code of its own doc_id;
    the collated doc_ids (L_xp's mask) of a copy and its original are equal; train.py says how many groups it
    joined and trains."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from modeling_xprt import XPRTCollator
    from plumbing.batches import document_keys

    src = make_groups(tmp_path / "src", 24)
    table = pq.read_table(src / "shard-00000.parquet").to_pylist()
    copies = [{**table[i], "doc_id": f"mirror-{i}"} for i in (0, 2, 4)]
    other = next(i for i, r in enumerate(table) if r["doc_id"] != table[0]["doc_id"] and i > 4)
    table[other]["related"] = [table[0]["related"][0]] + table[other]["related"][1:]  # s1 of group 0, repeated
    rows_in = table + copies
    groups = write_groups(tmp_path / "groups", rows_in)
    rows = train.load_groups(str(groups))
    keys, merged = document_keys(rows)
    codes = np.unique([r["doc_id"] for r in rows_in], return_inverse=True)[1]
    joined = {24, 25, 26} | {i for i in range(24) if rows_in[i]["doc_id"] == rows_in[other]["doc_id"]}
    assert all(keys[24 + k] == keys[i] for k, i in enumerate((0, 2, 4)))
    assert keys[other] == keys[0]  # its whole document joins group 0's
    assert set(merged) == {i for i in range(len(rows_in)) if keys[i] != codes[i]} and set(merged) <= joined
    assert all(keys[i] == codes[i] for i in range(len(rows_in)) if i not in joined)
    collator = XPRTCollator(AutoTokenizer.from_pretrained(tiny_bert), num_related=2, max_length=24, seed=0)
    pair = [train.with_extras(merged, None, 0, i, rows[i]) for i in (0, 24)]
    assert collator.retention_fields(pair)["doc_ids"].unique().numel() == 1  # masked as one document
    run(base_args(tiny_bert, groups, tmp_path / "run", **{"--max_train_steps": 2, "--num_related": 2,
                                                          "--max_length": 24, "--no_save_model": True}))
    assert f"{len(merged)} groups share an anchor or positive text with a group of another doc_id" in \
        capsys.readouterr().out


def test_one_document_links_a_text_across_its_roles(tmp_path):
    """document_keys links groups over one text space for both of L_xp's roles (issue 54 item 3): group A's anchor
    copied as group B's s1 (before: anchors and s1 texts in separate sets, so B's row scored A's anchor against its
    own text as a negative), and under --positive random group A's anchor as group B's random passage. Groups sharing
    no text stay apart."""
    import pyarrow.parquet as pq

    from plumbing.batches import document_keys

    src = make_groups(tmp_path / "src", 24)
    table = pq.read_table(src / "shard-00000.parquet").to_pylist()
    a = 0
    b = next(i for i, r in enumerate(table) if r["doc_id"] != table[a]["doc_id"])
    c = next(i for i, r in enumerate(table) if r["doc_id"] not in (table[a]["doc_id"], table[b]["doc_id"]))
    table[b]["related"] = [table[a]["anchor"]] + table[b]["related"][1:]  # A's anchor as B's s1
    table[c]["random_passage"] = table[a]["anchor"]  # A's anchor as C's random passage
    rows = train.load_groups(str(write_groups(tmp_path / "groups", table)))
    keys, _ = document_keys(rows)
    assert keys[b] == keys[a] and keys[c] != keys[a]  # s1 positives: C's random passage is not read
    keys, _ = document_keys(rows, positive="random")
    assert keys[c] == keys[a]  # --positive random: its random passage is its positive
    assert (keys[b] == keys[a]) == (table[b]["random_passage"] == table[a]["anchor"])


def test_every_group_an_epoch_leaves_out_is_counted_with_its_reason(tiny_bert, groups, tmp_path, capsys):
    """24 groups at batch 5: 4 batches an epoch, the last 4 groups left out (issue 54 item 13: groups an epoch left
    out were not said, while the cap's line said 0). The start says how many each reason leaves out."""
    run(base_args(tiny_bert, groups, tmp_path / "r", **{"--max_train_steps": 1, "--per_device_train_batch_size": 5,
                                                        "--max_document_groups_per_batch": 0, "--no_save_model": True}))
    said = capsys.readouterr().out
    assert "each epoch trains 20 of 24 groups; left out: 0 over the per-document cap, 4 in the last partial batch\n" \
        in said


def test_passages_the_training_tokenizer_cuts_are_counted_and_said(tiny_bert, tmp_path, capsys):
    """Groups select_groups.py packed to 128 tokens, trained at --max_length 24: before, the collator truncated them
    without a word. Now the run counts the passages (anchor + the num_related it trains on) longer than --max_length
    under its tokenizer, as a hand count gives, and warns naming what the folder was selected with; at
    --max_length 128 (the selection's length, the same tokenizer) nothing is cut."""
    from test_select_groups import _docs, _write_jsonl
    from transformers import AutoTokenizer

    import select_groups

    docs, groups = tmp_path / "docs.jsonl", tmp_path / "groups"
    _write_jsonl(docs, _docs(12))
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir", str(groups),
                        "--centrality_threshold", "-1"])
    rows = train.load_groups(str(groups))
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    texts = [t for r in rows for t in (r["anchor"], *r["related"][:2])]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    cut_at_24 = sum(n > 24 for n in lengths)
    assert cut_at_24 > len(texts) // 2  # the case is real: most passages are longer than 24 tokens
    for max_length, cut in ((24, cut_at_24), (128, 0)):
        run(base_args(tiny_bert, groups, tmp_path / f"run{max_length}", **{
            "--max_train_steps": 1, "--num_related": 2, "--max_length": max_length, "--no_save_model": True}))
        said = capsys.readouterr().out
        assert (f"passages longer than --max_length {max_length} tokens of this tokenizer: {cut:,} of {len(texts):,} "
                in said), said
        assert ("warning: " in said.split("passages longer")[0][-10:]) == (cut > 0)
        assert f"selected with {tiny_bert}'s tokenizer at --passage_tokens 128" in said


def test_random_span_batches_are_grouped_by_their_crops(tmp_path):
    """The random-span baseline: crops drawn per (seed, epoch) before batching (sort_lengths), the sampler sorts by
    (longer crop, shorter crop) and each batch pads the longer and the shorter crops separately: padding efficiency
    of the crops well above the former grouping by text length with one tensor (0.49-0.53 in train.py's log), and the
    spans change with the epoch, which the sampler follows."""
    from transformers import AutoTokenizer

    from baselines import contriever

    rows = train.load_groups(str(make_groups(tmp_path / "g", 400)))
    tok = AutoTokenizer.from_pretrained(common.resolve_model_path("all-MiniLM-L6-v2"))
    collator = contriever.RandomSpanCollator(tok, max_length=128)
    lengths_for, row_extras = collator.sort_lengths(rows, seed=3)
    spans_for = lambda epoch: np.stack([row_extras(epoch, i)["crop_spans"] for i in range(len(rows))])  # noqa: E731
    s = train.LengthGroupedBatchSampler(lengths_for, 16, seed=3, mega=50)

    def eff(epoch):
        s.set_epoch(epoch)
        k = spans_for(epoch)[:, :, 1] + 2  # + [CLS], [SEP]
        real = proc = 0
        for b in s.batches():
            kb = k[b]
            real += kb.sum()
            proc += (kb.max(1).max() + kb.min(1).max()) * len(b)
        return real / proc

    # the former batching: grouped by the anchor's text length, both crops padded to one length
    text_len = [len(r["anchor"]) for r in rows]
    k0 = spans_for(0)[:, :, 1] + 2
    before = train.LengthGroupedBatchSampler(text_len, 16, seed=3).batches()
    eff_before = sum(k0[b].sum() for b in before) / sum(k0[b].max() * 2 * len(b) for b in before)
    # 400 short paragraphs here (one mega-batch); on the compare groups (3,631 anchors) the same code gives 0.917
    assert eff(0) >= 0.83 and eff(1) >= 0.83 and eff_before < 0.65, (eff(0), eff(1), eff_before)
    assert not (spans_for(0) == spans_for(1)).all()
    # the collator cuts exactly those crops: its tensors' real tokens are the spans' lengths
    b0 = s.batches()[0]
    batch = collator([{**rows[i], "crop_spans": spans_for(1)[i]} for i in b0])
    k = spans_for(1)[b0][:, :, 1] + 2
    assert batch["attention_mask"].sum(1).tolist() == k.max(1).tolist()
    assert batch["short_attention_mask"].sum(1).tolist() == k.min(1).tolist()


def test_contriever_batches_are_grouped_by_their_crops(tmp_path):
    """Contriever's crops, drawn per (seed, epoch) before batching (sort_lengths: random_crop's int(n r)), the sampler
    sorting by (q crop, k crop): each view's tensor pads to its own longest, and the batches' real tokens are about
    twice those of batches of unsorted crops (the official batching: 52% real tokens in the 2026-12-04 GPU run); the
    collator cuts exactly those spans (deletion off here), in view order."""
    from transformers import AutoTokenizer

    from baselines import contriever

    rows = train.load_groups(str(make_groups(tmp_path / "g", 400)))
    tok = AutoTokenizer.from_pretrained(common.resolve_model_path("all-MiniLM-L6-v2"))
    collator = contriever.ContrieverCollator(tok, max_length=128, delete_prob=0.0)
    lengths_for, row_extras = collator.sort_lengths(rows, seed=3)
    spans_for = lambda epoch: np.stack([row_extras(epoch, i)["crop_spans"] for i in range(len(rows))])  # noqa: E731
    s = train.LengthGroupedBatchSampler(lengths_for, 16, seed=3, mega=50)

    def eff(batches, k):  # both views, each padded to its own longest
        return sum(k[b].sum() for b in batches) / sum((k[b, 0].max() + k[b, 1].max()) * len(b) for b in batches)

    k1 = spans_for(1)[:, :, 1] + 2  # + [CLS], [SEP]
    s.set_epoch(1)
    grouped = eff(s.batches(), k1)
    shuffled = eff(train.LengthGroupedBatchSampler([1] * len(rows), 16, seed=3, group_by_length=False).batches(), k1)
    # 400 short paragraphs of many lengths, batches of 16: 0.73 against 0.38 (at the GPU run's 256 groups a batch
    # and ~60-token anchors the same sampler gives about 0.90 against 0.58, a simulation of the draws)
    assert grouped >= 0.7 and grouped > 1.8 * shuffled, (grouped, shuffled)
    assert (lengths_for(1) == spans_for(1)[:, :, 1]).all() and not (spans_for(0) == spans_for(1)).all()
    k = contriever.crop_spans([37] * 2000, seed=0, epoch=0, floor=True)[:, :, 1]
    assert k.min() == 3 and k.max() == 18  # int(3.7) .. int(18.5): random_crop's floor
    b0 = s.batches()[0]
    batch = collator([{**rows[i], "crop_spans": spans_for(1)[i]} for i in b0])
    assert batch["q_attention_mask"].sum(1).tolist() == k1[b0, 0].tolist()
    assert batch["k_attention_mask"].sum(1).tolist() == k1[b0, 1].tolist()
    body = collator.crop_token_ids([rows[int(b0[0])]["anchor"]])[0]
    start, length = spans_for(1)[b0[0], 0]
    assert batch["q_input_ids"][0, 1:1 + length].tolist() == body[start:start + length]


def former_list_batches(lengths, batch_size, seed, epoch, group_by_length=True, mega=50):
    """The sampler as it was written first (lists, Python's sorted): the reference of the numpy version."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if group_by_length:
        span = batch_size * mega
        order = [i for s in range(0, len(order), span) for i in sorted(order[s:s + span], key=lambda i: -lengths[i])]
    out = [order[s:s + batch_size] for s in range(0, len(order) - batch_size + 1, batch_size)]
    rng.shuffle(out)
    return out


def test_length_grouped_batches_equal_the_former_list_version():
    """Same (seed, epoch), same batches as the list-based sampler, from a list or a numpy array of lengths (ties
    in length included: the sort is stable in both), so earlier runs resume and reproduce."""
    import numpy as np

    rng = random.Random(1)
    for n, bs in ((1000, 8), (1003, 7), (57, 4), (5000, 32)):
        lengths = [rng.randint(1, 30) for _ in range(n)]  # many equal lengths
        for seed, epoch, group in ((0, 0, True), (3, 2, True), (3, 1, False)):
            want = former_list_batches(lengths, bs, seed, epoch, group)
            for lens in (lengths, np.array(lengths, dtype=np.int32)):
                s = train.LengthGroupedBatchSampler(lens, bs, seed, group_by_length=group)
                s.set_epoch(epoch)
                assert s.batches() == want and list(s) == want, (n, bs, seed, epoch, group)


def test_groups_stay_memory_mapped_and_their_lengths_match_the_rows(groups, tmp_path):
    """load_groups returns the datasets.Dataset (Arrow, memory-mapped), RowsDataset hands out its rows as the
    former list of dicts did, and group_lengths (pyarrow, batched) gives the per-row Python lengths, code points
    included, for any num_related and batch size."""
    import shutil

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "g"
    shutil.copytree(groups, folder)
    extra = pq.read_table(folder / "shard-00000.parquet").to_pylist()[:3]
    extra[0]["anchor"] = "héllo wörld 日本語 🙂 " * 3
    extra[1]["related"] = ["ä", "b"]  # fewer related passages than asked for
    pq.write_table(pa.Table.from_pylist(extra, schema=group_schema()), folder / "shard-00001.parquet")
    (folder / "stats.json").write_text(json.dumps({"groups": 27}))
    ds = train.load_groups(str(folder))
    rows = pq.read_table(folder / "shard-00000.parquet").to_pylist() + extra
    assert isinstance(ds, datasets.Dataset) and len(ds) == 27 and ds.cache_files  # backed by an Arrow file
    dataset = batches.RowsDataset(ds)
    assert [dataset[i] for i in range(27)] == list(enumerate(rows))
    for num_related, batch_size in ((4, 8192), (2, 5), (6, 1)):
        want = [len(r["anchor"]) + sum(len(t) for t in r["related"][:num_related]) for r in rows]
        assert group_lengths(ds, num_related, batch_size).tolist() == want
    first5 = [len(r["anchor"]) + sum(len(t) for t in r["related"][:2]) for r in rows[:5]]
    assert group_lengths(train.load_groups(str(folder), max_groups=5), 2).tolist() == first5


def test_padding_efficiency_counts_every_attention_mask():
    batch = {"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
             "decoder_attention_mask": torch.tensor([[1, 1, 1, 1]]), "input_ids": torch.zeros(2, 3)}
    assert batches.padding_efficiency(batch) == (7, 10)


def test_flags_fail_early():
    with pytest.raises(UserError):
        train.parse_args(["--output_dir", "x"])  # pretrain without groups
    with pytest.raises(UserError):
        train.parse_args(["--output_dir", "x", "--groups_dir", "g", "--encoder_mask_rate", "1.5"])
    a = train.parse_args(["--output_dir", "x", "--groups_dir", "g"])
    assert a.learning_rate == 1e-6 and a.model_name_or_path == "intfloat/e5-base-unsupervised"
    assert a.retention_weight == 40.0 and a.retention_final_weight == 0.0


# ---------------------------------------------------------------------------------------------------------------
# every objective and ablation trains: its loss falls on a repeated batch
# ---------------------------------------------------------------------------------------------------------------
OBJECTIVE_RUNS = {
    "xprt": {},
    "contrastive_random_span": {"--objective": "contrastive_random_span"},
    "self_reconstruction": {"--objective": "self_reconstruction"},
    "no_fill_in": {"--no_fill_in": True},
    "positive_random": {"--positive": "random"},
}
EXPECTED_TERMS = {
    "xprt": {"xp_loss", "cross_fill_loss", "self_fill_loss", "mlm_loss", "uniformity_loss", "retention_loss"},
    "contrastive_random_span": {"contrastive_loss", "retention_loss"},
    "self_reconstruction": {"recon_loss", "mlm_loss", "retention_loss"},
    "no_fill_in": {"xp_loss", "self_fill_loss", "mlm_loss", "uniformity_loss", "retention_loss"},
    "positive_random": {"xp_loss", "cross_fill_loss", "self_fill_loss", "mlm_loss", "uniformity_loss",
                        "retention_loss"},
}


@pytest.mark.parametrize("name", [n if n == "xprt" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in OBJECTIVE_RUNS])
def test_every_objective_and_ablation_loss_falls_on_a_repeated_batch(name, tiny_bert, groups, tmp_path):
    """4 groups = one batch, seen 10 times (fresh masks / crops each time), with the retention term on (constant
    weight 1 so that the decay of the weight cannot make the total fall by itself). 2 related passages per group
    keep it fast (the 4-related xprt path runs in the other tests)."""
    out = tmp_path / name
    # two fresh random crops of 4 anchors per step make the contrastive loss swing by 2x from step to step: that
    # baseline gets more steps to show its trend
    steps = 24 if name == "contrastive_random_span" else 10
    argv = base_args(tiny_bert, groups, out, **{"--max_groups": 4, "--max_train_steps": steps, "--learning_rate": 2e-3,
                                               "--num_related": 2, "--max_length": 24,
                                               "--lr_scheduler_type": "constant", "--warmup_ratio": 0.0,
                                               "--retention_weight": 1.0, "--retention_schedule": "constant",
                                               "--no_save_model": True}, **OBJECTIVE_RUNS[name])
    res = run(argv)
    assert res["completed_steps"] == steps
    log = read_log(out)
    terms = {k for k in log[1] if k.endswith("_loss")}
    assert terms == EXPECTED_TERMS[name]
    first = sum(log[s]["loss"] for s in (1, 2, 3)) / 3
    last = sum(log[s]["loss"] for s in (steps - 2, steps - 1, steps)) / 3
    assert last < first - 0.05 * abs(first), (name, first, last)
    assert all(math.isfinite(log[s][k]) for s in log for k in terms)


# ---------------------------------------------------------------------------------------------------------------
# collation off the step: a batch is a pure function of its rows and (seed, epoch, batch, process)
# ---------------------------------------------------------------------------------------------------------------
def _loader_batches(tok, groups, workers, process=0, epoch=0, pad_to_multiple_of=1):
    from types import SimpleNamespace

    from modeling_xprt import XPRTCollator

    rows = train.load_groups(str(groups))
    sampler = batches.LengthGroupedBatchSampler(group_lengths(rows, 2), 4, seed=3)
    sampler.set_epoch(epoch)
    args = SimpleNamespace(dataloader_num_workers=workers, seed=3)
    accelerator = SimpleNamespace(process_index=process, device=torch.device("cpu"))
    loader = batches.training_loader(accelerator, args, rows, sampler,
                                     XPRTCollator(tok, num_related=2, pad_to_multiple_of=pad_to_multiple_of))
    return [{k: v for k, v in b.items() if torch.is_tensor(v)} for b in loader]


def test_max_length_past_the_position_table_is_refused_with_the_length_that_fits(groups, tmp_path):
    """A start whose position table holds 40 positions, at --max_length 128: refused before any work, naming the
    --max_length that fits (40 - 2 special tokens - xPRT's 4 conditioning vectors = 34); at 34 a step runs
    (146ed67: "The expanded size of the tensor (130) must match the existing size (64)" inside the first step)."""
    from conftest import build_tiny_bert

    short = tmp_path / "short"
    build_tiny_bert(short, max_position_embeddings=40)
    with pytest.raises(UserError, match=r"--max_length 128: .* takes inputs of at most 40 positions, and a step "
                                        r"needs 134 .*: pass --max_length 34 or less"):
        run(base_args(short, groups, tmp_path / "a", **{"--max_length": 128, "--max_train_steps": 1}))
    run(base_args(short, groups, tmp_path / "b", **{"--max_length": 34, "--max_train_steps": 1,
                                                    "--no_save_model": True}))
    assert [r["step"] for r in _records(tmp_path / "b") if "loss" in r] == [1]


def test_a_start_served_shorter_than_it_is_trained_is_said(groups, tmp_path, capsys):
    """A start whose folder states max_seq_length 16 (sentence-transformers' sentence_bert_config.json), trained at
    --max_length 32: the run says so at the start (146ed67 said nothing)."""
    from conftest import build_tiny_bert

    served = build_tiny_bert(tmp_path / "served")
    (served / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    run(base_args(served, groups, tmp_path / "run", **{"--max_length": 32, "--max_train_steps": 1,
                                                       "--no_save_model": True}))
    assert (f"note: {served} is used at 16 tokens (the length its folder states, which the saved folder keeps), and "
            "trained here on inputs of up to 34 (--max_length 32)") in capsys.readouterr().out


def test_one_group_per_device_trains(tiny_bert, groups, tmp_path):
    """--per_device_train_batch_size 1 (on one process: no in-batch negative, the log says so): L_unif has no pair
    and is 0, the other terms are finite, and the run finishes (146ed67: "math domain error" at step 1)."""
    out = tmp_path / "one"
    run(base_args(tiny_bert, groups, out, **{"--per_device_train_batch_size": 1, "--max_train_steps": 2,
                                             "--no_save_model": True}))
    recs = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["uniformity_loss"] == 0.0 and math.isfinite(r["loss"]) for r in recs)


def test_collation_in_workers_gives_the_loops_batches(tiny_bert, groups):
    """The DataLoader's workers build the batches the loop's own process builds (masks from the batch's key, not
    from a generator that runs on); another process draws other masks for the same rows, and the same key the same
    ones; another epoch seeds otherwise."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    here, workers = _loader_batches(tok, groups, 0), _loader_batches(tok, groups, 2)
    assert len(here) == 6 and all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                                  for a, b in zip(here, workers))
    other = _loader_batches(tok, groups, 0, process=1)
    assert all(torch.equal(a["retain_input_ids"], b["retain_input_ids"]) for a, b in zip(here, other))  # same rows
    assert not any(torch.equal(a["mlm_labels"], b["mlm_labels"]) for a, b in zip(here, other))  # other masks
    assert torch.equal(other[2]["input_ids"], _loader_batches(tok, groups, 2, process=1)[2]["input_ids"])
    # the key's parts each seed: the same rows as batch 1 of epoch 0 and as batch 0 of epoch 1 draw other masks
    from modeling_xprt import XPRTCollator

    rows = list(train.load_groups(str(groups)).select(range(4)))
    collate = batches.SeededCollate(XPRTCollator(tok, num_related=2), seed=3, process=0)
    a, b, c = (collate([((e, n, i), r) for i, r in enumerate(rows)]) for e, n in [(0, 1), (0, 1), (1, 0)])
    assert torch.equal(a["mlm_labels"], b["mlm_labels"]) and not torch.equal(a["mlm_labels"], c["mlm_labels"])


def test_flop_counter_equals_the_hand_count(tiny_bert, tmp_path):
    """run_log.flop_counter (torch's FlopCounterMode, run on the real step) against run_log.step_flops (the hand
    formula: per token and layer 4 h^2 + 2 h I weights + 2 L h attention, the MLM head per predicted row, backward
    twice the forward, teacher forward only). A plain BERT forward + backward (eager attention): equal to the FLOP.
    Every objective's step (retention on): the counter is the hand count plus what the formula leaves out, the
    similarity matrices and the attention scores that SDPA's backward recomputes, under 2% here (a 32-wide model
    at 14 tokens, where attention weighs most)."""
    from test_baselines import build_tiny_generator
    from test_modeling import make_model, toy_rows
    from transformers import AutoTokenizer, BertConfig, BertModel

    from plumbing.model_folder import load_teacher

    h, inner, n_layers = 32, 64, 2
    cfg = BertConfig(vocab_size=100, hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=2,
                     intermediate_size=inner, attn_implementation="eager")
    bert = BertModel(cfg, add_pooling_layer=False)
    ids = torch.randint(100, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # padding is computed, and counted
    with run_log.flop_counter() as counter:
        bert(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    tokens, length = ids.numel(), ids.shape[1]
    hand = 2 * 3 * n_layers * tokens * (4 * h * h + 2 * h * inner + 2 * length * h)
    assert counter.get_total_flops() == hand == 3_179_520

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    teacher = load_teacher(str(tiny_bert))
    ratios = {}
    for objective in train.pretraining_objectives():
        options = {}
        if objective == "simlm":
            options["generator_name_or_path"] = str(build_tiny_generator(tmp_path / "generator"))
        if objective == "revela":
            from test_revela import build_tiny_lm

            options["lm_name_or_path"] = build_tiny_lm(tmp_path / "lm", tiny_bert)
        model = make_model(tiny_bert, objective=objective, **options)
        collator = model.objective.make_collator(tok, max_length=24)
        rows = toy_rows(5, docs=[0, 0, 1, 2, 3])
        if objective == "contrastive_random_span":  # its crops come with the rows (sort_lengths)
            import datasets

            _, extras = collator.sort_lengths(datasets.Dataset.from_list(rows), 0)
            rows = [{**r, **extras(0, i)} for i, r in enumerate(rows)]
        batch = collator(rows)
        with run_log.flop_counter() as counter:
            model(batch, teacher=teacher, retention_weight=40.0)["loss"].backward()
        ratios[objective] = counter.get_total_flops() / run_log.step_flops(model, batch, retention=True)
    print("counted / hand:", {k: round(v, 4) for k, v in ratios.items()})
    # Revela's hand count (revela.Revela.multiply_adds) is 1.093 of torch's here, at a toy LM (hidden 32 under LoRA
    # rank 256): not yet reconciled, so bounded as measured rather than at the others' 2%
    revela = ratios.pop("revela", None)
    assert revela is None or 1.0 <= revela < 1.10, revela
    assert all(1.0 <= r < 1.02 for r in ratios.values()), ratios


# ---------------------------------------------------------------------------------------------------------------
# resume: stop at step k, resume, and the losses from k on equal an uninterrupted run's
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(tiny_bert, groups, tmp_path, workers):
    """24 groups, batch 4, accumulation 2 -> 3 steps per epoch; 7 steps cross two epoch boundaries. Run B stops
    at step 4 (mid-epoch 2, after checkpoints at 2 and 4) and resumes from 'latest'. Dropout, masks, data order,
    optimiser moments, lr and the retention weight must all continue exactly. Run A collates in the loop's process,
    run B in `workers` DataLoader workers: the batches are the same (batches.SeededCollate)."""
    common = {"--max_train_steps": 7, "--gradient_accumulation_steps": 2, "--learning_rate": 1e-3,
              "--num_related": 2, "--max_length": 24,
              "--warmup_ratio": 0.3, "--checkpointing_steps": 2, "--checkpoints_total_limit": 2}
    run(base_args(tiny_bert, groups, tmp_path / "a", **common))
    common["--dataloader_num_workers"] = workers
    r1 = run(base_args(tiny_bert, groups, tmp_path / "b", **common, **{"--stop_after_steps": 4}))
    assert r1["completed_steps"] == 4 and not (tmp_path / "b" / "model").exists()
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4"]
    r2 = run(base_args(tiny_bert, groups, tmp_path / "b", **common, **{"--resume_from_checkpoint": "latest"}))
    assert r2["completed_steps"] == 7
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    assert sorted(b) == list(range(1, 8))
    keys = [k for k in a[1] if k.endswith("_loss") or k in ("loss", "lr", "retention_weight")]
    for s in range(1, 8):
        for k in keys:
            assert a[s][k] == pytest.approx(b[s][k], rel=1e-5, abs=1e-6), (s, k, a[s][k], b[s][k])
    assert a[5]["loss"] != a[4]["loss"]  # the steps after k differ from each other: the comparison has teeth
    # and the final weights agree
    from safetensors.torch import load_file

    wa, wb = (load_file(tmp_path / "a" / "model" / "model.safetensors"),
              load_file(tmp_path / "b" / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    # rotation kept the last two: step_4 and step_6
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_4", "step_6"]


def test_a_resumed_runs_records_average_the_steps_the_uninterrupted_runs_do(tiny_bert, groups, tmp_path):
    """Every log record says how many optimiser steps it averages ("steps"). Logging every 3 steps, a run resumed
    from its step-4 checkpoint (a step it did not log: as a SIGTERM's mid-window checkpoint) logs step 6 over steps
    4-6 as the uninterrupted run does: the checkpoint carries the open log window's sums (TrainState ->
    LogWindow.state_dict), not only the model and the data position (issue 54 item 4)."""
    common = {"--max_train_steps": 7, "--num_related": 2, "--max_length": 24, "--learning_rate": 1e-3,
              "--logging_steps": 3, "--checkpointing_steps": 2}
    run(base_args(tiny_bert, groups, tmp_path / "a", **common))
    run(base_args(tiny_bert, groups, tmp_path / "b", **common, **{"--stop_after_steps": 5}))
    assert sorted(read_log(tmp_path / "b")) == [3, 5]  # stopped after step 5; its last checkpoint is step 4's
    run(base_args(tiny_bert, groups, tmp_path / "b", **common, **{"--resume_from_checkpoint": "latest"}))
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    assert sorted(a) == [3, 6, 7] and [a[s]["steps"] for s in (3, 6, 7)] == [3, 3, 1]
    assert sorted(b) == [3, 6, 7]  # the log cut back to the checkpoint's step, then continued
    for s in (6, 7):
        assert b[s]["steps"] == a[s]["steps"]
        for k in (k for k in a[s] if k.endswith("loss")):
            assert b[s][k] == pytest.approx(a[s][k], rel=1e-6, abs=1e-7), (s, k)


@pytest.mark.slow
def test_existing_output_is_refused_without_overwrite(tiny_bert, groups, tmp_path):
    argv = base_args(tiny_bert, groups, tmp_path / "o", **{"--max_train_steps": 1, "--max_groups": 4})
    run(argv)
    with pytest.raises(UserError, match="--overwrite"):
        run(argv)
    run(argv + ["--overwrite"])
    assert (tmp_path / "o" / "model" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------
# non-finite losses
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def nan_at_step_3(monkeypatch):
    """Make the model's cross_fill_loss (and so the total) NaN on the 3rd forward call."""
    import modeling_xprt

    orig = modeling_xprt.XPRTModel.forward
    calls = {"n": 0}

    def forward(self, batch, **kw):
        out = orig(self, batch, **kw)
        calls["n"] += 1
        if calls["n"] == 3:
            out["cross_fill_loss"] = out["cross_fill_loss"] * float("nan")
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(modeling_xprt.XPRTModel, "forward", forward)


def test_nonfinite_loss_stops_naming_step_and_term_and_writes_no_model(nan_at_step_3, tiny_bert, groups, tmp_path):
    argv = base_args(tiny_bert, groups, tmp_path / "n", **{"--max_train_steps": 5, "--max_groups": 8})
    with pytest.raises(FloatingPointError, match=r"step 3 .*cross_fill_loss"):
        run(argv)
    assert not (tmp_path / "n" / "model").exists()


@pytest.mark.slow
def test_nonfinite_loss_can_be_skipped(nan_at_step_3, tiny_bert, groups, tmp_path):
    out = tmp_path / "s"
    res = run(base_args(tiny_bert, groups, out, **{"--max_train_steps": 5, "--max_groups": 8,
                                                   "--on_nonfinite": "skip"}))
    assert res["completed_steps"] == 5
    log = read_log(out)
    assert "loss" not in log[3] and log[3]["skipped_nonfinite_micro_batches"] == 1
    assert all(math.isfinite(log[s]["loss"]) for s in (1, 2, 4, 5))
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(out / "model" / "model.safetensors").values())


# ---------------------------------------------------------------------------------------------------------------
# output: loadable by sentence-transformers with the same embeddings as our encoder; logs and PNG
# ---------------------------------------------------------------------------------------------------------------
def test_saved_model_loads_in_sentence_transformers_with_our_embeddings(tiny_bert, groups, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from modeling_xprt import XPRTModel
    from plumbing.embed import embed_texts

    out = tmp_path / "m"
    run(base_args(tiny_bert, groups, out, **{"--max_train_steps": 3, "--max_groups": 8, "--learning_rate": 1e-3,
                                            "--report_to": "tensorboard"}))
    texts = ["Dense retrieval maps passages to vectors.", "A short one.", "The cat sat on the mat, again and again."]
    st = torch.from_numpy(SentenceTransformer(str(out / "model"), device="cpu").encode(texts))
    tok = AutoTokenizer.from_pretrained(out / "model")
    ours = embed_texts(AutoModel.from_pretrained(out / "model"), tok, texts)
    assert torch.allclose(st, ours, atol=1e-5)
    # the weights really moved from the start, and the heads came back with from_pretrained
    start = embed_texts(AutoModel.from_pretrained(tiny_bert), tok, texts)
    assert not torch.allclose(start, ours, atol=1e-4)
    again = load_xprt_folder(XPRTModel, str(out / "model"))
    assert torch.allclose(embed_texts(again.encoder, tok, texts), ours, atol=1e-6)
    card = (out / "model" / "README.md").read_text()
    assert '"max_train_steps": 3' in card and '"objective": "xprt"' in card
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert list((out / "logs").rglob("events.out.tfevents*"))  # tensorboard
    log = read_log(out)
    for key in ("lr", "retention_weight", "tokens_per_s", "padding_efficiency", "xp_loss", "retention_loss"):
        assert key in log[3]
    # --retention_final_weight is w(T): step t (0 .. T-1) trains with w(t), so the last of 3 logs w(2)
    assert [log[s]["retention_weight"] for s in (1, 2, 3)] == pytest.approx([40, 80 / 3, 40 / 3])
    assert 0 < log[3]["padding_efficiency"] <= 1


def test_head_learning_rate_groups_every_parameter_once(tiny_bert):
    """--head_learning_rate: the decoder and the MLM head's transform and bias get it; the encoder, and the tied
    vocabulary projection (the word embeddings themselves), keep --learning_rate; biases and LayerNorm weights are
    not decayed; every trainable tensor is in exactly one group."""
    from modeling_xprt import XPRTModel
    from plumbing.model_folder import load_mlm_encoder

    model = XPRTModel(load_mlm_encoder(str(tiny_bert))[0])
    groups = training.optimizer_groups(model, learning_rate=1e-6, head_learning_rate=1e-4, weight_decay=0.01)
    where = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    assert sum(len(g["params"]) for g in groups) == len(where) == len(list(model.parameters()))
    named = dict(model.named_parameters())
    assert where[id(named["encoder.bert.embeddings.word_embeddings.weight"])] == (1e-6, 0.01)
    assert model.encoder.get_output_embeddings().weight is named["encoder.bert.embeddings.word_embeddings.weight"]
    assert where[id(named["encoder.bert.encoder.layer.0.attention.self.query.bias"])] == (1e-6, 0.0)
    assert where[id(named["objective.decoder.condition.weight"])] == (1e-4, 0.01)
    assert where[id(named["objective.decoder.layers.0.output.LayerNorm.weight"])] == (1e-4, 0.0)
    assert where[id(named["encoder.cls.predictions.transform.dense.weight"])] == (1e-4, 0.01)
    assert where[id(named["encoder.cls.predictions.bias"])] == (1e-4, 0.0)
    # default: one lr for all, as in the paper
    same = training.optimizer_groups(model, learning_rate=1e-6, head_learning_rate=None, weight_decay=0.01)
    assert {g["lr"] for g in same} == {1e-6}


def test_head_learning_rate_trains_the_heads_and_not_the_encoder(tiny_bert, groups, tmp_path):
    """--learning_rate 0 --head_learning_rate 1e-2: after 3 steps the encoder (and the tied projection) is
    bit-identical to the start, the MLM head transform has moved, and the log records both lrs."""
    from transformers import AutoModelForMaskedLM

    from modeling_xprt import XPRTModel

    out = tmp_path / "heads"
    run(base_args(tiny_bert, groups, out, **{"--max_train_steps": 3, "--max_groups": 8, "--learning_rate": 0.0,
                                            "--max_document_groups_per_batch": 0,
                                            "--head_learning_rate": 1e-2, "--warmup_ratio": 0.0,
                                            "--lr_scheduler_type": "constant"}))
    start = AutoModelForMaskedLM.from_pretrained(tiny_bert)
    after = load_xprt_folder(XPRTModel, str(out / "model")).encoder
    for (n, p), q in zip(start.bert.named_parameters(), after.bert.parameters()):
        assert torch.equal(p, q), n
    moved = after.cls.predictions.transform.dense.weight - start.cls.predictions.transform.dense.weight
    assert moved.abs().max() > 1e-3
    log = read_log(out)
    assert log[3]["lr"] == 0.0 and log[3]["head_lr"] == pytest.approx(1e-2)




# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2 under accelerate launch, one CPU process
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_accelerate_launch_deepspeed_one_cpu_process(tiny_bert, groups, tmp_path, stage):
    """ZeRO-2 and ZeRO-3 on one CPU process compute what the plain loop does. ZeRO-3 partitions every model that
    transformers loads: the frozen teacher must be loaded whole, and the tied projection read outside its module
    must be gathered (registered as an external parameter), or the run fails or trains on empty shards."""
    out = tmp_path / "ds"
    beir, _ = _eval_folders(tmp_path)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / f"accelerate_cpu_deepspeed_{stage}.yaml"), str(ROOT / "train.py")]
    cmd += [str(a) for a in base_args(tiny_bert, groups, out, **{"--max_train_steps": 3, "--max_groups": 8,
                                                                   "--learning_rate": 1e-3, "--checkpointing_steps": 3,
                                                                   "--eval_tasks": f"SciFact={beir}"})]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "DistributedType.DEEPSPEED x 1" in proc.stdout + proc.stderr  # really DeepSpeed, not a silent fallback
    # the final model scored inside the DeepSpeed engine (ZeRO-3: gathered weights) = evaluate.py on the saved folder
    import evaluate

    start, scored = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()
                     if "eval_SciFact" in line]
    assert (start["step"], scored["step"]) == (0, 3)  # the start, then the final model
    final = evaluate.run_evaluation([str(out / "model")], local_tasks=[f"SciFact={beir}"], show_progress=False)
    assert scored["eval_SciFact"] == pytest.approx(final["results"][str(out / "model")]["SciFact"]["main_score"],
                                                   abs=1e-4)
    log = {r["step"]: r for r in _records(out) if "loss" in r}  # the loss records (the score record is apart)
    assert sorted(log) == [1, 2, 3]
    assert (out / "checkpoints" / "step_3" / "pytorch_model").is_dir()  # a DeepSpeed engine checkpoint
    assert (out / "model" / "model.safetensors").exists()
    # DeepSpeed on one process computes what the plain loop does
    plain = tmp_path / "plain"
    run(base_args(tiny_bert, groups, plain, **{"--max_train_steps": 3, "--max_groups": 8, "--learning_rate": 1e-3,
                                                "--no_save_model": True}))
    ref = read_log(plain)
    for s in (1, 2, 3):
        assert log[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-4), s


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_retention_is_zero_at_step_0_under_deepspeed_bf16(tiny_bert, groups, tmp_path, stage):
    """DeepSpeed bf16 casts the student's weights to bf16; the frozen teacher is cast to the same dtype
    (training.engine_dtype), so at step 0 the clean student pass and the teacher are one computation and the retention
    term is exactly 0 (with an fp32 teacher it was 3.1e-7 on MiniLM, x40 in the loss)."""
    out = tmp_path / "dsbf16"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / f"accelerate_cpu_deepspeed_{stage}.yaml"), str(ROOT / "train.py")]
    cmd += [str(a) for a in base_args(tiny_bert, groups, out, **{"--max_train_steps": 1, "--max_groups": 8,
                                                                   "--mixed_precision": "bf16",
                                                                   "--no_save_model": True})]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "DistributedType.DEEPSPEED x 1, mixed precision bf16" in proc.stdout + proc.stderr
    # the start-up lines name the paths a GPU would take differently (tests/test_device_paths.py)
    assert "vocabulary weight gradient: one bf16 product per chunk" in proc.stdout + proc.stderr
    assert "AdamW: torch default kernel" in proc.stdout + proc.stderr
    (rec,) = [r for r in _records(out) if "loss" in r]
    assert rec["retention_loss"] == 0.0 and math.isfinite(rec["loss"])


@pytest.mark.slow
def test_two_process_run_resumes_exactly(tiny_bert, groups, tmp_path):
    """torchrun with 2 CPU processes (gloo): accelerate must form a MULTI_CPU group (train.py passes cpu=True when
    there is no GPU), negatives are gathered across both, and each process's masks follow from (seed, epoch, batch,
    process), so a stop at step 2 + resume equals the uninterrupted 4-step run."""
    def launch(out, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "train.py")]
        cmd += [str(a) for a in base_args(tiny_bert, groups, out, **{"--max_train_steps": 4, "--num_related": 2,
                                                                       "--max_length": 24, "--learning_rate": 1e-3,
                                                                       "--checkpointing_steps": 2,
                                                                       "--no_save_model": True})]
        proc = subprocess.run(cmd + list(extra), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout + proc.stderr

    text = launch(tmp_path / "a")
    assert "MULTI_CPU x 2" in text and "in-batch negatives per row = 7" in text
    launch(tmp_path / "b", "--stop_after_steps", "2")
    assert "resumed from" in launch(tmp_path / "b", "--resume_from_checkpoint", "latest")
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    for s in (3, 4):
        for k in ("loss", "xp_loss", "cross_fill_loss", "retention_loss"):
            assert a[s][k] == pytest.approx(b[s][k], rel=1e-5), (s, k)


@pytest.mark.slow
def test_accelerate_launch_of_two_processes_that_start_one_is_said(tiny_bert, groups, tmp_path):
    """Issue 54 item 13: `accelerate launch --num_processes 2` on a machine without GPUs starts one process and says
    nothing; train.py reads the launcher's command line (training.launcher_processes) and says it, naming torchrun."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", str(ROOT / "train.py")]
    toy = {"--max_train_steps": 1, "--num_related": 2, "--max_length": 24, "--no_save_model": True}
    cmd += [str(a) for a in base_args(tiny_bert, groups, tmp_path / "run", **toy)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("warning: `accelerate launch --num_processes 2` started 1 process(es) on this machine (cpu"
            in proc.stdout + proc.stderr)
    assert "torchrun --nproc_per_node 2" in proc.stdout + proc.stderr


def test_no_host_reads_outside_logging_steps(tiny_bert, groups, tmp_path, monkeypatch):
    """The loop reads nothing back from the device between logging steps: loss terms, token counts and the
    non-finite watch stay on the device (LogWindow); the repository's `.item()` / `.tolist()` calls run only inside
    the logging-step check and record. (Boolean-mask gathers inside the model's forward are device syncs too; they
    are not counted here.)"""
    calls = {"outside": [], "inside": 0}
    where = {"loop": False, "log": False}
    orig_item, orig_tolist = torch.Tensor.item, torch.Tensor.tolist

    ours = {str(p) for d in (ROOT, ROOT / "plumbing") for p in d.glob("*.py")}  # the scripts and the plumbing

    def counted(orig):
        def f(self, *a, **kw):
            caller = sys._getframe(1).f_code  # reads by the repository's code (torch's CPU-side ones are no syncs)
            if where["loop"] and caller.co_filename in ours:
                if where["log"]:
                    calls["inside"] += 1
                else:
                    calls["outside"].append(f"{caller.co_filename}:{caller.co_name}")
            return orig(self, *a, **kw)
        return f

    def flagged(orig, flag, value):
        def f(*a, **kw):
            where[flag] = value
            try:
                return orig(*a, **kw)
            finally:
                where[flag] = not value if flag == "log" else where[flag]
        return f

    import modeling_xprt

    orig_forward = modeling_xprt.XPRTModel.forward

    def forward(self, *a, **kw):
        where["loop"] = True
        return orig_forward(self, *a, **kw)

    monkeypatch.setattr(modeling_xprt.XPRTModel, "forward", forward)
    monkeypatch.setattr(run_log.LogWindow, "record", flagged(run_log.LogWindow.record, "log", True))
    monkeypatch.setattr(run_log.LogWindow, "check_finite", flagged(run_log.LogWindow.check_finite, "log", True))
    monkeypatch.setattr(training, "plot_loss_curves", flagged(run_log.plot_loss_curves, "loop", False))
    monkeypatch.setattr(torch.Tensor, "item", counted(orig_item))
    monkeypatch.setattr(torch.Tensor, "tolist", counted(orig_tolist))
    res = run(base_args(tiny_bert, groups, tmp_path / "h", **{"--max_train_steps": 6, "--max_groups": 8,
                                                               "--logging_steps": 3, "--no_save_model": True}))
    assert res["completed_steps"] == 6
    # the collator's reads are of the CPU tensors it builds before batch_to_device (where each group's rows start in
    # the flat index tensors, Layout): no device sync
    collating = {f"{ROOT / 'modeling_xprt.py'}:group_bounds"}
    assert [c for c in calls["outside"] if c not in collating] == [], calls["outside"][:3]
    assert calls["inside"] == 2 * 2  # two logging steps, one read-back each in check_finite and record


# Every device-to-host sync left in one xPRT training step between logging steps (forward, backward, clipping,
# optimiser step, lr schedule), by call site -> why it stays. On a GPU each would stall the pipeline.
ALLOWED_SYNCS = {
    # transformers decides, per attention-mask build, whether the padding mask may be dropped (`padding_mask.all()`:
    # no padding -> SDPA without a mask, the faster kernel): one read per encoder, decoder and teacher call, 3 per
    # xPRT step (4 with --retention_student clean). Avoiding it means building the 4-d masks ourselves, outside
    # transformers; kept HF-native.
    "transformers/masking_utils.py:_ignore_bidirectional_mask_sdpa": "transformers: may the padding mask be dropped?",
    # AdamW reads its step counter, a CPU tensor (capturable=False, the default): no device sync.
    "optim/optimizer.py:_get_value": "AdamW's CPU step counter: no device sync",
}


def test_host_syncs_in_a_training_step_are_the_listed_ones(tiny_bert, groups, tmp_path, monkeypatch):
    """Counts, during a few xPRT steps with the teacher and every term, each call that reads a tensor back to the
    host or has a data-dependent shape (Tensor.item / tolist / __bool__ / __int__ / __float__, nonzero, boolean-mask
    indexing, masked_select) from the start of the model's forward to the end of the step (optimiser and lr
    schedule), outside logging steps; the collator's (CPU tensors, before the batch moves to the device) are not in
    that window. Every call site must be one of ALLOWED_SYNCS, each with why it stays."""
    import modeling_xprt

    where = {"step": False, "log": False}
    sites = {}

    def counted(orig, name, only=None):
        def f(*a, **kw):
            if where["step"] and not where["log"] and (only is None or only(*a, **kw)):
                fr = sys._getframe(1)
                while fr.f_code.co_filename.endswith(("torch/_tensor.py", "torch/overrides.py")):
                    fr = fr.f_back  # the caller, not torch's wrapper
                parts = Path(fr.f_code.co_filename).parts
                site = "/".join(parts[-2:]) if "site-packages" in parts else Path(fr.f_code.co_filename).name
                key = f"{site}:{fr.f_code.co_name}"
                sites.setdefault(key, set()).add(name)
            return orig(*a, **kw)
        return f

    def bool_index(self, idx, *a):
        items = idx if isinstance(idx, tuple) else (idx,)
        return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "masked_select"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), name))
    monkeypatch.setattr(torch.Tensor, "__getitem__", counted(torch.Tensor.__getitem__, "bool-mask index", bool_index))
    monkeypatch.setattr(torch, "nonzero", counted(torch.nonzero, "nonzero"))
    monkeypatch.setattr(torch, "masked_select", counted(torch.masked_select, "masked_select"))

    orig_forward, orig_add = modeling_xprt.XPRTModel.forward, run_log.LogWindow.add_terms

    def forward(self, *a, **kw):
        where["step"] = True
        return orig_forward(self, *a, **kw)

    def add_terms(self, *a, **kw):  # the last thing of a step before the logging check
        out = orig_add(self, *a, **kw)
        where["step"] = False
        return out

    def flagged(orig):
        def f(*a, **kw):
            where["log"] = True
            try:
                return orig(*a, **kw)
            finally:
                where["log"] = False
        return f

    monkeypatch.setattr(modeling_xprt.XPRTModel, "forward", forward)
    monkeypatch.setattr(run_log.LogWindow, "add_terms", add_terms)
    monkeypatch.setattr(run_log.LogWindow, "record", flagged(run_log.LogWindow.record))
    monkeypatch.setattr(run_log.LogWindow, "check_finite", flagged(run_log.LogWindow.check_finite))
    res = run(base_args(tiny_bert, groups, tmp_path / "s", **{"--max_train_steps": 4, "--max_groups": 8,
                                                               "--logging_steps": 2, "--max_grad_norm": 1.0,
                                                               "--no_save_model": True}))
    assert res["completed_steps"] == 4
    print("host syncs in the step:", sites)
    assert set(sites) <= set(ALLOWED_SYNCS), {k: v for k, v in sites.items() if k not in ALLOWED_SYNCS}
    assert not any("bool-mask index" in v or "nonzero" in v for v in sites.values()), sites


def test_nonfinite_loss_found_at_the_next_logging_step_names_its_step(nan_at_step_3, tiny_bert, groups, tmp_path):
    """The non-finite watch stays on the device and is read at logging steps: with --logging_steps 5 the NaN of
    step 3 stops the run at step 5, still naming step 3 and the term; no model is written."""
    argv = base_args(tiny_bert, groups, tmp_path / "n5", **{"--max_train_steps": 6, "--max_groups": 8,
                                                             "--logging_steps": 5})
    with pytest.raises(FloatingPointError, match=r"step 3 .*cross_fill_loss"):
        run(argv)
    assert not (tmp_path / "n5" / "model").exists()


# ---------------------------------------------------------------------------------------------------------------
# scores during training: --eval_tasks / --eval_steps
# ---------------------------------------------------------------------------------------------------------------
def _eval_folders(tmp_path):
    from test_evaluate import write_beir, write_semeval_sts

    return write_beir(tmp_path / "scifact"), write_semeval_sts(tmp_path / "sts12")


def _records(out: Path):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_eval_steps_scores_the_model_during_training(tiny_bert, groups, tmp_path):
    """--eval_steps 2 over 3 steps: scores at step 2 and for the final model (3), in train_log.jsonl and on the
    curve picture; the final score equals evaluate.py's on the saved folder (dropout was off, the model's pooling and
    prompts were used), and the losses equal a run without scoring (training mode and random states restored)."""
    import evaluate

    beir, sts = _eval_folders(tmp_path)
    common = {"--max_train_steps": 3, "--max_groups": 12, "--learning_rate": 1e-3, "--num_related": 2}
    run(base_args(tiny_bert, groups, tmp_path / "e", **common,
                  **{"--eval_steps": 2, "--eval_limit": 0, "--eval_tasks": f"SciFact={beir}"}) + [str(sts)])
    recs = _records(tmp_path / "e")
    scored = [r for r in recs if "eval_SciFact" in r]
    assert [r["step"] for r in scored] == [0, 2, 3]  # the start, every --eval_steps, the end
    assert all(0.0 <= r["eval_SciFact"] <= 100.0 and -100.0 <= r["eval_STS12"] <= 100.0 for r in scored)
    png = (tmp_path / "e" / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    final = evaluate.run_evaluation([str(tmp_path / "e" / "model")], local_tasks=[f"SciFact={beir}", str(sts)],
                                    show_progress=False)["results"][str(tmp_path / "e" / "model")]
    assert scored[-1]["eval_SciFact"] == pytest.approx(final["SciFact"]["main_score"], abs=1e-4)
    assert scored[-1]["eval_STS12"] == pytest.approx(final["STS12"]["main_score"], abs=1e-4)

    run(base_args(tiny_bert, groups, tmp_path / "n", **common))
    plain = {r["step"]: r for r in _records(tmp_path / "n")}
    with_eval = {r["step"]: r for r in recs if "loss" in r}
    for s in range(1, 4):
        assert with_eval[s]["loss"] == pytest.approx(plain[s]["loss"], rel=1e-6), s


def test_eval_flags_fail_early(tiny_bert, groups, tmp_path):
    with pytest.raises(UserError, match="--eval_tasks"):
        train.parse_args(base_args(tiny_bert, groups, tmp_path / "x", **{"--eval_steps": 2}))


@pytest.mark.slow
def test_two_process_scores_equal_evaluate_on_the_saved_model(tiny_bert, groups, tmp_path):
    """torchrun, 2 CPU processes: each encodes half of the texts, the vectors are gathered; the final score equals
    evaluate.py's on the saved folder."""
    import evaluate

    beir, sts = _eval_folders(tmp_path)
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "train.py")]
    cmd += [str(a) for a in base_args(tiny_bert, groups, out, **{"--max_train_steps": 2, "--num_related": 2,
                                                                   "--max_length": 24, "--learning_rate": 1e-3,
                                                                   "--eval_steps": 1, "--eval_limit": 0,
                                                                   "--eval_tasks": f"SciFact={beir}"})] + [str(sts)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    scored = [r for r in _records(out) if "eval_SciFact" in r]
    assert [r["step"] for r in scored] == [0, 1, 2]
    final = evaluate.run_evaluation([str(out / "model")], local_tasks=[f"SciFact={beir}", str(sts)],
                                    show_progress=False)["results"][str(out / "model")]
    assert scored[-1]["eval_SciFact"] == pytest.approx(final["SciFact"]["main_score"], abs=1e-4)
    assert scored[-1]["eval_STS12"] == pytest.approx(final["STS12"]["main_score"], abs=1e-4)
