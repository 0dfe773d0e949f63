"""Selection as datatrove stages (select_groups_datatrove.py --executor): the same groups as the one-process command
(select_groups.py) whatever the executor's task and worker counts, a rerun after a kill that redoes only the
unfinished tasks, refusals of a changed task count or changed flags, and the Slurm and Ray executors as built
(neither can run here)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import select_groups as sg
import select_groups_datatrove as stages
from plumbing.common import UserError

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "data" / "docs.jsonl"


def rows_digest(out):
    """(row count, sha256 of the sorted rows) of a groups folder: every column of every row."""
    rows = [json.dumps(r, sort_keys=True) for f in sorted(Path(out).glob("groups-*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    return len(rows), hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


def corpus(folder, ids=True):
    """60 bundled documents in 4 files: file 2 repeats an id of file 0 (another task's at 3 tasks), file 3 repeats
    one of its own ids and holds a line that is not JSON."""
    docs = [json.loads(line) for line in open(DOCS, encoding="utf-8")][:60]
    if not ids:
        docs = [{"text": d["text"]} for d in docs]
    folder.mkdir()
    for f in range(4):
        lines = [json.dumps(d) for d in docs[f * 15:(f + 1) * 15]]
        if f == 2 and ids:
            lines.append(json.dumps({**docs[3], "text": docs[3]["text"] + " (a second copy)"}))
        if f == 3:
            lines[5:5] = ["{not json", *([json.dumps(docs[46])] if ids else [])]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def select(inp, out, model, *flags):
    """select_groups.py, or select_groups_datatrove.py where the flags name an --executor."""
    main = stages.main if "--executor" in flags else sg.main
    main(["--input", str(inp), "--output_dir", str(out), "--model_name_or_path", str(model), "--skip_bad_lines",
             "--chunk_docs", "7", *flags])
    return json.load(open(out / "stats.json"))


COUNTS = ("documents_read", "documents_valid", "documents_skipped_by_reason", "documents_with_groups", "groups",
          "passages", "centrality_histogram")


def test_the_same_groups_whatever_the_engine(tmp_path, tiny_bert, monkeypatch):
    """Today's command, the local executor with 1 and 3 tasks, and 3 tasks on 2 workers: every row equal (and the
    shard names), on files with an id repeated across tasks, one repeated within a file, and a bad line. The merge
    reads the tasks' hashes in slices of 5 (HASHES_PER_SLICE), so the sliced path is the one tested."""
    inp = corpus(tmp_path / "in")
    monkeypatch.setattr(stages, "HASHES_PER_SLICE", 5)  # workers=1 runs the tasks in this process
    ref = select(inp, tmp_path / "one", tiny_bert)
    skipped = {k: v for k, v in ref["documents_skipped_by_reason"].items() if v}
    assert skipped == {"duplicate_id": 2, "malformed_json": 1}
    runs = {"local, 1 task": ["--tasks", "1"], "local, 3 tasks": ["--tasks", "3", "--workers", "1"],
            "local, 3 tasks on 2 workers": ["--tasks", "3", "--workers", "2"]}
    want = rows_digest(tmp_path / "one")
    assert want[0] > 100
    shards = sorted(p.name for p in (tmp_path / "one").glob("groups-*.parquet"))
    for i, (name, flags) in enumerate(runs.items()):
        out = tmp_path / f"run{i}"
        stats = select(inp, out, tiny_bert, "--executor", "local", *flags)
        assert rows_digest(out) == want, name
        assert sorted(p.name for p in out.glob("groups-*.parquet")) == shards, name
        assert {k: stats[k] for k in COUNTS} == {k: ref[k] for k in COUNTS}, name
        assert stats["executor"].startswith("datatrove local executor")
    # the id repeated across tasks was counted by its task and taken back out of the corpus IDF
    import numpy as np

    merged = np.load(tmp_path / "run1" / sg.META_DIR / "datatrove" / "merged-df.npz")
    one = np.load(tmp_path / "one" / sg.META_DIR / "df-r0-w1.npz")
    assert int(merged["n_docs"]) == int(one["n_docs"]) == 60 and (merged["df"] == one["df"]).all()


