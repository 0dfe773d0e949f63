"""--compile (issue 55): the compiled step is the same step. Every objective's logged losses under train.py (and PAIR's
under finetune.py) equal the eager run's, in fp32 and under bf16 autocast, over a few steps on the CPU (inductor's C++
backend); the compiled regions have no graph break; the batches' widths, padded to a multiple, are few over an epoch;
compile time is logged apart; the CUDA-graph branch of the loop (--compile reduce-overhead) runs.

Dropout: a compiled graph draws its own random numbers (inductor's), so the two runs would drop different elements;
--compile exact (inductor's fallback_random, training.compile_layers) makes the compiled graphs draw from torch's
generator as eager does, so both runs see the same masks and only the compiled arithmetic (fused kernels, other
reduction orders) differs. A compiled run resumed from a checkpoint is the uninterrupted compiled run: no step runs
eagerly (the FLOP count is the hand count under --compile), so every step's dropout is inductor's.

Each distinct graph (a layer class x an input shape x fp32 / bf16 x forward / backward) compiles once per process and
once per machine (inductor's on-disk cache): the runs here pad every batch to one width (--pad_to_multiple_of 32)."""

import json
import math

import pytest
import torch
from test_baselines import tiny_generator  # noqa: F401  (a fixture)
from test_finetune import beir, ft_args  # noqa: F401  (a fixture)
from test_train import base_args, groups, read_log, run  # noqa: F401  (a fixture)

import finetune
from plumbing.run_log import compile_seconds

pytestmark = pytest.mark.slow


@pytest.fixture
def same_random_numbers():
    """A fresh dynamo; the compiled runs that compare with eager ones say --compile exact (fallback_random)."""
    import torch._dynamo

    torch._dynamo.reset()  # each test compiles its own graphs (from inductor's disk cache when it has them)
    torch._dynamo.utils.counters.clear()
    yield


# the losses each objective logs, and a tolerance per precision: fp32's differ by reduction order (a few ulps of
# each term); bf16 autocast rounds each matmul input to 8 bits of mantissa (eps 2^-8 = 3.9e-3), and a fused kernel
# rounds at other points than eager's. Step 1 is compiled too (no step runs eagerly), so its backward's rounding
# reaches AdamW's first update, g / (|g| + eps) per element, which turns it into up to whole-lr steps: measured at
# step 2 on contriever, 2.6e-3 relative at lr 1e-3, 6e-5 at lr 1e-5. Step 1 (the forward alone) keeps 2e-5; later
# steps, at lr 1e-5, 1e-4.
TOLERANCE = {"no": 2e-5, "bf16": 2e-2}
LATER_STEPS = {"no": 1e-4, "bf16": 2e-2}


def _objective_args(name, tiny_generator, tiny_bert, tmp_path):
    if name == "revela":  # a tiny random Qwen2 with LoRA (test_revela's): its layers compile as the encoder's do
        from test_revela import build_tiny_lm

        return {"--objective": name, "--lm_name_or_path": build_tiny_lm(tmp_path / "lm", tiny_bert, "qwen2"),
                "--lora_rank": 4, "--extra_anchors": 2}
    extra = {"simlm": {"--generator_name_or_path": tiny_generator}}.get(name, {})
    return {"--objective": name, **extra}


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("objective", ["xprt", "retromae", "simlm", "contriever", "contrastive_random_span",
                                       "self_reconstruction", "revela"])
def test_compiled_run_logs_the_eager_runs_losses(objective, precision, tiny_bert, tiny_generator, groups, tmp_path,
                                                 same_random_numbers, capsys):
    objective_args = _objective_args(objective, tiny_generator, tiny_bert, tmp_path)

    def train(name, *compile_flag):
        out = tmp_path / name
        run(base_args(tiny_bert, groups, out, **{"--max_train_steps": 3, "--num_related": 2, "--max_length": 24,
                                                 "--learning_rate": 1e-5, "--pad_to_multiple_of": 32,
                                                 "--mixed_precision": precision, "--no_save_model": True,
                                                 **objective_args}) + list(compile_flag))
        return read_log(out)

    eager, compiled = train("eager"), train("compiled", "--compile", "exact")
    # every layer the step runs is compiled: the encoder's, the decoder's (in a list, or RetroMAE's one layer), and
    # those of the models an objective holds outside the module tree (SimLM's generator, Revela's LM)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("compiled (exact, regional)"))
    layers = {"xprt": "3 x BertLayer", "retromae": "3 x BertLayer", "self_reconstruction": "3 x BertLayer",
              "simlm": "4 x BertLayer, 1 x ElectraLayer", "revela": "2 x BertLayer, 2 x Qwen2DecoderLayer"}
    assert line.startswith(f"compiled (exact, regional): {layers.get(objective, '2 x BertLayer')};"), line
    assert sorted(eager) == sorted(compiled) == [1, 2, 3]
    losses = [k for k in eager[1] if k.endswith("loss")]
    assert "loss" in losses and len(losses) >= 2
    for step in eager:
        for k in losses:
            rel = TOLERANCE[precision] if step == 1 else LATER_STEPS[precision]
            assert compiled[step][k] == pytest.approx(eager[step][k], rel=rel, abs=1e-6), \
                (objective, precision, step, k)
    assert torch._dynamo.utils.counters["graph_break"] == {}, dict(torch._dynamo.utils.counters["graph_break"])
    rec = compiled[3]
    # one width: a graph per compiled layer class and grad mode (the gradient cache's, the MoCo keys' no-grad passes)
    assert rec["batch_shapes"] == 1 and 1 <= rec["compiled_graphs"] <= 8, rec
    assert "compile_s" not in eager[3] and all(r.get("compile_s", 0) >= 0 for r in compiled.values())


