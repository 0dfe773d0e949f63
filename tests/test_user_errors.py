"""A user's mistake is one message, at the start (common.UserError, caught by common.run_script at each script's
entry): every refusal path of the four scripts prints one line `script: message` naming the flag or file, exits 2,
shows no traceback, and, where the work is expensive (loading a model, mining, encoding), comes before it: those
functions are replaced by ones that fail the test if they are reached."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_evaluate import write_beir
from test_finetune import make_beir
from test_train import make_groups, reset_accelerate

import evaluate as ev
import finetune
import select_groups as sg
import train
from plumbing import common, readers

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"train": train, "finetune": finetune, "select_groups": sg, "evaluate": ev}
# the expensive work of each script, which a refusal must come before
EXPENSIVE = {"train": ["load_model"], "finetune": ["load_model", "mine_hard_negatives"],
             "select_groups": ["load_selection_encoder"], "evaluate": ["XPRTEncoder"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_bert):
    """The inputs the refusals start from: a groups folder, a BEIR folder, a corpus, a regular file (a folder under
    it cannot be made, even by root), a zero-groups selection's stats, MS MARCO's qrels file alone."""
    root = tmp_path_factory.mktemp("inputs")
    d = {"model": tiny_bert, "groups": make_groups(root / "groups", 8), "beir": make_beir(root / "beir"),
         "eval_beir": write_beir(root / "scifact"), "corpus": ROOT / "data" / "docs.jsonl", "root": root}
    (root / "a_file").write_text("a regular file\n")
    d["under_file"] = root / "a_file" / "out"
    (root / "no_stats").mkdir()
    (root / "zero").mkdir()
    (root / "zero" / "stats.json").write_text(json.dumps({"groups": 0, "no_groups_reason": "every document is short"}))
    (root / "ms").mkdir()
    (root / "ms" / "qrels.train.tsv").write_text("q1\t0\tp1\t1\n")
    (root / "bad.jsonl").write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": broken\n')
    (root / "txts").mkdir()
    for name in ("a.txt", "b.txt"):
        (root / "txts" / name).write_text("One document in a plain text file.\n")
    (root / "remote").mkdir()  # a model only its own code builds (auto_map, a model_type transformers lacks)
    (root / "remote" / "config.json").write_text(json.dumps({
        "model_type": "my_bert", "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                                              "AutoModel": "modeling_my.MyModel"}}))
    (root / "empty.jsonl").write_text('{"id": "a", "text": ""}\n{"id": "b", "text": "   "}\n')
    (root / "bad_pairs.jsonl").write_text('{"query": "q", "pos": ["p"]}\n{"query": "r", "pos": broken\n')
    return d


def T(d, out, **kw):  # train.py's argv
    args = {"--model_name_or_path": d["model"], "--groups_dir": d["groups"], "--output_dir": out,
            "--per_device_train_batch_size": 2, "--report_to": "none"}
    args.update(kw)
    return [str(x) for k, v in args.items() if v is not None for x in ((k,) if v is True else (k, v))]


def F(d, out, **kw):  # finetune.py's argv
    args = {"--model_name_or_path": d["model"], "--beir_dir": d["beir"], "--output_dir": out,
            "--per_device_train_batch_size": 2, "--report_to": "none"}
    args.update(kw)
    return [str(x) for k, v in args.items() if v is not None for x in ((k,) if v is True else (k, v))]


def S(d, out, **kw):  # select_groups.py's argv
    args = {"--input": d["corpus"], "--model_name_or_path": d["model"], "--output_dir": out, "--max_docs": 6}
    args.update(kw)
    return [str(x) for k, v in args.items() if v is not None for x in ((k,) if v is True else (k, v))]


def E(d, out, **kw):  # evaluate.py's argv
    args = {"--models": d["model"], "--local_tasks": f"SciFact={d['eval_beir']}", "--output_dir": out,
            "--results_dir": d["root"] / "results"}
    args.update(kw)
    return [str(x) for k, v in args.items() if v is not None for x in ((k,) if v is True else (k, v))]


def _stranger_results(d, out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("my own notes\n")


def _model_inside(d, out):
    import shutil

    shutil.copytree(d["model"], out / "model")


def _corpus_inside(d, out):
    out.mkdir(parents=True)
    (out / "docs.jsonl").write_text(d["corpus"].read_text())


def _beir_inside(d, out):
    make_beir(out / "beir")


# (script, argv(d, out), what the one line must say, setup(d, out) or None, work it comes before (None: all of it))
CASES = {
    # train.py
    "train-missing-flag": ("train", lambda d, o: ["--output_dir", str(o)], "required: --groups_dir", None, None),
    "train-mask-rate": ("train", lambda d, o: T(d, o, **{"--encoder_mask_rate": 1.5}),
                        "--encoder_mask_rate must be in [0, 1)", None, None),
    "train-scheduler": ("train", lambda d, o: T(d, o, **{"--lr_scheduler_type": "cosin"}),
                        "argument --lr_scheduler_type: invalid choice: 'cosin'", None, None),
    "train-steps-0": ("train", lambda d, o: T(d, o, **{"--max_train_steps": 0}),
                      "argument --max_train_steps: 0 is not an integer >= 1", None, None),
    "train-revela-rank": ("train", lambda d, o: T(d, o, **{"--objective": "revela", "--lora_rank": -8}),
                          "argument --lora_rank: -8 is not an integer >= 1", None, None),
    "train-revela-dropout": ("train", lambda d, o: T(d, o, **{"--objective": "revela", "--lora_dropout": 1.0}),
                             "argument --lora_dropout: 1.0 is not a rate in [0, 1)", None, None),
    "train-revela-temperature": ("train", lambda d, o: T(d, o, **{"--objective": "revela", "--attn_temperature": 0}),
                                 "argument --attn_temperature: 0 is not a number > 0", None, None),
    "train-revela-anchors": ("train", lambda d, o: T(d, o, **{"--objective": "revela", "--extra_anchors": -1}),
                             "argument --extra_anchors: -1 is not an integer >= 0", None, None),
    "train-eval-steps": ("train", lambda d, o: T(d, o, **{"--eval_steps": 2}), "--eval_steps needs --eval_tasks",
                         None, None),
    "train-save-best": ("train", lambda d, o: T(d, o, **{"--save_best": "SciFact"}), "--save_best needs --eval_tasks",
                        None, None),
    "train-offline-name": ("train", lambda d, o: T(d, o, **{"--model_name_or_path": "intfloat/e5-base-unsupervisd"}),
                           "intfloat/e5-base-unsupervisd: not a local folder, and the Hub is offline", None, None),
    "train-teacher-missing": ("train", lambda d, o: T(d, o, **{"--teacher_name_or_path": "./no/teacher"}),
                              "--teacher_name_or_path ./no/teacher: no such folder", None, None),
    "train-no-stats": ("train", lambda d, o: T(d, o, **{"--groups_dir": d["root"] / "no_stats"}), "no stats.json",
                       None, None),
    "train-zero-groups": ("train", lambda d, o: T(d, o, **{"--groups_dir": d["root"] / "zero"}),
                          "the selection found no groups", None, None),
    "train-batch": ("train", lambda d, o: T(d, o, **{"--per_device_train_batch_size": 4096}),
                    "--per_device_train_batch_size 4096 x 1 process(es) needs 4096 groups for one step; the data has 8",
                    None, None),
    "train-unwritable": ("train", lambda d, o: T(d, d["under_file"]), "cannot write there", None, None),
    "train-model-inside": ("train", lambda d, o: T(d, o, **{"--model_name_or_path": o / "model", "--overwrite": True}),
                           "holds --model_name_or_path", _model_inside, None),
    "train-eval-task-offline": ("train", lambda d, o: T(d, o, **{"--eval_tasks": "SciFact"}),
                                "--local_tasks SciFact=DIR", None, None),
    # finetune.py
    "finetune-no-data": ("finetune", lambda d, o: ["--output_dir", str(o)], "needs --beir_dir, --train_data", None,
                         None),
    "finetune-mine-only": ("finetune", lambda d, o: ["--output_dir", str(o), "--triples_file", "t.tsv", "--mine_only"],
                           "--mine_only needs a corpus", None, None),
    "finetune-push": ("finetune", lambda d, o: F(d, o, **{"--push_to_hub": True}), "--hub_model_id", None, None),
    "finetune-steps-0": ("finetune", lambda d, o: F(d, o, **{"--max_train_steps": 0}),
                         "--max_train_steps: 0 is not an integer >= 1", None, None),
    "finetune-scheduler": ("finetune", lambda d, o: F(d, o, **{"--lr_scheduler_type": "cosin"}),
                           "invalid choice: 'cosin'", None, None),
    "finetune-msmarco-qrels-alone": ("finetune", lambda d, o: F(d, o, **{
        "--beir_dir": None, "--train_data": d["root"] / "ms" / "qrels.train.tsv"}),
        "MS MARCO's layout needs ['collection.tsv', 'queries.train.tsv']", None, None),
    "finetune-mined-missing": ("finetune", lambda d, o: F(d, o, **{"--mined_negatives": d["root"] / "none.json"}),
                               "--mined_negatives", None, None),
    "finetune-batch": ("finetune", lambda d, o: F(d, o, **{"--per_device_train_batch_size": 1000}),
                       "--per_device_train_batch_size 1000 x 1 process(es) needs 1000 (query, positive) rows", None,
                       ["mine_hard_negatives"]),
    "finetune-beir-inside": ("finetune", lambda d, o: F(d, o, **{"--beir_dir": o / "beir"}), "holds --beir_dir",
                             _beir_inside, None),
    "finetune-bad-pairs": ("finetune", lambda d, o: F(d, o, **{
        "--beir_dir": None, "--train_data": d["root"] / "bad_pairs.jsonl"}), "bad_pairs.jsonl:2: not valid JSON",
        None, ["mine_hard_negatives"]),
    "finetune-unwritable": ("finetune", lambda d, o: F(d, d["under_file"]), "cannot write there", None, None),
    # issue 43: a remote-code model without the flag got transformers' text (its keyword), not this flag
    "train-remote-code": ("train", lambda d, o: T(d, o, **{"--model_name_or_path": d["root"] / "remote"}),
                          "model_type 'my_bert' is built by the code its repository ships (config.json's auto_map), "
                          "which runs only with --trust_remote_code", None, None),
    "select-remote-code": ("select_groups", lambda d, o: S(d, o, **{"--model_name_or_path": d["root"] / "remote"}),
                           "runs only with --trust_remote_code", None, None),
    "evaluate-remote-code": ("evaluate", lambda d, o: E(d, o, **{"--models": d["root"] / "remote"}),
                             "runs only with --trust_remote_code", None, None),
    "finetune-remote-code": ("finetune", lambda d, o: F(d, o, **{"--model_name_or_path": d["root"] / "remote"}),
                             "runs only with --trust_remote_code", None, None),
    # issue 43: a length past the position table failed inside the first step
    "finetune-past-positions": ("finetune", lambda d, o: F(d, o, **{"--passage_max_length": 600}),
                                "takes inputs of at most 512 positions, and a step needs 600: pass "
                                "--passage_max_length 512 or less", None, ["mine_hard_negatives"]),
    # select_groups.py
    "select-unknown-flag": ("select_groups", lambda d, o: S(d, o, **{"--passage_prefix": "p: "}),
                            "unrecognized arguments: --passage_prefix", None, None),
    "select-no-input": ("select_groups", lambda d, o: ["--output_dir", str(o)], "give exactly one of --input", None,
                        None),
    "select-input-missing": ("select_groups", lambda d, o: S(d, o, **{"--input": d["root"] / "none.jsonl"}),
                             "no such file", None, None),
    # issue 43: a folder of .txt files was "no such file"
    "select-folder-of-txt": ("select_groups", lambda d, o: S(d, o, **{"--input": d["root"] / "txts"}),
                             "save_to_disk folder under it (it holds: .txt 2); write the documents as JSON Lines",
                             None, None),
    "select-corpus-inside": ("select_groups", lambda d, o: S(d, o, **{"--input": o / "docs.jsonl",
                                                                       "--overwrite": True}), "holds --input",
                             _corpus_inside, None),
    "select-inside-input": ("select_groups", lambda d, o: S(d, d["root"] / "groups" / "out", **{
        "--input": d["root"] / "groups"}), "is inside --input", None, None),
    "select-offline-name": ("select_groups", lambda d, o: S(d, o, **{"--model_name_or_path": "intfloat/e5-bse"}),
                            "the Hub is offline", None, None),
    "select-unwritable": ("select_groups", lambda d, o: S(d, d["under_file"]), "cannot write there", None, None),
    "select-bad-record": ("select_groups", lambda d, o: S(d, o, **{"--input": d["root"] / "bad.jsonl"}),
                          "bad.jsonl:2: malformed_json", None, []),
    # issue 43: --anchor_share's calibration raised "need at least one array to concatenate" here
    "select-anchor-share-no-valid-record": ("select_groups", lambda d, o: S(d, o, **{
        "--input": d["root"] / "empty.jsonl", "--anchor_share": 0.5, "--skip_bad_lines": True}),
        "none of the 2 records read is a valid document (skipped: {'empty_text': 2})", None, []),
    # evaluate.py
    "evaluate-limit-0": ("evaluate", lambda d, o: E(d, o, **{"--limit": 0}), "--limit: 0 is not an integer >= 1",
                         None, None),
    "evaluate-prefixes": ("evaluate", lambda d, o: E(d, o, **{"--prefixes": "E5"}), "invalid choice: 'E5'", None,
                          None),
    "evaluate-task-offline": ("evaluate", lambda d, o: E(d, o, **{"--local_tasks": None, "--tasks": "SciFact"}),
                              "--tasks SciFact: mteb reads its data from the Hub (mteb/scifact)", None, None),
    "evaluate-task-misspelled": ("evaluate", lambda d, o: E(d, o, **{"--local_tasks": None, "--tasks": "SciFakt"}),
                                 "Did you mean: 'SciFact'", None, None),
    "evaluate-model-missing": ("evaluate", lambda d, o: E(d, o, **{"--models": "./no/such/model"}),
                               "--models ./no/such/model: no such folder", None, None),
    "evaluate-not-a-model": ("evaluate", lambda d, o: E(d, o, **{"--models": d["root"] / "no_stats"}),
                             "a folder but not a model", None, None),
    "evaluate-model-offline": ("evaluate", lambda d, o: E(d, o, **{"--models": "BAAI/bge-smal-en"}),
                               "the Hub is offline", None, None),
    "evaluate-local-missing": ("evaluate", lambda d, o: E(d, o, **{"--local_tasks": d["root"] / "nope"}),
                               "local task folder not found", None, None),
    "evaluate-unknown-layout": ("evaluate", lambda d, o: E(d, o, **{"--local_tasks": d["root"] / "no_stats"}),
                                "not a known task layout", None, None),
    "evaluate-stranger-results": ("evaluate", lambda d, o: E(d, o, **{"--overwrite": True}),
                                  "results.md exists and evaluate.py has no record of writing it", _stranger_results,
                                  None),
    "evaluate-unwritable": ("evaluate", lambda d, o: E(d, d["under_file"]), "cannot write there", None, None),
    # issue 43: mteb's results folder was first written after the scoring
    "evaluate-results-unwritable": ("evaluate", lambda d, o: E(d, o, **{"--results_dir": d["under_file"]}),
                                    "--results_dir", None, None),
    "evaluate-model-inside": ("evaluate", lambda d, o: E(d, o, **{"--models": o / "model"}),
                              "holds --models", _model_inside, None),
}


def refusal(monkeypatch, capsys, script, argv, before=None):
    """Run `script`'s entry point (common.run_script) on argv -> (exit status, stderr lines); the functions of
    `before` (default: all of the script's expensive work) fail the test when reached."""
    module = SCRIPTS[script]
    for name in EXPENSIVE[script] if before is None else before:
        def reached(*a, _name=name, **k):
            raise AssertionError(f"{script}: {_name} ran before the refusal")
        monkeypatch.setattr(module, name, reached)
    reset_accelerate()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        common.run_script(module.main, argv)
    # a progress bar the refusal interrupted ends in '\r', not a newline: the terminal line the message starts
    return exit_.value.code, [line for line in re.split(r"[\r\n]+", capsys.readouterr().err) if line.strip()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mistake_is_one_line_at_the_start(case, data, tmp_path, monkeypatch, capsys):
    script, argv, says, setup, before = CASES[case]
    out = tmp_path / "out"
    if setup:
        setup(data, out)
    code, err = refusal(monkeypatch, capsys, script, argv(data, out), before)
    # the message may follow what a progress bar the refusal interrupted left on its line (no newline)
    lines = [m for line in err for m in re.findall(rf"{script}\.py: .*", line)]
    assert code == 2, err
    assert len(lines) == 1 and says in lines[0], err
    assert not any("Traceback" in line for line in err)
    if before is None:  # refused at the start: nothing else was printed
        assert err == lines and lines[0].startswith(f"{script}.py: "), err


def test_zero_groups_is_an_error_that_says_why(data, tmp_path, monkeypatch, capsys):
    """A selection that finds no group fails (it used to exit 0, and train.py then said 'run select_groups.py
    first'); its stats.json says why, and train.py repeats it."""
    out = tmp_path / "zero"
    code, err = refusal(monkeypatch, capsys, "select_groups", S(data, out, **{"--centrality_threshold": 1.1}), [])
    assert code == 2 and "no groups in" in err[-1] and "lower --centrality_threshold, or set --anchor_share" in err[-1]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["groups"] == 0 and "centrality >= 1.1000" in stats["no_groups_reason"]
    code, err = refusal(monkeypatch, capsys, "train", T(data, tmp_path / "run", **{"--groups_dir": out}))
    assert code == 2 and err == [f"train.py: --groups_dir {out}: the selection found no groups ({out / 'stats.json'}: "
                                 f"{stats['no_groups_reason']}); select again"]


def test_skipped_files_of_a_folder_are_named(data, tmp_path, capsys):
    """A folder of mixed formats: the .csv and .txt it holds are named as not read."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(data["corpus"].read_text().split("\n", 1)[0] + "\n")
    (folder / "b.csv").write_text("id,text\n1,hello\n")
    (folder / "c.txt").write_text("hello\n")
    skipped = []
    assert readers.input_files([str(folder)], skipped) == [str(folder / "a.jsonl")]
    assert skipped == [str(folder / "b.csv"), str(folder / "c.txt")]
    sg.main(S(data, tmp_path / "out", **{"--input": folder, "--centrality_threshold": -1}))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--input:")]
    assert said == [f"--input: 2 file(s) of a format not read ({'/'.join(readers.INPUT_SUFFIXES)} are), skipped: "
                    f"{folder / 'b.csv'}, {folder / 'c.txt'}"]


def test_a_dev_only_beir_folder_is_scored_on_dev_under_its_own_name(tmp_path):
    """A BEIR folder whose only qrels split is dev.tsv: scored on dev, reported under the folder's name (or the
    name given when it is no mteb task), never as a stock task's test split."""
    folder = write_beir(tmp_path / "mydev")
    (folder / "qrels" / "test.tsv").rename(folder / "qrels" / "dev.tsv")
    assert ev.parse_local_spec(str(folder))[0] == "mydev"
    assert ev.parse_local_spec(f"SciFact={folder}")[0] == "mydev"  # not SciFact's test split: not reported as it
    assert ev.parse_local_spec(f"MyTask={folder}")[0] == "MyTask"
    from test_evaluate import factory

    out = ev.run_evaluation(["perfect"], local_tasks=[str(folder)], encoder_factory=factory("perfect"),
                            show_progress=False, results_dir=str(tmp_path / "results"))
    r = out["results"]["perfect"]["mydev"]
    assert out["tasks"][0]["name"] == "mydev" and r["split"] == "dev" and list(r["scores"]) == ["dev"]
    assert r["task"] == "mydev" and Path(r["result_file"]).name == "mydev.json"  # mteb's file, under its own name
    assert r["main_score"] == pytest.approx(100.0)
    (folder / "qrels" / "dev.tsv").rename(folder / "qrels" / "other.tsv")
    (folder / "qrels" / "train.tsv").write_text("q1\td1\t1\n")
    (folder / "qrels" / "dev.tsv").write_text("q1\td1\t1\n")
    with pytest.raises(common.UserError, match=r"no qrels/test.tsv to score, and qrels/ holds \['dev', 'other', "):
        ev.parse_local_spec(str(folder))
    shutil.rmtree(folder / "qrels")  # 146ed67 said "qrels/ holds no .tsv" of a folder that is not there
    with pytest.raises(common.UserError, match=r"corpus.jsonl and queries.jsonl but no qrels/ folder: .* are "
                                               r"qrels/test.tsv"):
        ev.parse_local_spec(str(folder))


def test_max_train_steps_0_is_refused_by_both_training_scripts():
    for module in (train, finetune):
        with pytest.raises(common.UserError, match="--max_train_steps: 0 is not an integer >= 1"):
            module.parse_args(["--output_dir", "x", "--groups_dir", "g", "--beir_dir", "b", "--max_train_steps", "0"]
                              if module is finetune else ["--output_dir", "x", "--groups_dir", "g",
                                                          "--max_train_steps", "0"])


@pytest.mark.parametrize("script,argv,says", [
    ("train.py", ["--groups_dir", "g", "--output_dir", "o", "--lr_scheduler_type", "cosin"],
     "train.py: argument --lr_scheduler_type: invalid choice: 'cosin'"),
    ("select_groups.py", ["--input", "data/docs.jsonl", "--output_dir", "README.md/out",
                          "--model_name_or_path", "all-MiniLM-L6-v2"],
     "select_groups.py: --output_dir README.md/out: cannot write there (README.md is a file)"),
])
def test_a_real_process_prints_one_line_and_exits_2(script, argv, says):
    """The same as a user sees it: a process of its own, stderr exactly one line, status 2. (Run as root, as the
    tests here are: a folder under a regular file cannot be made by anyone, where chmod would not stop root.)"""
    res = subprocess.run([sys.executable, script, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(says), res.stderr


def test_custom_code_is_refused_only_where_transformers_needs_it(data, tmp_path):
    """check_remote_code: a model_type transformers lacks, with an auto_map, needs --trust_remote_code; with the flag
    it passes; an auto_map beside a model_type transformers knows loads with transformers' own class and passes."""
    remote = data["root"] / "remote"
    with pytest.raises(common.UserError, match="--trust_remote_code"):
        common.check_model_name(str(remote), "--model_name_or_path")
    assert common.check_model_name(str(remote), "--model_name_or_path", trust_remote_code=True) == str(remote)
    known = tmp_path / "known"
    known.mkdir()
    (known / "config.json").write_text(json.dumps({"model_type": "bert", "auto_map": {"AutoModel": "m.M"}}))
    assert common.check_model_name(str(known), "--model_name_or_path") == str(known)


# ----------------------------------------------------------------------------------------------------------------
# Flags are never matched by prefix, in any script (issue 54 item 10)
# ----------------------------------------------------------------------------------------------------------------
def test_every_parser_refuses_a_prefix_of_a_flag():
    """Every argparse parser of the repository is built without prefix matching: plumbing.common.ArgumentParser (the
    step scripts') sets allow_abbrev=False, and every plain argparse.ArgumentParser call passes it (read from the
    source of every script, bench and experiment)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    plain = []
    for path in root.rglob("*.py"):
        if {".venv", ".git", ".cache"} & set(path.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "argparse.ArgumentParser":
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if kw.get("allow_abbrev") != "False":
                    plain.append(f"{path.relative_to(root)}:{node.lineno}")
    assert plain == []


@pytest.mark.parametrize("script, argv, wanted", [
    ("train", ["--groups_dir", "g", "--output_dir", "o", "--lr", "1e-5"],
     "--lr: did you mean --learning_rate?"),
    ("finetune", ["--output_dir", "o", "--epochs", "2"], "--epochs: did you mean --num_train_epochs?"),
    ("select_groups_datatrove", ["--input", "x", "--output_dir", "o", "--executor", "local", "--num_tasks", "4"],
     "did you mean --tasks?"),
    ("train", ["--groups_dir", "g", "--output_dir", "o", "--per", "4"], "did you mean --per_device_train_batch_size"),
    ("finetune", ["--output_dir", "o", "--per", "4"], "did you mean --per_device_train_batch_size"),
    ("select_groups", ["--input", "x", "--output_dir", "o", "--passage", "32"], "did you mean --passage_tokens"),
    ("evaluate", ["--models", "m", "--output_dir", "o", "--local", "x"], "did you mean --local_tasks"),
])
def test_an_abbreviated_flag_is_refused_naming_the_real_one(script, argv, wanted):
    import importlib

    from plumbing.common import UserError

    with pytest.raises(UserError, match=re.escape(wanted)):
        importlib.import_module(script).parse_args(argv)


def script_flags(script: str, monkeypatch) -> list:
    """The --flags of the parser a script's parse_args builds (train.py's: with xPRT's flags)."""
    import importlib

    seen = {}

    def grab(parser, args=None, namespace=None):
        flags = parser._option_string_actions
        seen["flags"] = sorted(f for f in flags if f.startswith("--") and f != "--help")
        raise SystemExit(0)

    monkeypatch.setattr(common.ArgumentParser, "parse_known_args", grab)
    with pytest.raises(SystemExit):
        importlib.import_module(script).parse_args(["--output_dir", "o"])
    monkeypatch.undo()
    return seen["flags"]


HINT_SCRIPTS = ["select_groups", "select_groups_datatrove", "train", "finetune", "evaluate"]

# what users of other trainers type (HF Trainer, sentence-transformers), and slips -> the flag meant
# (None: any hint is fine, the meaning is open)
COMMON_MISTAKES = {
    "train": {
        "--lr": "--learning_rate", "--bs": "--per_device_train_batch_size",
        "--batch_size": "--per_device_train_batch_size", "--epochs": "--num_train_epochs",
        "--num_epochs": "--num_train_epochs", "--max_steps": "--max_train_steps",
        "--model": "--model_name_or_path", "--out": "--output_dir", "--outdir": "--output_dir",
        "--output_path": "--output_dir", "--groups": "--groups_dir", "--temperature": "--tau",
        "--warmup": "--warmup_ratio", "--grad_accum": "--gradient_accumulation_steps",
        "--wd": "--weight_decay", "--max_seq_length": "--max_length", "--seq_len": "--max_length",
        "--fp16": "--mixed_precision", "--resume": "--resume_from_checkpoint",
        "--num_workers": "--dataloader_num_workers", "--log_steps": "--logging_steps",
        "--learnig_rate": "--learning_rate", "--teacher": "--teacher_name_or_path",
        "--ckpt_steps": "--checkpointing_steps", "--grad_ckpt": "--gradient_checkpointing",
        "--scheduler": "--lr_scheduler_type"},
    "finetune": {
        "--lr": "--learning_rate", "--bs": "--per_device_train_batch_size",
        "--epochs": "--num_train_epochs", "--beir": "--beir_dir", "--model": "--model_name_or_path",
        "--mined": "--mined_negatives", "--alpha": "--pair_alpha",
        "--query_len": "--query_max_length", "--negatives": None},
    "select_groups": {
        "--model": "--model_name_or_path", "--out": "--output_dir", "--input_file": "--input",
        "--related": "--num_related", "--threshold": "--centrality_threshold",
        "--tokens": "--passage_tokens", "--bs": "--batch_size", "--max_documents": "--max_docs",
        "--data": "--dataset", "--seeds": "--seed"},
    "select_groups_datatrove": {
        "--executors": "--executor", "--num_tasks": "--tasks", "--num_workers": "--workers",
        "--model": "--model_name_or_path"},
    "evaluate": {
        "--model": "--models", "--task": "--tasks", "--local": "--local_tasks",
        "--bench": "--benchmark", "--bs": "--batch_size", "--max_len": "--max_length",
        "--results": "--results_dir", "--prefix": None},
}


@pytest.mark.parametrize("script", HINT_SCRIPTS)
def test_every_flag_is_found_from_the_spellings_users_type(script, monkeypatch):
    """Over every flag of every script (before: `--lr` hinted --lr_scheduler_type): its spelling
    without underscores, with dashes, in capitals, with a letter dropped from its longest word, and
    its initials (where no other flag of the script has the same) are each answered with that flag
    alone; and every common mistake of the table gets the flag meant as its first hint."""
    from plumbing.flag_hints import likely_flags

    flags = script_flags(script, monkeypatch)
    words = {f: f[2:].split("_") for f in flags}
    initials = {f: "--" + "".join(w[0] for w in ws) for f, ws in words.items()}
    wrong = []
    for f, ws in words.items():
        longest = max(ws, key=len)
        typed = ["--" + "".join(ws), "--" + "-".join(ws), f.upper()]
        typed += [f.replace(longest, longest[:-2] + longest[-1])] if len(longest) >= 5 else []
        unique = list(initials.values()).count(initials[f]) == 1
        typed += [initials[f]] if len(ws) > 1 and unique else []
        wrong += [(t, likely_flags(t, flags), f) for t in typed
                  if t not in flags and likely_flags(t, flags) != [f]]
    for typed, meant in COMMON_MISTAKES[script].items():
        hint = likely_flags(typed, flags)
        if not hint or (meant and hint[0] != meant):
            wrong.append((typed, hint, meant))
    assert wrong == [], wrong
    assert len(flags) > 25
