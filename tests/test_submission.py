"""The leaderboard submission (issue 56): each model's complete ModelMeta from what its folder records, and
`evaluate.py --submission DIR`, checked by mteb's own code: ModelMeta's validation reads model_meta.json back, the
Python entry evaluates to the same ModelMeta, and mteb's ResultCache reads the folder's task results.

The model is what the repository's own scripts write: train.py from all-MiniLM-L6-v2 on groups of the bundled web
text, then finetune.py on a BEIR folder named scifact (the user's copy of SciFact's train split), at toy size. mteb's
Hub is simulated for SciFact (its loader gives a sample of the bundled SciFact test data), so that the run files a
standard result, which is what a submission takes; nothing reaches a network.
"""

import datetime
import json
import runpy
from pathlib import Path

import mteb
import pytest
from conftest import cli_args
from mteb.models.model_meta import ModelMeta
from test_evaluate import write_beir
from test_finetune import ft_args, make_beir
from test_train import make_groups, run

import evaluate as ev
import finetune
from plumbing import leaderboard as lb
from plumbing.common import UserError
from plumbing.readers import load_beir

ROOT = Path(__file__).resolve().parent.parent
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """<tmp>/ft/model: all-MiniLM-L6-v2 -> train.py (xPRT, 2 steps on 8 groups of data/docs.jsonl) -> finetune.py
    (PAIR, 2 steps on qrels/train.tsv of a BEIR folder named scifact), each run's run.json beside its model."""
    tmp = tmp_path_factory.mktemp("submission")
    run(cli_args({"--model_name_or_path": "all-MiniLM-L6-v2", "--groups_dir": make_groups(tmp / "groups", 8),
                  "--output_dir": tmp / "xprt", "--max_length": 32, "--per_device_train_batch_size": 4,
                  "--report_to": "none", "--max_train_steps": 2, "--seed": 7}))
    run(ft_args(tmp / "xprt" / "model", make_beir(tmp / "scifact", num_docs=20, num_queries=8), tmp / "ft",
                **{"--max_train_steps": 2, "--query_max_length": 16, "--passage_max_length": 32}), main=finetune.main)
    return tmp / "ft" / "model"


def simulate_scifact_on_the_hub(monkeypatch):
    """mteb's own loader of a stock retrieval task, answered with 10 queries of the bundled SciFact test sample and
    60 documents (their relevant ones among them), as test_evaluate's online test does: the run is then mteb's
    standard run of the task, filed where the leaderboard's results are."""
    from datasets import Dataset
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData

    data = ev.subsample_retrieval(load_beir(ROOT / "data" / "eval" / "scifact", "test"), 10, 60, 0)

    def hub(self, num_proc=None, **kw):
        corpus = Dataset.from_dict({"id": list(data["corpus"]), "title": [t for t, _ in data["corpus"].values()],
                                    "text": [x for _, x in data["corpus"].values()]})
        queries = Dataset.from_dict({"id": list(data["queries"]), "text": list(data["queries"].values())})
        self.dataset = {"default": {"test": RetrievalSplitData(corpus=corpus, queries=queries,
                                                               relevant_docs=data["qrels"], top_ranked=None)}}
        self.data_loaded = True

    monkeypatch.setattr(AbsTaskRetrieval, "load_data", hub)
    monkeypatch.setattr(ev, "hub_offline", lambda: False)


