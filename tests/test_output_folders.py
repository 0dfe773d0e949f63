"""Nothing a user owns is deleted (common.claim_output_folder). Over the family: each script (select_groups, train,
finetune, evaluate), each kind of input inside its output folder (and the output folder inside an input), a
stranger's file in it, a folder that cannot be written. A script replaces only the outputs its record
(.xprt/outputs.json) says it wrote; --overwrite leaves everything else as it was, byte for byte.

The tests run as root, whom chmod does not stop: the unwritable folder is one under a regular file (ENOTDIR for
everyone), which common.check_writable's probe (a real mkdir and file) meets as a user would."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_evaluate import write_beir
from test_finetune import make_beir
from test_train import make_groups, reset_accelerate

import evaluate as ev
import finetune
import select_groups as sg
import train
from plumbing import common, training

ROOT = Path(__file__).resolve().parent.parent


def digest(folder: Path) -> dict:
    """{relative path: sha1 of the bytes} of every file under `folder` (a file: itself)."""
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)) if p != folder else ".": hashlib.sha1(p.read_bytes()).hexdigest()
            for p in files}


def run(main, argv):
    reset_accelerate()
    return main([str(a) for a in argv])


def flat(args: dict) -> list:
    return [str(x) for k, v in args.items() if v is not None for x in ((k,) if v is True else (k, v))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(list(open(ROOT / "data" / "docs.jsonl", encoding="utf-8"))[:6]))
    return path


def select_args(model, corpus, out, **kw):
    return flat({"--input": corpus, "--model_name_or_path": model, "--output_dir": out, "--centrality_threshold": -1,
                 "--passage_tokens": 48, **kw})


def train_args(model, groups, out, **kw):
    return flat({"--model_name_or_path": model, "--groups_dir": groups, "--output_dir": out, "--max_length": 32,
                 "--per_device_train_batch_size": 2, "--max_groups": 4, "--max_train_steps": 1, "--report_to": "none",
                 "--retention_weight": 0, **kw})


def finetune_args(model, beir, out, **kw):
    return flat({"--model_name_or_path": model, "--beir_dir": beir, "--output_dir": out, "--report_to": "none",
                 "--per_device_train_batch_size": 4, "--negatives_rank_min": 2, "--negatives_rank_max": 20,
                 "--passage_max_length": 32, **kw})


def eval_args(model, task, out, **kw):
    return flat({"--models": model, "--local_tasks": f"SciFact={task}", "--output_dir": out, **kw})


# ---- each script x each input kind inside the output folder (or the output folder inside the input) ------------
def _copy(src):
    """A function placing a copy of the input `src` in an output folder (as out/inp) -> its path."""
    def place(out):
        dest = out / "inp"
        if Path(src).is_dir():
            shutil.copytree(src, dest)
        else:
            shutil.copy(src, dest)
        return dest
    return place


INSIDE = {
    # name: (script main, argv(fx, out, input path), flag named, input placed under out by)
    "select_groups --input": (sg.main, lambda fx, o, p: select_args(fx["model"], p, o, **{"--overwrite": True}),
                              "--input", lambda fx: _copy(fx["corpus"])),
    "select_groups --model_name_or_path": (sg.main, lambda fx, o, p: select_args(p, fx["corpus"], o),
                                           "--model_name_or_path", lambda fx: _copy(fx["model"])),
    "train --model_name_or_path": (train.main, lambda fx, o, p: train_args(p, fx["groups"], o, **{"--overwrite": True}),
                                   "--model_name_or_path", lambda fx: _copy(fx["model"])),
    "train --groups_dir": (train.main, lambda fx, o, p: train_args(fx["model"], p, o, **{"--overwrite": True}),
                           "--groups_dir", lambda fx: _copy(fx["groups"])),
    "train --teacher_name_or_path": (train.main, lambda fx, o, p: train_args(fx["model"], fx["groups"], o, **{
        "--teacher_name_or_path": p, "--retention_weight": 40}), "--teacher_name_or_path",
        lambda fx: _copy(fx["model"])),
    "train --eval_tasks": (train.main, lambda fx, o, p: train_args(fx["model"], fx["groups"], o, **{
        "--eval_tasks": f"SciFact={p}"}), "--eval_tasks", lambda fx: _copy(fx["task"])),
    "finetune --model_name_or_path": (finetune.main, lambda fx, o, p: finetune_args(p, fx["beir"], o),
                                      "--model_name_or_path", lambda fx: _copy(fx["model"])),
    "finetune --beir_dir": (finetune.main, lambda fx, o, p: finetune_args(fx["model"], p, o, **{"--overwrite": True}),
                            "--beir_dir", lambda fx: _copy(fx["beir"])),
    "finetune --train_data": (finetune.main, lambda fx, o, p: finetune_args(fx["model"], None, o, **{
        "--train_data": p}), "--train_data", lambda fx: _copy(fx["pairs"])),
    "finetune --mined_negatives": (finetune.main, lambda fx, o, p: finetune_args(fx["model"], fx["beir"], o, **{
        "--mined_negatives": p, "--overwrite": True}), "--mined_negatives", lambda fx: _copy(fx["pairs"])),
    "evaluate --models": (ev.main, lambda fx, o, p: eval_args(p, fx["task"], o, **{"--overwrite": True}), "--models",
                          lambda fx: _copy(fx["model"])),
    "evaluate --local_tasks": (ev.main, lambda fx, o, p: eval_args(fx["model"], p, o), "--local_tasks",
                               lambda fx: _copy(fx["task"])),
}


@pytest.fixture(scope="module")
def fx(tmp_path_factory, tiny_bert, corpus):
    root = tmp_path_factory.mktemp("inputs")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": f"q{i}", "pos": [f"passage {i}"], "neg": [f"other {i}"]}) + "\n"
                             for i in range(8)))
    return {"model": tiny_bert, "corpus": corpus, "groups": make_groups(root / "groups", 8),
            "beir": make_beir(root / "beir"), "task": write_beir(root / "scifact"), "pairs": pairs}


@pytest.mark.parametrize("case", sorted(INSIDE))
def test_an_input_inside_the_output_folder_is_refused_and_kept(case, fx, tmp_path):
    main, argv, flag, place = INSIDE[case]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("a stranger's file\n")
    inp = place(fx)(out)
    before = digest(out)
    with pytest.raises(common.UserError, match=f"--output_dir {out} holds {flag} {inp}"):
        run(main, argv(fx, out, inp))
    assert digest(out) == before  # the input and the stranger's file, byte for byte; nothing written


@pytest.mark.parametrize("main,argv", [
    (sg.main, lambda fx, o: select_args(fx["model"], fx["corpus"], o)),
    (train.main, lambda fx, o: train_args(fx["model"], fx["groups"], o)),
    (finetune.main, lambda fx, o: finetune_args(fx["model"], fx["beir"], o)),
    (ev.main, lambda fx, o: eval_args(fx["model"], fx["task"], o)),
], ids=["select_groups", "train", "finetune", "evaluate"])
def test_an_output_folder_inside_an_input_or_under_a_file_is_refused(main, argv, fx, tmp_path):
    """The output folder inside the start model's folder (a scan of the model folder would read outputs back, a
    save would mix them in), and one under a regular file: refused before any work, nothing created."""
    model = tmp_path / "model"
    shutil.copytree(fx["model"], model)
    before = digest(model)
    fx_inside = {**fx, "model": model}
    with pytest.raises(common.UserError, match=f"--output_dir {model / 'out'} is inside --(model_name_or_path|models) "
                                                f"{model}"):
        run(main, argv(fx_inside, model / "out"))
    assert digest(model) == before and not (model / "out").exists()
    blocker = tmp_path / "a_file"
    blocker.write_text("a regular file\n")
    with pytest.raises(common.UserError, match=f"cannot write there \\({blocker} is a file\\)"):
        run(main, argv(fx, blocker / "out"))
    assert blocker.read_text() == "a regular file\n"


@pytest.mark.parametrize("main,argv,name", [
    (sg.main, lambda fx, o: select_args(fx["model"], fx["corpus"], o, **{"--overwrite": True}), "stats.json"),
    (sg.main, lambda fx, o: select_args(fx["model"], fx["corpus"], o, **{"--overwrite": True}),
     "groups-000000.parquet"),
    (train.main, lambda fx, o: train_args(fx["model"], fx["groups"], o, **{"--overwrite": True}), "model"),
    (train.main, lambda fx, o: train_args(fx["model"], fx["groups"], o, **{"--overwrite": True}), "train_log.jsonl"),
    (finetune.main, lambda fx, o: finetune_args(fx["model"], fx["beir"], o, **{"--overwrite": True}),
     "mined_negatives.json"),
    (ev.main, lambda fx, o: eval_args(fx["model"], fx["task"], o, **{"--overwrite": True}), "results.md"),
], ids=["select_groups-stats", "select_groups-shard", "train-model", "train-log", "finetune-mined", "evaluate"])
def test_a_strangers_file_named_like_an_output_is_never_replaced(main, argv, name, fx, tmp_path):
    """A file (or folder) named like one of the script's outputs that its record does not list (the user's own,
    or a run from before the record existed): refused even with --overwrite, kept byte for byte."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True) if name == "model" else out.mkdir()
    (out / name / "weights.bin" if name == "model" else out / name).write_text("mine\n")
    before = digest(out)
    with pytest.raises(common.UserError, match=f"{out / name} exists and .* has no record of writing it"):
        run(main, argv(fx, out))
    assert digest(out) == before


