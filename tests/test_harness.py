"""experiments/paper (the paper's experiments at three scales) and train.py's stopping signal (--save_best, the drift
logged as teacher_cosine).

The fast tests check the parts on real outputs: the arms follow train.py's parser, the paper scale's dry run prints
its commands and a GPU-hour estimate from run_log.step_flops, the device round trip's packing keeps every weight (to
fp16) and the return limits, --save_best keeps the best-scored model. Two slow tests run the tiny scale end to end
and the gpu scale's three commands (build, device, score) at toy size on the CPU.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_bert, cli_args
from test_train import make_groups
from test_train import run as run_train

import train
from experiments.paper import device, run, stages
from plumbing import model_folder
from plumbing.common import UserError
from plumbing.model_folder import load_xprt_folder

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------------
# configs and arms
# ---------------------------------------------------------------------------------------------------------------
def test_arms_are_train_py_objectives_plus_the_ablations(monkeypatch):
    exp = stages.load_config("tiny")["experiments"][0]
    arms = stages.arms_of(exp)
    choices = train.build_parser()._option_string_actions["--objective"].choices
    assert set(arms) == set(choices) | set(stages.ABLATIONS)
    own = exp.get("objective_flags", {})  # an objective's own flags (SimLM's generator)
    for o in choices:
        assert arms[o]["flags"] == ([] if o == "xprt" else ["--objective", o] + stages.argv_of(own.get(o, {})))
    assert arms["simlm"]["flags"][2:] == ["--generator_name_or_path", "{start}", "--baseline_setting", "official"]
    assert arms["revela"]["flags"][2:4] == ["--lm_name_or_path", "{lm}"]
    assert arms["self_reconstruction_5x"]["steps_factor"] == 5 and arms["e5_ranking"]["ranking"] == "e5"
    # an objective added to train.py's parser becomes an arm with no edit to the harness
    build = train.build_parser

    def with_new_objective():
        p = build()
        p._option_string_actions["--objective"].choices = [*choices, "new_objective"]
        return p

    monkeypatch.setattr(train, "build_parser", with_new_objective)
    assert stages.arms_of(exp)["new_objective"]["flags"] == ["--objective", "new_objective"]
    assert "new_objective" not in stages.arms_of({**exp, "arms": ["xprt", "no_fill_in"]})
    assert set(stages.arms_of({**exp, "arms": "objectives"})) == {*choices, "new_objective"}
    with pytest.raises(SystemExit, match="unknown arms"):
        stages.arms_of({**exp, "arms": ["xprt", "nope"]})


def test_every_arm_gets_the_same_budget():
    exp = stages.load_config("tiny")["experiments"][0]
    arms = stages.arms_of(exp)
    groups = {"rrf": "g", "e5": "g_e5", "tfidf": "g_tfidf"}
    argvs = {a: stages.train_argv(exp, arm, "start", groups, 1, 4, Path("o") / a) for a, arm in arms.items()}
    parsed = {a: train.build_parser().parse_args(argv) for a, argv in argvs.items()}  # as train.py reads them
    for a, f in parsed.items():
        assert f.model_name_or_path == "start" and f.seed == 1 and f.retention_weight == 0
        assert f.per_device_train_batch_size == 8 and f.learning_rate == 1e-3 and f.max_length == 48
        assert f.max_train_steps == (20 if a == "self_reconstruction_5x" else 4)
    assert parsed["no_fill_in"].no_fill_in and parsed["random_positive"].positive == "random"
    assert parsed["tfidf_ranking"].groups_dir == "g_tfidf" and parsed["xprt"].groups_dir == "g"
    assert parsed["contrastive_random_span"].objective == "contrastive_random_span"
    assert stages.argv_of({"--a": True, "--b": None, "--c": [1, 2], "--d": 0.5, "--e": False}) == \
        ["--a", "--c", "1", "2", "--d", "0.5"]


def test_toy_overrides_merge_one_level_down():
    exp = stages.load_config("gpu", toy=True)["experiments"][0]
    assert exp["train"]["--per_device_train_batch_size"] == 8  # the toy's
    assert exp["train"]["--learning_rate"] == 1e-4  # the gpu config's, kept
    assert exp["start"]["flags"]["--hidden_size"] == 32 and "--bf16" not in exp["start"]["flags"]
    full = stages.load_config("gpu")["experiments"][0]
    assert full["train"]["--per_device_train_batch_size"] == 256 and full["start"]["flags"]["--bf16"] is True
    assert not any("{shared}" in t for t in full["eval"]["--local_tasks"])


def test_flop_estimate_is_train_step_flops_and_scales_with_the_batch():
    exp = stages.load_config("tiny")["experiments"][0]
    arms = stages.arms_of(exp)
    f = {a: stages.estimate_flops(exp, arm) for a, arm in arms.items()}
    assert f["xprt"] > f["no_fill_in"] > 0 and f["xprt"] > f["contrastive_random_span"] > 0
    assert f["xprt"] == f["e5_ranking"] == f["random_positive"]  # same shapes
    double = {**exp, "train": {**exp["train"], "--per_device_train_batch_size": 16}}
    # twice the rows: twice the work, up to the random count of masked positions the heads predict
    assert stages.estimate_flops(double, arms["xprt"]) == pytest.approx(2 * f["xprt"], rel=0.01)


def test_paper_dry_run_prints_the_plan_and_gpu_hours(capsys):
    run.main(["--scale", "paper", "--dry_run"])
    text = capsys.readouterr().out
    assert "accelerate launch --config_file configs/accelerate_8gpu.yaml train.py --model_name_or_path " \
           "intfloat/e5-base-unsupervised" in text
    assert "torchrun --standalone --nproc_per_node 8 select_groups.py" in text
    assert "--benchmark 'MTEB(eng, v2)'" in text and "GPU-hours of from_bert" in text
    # the from-BERT runs read E5's groups, every ranking from the 100K experiment's folders
    assert "--groups_dir outputs/paper/paper/e5_100k/groups_tfidf" in text
    exp = stages.load_config("paper")["experiments"][0]
    rows = stages.gpu_hours(exp, stages.arms_of(exp), [1], None)
    xprt = rows[0]
    # 100K documents x 7.0 groups, one epoch, 32 groups x 8 GPUs per step
    assert xprt["steps"] == 2735 and xprt["processes"] == 8
    assert xprt["tflop_per_step"] == pytest.approx(8 * stages.estimate_flops(exp, stages.arms_of(exp)["xprt"]) / 1e12)
    hours = xprt["tflop_per_step"] * 1e12 * xprt["steps"] / (989e12 * 0.15) / 3600
    assert xprt["gpu_hours"]["0.15"] == pytest.approx(hours)
    assert f"{xprt['steps']:>8}" in text


# ---------------------------------------------------------------------------------------------------------------
# the device round trip: what comes back
# ---------------------------------------------------------------------------------------------------------------
def test_pack_and_unpack_keep_every_weight_within_the_return_limits(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    folders = {"start": build_tiny_bert(out / "start"),
               **{f"s1/{a}": build_tiny_bert(out / "s1" / a / "model", seed=i) for i, a in enumerate(["x", "y"])}}
    (out / "s1" / "x" / "train_log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    dest = tmp_path / "OUT"
    dest.mkdir()
    packed = device.pack(folders, out, dest)
    assert packed["returned"] == list(folders) and not packed["not_returned"]
    assert len(list(dest.iterdir())) <= device.RETURN["files"] - 1  # run.json comes on top
    assert all(p.stat().st_size <= device.RETURN["file_bytes"] for p in dest.iterdir())
    (dest / "run.json").write_text(json.dumps({**packed, "steps_per_arm": 3}))
    back = tmp_path / "back"
    device.unpack(dest, back)
    for name, folder in folders.items():
        orig = load_file(str(folder / "model.safetensors"))
        got = load_file(str(back / folder.relative_to(out) / "model.safetensors"))
        assert set(got) == set(orig)
        for k, v in orig.items():
            assert got[k].dtype == v.dtype
            assert torch.equal(got[k], v.half().float()) if v.is_floating_point() else torch.equal(got[k], v)
        assert (back / folder.relative_to(out) / "tokenizer.json").is_file()
    assert (back / "s1" / "x" / "train_log.jsonl").read_text().startswith('{"step": 1')
    # a model over one file's limit spans files (all-MiniLM-L6-v2 is 45 MB in fp16, a file 16 MiB) and comes back
    # whole; one that does not fit the files left is left out whole and named
    biggest = max(v.numel() * 2 for v in load_file(str(folders["start"] / "model.safetensors")).values())
    monkeypatch.setitem(device.RETURN, "files", 5)  # 3 for the bundles
    monkeypatch.setitem(device.RETURN, "file_bytes", biggest + 1024)  # a model's fp16 tensors need two files
    dest2, back2 = tmp_path / "OUT2", tmp_path / "back2"
    dest2.mkdir()
    split = device.pack(folders, out, dest2)
    assert split["returned"] == ["start"] and split["not_returned"] == ["s1/x", "s1/y"] and split["bundles"] >= 2
    assert all(p.stat().st_size <= biggest + 1024 + 8192 for p in dest2.glob("models_*"))  # + the header
    (dest2 / "run.json").write_text(json.dumps({**split, "steps_per_arm": 3}))
    device.unpack(dest2, back2)
    got = load_file(str(back2 / "start" / "model.safetensors"))
    assert all(torch.equal(got[k], v.half().float()) for k, v in load_file(str(folders["start"] /
                                                                            "model.safetensors")).items())
    assert not (back2 / "s1" / "x" / "model.safetensors").exists()
    # a tensor over one file's limit travels in row slices (MiniLM's word embeddings: 23 MB); a model that needs
    # more files than are left is left out whole
    monkeypatch.setitem(device.RETURN, "files", 8)
    monkeypatch.setitem(device.RETURN, "file_bytes", biggest // 3)
    dest4, back4 = tmp_path / "OUT4", tmp_path / "back4"
    dest4.mkdir()
    sliced = device.pack({"start": folders["start"]}, out, dest4)
    assert sliced["returned"] == ["start"] and sliced["bundles"] >= 3
    (dest4 / "run.json").write_text(json.dumps({**sliced, "steps_per_arm": 3}))
    device.unpack(dest4, back4)
    got = load_file(str(back4 / "start" / "model.safetensors"))
    orig = load_file(str(folders["start"] / "model.safetensors"))
    assert set(got) == set(orig) and all(torch.equal(got[k], v.half().float()) for k, v in orig.items())
    monkeypatch.setitem(device.RETURN, "file_bytes", 1024)
    dest3 = tmp_path / "OUT3"
    dest3.mkdir()
    small = device.pack(folders, out, dest3)
    assert small["returned"] == [] and small["not_returned"] == list(folders)


def test_the_gpu_plans_count_what_a_run_can_bring_back(capsys):
    """The plans of both gpu settings (dry runs): a MiniLM (the E5 stand-in) is 43 MiB in fp16, so one run brings
    back one arm and the 27 runs of 9 arms x 3 seeds need 27 GPU runs, the carried start never among the returns;
    the from-MLM start's 5.2 MiB encoders come back 11 to a run. The arms that do not run at a scale say why."""
    e5 = stages.load_config("gpu_e5")["experiments"][0]
    assert device.models_per_run(e5) == 1 and device.encoder_bytes(e5) == 2 * 22_713_216
    run.main(["--scale", "gpu_e5", "--dry_run"])
    text = capsys.readouterr().out
    assert "at most 1 models of 43.3 MiB (fp16) come back from one run: 27 GPU run(s) of 540 s for 27 of them" in text
    assert "brings back the models of run 1" in text  # not the start: every run carries it
    assert "run 27: s3/self_reconstruction" in text and "simlm" not in text.split("arms:")[1].split("\n")[0]
    mlm = stages.load_config("gpu")["experiments"][0]
    assert device.models_per_run(mlm) == 11
    assert set(mlm["exclude"]) == {"self_reconstruction_5x"}  # Revela and the rankings run
    assert all(len(why) > 40 for why in {**mlm["exclude"], **e5["exclude"]}.values())


