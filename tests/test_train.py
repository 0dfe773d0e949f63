"""train.py --stage pretrain: schedules, batching, every objective and ablation, resume, NaN handling, saving,
and DeepSpeed ZeRO-2 under `accelerate launch`.

Runs use the tiny random BERT (conftest) on a small groups folder built here from the bundled sample documents in
the groups schema of INTERFACE.md, so they take seconds each on a CPU.
"""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train

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
    schema = pa.schema([("doc_id", pa.string()), ("group_index", pa.int32()), ("anchor_index", pa.int32()),
                        ("anchor", pa.string()), ("anchor_centrality", pa.float32()), ("related", pa.list_(pa.string())),
                        ("related_index", pa.list_(pa.int32())), ("related_cosine", pa.list_(pa.float32())),
                        ("related_tfidf", pa.list_(pa.float32())), ("related_rrf", pa.list_(pa.float32())),
                        ("random_passage", pa.string()), ("num_passages", pa.int32())])
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / "shard-00000.parquet")
    (out / "stats.json").write_text(json.dumps({"groups": len(rows)}))
    return out


def reset_accelerate():
    """Several runs in one test process: accelerate's state singletons must start fresh each time."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run(argv):
    reset_accelerate()
    try:
        return train.main([str(a) for a in argv])
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
    flat = []
    for k, v in args.items():
        if v is True:
            flat.append(k)
        elif v is not None and v is not False:
            flat += [k, v]
    return flat


# ---------------------------------------------------------------------------------------------------------------
# schedules and batching
# ---------------------------------------------------------------------------------------------------------------
def test_retention_schedule_decays_40_to_0_and_round_trips():
    s = train.RetentionSchedule(40.0, 0.0, total_steps=10)
    vals = []
    for _ in range(11):
        vals.append(s.value())
        s.step()
    assert vals[0] == 40.0 and vals[5] == pytest.approx(20.0) and vals[10] == 0.0
    assert all(a > b for a, b in zip(vals, vals[1:]))
    c = train.RetentionSchedule(40.0, 0.0, total_steps=10, shape="cosine")
    c.step_count = 5
    assert c.value() == pytest.approx(20.0)  # cosine passes the midpoint at half time
    t = train.RetentionSchedule(40.0, 0.0, total_steps=10)
    t.load_state_dict({**s.state_dict(), "step_count": 3})
    assert t.value() == pytest.approx(28.0)
    assert not train.RetentionSchedule(0.0, 0.0, 10).enabled
    with pytest.raises(ValueError):
        t.load_state_dict({**s.state_dict(), "total_steps": 11})


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


def test_padding_efficiency_counts_every_attention_mask():
    batch = {"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
             "decoder_attention_mask": torch.tensor([[1, 1, 1, 1]]), "input_ids": torch.zeros(2, 3)}
    assert train.padding_efficiency(batch) == (7, 10)


def test_pair_alpha_schedule_values():
    assert [train.pair_alpha_at(t, 10, 0.1, "constant") for t in (0, 5, 9)] == [0.1, 0.1, 0.1]
    lin = [train.pair_alpha_at(t, 10, 0.5, "linear") for t in range(11)]
    assert lin[0] == 0.5 and lin[5] == pytest.approx(0.25) and lin[10] == 0.0
    assert all(a > b for a, b in zip(lin, lin[1:]))


def test_flags_fail_early():
    with pytest.raises(SystemExit):
        train.parse_args(["--output_dir", "x"])  # pretrain without groups
    with pytest.raises(SystemExit):
        train.parse_args(["--output_dir", "x", "--groups_dir", "g", "--encoder_mask_rate", "1.5"])
    a = train.parse_args(["--output_dir", "x", "--groups_dir", "g"])
    assert a.learning_rate == 1e-6 and a.model_name_or_path == "intfloat/e5-base-unsupervised"
    assert a.retention_weight == 40.0 and a.retention_final_weight == 0.0
    assert train.parse_args(["--output_dir", "x", "--stage", "finetune", "--beir_dir", "b"]).learning_rate == 3e-5
