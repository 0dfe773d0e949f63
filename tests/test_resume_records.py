"""A resumed run's every record is the uninterrupted run's (issue 64, item 2): train.py --save_best's best so far and
the start's score travel in the checkpoint (training.TrainState.best), so best.json, best_model/ and train_log.jsonl
of a run stopped and resumed at any point equal those of the run that was never stopped. Scored on the bundled
SciFact sample (data/eval/scifact, --eval_limit 20)."""

import json
from pathlib import Path

import pytest
import torch
from test_train import base_args, make_groups, run

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVAL_EVERY = 6, 2  # scores at 0 (the start), 2, 4 and 6


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return make_groups(tmp_path_factory.mktemp("groups"), 24)


def args(tiny_bert, groups, out, **kw):
    common = {"--max_train_steps": STEPS, "--num_related": 2, "--max_length": 24, "--learning_rate": 3e-3,
              "--checkpointing_steps": 1, "--eval_steps": EVAL_EVERY, "--eval_limit": 20,
              "--eval_tasks": f"SciFact={ROOT / 'data' / 'eval' / 'scifact'}", "--save_best": "SciFact"}
    return base_args(tiny_bert, groups, out, **common, **kw)


@pytest.fixture(scope="module")
def uninterrupted(tiny_bert, groups, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_records") / "a"
    run(args(tiny_bert, groups, out))
    return out


def read_log(out: Path) -> dict:
    """train_log.jsonl as {step: every record of that step merged} (a step's losses and its scores)."""
    recs = {}
    for line in (out / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs.setdefault(r["step"], {}).update(r)
    return recs


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "best_model" / "model.safetensors")


@pytest.mark.parametrize("stop", [1, 3, 5], ids=["before-the-first-score", "between-scores", "after-the-best"])
def test_a_resumed_run_keeps_the_uninterrupted_runs_best(tiny_bert, groups, uninterrupted, tmp_path, stop):
    """Stopped after `stop` steps (its checkpoint there) and resumed: best.json (step, score, every task's score,
    the start's score), best_model/'s weights and every log record (losses and scores) equal the uninterrupted
    run's. The trajectory has teeth: the best is not the last score, so a resumed run that forgot it would keep a
    later, lower one, and would take its first score for the start's."""
    a = uninterrupted
    scores = {s: r["eval_SciFact"] for s, r in read_log(a).items() if "eval_SciFact" in r}
    best_a = json.loads((a / "best.json").read_text())
    assert sorted(scores) == [0, 2, 4, 6] and best_a["score"] == max(scores.values())
    assert best_a["start"] == scores[0] and min(scores.values()) < best_a["score"]
    b = tmp_path / "b"
    run(args(tiny_bert, groups, b, **{"--stop_after_steps": stop}))
    run(args(tiny_bert, groups, b, **{"--resume_from_checkpoint": "latest"}))
    best_b = json.loads((b / "best.json").read_text())
    assert best_b.keys() == best_a.keys() and best_b["step"] == best_a["step"]
    for k in ("score", "start"):
        assert best_b[k] == pytest.approx(best_a[k], abs=1e-6), (k, best_b, best_a)
    assert best_b["scores"] == pytest.approx(best_a["scores"], abs=1e-6)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    la, lb = read_log(a), read_log(b)
    assert sorted(la) == sorted(lb)
    for s in la:
        same = [k for k in la[s] if k.endswith("loss") or k.startswith("eval_")]
        assert same and set(same) <= set(lb[s]), (s, same, lb[s])
        for k in same:
            assert lb[s][k] == pytest.approx(la[s][k], rel=1e-5, abs=1e-6), (s, k)
