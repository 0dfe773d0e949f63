"""Every branch only a GPU takes, reached from a CPU test (issue 42). On 2026-12-04 train.py died at its first CUDA
step: accelerate's prepared loader had already moved the batch to the GPU, and batches.batch_to_device then pinned it
("cannot pin 'torch.cuda.LongTensor'"). Nothing on a CPU took that branch. The CUDA-only branches, and the test here
that reaches each:

  the batch's move to the device (one place: the loader pins, batch_to_device moves)  test_prepared_loader_*
  the loader's workers and pinning on a GPU (batches.loader_options)                   test_loader_options_*
  the fp32-output GEMM probe (architectures._fp32_out_gemm) and its start-up line        test_fp32_output_gemm_probe_*
  the FLOP counter on CUDA's fp32-output addmm (run_log.flop_counter)                   test_flop_counter_counts_*
  the device name -> peak FLOPs (run_log.peak_flops)                                    test_peak_flops_*
  the memory estimate's free memory (run_log.device_memory, mem_get_info)              test_memory_estimate_*
  the device's RNG state in the gradient cache's replay (modeling_xprt._rng_state)     test_rng_state_*
  the RNG states kept around scoring (evaluate.preserved_rng)                          test_preserved_rng_*
  the fused AdamW on CUDA (training.adamw_kernel)                                      test_fused_adamw_*
  the device and dtype of evaluate.py / select_groups.py (pick_device_and_dtype,
  select_groups.selection_device), selection's batch (select_groups.selection_batch_size),
  a datatrove task's GPU (selection_stages.task_device)                                test_device_choice_*
Taken on a CPU too (no test of their own here): make_accelerator's cpu= (CPU runs take the other side),
matmul_precision_policy (sets CUDA's flags on any machine), fused_vocab._padded (the padding bf16 takes on a CPU)."""

import argparse
import types

import pytest
import torch

from plumbing import architectures
from plumbing import run_log
from plumbing.batches import batch_to_device, loader_options
from plumbing.common import pick_device_and_dtype


def _prepared(monkeypatch, tmp_path):
    from accelerate import Accelerator

    from plumbing.training import prepare_run

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    loader = torch.utils.data.DataLoader([{"input_ids": torch.arange(4)} for _ in range(4)], batch_size=2)
    args = argparse.Namespace(gradient_accumulation_steps=1, max_train_steps=2, num_train_epochs=1, warmup_ratio=0.0,
                              lr_scheduler_type="linear", resume_from_checkpoint=None, output_dir=str(tmp_path),
                              checkpointing_steps=None)
    return prepare_run(accelerator, args, model, torch.optim.SGD(model.parameters(), lr=0.1), loader)


def test_prepared_loader_places_nothing(monkeypatch, tmp_path):
    """The loader prepare_run returns hands CPU batches (no device placement): train_loop's batch_to_device is the
    one move. At 146ed67 the prepared loader placed its batches itself (its device was the accelerator's), and on
    CUDA batch_to_device then pinned a GPU tensor."""
    _, _, loader, *_ = _prepared(monkeypatch, tmp_path)
    assert loader.device is None  # 146ed67: torch.device("cpu") here, torch.device("cuda") on a GPU
    batch = next(iter(loader))
    assert batch["input_ids"].device.type == "cpu"


def test_prepared_loader_batch_moves_once():
    """batch_to_device pins nothing (the loader's pin-memory thread does, loader_options) and leaves a tensor already
    on the device as it is: the same tensor comes back, so a second move can never fail or copy."""
    ids = torch.arange(6).view(2, 3)
    moved = batch_to_device({"input_ids": ids, "n": 3}, torch.device("cpu"))
    assert moved["input_ids"] is ids and moved["n"] == 3
    if torch.cuda.is_available():  # on a GPU machine: the CUDA tensor passes through, unpinned, untouched
        on_gpu = ids.cuda()
        assert batch_to_device({"input_ids": on_gpu}, on_gpu.device)["input_ids"] is on_gpu


