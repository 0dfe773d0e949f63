"""xprt_sentence_transformers.XPRTLoss (issue 63): the step equals train.py's, the groups become the
trainer's dataset with train.py's batches and masks, and sentence-transformers' machinery (bf16,
accumulation, evaluators, checkpoints and resume, two processes) runs it; its folder is one
train.py, finetune.py and evaluate.py read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STEP_ARGS = [
    "--max_length",
    "16",
    "--per_device_train_batch_size",
    "6",
    "--seed",
    "3",
    "--report_to",
    "none",
]


@pytest.fixture(scope="module")
def groups(tmp_path_factory, tiny_bert):
    import select_groups
    from test_select_groups import _docs, _write_jsonl

    tmp = tmp_path_factory.mktemp("st-groups")
    _write_jsonl(tmp / "docs.jsonl", _docs(12))
    select_groups.main(
        [
            "--input",
            str(tmp / "docs.jsonl"),
            "--model_name_or_path",
            str(tiny_bert),
            "--output_dir",
            str(tmp / "groups"),
            "--centrality_threshold",
            "-1",
        ]
    )
    return tmp / "groups"


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
    """A start other than the student, so the retention term is not 0 at step 0."""
    from conftest import build_tiny_bert

    return build_tiny_bert(tmp_path_factory.mktemp("teacher"), seed=1)


def train_py_step(tiny_bert, groups, teacher, out, step, max_steps):
    """train.py's own pieces, in main's order: flags, accelerator, seed, model, data (its first
    batch), teacher, then the loop's line: model(batch, teacher, w(t)) and backward -> (outputs,
    batch, {name: grad}, model)."""
    from accelerate.utils import set_seed

    import train
    from modeling_xprt import retention_weight
    from plumbing.training import make_accelerator

    args = train.parse_args(
        [
            "--model_name_or_path",
            str(tiny_bert),
            "--groups_dir",
            str(groups),
            "--output_dir",
            str(out),
            "--teacher_name_or_path",
            str(teacher),
            *STEP_ARGS,
        ]
    )
    accelerator = make_accelerator(args, find_unused_parameters=False)
    set_seed(args.seed)
    model, tok = train.load_pretraining_model(accelerator, args)
    _, _, loader = train.load_data(accelerator, args, model, tok)
    teacher_model = train.load_teacher_model(accelerator, args)
    batch = next(iter(loader))
    torch.manual_seed(11)  # dropout
    w = retention_weight(step, max_steps, args.retention_weight, args.retention_final_weight)
    out = model(batch, teacher=teacher_model, retention_weight=w)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, batch, grads, model


def st_loss(tiny_bert, teacher, **kw):
    """The SentenceTransformer of the same start and its XPRTLoss, the heads drawn from train.py's
    seed."""
    from accelerate.utils import set_seed
    from sentence_transformers import SentenceTransformer

    from xprt_sentence_transformers import XPRTLoss

    model = SentenceTransformer(str(tiny_bert), device="cpu")
    set_seed(
        3
    )  # train.py seeds before it loads the model: the fresh decoder draws the same weights
    return model, XPRTLoss(model, max_length=16, teacher=str(teacher), **kw)


def test_the_loss_and_each_term_and_every_gradient_equal_train_pys_step(
    tiny_bert, groups, other_teacher, tmp_path
):
    """Same rows, same seeds: the collated batch is train.py's tensor for tensor; the loss, each of
    the six terms and the gradient of every parameter equal train.py's step to fp32 rounding (rtol
    1e-5, atol 1e-7: the same functions on the same tensors; the two runs differ only in which
    Python object holds the encoder, so any gap would be summation order, which fp32 rounds at ~1e-7
    relative)."""
    from sentence_transformers import SentenceTransformerTrainer

    from xprt_sentence_transformers import PREFIX

    ref, ref_batch, ref_grads, ref_model = train_py_step(
        tiny_bert, groups, other_teacher, tmp_path / "t", 3, 10
    )
    model, loss = st_loss(tiny_bert, other_teacher)
    data = loss.groups_dataset(str(groups))
    sampler = loss.batch_sampler(data, batch_size=6, seed=3)
    rows = data[sampler.batches()[0]]
    inputs = loss.collate([dict(zip(rows, v)) for v in zip(*rows.values())])
    features, _ = SentenceTransformerTrainer.collect_features(None, inputs)
    batch = next(f for f in features if "layout" in f)
    assert set(batch) == set(ref_batch) and len(inputs) == len(ref_batch)
    for k, v in ref_batch.items():
        if torch.is_tensor(v):
            assert torch.equal(batch[k], v), k
    assert all(k.startswith(PREFIX) for k in inputs)

    # heads and encoder: the same values (the heads drawn from one seed by one load_xprt_folder)
    ours = dict(loss.xprt.named_parameters())
    for n, p in ref_model.named_parameters():
        assert torch.equal(ours[n], p), n

    class State:
        global_step, max_steps = 3, 10

    loss.state = State()
    torch.manual_seed(11)
    value = loss(features)
    value.backward()
    assert value.item() == pytest.approx(ref["loss"].item(), rel=1e-5, abs=1e-7)
    terms = {k: v[-1] for k, v in loss.logged.items()}
    for k in (
        "xp_loss",
        "cross_fill_loss",
        "self_fill_loss",
        "mlm_loss",
        "uniformity_loss",
        "retention_loss",
    ):
        assert terms[k] == pytest.approx(ref[k].item(), rel=1e-5, abs=1e-7), k
    assert ref["retention_loss"].item() > 0 and ref["cross_fill_loss"].item() > 0
    grads = {n: p.grad for n, p in loss.xprt.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads)
    for n, g in ref_grads.items():
        assert torch.allclose(grads[n], g, rtol=1e-5, atol=1e-7), n
    gap = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    print(
        f"\nloss {value.item():.6f} vs train.py {ref['loss'].item():.6f}; "
        f"largest gradient gap {gap:.1e} over "
        f"{len(ref_grads)} tensors; terms "
        + ", ".join(f"{k} {terms[k]:.5f}" for k in sorted(terms))
    )
    # the SentenceTransformer's own parameters are the ones trained: one set of encoder weights
    st_params = {id(p) for p in model.parameters()}
    assert all(id(p) in st_params for n, p in loss.xprt.base.named_parameters())


def test_the_ablations_and_the_gradient_cache_are_options(tiny_bert, groups, other_teacher):
    """fill_in=False drops L_cross (the decoder's self passes stay); positive='random' puts the
    random passage in slot 1; gradient_cache_chunk runs XPRTModel.cached_step: the same loss and
    gradients as the plain step."""
    from sentence_transformers import SentenceTransformerTrainer

    def step(**kw):
        model, loss = st_loss(tiny_bert, other_teacher, **kw)
        data = loss.groups_dataset(str(groups))
        sampler = loss.batch_sampler(data, batch_size=6, seed=3)
        rows = data[sampler.batches()[0]]
        features, _ = SentenceTransformerTrainer.collect_features(
            None, loss.collate([dict(zip(rows, v)) for v in zip(*rows.values())])
        )
        for m in loss.modules():  # no dropout: the cached and plain steps then draw nothing
            m.eval() if isinstance(m, torch.nn.Dropout) else None
        value = loss(features)
        if value.requires_grad:
            value.backward()
        grads = {n: p.grad.clone() for n, p in loss.xprt.named_parameters() if p.grad is not None}
        return value.item(), {k: v[-1] for k, v in loss.logged.items()}, grads, features

    plain, plain_terms, plain_grads, _ = step()
    _, terms, _, _ = step(fill_in=False)
    assert "cross_fill_loss" not in terms and terms["self_fill_loss"] > 0
    _, random_terms, _, features = step(positive="random")
    batch = next(f for f in features if "layout" in f)
    # slot 1 (L_xp's positive, the second self pass) holds another passage than s1, which the
    # retention pairs (anchor x s1) keep
    assert not torch.equal(batch["input_ids"][:, 1, :4], batch["retain_input_ids"][:, 1, :4])
    assert random_terms["xp_loss"] != pytest.approx(plain_terms["xp_loss"], rel=1e-3)
    cached, cached_terms, cached_grads, _ = step(gradient_cache_chunk=2)
    assert cached == pytest.approx(plain, rel=1e-5)
    for k, v in plain_terms.items():
        assert cached_terms[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    for n, g in plain_grads.items():
        assert torch.allclose(cached_grads[n], g, rtol=1e-4, atol=1e-6), n


def trainer_run(tiny_bert, groups, out, resume=None, **extra):
    """A SentenceTransformerTrainer run of XPRTLoss: bf16, accumulation 2, an evaluator every 2
    steps, a checkpoint every 2 steps, 4 steps logged one by one -> (trainer, loss, model)."""
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    from xprt_sentence_transformers import XPRTLoss

    model = SentenceTransformer(str(tiny_bert), device="cpu")
    loss = XPRTLoss(model, max_length=16)
    data = loss.groups_dataset(str(groups))
    evaluator = EmbeddingSimilarityEvaluator(
        ["a cat sat", "rain fell", "stocks rose"],
        ["a cat rested", "it rained", "markets fell"],
        [0.9, 0.8, 0.2],
        name="toy-sts",
    )
    args = SentenceTransformerTrainingArguments(
        str(out),
        max_steps=4,
        per_device_train_batch_size=6,
        gradient_accumulation_steps=2,
        bf16=True,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        seed=3,
        use_cpu=not torch.cuda.is_available(),
        batch_sampler=loss.batch_sampler,
        report_to="none",
        **extra,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=data,
        loss=loss,
        evaluator=evaluator,
        **loss.trainer_kwargs(),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, loss, model


def losses_by_step(trainer) -> dict:
    return {r["step"]: r for r in trainer.state.log_history if "loss" in r and "xp_loss" in r}


@pytest.mark.slow
def test_the_trainer_runs_it_with_bf16_accumulation_evaluators_and_resumes(
    tiny_bert, groups, tmp_path
):
    """4 steps under bf16 with accumulation 2, the evaluator every 2 steps, checkpoints with the
    heads; a run resumed from checkpoint-2 logs the uninterrupted run's losses at steps 3 and 4 and
    ends with its heads. The saved folder: the card names XPRTLoss; train.py's loader restores its
    heads; finetune.py and evaluate.py read it."""
    import shutil

    import evaluate
    import finetune
    from modeling_xprt import XPRTModel
    from plumbing.model_folder import load_xprt_folder

    full, loss, model = trainer_run(tiny_bert, groups, tmp_path / "a")
    logged = losses_by_step(full)
    assert sorted(logged) == [1, 2, 3, 4]
    assert all(
        k in logged[1]
        for k in ("xp_loss", "cross_fill_loss", "retention_loss", "in_batch_negatives")
    )
    assert any("eval_toy-sts_spearman_cosine" in r for r in full.state.log_history)
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert (ckpt / "xprt_heads.safetensors").is_file() and (ckpt / "optimizer.pt").is_file()

    (tmp_path / "b").mkdir()
    shutil.copytree(ckpt, tmp_path / "b" / "checkpoint-2")
    resumed, loss_b, _ = trainer_run(
        tiny_bert, groups, tmp_path / "b", resume=str(tmp_path / "b" / "checkpoint-2")
    )
    again = losses_by_step(
        resumed
    )  # steps 1-2 from checkpoint-2's trainer_state.json, 3-4 run again
    assert sorted(again) == [1, 2, 3, 4] and resumed.state.global_step == 4
    for s in (3, 4):
        for k in ("loss", "xp_loss", "cross_fill_loss", "mlm_loss", "retention_loss"):
            assert again[s][k] == pytest.approx(logged[s][k], rel=1e-3, abs=1e-4), (s, k)
    for (n, p), q in zip(
        loss.xprt.objective.named_parameters(), loss_b.xprt.objective.parameters()
    ):
        assert torch.allclose(p, q, atol=1e-6), n

    folder = tmp_path / "a" / "model"
    model.save_pretrained(str(folder))
    card = (folder / "README.md").read_text(encoding="utf-8")
    assert "XPRTLoss" in card
    from sentence_transformers import SentenceTransformer

    texts = ["a cat sat on the mat", "stocks rose"]
    back_st = SentenceTransformer(str(folder), device="cpu")
    # the trained weights, loaded back by sentence-transformers (after training the in-memory
    # model's forward runs under accelerate's bf16 autocast: its vectors are not the fp32 ones)
    trained = model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in back_st.state_dict().items())
    assert back_st.encode(texts).shape == (2, 32)
    cfg = json.loads((folder / "xprt_config.json").read_text())
    assert cfg["objective"] == "xprt" and cfg["heads"]["objective"] == "xprt"
    back = load_xprt_folder(XPRTModel, str(folder))
    assert "xprt heads restored" in back.load_message
    for (n, p), q in zip(loss.xprt.objective.named_parameters(), back.objective.parameters()):
        assert torch.equal(p, q), n
    import train

    train.main(
        [
            "--model_name_or_path",
            str(folder),
            "--groups_dir",
            str(groups),
            "--output_dir",
            str(tmp_path / "cont"),
            "--max_train_steps",
            "1",
            "--no_save_model",
            *STEP_ARGS,
        ]
    )
    finetune.main(
        [
            "--model_name_or_path",
            str(folder),
            "--train_data",
            str(ROOT / "data" / "pairs.jsonl"),
            "--output_dir",
            str(tmp_path / "ft"),
            "--max_train_steps",
            "1",
            "--per_device_train_batch_size",
            "4",
            "--passage_max_length",
            "16",
            "--report_to",
            "none",
            "--no_save_model",
        ]
    )
    evaluate.main(
        [
            "--models",
            str(folder),
            "--local_tasks",
            str(ROOT / "data" / "eval" / "stsbenchmark"),
            "--output_dir",
            str(tmp_path / "eval"),
            "--limit",
            "10",
            "--max_length",
            "16",
        ]
    )
    assert "stsbenchmark" in (tmp_path / "eval" / "results.md").read_text().lower()


@pytest.fixture(scope="module")
def no_dropout_bert(tiny_bert, tmp_path_factory):
    """The tiny BERT without dropout: train.py's run and the trainer's then draw nothing but the
    seeded masks."""
    import shutil

    folder = tmp_path_factory.mktemp("st-nodrop") / "bert"
    shutil.copytree(tiny_bert, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**cfg, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    )
    return folder


@pytest.mark.slow
def test_two_processes_gather_as_train_py_and_resume(no_dropout_bert, groups, tmp_path):
    """torchrun --nproc_per_node 2 (gloo, CPU): train.py's step 1 and XPRTLoss's step 1 under the
    trainer log the same losses (each process's rows against both processes' gathered s1), the two
    processes end with the same weights (the loss's one gradient average), and a run resumed from
    checkpoint-1 logs step 2 as the uninterrupted run."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            *torchrun,
            str(ROOT / "train.py"),
            "--model_name_or_path",
            str(no_dropout_bert),
            "--groups_dir",
            str(groups),
            "--output_dir",
            str(tmp_path / "train_py"),
            "--max_train_steps",
            "1",
            "--logging_steps",
            "1",
            "--no_save_model",
            *STEP_ARGS,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log = [
        json.loads(ln)
        for ln in (tmp_path / "train_py" / "train_log.jsonl").read_text().splitlines()
    ]
    ref = next(r for r in log if r.get("step") == 1 and "loss" in r)
    proc = subprocess.run(
        [
            *torchrun,
            str(ROOT / "tests" / "dist_st_check.py"),
            str(no_dropout_bert),
            str(groups),
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT "))[7:])
    print(
        "\ntrain.py (2 processes) step 1: "
        + json.dumps(
            {
                k: round(v, 4)
                for k, v in ref.items()
                if k.endswith("loss") or k == "in_batch_negatives"
            }
        )
    )
    print("\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith("LOG")))
    st, resumed = report["trainer"], report["resumed"]
    # the total: XPRTLoss's own mean over the processes (xprt_loss), as train.py's log averages it
    assert st["1"]["xprt_loss"] == pytest.approx(ref["loss"], rel=1e-3, abs=1e-4)
    for k in (
        "xp_loss",
        "cross_fill_loss",
        "mlm_loss",
        "uniformity_loss",
        "in_batch_negatives",
    ):
        assert st["1"][k] == pytest.approx(ref[k], rel=1e-3, abs=1e-4), k
    assert report["same_weights_across_processes"]
    assert ref["in_batch_negatives"] > 6  # the other process's rows are candidates (6 rows each)
    for k in ("loss", "xp_loss", "cross_fill_loss"):
        assert resumed["2"][k] == pytest.approx(st["2"][k], rel=1e-5, abs=1e-6), k
