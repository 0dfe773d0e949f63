"""The README's paper map is the code that runs: one training step of every objective and ablation, run through the
real scripts under sys.setprofile, calls each paper-map function of that objective (and never L_cross without the
fill-in loss); every function the map names for modeling_xprt.py, train.py, finetune.py and select_groups.py exists
and ran in one of these runs."""

import re
import sys
import threading
from pathlib import Path

import pytest
from conftest import cli_args
from test_finetune import make_beir
from test_select_groups import _docs, _write_jsonl
from test_train import base_args

import finetune
import select_groups
import train

ROOT = Path(__file__).resolve().parent.parent
# every Python file of the repository a step can run: the root's scripts, the arms, the plumbing
SCRIPTS = tuple(str(p.relative_to(ROOT)) for d in (ROOT, ROOT / "baselines", ROOT / "plumbing") for p in d.glob("*.py"))

# What one step of each objective must run (qualified names), beyond what every step runs.
EVERY_PRETRAIN_STEP = {"XPRTModel.encode", "mean_pool", "retention_loss",
                       "retention_weight", "load_mlm_encoder"}
EXPECTED = {
    "xprt": {"XPRTModel.forward", "XPRTObjective.encode", "XPRTObjective.batch_terms", "XPRTObjective.row_terms",
             "xp_loss", "info_nce",
             "gather_with_grad", "cross_fill_loss", "self_fill_loss", "mlm_loss", "uniformity_loss",
             "decoder_pass_plan", "ConditionedDecoder.forward", "XPRTObjective.decode", "XPRTObjective.total",
             "linear_cross_entropy", "linear_kl_div", "_FusedLinearCE.forward"},
    "no_fill_in": {"XPRTObjective.row_terms", "xp_loss", "info_nce", "self_fill_loss", "mlm_loss", "uniformity_loss",
                   "decoder_pass_plan", "ConditionedDecoder.forward", "linear_kl_div"},
    "positive_random": {"XPRTObjective.batch_terms", "xp_loss", "cross_fill_loss", "self_fill_loss", "mlm_loss"},
    "contrastive_random_span": {"contrastive_random_span", "info_nce", "gather_with_grad"},
    "self_reconstruction": {"self_reconstruction", "mlm_loss", "ConditionedDecoder.forward", "linear_cross_entropy"},
    "gradient_cache": {"XPRTModel.cached_step", "Layout.chunks", "XPRTObjective.row_terms", "xp_loss"},
    "retromae": {"whole_word_mask", "enhanced_decoding_masks", "enhanced_decoding", "retromae_decoder_loss",
                 "mlm_loss", "linear_cross_entropy"},
    "simlm": {"simlm_masks", "replace_tokens", "simlm_replaced_lm_loss", "run_layers", "linear_cross_entropy"},
    "contriever": {"crop_spans", "delete_words", "contriever_loss"},
    "revela": {"revela_attention_weights", "revela_loss", "revela_attention", "in_batch_attention"},
    "pair": {"pair_q_loss", "pair_p_loss", "pair_loss", "pair_false_negatives", "info_nce", "pair_alpha_at",
             "mine_hard_negatives", "XPRTModel.encode", "mean_pool"},
}
NEVER = {"no_fill_in": {"cross_fill_loss"}}


def paper_map():
    """{script: {function}} named in the README's paper map ("script : name, name"; flags and prose left out)."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Paper map", 1)[1].split("\n## ", 1)[0]
    out = {}
    for script, names in re.findall(r"`([\w/]+\.py) : ([^`]+)`", table):
        out.setdefault(script, set()).update(n.strip() for n in names.split(","))
    return out


def profiled(fn):
    """Run fn() and return the qualified names of the repository's functions it called (sys.setprofile)."""
    files = {str(ROOT / s) for s in SCRIPTS}
    seen = set()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files:
            seen.add(frame.f_code.co_qualname)

    # threads too: select_groups.select_chunks ranks (document_groups -> rrf_score) in a thread beside the encoder
    sys.setprofile(prof)
    threading.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


