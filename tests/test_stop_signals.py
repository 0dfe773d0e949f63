"""Every phase stops cleanly (issue 62, item 7): a SIGTERM or Ctrl-C in any phase of the five scripts (selection,
the datatrove stages, the start's and later scoring, the first step where --compile compiles, the final save,
fine-tuning's mining, evaluation) ends the run in one line saying what was kept and which command continues, with the
shell's status 128 + N. Before (1fbaae3) a SIGTERM outside the optimiser steps killed the process with no line.

Each test runs the script through its real entry point (common.run_script, which installs the handlers) in this
process, and sends the signal to this process with os.kill from inside the phase (a wrapper around the phase's
function), so the signal arrives where a scheduler's would. The step-boundary case (a checkpoint after the step,
then a resume equal to the uninterrupted run) is tests/test_run_endings.py's."""

import os
import re
import signal

import pytest
from test_evaluate import write_beir
from test_finetune import ft_args, make_beir
from test_select_groups import _docs, _rows, _write_jsonl
from test_train import base_args, make_groups, reset_accelerate

import evaluate as ev
import finetune
import select_groups as sg
import select_groups_datatrove as sgd
import train
from plumbing import training
from plumbing.common import run_script


def signalled_at(monkeypatch, owner, name, sig=signal.SIGTERM, call=1, when=None):
    """Replace owner.name by a wrapper that sends `sig` to this process on its `call`-th call (among the calls
    `when(*args, **kw)` accepts), then runs the real function: the signal arrives inside the phase."""
    real, seen = getattr(owner, name), []

    def wrapper(*args, **kw):
        if when is None or when(*args, **kw):
            seen.append(1)
            if len(seen) == call:
                os.kill(os.getpid(), sig)
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, wrapper)
    return seen


def stopped_line(main, argv, capsys, sig=signal.SIGTERM) -> str:
    """Run `main` through run_script: it must exit 128 + sig with exactly one line on stderr after the progress bars,
    `script: SIG...: stopped; kept...`; -> that line."""
    reset_accelerate()
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit) as ended:
            run_script(main, [str(a) for a in argv])
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        reset_accelerate()
    err = capsys.readouterr().err
    assert ended.value.code == 128 + sig, err[-2000:]
    lines = [ln for ln in re.split(r"[\r\n]", err) if ": stopped; " in ln]
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"{main.__module__}.py: {signal.Signals(sig).name}: stopped; "), lines[0]
    return lines[0]


@pytest.fixture
def corpus(tmp_path):
    docs = tmp_path / "docs.jsonl"
    _write_jsonl(docs, _docs(12))
    return docs


def sg_args(tiny_bert, corpus, out, **kw):
    args = ["--input", corpus, "--model_name_or_path", tiny_bert, "--output_dir", out, "--anchor_share", "0.5",
            "--calibration_docs", "4", "--chunk_docs", "4"]
    return args + [str(x) for kv in kw.items() for x in kv]


def test_selection_stops_in_calibration_and_in_selection_keeping_its_finished_chunks(tiny_bert, corpus, tmp_path,
                                                                                      monkeypatch, capsys):
    """SIGTERM in the --anchor_share calibration (before: exit 143, no line): nothing kept, the same command starts
    over. SIGTERM while the third chunk is embedded: the chunks finished before it are kept and said, and the same
    command reuses them and writes the groups an uninterrupted run writes."""
    out = tmp_path / "groups"
    signalled_at(monkeypatch, sg, "embed_passages", when=lambda *a, **k: a[4] == "calibration")
    line = stopped_line(sg.main, sg_args(tiny_bert, corpus, out), capsys)
    assert line.endswith(f"kept: 0 finished chunk(s) of groups in {out}; the same command continues from them")
    monkeypatch.undo()
    signalled_at(monkeypatch, sg, "embed_passages", call=3)  # the calibration's chunk 0, chunk 1, then chunk 2
    line = stopped_line(sg.main, sg_args(tiny_bert, corpus, out), capsys)
    kept = int(re.search(r"kept: (\d+) finished chunk", line).group(1))
    assert kept >= 1 and len(list(out.glob("groups-*.parquet"))) == kept
    monkeypatch.undo()
    sg.main([str(a) for a in sg_args(tiny_bert, corpus, out)])
    assert f"{kept} finished chunk(s) will be reused" in capsys.readouterr().out
    whole = tmp_path / "whole"
    sg.main([str(a) for a in sg_args(tiny_bert, corpus, whole)])
    a, b = _rows(out), _rows(whole)
    diff = [(k, x[k], y[k]) for x, y in zip(a, b) for k in x if x[k] != y[k]]
    assert len(a) == len(b) and diff == [], diff[:3]


def test_the_datatrove_stages_stop_keeping_their_finished_tasks(tiny_bert, corpus, tmp_path, monkeypatch, capsys):
    """SIGTERM in the datatrove selection stage (local executor, in this process): the line counts each stage's
    finished tasks (datatrove's completion markers, which a rerun skips) and the chunks."""
    out = tmp_path / "groups"
    signalled_at(monkeypatch, sg, "select_chunks")
    line = stopped_line(sgd.main, sg_args(tiny_bert, corpus, out, **{"--executor": "local", "--tasks": "2",
                                                                    "--workers": "1"}), capsys)
    assert "kept: the stages' finished tasks (frequencies 2, merge 1, select 0, finish 0) and 0 finished chunk(s)" \
        in line and line.endswith("the same command continues from them")


