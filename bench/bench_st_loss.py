"""
SentenceTransformerTrainer with xprt_sentence_transformers.XPRTLoss against train.py, the same xPRT
step at the same batch on the CPU: the same start model (all-MiniLM-L6-v2 by default), the same
groups (random word passages filling --max_length, each its own document), batch, seed and
retention term (teacher on), fp32.

    python -m bench.bench_st_loss         # MiniLM, 8 groups of 64 tokens, steps 6..10 timed
    python -m bench.bench_st_loss --toy   # seconds: the tiny encoder, 4 groups of 8 tokens

Each side runs 2 x --steps optimiser steps in this process; the second --steps are timed (the
first warm up): train.py's time_per_step_s of its log record at step 2 x --steps (--logging_steps
--steps: the window, its data wait included), the trainer's wall time between the ends of steps
--steps and 2 x --steps (a callback). Last line `ratio: <trainer step / train.py step>`.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench import (
    add_toy_flag,
    build_tiny,
    toy_sized,
)  # the repository on sys.path; offline defaults


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="all-MiniLM-L6-v2",
        help="the start model ('tiny': a random 2-layer, 32-wide BERT with MiniLM's tokenizer)",
    )
    p.add_argument(
        "--groups", type=int, default=8, help="groups per step (per_device_train_batch_size)"
    )
    p.add_argument("--max_length", type=int, default=64, help="tokens per passage")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after as many warm-up steps)")
    add_toy_flag(p, "the tiny encoder, 4 groups of 8 tokens, 1 timed step")
    return toy_sized(p.parse_args(argv), model="tiny", groups=4, max_length=8, steps=1)


def groups_folder(dest: Path, tokenizer, n: int, max_length: int) -> Path:
    """A finished groups folder (one parquet shard, stats.json) of random word groups, one document
    each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.bench_step import make_rows

    rows = make_rows(tokenizer, n, max_length)
    dest.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), dest / "groups-00000.parquet")
    (dest / "stats.json").write_text(json.dumps({"groups": n}))
    return dest


def main(argv=None):
    args = parse_args(argv)
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from transformers import AutoTokenizer, TrainerCallback

    import train
    from plumbing.common import resolve_model_path
    from xprt_sentence_transformers import XPRTLoss

    tmp = Path(tempfile.mkdtemp(prefix="bench-st-"))
    start = (
        str(build_tiny(tmp / "tiny")) if args.model == "tiny" else resolve_model_path(args.model)
    )
    total = 2 * args.steps
    # enough groups that neither side repeats an epoch
    groups = groups_folder(
        tmp / "groups",
        AutoTokenizer.from_pretrained(start),
        args.groups * (total + 1),
        args.max_length,
    )

    train.main(
        [
            "--model_name_or_path",
            start,
            "--groups_dir",
            str(groups),
            "--output_dir",
            str(tmp / "train_py"),
            "--max_train_steps",
            str(total),
            "--logging_steps",
            str(args.steps),
            "--per_device_train_batch_size",
            str(args.groups),
            "--max_length",
            str(args.max_length),
            "--report_to",
            "none",
            "--no_save_model",
            "--learning_rate",
            "1e-5",
        ]
    )
    log = [json.loads(ln) for ln in (tmp / "train_py" / "train_log.jsonl").read_text().splitlines()]
    ours = next(
        r["time_per_step_s"] for r in log if r.get("step") == total and "time_per_step_s" in r
    )

    ends = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            ends[state.global_step] = time.perf_counter()

    model = SentenceTransformer(start, device="cpu")
    loss = XPRTLoss(model, max_length=args.max_length)
    targs = SentenceTransformerTrainingArguments(
        str(tmp / "st"),
        max_steps=total,
        per_device_train_batch_size=args.groups,
        learning_rate=1e-5,
        batch_sampler=loss.batch_sampler,
        report_to="none",
        save_strategy="no",
        logging_steps=total,
        disable_tqdm=True,
    )
    kwargs = loss.trainer_kwargs()
    kwargs["callbacks"].append(StepClock())
    SentenceTransformerTrainer(
        model=model, args=targs, train_dataset=loss.groups_dataset(str(groups)), loss=loss, **kwargs
    ).train()
    theirs = (ends[total] - ends[args.steps]) / args.steps
    print(
        f"xPRT step, {args.groups} groups x 5 passages of {args.max_length} tokens, "
        f"{Path(start).name}, CPU fp32, "
        f"steps {args.steps + 1}..{total}:"
    )
    print(f"  train.py                                   {ours:8.3f} s/step")
    print(f"  SentenceTransformerTrainer + XPRTLoss      {theirs:8.3f} s/step")
    print(f"ratio: {theirs / ours:.3f}")


if __name__ == "__main__":
    main()