# ---- --overwrite replaces the script's own outputs and leaves the rest ---------------------------------------------
def strangers(out: Path) -> dict:
    """A stranger's files in an output folder: a note, a folder of data, a file inside the record's folder."""
    (out / "notes.txt").write_text("my notes\n")
    (out / "mydata").mkdir()
    (out / "mydata" / "x.parquet").write_bytes(b"PAR1 not a shard")
    (out / ".xprt" / "mine.txt").write_text("mine too\n")
    return {k: v for k, v in digest(out).items() if k in ("notes.txt", "mydata/x.parquet", ".xprt/mine.txt")}


def test_select_groups_overwrite_replaces_its_own_outputs_only(fx, tmp_path):
    out = tmp_path / "groups"
    first = sg.main(select_args(fx["model"], fx["corpus"], out)) or json.loads((out / "stats.json").read_text())
    kept = strangers(out)
    shards = sorted(p.name for p in out.glob("groups-*.parquet"))
    with pytest.raises(common.UserError, match="holds a finished selection"):
        sg.main(select_args(fx["model"], fx["corpus"], out))
    sg.main(select_args(fx["model"], fx["corpus"], out, **{"--overwrite": True, "--num_related": 2,
                                                            "--max_docs": 3}))
    again = json.loads((out / "stats.json").read_text())
    assert again["num_related"] == 2 and again["documents_read"] == 3 and first["documents_read"] == 6
    assert {k: v for k, v in digest(out).items() if k in kept} == kept  # the stranger's files, byte for byte
    import pyarrow.parquet as pq

    rows = [r for p in sorted(out.glob("groups-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert len(rows) == again["groups"] and all(len(r["related"]) == 2 for r in rows)  # no shard of the first run
    assert len(shards) >= 1
    record = json.loads((out / ".xprt" / "outputs.json").read_text())
    assert set(record) == {"select_groups.py"} and "groups-*.parquet" in record["select_groups.py"]


@pytest.mark.slow
def test_train_overwrite_replaces_its_own_outputs_only(fx, tmp_path):
    out = tmp_path / "run"
    run(train.main, train_args(fx["model"], fx["groups"], out))
    kept = strangers(out)
    (out / ".tmp-4242-train_log.jsonl").write_text("a killed run's half-written log\n")
    old_model = digest(out / "model")
    with pytest.raises(common.UserError, match="model exists: pass --overwrite"):
        run(train.main, train_args(fx["model"], fx["groups"], out))
    run(train.main, train_args(fx["model"], fx["groups"], out, **{"--overwrite": True, "--max_train_steps": 2,
                                                                  "--logging_steps": 1}))
    assert {k: v for k, v in digest(out).items() if k in kept} == kept
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # this run's log alone, not appended to the first
    assert digest(out / "model") != old_model and not (out / ".tmp-4242-train_log.jsonl").exists()
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_finetune_overwrite_replaces_its_own_outputs_only(fx, tmp_path):
    """--mine_only twice in one folder: the second (--overwrite) replaces mined_negatives.json and nothing else."""
    out = tmp_path / "ft"
    run(finetune.main, finetune_args(fx["model"], fx["beir"], out, **{"--mine_only": True}))
    kept = strangers(out)
    first = (out / "mined_negatives.json").read_text()
    run(finetune.main, finetune_args(fx["model"], fx["beir"], out, **{"--mine_only": True, "--overwrite": True,
                                                                      "--negatives_rank_max": 5}))
    assert {k: v for k, v in digest(out).items() if k in kept} == kept
    pools = json.loads((out / "mined_negatives.json").read_text())
    assert (out / "mined_negatives.json").read_text() != first and max(len(p) for p in pools) <= 4


def test_evaluate_overwrite_replaces_its_own_outputs_only(fx, tmp_path):
    out = tmp_path / "eval"
    argv = eval_args(fx["model"], fx["task"], out, **{"--results_dir": tmp_path / "results"})
    ev.main(argv)
    kept = strangers(out)
    first = (out / "results.json").read_text()
    with pytest.raises(common.UserError, match="already has"):
        ev.main(argv)
    ev.main(argv + ["--overwrite", "--limit", "1"])
    assert {k: v for k, v in digest(out).items() if k in kept} == kept
    assert json.loads((out / "results.json").read_text())["sample"]["limit"] == 1 and first != (
        out / "results.json").read_text()


def test_remove_outputs_refuses_what_the_record_does_not_list(tmp_path):
    """The one function that deletes: only paths the script's record lists (a mistake in a caller cannot delete a
    stranger's file), plus the '.tmp-' leftovers of those outputs' atomic writes."""
    out = tmp_path / "out"
    common.check_writable(out)
    common.record_outputs(out, "train.py", training.RUN_OUTPUTS)
    (out / "train_log.jsonl").write_text("{}\n")
    (out / "notes.txt").write_text("mine\n")
    (out / ".tmp-7-train_log.jsonl").write_text("half\n")
    (out / ".tmp-7-notes.txt").write_text("a stranger's own temporary\n")
    with pytest.raises(RuntimeError, match="notes.txt: not an output train.py recorded"):
        common.remove_outputs(out, "train.py", [out / "notes.txt"])
    with pytest.raises(RuntimeError, match="not an output finetune.py recorded"):
        common.remove_outputs(out, "finetune.py", [out / "train_log.jsonl"])
    common.remove_outputs(out, "train.py", [out / "train_log.jsonl"])
    assert sorted(p.name for p in out.iterdir()) == [".tmp-7-notes.txt", ".xprt", "notes.txt"]