@pytest.fixture(scope="module")
def runs(tiny_bert, tmp_path_factory):
    """One optimiser step of every objective and ablation through train.main / finetune.main, and a small selection
    through select_groups.main: {run: functions that ran}."""
    tmp = tmp_path_factory.mktemp("paper_map")
    # the groups the training runs read are select_groups.py's own output
    docs = tmp / "docs.jsonl"
    _write_jsonl(docs, _docs(12))
    groups = tmp / "groups"
    sel = ["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir", str(groups),
           "--centrality_threshold", "-1"]
    out = {"select": profiled(lambda: select_groups.main(sel))}
    flags = {"xprt": {}, "no_fill_in": {"--no_fill_in": True}, "positive_random": {"--positive": "random"},
             "contrastive_random_span": {"--objective": "contrastive_random_span"},
             "self_reconstruction": {"--objective": "self_reconstruction"},
             "gradient_cache": {"--gradient_cache_chunk": 2}}
    from modeling_xprt import pretraining_objectives

    flags.update({name: {"--objective": name} for name in pretraining_objectives() if name not in flags | {"xprt": 0}})
    from test_baselines import build_tiny_generator

    flags["simlm"]["--generator_name_or_path"] = build_tiny_generator(tmp / "generator")
    from test_revela import build_tiny_lm

    flags["revela"]["--lm_name_or_path"] = build_tiny_lm(tmp / "lm", tiny_bert)
    for name, extra in flags.items():
        argv = base_args(tiny_bert, groups, tmp / name, **{"--max_train_steps": 1, "--max_groups": 8,
                                                            "--max_document_groups_per_batch": 0,
                                                            "--no_save_model": True, **extra})
        out[name] = profiled(lambda: train.main(argv))
    beir = make_beir(tmp / "beir")
    ft = cli_args({"--model_name_or_path": str(tiny_bert), "--beir_dir": str(beir), "--output_dir": str(tmp / "ft"),
                   "--per_device_train_batch_size": 4, "--max_train_steps": 1, "--num_negatives": 1,
                   "--negatives_rank_min": 1, "--negatives_rank_max": 5, "--pair_alpha": 0.1,
                   "--report_to": "none", "--no_save_model": True})
    out["pair"] = profiled(lambda: finetune.main(ft))
    return out


def test_every_objective_has_its_paper_map_run():
    from modeling_xprt import pretraining_objectives

    assert set(pretraining_objectives()) <= set(EXPECTED)


@pytest.mark.parametrize("objective", sorted(EXPECTED))
def test_each_objective_runs_its_paper_map_functions(runs, objective):
    ran = runs[objective]
    expected = EXPECTED[objective] | (EVERY_PRETRAIN_STEP if objective != "pair" else set())
    named = set().union(*paper_map().values())
    print(f"{objective}: paper-map functions that ran: {sorted(ran & named)}")
    assert expected <= ran, sorted(expected - ran)
    assert not (NEVER.get(objective, set()) & ran), NEVER[objective] & ran


def test_every_function_the_map_names_exists_and_runs(runs):
    import importlib

    modules = {script: importlib.import_module(script.removesuffix(".py").replace("/", ".")) for script in paper_map()}
    ran = set().union(*runs.values())
    # run by fine-tuning's stage 1 only, which needs real generator and cross-encoder weights (tests/test_finetune.py
    # runs them on tiny random models)
    stage1 = {"generate_pseudo_queries", "denoise_pseudo_queries"}
    for script, names in paper_map().items():
        for name in names:
            obj = modules[script]
            for part in name.split("."):
                obj = getattr(obj, part)  # a renamed function breaks the map here
            ran_here = name in ran or any(r.startswith(name + ".") for r in ran)  # a class: one of its methods
            assert ran_here or name in stage1, f"{script} : {name} never ran"



