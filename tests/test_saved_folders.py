"""Every folder a script saves loads (issue 43, family 2): the save is loaded back by sentence-transformers (and so
transformers' AutoModel) before "saved", with the run's vectors; a start model's own code travels with the folder or
is refused at the start; a checkpoint is exported to a model folder by one command, and refused as a model naming it.
Every run here is a real train.py / finetune.py run."""

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_bert
from safetensors.torch import load_file
from test_finetune import ft_args, make_beir
from test_train import base_args, groups, run  # noqa: F401  (groups: a fixture)

import finetune
from plumbing import model_folder
from plumbing.common import UserError

CUSTOM_CONFIG = ("from transformers import BertConfig\n\n\nclass CustomConfig(BertConfig):\n"
                 "    model_type = 'xprt_custom_bert'\n")
# the modeling file imports the configuration's relatively, as Hub repositories' code does
CUSTOM_MODELING = ("from transformers import BertForMaskedLM, BertModel\n\nfrom .configuration_custom import "
                   "CustomConfig\n\n\nclass CustomModel(BertModel):\n    config_class = CustomConfig\n\n\n"
                   "class CustomForMaskedLM(BertForMaskedLM):\n    config_class = CustomConfig\n")


def custom_code_model(path: Path, auto_model: str = "modeling_custom.CustomModel") -> Path:
    """A tiny BERT whose config only its own code builds (model_type unknown to transformers, auto_map to
    configuration_custom.py and modeling_custom.py in the folder), as a remote-code Hub model is."""
    build_tiny_bert(path)
    (path / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (path / "modeling_custom.py").write_text(CUSTOM_MODELING)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="xprt_custom_bert", architectures=["CustomForMaskedLM"], auto_map={
        "AutoConfig": "configuration_custom.CustomConfig", "AutoModel": auto_model,
        "AutoModelForMaskedLM": "modeling_custom.CustomForMaskedLM"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


FLAGS = {"--num_related": 2, "--max_length": 24}


def test_a_start_models_code_travels_with_the_saved_folder(groups, tmp_path, capsys):
    """Before: model/config.json kept the auto_map to modeling_custom.py, which was not copied, so
    SentenceTransformer, AutoModel and evaluate.py failed on 'does not appear to have a file named
    modeling_custom.py'. Now the code travels (with what it imports), the save is loaded back before "saved", and
    the folder loads in sentence-transformers and AutoModel, giving the vectors XPRTModel computes."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from plumbing.embed import embed_texts

    start, out = custom_code_model(tmp_path / "custom"), tmp_path / "run"
    run(base_args(start, groups, out, **FLAGS, **{"--max_train_steps": 2, "--trust_remote_code": True}))
    said = capsys.readouterr().out
    assert f"saved {out / 'model'} (loaded back by sentence-transformers: 3 texts' vectors within" in said
    saved = out / "model"
    assert (saved / "modeling_custom.py").read_text() == CUSTOM_MODELING
    assert (saved / "configuration_custom.py").read_text() == CUSTOM_CONFIG
    texts = ["a passage about rivers", "Zürich"]
    st = SentenceTransformer(str(saved), device="cpu", trust_remote_code=True)
    auto = AutoModel.from_pretrained(saved, trust_remote_code=True)
    assert type(auto).__name__ == "CustomModel"  # the start's own class, from the folder's own code
    plain = embed_texts(auto.eval(), AutoTokenizer.from_pretrained(saved), texts)  # mean pooling, L2 (the card's)
    assert torch.allclose(torch.as_tensor(st.encode(texts)), plain, atol=1e-5)


def test_custom_code_that_cannot_travel_is_refused_at_the_start(groups, tmp_path):
    """An auto_map naming a file the model's folder lacks (here AutoModel's, which training never loads but every
    user of the saved folder does) is refused before any work, naming the file; nothing is written."""
    start = custom_code_model(tmp_path / "custom", auto_model="modeling_missing.CustomModel")
    out = tmp_path / "run"
    with pytest.raises(UserError, match="auto_map names modeling_missing.py, which is not in the model's folder"):
        run(base_args(start, groups, out, **FLAGS, **{"--max_train_steps": 2, "--trust_remote_code": True}))
    assert not (out / "train_log.jsonl").exists() and not (out / "model").exists()


def test_a_folder_that_loads_as_another_model_is_not_saved(tiny_bert, groups, tmp_path, monkeypatch):
    """The load-back check on a folder whose weights are not the run's (the encoder's state dict perturbed on its
    way to disk): refused before the rename, so the previous model/ stays as it was and no temporary is left."""
    out = tmp_path / "run"
    argv = base_args(tiny_bert, groups, out, **FLAGS, **{"--max_train_steps": 2})
    run(argv)
    before = (out / "model" / "model.safetensors").read_bytes()
    complete = model_folder.complete_base_state_dict
    monkeypatch.setattr(model_folder, "complete_base_state_dict",
                        lambda model: {k: v + 0.01 if v.is_floating_point() else v for k, v in complete(model).items()})
    with pytest.raises(RuntimeError, match="loads as another model"):
        run(argv + ["--overwrite"])
    assert (out / "model" / "model.safetensors").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_a_checkpoint_exports_to_the_model_the_run_saved_and_is_refused_as_a_model(tiny_bert, groups, tmp_path):
    """A run of 2 steps checkpointed at step 2 saves model/; `train.py --export_checkpoint checkpoints/step_2
    --output_dir DIR` writes DIR/model with every tensor of that model/ (the same bytes' values) and a card naming
    the step. Before: the checkpoint given as --model_name_or_path failed deep in transformers ('install
    sentencepiece or tiktoken'); now it is refused naming the export command. Other flags with the export are
    refused (they come from the checkpoint)."""
    out = tmp_path / "run"
    run(base_args(tiny_bert, groups, out, **FLAGS, **{"--max_train_steps": 2, "--checkpointing_steps": 2}))
    ckpt = out / "checkpoints" / "step_2"
    run(["--export_checkpoint", ckpt, "--output_dir", tmp_path / "exported"])
    a, b = load_file(out / "model" / "model.safetensors"), load_file(tmp_path / "exported" / "model" /
                                                                      "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    heads = [load_file(d / "xprt_heads.safetensors") for d in (out / "model", tmp_path / "exported" / "model")]
    assert all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])
    assert "checkpoint step 2" in (tmp_path / "exported" / "model" / "README.md").read_text()
    with pytest.raises(UserError, match="a training checkpoint, not a model folder. `python train.py "
                                        "--export_checkpoint"):
        run(base_args(ckpt, groups, tmp_path / "next", **FLAGS, **{"--max_train_steps": 2}))
    with pytest.raises(UserError, match="drop --learning_rate"):
        run(["--export_checkpoint", ckpt, "--output_dir", tmp_path / "again", "--learning_rate", "1e-3"])
    with pytest.raises(UserError, match="exists: --overwrite"):
        run(["--export_checkpoint", ckpt, "--output_dir", tmp_path / "exported"])


def test_a_finetune_checkpoint_exports_too(tiny_bert, tmp_path):
    """finetune.py --export_checkpoint: the PAIR model of its checkpoint, equal to the finished run's model/."""
    beir, out = make_beir(tmp_path / "beir"), tmp_path / "ft"
    run(ft_args(tiny_bert, beir, out, **{"--max_train_steps": 2, "--checkpointing_steps": 2}), main=finetune.main)
    run(["--export_checkpoint", out / "checkpoints" / "step_2", "--output_dir", tmp_path / "exported"],
        main=finetune.main)
    a, b = (load_file(d / "model" / "model.safetensors") for d in (out, tmp_path / "exported"))
    assert all(torch.equal(a[k], b[k]) for k in a)
