"""Long runs survive what ends them (issue 43, family 4): a scheduler's SIGTERM / SIGUSR1 is answered with a
checkpoint of the step it arrived in (and the resumed run is the uninterrupted one), a long run is checkpointed by
default, and a full disk is said as a full disk with nothing partial left. Every run here is a real train.py run."""

import errno
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_train import base_args, groups, read_log, run  # noqa: F401  (groups: a fixture)

from plumbing import common, training
from plumbing.common import UserError

ROOT = Path(__file__).resolve().parents[1]


def steps_logged(out: Path) -> list:
    return [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("sig, workers", [(signal.SIGTERM, 2), (signal.SIGUSR1, 0), (signal.SIGINT, 2)])
def test_a_stop_signal_writes_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one(sig, workers, tiny_bert,
                                                                                      groups, tmp_path):
    """A live run (its own process; with loader workers, which the signal reaches too when a scheduler signals the
    process group) gets the signal after step 3: it finishes the step it is in, writes checkpoints/step_N (no
    periodic checkpoint is due), says so, and exits 128 + the signal's number. The same command with
    --resume_from_checkpoint latest continues from step N, and its losses equal an uninterrupted run's."""
    out = tmp_path / "run"
    flags = {"--max_train_steps": 100000, "--num_related": 2, "--max_length": 24, "--dataloader_num_workers": workers}
    argv = [str(a) for a in base_args(tiny_bert, groups, out, **flags)]
    log = open(tmp_path / "a.log", "w")
    a = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not ((out / "train_log.jsonl").exists() and len(steps_logged(out)) >= 3):
            assert a.poll() is None and time.time() < deadline, (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.2)
        import os

        os.killpg(a.pid, sig)  # as Slurm does: the whole process group, loader workers included
        rc = a.wait(timeout=300)
    finally:
        if a.poll() is None:
            a.kill()
        log.close()
    said = (tmp_path / "a.log").read_text()
    assert rc == 128 + sig, said[-3000:]
    stopped = steps_logged(out)[-1]
    assert f"{sig.name} at step {stopped}: checkpoint written" in said
    assert [p.name for p in training.list_checkpoints(out / "checkpoints")] == [f"step_{stopped}"]
    assert not (out / "model").exists() and not (out / "run.lock").exists()
    run(argv + ["--resume_from_checkpoint", "latest", "--stop_after_steps", str(stopped + 2)])
    assert steps_logged(out) == list(range(1, stopped + 3))  # continued from the checkpoint, no step twice
    fresh = tmp_path / "fresh"
    run(base_args(tiny_bert, groups, fresh, **flags, **{"--stop_after_steps": stopped + 2}))
    resumed, whole = read_log(out), read_log(fresh)
    for step in (stopped + 1, stopped + 2):
        assert resumed[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5, abs=1e-6)


def test_a_long_run_is_checkpointed_by_default_and_said(tiny_bert, groups, tmp_path, capsys):
    """--checkpointing_steps unset: every DEFAULT_CHECKPOINT_EVERY steps in a longer run, none in a shorter one; 0
    turns it off; the run's first line says which."""
    every = training.DEFAULT_CHECKPOINT_EVERY
    pick = [training.checkpoint_interval(SimpleNamespace(checkpointing_steps=c), n)
            for c, n in [(None, every + 1), (None, every), (0, 10**6), (7, 10)]]
    assert pick == [every, 0, 0, 7]
    run(base_args(tiny_bert, groups, tmp_path / "run", **{"--max_train_steps": every + 1, "--stop_after_steps": 2,
                                                          "--num_related": 2, "--max_length": 24}))
    assert f"a checkpoint every {every} steps (and one on SIGTERM / SIGUSR1 / Ctrl-C)" in capsys.readouterr().out


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB filesystem (tmpfs, mounted as root): a run's first files fit, the tiny model's checkpoint (about 12
    MB with AdamW's moments) and its model folder (about 5 MB) do not."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root: the full-disk case runs where it can")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("what", ["checkpoint", "model"])
def test_a_full_disk_is_said_as_one_and_leaves_nothing_partial(what, small_disk, tiny_bert, groups):
    """On a really full disk (before: torch's 'unexpected pos' traceback and a partial step_N folder): the save is
    refused in one line naming the folder and 'the disk is full', and neither a partial checkpoint nor a half model
    folder (nor an atomic write's temporary) is left."""
    out = small_disk / "run"
    flags = {"--max_train_steps": 2, "--num_related": 2, "--max_length": 24, "--report_to": "none"}
    if what == "checkpoint":
        flags["--checkpointing_steps"] = 1
    with pytest.raises(UserError, match="not written: the disk is full") as err:
        run(base_args(tiny_bert, groups, out, **flags))
    assert ("checkpoints/step_1" if what == "checkpoint" else "run/model") in str(err.value)
    assert not (out / "checkpoints" / "step_1").exists() and not (out / "model").exists()
    assert not [p for p in out.rglob("*") if p.name.startswith((".tmp-", ".old-"))]


def test_disk_full_reads_the_errno_and_nothing_else(tmp_path):
    """disk_full: an ENOSPC / EDQUOT anywhere in the chain is a full disk; another error on a disk with room is
    not (it is raised as it is)."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 4096 vs 0") from inner
    except RuntimeError as err:
        assert "the disk is full" in common.disk_full(err, tmp_path / "x")
    assert common.disk_full(OSError(errno.EDQUOT, "quota"), tmp_path) is not None
    assert common.disk_full(OSError(errno.EACCES, "denied"), tmp_path) is None
    assert common.disk_full(ValueError("a bug"), tmp_path) is None