@pytest.mark.slow
def test_a_trained_models_submission_is_validated_and_read_by_mteb(trained, tmp_path, monkeypatch, capsys):
    """evaluate.py --submission on the start and the fine-tuned model: the folder mteb's ResultCache lays out,
    model_meta.json that ModelMeta's own validation loads, the Python entry that evaluates to the same ModelMeta, the
    run settings mteb's reader reads with ours beside its own; every field of the trained model's ModelMeta from its
    records; the start's registry entry as it is; a user's own task left out and said."""
    simulate_scifact_on_the_hub(monkeypatch)
    own = write_beir(tmp_path / "my_claims")
    sub = tmp_path / "submission"
    rep = ev.main(["--models", "all-MiniLM-L6-v2", str(trained), "--tasks", "SciFact", "--local_tasks", str(own),
                   "--output_dir", str(tmp_path / "out"), "--results_dir", str(tmp_path / "results"),
                   "--submission", str(sub), "--public_training_code", "https://github.com/me/xprt",
                   "--public_training_data", "https://huggingface.co/datasets/me/groups", "--no_card_update",
                   "--batch_size", "16", "--training_datasets", "SciFact"])
    table = rep["summary"]["per_task"]
    name, revision = "local/ft", lb.content_revision(str(trained))
    folder = sub / "results" / "local__ft" / revision
    start = sub / "results" / "sentence-transformers__all-MiniLM-L6-v2" / mteb.get_model_meta(MINILM).revision
    assert sorted(p.relative_to(sub).as_posix() for p in sub.rglob("*") if p.is_file()) == sorted([
        "README.md", "submission.json", "model_meta/local__ft.py",
        "mock_run/local__ft.md", "mock_run/sentence-transformers__all-MiniLM-L6-v2.md",  # mteb.mock_run's reports
        *(f"{f.relative_to(sub).as_posix()}/{n}" for f in (folder, start)
          for n in ("SciFact.json", "model_meta.json", "run_settings.jsonl"))])

    # mteb's own validation of model_meta.json, and the Python entry is the same ModelMeta
    meta = ModelMeta.model_validate_json_resolved((folder / "model_meta.json").read_text())
    entry = runpy.run_path(str(sub / "model_meta" / "local__ft.py"))["ft"]
    assert isinstance(entry, ModelMeta) and entry.to_dict() == meta.to_dict()
    assert meta.loader.__name__ == "SentenceTransformerEncoderWrapper"
    # field by field, each from what the folder records (plumbing/leaderboard.py's model_meta_of)
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert (meta.name, meta.revision, meta.release_date, meta.languages) == (name, revision, today, ["eng-Latn"])
    assert (meta.license, meta.adapted_from, meta.training_datasets) == ("apache-2.0", MINILM, {"SciFact"})
    assert (meta.n_parameters, meta.n_embedding_parameters, meta.memory_usage_mb) == (22_713_216, 11_720_448, 87)
    assert (meta.max_tokens, meta.embed_dim, meta.similarity_fn_name.value, meta.use_instructions) == (
        256, 384, "cosine", False)
    assert (meta.public_training_code, meta.public_training_data) == ("https://github.com/me/xprt",
                                                                      "https://huggingface.co/datasets/me/groups")
    assert (meta.open_weights, meta.framework, meta.reference) == (
        True, ["Sentence Transformers", "PyTorch", "safetensors", "Transformers"], None)
    # mteb's zero-shot reading: SciFact from the fine-tuning, MS MARCO and NQ from the start's registry entry
    assert meta.is_zero_shot_on(["SciFact"]) is False and meta.is_zero_shot_on(["STS12", "ArguAna"]) is True
    assert {"SciFact", "MSMARCO", "NQ"} <= meta.get_training_datasets()
    # the start is mteb's registry entry as it is
    registry = mteb.get_model_meta(MINILM)
    assert json.loads((start / "model_meta.json").read_text()) == json.loads(json.dumps(registry.to_dict(),
                                                                                         default=str))

    # mteb's ResultCache reads the folder: both models' SciFact, the scores evaluate.py tabled
    loaded = mteb.ResultCache(sub).load_results(models=[name, MINILM], tasks=["SciFact"], include_remote=False)
    scores = {(m.model_name, m.model_revision): [100 * tr.get_score() for tr in m.task_results]
              for m in loaded.model_results}
    assert scores == {(name, revision): [pytest.approx(table[str(trained)]["SciFact"], abs=1e-9)],
                      (MINILM, registry.revision): [pytest.approx(table["all-MiniLM-L6-v2"]["SciFact"], abs=1e-9)]}
    assert 0.0 < table[str(trained)]["SciFact"] <= 100.0
    assert mteb.ResultCache(sub)._load_model_meta_from_cache(name, revision).to_dict() == meta.to_dict()

    # run settings: mteb's own lines (package versions, encode kwargs), with ours beside them
    from mteb.results.task_result import _read_run_settings_from_file

    (line,) = _read_run_settings_from_file(folder / "run_settings.jsonl")
    assert (line["task"], line["splits"], line["subsets"]) == ("SciFact", ["test"], ["default"])
    assert line["version"]["mteb"] == mteb.__version__ and line["encode_kwargs"]["batch_size"] == 16
    x = line["xprt"]
    assert x["batch_size"] == 16 and x["mteb_version"] == mteb.__version__ and x["dtype"] == "torch.float32"
    assert x["prompts"] == {"query": "", "document": ""} and x["max_length"] == 256
    assert x["code"]["sha256"] and "--submission SUBMISSION" in x["command"] and "my_claims" not in x["command"]
    assert x["task"]["dataset"] == {"path": "mteb/scifact", "revision": "d56462d0e63a25450459c4f213e49ffdb866f7f9"}
    assert x["task"]["mteb_ids"] == "the only id" and x["task"]["result_mteb_version"] == mteb.__version__

    # what is still missing, said in the output, README.md, submission.json and the Python entry
    record = json.loads((sub / "submission.json").read_text())
    ft = record["models"][str(trained)]
    assert ft["tasks"] == ["SciFact"] and ft["left_out"] == {"my_claims": "the user's own task, not an mteb task"}
    assert ft["missing"] == [
        "no Hub id: the leaderboard names a model by its Hub repository. Push it (train.py / finetune.py "
        "--push_to_hub --hub_model_id ORG/NAME) and evaluate the Hub id, whose revision is then the Hub commit"]
    assert record["models"]["all-MiniLM-L6-v2"]["missing"] == [] and record["models"]["all-MiniLM-L6-v2"]["registry"]
    # a folder named scifact is no evidence of SciFact's data: the user named it (--training_datasets)
    assert ft["said"]["training_datasets"] == ("--beir_dir scifact (finetune.py) -> no mteb task; --groups_dir groups "
                                               "(train.py) -> no mteb task; --training_datasets SciFact")
    readme = (sub / "README.md").read_text()
    assert "| training_datasets | `[\"SciFact\"]` | --beir_dir scifact (finetune.py) -> no mteb task;" in readme
    assert "| adapted_from | `\"sentence-transformers/all-MiniLM-L6-v2\"` | xprt_config.json's lineage" in readme
    assert f"mteb.ResultCache('{sub}').submit_results('local/ft', create_pr=True)" in readme
    printed = capsys.readouterr().out
    assert f"submission {sub}: local/ft at {revision}: 1 task result(s)\n  missing: no Hub id" in printed
    # results.md names the task's version
    md = (tmp_path / "out" / "results.md").read_text()
    assert ("| SciFact | the stock mteb task SciFact on mteb's data | mteb/scifact @ d56462d0e63a | the only id | "
            f"{mteb.__version__} |") in md


