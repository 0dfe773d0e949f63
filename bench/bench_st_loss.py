"""
SentenceTransformerTrainer with xprt_sentence_transformers.XPRTLoss against train.py, the same xPRT
step at the same batch on the CPU: the same start model (all-MiniLM-L6-v2 by default), the same
groups (random word passages filling --max_length, each its own document), batch, seed and
retention term (teacher on), fp32.

    python -m bench.bench_st_loss         # MiniLM, 8 groups of 64 tokens, steps 6..10 timed
    python -m bench.bench_st_loss --toy   # seconds: the tiny encoder, 4 groups of 8 tokens

Each side runs twice, interleaved (train.py, trainer, trainer, train.py), 2 x --steps optimiser
steps a run, the second --steps timed (the first warm up): train.py's time_per_step_s of its log
record at step 2 x --steps (--logging_steps --steps: the window, its data wait included), the
trainer's wall time between the ends of steps --steps and 2 x --steps (a callback). Last line
`ratio: <trainer step / train.py step>`.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench import add_toy_flag, build_tiny, toy_sized  # the repository on sys.path; offline


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="all-MiniLM-L6-v2",
                   help="the start model ('tiny': a random 2-layer, 32-wide BERT)")
    p.add_argument("--groups", type=int, default=8, help="groups per step (the per-device batch)")
    p.add_argument("--max_length", type=int, default=64, help="tokens per passage")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after as many warm-up steps)")
    add_toy_flag(p, "the tiny encoder, 4 groups of 8 tokens, 1 timed step")
    return toy_sized(p.parse_args(argv), model="tiny", groups=4, max_length=8, steps=1)


def groups_folder(dest: Path, tokenizer, n: int, max_length: int) -> Path:
    """A finished groups folder (a parquet shard, stats.json) of random groups, a document each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bench.bench_step import make_rows

    rows = make_rows(tokenizer, n, max_length)
    dest.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), dest / "groups-00000.parquet")
    (dest / "stats.json").write_text(json.dumps({"groups": n}))
    return dest


def train_py_step(start: str, groups: Path, out: Path, args) -> float:
    """train.py's seconds per step over steps --steps + 1 .. 2 x --steps (its log's window)."""
    import train

    total = 2 * args.steps
    train.main(["--model_name_or_path", start, "--groups_dir", str(groups), "--output_dir",
                str(out), "--max_train_steps", str(total), "--logging_steps", str(args.steps),
                "--max_length",
                str(args.max_length), "--per_device_train_batch_size", str(args.groups),
                "--learning_rate", "1e-5", "--report_to", "none", "--no_save_model"])
    log = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    return next(r["time_per_step_s"] for r in log if r.get("step") == total and "lr" in r)


def trainer_step(start: str, groups: Path, out: Path, args) -> float:
    """SentenceTransformerTrainer's seconds per step over the same steps (a callback's clock)."""
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from transformers import TrainerCallback

    from xprt_sentence_transformers import XPRTLoss

    total, ends = 2 * args.steps, {}

    class StepClock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            ends[state.global_step] = time.perf_counter()

    model = SentenceTransformer(start, device="cpu")
    loss = XPRTLoss(model, max_length=args.max_length)
    targs = SentenceTransformerTrainingArguments(
        str(out), max_steps=total, per_device_train_batch_size=args.groups, learning_rate=1e-5,
        batch_sampler=loss.batch_sampler, report_to="none", save_strategy="no", logging_steps=total,
        disable_tqdm=True)
    kwargs = loss.trainer_kwargs()
    kwargs["callbacks"].append(StepClock())
    data = loss.groups_dataset(str(groups))
    trainer = SentenceTransformerTrainer(model=model, args=targs, train_dataset=data, loss=loss,
                                         **kwargs)
    trainer.train()
    return (ends[total] - ends[args.steps]) / args.steps


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from plumbing.common import resolve_model_path

    tmp = Path(tempfile.mkdtemp(prefix="bench-st-"))
    tiny = args.model == "tiny"
    start = str(build_tiny(tmp / "tiny")) if tiny else resolve_model_path(args.model)
    # enough groups that no run repeats an epoch
    groups = groups_folder(tmp / "groups", AutoTokenizer.from_pretrained(start),
                           args.groups * (2 * args.steps + 1), args.max_length)
    times = {"train.py": [], "trainer": []}
    for k, side in enumerate(["train.py", "trainer", "trainer", "train.py"]):  # interleaved
        step = train_py_step if side == "train.py" else trainer_step
        times[side].append(step(start, groups, tmp / f"run{k}", args))
    ours, theirs = (sum(times[s]) / 2 for s in ("train.py", "trainer"))
    print(f"xPRT step, {args.groups} groups x 5 passages of {args.max_length} tokens, "
          f"{Path(start).name}, CPU fp32, steps {args.steps + 1}..{2 * args.steps} of 2 runs each:")
    print(f"  train.py                                {ours:8.3f} s/step  {times['train.py']}")
    print(f"  SentenceTransformerTrainer + XPRTLoss   {theirs:8.3f} s/step  {times['trainer']}")
    print(f"ratio: {theirs / ours:.3f}")


if __name__ == "__main__":
    main()
