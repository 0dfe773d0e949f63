"""Run by tests/test_sentence_transformers.py under `torchrun --nproc_per_node 2` (gloo, CPU): argv = the start
model's folder (no dropout: train.py's and the trainer's steps then draw nothing but the seeded masks), the groups,
a scratch folder.

1. train.py, 1 step of 6 groups per process: its logged step-1 losses.
2. SentenceTransformerTrainer with XPRTLoss, 2 steps, the same seed, batch and flags, a checkpoint each step: its
   log, and whether both processes end with the same weights (XPRTLoss's gradient average is the only sync).
3. A run resumed from step 1's checkpoint: its step-2 log.
Rank 0 prints `LOG <step record>` lines and one `REPORT <json>` line.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def st_run(start, groups, out, resume=None):
    from accelerate.utils import set_seed
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)

    from xprt_sentence_transformers import XPRTLoss

    model = SentenceTransformer(start, device="cpu")
    set_seed(3)  # as train.py before it loads the model: the same fresh decoder
    loss = XPRTLoss(model, max_length=16)
    data = loss.groups_dataset(groups)
    args = SentenceTransformerTrainingArguments(
        out, max_steps=2, per_device_train_batch_size=6, learning_rate=1e-3, logging_steps=1, save_steps=1, seed=3,
        batch_sampler=loss.batch_sampler, report_to="none", ddp_backend="gloo")
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss,
                                         **loss.trainer_kwargs())
    trainer.train(resume_from_checkpoint=resume)
    logged = {str(r["step"]): r for r in trainer.state.log_history if "xp_loss" in r}
    return logged, loss


def main():
    import train

    start, groups, tmp = sys.argv[1:4]
    tmp = Path(tmp)
    train.main(["--model_name_or_path", start, "--groups_dir", groups, "--output_dir", str(tmp / "train_py"),
                "--max_train_steps", "1", "--no_save_model", "--max_length", "16", "--per_device_train_batch_size",
                "6", "--seed", "3", "--report_to", "none", "--logging_steps", "1"])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    assert world == 2, world
    ref = [json.loads(ln) for ln in (tmp / "train_py" / "train_log.jsonl").read_text().splitlines()]
    ref = next(r for r in ref if r.get("step") == 1 and "loss" in r)

    logged, loss = st_run(start, groups, str(tmp / "st"))
    flat = torch.cat([p.detach().flatten() for p in loss.parameters()])
    both = [torch.zeros_like(flat) for _ in range(world)]
    torch.distributed.all_gather(both, flat)
    same = bool(torch.equal(both[0], both[1]))

    if rank == 0:
        (tmp / "resume").mkdir()
        shutil.copytree(tmp / "st" / "checkpoint-1", tmp / "resume" / "checkpoint-1")
    torch.distributed.barrier()
    resumed, _ = st_run(start, groups, str(tmp / "resume"), resume=str(tmp / "resume" / "checkpoint-1"))
    if rank == 0:
        for r in [ref] + list(logged.values()) + list(resumed.values()):
            print("LOG " + json.dumps({k: v for k, v in r.items() if k == "step" or k.endswith("loss")
                                       or k == "in_batch_negatives"}))
        print("REPORT " + json.dumps({"train_py": ref, "trainer": logged, "resumed": resumed,
                                      "same_weights_across_processes": same,
                                      "in_batch_negatives": logged["1"]["in_batch_negatives"]}))


if __name__ == "__main__":
    main()