def test_loader_options_on_a_gpu_machine():
    """On CUDA: the cores shared among the machine's processes, one left to each, at most 8, batches pinned; on a
    CPU: no workers (they would take the step's cores), nothing pinned; a flag's value is kept."""
    assert loader_options("cuda", None, local_processes=1, cpus=16) == (8, True)
    assert loader_options("cuda", None, local_processes=8, cpus=16) == (1, True)
    assert loader_options("cuda", None, local_processes=4, cpus=16) == (3, True)
    assert loader_options("cuda", 0, cpus=16) == (0, True)
    assert loader_options("cpu", None, cpus=16) == (0, False)
    assert loader_options("cpu", 2, cpus=16) == (2, False)


def test_loader_options_reach_the_dataloader(monkeypatch):
    """training_loader asks loader_options with the accelerator's device type and passes both to the DataLoader."""
    from plumbing.batches import training_loader

    seen = {}
    monkeypatch.setattr(torch.utils.data, "DataLoader", lambda *a, **kw: seen.update(kw) or kw)
    accelerator = types.SimpleNamespace(device=torch.device("cuda"), process_index=0)
    args = argparse.Namespace(dataloader_num_workers=3, seed=0)
    sampler = types.SimpleNamespace(batch_size=2, drop_last=False)  # what KeyedBatches reads of a batch sampler
    training_loader(accelerator, args, [], sampler=sampler, collator=None)
    assert (seen["num_workers"], seen["pin_memory"]) == (3, True)


def test_fp32_output_gemm_probe_runs_outside_dispatch_modes(monkeypatch):
    """The probe runs none of its ops under an active dispatch mode (a FLOP counter, a profiler): at 146ed67 it ran
    inside train.py's FLOP-counting window when its first call fell there, and torch's counter's TypeError fixed the
    slow path for the run. weight_grad_path says the path chosen, for the run's start-up line."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(architectures, "_FP32_OUT", {})
    with Record() as mode:
        got = architectures._fp32_out_gemm(torch.device("cpu"))
    assert mode.ops == []
    assert got is False  # the CPU has no fp32-output GEMM
    assert "one bf16 product per chunk" in architectures.weight_grad_path("cpu")
    monkeypatch.setattr(architectures, "_FP32_OUT", {"cuda": True})
    assert "one GEMM (addmm out_dtype)" in architectures.weight_grad_path("cuda")


def test_flop_counter_counts_the_fp32_output_gemm():
    """CUDA's addmm(..., out_dtype=float32, out=grad_w) (aten.addmm.dtype_out) counts 2 m n k, as the plain and the
    in-place addmm do; torch's own addmm formula takes out_dtype for a shape (TypeError). The meta device runs the
    same overload as CUDA without a GPU."""
    a = torch.ones(8, 16, dtype=torch.bfloat16, device="meta")
    b = torch.ones(16, 4, dtype=torch.bfloat16, device="meta")
    c = torch.zeros(8, 4, device="meta")
    counter = run_log.flop_counter()
    with counter:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        c.addmm_(a.float(), b.float())
    assert counter.get_total_flops() == 2 * (2 * 8 * 16 * 4)


def test_peak_flops_from_the_device_name(monkeypatch):
    """A GPU's name picks its bf16 peak (vendor figures); a CPU or an unknown GPU has none (--peak_tflops)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    args = argparse.Namespace(peak_tflops=None)
    assert run_log.peak_flops(types.SimpleNamespace(device=torch.device("cuda", 0)), args) == 989e12
    assert run_log.peak_flops(types.SimpleNamespace(device=torch.device("cpu")), args) is None
    assert run_log.device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert run_log.device_peak_flops("Tesla T4") is None
    assert run_log.peak_flops(types.SimpleNamespace(device=torch.device("cpu")),
                              argparse.Namespace(peak_tflops=2.0)) == 2e12