def test_finetune_compiled_logs_the_eager_losses(tiny_bert, beir, tmp_path, same_random_numbers):  # noqa: F811
    """PAIR's L_Q and L_P (alpha 0.1) under finetune.py --compile equal the eager run's, fp32."""
    def tune(name, *flag):
        out = tmp_path / name
        from test_train import run as run_main

        run_main(ft_args(tiny_bert, beir, out, **{"--max_train_steps": 3, "--pair_alpha": 0.1,
                                                  "--pad_to_multiple_of": 32, "--passage_max_length": 24,
                                                  "--no_save_model": True}) + list(flag), main=finetune.main)
        return read_log(out)

    eager, compiled = tune("eager"), tune("compiled", "--compile", "exact")
    for step in eager:
        for k in ("loss", "query_loss", "passage_loss"):
            if k in eager[step]:
                assert compiled[step][k] == pytest.approx(eager[step][k], rel=TOLERANCE["no"], abs=1e-6), (step, k)
    assert torch._dynamo.utils.counters["graph_break"] == {}


def test_compile_time_is_logged_apart_and_left_out_of_the_step_time(tiny_bert, groups, tmp_path, monkeypatch,
                                                                     same_random_numbers, capsys):
    """A fresh shape compiles inside the first step (no step runs eagerly: the FLOPs are counted from the shapes, and
    said so): that time is the record's compile_s, the process's whole compile time, and the next steps, of the same
    shape, compile nothing. Left out of the step time: with dynamo's timers made to say 1,000 s more once a graph
    exists, step 1's record holds those 1,000 s in compile_s, and its time per step (its window's wall time less
    them) stays at a floor."""
    import torch._dynamo

    from plumbing import run_log

    torch._dynamo.reset()  # nothing compiled yet in this process
    before = compile_seconds()
    out = tmp_path / "run"
    argv = base_args(tiny_bert, groups, out, **{"--max_train_steps": 3, "--num_related": 2, "--max_length": 24,
                                                "--pad_to_multiple_of": 32, "--no_save_model": True, "--compile": True})
    run(argv)
    assert "TFLOP per step (counted from the shapes: under --compile no step runs eagerly)" in capsys.readouterr().out
    log = read_log(out)
    spent = compile_seconds() - before
    assert log[1]["compile_s"] > 0 and log[1]["compiled_graphs"] > 0 and log[2]["compile_s"] == log[3]["compile_s"] == 0
    assert log[1]["compile_s"] == pytest.approx(spent, rel=0.01)

    torch._dynamo.reset()
    real = run_log.compile_seconds
    monkeypatch.setattr(run_log, "compile_seconds", lambda: real() + (
        1000.0 if torch._dynamo.utils.counters["stats"]["unique_graphs"] else 0.0))
    torch._dynamo.utils.counters.clear()
    run(argv + ["--overwrite"])
    log = read_log(out)
    assert log[1]["compile_s"] > 1000 and log[1]["time_per_step_s"] < 1e-6 and log[2]["compile_s"] == 0


def test_reduce_overhead_marks_each_step_for_cuda_graphs(tiny_bert, groups, tmp_path, monkeypatch,
                                                         same_random_numbers):
    """--compile reduce-overhead (CUDA graphs on a GPU; on a CPU inductor runs without them): the loop tells the
    CUDA-graph trees where each step begins (torch.compiler.cudagraph_mark_step_begin), once per micro-batch."""
    marks = []
    real = torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: (marks.append(1), real())[1])
    out = tmp_path / "run"
    run(base_args(tiny_bert, groups, out, **{"--max_train_steps": 2, "--num_related": 2, "--max_length": 24,
                                             "--pad_to_multiple_of": 32, "--no_save_model": True,
                                             "--gradient_accumulation_steps": 2}) + ["--compile", "reduce-overhead"])
    assert len(marks) == 4  # 2 steps x 2 micro-batches
    assert math.isfinite(read_log(out)[2]["loss"])


