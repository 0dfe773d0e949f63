"""The leaderboard ModelMeta from evidence, not names (issue 64 item 4; issue 62 item 3): training_datasets names a
task when a record (a Hub dataset id) or the data itself (a BEIR corpus with the task's statistics) shows it, and
says a name alone is a guess; adapted_from of a start given as a local folder is what that folder says it is, or
--adapted_from. On the records the real train.py, finetune.py and select_groups.py leave."""

import json
import shutil
from pathlib import Path

import pytest
from test_finetune import ft_args
from test_train import base_args, make_groups, run

import evaluate as ev
import finetune
from plumbing import leaderboard as lb

ROOT = Path(__file__).resolve().parent.parent


def trained_datasets(model: Path, given=None):
    """training_datasets_of on a model folder, as model_meta_of calls it -> (the set, said, missing)."""
    said, missing = {}, []
    cfg = json.loads((model / "xprt_config.json").read_text())
    return lb.training_datasets_of(str(model), cfg, given or {}, said, missing), said, missing


def test_a_web_text_folder_named_news_is_no_news_task(tiny_bert, tmp_path):
    """select_groups.py on a web-text folder named news/, then train.py: no task is named (its name is only said
    as a guess), and the source is listed for the user to name."""
    import select_groups

    news = tmp_path / "news"
    news.mkdir()
    with open(ROOT / "data" / "docs.jsonl") as src, open(news / "docs.jsonl", "w") as dst:
        dst.writelines(line for _, line in zip(range(12), src))
    select_groups.main(["--input", str(news), "--model_name_or_path", str(tiny_bert), "--output_dir",
                        str(tmp_path / "groups"), "--centrality_threshold", "-1"])
    run(base_args(tiny_bert, tmp_path / "groups", tmp_path / "run", **{"--max_train_steps": 1, "--max_length": 24,
                                                                        "--num_related": 2}))
    tasks, said, missing = trained_datasets(tmp_path / "run" / "model")
    assert lb.mteb_tasks_of(str(news)) == ["NewsClassification.v2"]  # what the name alone would say
    assert tasks == set() and said["training_datasets"] == "--groups_dir news (train.py) -> no mteb task"
    assert ("--groups_dir news (train.py) is named like NewsClassification.v2, and a name is no evidence of its "
            "data: if it holds an mteb task's data (a train split counts), add the task with --training_datasets"
            ) in missing


@pytest.fixture(scope="module")
def scifact_named_msmarco(shared_data, tmp_path_factory) -> Path:
    """The full BEIR SciFact folder (../shared/data/scifact) under the name msmarco/."""
    return Path(shutil.copytree(shared_data / "scifact", tmp_path_factory.mktemp("lying") / "msmarco"))


def test_a_beir_folder_named_msmarco_holding_scifact_is_scifact(tiny_bert, scifact_named_msmarco, tmp_path):
    """finetune.py on a BEIR folder named msmarco/ that holds SciFact: SciFact, by its corpus's statistics (mteb's
    descriptive statistics of SciFact's documents); MSMARCO, its name, is not listed."""
    run(ft_args(tiny_bert, scifact_named_msmarco, tmp_path / "ft", **{"--max_train_steps": 1}),
        main=finetune.main)
    tasks, said, missing = trained_datasets(tmp_path / "ft" / "model")
    assert tasks == {"SciFact"}, (tasks, said, missing)
    assert said["training_datasets"] == ("--beir_dir msmarco (finetune.py) -> SciFact (its corpus's statistics "
                                         "are SciFact's)")
    assert not any("msmarco" in m for m in missing)


def test_sources_are_tasks_by_their_data(scifact_named_msmarco, tmp_path):
    """The family of sources: a Hub id that is a task's dataset (a record), one that only shares a name (a guess),
    a BEIR folder and the corpus.jsonl groups are selected from (the data), a sample of a task's corpus (its
    statistics are not the task's: a guess by its name), web text."""
    assert lb.tasks_of("mteb/scifact")[0] == ["SciFact"] and lb.tasks_of("BeIR/scifact") == ([], "")
    assert lb.tasks_of(str(scifact_named_msmarco))[0] == ["SciFact"]
    corpus = tmp_path / "web" / "corpus.jsonl"  # groups selected from a task's corpus record this file
    corpus.parent.mkdir()
    shutil.copy(scifact_named_msmarco / "corpus.jsonl", corpus)
    assert lb.tasks_of(str(corpus))[0] == ["SciFact"]
    assert lb.tasks_of(str(ROOT / "data" / "eval" / "scifact")) == ([], "")
    assert lb.tasks_of(str(ROOT / "data" / "docs.jsonl")) == ([], "") == lb.tasks_of("HuggingFaceFW/fineweb")


def start_says(kind: str, folder: Path):
    """A start folder that names the model it is in one of the ways a folder can."""
    if kind == "config _name_or_path":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "google-bert/bert-base-uncased"}))
    elif kind == "card base_model":
        (folder / "README.md").write_text("---\nbase_model: google-bert/bert-base-uncased\n---\n\n# a start\n")


@pytest.mark.parametrize("kind", ["config _name_or_path", "card base_model", "nothing"])
def test_a_local_starts_adapted_from_is_what_its_folder_says(kind, tiny_bert, tmp_path):
    """train.py from a start given as a local folder: adapted_from is the Hub model the folder's own files name;
    a folder that names none leaves it missing, with the flag that gives it (evaluate.py --adapted_from)."""
    start = Path(shutil.copytree(tiny_bert, tmp_path / "start"))
    start_says(kind, start)
    run(base_args(start, make_groups(tmp_path / "groups", 8), tmp_path / "run",
                  **{"--max_train_steps": 1, "--max_length": 24, "--num_related": 2}))
    model = tmp_path / "run" / "model"
    cfg = json.loads((model / "xprt_config.json").read_text())
    said, missing = {}, []
    found = lb.adapted_from(str(model), model, cfg, said, missing)
    if kind == "nothing":
        assert found is None
        assert any(m.startswith("no adapted_from") and "--adapted_from ORG/NAME" in m for m in missing), missing
        assert ev.parse_args(["--models", str(model), "--adapted_from", "me/start"]).adapted_from == "me/start"
    else:
        assert found == "google-bert/bert-base-uncased" and kind.split(" ")[-1] in said["adapted_from"], said
