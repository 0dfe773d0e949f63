"""Run by tests/test_gradient_cache.py under `torchrun --nproc_per_node 2` (gloo, CPU).

Each process holds its half of a fixed batch of groups and computes one xPRT step twice: plainly (the batch-wide
terms on the vectors gathered across processes, one backward) and with the gradient cache (XPRTModel.cached_step,
one group per chunk), each followed by DDP's averaging of the parameter gradients over the processes; then one
optimiser step of two micro-batches under a real Accelerator (DDP, gradient accumulation 2), plain and cached
(training.gradient_cache_step). Dropout is off (eval mode), so both see the same computation. Rank 0 writes the
largest gradient and loss differences to
argv[1] (JSON); argv[2] is the tiny model's folder.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import modeling_xprt as mx  # noqa: E402
from plumbing import model_folder


def rows(seed=0):
    words = "baseball pitcher game perfect inning rule catcher umpire league season team score".split()
    g = torch.Generator().manual_seed(seed)
    pick = lambda k: " ".join(words[i] for i in torch.randint(len(words), (k,), generator=g).tolist())  # noqa: E731
    return [{"doc_id": f"d{i % 3}", "anchor": pick(10), "related": [pick(8) for _ in range(4)],
             "random_passage": pick(9)} for i in range(6)]


def main():
    from transformers import AutoTokenizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, f"expected 2 processes, got {world}"
    folder = sys.argv[2]
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    mlm, _ = model_folder.load_mlm_encoder(folder)
    model = mx.XPRTModel(mlm).eval()  # no dropout: the plain and the cached step compute the same thing
    teacher = model_folder.load_teacher(folder)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for q in teacher.parameters():
            q.add_(0.02 * torch.randn(q.shape, generator=g))
    local = rows()[rank * 3:(rank + 1) * 3]
    batch = mx.XPRTCollator(tok, seed=rank)(local)

    def averaged_grads():
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
        for v in grads.values():
            dist.all_reduce(v)
            v /= world
        return grads

    out = model(batch, teacher=teacher, retention_weight=40.0)
    out["loss"].backward()
    plain, plain_loss = averaged_grads(), out["loss"].detach()
    model.zero_grad(set_to_none=True)
    cached_out = model.cached_step(batch, 1, lambda loss: loss.backward(), teacher=teacher, retention_weight=40.0)
    cached = averaged_grads()
    diffs = {"loss": float((cached_out["loss"] - plain_loss).abs()),
             "grad": max(float((cached[n] - plain[n]).abs().max()) for n in plain),
             "grad_scale": max(float(plain[n].abs().max()) for n in plain), "same_keys": set(plain) == set(cached)}

    # One optimiser step of two micro-batches under a real Accelerator (DDP, gradient accumulation 2): the cached
    # step (training.gradient_cache_step) against the plain one, every parameter's accumulated, averaged gradient.
    from accelerate import Accelerator

    from plumbing import training
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    prepared = acc.prepare(model)
    micro = [batch, mx.XPRTCollator(tok, seed=10 + rank)(rows(seed=1)[rank * 3:(rank + 1) * 3])]

    def accumulated(cached):
        model.zero_grad(set_to_none=True)
        for b in micro:
            with acc.accumulate(prepared):
                if cached:
                    training.gradient_cache_step(acc, prepared, b, 1, teacher=teacher, retention_weight=40.0)
                else:
                    acc.backward(prepared(b, teacher=teacher, retention_weight=40.0)["loss"])
        return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    plain2, cached2 = accumulated(False), accumulated(True)
    err = sum(float((cached2[n] - plain2[n]).pow(2).sum()) for n in plain2) ** 0.5
    diffs["accumulated_relative_error"] = err / sum(float(plain2[n].pow(2).sum()) for n in plain2) ** 0.5
    diffs["accumulated_same_keys"] = set(plain2) == set(cached2)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(diffs, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # as dist_xp_check.py: skip interpreter finalisation (torch 2.13's gloo sometimes aborts in teardown after
    # collectives inside autograd); the results are written and the group destroyed by now
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