def test_a_compiled_resume_is_the_uninterrupted_run(tiny_bert, groups, tmp_path, same_random_numbers):
    """Issue 64 item 5: --compile (inductor's dropout, the tiny BERT's 0.1) stopped at step 2 and resumed equals the
    uninterrupted compiled run: losses of every step and the final weights. At 1fbaae3 the resumed process ran its
    first micro-batch eagerly (the FLOP count), drawing dropout from torch's generator, and steps 3-4 differed."""
    from safetensors.torch import load_file

    common = {"--max_train_steps": 4, "--num_related": 2, "--max_length": 24, "--learning_rate": 1e-3,
              "--checkpointing_steps": 2, "--compile": True}
    run(base_args(tiny_bert, groups, tmp_path / "a", **common))
    run(base_args(tiny_bert, groups, tmp_path / "b", **common, **{"--stop_after_steps": 2}))
    run(base_args(tiny_bert, groups, tmp_path / "b", **common, **{"--resume_from_checkpoint": "latest"}))
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        for k in (k for k in a[step] if k.endswith("loss")):
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-5, abs=1e-6), (step, k, a[step][k], b[step][k])
    wa, wb = (load_file(tmp_path / d / "model" / "model.safetensors") for d in "ab")
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"compiled resume: largest weight difference {worst:.2e}")
    assert worst < 1e-6


@pytest.mark.parametrize("multiple", [1, 8])
def test_padding_to_a_multiple_keeps_the_widths_few(tiny_bert, groups, multiple):
    """Over an epoch of train.py's own batches, the distinct input widths: as many as the batches' longest passages
    differ (multiple 1), or at most one per multiple of 8 up to the longest (8). Printed for the closing note."""
    from test_train import _loader_batches
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    batches = _loader_batches(tok, groups, 0, pad_to_multiple_of=multiple)
    widths = {b["input_ids"].shape[-1] for b in batches}
    print(json.dumps({"pad_to_multiple_of": multiple, "batches": len(batches), "widths": sorted(widths)}))
    assert all(w % multiple == 0 for w in widths)
    if multiple > 1:
        assert len(widths) <= math.ceil(max(widths) / multiple)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_compiled_run_logs_the_plain_runs_losses(tiny_bert, groups, tmp_path, stage):
    """--compile under accelerate launch with DeepSpeed, one CPU process: ZeRO-2's compiled run logs the plain
    compiled run's losses with its 3 graphs (dynamo's unique graphs: no more than the plain run's);
    ZeRO-3's hooks break the graphs (39 of them and 377 s of compiling measured), so it says so
    at the start (one step here, with dynamo off in that process, TORCHDYNAMO_DISABLE: nothing compiles, and the
    plain run's --compile exact draws the same dropout)."""
    import os
    import subprocess
    import sys

    from test_train import ROOT

    steps = {"zero2": 3, "zero3": 1}[stage]
    kw = {"--max_train_steps": steps, "--max_groups": 8, "--learning_rate": 1e-3, "--no_save_model": True,
          "--pad_to_multiple_of": 8}  # --compile's default width, given to the plain run too (the masks follow it)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / f"accelerate_cpu_deepspeed_{stage}.yaml"), str(ROOT / "train.py")]
    flag = ["--compile"] + (["exact"] if stage == "zero3" else [])
    env = {**os.environ, **({"TORCHDYNAMO_DISABLE": "1"} if stage == "zero3" else {})}
    proc = subprocess.run(cmd + [str(a) for a in base_args(tiny_bert, groups, tmp_path / "ds", **kw)] + flag,
                          cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-5000:]
    mode = "exact" if stage == "zero3" else "default"
    assert "DistributedType.DEEPSPEED x 1" in said and f"compiled ({mode}, regional): 3 x BertLayer" in said
    assert ("warning: --compile under DeepSpeed ZeRO-3" in said) == (stage == "zero3")
    # the plain run compiled too: a compiled layer's dropout draws inductor's random numbers, alike in both runs
    # (the plain compiled run = the eager run is the equality test above, with fallback_random)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # compiled_graphs counts this process's graphs: the earlier tests' too
    run(base_args(tiny_bert, groups, tmp_path / "plain", **kw) + flag)
    plain, compiled = read_log(tmp_path / "plain"), read_log(tmp_path / "ds")
    assert sorted(compiled) == list(range(1, steps + 1))
    for step in plain:
        assert compiled[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-4), step
    if stage == "zero2":
        assert compiled[steps]["compiled_graphs"] == plain[steps]["compiled_graphs"] == 3
        assert compiled[steps]["batch_shapes"] == 1
