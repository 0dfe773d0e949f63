"""One key for what changes an output (issue 64, item 1): common.output_key, over every file of a tokenizer or model
folder that changes tokens or vectors (common.output_files, common.tokenizer_files) and the flags, code and library
versions that do, keys the token cache (train.tokenized) and a model folder's revision (leaderboard.content_revision,
under which evaluate.py files and serves its results). Each file of a folder the real producer writes
(model_folder.save_xprt_folder, as train.py does), and each setting, is edited in turn: every edit that changes the
tokens misses the token cache, every edit of the folder changes the revision, and the records that change neither
(the card, the decoder heads, the lineage) keep both."""

import json
import shutil
from pathlib import Path

import pytest
from test_caches import groups  # noqa: F401 - select_groups.py's groups of 12 documents (a fixture)

import modeling_xprt as mx
import train
from plumbing import leaderboard as lb

ROOT = Path(__file__).resolve().parent.parent


def edit_json(name, **changes):
    def edit(folder: Path):
        data = json.loads((folder / name).read_text())
        for key, value in changes.items():
            node, *path = key.split(".")
            target = data
            for part in [node, *path][:-1]:
                target = target[part]
            target[[node, *path][-1]] = value(target.get([node, *path][-1])) if callable(value) else value
        (folder / name).write_text(json.dumps(data, indent=2))
    return edit


def add_to_a_weight(folder: Path):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    k = next(iter(weights))
    weights[k] = weights[k] + 1
    save_file(weights, str(folder / "model.safetensors"))


def swap_two_words(vocab: dict) -> dict:
    a, b = "the", "of"
    return {**vocab, a: vocab[b], b: vocab[a]}


def drop_normalize(folder: Path):
    modules = json.loads((folder / "modules.json").read_text())
    assert modules[-1]["type"].endswith("Normalize"), modules
    (folder / "modules.json").write_text(json.dumps(modules[:-1]))


# every file the producer writes that changes vectors, edited (the tokenizer's edits may change the tokens too)
FOLDER_EDITS = {
    "tokenizer_config.json truncation_side": edit_json("tokenizer_config.json", truncation_side="left"),
    "tokenizer_config.json split_special_tokens": edit_json("tokenizer_config.json", split_special_tokens=True),
    "tokenizer_config.json do_lower_case": edit_json("tokenizer_config.json", do_lower_case=False),
    "tokenizer.json normalizer lowercase": edit_json("tokenizer.json", **{"normalizer.lowercase": False}),
    "tokenizer.json vocabulary": edit_json("tokenizer.json", **{"model.vocab": swap_two_words}),
    "config.json layer_norm_eps": edit_json("config.json", layer_norm_eps=1e-3),
    "model.safetensors": add_to_a_weight,
    "modules.json (no Normalize)": drop_normalize,
    "1_Pooling/config.json (CLS)": edit_json("1_Pooling/config.json", pooling_mode_cls_token=True,
                                             pooling_mode_mean_tokens=False),
    "sentence_bert_config.json max_seq_length": edit_json("sentence_bert_config.json", max_seq_length=8),
    "config_sentence_transformers.json prompts": edit_json("config_sentence_transformers.json",
                                                           prompts={"query": "query: ", "document": "passage: "}),
    "xprt_config.json start_model": edit_json("xprt_config.json", start_model="intfloat/e5-small-v2"),
}
# what records the model's history or card: neither the tokens nor the vectors change
RECORD_EDITS = {
    "README.md": lambda f: (f / "README.md").write_text("a new card"),
    "xprt_heads.safetensors": lambda f: (f / "xprt_heads.safetensors").write_bytes(b"other heads"),
    "xprt_config.json hub_model_id": edit_json("xprt_config.json", hub_model_id="me/other"),
    "xprt_config.json lineage": edit_json("xprt_config.json", lineage=[{"model": "x", "stage": "y"}]),
}


@pytest.fixture(scope="module")
def model(tiny_bert, tmp_path_factory) -> Path:
    from test_evaluate import _xprt_run_folder

    return _xprt_run_folder(tiny_bert, tmp_path_factory.mktemp("output_key") / "run")


def token_cache(folder: Path, rows, **setting):
    """train.tokenized with the folder's tokenizer (as training.load_model loads it), `setting` set on it after
    loading -> the cached dataset (its fingerprint names the cache)."""
    from accelerate import PartialState
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    for k, v in setting.items():
        setattr(tok, k, v)
    return train.tokenized(PartialState(), rows, mx.XPRTCollator(tok, max_length=24))


def test_the_files_counted_are_the_folders_own(model):
    """The folder the producer writes holds every file the edits below touch (so the table is over its real files)."""
    names = {f.relative_to(model).as_posix() for f in model.rglob("*") if f.is_file()}
    edited = {k.split(" ")[0] for k in (*FOLDER_EDITS, *RECORD_EDITS)}
    assert edited <= names, edited - names