def test_row_number_ids_and_anchor_share_across_tasks(tmp_path, tiny_bert):
    """Text-only files (ids are global row numbers: each task numbers its records from its files' offsets) and
    --anchor_share (calibrated by the merge over the first documents of the whole input): the same rows."""
    inp = corpus(tmp_path / "in", ids=False)
    flags = ["--anchor_share", "0.5"]
    ref = select(inp, tmp_path / "one", tiny_bert, *flags)
    stats = select(inp, tmp_path / "three", tiny_bert, *flags, "--executor", "local", "--tasks", "3",
                   "--workers", "1")
    assert rows_digest(tmp_path / "three") == rows_digest(tmp_path / "one")
    assert stats["centrality_threshold"] == ref["centrality_threshold"] and stats["doc_ids"] == ref["doc_ids"]
    ids = {r["doc_id"] for f in (tmp_path / "three").glob("groups-*.parquet") for r in pq.read_table(f).to_pylist()}
    assert "48" in ids or "47" in ids  # file 3's records are numbered after files 0-2 (15 x 3 + the bad line)


def test_a_repeated_id_across_tasks_is_refused_naming_both_places(tmp_path, tiny_bert):
    """Without --skip_bad_lines an id repeated in another task's file is refused as the one-process reader refuses
    it: the later record's file and line, and where the id was first seen."""
    inp = tmp_path / "in"
    inp.mkdir()
    docs = [json.loads(line) for line in open(DOCS, encoding="utf-8")][:4]
    (inp / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:2]))
    (inp / "b.jsonl").write_text("".join(json.dumps(d) + "\n" for d in [docs[2], docs[0]]))
    with pytest.raises(UserError, match=r"b\.jsonl:2: duplicate_id: .* already seen at .*a\.jsonl:1"):
        stages.main(["--input", str(inp), "--output_dir", str(tmp_path / "out"), "--model_name_or_path",
                     str(tiny_bert), "--executor", "local", "--tasks", "2", "--workers", "1"])
    with pytest.raises(UserError, match=r"b\.jsonl:2: duplicate_id"):  # the one-process command says the same
        sg.main(["--input", str(inp), "--output_dir", str(tmp_path / "one"), "--model_name_or_path", str(tiny_bert)])


def test_a_killed_run_redoes_only_its_unfinished_tasks(tmp_path, tiny_bert):
    """SIGKILL of the whole run once the selection stage's task 0 is marked completed; the rerun skips the
    completed stages and tasks (datatrove's markers), selects only the rest, and the groups equal the one-process
    command's. A rerun with another --tasks or another selection flag is refused, naming it."""
    inp = corpus(tmp_path / "in")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "select_groups_datatrove.py"), "--input", str(inp), "--output_dir", str(out),
           "--model_name_or_path", str(tiny_bert), "--skip_bad_lines", "--chunk_docs", "7", "--executor", "local",
           "--tasks", "3", "--workers", "1"]
    marks = out / sg.META_DIR / "datatrove" / "logs" / "select" / "completions"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while not (marks / "00000").exists() and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sorted(os.listdir(marks))
    assert "00000" in done and len(done) < 3, done  # the premise: killed between the selection's tasks
    assert not (out / "stats.json").exists()

    for flags, what in ((["--tasks", "2"], "datatrove_tasks"), (["--tasks", "3", "--rrf_k", "20"], "rrf_k")):
        bad = [*cmd[:cmd.index("--tasks")], *flags, "--workers", "1"]
        with pytest.raises(UserError, match=f"unfinished selection made with other settings \\({what} differ"):
            stages.main(bad[2:])

    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    log = rerun.stdout + rerun.stderr
    assert "Not doing anything as all 3 tasks have already been completed" in log  # the frequencies stage
    assert f"Skipping {len(done)} already completed tasks" in log  # the selection stage
    assert "select task 0/3" not in log and "select task 2/3" in log
    ref = tmp_path / "one"
    select(inp, ref, tiny_bert)
    assert rows_digest(out) == rows_digest(ref)


def _stage_args(tmp_path, *flags):
    inp = tmp_path / "in.jsonl"
    inp.write_text(DOCS.read_text(encoding="utf-8"))
    args = stages.parse_args(["--input", str(inp), "--output_dir", str(tmp_path / "out"), "--model_name_or_path",
                              "all-MiniLM-L6-v2", *flags])
    args.launched_at = 0.0
    return args, sg.Selection.from_args(args)