@pytest.mark.slow
def test_what_a_submission_lacks_without_public_code(trained, tmp_path, capsys):
    """A model with no public code (nor data) given, scored on a local copy only: each lack said in one line with the
    flag or step that fills it, in the output, README.md and the Python entry; the folder still holds the ModelMeta
    mteb validates."""
    rep = ev.main(["--models", str(trained), "--local_tasks", f"SciFact={ROOT / 'data' / 'eval' / 'scifact'}",
                   "--limit", "3", "--corpus_limit", "20", "--output_dir", str(tmp_path / "out"), "--results_dir",
                   str(tmp_path / "results"), "--submission", str(tmp_path / "sub"), "--no_card_update"])
    missing = rep["submission"]["models"][str(trained)]["missing"]
    data = ev.data_fingerprint(ROOT / "data" / "eval" / "scifact")
    assert missing == [
        "no Hub id: the leaderboard names a model by its Hub repository. Push it (train.py / finetune.py "
        "--push_to_hub --hub_model_id ORG/NAME) and evaluate the Hub id, whose revision is then the Hub commit",
        "--beir_dir scifact (finetune.py) is named like SciFact, and a name is no evidence of its data: if it holds "
        "an mteb task's data (a train split counts), add the task with --training_datasets",
        "--groups_dir groups (train.py) names no mteb task: if it holds an mteb task's data (a train split counts), "
        "add the task with --training_datasets",
        "no public training code given: pass --public_training_code URL",
        "no public training data given: pass --public_training_data URL",
        f"no result the leaderboard takes: SciFact: scored on a local copy (data_{data}), which mteb cannot tell is "
        "its data: rerun it as --tasks SciFact (needs the Hub)"]
    printed = capsys.readouterr().out
    assert "\n  missing: no public training code given: pass --public_training_code URL\n" in printed
    assert "- no public training code given: pass --public_training_code URL" in (tmp_path / "sub" /
                                                                                  "README.md").read_text()
    assert "#   - no public training code given: pass --public_training_code URL" in (
        tmp_path / "sub" / "model_meta" / "local__ft.py").read_text()
    (meta_file,) = (tmp_path / "sub" / "results").rglob("model_meta.json")
    meta = ModelMeta.model_validate_json_resolved(meta_file.read_text())
    assert meta.public_training_code is None and meta.openness["open training code"] is False
    assert not list((tmp_path / "sub" / "results").rglob("SciFact.json"))  # a local copy is no leaderboard result