@pytest.fixture
def eval_task(tmp_path_factory):
    return write_beir(tmp_path_factory.mktemp("beir") / "scifact")


@pytest.mark.parametrize("phase", ["start scoring", "first step", "later scoring", "saving"])
def test_train_stops_cleanly_in_every_phase(phase, tiny_bert, eval_task, tmp_path, monkeypatch, capsys):
    """train.py: SIGTERM in the start's scoring or the first step (where --compile compiles): stopped at once, no
    checkpoint yet, the same command starts again. In a later scoring: the scoring is left, the step just done is
    checkpointed and the line says so (the resume line). In the final save: at once, no half model folder, the line
    names the last checkpoint and --resume_from_checkpoint latest."""
    import evaluate

    groups = make_groups(tmp_path / "g", 24)
    out = tmp_path / "run"
    argv = base_args(tiny_bert, groups, out, **{"--max_train_steps": 4, "--eval_tasks": f"SciFact={eval_task}",
                                                "--eval_steps": 2, "--eval_limit": 0, "--checkpointing_steps": 1})
    if phase == "start scoring":
        signalled_at(monkeypatch, evaluate.TrainingScorer, "__call__")
    elif phase == "later scoring":
        signalled_at(monkeypatch, evaluate.TrainingScorer, "__call__", call=2)  # step 2's
    elif phase == "first step":
        from modeling_xprt import XPRTModel

        signalled_at(monkeypatch, XPRTModel, "forward")
    else:
        signalled_at(monkeypatch, training, "save_model_with_card")
    reset_accelerate()
    if phase == "later scoring":  # answered by the loop: the step's checkpoint, save_run's exit status
        with pytest.raises(SystemExit) as ended:
            run_script(train.main, [str(a) for a in argv])
        said = capsys.readouterr()
        assert ended.value.code == 143
        assert f"SIGTERM at step 2: checkpoint written to {out}/checkpoints/step_2" in said.out
        assert [p.name for p in training.list_checkpoints(out / "checkpoints")][-1] == "step_2"
        return
    line = stopped_line(train.main, argv, capsys)
    if phase == "saving":
        assert line.endswith(f"kept: checkpoint {out}/checkpoints/step_4; the same command with "
                             "--resume_from_checkpoint latest continues from it")
        assert not (out / "model").exists() and not list(out.glob(".tmp-*"))
    else:
        assert line.endswith("no checkpoint was written yet; the same command starts the run again")
        assert not (out / "checkpoints").exists() or not training.list_checkpoints(out / "checkpoints")


def test_finetune_announces_its_mining_and_stops_cleanly_in_it(tiny_bert, tmp_path, monkeypatch, capsys):
    """finetune.py says what it mines, how many and where (before: mined_negatives.json appeared without a word);
    a SIGTERM in the mining stops at once: no mined_negatives.json, no checkpoint, the same command starts again."""
    beir = make_beir(tmp_path / "beir")
    out = tmp_path / "ft"
    argv = ft_args(tiny_bert, beir, out, **{"--max_train_steps": 1, "--query_max_length": 16,
                                              "--passage_max_length": 32})
    signalled_at(monkeypatch, finetune, "mine_hard_negatives")
    line = stopped_line(finetune.main, argv, capsys)
    assert line.endswith("no checkpoint was written yet; the same command starts the run again")
    assert not (out / "mined_negatives.json").exists()
    monkeypatch.undo()
    reset_accelerate()
    finetune.main([str(a) for a in argv + ["--mine_only"]])
    said = capsys.readouterr().out
    mined = out / "mined_negatives.json"
    assert f"mining hard negatives with the start model: ranks 2-20 of 61 passages for 17 queries, into {mined}" \
        in said
    assert re.search(rf"mined 17 pools of hard negatives \([\d,]+ passages\) into {re.escape(str(mined))}: "
                     rf"--mined_negatives {re.escape(str(mined))} reuses them", said), said


def test_evaluate_stops_keeping_the_tasks_it_scored(tiny_bert, eval_task, tmp_path, monkeypatch, capsys):
    """evaluate.py: SIGTERM while the second task is scored: the line names the task result already written (mteb's
    results folder) and says the same command reads it back; the rerun scores only the rest."""
    from test_evaluate import write_semeval_sts

    sts = write_semeval_sts(tmp_path / "sts12")
    results = tmp_path / "results"
    argv = ["--models", tiny_bert, "--local_tasks", f"SciFact={eval_task}", sts, "--output_dir", tmp_path / "out",
            "--results_dir", results, "--batch_size", "2", "--no_card_update"]
    signalled_at(monkeypatch, ev, "evaluate_model_on_task", call=2)
    line = stopped_line(ev.main, argv, capsys)
    assert line.endswith(f"kept: 1 task result(s) scored in this run (SciFact) in {results}; the same command "
                         "reads them back and scores the rest")
