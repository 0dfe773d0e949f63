"""The paper's own setting: E5's "query: " / "passage: " prefixes travel with the model through every step, are
never masking candidates, and selected passages reach the encoder whole; the retention term starts at 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_args
from test_modeling import collator_for

from modeling_xprt import XPRTCollator, XPRTModel
from plumbing.common import E5_PROMPTS, model_prompts
from plumbing.model_folder import load_teacher, load_xprt_folder

ROOT = Path(__file__).resolve().parent.parent


def _groups_rows(n=4, related=4):
    rows = []
    for line in (ROOT / "data" / "docs.jsonl").read_text().splitlines():
        d = json.loads(line)
        paras = [p for p in d["text"].split("\n") if len(p) > 40]
        if len(paras) >= related + 2:
            rows.append({"doc_id": d["id"], "anchor": paras[0], "related": paras[1:related + 1],
                         "random_passage": paras[related + 1]})
        if len(rows) == n:
            break
    return rows


@pytest.mark.parametrize("objective", ["xprt", "self_reconstruction", "contrastive_random_span"])
def test_prefix_tokens_are_never_masked_and_passages_arrive_whole(minilm_path, objective):
    """With "passage: " every encoder row starts [CLS] passage : ...; no prefix position is ever a MLM or fill-in
    target, and --max_length counts the passage's own tokens (+ [CLS], [SEP] and the prefix on top)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    prefix = tok("passage: ", add_special_tokens=False)["input_ids"]
    rows = _groups_rows()
    for seed in range(5):
        c = collator_for(objective, tok, max_length=24, passage_prefix="passage: ", seed=seed,
                         encoder_mask_rate=0.9 if objective == "contrastive_random_span" else None)
        b = c(rows)
        ids = b["input_ids"].flatten(0, 1) if b["input_ids"].dim() == 3 else b["input_ids"]  # crops: (G, L)
        assert ids[:, 1 : 1 + len(prefix)].tolist() == [prefix] * ids.shape[0]  # the prefix is intact
        if "mlm_labels" in b:
            rows_of = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731  ((G, P, L) or (G, L) -> rows)
            assert (rows_of(b["mlm_labels"])[:, : 1 + len(prefix)] == -100).all()
            assert (rows_of(b["dec_labels"])[:, : 1 + len(prefix)] == -100).all()
            assert (rows_of(b["dec_input_ids"])[:, 1 : 1 + len(prefix)] != tok.mask_token_id).all()
        # 24 passage tokens + [CLS] + [SEP] + 3 prefix tokens
        assert b["retain_input_ids"].shape[-1] == 24 + 2 + len(prefix)
    # a passage of exactly max_length tokens is not cut
    text = " ".join(["retrieval"] * 24)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == 24
    b = XPRTCollator(tok, max_length=24, passage_prefix="passage: ", num_related=1)(
        [{"doc_id": "d", "anchor": text, "related": [text], "random_passage": text}])
    assert int(b["retain_attention_mask"][0, 0].sum()) == 24 + 2 + len(prefix)


def test_retention_is_zero_at_step_0_on_minilm(minilm_path):
    """The clean-student retention term compares the model with its own frozen copy: at step 0 it is 0 (the
    student pass runs without dropout; with dropout it was 0.02-0.04 on these batches)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    torch.manual_seed(0)
    model = load_xprt_folder(XPRTModel, minilm_path).train()
    teacher = load_teacher(minilm_path)
    for seed in range(3):
        out = model(XPRTCollator(tok, max_length=64, seed=seed)(_groups_rows(8)), teacher=teacher,
                    retention_weight=40.0)
        assert out["retention_loss"].item() == pytest.approx(0.0, abs=1e-7)
    assert model.training and model.encoder.training  # the pass restored the training mode


def _run(script, args):
    proc = subprocess.run([sys.executable, str(ROOT / script), *cli_args(args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_e5_prefixes_travel_through_select_train_finetune_evaluate(tiny_bert, tmp_path):
    """A tiny model whose name says E5, through the four real scripts (no stand-ins): every step states the prefixes
    it uses, the trained and the fine-tuned folders carry them where sentence-transformers reads them, and
    evaluate.py scores both with "query: " / "passage: "."""
    from sentence_transformers import SentenceTransformer
    from test_finetune import make_beir
    from transformers import AutoModel, AutoTokenizer

    from plumbing.embed import embed_texts

    e5 = tmp_path / "e5-tiny"
    e5.symlink_to(tiny_bert, target_is_directory=True)
    log = _run("select_groups.py", {"--input": ROOT / "data" / "docs.jsonl", "--model_name_or_path": e5,
                                    "--anchor_share": 0.5, "--calibration_docs": 50, "--max_docs": 120,
                                    "--output_dir": tmp_path / "groups"})
    assert "passage prefix 'passage: '" in log
    log = _run("train.py", {"--model_name_or_path": e5, "--groups_dir": tmp_path / "groups", "--max_length": 32,
                            "--output_dir": tmp_path / "xprt", "--max_train_steps": 2, "--report_to": "none",
                            "--per_device_train_batch_size": 4, "--learning_rate": 1e-3})
    assert "prefixes: query 'query: ', passage 'passage: '" in log
    trained = tmp_path / "xprt" / "model"
    assert model_prompts(str(trained)) == E5_PROMPTS
    log = _run("finetune.py", {"--model_name_or_path": trained, "--beir_dir": make_beir(tmp_path / "beir"),
                               "--output_dir": tmp_path / "ft", "--max_train_steps": 2, "--report_to": "none",
                               "--per_device_train_batch_size": 4, "--negatives_rank_min": 2})
    assert "prefixes: query 'query: ', passage 'passage: '" in log
    tuned = tmp_path / "ft" / "model"
    assert json.loads((tuned / "xprt_config.json").read_text())["start_model"] == str(e5)
    log = _run("evaluate.py", {"--models": trained, "--output_dir": tmp_path / "eval",
                               "--local_tasks": ROOT / "data" / "eval" / "scifact", "--limit": 20})
    assert f"model {trained}: prefixes: query 'query: ', passage 'passage: '" in log
    log = _run("evaluate.py", {"--models": tuned, "--output_dir": tmp_path / "eval2",
                               "--local_tasks": ROOT / "data" / "eval" / "scifact", "--limit": 20})
    assert f"model {tuned}: prefixes: query 'query: ', passage 'passage: '" in log
    # sentence-transformers applies the saved prompts: encode_query == encoding "query: ..." by hand
    st = SentenceTransformer(str(tuned), device="cpu")
    texts = ["what do anchors retrieve?", "a second query"]
    by_hand = embed_texts(AutoModel.from_pretrained(tuned), AutoTokenizer.from_pretrained(tuned), texts,
                          prefix="query: ")
    assert torch.allclose(torch.from_numpy(st.encode_query(texts)), by_hand, atol=1e-5)
    assert torch.allclose(torch.from_numpy(st.encode_document(texts)),
                          embed_texts(AutoModel.from_pretrained(tuned), AutoTokenizer.from_pretrained(tuned), texts,
                                      prefix="passage: "), atol=1e-5)
