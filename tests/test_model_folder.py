"""The saved model folder as others use it: a complete sentence-transformers model (prompts, mean pooling, cosine),
a Hub-ready card (base_model, usage code that runs, the command without local paths, evaluation results),
--push_to_hub up to the upload call, and no transformers LOAD REPORT when it is loaded.

One real train.py run (tiny random BERT named like E5, 2 steps) and one finetune.py run from its output, shared by
the tests of this module."""

import contextlib
import io
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from test_finetune import make_beir
from test_train import base_args, make_groups, run

import finetune
import modeling_xprt as mx
from plumbing import common, model_folder
from plumbing.model_folder import load_xprt_folder
from plumbing import embed

HUB_ID = "someone/xprt-e5-tiny"


@pytest.fixture(scope="module")
def runs(tiny_bert, tmp_path_factory):
    """train.py with --push_to_hub (HfApi's create_repo / upload_folder recorded, nothing sent), then finetune.py from
    its folder on a FlagEmbedding JSONL file. Returns the paths and the recorded Hub calls."""
    from huggingface_hub import HfApi

    tmp = tmp_path_factory.mktemp("folder")
    e5 = tmp / "e5-tiny"
    e5.symlink_to(tiny_bert, target_is_directory=True)
    calls = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, **kw):
        # what would be uploaded: the final folder, complete at the time of the call
        calls.append(("upload_folder", repo_id, Path(folder_path), sorted(p.name for p in Path(folder_path).iterdir())))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HfApi, "create_repo", create_repo)
        mp.setattr(HfApi, "upload_folder", upload_folder)
        run(base_args(e5, make_groups(tmp / "groups", 12), tmp / "xprt",
                      **{"--max_train_steps": 2, "--learning_rate": 1e-3, "--push_to_hub": True,
                         "--hub_model_id": HUB_ID, "--hub_private": True, "--hub_token": "hf_secret_token",
                         "--license": "mit"}))
    beir = make_beir(tmp / "beir")
    fe = tmp / "pairs.jsonl"  # FlagEmbedding format with its own negatives: no mining
    corpus = [json.loads(line)["text"] for line in (beir / "corpus.jsonl").read_text().splitlines()]
    fe.write_text("".join(json.dumps({"query": " ".join(corpus[i].split()[:8]), "pos": [corpus[i]],
                                      "neg": [corpus[i + 20], corpus[i + 30]]}) + "\n" for i in range(12)))
    run(["--model_name_or_path", tmp / "xprt" / "model", "--train_data", fe, "--output_dir", tmp / "ft",
         "--max_train_steps", 2, "--per_device_train_batch_size", 4, "--report_to", "none"], main=finetune.main)
    return {"tmp": tmp, "model": tmp / "xprt" / "model", "ft": tmp / "ft" / "model", "calls": calls}


