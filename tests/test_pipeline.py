"""The model is the whole sentence-transformers pipeline, and its prompts are used as mteb uses them.

Start folders are built with sentence-transformers itself from the tiny BERT: Transformer -> Pooling -> every module
type sentence-transformers ships that can follow pooling (Dense, LayerNorm, Dropout, Normalize) and a truncate_dim.
Each goes through train.py (and finetune.py) to a saved folder that SentenceTransformer loads with the start's modules
and dimension; selection embeds as SentenceTransformer(start).encode does; a module xprt cannot carry is refused by
name. Prompts: every key kept in the saved folder, and evaluate.py picks the prompt mteb's own wrapper picks.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import cli_args
from test_finetune import make_beir
from test_train import make_groups, run

from plumbing.model_folder import load_xprt_folder

TEXTS = ["Dense retrieval maps passages to vectors.", "A short one.", "The cat sat on the mat, again and again.",
         "Anchors are the passages closest to their document's mean vector."]

# Every module sentence-transformers exports, by where it can stand in a model. The test fails when a version adds
# one, so that it is placed here (and, if it can follow pooling, tested through the scripts below).
INPUT_MODULES = {"Transformer", "StaticEmbedding", "CLIPModel", "WordEmbeddings", "BoW", "InputModule", "Module"}
BEFORE_POOLING = {"CNN", "LSTM", "WeightedLayerPooling", "WordWeights"}
ROUTING = {"Router", "Asym"}
AFTER_POOLING = {"Dense", "Dropout", "LayerNorm", "Normalize"}


def post_modules(kind: str, hidden: int):
    """(modules after pooling, truncate_dim) of one start folder of the family."""
    from sentence_transformers.sentence_transformer.modules import Dense, Dropout, LayerNorm, Normalize

    torch.manual_seed(1)
    return {
        "dense_normalize": ([Dense(hidden, 16, activation_function=torch.nn.Tanh()), Normalize()], None),
        "layernorm": ([LayerNorm(hidden)], None),
        "dropout_normalize": ([Dropout(0.1), Normalize()], None),
        "normalize_truncate": ([Normalize()], 8),
        "dense_layernorm_truncate": ([Dense(hidden, 24, activation_function=torch.nn.Identity()), LayerNorm(24)], 12),
    }[kind]


def build_start(tiny_bert, out: Path, kind: str, pooling: str = "mean", prompts=None) -> Path:
    """A start folder saved by sentence-transformers: the tiny BERT, its Pooling, then `kind`'s modules."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    first = Transformer(str(tiny_bert))
    post, truncate = post_modules(kind, first.get_embedding_dimension())
    st = SentenceTransformer(modules=[first, Pooling(first.get_embedding_dimension(), pooling), *post],
                             device="cpu", truncate_dim=truncate, prompts=prompts)
    st.save(str(out))
    return out


def st_layout(folder) -> tuple:
    """(module class names, embedding dimension, truncate_dim) of a folder as sentence-transformers loads it."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return [type(m).__name__ for m in st], st.get_embedding_dimension(), st.truncate_dim


def post_state(folder) -> dict:
    """The parameters of the modules after pooling, by module index."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return {f"{i}.{k}": v.clone() for i, m in enumerate(list(st)[2:]) for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return make_groups(tmp_path_factory.mktemp("groups"), 16)


def test_every_module_sentence_transformers_ships_is_placed():
    import sentence_transformers.sentence_transformer.modules as modules

    assert set(modules.__all__) == INPUT_MODULES | BEFORE_POOLING | ROUTING | AFTER_POOLING | {"Pooling"}


@pytest.mark.parametrize("kind", ["dense_normalize", "layernorm", "dropout_normalize", "normalize_truncate",
                                  "dense_layernorm_truncate"])
def test_train_keeps_the_modules_after_pooling(kind, tiny_bert, groups, tmp_path):
    """train.py from a start with modules after pooling: the saved folder has the start's modules (their weights
    unchanged: frozen), dimension and truncate_dim; its SentenceTransformer vectors are the XPRTModel's own; the
    encoder moved; the log says what happened."""
    from sentence_transformers import SentenceTransformer

    from modeling_xprt import XPRTModel

    start = build_start(tiny_bert, tmp_path / "start", kind)
    out = tmp_path / "run"
    run(cli_args({"--model_name_or_path": start, "--groups_dir": groups, "--output_dir": out, "--max_length": 32,
                  "--per_device_train_batch_size": 4, "--report_to": "none", "--max_train_steps": 2,
                  "--learning_rate": 1e-3, "--seed": 7}))
    saved = out / "model"
    assert st_layout(saved) == st_layout(start)
    before, after = post_state(start), post_state(saved)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    st_saved, st_start = (SentenceTransformer(str(f), device="cpu") for f in (saved, start))
    v_saved, v_start = (torch.from_numpy(m.encode(TEXTS)) for m in (st_saved, st_start))
    assert not torch.allclose(v_saved, v_start, atol=1e-4)  # the encoder trained
    model = load_xprt_folder(XPRTModel, str(saved)).eval()
    tok = st_saved.tokenizer
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model.post_pooling(model.encode(enc["input_ids"], enc["attention_mask"])[1])
    assert torch.allclose(ours, v_saved, atol=1e-5)
    log = (out / "model" / "README.md").read_text()
    assert "kept frozen" in log and model.info.modules and model.info.dim == v_saved.shape[1]