def traced_step(argv, step: int = 1, end: str = "XPRTModel.forward") -> dict:
    """Run train.main(argv) under sys.setprofile -> {"sampler": {file: {function}}, "model": ...}: the repository's
    functions that optimiser step `step` calls from the batch sampler to the loss (`end` returning), and from the
    model's step (`end` called) to the loss. The path of step k: its batch's rows read and collated (the k-th
    SeededCollate call; the loader fetches a batch ahead, during the step before) and the loop from the end of step
    k - 1 (step 1: the epoch's start, epoch_batches) to its loss. Step 1 also runs what happens once (the epoch's
    batches dealt, the memory estimate, the FLOP count); a later step is the steady state. Comprehensions and generator
    expressions are left out: they are expressions inside the functions a reader opens."""
    files = {str(ROOT / s) for s in SCRIPTS}
    seen = {"sampler": {}, "model": {}}
    st = {"steps": 0, "collated": 0, "fetching": None, "loop": False, "model": False}

    def prof(frame, event, arg):
        code = frame.f_code
        if code.co_filename not in files:
            return
        name = code.co_qualname
        if event == "call":
            if name in ("RowsDataset.__getitem__", "RowsDataset.__getitems__") and st["fetching"] is None:
                st["fetching"] = st["collated"] + 1  # the batch whose rows are being read
            st["loop"] = st["loop"] or (step == 1 and name == "epoch_batches")
            st["model"] = st["model"] or (name == end and st["loop"])
            fetch = st["fetching"]
            if not name.rsplit(".", 1)[-1].startswith(("<listcomp", "<dictcomp", "<setcomp", "<genexpr")):
                if fetch == step or (fetch is None and st["loop"]):
                    seen["sampler"].setdefault(str(Path(code.co_filename).relative_to(ROOT)), set()).add(name)
                if st["model"]:
                    seen["model"].setdefault(str(Path(code.co_filename).relative_to(ROOT)), set()).add(name)
        elif event == "return":
            if name == "SeededCollate.__call__":
                st["fetching"], st["collated"] = None, st["collated"] + 1
            elif name == end:
                st["loop"] = st["model"] = False
            elif name == "LogWindow.step_done":  # an optimiser step ended: the next one's loop starts
                st["steps"] += 1
                st["loop"] = st["steps"] == step - 1

    sys.setprofile(prof)
    try:
        train.main(argv)
    finally:
        sys.setprofile(None)
    return seen


# (functions, files) a step may call, as measured, sampler to loss and model to loss, on the first step and on a
# steady one (step 2, not a logging step). The loop is train.py's own (its main, already running, is not counted). On
# xPRT's steady step the files are its equations, decoder, retention term, collator and batch Layout (modeling_xprt.py),
# the encoder's layers and the vocabulary kernel (plumbing/architectures.py), the loader and the batch's move to the
# device (plumbing/batches.py), the log window (plumbing/run_log.py: measured, step_done) and the epoch's batches or the
# stop check (plumbing/training.py): 5 files, where the tree before the plumbing/ folder crossed 7 (9 on the first
# step, now 6). The first step adds what runs once: the memory estimate and the FLOP count (run_log.py), the epoch's
# batches. The function counts grew by two with the loop moved into the script: LogWindow.measured (the token and
# FLOP count around a micro-batch) and StopSignals.check. Issue 65 added one to each first step (the estimate's
# vocabulary share, run_log.vocab_kernel_bytes) and one to xPRT's steps (L_self's value, architectures._kl_rows_);
# issue 62 three (the masks over the real width, unpadded_rand; the model's count of each row's negatives,
# with_negatives, Objective.negatives).
STEP_BOUNDS = {
    "xprt": {1: {"sampler": (78, 6), "model": (39, 3)}, 2: {"sampler": (56, 5), "model": (37, 3)}},
    "retromae": {1: {"sampler": (72, 8), "model": (33, 5)}, 2: {"sampler": (50, 7), "model": (31, 4)}},
}


@pytest.mark.parametrize("objective", ["xprt", "retromae"])
def test_one_step_reads_in_a_few_dozen_functions(tiny_bert, tmp_path, objective):
    """The reader's path through one training step: the repository functions it calls, from the batch sampler to the
    loss and from the model's step to the loss, counted and bounded, on the first step and on a steady one."""
    docs, groups = tmp_path / "docs.jsonl", tmp_path / "groups"
    _write_jsonl(docs, _docs(12))
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir", str(groups),
                        "--centrality_threshold", "-1"])
    for step, bounds in STEP_BOUNDS[objective].items():
        seen = traced_step(base_args(tiny_bert, groups, tmp_path / f"run{step}", **{
            "--max_train_steps": 2, "--max_groups": 8, "--max_document_groups_per_batch": 0, "--no_save_model": True,
            "--objective": objective, "--logging_steps": 1 if step == 1 else 10}), step=step)
        for part, (most, most_files) in bounds.items():
            n = sum(len(v) for v in seen[part].values())
            print(f"{objective}, step {step}, {part} to loss: {n} repository functions in {len(seen[part])} files ("
                  + ", ".join(f"{f} {len(v)}" for f, v in sorted(seen[part].items(), key=lambda kv: -len(kv[1])))
                  + ")")
            for f, names in sorted(seen[part].items()):
                print(f"  {f}: {', '.join(sorted(names))}")
            assert n <= most and len(seen[part]) <= most_files, (step, part, n, sorted(seen[part]))