@pytest.mark.slow  # shares the module's train.py + finetune.py runs (about 35 s)
def test_saved_folder_is_a_complete_sentence_transformers_model(runs):
    """SentenceTransformer(folder) has E5's prompts, mean pooling, cosine; encode_query = "query: " + text by hand."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    folder = runs["model"]
    assert [m["type"].rsplit(".", 1)[1] for m in json.loads((folder / "modules.json").read_text())] == \
        ["Transformer", "Pooling", "Normalize"]
    assert json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"] == 512
    st = SentenceTransformer(str(folder), device="cpu")
    assert st.prompts["query"] == "query: " and st.prompts["document"] == "passage: "
    assert st[1].get_config_dict()["pooling_mode"] == "mean"
    assert st.similarity_fn_name == "cosine"
    texts = ["which passages does an anchor retrieve?", "a second query"]
    model, tok = AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert torch.allclose(torch.from_numpy(st.encode_query(texts)),
                          embed.embed_texts(model, tok, texts, prefix="query: "), atol=1e-5)
    assert torch.allclose(torch.from_numpy(st.encode_document(texts)),
                          embed.embed_texts(model, tok, texts, prefix="passage: "), atol=1e-5)


def _python_blocks(card: str) -> list:
    return re.findall(r"```python\n(.*?)```", card, flags=re.S)


@pytest.mark.slow  # shares the module's train.py + finetune.py runs (about 35 s)
def test_card_metadata_usage_code_and_command_without_local_paths(runs):
    """The card's YAML is huggingface_hub's; both usage snippets run on the folder and give the same similarity; no
    local path and no token is on the card; the fine-tuned model names the pushed one as its base_model."""
    from huggingface_hub import ModelCard

    card_text = (runs["model"] / "README.md").read_text()
    data = ModelCard(card_text).data
    assert data.base_model is None  # a local start model: nothing on the Hub to name
    # the start (a tiny folder without a card) states no language, so the card claims none
    assert (data.library_name, data.pipeline_tag, data.language) == ("sentence-transformers",
                                                                      "sentence-similarity", None)
    assert "xprt" in data.tags and data.license == "mit"  # --license
    assert str(runs["tmp"]) not in card_text and "/tmp" not in card_text and "hf_secret_token" not in card_text
    assert "python train.py --model_name_or_path MODEL_NAME_OR_PATH --groups_dir GROUPS_DIR --output_dir " \
           "OUTPUT_DIR" in card_text
    assert f"--hub_model_id {HUB_ID}" in card_text and "--hub_token" not in card_text
    assert '"max_train_steps": 2' in card_text and "| xp_loss |" in card_text
    assert f'model_id = "{HUB_ID}"' in card_text
    # both snippets, pointed at the folder instead of the Hub: the same similarity
    sims = []
    for code in _python_blocks(card_text):
        ns = {}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code.replace(f'"{HUB_ID}"', repr(str(runs["model"]))), ns)  # noqa: S102 - our own card's code
        sims.append(float(ns["model"].similarity(ns["queries"], ns["documents"])[0, 0]) if "queries" in ns
                    else float(ns["embeddings"][0] @ ns["embeddings"][1]))
    assert len(sims) == 2 and sims[0] == pytest.approx(sims[1], abs=1e-5)
    assert 'texts = ["query: which passages' in card_text  # the transformers snippet writes the prefix by hand
    # the fine-tuned model: base_model is the Hub repository its start folder was pushed to
    ft = (runs["ft"] / "README.md").read_text()
    assert ModelCard(ft).data.base_model == HUB_ID
    assert ModelCard(ft).data.license == "mit"  # no --license: the start folder's card's
    assert "python finetune.py --model_name_or_path MODEL_NAME_OR_PATH --train_data TRAIN_DATA" in ft
    assert json.loads((runs["model"] / "xprt_config.json").read_text())["hub_model_id"] == HUB_ID
    # every stage in the lineage, the xPRT one too, with no local path
    lineage = json.loads((runs["ft"] / "xprt_config.json").read_text())["lineage"]
    assert [s["stage"].split(",")[0] for s in lineage] == ["start", "xprt pretrain (xprt)",
                                                          "xprt finetune (PAIR loss"]
    assert [s["model"] for s in lineage] == [None, HUB_ID, None]  # the start is a local folder
    assert f"Lineage: start (local) -> xprt pretrain (xprt), 2 steps (train.py) ({HUB_ID}) -> xprt finetune" in ft
    assert str(runs["tmp"]) not in ft


@pytest.mark.slow  # shares the module's train.py + finetune.py runs (about 35 s)
def test_push_to_hub_creates_the_repo_and_uploads_the_final_folder(runs):
    (c_name, c_repo, c_kw), (u_name, u_repo, u_folder, u_files) = runs["calls"]
    assert (c_name, c_repo, c_kw["private"], c_kw["exist_ok"]) == ("create_repo", HUB_ID, True, True)
    assert (u_name, u_repo, u_folder) == ("upload_folder", HUB_ID, runs["model"])
    assert {"README.md", "model.safetensors", "modules.json", "config_sentence_transformers.json",
            "xprt_heads.safetensors", "1_Pooling"} <= set(u_files)
    with pytest.raises(common.UserError, match="--hub_model_id"):
        finetune.parse_args(["--output_dir", "x", "--beir_dir", "b", "--push_to_hub"])


def test_base_model_and_licence_of_a_hub_start_model(tmp_path):
    """MiniLM (the offline alias) is named by its Hub id with the licence of its own card; a local folder is not
    named; a folder saved from MiniLM carries MiniLM's pooler unchanged."""
    from safetensors.torch import load_file

    assert model_folder.hub_base_model("all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"
    assert model_folder.hub_base_model("intfloat/e5-base-unsupervised") == "intfloat/e5-base-unsupervised"
    assert model_folder.hub_base_model(str(tmp_path)) is None
    assert model_folder.card_license("all-MiniLM-L6-v2") == "apache-2.0"
    model = load_xprt_folder(mx.XPRTModel, "all-MiniLM-L6-v2")
    assert model.info.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    start = load_file(str(Path(common.resolve_model_path("all-MiniLM-L6-v2")) / "model.safetensors"))
    saved = model_folder.complete_base_state_dict(model)
    assert torch.equal(saved["pooler.dense.weight"], start["pooler.dense.weight"])


def _loading_output(fn, capfd):
    """Everything a load writes: the transformers loggers (whatever handler they have) and stdout / stderr."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        fn()
    finally:
        log.removeHandler(handler)
    out, err = capfd.readouterr()
    return "\n".join(records) + out + err


@pytest.mark.slow  # shares the module's train.py + finetune.py runs (about 35 s)
def test_loading_a_saved_folder_prints_no_load_report(runs, tiny_bert, capfd):
    """AutoModel, SentenceTransformer and XPRTModel load the folder without transformers' LOAD REPORT (the pooler is
    saved; the heads come from xprt_heads.safetensors); the unchanged start checkpoint (no pooler) still gets one from
    AutoModel, so the capture does see reports."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    folder = str(runs["model"])
    for load in (lambda: AutoModel.from_pretrained(folder), lambda: SentenceTransformer(folder, device="cpu"),
                 lambda: load_xprt_folder(mx.XPRTModel, folder),
                 lambda: load_xprt_folder(mx.XPRTModel, str(runs["ft"]))):
        out = _loading_output(load, capfd)
        assert "LOAD REPORT" not in out and "MISSING" not in out, out
    assert "LOAD REPORT" in _loading_output(lambda: AutoModel.from_pretrained(str(tiny_bert)), capfd)