def test_finetune_keeps_the_modules_after_pooling(tiny_bert, tmp_path):
    """finetune.py the same: the saved folder encodes at the start's dimension with the start's modules."""
    import finetune

    start = build_start(tiny_bert, tmp_path / "start", "dense_layernorm_truncate")
    beir = make_beir(tmp_path / "beir")
    out = tmp_path / "ft"
    run(cli_args({"--model_name_or_path": start, "--beir_dir": beir, "--output_dir": out,
                  "--per_device_train_batch_size": 4, "--num_negatives": 1, "--max_train_steps": 2,
                  "--report_to": "none", "--query_max_length": 16, "--passage_max_length": 32}), finetune.main)
    assert st_layout(out / "model") == st_layout(start)
    before, after = post_state(start), post_state(out / "model")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind,pooling", [("dense_normalize", "mean"), ("dense_layernorm_truncate", "cls")])
def test_selection_embeds_as_sentence_transformers_does(kind, pooling, tiny_bert, tmp_path):
    """select_groups.py's encoder (load_selection_encoder, then the embed_texts call select_documents makes) gives
    SentenceTransformer(start).encode's vectors, L2-normalised (centrality and the ranking are cosines)."""
    import argparse

    from accelerate import PartialState
    from sentence_transformers import SentenceTransformer

    import select_groups

    start = build_start(tiny_bert, tmp_path / "start", kind, pooling)
    sel = select_groups.Selection(model_name_or_path=str(start), passage_prefix="")
    args = argparse.Namespace(device="cpu", batch_size=3, trust_remote_code=False)
    encoder = select_groups.load_selection_encoder(args, sel, PartialState(cpu=True))
    ours = select_groups.embed_passages(encoder, TEXTS, "")
    ref = SentenceTransformer(str(start), device="cpu").encode(TEXTS, convert_to_tensor=True, normalize_embeddings=True)
    assert ours.shape == ref.shape and torch.allclose(torch.as_tensor(ours), ref, atol=1e-5)


def test_modules_xprt_cannot_carry_are_refused_by_name(tiny_bert, tmp_path):
    """A module between the transformer and the pooling (CNN), and one that routes queries and documents
    differently (Router) after it, are refused when the model loads, naming the module."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import CNN, Dense, Pooling, Router, Transformer

    from modeling_xprt import XPRTModel

    first = Transformer(str(tiny_bert))
    h = first.get_embedding_dimension()
    SentenceTransformer(modules=[first, CNN(h, out_channels=8, kernel_sizes=[1]), Pooling(8)], device="cpu").save(
        str(tmp_path / "cnn"))
    with pytest.raises(ValueError, match="1_CNN.*between the transformer and the pooling"):
        load_xprt_folder(XPRTModel, str(tmp_path / "cnn"))
    router = Router.for_query_document([Dense(h, 8)], [Dense(h, 8)])
    SentenceTransformer(modules=[first, Pooling(h), router], device="cpu").save(str(tmp_path / "router"))
    with pytest.raises(ValueError, match="2_Router"):
        load_xprt_folder(XPRTModel, str(tmp_path / "router"))


# ---------------------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------------------
BGE_QUERY = "Represent this sentence for searching relevant passages: "


def test_every_prompt_key_survives_training(tiny_bert, groups, tmp_path):
    start = build_start(tiny_bert, tmp_path / "start", "normalize_truncate",
                        prompts={"query": BGE_QUERY, "STSBenchmark": "sts: ", "Retrieval-document": "doc: "})
    out = tmp_path / "run"
    run(cli_args({"--model_name_or_path": start, "--groups_dir": groups, "--output_dir": out, "--max_length": 32,
                  "--per_device_train_batch_size": 4, "--report_to": "none", "--max_train_steps": 1}))
    saved = json.loads((out / "model" / "config_sentence_transformers.json").read_text())["prompts"]
    assert saved["STSBenchmark"] == "sts: " and saved["query"] == BGE_QUERY
    assert saved["Retrieval-document"] == "doc: "


@pytest.mark.parametrize("prompts", [{"query": BGE_QUERY},
                                     {"query": BGE_QUERY, "STSBenchmark": "sts: ", "Retrieval-document": "doc: "}])
def test_evaluate_picks_the_prompt_mteb_picks(prompts, tiny_bert, tmp_path):
    """The prompt of each side of a retrieval task and of a symmetric task is the one mteb's own
    SentenceTransformerEncoderWrapper gives, and the scores on local tasks are the wrapper's."""
    import numpy as np
    from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper
    from mteb.types import PromptType
    from sentence_transformers import SentenceTransformer

    import evaluate

    start = build_start(tiny_bert, tmp_path / "start", "normalize_truncate", prompts=prompts)
    ours = evaluate.XPRTEncoder(str(start), device="cpu", dtype="fp32")
    root = Path(__file__).resolve().parent.parent / "data" / "eval"
    sts = evaluate.build_task("STSBenchmark", local=(root / "stsbenchmark", "sts"), limit=20)
    scifact = evaluate.build_task("SciFact", local=(root / "scifact", "retrieval"), limit=5, corpus_limit=50)
    expect = {(sts, None): prompts.get("STSBenchmark", ""),
              (scifact, PromptType.query): BGE_QUERY,
              (scifact, PromptType.document): prompts.get("Retrieval-document", "")}
    for (task, side), prompt in expect.items():
        assert ours.prefix_for(task.metadata, side) == prompt
    wrapper = SentenceTransformerEncoderWrapper(SentenceTransformer(str(start), device="cpu"))
    for task in (sts, scifact):
        task.load_data()
        a = evaluate.evaluate_model_on_task(ours, task, 16)["main_score"]
        b = evaluate.evaluate_model_on_task(wrapper, task, 16)["main_score"]
        assert np.isclose(a, b, atol=1e-6), (task.metadata.name, a, b)
