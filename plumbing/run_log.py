"""
What a run says about itself while it trains: the log, its FLOPs, its memory, its loss curve.
  1. the log window: the loss terms kept on the device and read back once per logging step (LogWindow), the
     non-finite checks, train_log.jsonl
  2. FLOPs: torch's count of the real step behind the logged TFLOP/s and MFU (flop_counter), the hand count every
     objective gives of its passes (step_flops, for plans made before a run), a device's peak
  3. memory: the activation bytes a step holds, measured and said before the first step, and in the message of an
     out-of-memory error
  4. the loss curve (loss_curve.png)
It imports plumbing/common.py, batches.py (token counts) and architectures.py (the hand FLOP count).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch

from plumbing.architectures import head_multiply_adds, layer_multiply_adds
from plumbing.common import UserError
from plumbing.batches import padding_efficiency
from plumbing.common import atomic_path, is_zero3, read_jsonl

# ==============================================================================================================
# 1. The log window: loss terms kept on the device, read back once per logging step
# ==============================================================================================================

EVAL_PREFIX = "eval_"  # train_log.jsonl keys of --eval_tasks scores: eval_<task name>

class LogWindow:
    """The loss terms, token counts and non-finite flags since the last logging step, kept ON THE DEVICE: a step
    adds to them without reading anything back (a `.item()` per term per step would stall a GPU on the host every
    step). `check_finite` and `record` read them once per logging step (and before a checkpoint)."""

    def __init__(self, accelerator=None, args=None, lr_scheduler=None, optimizer=None, max_steps: int = 0,
                 peak_flops: Optional[float] = None, state=None, hand_count=None):
        """state: the run's TrainState, which carries the window's sums in a checkpoint (state_dict): a resumed run's
        window continues the one its checkpoint interrupted. hand_count: batch -> FLOPs (step_flops): --compile's."""
        self.accelerator, self.args, self.lr_scheduler, self.optimizer = accelerator, args, lr_scheduler, optimizer
        self.hand_count = hand_count
        self.max_steps, self.peak_flops = max_steps, peak_flops  # peak FLOP/s of one device (None: not known)
        self.progress = None
        self.flops_per_token = None  # measured on the run's first counted micro-batch (measured)
        self.shapes = set()  # the distinct shapes of the batches' inputs this process has met (--compile: graphs)
        self.reset()
        if state is not None:  # the checkpoint's open window, when resumed; this one goes into the next checkpoint
            state.log_window = self
            self.load_state_dict(state.resumed_window or {})

    def state_dict(self) -> dict:
        """The window so far, as plain numbers (read back at a checkpoint only: no step waits on it)."""
        return {"sums": {k: float(v) for k, v in self.sums.items()}, "bad": {k: bool(v) for k, v in self.bad.items()},
                "first_bad": None if self.first_bad is None else int(self.first_bad),
                "elapsed": time.time() - self.start_time,  # the window's time so far, kept with its steps
                **{k: getattr(self, k) for k in ("n_micro", "n_skipped", "steps", "real_tokens", "processed_tokens",
                                                 "flops", "data_wait")}}

    def load_state_dict(self, saved: dict):
        if not saved:
            return
        device = self.accelerator.device
        self.sums = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in saved["sums"].items()}
        self.bad = {k: torch.tensor(v, device=device) for k, v in saved["bad"].items()}
        self.first_bad = None if saved["first_bad"] is None else torch.tensor(saved["first_bad"], device=device)
        for k in ("n_micro", "n_skipped", "steps", "real_tokens", "processed_tokens", "flops", "data_wait"):
            setattr(self, k, saved[k])
        self.start_time = time.time() - saved["elapsed"]

    @contextlib.contextmanager
    def measured(self, batch, skip_tokens=()):
        """Around one micro-batch's step: its real and processed tokens, from the CPU batch's masks (no device sync;
        skip_tokens: masks left out), and its FLOPs, counted by torch on the window's first micro-batch (flop_counter:
        a recomputed forward, the gradient cache's or checkpointing's, is work and counts) and scaled by each later
        one's processed tokens. The run's first counted micro-batch prints the tokens and TFLOP of a step. --compile:
        hand_count's (the counter would run the step eagerly, with other dropout: a resume would differ)."""
        real, proc = padding_efficiency(batch, skip_tokens)
        self.shapes.add(tuple((k, tuple(v.shape)) for k, v in batch.items() if k.endswith("input_ids")
                              and torch.is_tensor(v)))
        self.real_tokens += real
        self.processed_tokens += proc
        # (a resumed window: not yet in this process). Under --compile once, by hand (no step runs eagerly)
        compiled = bool(getattr(self.args, "compile", None)) and self.hand_count is not None
        counting = self.flops_per_token is None or (self.n_micro == 0 and not compiled)
        counter = flop_counter() if counting and not compiled else contextlib.nullcontext()
        with counter:
            yield
        if counting:
            total = self.hand_count(batch) if compiled else counter.get_total_flops()
            first, self.flops_per_token = self.flops_per_token is None, total / max(proc, 1)
            if first:
                acc = self.accelerator
                accum = self.args.gradient_accumulation_steps * acc.num_processes
                acc.print(f"tokens per step: ~{real * accum} real, {proc * accum} processed (first batch); "
                          f"{self.flops_per_token * proc * accum / 1e12:.3f} TFLOP per step" + (
                              " (counted from the shapes: under --compile no step runs eagerly)" if compiled else ""))
        self.flops += self.flops_per_token * proc

    def step_done(self, state, epoch: int, scalars: dict):
        """After each optimiser step: the progress bar, and on logging steps (every --logging_steps and the run's
        last) the window's record to the trackers and train_log.jsonl. Under --on_nonfinite stop the window is
        checked first, on logging and checkpoint steps, so nothing non-finite is logged or saved."""
        acc, args, step = self.accelerator, self.args, state.completed_steps
        self.steps += 1
        if self.progress is None:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=self.max_steps, initial=step - 1, disable=not acc.is_local_main_process,
                                 desc="train")
        self.progress.update(1)
        stop_at = min(self.max_steps, args.stop_after_steps or self.max_steps)
        log_now = step % args.logging_steps == 0 or step == stop_at
        ckpt_now = args.checkpointing_steps and step % args.checkpointing_steps == 0
        if args.on_nonfinite == "stop" and (log_now or ckpt_now):
            self.check_finite(acc, epoch)
        if log_now:
            rec = self.record(acc, args, step, epoch, self.lr_scheduler, self.optimizer, scalars)
            floor = getattr(args, "min_in_batch_negatives", None) or (
                args.per_device_train_batch_size * acc.num_processes // 2)
            if rec.get("in_batch_negatives", floor) < floor:  # train.py logs what the same-document mask left
                acc.print(f"warning: step {step}: a row kept {rec['in_batch_negatives']:.2f} in-batch negatives on "
                          f"average after the same-document mask (< --min_in_batch_negatives {floor}); at 0 L_xp is 0")
            acc.log({k: v for k, v in rec.items() if k != "step"}, step=step)
            write_log_record(acc, Path(args.output_dir) / "train_log.jsonl", rec)
            self.progress.set_postfix(loss=f"{rec.get('loss', float('nan')):.4f}",
                                      s_per_step=f"{rec['time_per_step_s']:.2f}")

    def timed(self, batches):
        """The loader's batches, each wait of the loop for the next one (its workers not keeping up with the step)
        added to the window: logged as data_wait_share, of the window's time."""
        it, done = iter(batches), object()
        while True:
            t0 = time.perf_counter()
            batch = next(it, done)
            if batch is done:
                return
            self.data_wait += time.perf_counter() - t0
            yield batch

    def exclude(self, seconds: float):
        """Leave `seconds` spent on other work in this window (a scoring during training) out of its training time,
        so tokens/s and time per step count training only."""
        self.start_time += seconds

    def close(self):
        if self.progress is not None:
            self.progress.close()

    def reset(self):
        self.start_time, self.sums, self.n_micro, self.n_skipped = time.time(), {}, 0, 0
        self.compile_start = compile_seconds()
        self.real_tokens = self.processed_tokens = 0  # attention-mask ones, and every position the device computes
        self.flops = 0.0  # FLOPs of the window's micro-batches (train_loop's count), this process
        self.data_wait = 0.0  # seconds the loop waited for its next batch (timed)
        self.steps = 0  # optimiser steps in the window: the last window of a run may be shorter
        self.bad, self.first_bad = {}, None  # per-term "was ever non-finite"; the first step that was

    def keep(self, accelerator, on_nonfinite: str, outputs: dict, step: int, epoch: int) -> bool:
        """Whether this micro-batch's backward runs: always under --on_nonfinite stop (check_finite stops the run
        at the next logging step), and under skip only when every term is finite on every process. The kept
        micro-batch's loss terms are added to the window (on the device)."""
        terms = {k: v for k, v in outputs.items() if torch.is_tensor(v) and v.dim() == 0}
        if on_nonfinite == "stop" or finite_everywhere(accelerator, terms, f"step {step} (epoch {epoch})"):
            self.add_terms(terms, step)
            return True
        self.n_skipped += 1
        return False

    def add_terms(self, terms: dict, step: int):
        """Add one micro-batch's detached loss terms (0-dim device tensors); `step` is the optimiser step (1-based)
        they belong to, remembered on the device if a term is non-finite."""
        for k, v in terms.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v
            bad = ~torch.isfinite(v)
            self.bad[k] = self.bad[k] | bad if k in self.bad else bad
            step_t = torch.where(bad, step, torch.iinfo(torch.int64).max)
            self.first_bad = step_t if self.first_bad is None else torch.minimum(self.first_bad, step_t)
        self.n_micro += 1

    def check_finite(self, accelerator, epoch: int):
        """Raise, on every process together, when a loss term was non-finite on any process since the last check,
        naming the first such step and the terms. Checked at logging steps only, so the run may go on for up to
        --logging_steps - 1 steps after the bad one (no checkpoint or model is written from them: this check runs
        before each)."""
        if not self.bad:
            return
        keys = sorted(self.bad)
        # max over processes: a flag set anywhere, and (negated) the earliest bad step
        flags = torch.stack([self.bad[k].double() for k in keys] + [-self.first_bad.double()])
        flags = accelerator.reduce(flags, "max").tolist()  # the one read-back
        bad = [k for k, f in zip(keys, flags) if f > 0]
        if bad:
            first = int(-flags[-1])
            raise FloatingPointError(
                f"non-finite loss at step {first} (epoch {epoch}; found at the logging step after it), term(s) "
                f"{bad}; nothing was saved from this state. Lower --learning_rate or use --on_nonfinite skip")

    def record(self, accelerator, args, step: int, epoch: int, lr_scheduler, optimizer, scalars: dict) -> dict:
        # the window's training time: compiling (--compile: the first batch of each new shape) is logged apart
        compile_s = compile_seconds() - self.compile_start
        world, dt = accelerator.num_processes, max(time.time() - self.start_time - compile_s, 1e-9)
        keys = sorted(self.sums)
        # scalars given as device tensors (train.py's drift) join the one read-back, averaged over processes
        on_device = sorted(k for k, v in scalars.items() if torch.is_tensor(v))
        device = accelerator.device
        means = [self.sums[k].double() / max(self.n_micro, 1) for k in keys]
        means += [scalars[k].detach().double().to(device) for k in on_device]
        counts = torch.tensor([self.real_tokens, self.processed_tokens], device=device, dtype=torch.float64)
        vals = accelerator.reduce(torch.cat([torch.stack(means).to(device), counts]) if means else counts, "sum")
        vals = vals.tolist()  # the one read-back of the window
        rec = {"step": step, "epoch": epoch, "steps": self.steps}  # the optimiser steps the record averages
        rec.update({k: vals[i] / world for i, k in enumerate(keys + on_device)})
        rec.update({"lr": lr_scheduler.get_last_lr()[0], **{k: v for k, v in scalars.items() if k not in on_device},
                    "padding_efficiency": vals[-2] / max(vals[-1], 1),
                    "tokens_per_s": vals[-2] / dt, "time_per_step_s": dt / max(self.steps, 1),
                    "data_wait_share": self.data_wait / dt})
        if self.flops:  # every process does the same work: its FLOP/s over its device's peak
            rec["tflops_per_s"] = self.flops / dt / 1e12
            if self.peak_flops:
                rec["mfu"] = self.flops / dt / self.peak_flops
        if getattr(args, "head_learning_rate", None) is not None:
            lrs = lr_scheduler.get_last_lr()  # one per optimiser group, in order
            rec["head_lr"] = next(lr for lr, g in zip(lrs, optimizer.param_groups) if g["name"] == "heads")
        if self.n_skipped:
            rec["skipped_nonfinite_micro_batches"] = self.n_skipped
        if getattr(args, "compile", None):  # what compiling cost this window, and the graphs and shapes so far
            from torch._dynamo.utils import counters

            rec.update(compile_s=compile_s, compiled_graphs=counters["stats"]["unique_graphs"],
                       batch_shapes=len(self.shapes))
        self.reset()
        return rec

def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process (dynamo's frames and their forward graphs, and the
    backward graphs, compiled at their first backward), from dynamo's own timers; 0 without --compile."""
    from torch._dynamo.utils import cumulative_time_spent_ns

    return sum(cumulative_time_spent_ns.get(k, 0) for k in ("entire_frame_compile", "entire_backward_compile")) / 1e9

def finite_everywhere(accelerator, terms: dict, where: str) -> bool:
    """--on_nonfinite skip: True when every loss term is finite on every process, decided before this micro-batch's
    backward. A NaN on any process must skip on every process together, or DDP would hang. One device-to-host sync
    per micro-batch: only the skip mode does it (LogWindow watches on the device otherwise)."""
    bad = [k for k, v in terms.items() if not torch.isfinite(v)]
    n_bad = accelerator.reduce(torch.tensor(float(len(bad)), device=accelerator.device), "sum").item()
    if n_bad:
        accelerator.print(f"skipping non-finite loss at {where}, term(s) {bad or 'on another process'}")
    return not n_bad

def write_log_record(accelerator, log_path: Path, rec: dict):
    """One record (a logging step's window, or a scoring) appended to train_log.jsonl by the main process."""
    if accelerator.is_main_process:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")

# ==============================================================================================================
# 2. FLOPs: torch's count of the step, the hand count of the estimates, the device's peak
# ==============================================================================================================

def flop_counter():
    """torch's FlopCounterMode (matmuls and attention, forward and backward: what the device computes, padding
    included), taught the ops of our step its table lacks or miscounts: the CPU kernel SDPA runs on CPU, and the
    vocabulary kernel's weight gradient (addmm_, and addmm into an fp32 output: docs/plumbing.md: flop_counter)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def as_torch_counts(op):  # the registered formula reads the shapes itself ("raw" to FlopCounterMode)
        def formula(*args, **kwargs):
            return fc.flop_registry[op](*args, **kwargs)

        formula._get_raw = True
        return formula

    counter = fc.FlopCounterMode(display=False, custom_mapping={
        aten.addmm: addmm_flops, aten.addmm_: addmm_flops,
        aten._scaled_dot_product_flash_attention_for_cpu: as_torch_counts(aten._scaled_dot_product_flash_attention),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            as_torch_counts(aten._scaled_dot_product_flash_attention_backward)})
    # Only the total is read. Its per-module tracker hooks every module's backward, which torch refuses inside
    # torch.autograd.grad (the gradient cache's): count everything under "Global" instead.
    counter.mod_tracker = _GlobalOnly()
    return counter

def addmm_flops(bias, mat1, mat2, *args, **kwargs) -> int:
    """FLOPs of every addmm overload (plain, out=, in place, out_dtype): 2 m n k, the product's; what follows the
    two matrices (out_dtype, beta, alpha, out) does not change it."""
    (m, k), n = mat1.shape, mat2.shape[-1]
    return 2 * m * n * k

addmm_flops._get_raw = True

class _GlobalOnly:
    """A stand-in for FlopCounterMode's module tracker: every count goes to "Global", no module hooks."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None

# Dense bf16 peak of one device (vendor figures), for the MFU estimate; --peak_tflops for any other device.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}

def peak_flops(accelerator, args):
    """One device's peak FLOP/s for the MFU estimate: --peak_tflops, else a known GPU's bf16 peak, else None."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    dev = accelerator.device
    return device_peak_flops(torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type)

def device_peak_flops(name: str):
    """The dense bf16 peak FLOP/s of a device named `name` (torch.cuda.get_device_name: "NVIDIA H200"), or None."""
    return next((t * 1e12 for k, t in PEAK_BF16_TFLOPS.items() if k in name), None)

def step_flops(model, batch, retention: bool) -> float:
    """Model FLOPs of one collated micro-batch: every trained pass forward and backward (3x its forward), what runs
    without gradient (the frozen teacher, L_self's teacher rows, SimLM's generator) forward only. Padded tokens count
    (the device computes them); embedding lookups, norms and softmaxes do not."""
    # one layer's weight matrices read off its modules (BERT: QKV + output 4 h^2, FFN 2 h inner), whatever the
    # config calls them (DistilBERT: n_layers, hidden_dim)
    n_enc, per_token, h = layer_multiply_adds(model.encoder)

    def layers(ids, n, extra=0):  # multiply-adds of n Transformer layers over an (..., L) tensor (L + extra wide)
        length = ids.shape[-1] + extra
        tokens = ids.numel() // ids.shape[-1] * length
        return n * tokens * (per_token + 2 * length * h)  # weight matrices, attention scores and sums

    head = head_multiply_adds(model.encoder)  # the MLM head's transform and vocabulary projection, per row
    # each objective counts its own passes (Objective.multiply_adds): (trained, forward only)
    trained, forward = model.objective.multiply_adds(model, batch, layers, head)
    if retention:
        teacher = layers(batch["retain_input_ids"], n_enc)
        forward += teacher
        if model.retention_student == "clean":
            trained += teacher  # the clean student pass
    return 2.0 * (3 * trained + forward)

# ==============================================================================================================
# 3. Memory: what a step holds, said before the first step and in an out-of-memory message
# ==============================================================================================================

_MEMORY_NOTE: dict = {}  # the last estimate printed, for explain_oom's message

def activation_bytes_per_token_layer(encoder, length: int, device, dtype=torch.bfloat16) -> float:
    """Bytes autograd saves for backward per token per encoder layer, measured: encoders of this config with one and
    two layers (random weights, on `device`) run forward under autocast(dtype) on 2 and on 4 sequences of `length`
    tokens, every tensor saved for backward counted once (saved_tensors_hooks, by storage); the differences (two
    layers less one, four sequences less two) leave one layer's per-token share, without what does not grow with
    the tokens (the weights' low-precision copies; a figure: docs/plumbing.md: activation_bytes_per_token_layer)."""
    from transformers import AutoModel

    def saved(layers, seqs):
        cfg = copy.deepcopy(encoder.config)
        for name in ("num_hidden_layers", "n_layers", "num_layers"):
            if hasattr(cfg, name):
                setattr(cfg, name, layers)
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total[0] += key[1]
            return t

        ids = torch.full((seqs, length), 100, dtype=torch.long, device=device)
        # the init and the dropout draw from their own RNG: a run (a resumed one too) draws what it would without
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            enc = AutoModel.from_config(cfg).to(device).train()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                enc(input_ids=ids, attention_mask=torch.ones_like(ids))
        return total[0]

    per_layer = {seqs: saved(2, seqs) - saved(1, seqs) for seqs in (2, 4)}
    return (per_layer[4] - per_layer[2]) / (2 * length)

def layer_tokens_per_group(model, batch, retention: bool) -> float:
    """Token x layer products a step runs WITH gradient, per group: every encoder pass of the batch (its *input_ids
    tensors but the frozen retention teacher's and those the objective encodes without gradient: MoCo's keys), the
    clean retention student, the decoder's passes (their layers)."""
    cfg = model.encoder.config
    n_enc = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layers", "num_layers") if hasattr(cfg, k)), 1)
    dec = getattr(model.objective, "decoder", None)
    n_dec = len(dec.layers) if dec is not None and hasattr(dec, "layers") else n_enc
    groups, total, no_grad = None, 0, set(getattr(model.objective, "forward_only_inputs", ()))
    for k, v in batch.items():
        if not (k.endswith("input_ids") and torch.is_tensor(v)) or k.startswith("retain_") or k in no_grad:
            continue
        groups = groups or v.shape[0]
        total += v.numel() * (n_dec if k.startswith("dec_") else n_enc)
    if retention and "retain_input_ids" in batch and getattr(model, "retention_student", "clean") == "clean":
        total += batch["retain_input_ids"].numel() * n_enc
    return total / max(groups or 1, 1)

def vocab_kernel_bytes(model, batch, lowp: bool) -> float:
    """What the vocabulary terms (architectures._FusedLinearCE) add: fp32 (rows, V') buffers for the largest term's
    rows (at most 1024) and two for L_self's, a (V', H) fp32 weight gradient per term from forward to backward, in low
    precision W's copy and a chunk's logits and gradient. Rows: each *_targets (cross-entropies) and self_rows, the
    whole batch's under the gradient cache too (its peak, measured at chunks 4-16: docs/notes.md)."""
    weight = getattr(model, "vocab_weight", None)
    if weight is None:
        return 0.0
    v, h = weight.shape
    vp = -(-v // 64) * 64 if lowp else v  # architectures._PAD
    rows = {k: min(1024, t.numel()) for k, t in batch.items()
            if torch.is_tensor(t) and t.dim() == 1 and (k.endswith("_targets") or k == "self_rows")}
    if not rows:
        return 0.0
    buffers = max(rows.values()) + 2 * rows.get("self_rows", 0)
    return 4.0 * vp * buffers + len(rows) * 4.0 * vp * h + lowp * 2.0 * vp * (h + 2 * max(rows.values()))

# Backward temporaries of the largest trained call, in its layers' saved bytes (bench_memory --only estimate)
BACKWARD_LAYERS = {torch.float32: 2.0, torch.bfloat16: 3.0, torch.float16: 3.0}

def memory_estimate(accelerator, args, model, batch, teacher, max_length: int) -> dict:
    """Printed before the first step, the weights and teacher in memory already (resident_gib, counted once): what
    the step adds, batch_gib = held x gib_per_group (layer_tokens_per_group + BACKWARD_LAYERS x the largest call's
    tokens, x the measured bytes per token per layer) + fixed_gib (12 bytes a trained parameter: gradient, AdamW; in
    low precision autocast's 2-byte copies; vocab_kernel_bytes); against device_memory, the groups that fit and the
    --gradient_cache_chunk that would. Calibrated: bench/bench_memory.py --only estimate (docs/notes.md)."""
    import math

    if is_zero3(accelerator):  # the measuring copies would be partitioned too; ZeRO-3 plans its memory itself
        return {}
    dev = accelerator.device
    dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else (
        torch.float16 if accelerator.mixed_precision == "fp16" else torch.float32)
    try:
        per_tl = activation_bytes_per_token_layer(model.encoder, max_length, dev, dtype)
    except Exception as err:  # an encoder AutoModel cannot rebuild from its config: the run goes on without it
        accelerator.print(f"memory: no estimate ({type(err).__name__}: {str(err)[:120]})")
        return {}
    groups = max(next((v.shape[0] for k, v in batch.items() if k.endswith("input_ids") and torch.is_tensor(v)), 1), 1)
    widest = max((v.numel() for k, v in batch.items() if k.endswith("input_ids") and torch.is_tensor(v)
                  and not k.startswith("retain_")), default=0) / groups  # tokens a group has in its largest call
    per_group = per_tl * (layer_tokens_per_group(model, batch, teacher is not None) + BACKWARD_LAYERS[dtype] * widest)
    b = args.per_device_train_batch_size
    # the gradient cache holds one chunk's activations at a time; checkpointing keeps a fraction the estimate does
    # not measure (it is then an upper bound, never a reason to refuse)
    held = min(getattr(args, "gradient_cache_chunk", None) or b, b)
    lowp = dtype != torch.float32
    params = list(model.parameters())
    held_weights = [*params, *(teacher.parameters() if teacher is not None else [])]
    resident = sum(p.numel() * p.element_size() for p in held_weights)  # in memory already: counted once
    # autocast keeps one low-precision copy of each trained weight a matmul reads (not the embeddings) to backward
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    fixed = (12 * sum(p.numel() for p in params if p.requires_grad)
             + lowp * 2 * sum(p.numel() for p in params if p.requires_grad and id(p) not in embeddings))
    full = fixed = fixed + vocab_kernel_bytes(model, batch, lowp)
    note = {"bytes_per_token_layer": per_tl, "gib_per_group": per_group / 2**30, "fixed_gib": fixed / 2**30,
            "batch_gib": (fixed + held * per_group) / 2**30, "resident_gib": resident / 2**30, "batch": b}
    line = (f"memory: ~{note['batch_gib']:.1f} GiB for {b} groups per device"
            + (f" ({held} at a time: --gradient_cache_chunk)" if held < b else "") + f" at {max_length} tokens "
            f"({note['gib_per_group'] * 1024:.0f} MiB of activations a group from {per_tl / 1024:.1f} KiB per token "
            f"per layer, measured; {note['fixed_gib']:.1f} GiB of gradients, AdamW and the vocabulary kernel), "
            f"beside the {note['resident_gib']:.1f} GiB of weights and teacher in memory")
    free_total = device_memory(dev)
    if free_total is None:
        accelerator.print(line)
    else:
        free, total = free_total
        fit = max(int((0.9 * free - full) // per_group), 0)
        chunk = 2 ** int(math.log2(fit)) if fit >= 1 else 0
        note.update({"device_gib": total / 2**30, "groups_that_fit": fit, "cache_chunk": min(chunk, b)})
        cached = (fixed + chunk * per_group) / 2**30
        where = "this device" if dev.type != "cpu" else "this machine (host memory, shared by its processes)"
        line += (f"; {where}: {free / 2**30:.0f} of {total / 2**30:.0f} GiB free -> at most ~{fit} groups per "
                 f"step" + ("" if fit >= held else f": {held} do not fit" + (
                     f"; --gradient_cache_chunk {note['cache_chunk']} keeps the batch (its negatives) in ~{cached:.0f} "
                     "GiB" if chunk else "")))
        accelerator.print(line)
        # A run that cannot fit stops here, before its first step, in one line: not minutes later out of memory (a
        # GPU's OOM error) or killed by the kernel without a word (a CPU's host memory)
        if fit < held and not getattr(args, "gradient_checkpointing", False) \
                and not getattr(args, "ignore_memory_estimate", False):
            fix = (f"--gradient_cache_chunk {note['cache_chunk']} (the same batch, {note['cache_chunk']} groups at a "
                   f"time), a smaller --per_device_train_batch_size, --gradient_checkpointing" if chunk else
                   "a smaller model or --max_length (not even one group fits)")
            raise UserError(f"--per_device_train_batch_size {b}: the step needs ~{note['batch_gib']:.1f} GiB and "
                            f"{where} has {free / 2**30:.1f} GiB free (estimate measured before the first step); use "
                            f"{fix}, or --ignore_memory_estimate to try anyway")
    _MEMORY_NOTE.clear()
    _MEMORY_NOTE.update(note)
    return note

def device_memory(device):
    """(free, total) bytes where a step's memory lives: a GPU's as its driver says them (CUDA's mem_get_info); on a
    CPU the host's available memory (psutil, what the kernel can give without swapping) shared evenly by the node's
    processes (LOCAL_WORLD_SIZE, set by torchrun and accelerate), and its total."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    if device.type == "cpu":
        import psutil

        mem, local = psutil.virtual_memory(), max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
        return mem.available // local, mem.total
    return None

def explain_oom(main):
    """A script's main, with a device out-of-memory error turned into one line that names the flags to change and
    the estimate printed before the first step (memory_estimate)."""
    import functools

    @functools.wraps(main)
    def wrapped(*a, **kw):
        try:
            return main(*a, **kw)
        except torch.OutOfMemoryError as err:
            n = _MEMORY_NOTE
            hint = (f" (estimated before the first step: ~{n['batch_gib']:.0f} GiB for {n['batch']} groups, "
                    f"~{n['gib_per_group'] * 1024:.0f} MiB a group; about {n.get('groups_that_fit', '?')} fit)"
                    if n else "")
            raise SystemExit(f"out of device memory at --per_device_train_batch_size {n.get('batch', '?')}{hint}: "
                             f"lower it, or keep the batch with --gradient_cache_chunk "
                             f"{n.get('cache_chunk') or 'N'} (or --gradient_checkpointing); "
                             f"{str(err).splitlines()[0][:160]}") from None
    return wrapped

# ==============================================================================================================
# 4. The loss curve
# ==============================================================================================================

def plot_loss_curves(log_path: Path, png_path: Path):
    """One panel per logged quantity (loss terms, lr, retention weight), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = {}
    for r in read_jsonl(log_path):
        # a resumed run rewrites steps: keep the last; a step's loss record and score record are merged
        recs.setdefault(r["step"], {}).update(r)
    steps = sorted(recs)
    seen = list(dict.fromkeys(k for s in steps for k in recs[s]))
    # teacher_cosine: train.py's drift from the start model, plotted beside the scores (the stopping signal)
    keys = [k for k in seen if k.endswith("loss") or k in ("lr", "head_lr", "retention_weight", "teacher_cosine")]
    if any(recs[s].get("pair_alpha") for s in steps):  # only fine-tuning runs have an alpha to show
        keys.append("pair_alpha")
    evals = [k for k in seen if k.startswith(EVAL_PREFIX)]
    panels = keys + (["scores"] if evals else [])
    rows = math.ceil(len(panels) / 3)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3 * rows), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        xs = [s for s in steps if k in recs[s]]
        ax.plot(xs, [recs[s][k] for s in xs])
        ax.set_title(k)
        ax.set_xlabel("step")
    if evals:  # --eval_steps: mteb's main score (x100) of each task, next to the losses
        ax = list(axes.flat)[len(keys)]
        for k in evals:
            xs = [s for s in steps if k in recs[s]]
            ax.plot(xs, [recs[s][k] for s in xs], marker="o", label=k[len(EVAL_PREFIX):])
        ax.set_title("scores during training (main score x100)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
