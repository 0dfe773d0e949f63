"""The contrastive term cannot vanish: a document that dominates the groups (issue: a 2 MB page gave 2,095 of 2,119
groups, every in-batch candidate was same-document and masked, and xp_loss was exactly 0.0). The batch sampler caps
one document's groups per batch (batches.LengthGroupedBatchSampler keys / max_per_key), select_groups.py can cap them
per corpus (--max_groups_per_document), and train.py logs the negatives the same-document mask left."""

import json
from pathlib import Path

import numpy as np
import pytest
from test_train import base_args, make_groups, run

from plumbing import batches

ROOT = Path(__file__).resolve().parent.parent


def _per_batch_max(keys, batches):
    return max(np.unique(keys[b], return_counts=True)[1].max() for b in batches)


def test_the_measured_page_keeps_negatives_under_the_cap():
    """The issue's corpus shape (2,095 groups of one document, 24 of others, batch 4): without the cap 2,020 of 2,116
    rows have no negative; with at most 2 of one document per batch, 12 batches (the most the other documents allow:
    capped_batch_count), every row keeps >= 2 negatives, a different subset of the page each epoch."""
    keys = np.array([0] * 2095 + list(range(1, 25)))
    lengths = np.random.default_rng(0).integers(50, 130, len(keys))
    plain = batches.LengthGroupedBatchSampler(lengths, 4, seed=0)
    before = batches.sampler_negatives(plain, keys)
    assert before["rows_without"] == 2020 and before["rows"] == 2116
    s = batches.LengthGroupedBatchSampler(lengths, 4, seed=0, keys=keys, max_per_key=2)
    assert len(s) == 12 and s.rows_left_out == 2116 - 48
    b0 = s.batch_matrix()
    assert b0.shape == (12, 4) and _per_batch_max(keys, b0) == 2 and len(set(b0.ravel())) == 48
    after = batches.sampler_negatives(s, keys)
    assert after["min"] == 2 and after["rows_without"] == 0 and after["mean"] == 2.5
    assert (s.batch_matrix() == b0).all()  # a function of (seed, epoch)
    s.set_epoch(1)
    b1 = s.batch_matrix()
    assert _per_batch_max(keys, b1) == 2 and set(b1.ravel()) != set(b0.ravel())