# ---------------------------------------------------------------------------------------------------------------
# train.py's stopping signal
# ---------------------------------------------------------------------------------------------------------------
def test_save_best_keeps_the_start_when_no_step_beats_it(tmp_path, tiny_bert, capsys):
    """The start is scored first (step 0). A run whose scores never rise above it (here lr 0: every score equals the
    start's) keeps the start in best_model/ and says so; the score records begin at step 0."""
    groups = make_groups(tmp_path / "groups", 16)
    out = tmp_path / "run"
    res = run_train(cli_args({"--model_name_or_path": tiny_bert, "--groups_dir": groups, "--output_dir": out,
                              "--max_length": 32, "--per_device_train_batch_size": 4, "--report_to": "none",
                              "--max_train_steps": 2, "--learning_rate": 0.0, "--retention_weight": 0,
                              "--eval_tasks": str(ROOT / "data/eval/scifact"), "--eval_steps": 1,
                              "--eval_limit": 10, "--save_best": "SciFact"}))
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["eval_SciFact"] for r in recs if "eval_SciFact" in r}
    assert sorted(scores) == [0, 1, 2] and len(set(scores.values())) == 1
    assert json.loads((out / "best.json").read_text())["step"] == 0 == res["best"]["step"]
    assert "holds the start model: no step of training scored above it" in capsys.readouterr().out
    from safetensors.torch import load_file

    a, b = load_file(str(out / "best_model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # lr 0: the start's weights, kept as they were


def test_save_best_keeps_the_best_scored_model_and_the_drift_is_logged(tmp_path, tiny_bert):
    groups = make_groups(tmp_path / "groups", 16)
    out = tmp_path / "run"
    res = run_train(cli_args({"--model_name_or_path": tiny_bert, "--groups_dir": groups, "--output_dir": out,
                              "--max_length": 32, "--per_device_train_batch_size": 4, "--report_to": "none",
                              "--logging_steps": 1, "--seed": 7, "--max_train_steps": 4, "--learning_rate": 5e-3,
                              "--eval_tasks": str(ROOT / "data/eval/scifact"), "--eval_steps": 1,
                              "--eval_limit": 10, "--save_best": "SciFact"}))
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["eval_SciFact"] for r in recs if "eval_SciFact" in r}
    assert sorted(scores) == [0, 1, 2, 3, 4]  # the start (step 0) is scored first
    best_step = max(scores, key=lambda s: (scores[s], -s))  # the first of equal scores is kept
    best = json.loads((out / "best.json").read_text())
    assert best["step"] == best_step == res["best"]["step"] and best["score"] == pytest.approx(scores[best_step])
    assert (out / "best_model" / "model.safetensors").is_file() and (out / "model" / "model.safetensors").is_file()
    # the kept folder is the model of that step: the final one only when the last step was the best
    from safetensors.torch import load_file

    a, b = load_file(str(out / "best_model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a) == (best_step == 4)
    drift = [r["teacher_cosine"] for r in recs if "teacher_cosine" in r]
    assert len(drift) == 4 and all(-1.0 <= d <= 1.0 + 1e-6 for d in drift) and drift[-1] < 1.0 - 1e-4
    with pytest.raises(UserError, match="needs --eval_tasks"):
        train.parse_args(cli_args({"--groups_dir": groups, "--output_dir": out, "--save_best": "SciFact"}))


def test_teacher_cosine_is_one_at_the_start(tmp_path, tiny_bert):
    from transformers import AutoTokenizer

    import modeling_xprt as mx

    model = load_xprt_folder(mx.XPRTModel, str(tiny_bert))
    teacher = model_folder.load_teacher(str(tiny_bert))
    tok = AutoTokenizer.from_pretrained(str(tiny_bert))
    rows = [{"doc_id": str(i), "anchor": f"anchor text {i}", "related": [f"related {i} {j}" for j in range(4)],
             "random_passage": "random"} for i in range(3)]
    batch = mx.XPRTCollator(tok, max_length=16)(rows)
    assert train.teacher_cosine(model, teacher, batch).item() == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# end to end (slow): the tiny scale, and the gpu scale's three commands at toy size on the CPU
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_scale_end_to_end(tmp_path):
    out = tmp_path / "tiny"
    run.main(["--scale", "tiny", "--out", str(out)])
    exp = stages.load_config("tiny")["experiments"][0]
    arms = list(stages.arms_of(exp))
    res = json.loads((out / "results.json").read_text())
    assert res["arms"] == arms and len(res["per_seed"]) == 1
    ev = json.loads((out / "eval_s1" / "results.json").read_text())
    assert ev["models"][0] == str(out / "start") and len(ev["models"]) == len(arms) + 1
    # the page's numbers are evaluate.py's, set beside the paper's
    xprt = ev["summary"]["average"][ev["models"][1 + arms.index("xprt")]]
    md = (out / "results.md").read_text()
    assert f"| xPRT | mean pooling, cosine | {xprt:.2f} |" in md
    assert "47.12 (retrieval 29.21)" in md and "| -4.9 |" in md
    # each arm's setting, as its saved folder states it (the from-BERT setting: the baselines as their authors run them)
    assert "| RetroMAE | official: cls pooling, cosine |" in md and "| SimLM | official: cls pooling, cosine |" in md
    # the second scoring: every model as the start scores it (--score_as), on the page beside the first
    same = json.loads((out / "eval_s1_as_start" / "results.json").read_text())
    assert same["score_as"]["model"] == str(out / "start") and same["models"] == ev["models"]
    retromae = same["summary"]["average"][same["models"][1 + arms.index("retromae")]]
    assert "## Every model scored as the start is" in md and "| RetroMAE | " in md.split("## Every model scored")[1]
    assert f"| {retromae:.2f} |" in md.split("## Every model scored")[1].split("\n## ")[0]
    assert "| Contriever | official: mean pooling, dot |" in md and "| Revela | mean pooling, cosine |" in md
    for a in arms:
        assert json.loads((out / f"s1/{a}/model/xprt_config.json").read_text())
        steps = [json.loads(line)["step"] for line in (out / f"s1/{a}/train_log.jsonl").read_text().splitlines()]
        assert max(steps) == (20 if a == "self_reconstruction_5x" else 4)


@pytest.mark.slow
def test_gpu_scale_round_trip_at_toy_size(tmp_path, monkeypatch):
    """Two simulated GPU runs build one table (the ledger). Run 1 is built for the xPRT arm: the device pre-trains
    the start (rounded to fp16, so the bundle it comes back in holds the very weights), trains xPRT at the config's
    fixed steps, and `score` records it. Run 2 is built for xPRT and random spans: it carries run 1's start, plans
    only the missing arm, and brings back only that one, trained from the same start (its digest); the page then
    has both rows at equal steps, scored both ways, and nothing missing."""
    import shutil

    here = tmp_path / "here"

    def device_run(k: int, arms: list) -> dict:
        there, returned = tmp_path / f"there{k}", tmp_path / f"OUT{k}"
        shutil.copytree(here / "carry", there / "carry")  # the device: the tree with the carry folder; $OUT
        monkeypatch.setenv("OUT", str(returned))
        report = run.main(["--scale", "gpu", "--toy", "--stage", "device", "--out", str(there), "--arms", *arms])
        assert len(list(returned.iterdir())) <= device.RETURN["files"]
        run.main(["--scale", "gpu", "--toy", "--stage", "score", "--returned", str(returned), "--out", str(here),
                  "--arms", *arms])
        return report["gpu"]

    run.main(["--scale", "gpu", "--toy", "--stage", "build", "--out", str(here), "--arms", "xprt"])
    plan = json.loads((here / "carry" / "plan.json").read_text())
    assert plan["sizes"]["with_tree"] < device.CARRY_BYTES and plan["todo"] == ["s1/xprt"]
    first = device_run(1, ["xprt"])
    assert first["returned"] == ["start", "s1/xprt"] and first["steps_per_arm"] == 2  # the toy config's per_arm
    assert set(first["probes"]) == {"xprt"}
    ledger = device.read_ledger(here)
    assert list(ledger["runs"]) == ["s1/xprt"] and ledger["start"] == first["start_digest"]
    assert device.tensors_digest(here / "start") == first["start_digest"]  # the fp16 bundle held the very weights

    both = ["xprt", "contrastive_random_span", "revela"]
    run.main(["--scale", "gpu", "--toy", "--stage", "build", "--out", str(here), "--arms", *both])
    plan = json.loads((here / "carry" / "plan.json").read_text())
    assert plan["todo"] == ["s1/contrastive_random_span", "s1/revela"] and plan["start_digest"] == first["start_digest"]
    second = device_run(2, both)
    # Revela's language model is made by the first run that trains Revela (a causal LM pre-trained there) and
    # comes back with the arms
    assert second["returned"] == ["lm", "s1/contrastive_random_span", "s1/revela"]
    assert second["start_digest"] == first["start_digest"]
    assert second["finished"] == ["s1/contrastive_random_span", "s1/revela"]  # only what the first run missed
    ledger = device.read_ledger(here)
    assert sorted(ledger["runs"]) == ["s1/contrastive_random_span", "s1/revela", "s1/xprt"]
    assert {r["steps"] for r in ledger["runs"].values()} == {2}
    assert ledger["lm"] == second["lm_digest"] == device.tensors_digest(here / "lm")
    assert json.loads((here / "lm" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    md = (here / "results.md").read_text()
    assert "| xPRT |" in md and "| random spans (Contriever) |" in md and "| Revela |" in md
    assert "Not yet trained" not in md
    # a later build carries the language model as it carries the start
    run.main(["--scale", "gpu", "--toy", "--stage", "build", "--out", str(here), "--arms", *both, "--seeds", "2"])
    plan = json.loads((here / "carry" / "plan.json").read_text())
    assert plan["sizes"]["lm"] > 0 and plan["todo"] == ["s2/xprt", "s2/contrastive_random_span", "s2/revela"]
    assert "## Every model scored as the start is" in md
    assert "## Arms not run at this scale" in md and ("- self-reconstruction, 5x steps (as much text as xPRT): "
                                                      "not run") in md
    assert "tears the encoder" not in md  # the config's note on Contriever: on the page only where it is an arm
    for arm in both:
        log = [json.loads(line) for line in (here / f"s1/{arm}/train_log.jsonl").read_text().splitlines()]
        assert log[-1]["step"] == 2

@pytest.mark.slow
def test_the_e5_setting_carries_its_start_and_brings_back_only_the_arms(tmp_path, monkeypatch):
    """The gpu_e5 round trip at toy size: build carries all-MiniLM-L6-v2 (weights rounded to fp16, packed as a run
    returns models), the device restores it and trains xPRT from it with retention on, and only the arm comes back;
    every arm of the table starts from the bytes build digested, and the page says why SimLM does not run."""
    import shutil

    here, there, returned = tmp_path / "here", tmp_path / "there", tmp_path / "OUT"
    run.main(["--scale", "gpu_e5", "--toy", "--stage", "build", "--out", str(here), "--arms", "xprt"])
    plan = json.loads((here / "carry" / "plan.json").read_text())
    assert plan["start_digest"] == device.tensors_digest(here / "start") and plan["todo"] == ["s1/xprt"]
    assert plan["sizes"]["start"] > 40 * device.MIB and plan["sizes"]["with_tree"] < device.CARRY_BYTES
    shutil.copytree(here / "carry", there / "carry")
    monkeypatch.setenv("OUT", str(returned))
    report = run.main(["--scale", "gpu_e5", "--toy", "--stage", "device", "--out", str(there), "--arms", "xprt"])
    report = report["gpu_e5"]
    assert report["returned"] == ["s1/xprt"] and report["start_digest"] == plan["start_digest"]
    log = [json.loads(line) for line in (there / "s1" / "xprt" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 2 and "retention_loss" in log[0]  # retention on, to the carried start
    run.main(["--scale", "gpu_e5", "--toy", "--stage", "score", "--returned", str(returned), "--out", str(here),
              "--arms", "xprt"])
    assert device.read_ledger(here)["start"] == plan["start_digest"]
    md = (here / "results.md").read_text()
    assert "| xPRT |" in md and "## Arms not run at this scale" in md and "no MLM generator" in md


@pytest.mark.slow
def test_each_run_carries_the_groups_its_arms_read(tmp_path, monkeypatch):
    """Where the carry holds one ranking's groups beside the rest (a MiniLM start, or 27 MB groups folders), build
    carries those of the first missing runs' ranking and leaves the other ranking's runs to a later build, which
    carries theirs: the E5-only ranking gets its row from the second run, both on one page."""
    import shutil

    here = tmp_path / "here"
    arms = ["xprt", "e5_ranking"]

    def build() -> dict:
        run.main(["--scale", "gpu", "--toy", "--stage", "build", "--out", str(here), "--arms", *arms])
        return json.loads((here / "carry" / "plan.json").read_text())

    limit = device.CARRY_BYTES
    for k, (todo, folder) in enumerate([(["s1/xprt"], "groups"), (["s1/e5_ranking"], "groups_e5")], 1):
        monkeypatch.setattr(device, "CARRY_BYTES", limit)
        sizes = build()["sizes"]  # everything fits at toy size: measure, then leave room for one ranking only
        assert set(sizes["groups"]) == ({"rrf", "e5"} if k == 1 else {"e5"})
        room = max(sizes["groups_selected"].values()) + 1024
        monkeypatch.setattr(device, "CARRY_BYTES", limit - sizes["room_for_groups"] + room)
        plan = build()
        assert plan["todo"] == todo and [p.name for p in (here / "carry").glob("groups*")] == [folder]
        there, returned = tmp_path / f"there{k}", tmp_path / f"OUT{k}"
        shutil.copytree(here / "carry", there / "carry")
        monkeypatch.setenv("OUT", str(returned))
        report = run.main(["--scale", "gpu", "--toy", "--stage", "device", "--out", str(there), "--arms", *arms])
        assert report["gpu"]["finished"] == todo and list(report["gpu"]["groups_digests"]) == [folder[7:] or "rrf"]
        run.main(["--scale", "gpu", "--toy", "--stage", "score", "--returned", str(returned), "--out", str(here),
                  "--arms", *arms])
    ledger = device.read_ledger(here)
    assert sorted(ledger["runs"]) == ["s1/e5_ranking", "s1/xprt"] and set(ledger["groups"]) == {"rrf", "e5"}
    md = (here / "results.md").read_text()
    assert "| xPRT, E5-only ranking |" in md and "Not yet trained" not in md


def test_the_page_marks_runs_made_by_other_code():
    """The ledger records each returned run's code (training.code_revision in the device report); the page names the
    runs made by other code than this tree's (issue 54 item 5), and a run with no code record as such."""
    from experiments.paper import page
    from plumbing.training import code_revision

    here = code_revision()
    other = {"sha256": "f" * 64, "git": "0123456789abcd"}
    ledger = {"runs": {"s0/xprt": {"code": here}, "s0/retromae": {"code": other}, "s1/xprt": {"code": None}}}
    assert page.other_code(ledger, here["sha256"]) == {"s0/retromae": "0123456789ab", "s1/xprt": "no code record"}
    assert page.other_code({"runs": {"s0/xprt": {"code": here}}}, here["sha256"]) == {}