def test_memory_estimate_with_the_device_memory(monkeypatch, tiny_bert, capsys):
    """Where the device says its free memory (CUDA's mem_get_info), the line adds the groups that fit and the
    --gradient_cache_chunk that would keep the batch: the arithmetic of memory_estimate, fed 2 GiB free of 4."""
    from test_modeling import collator_for, make_model, toy_rows
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    model = make_model(tiny_bert, "xprt")
    batch = collator_for("xprt", tok, seed=0)(toy_rows(4))
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), mixed_precision="no", state=types.SimpleNamespace(),
                                        print=print)
    args = argparse.Namespace(per_device_train_batch_size=4)
    import psutil

    free, total = run_log.device_memory(torch.device("cpu"))  # a CPU: the host's, the same arithmetic
    assert total == psutil.virtual_memory().total and 0 < free <= total
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * 2**30, 4 * 2**30))
    assert run_log.device_memory(torch.device("cuda", 0)) == (2 * 2**30, 4 * 2**30)
    monkeypatch.setattr(run_log, "device_memory", lambda device: (2 * 2**30, 4 * 2**30))
    note = run_log.memory_estimate(accelerator, args, model, batch, None, 32)
    per_group, fixed = note["gib_per_group"] * 2**30, note["fixed_gib"] * 2**30
    assert note["groups_that_fit"] == int((0.9 * 2 * 2**30 - fixed) // per_group)
    assert note["device_gib"] == 4.0
    assert "this machine (host memory, shared by its processes): 2 of 4 GiB free" in capsys.readouterr().out


def test_a_batch_that_cannot_fit_stops_before_its_first_step(monkeypatch, tiny_bert, capsys):
    """Issue 54 item 6: the estimate over what the device has stops the run in one line (a UserError) naming the
    --gradient_cache_chunk that keeps the batch; with that chunk, with --gradient_checkpointing (which the estimate
    does not measure) or --ignore_memory_estimate the run goes on. Fed a free memory of the fixed share plus 2.5
    groups; on a CPU the same branch reads the host's memory, shared by the node's processes."""
    from test_modeling import collator_for, make_model, toy_rows
    from transformers import AutoTokenizer

    from plumbing.common import UserError

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    model = make_model(tiny_bert, "xprt")
    batch = collator_for("xprt", tok, seed=0)(toy_rows(4))
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), mixed_precision="no", state=types.SimpleNamespace(),
                                        print=print)
    probe = run_log.memory_estimate(accelerator, argparse.Namespace(per_device_train_batch_size=4), model, batch,
                                    None, 32)
    free = (probe["fixed_gib"] + 2.5 * probe["gib_per_group"]) * 2**30 / 0.9
    monkeypatch.setattr(run_log, "device_memory", lambda device: (int(free), 8 * 2**30))
    args = argparse.Namespace(per_device_train_batch_size=4)
    with pytest.raises(UserError) as err:
        run_log.memory_estimate(accelerator, args, model, batch, None, 32)
    assert "--per_device_train_batch_size 4: the step needs" in str(err.value)
    assert "--gradient_cache_chunk 2 (the same batch, 2 groups at a time)" in str(err.value)
    for ok in ({"gradient_cache_chunk": 2}, {"gradient_checkpointing": True}, {"ignore_memory_estimate": True}):
        note = run_log.memory_estimate(accelerator, argparse.Namespace(per_device_train_batch_size=4, **ok), model,
                                       batch, None, 32)
        assert note["groups_that_fit"] == 2
    assert "2 at a time: --gradient_cache_chunk" in capsys.readouterr().out
    monkeypatch.undo()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes on one host: each has half of what is available
    import psutil

    half = run_log.device_memory(torch.device("cpu"))[0]
    assert abs(half - psutil.virtual_memory().available / 2) < 0.05 * psutil.virtual_memory().total