def test_training_data_named_as_mteb_tasks(tmp_path):
    """mteb_tasks_of over the family of sources a run records: a Hub dataset id (mteb's own, or another's with the same
    last part), a local BEIR folder or file named as the task or its dataset, web text that names none."""
    assert lb.mteb_tasks_of("mteb/scifact") == ["SciFact"]
    assert lb.mteb_tasks_of("BeIR/scifact") == ["SciFact"]
    assert lb.mteb_tasks_of(str(ROOT / "data" / "eval" / "scifact")) == ["SciFact"]
    (tmp_path / "msmarco.jsonl").write_text("{}\n")  # FlagEmbedding's MS MARCO file, say
    assert lb.mteb_tasks_of(str(tmp_path / "msmarco.jsonl")) == ["MSMARCO"]
    assert lb.mteb_tasks_of("mteb/banking77") == ["Banking77Classification", "Banking77Classification.v2"]
    assert lb.mteb_tasks_of("HuggingFaceFW/fineweb") == lb.mteb_tasks_of(str(ROOT / "data" / "docs.jsonl")) == []
    (tmp_path / "pairs.jsonl").write_text("{}\n")
    assert lb.mteb_tasks_of(str(tmp_path / "pairs.jsonl")) == []  # a name that keeps no origin: no task


def test_task_ids_are_told_apart():
    """task_variant over the kinds of ids mteb 2.26 has: a revised (cleaned) id, the original it supersedes, an id
    with no revision."""
    assert ev.task_variant(mteb.get_task("STSBenchmark.v2").metadata) == (
        "revised id of STSBenchmark: This version removes duplicate sentence pairs from the validation and test "
        "splits when the same order-insensitive pair appears more than once in an evaluation split or appears in "
        "another split.")
    assert ev.task_variant(mteb.get_task("STSBenchmark").metadata) == (
        "original id; mteb revised it as STSBenchmark.v2: scores on the two do not compare (a benchmark that lists "
        "this id still scores it)")
    assert ev.task_variant(mteb.get_task("Touche2020Retrieval.v3").metadata) == "revised id of Touche2020"
    assert ev.task_variant(mteb.get_task("SciFact").metadata) == "the only id"


def test_a_folder_without_its_run_records_says_its_training_data_is_unknown(tiny_bert, tmp_path):
    """A model folder copied away from its run.json: the stage's data is unknown, so training_datasets is None
    (mteb's "unknown") and the lack is said, until --training_datasets names them."""
    import shutil

    from sentence_transformers import SentenceTransformer
    from test_evaluate import _xprt_run_folder

    folder = _xprt_run_folder(tiny_bert, tmp_path / "runs" / "copied")
    cfg = json.loads((folder / "xprt_config.json").read_text())
    cfg["lineage"] = [{"stage": "start", "model": None}, {"stage": "xprt pretrain (xprt), 2 steps (train.py)",
                                                          "model": None}]
    (folder / "xprt_config.json").write_text(json.dumps(cfg))
    st = SentenceTransformer(str(folder), device="cpu")
    prompts = {"query": "", "document": ""}
    meta, said, missing = lb.model_meta_of(str(folder), str(folder), st, prompts, 512)
    assert meta.training_datasets is None
    assert (f"training data unknown (xprt pretrain (xprt), 2 steps (train.py): no run.json beside {folder}): pass "
            "--training_datasets TASK ... (the mteb tasks whose data trained it; none when none did)") in missing
    assert ("no adapted_from: the start model was a local folder whose files name no Hub model (its xprt_config.json "
            "hub_model_id, config.json _name_or_path, card base_model): pass --adapted_from ORG/NAME, or none if it "
            "was trained from scratch") in missing
    meta, said, missing = lb.model_meta_of(str(folder), str(folder), st, prompts, 512, {"training_datasets": []})
    assert meta.training_datasets == set() and said["training_datasets"] == "--training_datasets (none)"
    shutil.rmtree(folder)


