"""How much of a training step waits on collation, with the batches collated in the loop's process or ahead of it?

For every objective train.py offers and two model sizes (random weights, the shipped tokenizer's 30,522 words):
  gpu        the gpu scale of experiments/paper: 4 layers x 192, passages of 64 tokens, retention off
  bert-base  12 layers x 768, passages of 128 tokens, retention on (40, the clean student)
it builds the run's own DataLoader (batches.training_loader: rows, the objective's collator, batches.SeededCollate) over
groups cut from data/docs.jsonl (each passage about max_length tokens), and times, for --steps steps:
  wait   the loop's wait for the next collated batch (next(loader)): its CPU time with 0 workers (the collation
         itself), its wall time with workers (they collate in other processes)
  step   XPRTModel.forward + backward + AdamW step on it, CPU time of this process (so that other load on a shared
         machine does not count)
with --dataloader_num_workers 0 (collation in the loop's process) and with 2 workers. The figure is wait / step, the
share of the step spent waiting on collation (first batch left out: worker start-up); the last line is `ratio: <the
mean wait / step with the last --workers value>`. On CPU the step is slower than on a GPU and the workers share
the step's cores, so the ratio, not the times, is the result; on a GPU the step shrinks by 100x and the 0-worker
ratio grows as much.

    python -m bench.bench_collation                       # both sizes, every objective (~15 min on 2 CPU cores)
    python -m bench.bench_collation --sizes gpu --groups 64
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench import ROOT, add_toy_flag, toy_sized
from bench.bench_step import tiny_causal_lm
from plumbing import model_folder

SIZES = {  # (hidden, layers, heads, intermediate, max_length, retention weight)
    "gpu": (192, 4, 3, 768, 64, 0.0),
    "bert-base": (768, 12, 12, 3072, 128, 40.0),
    "toy": (32, 2, 2, 64, 16, 40.0),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["gpu", "bert-base"], choices=list(SIZES), help="model sizes")
    p.add_argument("--objectives", nargs="+", default=None, help="default: every train.py --objective")
    p.add_argument("--groups", type=int, default=16, help="groups per batch")
    p.add_argument("--steps", type=int, default=4, help="timed steps per setting (after one untimed)")
    p.add_argument("--workers", nargs="+", type=int, default=[0, 2], help="DataLoader workers to compare")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the step (default: torch's)")
    add_toy_flag(p, "a 2-layer 32-wide BERT, 4 groups, 1 timed step")
    return toy_sized(p.parse_args(argv), sizes=["toy"], groups=4, steps=1)


def passage_rows(max_length: int, n: int) -> list:
    """n groups (anchor, 4 related, random passage) of about max_length-token passages cut from data/docs.jsonl;
    three groups per document id."""
    words = []
    with open(Path(ROOT) / "data" / "docs.jsonl", encoding="utf-8") as f:
        for line in f:
            words += json.loads(line)["text"].split()
            if len(words) > 6 * n * max_length:
                break
    k = int(max_length * 0.75)  # about 1.3 word pieces per word
    texts = [" ".join(words[i:i + k]) for i in range(0, len(words) - k, k)]
    return [{"doc_id": str(g // 3), "anchor": texts[6 * g], "related": texts[6 * g + 1:6 * g + 5],
             "random_passage": texts[6 * g + 5]} for g in range(n)]


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import datasets
    from accelerate.state import PartialState
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    import modeling_xprt as mx
    import train
    from plumbing import batches

    tok = AutoTokenizer.from_pretrained(str(Path(ROOT) / "bench" / "tokenizer"))
    objectives = args.objectives or train.pretraining_objectives()
    results = []
    for size in args.sizes:
        hidden, layers, heads, inner, max_length, retention = SIZES[size]
        folder = Path(tempfile.mkdtemp())
        torch.manual_seed(0)
        BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, intermediate_size=inner)).save_pretrained(folder)
        tok.save_pretrained(folder)
        teacher = model_folder.load_teacher(str(folder)) if retention else None
        rows = datasets.Dataset.from_list(passage_rows(max_length, args.groups * (args.steps + 1)))
        lm = tiny_causal_lm(folder / "lm", tok)  # Revela's language model
        for objective in objectives:
            options = ({"generator_name_or_path": str(folder)} if objective == "simlm" else
                       {"lm_name_or_path": lm} if objective == "revela" else {})
            mlm, _ = model_folder.load_mlm_encoder(str(folder))
            model = mx.XPRTModel(mlm, objective=objective, **options).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            collator = model.objective.make_collator(tok, max_length=max_length)
            lengths, row_extras = collator.sort_lengths(rows, 0)
            make_row = None if row_extras is None else (lambda e, i, r, x=row_extras: {**r, **x(e, i)})
            for workers in args.workers:
                sampler = batches.LengthGroupedBatchSampler(lengths, args.groups, seed=0)
                loader = batches.training_loader(PartialState(cpu=True), argparse.Namespace(
                    dataloader_num_workers=workers, seed=0), rows, sampler, collator, make_row)
                it, waits, steps = iter(loader), [], []
                for s in range(args.steps + 1):
                    # CPU seconds of this process (its threads together): on a shared machine, what the step and an
                    # in-process collation cost, whatever else runs; wall seconds: what the loop waited
                    t0, c0 = time.perf_counter(), time.process_time()
                    batch = next(it)
                    t1, c1 = time.perf_counter(), time.process_time()
                    out = model(batch, teacher=teacher, retention_weight=retention)
                    out["loss"].backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    c2 = time.process_time()
                    if s:  # the first batch waits for the workers to start
                        waits.append((t1 - t0, c1 - c0))
                        steps.append(c2 - c1)
                del it
                rec = {"size": size, "objective": objective, "workers": workers,
                       "wait_wall_s": sum(w for w, _ in waits) / len(waits),
                       "wait_cpu_s": sum(c for _, c in waits) / len(waits), "step_cpu_s": sum(steps) / len(steps)}
                # 0 workers: the collation's CPU time; with workers, the loop's wall-clock wait (its CPU time is ~0)
                rec["wait_over_step"] = (rec["wait_cpu_s"] if workers == 0 else rec["wait_wall_s"]) / rec["step_cpu_s"]
                results.append(rec)
                print(f"{size:>9} {objective:<24} workers {workers}: wait {rec['wait_wall_s']:7.3f} s wall "
                      f"{rec['wait_cpu_s']:7.3f} s CPU, step {rec['step_cpu_s']:7.3f} s CPU, wait / step "
                      f"{rec['wait_over_step']:.4f}", flush=True)
    last = [r["wait_over_step"] for r in results if r["workers"] == args.workers[-1]]
    print(f"ratio: {sum(last) / len(last):.4f}")  # the mean wait / step with the last --workers value
    return results


if __name__ == "__main__":
    main()