@pytest.mark.slow  # shares the module's train.py + finetune.py runs (about 35 s)
def test_eval_results_section_is_rewritten_not_repeated(runs, tmp_path):
    """add_eval_results_to_card twice (a task rescored, one added): one Evaluation section, the model-index holds
    the latest scores, the rest of the card is unchanged."""
    import shutil

    from huggingface_hub import ModelCard

    folder = tmp_path / "m"
    shutil.copytree(runs["model"], folder)
    before = (folder / "README.md").read_text()
    model_folder.add_eval_results_to_card(folder, {"SciFact": {"metric": "ndcg_at_10", "score": 61.234},
                                         "STSBenchmark": {"metric": "cosine_spearman", "score": 80.5}}, "evaluate.py")
    model_folder.add_eval_results_to_card(folder, {"SciFact": {"metric": "ndcg_at_10", "score": 62.0}},
                                          "evaluate.py (2)")
    text = (folder / "README.md").read_text()
    assert text.count("## Evaluation") == 1 and text.count(model_folder.EVAL_SECTION_START) == 1
    assert "| SciFact | Retrieval | ndcg_at_10 | 62.00 |" in text \
        and "| STSBenchmark | STS | cosine_spearman | 80.50 |" in text and "61.23" not in text
    model_folder.add_eval_results_to_card(folder, {"ArguAna": {"metric": "ndcg_at_10", "score": 40.0,
                                                     "dataset_id": "mteb/arguana",
                                                     "split": "test", "revision": "abc123"}}, "evaluate.py (3)")
    arg = [e for e in ModelCard.load(folder / "README.md").data.eval_results if e.dataset_name == "ArguAna"][0]
    assert (arg.dataset_type, arg.dataset_split, arg.dataset_revision) == ("mteb/arguana", "test", "abc123")
    assert ModelCard.load(folder / "README.md").data.model_name == HUB_ID  # the Hub id the folder records
    card = ModelCard.load(folder / "README.md")
    card.data.eval_results = [e for e in card.data.eval_results if e.dataset_name != "ArguAna"]
    assert {(e.dataset_name, e.metric_type, e.metric_value) for e in card.data.eval_results} == \
        {("SciFact", "ndcg_at_10", 62.0), ("STSBenchmark", "cosine_spearman", 80.5)}
    assert card.data.model_name == HUB_ID
    assert ModelCard(before).text.strip() in card.text  # everything else kept
    with pytest.raises(ValueError, match="metric"):
        model_folder.add_eval_results_to_card(folder, {"X": {"score": 1}}, "s")