def test_capped_batch_count_is_the_most_batches_that_fit():
    """Bisection against trying every count of batches, on random per-key counts."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        counts = rng.integers(1, 40, rng.integers(1, 12))
        bs, cap = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        want = max(b for b in range(counts.sum() // bs + 1) if np.minimum(counts, cap * b).sum() >= bs * b)
        assert batches.capped_batch_count(counts, bs, cap) == want


def test_the_cap_changes_nothing_where_it_binds_nowhere_and_holds_where_it_does():
    """Many documents of a few groups each (the usual corpus): the same batches as without keys. A corpus with a few
    large documents: every batch within the cap, every row once at most, len(self) batches, still grouped by length
    (padding efficiency over the unsorted batches')."""
    rng = np.random.default_rng(2)
    keys = np.repeat(np.arange(500), 3)
    lengths = rng.integers(20, 400, len(keys))
    plain = batches.LengthGroupedBatchSampler(lengths, 8, seed=3, spread=4).batch_matrix()
    kept = batches.LengthGroupedBatchSampler(lengths, 8, seed=3, spread=4, keys=keys, max_per_key=4).batch_matrix()
    assert (plain == kept).all()

    keys = np.concatenate([np.zeros(300, int), np.ones(200, int), np.arange(2, 402)])
    lengths = rng.integers(20, 400, len(keys))
    s = batches.LengthGroupedBatchSampler(lengths, 8, seed=3, keys=keys, max_per_key=2)
    for epoch in range(3):
        s.set_epoch(epoch)
        b = s.batch_matrix()
        assert b.shape == (len(s), 8) and len(set(b.ravel())) == b.size and _per_batch_max(keys, b) <= 2
    eff = lambda bs: lengths[bs].sum() / (lengths[bs].max(1) * bs.shape[1]).sum()  # noqa: E731
    unsorted = batches.LengthGroupedBatchSampler(lengths, 8, seed=3, group_by_length=False).batch_matrix()
    assert eff(b) > eff(unsorted) + 0.1, (eff(b), eff(unsorted))


def _one_document_groups(out: Path, n_big: int, n_small: int) -> Path:
    """A finished groups folder whose rows are mostly one document's (the long page's), the rest one each of other
    documents: make_groups' rows with their doc_id rewritten."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = make_groups(out.parent / f"{out.name}-src", n_big + n_small)
    table = pq.read_table(src / "shard-00000.parquet")
    ids = ["the-long-page"] * n_big + [f"other-{i}" for i in range(n_small)]
    table = table.set_column(table.schema.get_field_index("doc_id"), "doc_id", pa.array(ids))
    out.mkdir(parents=True)
    pq.write_table(table, out / "groups-000000.parquet")
    (out / "stats.json").write_text(json.dumps({"groups": n_big + n_small}))
    return out


@pytest.mark.parametrize("cap", [0, None])
def test_a_dominant_document_leaves_xp_loss_on_and_the_negatives_logged(tiny_bert, tmp_path, cap, capsys):
    """36 groups of one document and 4 of others, batch 4, 3 steps. Without the cap (0) the rows of a batch of the
    page alone keep no negative: L_xp is exactly 0 there, the logged in_batch_negatives says 0 and the run warns.
    With the default cap (half the batch: 2; 2 batches an epoch fit) every step keeps >= 2 negatives per row and
    L_xp > 0, and the log says
    how many groups the cap left out of the epoch."""
    groups = _one_document_groups(tmp_path / "groups", 36, 4)
    out = tmp_path / f"run-{cap}"
    kw = {"--max_train_steps": 3, "--retention_weight": 0}
    if cap is not None:
        kw["--max_document_groups_per_batch"] = cap
    run(base_args(tiny_bert, groups, out, **kw))
    log = capsys.readouterr().out
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:  # L_xp is 0 exactly when the mask left no negative
        assert (r["xp_loss"] == 0.0) == (r["in_batch_negatives"] == 0.0), r
    if cap == 0:
        assert "left 0 of 40 groups out of each epoch" in log
        assert any(r["in_batch_negatives"] == 0.0 and r["xp_loss"] == 0.0 for r in recs)
        assert "warning: step" in log and "in-batch negatives" in log
    else:
        assert "at most 2 groups of one document per batch" in log and "left 32 of 40 groups out of each epoch" in log
        assert all(r["in_batch_negatives"] >= 2.0 and r["xp_loss"] > 0.0 for r in recs)
        assert "warning: step" not in log


def test_select_groups_caps_a_documents_groups_and_counts_them(tiny_bert, tmp_path):
    """--max_groups_per_document 2 with every passage an anchor: at most 2 groups a document, the most central
    anchors kept, and stats.json's groups_capped = the anchors left out (the groups without the cap minus with)."""
    from test_select_groups import _docs, _rows, _write_jsonl

    import select_groups as sg

    docs = _write_jsonl(tmp_path / "docs.jsonl", _docs(6))
    common = ["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--centrality_threshold", "-1"]
    sg.main(common + ["--output_dir", str(tmp_path / "all")])
    sg.main(common + ["--output_dir", str(tmp_path / "capped"), "--max_groups_per_document", "2"])
    full, capped = (json.loads((tmp_path / d / "stats.json").read_text()) for d in ("all", "capped"))
    rows_full, rows = _rows(tmp_path / "all"), _rows(tmp_path / "capped")
    per_doc = {}
    for r in rows:
        per_doc.setdefault(r["doc_id"], []).append(r)
    assert max(len(v) for v in per_doc.values()) == 2
    assert capped["groups_capped"] == full["groups"] - capped["groups"] > 0
    assert capped["documents_capped"] == sum(1 for d in {r["doc_id"] for r in rows_full}
                                             if sum(r["doc_id"] == d for r in rows_full) > 2)
    for d, kept in per_doc.items():  # the kept anchors are the document's most central
        cents = sorted((r["anchor_centrality"] for r in rows_full if r["doc_id"] == d), reverse=True)
        assert sorted(r["anchor_centrality"] for r in kept) == pytest.approx(sorted(cents[:2]))