def test_slurm_and_ray_executors_are_built_with_the_stages_and_resources(tmp_path, capsys):
    """Neither can run here: the built executors are checked. Four stages chained by `depends`; --tasks for the
    frequencies and selection stages, one task for the merges; a GPU per task (--gpus_per_task, default 1) for
    the stages that embed (the merge only with --anchor_share, the finish only with --inspect); the executor's own
    options passed through; --dry_run prints them and writes nothing."""
    args, sel = _stage_args(tmp_path, "--executor", "slurm", "--tasks", "64", "--executor_option", "partition=gpu",
                            "--executor_option", "time=04:00:00", "--executor_option", "cpus_per_task=8")
    exs = stages.build_executors(args, sel)
    assert [type(e).__name__ for e in exs] == ["SlurmPipelineExecutor"] * 4
    assert [e.world_size for e in exs] == [64, 1, 64, 1]
    assert [e.depends for e in exs] == [None, *exs[:3]]
    assert [e.gpus_per_task for e in exs] == [0, 0, 1, 0]
    assert {(e.partition, e.time, e.cpus_per_task) for e in exs} == {("gpu", "04:00:00", 8)}
    assert [type(e.pipeline[0]) for e in exs] == [stages.CountFrequencies, stages.MergeFrequencies,
                                                  stages.SelectChunks, stages.Finish]
    assert [e.job_name for e in exs] == [f"xprt-select-{s}" for s in stages.STAGES]

    args, sel = _stage_args(tmp_path, "--executor", "ray", "--tasks", "8", "--gpus_per_task", "2", "--anchor_share",
                            "0.3", "--inspect", "5")
    exs = stages.build_executors(args, sel)  # ray is not installed: building needs it not, running does
    assert [type(e).__name__ for e in exs] == ["RayPipelineExecutor"] * 4
    assert [e.world_size for e in exs] == [8, 1, 8, 1] and [e.gpus_per_task for e in exs] == [0, 2, 2, 2]
    assert [e.depends for e in exs] == [None, *exs[:3]]

    with pytest.raises(UserError, match="--executor slurm: .*partition.*--executor_option KEY=VALUE"):
        stages.build_executors(*_stage_args(tmp_path, "--executor", "slurm"))

    stages.main(["--input", str(tmp_path / "in.jsonl"), "--output_dir", str(tmp_path / "dry"), "--model_name_or_path",
                 "all-MiniLM-L6-v2", "--executor", "slurm", "--tasks", "4", "--executor_option", "partition=gpu",
                 "--executor_option", "time=1:00:00", "--dry_run"])
    printed = capsys.readouterr().out
    assert "stage select: SlurmPipelineExecutor, 4 task(s), depends on merge" in printed
    assert "'gpus_per_task': 1" in printed and "3. select: passages" in printed
    assert not (tmp_path / "dry").exists()


def test_executor_flags_are_checked():
    """select_groups.py knows no executor flag (select_groups_datatrove.py's own), select_groups_datatrove.py needs
    --executor; a Hub dataset or --max_docs with it, a malformed option: one line each."""
    base = ["--input", str(DOCS), "--output_dir", "x"]
    for flag in (["--executor", "local"], ["--tasks", "3"]):
        with pytest.raises(UserError, match=f"unrecognized arguments: {' '.join(flag)}") as err:
            sg.parse_args([*base, *flag])
        assert "\n" not in str(err.value)
    for argv in (base, [*base, "--tasks", "3"], [*base, "--executor", "local", "--max_docs", "5"],
                 ["--dataset", "a/b", "--output_dir", "x", "--executor", "local"]):
        with pytest.raises(UserError, match="--executor") as err:
            stages.parse_args(argv)
        assert "\n" not in str(err.value)
    args = sg.parse_args(base)  # what the shared code reads of the executor flags: no executor
    assert (args.executor, args.tasks, args.workers, args.executor_option, args.dry_run, args.gpus_per_task) == (
        None, 1, -1, [], False, None)
    with pytest.raises(UserError, match="--executor_option 'partition': give KEY=VALUE"):
        stages.executor_options(["partition"])
    assert stages.executor_options(["time=04:00:00", "cpus_per_task=8", "sbatch_args={\"a\": 1}"]) == {
        "time": "04:00:00", "cpus_per_task": 8, "sbatch_args": {"a": 1}}


def test_an_executor_this_machine_cannot_reach_is_refused_before_any_work(tmp_path):
    """No sbatch here, no ray package: one line each, and the output folder is never made."""
    base = ["--input", str(DOCS), "--output_dir", str(tmp_path / "out"), "--model_name_or_path", "all-MiniLM-L6-v2"]
    with pytest.raises(UserError, match="--executor slurm: no sbatch on this machine's PATH"):
        stages.main([*base, "--executor", "slurm", "--executor_option", "partition=gpu", "--executor_option",
                     "time=1:00"])
    with pytest.raises(UserError, match="--executor ray: the ray package is not installed"):
        stages.main([*base, "--executor", "ray"])
    assert not (tmp_path / "out").exists()


def test_a_task_embeds_on_its_gpu():
    """The CUDA branch of a task's device, from a CPU: GPU rank % visible GPUs, the CPU without any."""
    assert str(stages.task_device(5, 4)) == "cuda:1" and str(stages.task_device(5, 1)) == "cuda:0"
    assert str(stages.task_device(5, 0)) == "cpu"
