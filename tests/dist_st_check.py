"""Run by tests/test_sentence_transformers.py under `torchrun --nproc_per_node 2` (gloo, CPU).
argv: the start model's folder (no dropout: train.py's and the trainer's steps then draw nothing
but the seeded masks), the groups, a scratch folder. (train.py's own 2-process run is the test's:
its accelerator ends the process group.)

1. SentenceTransformerTrainer with XPRTLoss, 2 steps, the same seed, batch and flags, a checkpoint
   each step: its log, and whether both processes end with the same weights (XPRTLoss's gradient
   average is the only sync).
2. A run resumed from step 1's checkpoint: its step-2 log.
Rank 0 prints `LOG <step record>` lines and one `REPORT <json>` line.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def st_run(start, groups, out, resume=None):
    from accelerate.utils import set_seed
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    from xprt_sentence_transformers import XPRTLoss

    model = SentenceTransformer(start, device="cpu")
    set_seed(3)  # as train.py before it loads the model: the same fresh decoder
    loss = XPRTLoss(model, max_length=16)
    data = loss.groups_dataset(groups)
    args = SentenceTransformerTrainingArguments(
        out,
        max_steps=2,
        per_device_train_batch_size=6,
        learning_rate=1e-3,
        logging_steps=1,
        save_steps=1,
        seed=3,
        batch_sampler=loss.batch_sampler,
        report_to="none",
        ddp_backend="gloo",
    )
    trainer = SentenceTransformerTrainer(
        model=model, args=args, train_dataset=data, loss=loss, **loss.trainer_kwargs()
    )
    trainer.train(resume_from_checkpoint=resume)
    logged = {str(r["step"]): r for r in trainer.state.log_history if "xp_loss" in r}
    return logged, loss


def main():
    start, groups, tmp = sys.argv[1:4]
    tmp = Path(tmp)
    logged, loss = st_run(start, groups, str(tmp / "st"))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    assert world == 2, world
    flat = torch.cat([p.detach().flatten() for p in loss.parameters()])
    both = [torch.zeros_like(flat) for _ in range(world)]
    torch.distributed.all_gather(both, flat)
    same = bool(torch.equal(both[0], both[1]))

    if rank == 0:
        (tmp / "resume").mkdir()
        shutil.copytree(tmp / "st" / "checkpoint-1", tmp / "resume" / "checkpoint-1")
    torch.distributed.barrier()
    resumed, _ = st_run(
        start, groups, str(tmp / "resume"), resume=str(tmp / "resume" / "checkpoint-1")
    )
    if rank == 0:
        for r in list(logged.values()) + list(resumed.values()):
            print(
                "LOG "
                + json.dumps(
                    {
                        k: v
                        for k, v in r.items()
                        if k == "step" or k.endswith("loss") or k == "in_batch_negatives"
                    }
                )
            )
        print(
            "REPORT "
            + json.dumps(
                {
                    "trainer": logged,
                    "resumed": resumed,
                    "same_weights_across_processes": same,
                    "in_batch_negatives": logged["1"]["in_batch_negatives"],
                }
            )
        )


if __name__ == "__main__":
    main()