def test_rng_state_keeps_the_device_generator(monkeypatch):
    """The gradient cache replays a chunk's dropout: on an accelerator its own generator is kept and restored with
    the CPU's (torch.get_device_module(type).get/set_rng_state)."""
    from modeling_xprt import _rng_state

    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: restored.append((state, device)))
    dev = torch.device("cuda", 0)
    state = _rng_state(dev)
    assert state[1].tolist() == [7]
    torch.rand(3)  # the CPU generator moves on
    _rng_state(dev, state)
    assert torch.equal(state[0], torch.get_rng_state()) and restored == [(state[1], dev)]
    assert _rng_state(torch.device("cpu"))[1] is None


def test_preserved_rng_restores_the_gpu_generators(monkeypatch):
    """Scoring during training draws from the global generators; on CUDA every device's state is put back too."""
    import evaluate

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["gpu0"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    with evaluate.preserved_rng():
        torch.rand(2)
    assert restored == [["gpu0"]]


def test_device_choice_on_a_gpu_machine():
    """evaluate.py's and select_groups.py's device and dtype: the GPU in bf16 (fp16 before Ampere) when there is one,
    the CPU in fp32 otherwise, a flag first; select_groups.py takes the GPU accelerate gave its process."""
    from select_groups import selection_device

    assert pick_device_and_dtype(None, None, cuda=True, bf16=True) == (torch.device("cuda"), torch.bfloat16)
    assert pick_device_and_dtype(None, None, cuda=True, bf16=False) == (torch.device("cuda"), torch.float16)
    assert pick_device_and_dtype(None, None, cuda=False) == (torch.device("cpu"), torch.float32)
    assert pick_device_and_dtype("cpu", None, cuda=True) == (torch.device("cpu"), torch.float32)
    assert pick_device_and_dtype(None, "fp32", cuda=True) == (torch.device("cuda"), torch.float32)
    assert selection_device(None, torch.device("cuda", 1), None, bf16=True) == (torch.device("cuda", 1),
                                                                                 torch.bfloat16)
    assert selection_device(None, torch.device("cpu"), None) == (torch.device("cpu"), torch.float32)
    assert selection_device("cpu", torch.device("cuda", 1), None) == (torch.device("cpu"), torch.float32)
    from select_groups import selection_batch_size
    from select_groups_datatrove import task_device

    assert (selection_batch_size(None, torch.device("cuda", 1)) == 512
            and selection_batch_size(None, torch.device("cpu")) == 64)
    assert selection_batch_size(32, torch.device("cuda")) == 32
    assert task_device(5, 4) == torch.device("cuda", 1) and task_device(5, 0) == torch.device("cpu")


def test_fused_adamw_on_a_gpu():
    """train.py's and finetune.py's AdamW takes the fused kernel on CUDA (training.adamw_kernel) and torch's default
    elsewhere; the fused kernel runs on a CPU too, so its update is checked here against the default's."""
    from plumbing.training import adamw, adamw_kernel

    assert adamw_kernel("cuda") == {"fused": True} and adamw_kernel("cpu") == {}
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(3)]
    grads = [[torch.randn_like(w) for w in start] for _ in range(3)]
    after = []
    for kernel in ({}, adamw_kernel("cuda")):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, **kernel)
        for g in grads:
            for p, gp in zip(params, g):
                p.grad = gp.clone()
            opt.step()
        after.append(params)
    for a, b in zip(*after):
        assert torch.allclose(a, b, atol=1e-6)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Linear(3, 2)

        def head_parameters(self):
            return []

    accelerator = types.SimpleNamespace(device=torch.device("cuda"), print=lambda *a: None)
    args = argparse.Namespace(learning_rate=1e-3, weight_decay=0.01)
    opt, trainable = adamw(accelerator, Model(), args)
    assert opt.defaults["fused"] is True and trainable == 8
