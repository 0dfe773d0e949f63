"""Every output true (issue 62, item 5): a --limit sample's scores enter a model card labelled as a sample (and
--help says where they go), and the two library lines every run printed ("Setting accelerator to CPU", "Removed
shared tensor ...") are dropped where they say nothing. finetune.py's mining line is tested with its stop
(tests/test_stop_signals.py)."""

import logging
import subprocess
import sys
from pathlib import Path

from test_evaluate import _xprt_run_folder, write_beir
from test_train import make_groups

import evaluate as ev
from plumbing import common

ROOT = Path(__file__).resolve().parent.parent


def test_a_limit_samples_scores_enter_the_card_labelled_and_help_says_so(tiny_bert, tmp_path, capsys):
    """evaluate.py --limit on an xprt folder: the card's row says it is a --limit sample, in the section apart from
    full tasks (never model-index); --help (before: 'a local xprt folder scored on full tasks gets the scores in its
    model card') says where sample scores go."""
    from huggingface_hub import ModelCard

    model = _xprt_run_folder(tiny_bert, tmp_path / "runs" / "myrun")
    beir = write_beir(tmp_path / "scifact")
    ev.main(["--models", str(model), "--local_tasks", f"SciFact={beir}", "--limit", "3", "--output_dir",
             str(tmp_path / "out"), "--results_dir", str(tmp_path / "results"), "--batch_size", "2"])
    card = (model / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| SciFact |"))
    assert "a --limit 3 sample" in row and "## Scores on local data" in card
    assert ModelCard(card).data.eval_results is None
    capsys.readouterr()
    try:
        ev.parse_args(["--help"])
    except SystemExit:
        pass
    said = " ".join(capsys.readouterr().out.split())
    assert "a --limit sample's in a section of their own" in said and "labelled as the sample they are" in said


def test_the_library_lines_are_dropped_narrowly(tiny_bert, tmp_path):
    """A real 2-step run with a checkpoint every step prints neither line (before: one "Setting accelerator to CPU"
    and one "Removed shared tensor" per checkpoint); the filter drops a "Removed shared tensor" only when every
    tensor is a tied MLM decoder."""
    groups = make_groups(tmp_path / "g", 16)
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model_name_or_path", str(tiny_bert),
                          "--groups_dir", str(groups), "--output_dir", str(tmp_path / "run"), "--max_train_steps", "2",
                          "--checkpointing_steps", "1", "--per_device_train_batch_size", "4", "--max_length", "32",
                          "--report_to", "none", "--no_save_model"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    said = res.stdout + res.stderr
    assert "Setting accelerator" not in said and "Removed shared tensor" not in said
    assert len(list((tmp_path / "run" / "checkpoints").glob("step_*"))) == 2

    def kept(msg):
        return common.LibraryNoise().filter(logging.LogRecord("x", logging.WARNING, "f", 1, msg, None, None))

    assert not kept("[RANK 0] Removed shared tensor {'encoder.cls.predictions.decoder.weight', "
                    "'encoder.cls.predictions.decoder.bias'} while saving. This should be OK")
    assert kept("Removed shared tensor {'encoder.embeddings.word_embeddings.weight'} while saving.")
    assert kept("another warning")
