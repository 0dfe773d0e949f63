"""A run's identity (training.py, section 4): one live run per folder, a resume or a rerun that is the same run, and
a log that continues from the checkpoint (issue 43, family 1). Every run here is a real train.py run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import base_args, groups, read_log, run  # noqa: F401  (groups: a fixture)

from plumbing import common, training
from plumbing.common import UserError

ROOT = Path(__file__).resolve().parents[1]


def logged_steps(out: Path) -> list:
    """The steps of train_log.jsonl's loss records, in file order (read_log's dict would hide a repeat)."""
    return [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_a_second_live_run_is_refused_and_a_killed_ones_lock_taken_over(tiny_bert, groups, tmp_path):
    """Run A (its own process) trains in the folder; run B, started there meanwhile, is refused naming A's pid and
    writes nothing; A is killed (SIGKILL: its lock stays); B then takes the dead run's lock over and runs fresh."""
    out = tmp_path / "run"
    argv = base_args(tiny_bert, groups, out, **{"--max_train_steps": 100000, "--num_related": 2, "--max_length": 24})
    log = open(tmp_path / "a.log", "w")
    a = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *map(str, argv)], cwd=ROOT, stdout=log,
                         stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not (out / "train_log.jsonl").exists():  # A is past its start and training
            assert a.poll() is None and time.time() < deadline, (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.5)
        with pytest.raises(UserError, match=f"in use by a live run \\(pid {a.pid}, started"):
            run(argv + ["--stop_after_steps", "3"])
        assert json.loads((out / "run.lock").read_text())["pid"] == a.pid  # B left A's lock (and run) alone
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
        log.close()
    assert (out / "run.lock").exists()  # a killed run cannot remove its lock
    run(argv + ["--stop_after_steps", "3"])  # the same run: the killed one's lock and log are taken over
    assert logged_steps(out) == [1, 2, 3] and not (out / "run.lock").exists()  # a fresh log; the lock released


def test_a_resume_that_is_another_run_is_refused_naming_each_difference(tiny_bert, groups, tmp_path):
    """Stopped at step 3 after a checkpoint at 2: a resume with another --learning_rate, or from groups whose
    content changed, is refused naming it; the same run resumes from step 2 and the log continues from there
    (no step twice). The checkpoint carries the record it is checked against."""
    data = tmp_path / "groups"
    shutil.copytree(groups, data)
    out = tmp_path / "run"
    common = {"--max_train_steps": 5, "--num_related": 2, "--max_length": 24, "--learning_rate": 1e-4,
              "--checkpointing_steps": 2}
    run(base_args(tiny_bert, data, out, **common, **{"--stop_after_steps": 3}))
    assert logged_steps(out) == [1, 2, 3] and (out / "checkpoints" / "step_2" / "run.json").exists()
    resume = {"--resume_from_checkpoint": "latest"}
    with pytest.raises(UserError, match=r"--learning_rate 0.0001 there, 0.00011 here") as err:
        run(base_args(tiny_bert, data, out, **{**common, "--learning_rate": 1.1e-4}, **resume))
    assert "--overwrite" in str(err.value) and logged_steps(out) == [1, 2, 3]
    shard = next(data.glob("*.parquet"))
    original = shard.read_bytes()
    shard.write_bytes(original + b"\0")  # the groups changed under the run (their reader is never reached)
    with pytest.raises(UserError, match=r"--groups_dir's content \(sha256 \w{12} there, \w{12} here\)"):
        run(base_args(tiny_bert, data, out, **common, **resume))
    shard.write_bytes(original)
    r = run(base_args(tiny_bert, data, out, **common, **resume))
    assert r["completed_steps"] == 5 and logged_steps(out) == [1, 2, 3, 4, 5]
    lrs = {s: rec["lr"] for s, rec in read_log(out).items()}
    assert max(lrs.values()) <= 1e-4  # the old schedule, as the card says
    card = (out / "model" / "README.md").read_text()
    assert "1.1e-04" not in card and "0.00011" not in card


def test_a_rerun_after_a_kill_starts_a_fresh_log_or_is_refused_when_it_differs(tiny_bert, groups, tmp_path):
    """A run killed before its first checkpoint (here: stopped at step 2, no checkpoints) leaves a log. The same
    command again starts a fresh log (not 1, 2, 1, 2, ...); another command is refused naming the difference, and
    --overwrite starts it afresh. A start that failed before any step has nothing to keep: another command runs."""
    out = tmp_path / "run"
    common = {"--max_train_steps": 3, "--num_related": 2, "--max_length": 24}
    run(base_args(tiny_bert, groups, out, **common, **{"--stop_after_steps": 2}))
    assert logged_steps(out) == [1, 2]
    with pytest.raises(UserError, match=r"the run .* holds \(killed\): --seed 7 there, 8 here"):
        run(base_args(tiny_bert, groups, out, **{**common, "--seed": 8}))
    run(base_args(tiny_bert, groups, out, **common))
    assert logged_steps(out) == [1, 2, 3]
    run(base_args(tiny_bert, groups, out, **{**common, "--seed": 8}, **{"--overwrite": True}))
    assert logged_steps(out) == [1, 2, 3] and json.loads((out / "run.json").read_text())["flags"]["seed"] == 8