def test_the_submission_folder_is_checked_before_scoring(tmp_path):
    """--submission DIR is written whole: a folder it did not write is never replaced, an earlier one needs
    --overwrite, one inside an input is refused; an unknown --training_datasets name is refused at parse time."""
    stranger = tmp_path / "mine"
    stranger.mkdir()
    with pytest.raises(UserError, match="exists and is no folder evaluate.py --submission wrote"):
        lb.check_submission_folder(stranger, True, {})
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "submission.json").write_text(json.dumps({"written_by": lb.SUBMISSION_MARK}))
    with pytest.raises(UserError, match="holds an earlier submission: pass --overwrite"):
        lb.check_submission_folder(earlier, False, {})
    lb.check_submission_folder(earlier, True, {})
    with pytest.raises(UserError, match="is inside --models"):
        lb.check_submission_folder(tmp_path / "model" / "sub", False, {"--models": [tmp_path / "model"]})
    with pytest.raises(UserError, match="--training_datasets SciFcat"):
        ev.parse_args(["--models", "m", "--training_datasets", "SciFcat"])


def test_labelled_pairs_whose_name_says_no_task_are_said(tiny_bert, tmp_path):
    """finetune.py on a pairs file whose name keeps no origin (pairs.jsonl), from a local start with no Hub id: the
    ModelMeta claims no task it cannot name, and says both lacks (the pairs may be a task's train split; the start's
    own data cannot count) until --training_datasets names the task."""
    from sentence_transformers import SentenceTransformer

    beir = make_beir(tmp_path / "beir", num_docs=20, num_queries=8)
    corpus = {d["_id"]: d["text"] for d in map(json.loads, (beir / "corpus.jsonl").read_text().splitlines())}
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": q["text"], "positive": corpus[q["_id"].replace("q", "d")]}) + "\n"
                             for q in map(json.loads, (beir / "queries.jsonl").read_text().splitlines())))
    run(cli_args({"--model_name_or_path": tiny_bert, "--train_data": pairs, "--output_dir": tmp_path / "ft",
                  "--per_device_train_batch_size": 4, "--report_to": "none", "--max_train_steps": 2,
                  "--passage_max_length": 32, "--negatives_rank_min": 1, "--negatives_rank_max": 6}),
        main=finetune.main)
    folder = tmp_path / "ft" / "model"
    st = SentenceTransformer(str(folder), device="cpu")
    meta, said, missing = lb.model_meta_of(str(folder), str(folder), st, {"query": "", "document": ""}, 512)
    assert meta.training_datasets == set() and meta.adapted_from is None
    assert said["training_datasets"] == "--train_data pairs.jsonl (finetune.py) -> no mteb task"
    assert ("--train_data pairs.jsonl (finetune.py) names no mteb task: if it holds an mteb task's data (a train split "
            "counts), add the task with --training_datasets") in missing
    assert ("no adapted_from: the start model was a local folder whose files name no Hub model (its xprt_config.json "
            "hub_model_id, config.json _name_or_path, card base_model): pass --adapted_from ORG/NAME, or none if it "
            "was trained from scratch") in missing
    meta, said, missing = lb.model_meta_of(str(folder), str(folder), st, {"query": "", "document": ""}, 512,
                                           {"training_datasets": ["SciFact"]})
    assert meta.training_datasets == {"SciFact"} and not any("names no mteb task" in m for m in missing)


def test_the_submission_carries_mtebs_mock_run(tiny_bert, tmp_path, capsys):
    """mteb's model PR asks for its mock-run output (mteb.mock_run, mteb's built-in mock tasks, offline): the
    --submission folder carries mock_run/<org__name>.md, the report mteb's own MockRunResults.to_markdown writes,
    with every compatible mock task passed, named in submission.json and README.md (before: absent)."""
    from test_evaluate import _xprt_run_folder

    model = _xprt_run_folder(tiny_bert, tmp_path / "runs" / "mine")
    rep = ev.main(["--models", str(model), "--local_tasks", f"SciFact={ROOT / 'data' / 'eval' / 'scifact'}",
                   "--limit", "3", "--corpus_limit", "20", "--output_dir", str(tmp_path / "out"), "--results_dir",
                   str(tmp_path / "results"), "--submission", str(tmp_path / "sub"), "--no_card_update"])
    entry = rep["submission"]["models"][str(model)]
    assert entry["mock_run"] == {"report": "mock_run/local__mine.md", "all_passed": True}
    report = (tmp_path / "sub" / "mock_run" / "local__mine.md").read_text()
    assert report.startswith("# MTEB Mock-Run Results for `local/mine`\n\n| Task | Modality | Pass | Reason |")
    assert "| MockRetrievalTask | text | ✓ | - |" in report and "| MockSTSTask | text | ✓ | - |" in report
    assert "✗" not in report and "## Summary by Modality" in report
    assert "`mock_run/local__mine.md`: mteb.mock_run's report (all passed: True)" in (
        tmp_path / "sub" / "README.md").read_text()