def fresh_tokens(folder: Path, rows, **setting) -> dict:
    """The groups' tokens as the folder's tokenizer makes them now, with no cache (tokenize_groups called)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    for k, v in setting.items():
        setattr(tok, k, v)
    collator = mx.XPRTCollator(tok, max_length=24)
    return mx.tokenize_groups(rows[:], tok, collator.passage_prefix, len(collator.prefix_ids) + 24, False,
                              ["anchor", "related", "random_passage"])


def tokens_of(cached) -> dict:
    return {k: [list(v) for v in cached[k]] for k in ("anchor_ids", "related_ids", "random_passage_ids")}


@pytest.mark.parametrize("what", list(FOLDER_EDITS))
def test_each_file_that_changes_tokens_or_vectors_changes_the_key(what, model, groups, tmp_path):  # noqa: F811
    """An edited copy of the folder: a new revision; the token cache's tokens are the edited tokenizer's (never the
    earlier cache's): an edit that changes them misses the cache, and one of a file the tokenizer does not save
    (weights, configs, modules) keeps it (no needless re-tokenising). transformers 5 rebuilds a BERT tokenizer's
    normalizer from tokenizer_config.json's do_lower_case: tokenizer.json's own normalizer changes no token."""
    from transformers import AutoTokenizer

    rows = train.load_groups(str(groups))
    before, rev = token_cache(model, rows), lb.content_revision(str(model))
    copy = Path(shutil.copytree(model, tmp_path / "model"))
    assert lb.content_revision(str(copy)) == rev  # a copy is the same model
    FOLDER_EDITS[what](copy)
    after, fresh = token_cache(copy, rows), fresh_tokens(copy, rows)
    assert lb.content_revision(str(copy)) != rev, what
    assert tokens_of(after) == {k: [list(v) for v in fresh[k]] for k in tokens_of(after)}, what  # never stale
    AutoTokenizer.from_pretrained(model).save_pretrained(tmp_path / "tok")
    tokenizers = {f.name for f in (tmp_path / "tok").iterdir()}  # the files a tokenizer's saved state is
    missed, changed = after._fingerprint != before._fingerprint, tokens_of(after) != tokens_of(before)
    assert (missed or not changed) and (missed <= (what.split(" ")[0] in tokenizers)), what
    print(f"| {what} | {changed} | {missed} | True |")


@pytest.mark.parametrize("setting", [{"truncation_side": "left"}, {"split_special_tokens": True}],
                         ids=["truncation_side", "split_special_tokens"])
def test_each_tokenizer_setting_changes_the_token_key(setting, model, groups):  # noqa: F811
    """A setting changed on the loaded tokenizer (no file touched) changes the tokens and misses the cache too."""
    rows = train.load_groups(str(groups))
    after, before = token_cache(model, rows, **setting), token_cache(model, rows)
    fresh = fresh_tokens(model, rows, **setting)
    assert tokens_of(after) == {k: [list(v) for v in fresh[k]] for k in tokens_of(after)}
    assert after._fingerprint != before._fingerprint
    print(f"| setting {setting} | {tokens_of(after) != tokens_of(before)} | True | - |")


@pytest.mark.parametrize("what", list(RECORD_EDITS))
def test_records_keep_the_key(what, model, groups, tmp_path):  # noqa: F811
    """The card, the decoder heads and the lineage records change no token and no vector: same revision, same
    token cache."""
    rows = train.load_groups(str(groups))
    before, rev = token_cache(model, rows), lb.content_revision(str(model))
    copy = Path(shutil.copytree(model, tmp_path / "model"))
    RECORD_EDITS[what](copy)
    assert lb.content_revision(str(copy)) == rev and token_cache(copy, rows)._fingerprint == before._fingerprint


def test_evaluate_serves_no_stale_result_after_a_tokenizer_edit(model, tmp_path):
    """evaluate.py files a result under the folder's revision and serves it again from its results folder: after
    tokenizer_config.json is edited (truncation on the left, at --max_length 16), the score it returns is the
    edited model's (equal to a fresh results folder's), not the earlier one."""
    import evaluate

    scifact = f"SciFact={ROOT / 'data' / 'eval' / 'scifact'}"
    copy = Path(shutil.copytree(model, tmp_path / "run" / "model"))

    def score(results):
        out = evaluate.run_evaluation([str(copy)], local_tasks=[scifact], limit=20, max_length=16,
                                      results_dir=str(results), show_progress=False)
        return out["results"][str(copy)]["SciFact"]["main_score"]

    first = score(tmp_path / "results")
    edit_json("tokenizer_config.json", truncation_side="left")(copy)
    served, fresh = score(tmp_path / "results"), score(tmp_path / "fresh")
    assert fresh != pytest.approx(first, abs=1e-6)  # the edit changes the vectors: the comparison has teeth
    assert served == pytest.approx(fresh, abs=1e-6)