def test_unchanged_files_keep_their_recorded_hash_and_changes_are_found(tmp_path, monkeypatch):
    """content_digest rereads only files whose size or mtime changed; the digest follows content, not the path."""
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(3):
        (folder / f"shard-{i}.parquet").write_bytes(bytes([i]) * 1000)
    (folder / ".tmp-1-shard-9.parquet").write_bytes(b"leftover")  # skipped: a killed write's leftover
    first = training.content_digest([folder], {})
    reads = []
    real = training.hashlib.file_digest
    monkeypatch.setattr(training.hashlib, "file_digest", lambda f, name: reads.append(f.name) or real(f, name))
    assert training.content_digest([folder], first["files"]) == first and reads == []
    (folder / "shard-1.parquet").write_bytes(b"\1" * 999)
    changed = training.content_digest([folder], first["files"])
    assert changed["sha256"] != first["sha256"] and reads == [str(folder / "shard-1.parquet")]
    moved = tmp_path / "elsewhere"
    shutil.copytree(folder, moved)
    assert training.content_digest([moved], {})["sha256"] == changed["sha256"]


def test_every_process_checks_the_folder_before_the_main_one_locks_it(tiny_bert, groups, tmp_path, monkeypatch):
    """Two processes (threads here, with a barrier as accelerate's wait_for_everyone) prepare one fresh folder; the
    second is slow between reading the folder's record and listing its files (the window a 2-process CI run hit).
    It must not find the main one's run.lock (and refuse its own run, as a 2-process
    torchrun once did): the main process records and locks only after every process has checked."""
    import threading

    import train
    from plumbing.common import local_inputs

    barrier = threading.Barrier(2, timeout=60)

    class Rank:  # the part of an Accelerator prepare_output_dir uses, one per 'process'
        def __init__(self, rank):
            self.is_main_process, self.num_processes, self.mixed_precision = rank == 0, 2, "no"

        def wait_for_everyone(self):
            barrier.wait()

        def print(self, *a):
            pass

    present = common.present_outputs
    calls = []

    def slow_for_rank_1(out, patterns):
        found = present(out, patterns)
        if threading.current_thread().name == "rank1" and not calls:
            calls.append(1)
            time.sleep(1.0)  # between reading the record and listing the folder: the main process locks it now,
        return found  # unless it waits

    monkeypatch.setattr(common, "present_outputs", slow_for_rank_1)
    out = tmp_path / "run"
    args = train.parse_args(list(map(str, base_args(tiny_bert, groups, out))))
    inputs = local_inputs(groups_dir=args.groups_dir, model_name_or_path=args.model_name_or_path)
    errors = {}

    def prepare(rank):
        try:
            training.prepare_output_dir(Rank(rank), args, "train.py", inputs)
        except BaseException as err:  # noqa: BLE001  (the test reports it)
            errors[rank] = err
            barrier.abort()

    threads = [threading.Thread(target=prepare, args=(r,), name=f"rank{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
    assert (out / "run.json").exists()
    training.release_run_lock(out / "run.lock")


def test_the_code_revision_covers_every_script_of_the_repository(tmp_path):
    """training.code_revision (the run record's "code", compared on resume) hashes the root's scripts, plumbing/ and
    baselines/: an edit of modeling_xprt.py, train.py or an arm changes it (after the move to plumbing/ it hashed
    plumbing/ alone until this test)."""
    import importlib.util
    import shutil

    root = Path(__file__).resolve().parent.parent
    for d in ("", "plumbing", "baselines"):
        (tmp_path / d).mkdir(exist_ok=True)
        for f in (root / d).glob("*.py"):
            shutil.copy(f, tmp_path / d / f.name)
    spec = importlib.util.spec_from_file_location("training_copy", tmp_path / "plumbing" / "training.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    seen = [copy.code_revision()["sha256"]]
    for f in ("modeling_xprt.py", "train.py", "baselines/retromae.py", "plumbing/batches.py"):
        with open(tmp_path / f, "a") as fh:
            fh.write("\n# edited\n")
        seen.append(copy.code_revision()["sha256"])
    assert len(set(seen)) == len(seen)
