"""experiments/nano/summarize.py on the experiment's own outputs (experiments/nano/results: evaluate.py's
results.json of every seed and the train logs, as run.sh wrote them): its table must agree with evaluate.py's
own averages, and its stop rule must read the first seed the way run.sh relies on."""

import importlib.util
import json
import shutil
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "nano" / "results"
ARMS = ["xprt", "contrastive_random_span", "self_reconstruction", "xprt_random_positive", "xprt_no_fill_in"]

spec = importlib.util.spec_from_file_location("nano_summarize", ROOT / "experiments" / "nano" / "summarize.py")
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)


@pytest.fixture()
def out(tmp_path):
    if not RESULTS.is_dir():
        pytest.skip("experiments/nano/results not present")
    dst = tmp_path / "nano"
    shutil.copytree(RESULTS, dst)
    return dst


def test_table_agrees_with_evaluate_averages(out):
    assert summarize.main(["--out", str(out), "--arms", *ARMS]) == 0
    tab = json.loads((out / "results.json").read_text())
    evals = [json.loads(p.read_text()) for p in sorted(out.glob("eval_s*/results.json"))]
    assert tab["seeds"] == [int(p.parent.name[len("eval_s"):]) for p in sorted(out.glob("eval_s*/results.json"))]
    # evaluate.py's average of each model (the MLM start first, then the arms in run.sh's order)
    per_arm = {a: [e["summary"]["average"][e["models"][i + 1]] for e in evals] for i, a in enumerate(ARMS)}
    start = evals[0]["summary"]["average"][evals[0]["models"][0]]
    row = tab["table"]["[average]"]
    assert row["start"] == pytest.approx(start, abs=1e-9)
    for a in ARMS:
        mean, sd, delta = row[a]
        assert mean == pytest.approx(statistics.mean(per_arm[a]), abs=1e-9)
        assert sd == pytest.approx(statistics.stdev(per_arm[a]) if len(per_arm[a]) > 1 else 0.0, abs=1e-9)
        assert delta == pytest.approx(mean - start, abs=1e-9)
    # a category row is the mean of its tasks, as evaluate.py's per_category
    for cat, score in evals[0]["summary"]["per_category"][evals[0]["models"][0]].items():
        assert tab["table"][f"[{cat}]"]["start"] == pytest.approx(score, abs=1e-9)
    md = (out / "results.md").read_text()
    assert md.count("\n| ") == 1 + len(tab["table"])  # header + one line per row
    assert (out / "loss_curves.png").stat().st_size > 10_000


def test_stop_rule_on_the_first_seed(out):
    first = json.loads(sorted(out.glob("eval_s*/results.json"))[0].read_text())
    avgs = [first["summary"]["average"][m] for m in first["models"][1:]]
    spread = max(avgs) - min(avgs)
    args = ["--out", str(out), "--arms", *ARMS, "--stop_check"]
    # exit 0 = the arms separate (go on), 1 = within noise (stop): run.sh's `if ! summarize --stop_check` reads this
    assert summarize.main(args + ["--noise", str(spread - 0.01)]) == 0
    assert summarize.main(args + ["--noise", str(spread + 0.01)]) == 1


def test_pretrain_mlm_overwrite_replaces_only_its_own_outputs(tmp_path):
    """experiments/nano/pretrain_mlm.py --overwrite replaces the files it recorded writing and nothing else (a user's
    file in the folder stays; a stranger's file named like an output is refused); an input inside the output folder
    is refused; without --overwrite a second run is refused in one line."""
    spec = importlib.util.spec_from_file_location("pretrain_mlm", ROOT / "experiments" / "nano" / "pretrain_mlm.py")
    mlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mlm)
    corpus, out = tmp_path / "docs.jsonl", tmp_path / "out"
    words = "the model reads passages of web text and learns which words fill the masked slots".split()
    corpus.write_text("".join(json.dumps({"text": " ".join(words[i:] + words[:i]) * 4}) + "\n" for i in range(12)))
    def args(folder):
        return ["--inputs", str(corpus), "--output_dir", str(folder), "--vocab_size", "200", "--hidden_size", "32",
                "--num_layers", "1", "--num_heads", "2", "--intermediate_size", "64", "--block_size", "16",
                "--per_device_train_batch_size", "4", "--max_steps", "2", "--logging_steps", "1", "--eval_share", "0.2"]

    argv = args(out)
    with pytest.raises(mlm.UserError, match="holds --inputs"):  # the corpus inside the output folder
        mlm.main(args(tmp_path))
    out.mkdir()
    (out / "notes.jsonl").write_text("the user's own file\n")
    mlm.main(argv)
    assert (out / "model.safetensors").exists()
    with pytest.raises(mlm.UserError, match="--overwrite"):
        mlm.main(argv)
    mlm.main(argv + ["--overwrite"])
    assert (out / "model.safetensors").exists() and (out / "notes.jsonl").read_text() == "the user's own file\n"
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "config.json").write_text("{}")  # named like an output, written by someone else
    with pytest.raises(mlm.UserError, match="no record of writing it"):
        mlm.main(args(stranger) + ["--overwrite"])
    assert (stranger / "config.json").read_text() == "{}"
