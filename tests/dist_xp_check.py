"""Run by tests/test_modeling.py under `torchrun --nproc_per_node 2` (gloo, CPU).

Each process holds half of a fixed batch, encodes it with a shared linear "encoder" W, computes
xp_loss and PAIR's losses, with and without the false-negative mask (candidates gathered across processes WITH
gradients, their ids without), backpropagates, and averages W's
gradient over processes as DDP does. Rank 0 writes the mean loss and the averaged gradient to
argv[1] (safetensors) for the test to compare with one process holding the whole batch.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from modeling_xprt import pair_p_loss, pair_q_loss, xp_loss  # noqa: E402


def fixed_batch():
    """Same tensors on every process and in the test: 8 groups, hidden 6, docs with repeats."""
    g = torch.Generator().manual_seed(0)
    xa, xs = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    w = torch.randn(6, 6, generator=g)
    docs = torch.tensor([0, 1, 2, 0, 3, 1, 4, 5])  # groups 0/3 and 1/5 share documents across processes
    xq, xp = torch.randn(8, 6, generator=g), torch.randn(8, 3, 6, generator=g)
    xp[5, 1], xp[4, 0], xp[2, 1] = xp[0, 0], xp[3, 0], xp[1, 0]  # the copies of pair_ids: same text, same vector
    return xa, xs, w, docs, xq, xp


def pair_ids():
    """PAIR's false-negative ids for fixed_batch's 8 x 3 passages, duplicates straddling the processes (rows 0-3 on
    rank 0, 4-7 on rank 1): row 0's positive (100) is row 5's negative; rows 3 and 4 share a positive (400); row 6's
    query counts row 1's positive (200) as relevant, which is also row 2's negative. relevant_ids padded by
    repeating the row's positive."""
    passage_ids = torch.tensor([[100, 101, 102], [200, 201, 202], [300, 200, 302], [400, 401, 402],
                                [400, 501, 502], [600, 100, 602], [700, 701, 702], [800, 801, 802]])
    relevant_ids = passage_ids[:, :1].repeat(1, 2)
    relevant_ids[6, 1] = 200
    return passage_ids, relevant_ids


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, f"expected 2 processes, got {world}"
    xa, xs, w0, docs, xq, xp = fixed_batch()
    n = xa.shape[0] // world
    sl = slice(rank * n, (rank + 1) * n)
    ids = tuple(t[sl] for t in pair_ids())  # the local rows' ids; the losses gather the candidates' ids
    out = {}
    for name in ("xp", "pair_q", "pair_p", "pair_q_masked", "pair_p_masked"):
        w = w0.clone().requires_grad_(True)
        mask_ids = ids if name.endswith("masked") else ()
        if name == "xp":
            loss = xp_loss(xa[sl] @ w, xs[sl] @ w, docs[sl], tau=0.05)
        elif name.startswith("pair_q"):
            loss = pair_q_loss(xq[sl] @ w, xp[sl] @ w, 0.05, *mask_ids)
        else:
            loss = pair_p_loss(xq[sl] @ w, xp[sl] @ w, 0.05, *mask_ids)
        loss.backward()
        grad = w.grad.clone()
        dist.all_reduce(grad)  # DDP: average of the per-process parameter gradients
        grad /= world
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        out[f"{name}_loss"], out[f"{name}_grad"] = mean_loss, grad
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter finalisation: with torch 2.13's gloo, a process that has run collectives inside autograd
    # (all_gather's backward) sometimes aborts while Python tears down, AFTER destroy_process_group returned
    # ("terminate called without an active exception", SIGABRT; ~1 run in 6 on a loaded 2-core machine, also with
    # a barrier first). The results are written and the group destroyed by now, so nothing is lost by leaving.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
