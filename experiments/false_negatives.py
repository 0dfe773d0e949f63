"""In-batch false negatives of PAIR fine-tuning, counted without a model (issue 12).

PAIR's L_Q and L_P use every other passage of the batch as a negative. A row whose positive sits in another slot
of the batch (a copy, or the positive of another query with the same passage), or that meets another passage
labelled relevant to its query, trains against its own positive: its L_Q cannot fall below ln 2. This script
builds finetune.py's rows from a BEIR folder (one row per (query, relevant passage) of the qrels), cuts them into
the first epoch's batches for --seeds seeds, and reports, averaged over the seeds:
  before: the old sampler (length-grouped, queries may repeat), no mask: the share of rows that meet their own
          positive, or any passage labelled relevant to their query, among their negatives;
  after:  the sampler that never repeats a query in a batch, with the losses' mask (modeling_xprt.pair_false_negatives
          on the ids of modeling_xprt.pair_text_ids): the candidates masked, and the false negatives left unmasked
          (counted independently, by comparing texts; must be 0).
Hard negatives need a model to mine; without --mined_negatives the rows carry none (--num_negatives 0) and only the
in-batch positives are counted.

    python experiments/false_negatives.py --beir_dir ../shared/data/scifact --batch_size 32 --seeds 20
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import finetune  # noqa: E402
from modeling_xprt import pair_false_negatives, pair_text_ids
from plumbing.batches import NoDuplicatesBatchSampler
from plumbing.readers import load_beir


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--beir_dir", required=True, help="BEIR-layout folder (corpus.jsonl, queries.jsonl, qrels/)")
    p.add_argument("--qrels_split", default="train", help="qrels file the rows come from (finetune.py's default)")
    p.add_argument("--batch_size", type=int, default=32, help="rows per batch (per process)")
    p.add_argument("--world_size", type=int, default=1, help="processes: one step gathers this many batches")
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1, each the first epoch of a run")
    p.add_argument("--mined_negatives", default=None,
                   help="mined_negatives.json of a finetune.py run on the same folder, to count hard negatives too")
    p.add_argument("--num_negatives", type=int, default=0, help="hard negatives per row (needs --mined_negatives)")
    args = p.parse_args(argv)
    if args.num_negatives and not args.mined_negatives:
        raise SystemExit("--num_negatives > 0 needs --mined_negatives (no model here to mine with)")
    return args


def beir_rows(beir_dir, split, mined_negatives=None):
    """finetune.build_finetune_rows's BEIR rows, in its order, without the model: {query, positive, relevant,
    negative_pool (with --mined_negatives)}."""
    import json
    from pathlib import Path

    beir = load_beir(beir_dir, split)
    corpus = {d: finetune.passage_text(*tt) for d, tt in beir["corpus"].items()}
    qrels = {q: {d for d, s in ds.items() if s > 0} for q, ds in beir["qrels"].items()}
    rows = [{"query": beir["queries"][q], "positive": corpus[d]} for q in sorted(qrels) for d in sorted(qrels[q])]
    if mined_negatives:
        pools = json.loads(Path(mined_negatives).read_text(encoding="utf-8"))
        if len(pools) != len(rows):
            raise SystemExit(f"{mined_negatives}: {len(pools)} pools for {len(rows)} rows: mined for other data")
        for r, pool in zip(rows, pools):
            r["negative_pool"] = [corpus[d] for d in pool]
    return finetune.add_relevant(rows)


def epoch_figures(rows, batches, num_negatives, seed, world):
    """One epoch's steps -> per-row flags and counts. False negatives are found by text (candidate text equal to
    the row's positive or in its relevant texts), independently of the hash ids; masked ones are what the losses
    exclude (pair_false_negatives)."""
    f = dict.fromkeys(("rows", "own", "relevant", "fn", "masked", "unmasked_fn", "masked_not_fn", "rows_masked",
                       "repeated_query_rows"), 0)
    for s in range(0, len(batches) - world + 1, world):
        step = [{**rows[i], "negatives": finetune.pick_negatives(rows[i], i, num_negatives, seed, 0)}
                for b in batches[s:s + world] for i in b]
        texts = [t for r in step for t in [r["positive"]] + r["negatives"][:num_negatives]]
        k = 1 + num_negatives
        passage_ids, relevant_ids = pair_text_ids(step, num_negatives)
        exclude = pair_false_negatives(passage_ids.reshape(-1), relevant_ids, torch.arange(len(step)) * k).tolist()
        queries = [r["query"] for r in step]
        for i, r in enumerate(step):
            rel = set(r["relevant"])
            cands = [c for c in range(len(texts)) if c != i * k]
            fn = {c for c in cands if texts[c] in rel}
            masked = {c for c in cands if exclude[i][c]}
            f["rows"] += 1
            f["own"] += any(texts[c] == r["positive"] for c in cands)
            f["relevant"] += bool(fn)
            f["fn"] += len(fn)
            f["masked"] += len(masked)
            f["unmasked_fn"] += len(fn - masked)
            f["masked_not_fn"] += len(masked - fn)
            f["rows_masked"] += bool(masked)
            f["repeated_query_rows"] += queries.count(r["query"]) > 1
    return f


def main(argv=None):
    args = parse_args(argv)
    rows = beir_rows(args.beir_dir, args.qrels_split, args.mined_negatives)
    lengths = [len(r["query"]) + len(r["positive"]) for r in rows]  # finetune.main's lengths
    keys = [r["query"] for r in rows]
    print(f"{args.beir_dir} ({args.qrels_split}): {len(rows)} rows, {len(set(keys))} queries; batch "
          f"{args.batch_size} x {args.world_size} processes, {args.num_negatives} hard negatives, "
          f"seeds 0-{args.seeds - 1}")
    res = {"before": [], "after": []}
    for seed in range(args.seeds):
        for name, k in (("before", None), ("after", keys)):
            batches = NoDuplicatesBatchSampler(lengths, args.batch_size, seed, keys=k).batches()
            fig = epoch_figures(rows, batches, args.num_negatives, seed, args.world_size)
            if name == "after":  # finetune.py's start-up line counts the same mask
                c = finetune.count_false_negatives(rows, batches, args.num_negatives, seed, 0, args.world_size)
                assert (c["masked"], c["rows_with_masked"]) == (fig["masked"], fig["rows_masked"]), (c, fig)
            res[name].append(fig)

    def mean(name, key, per_row=True):
        vals = [f[key] / f["rows"] if per_row else f[key] for f in res[name]]
        return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)

    print(f"{'':<7} {'own positive':>13} {'relevant':>9} {'repeated query':>15} {'masked / epoch':>17} "
          f"{'left unmasked':>14}")
    for name in ("before", "after"):
        own, rel, rep = mean(name, "own"), mean(name, "relevant"), mean(name, "repeated_query_rows")
        masked = mean(name, "masked", False)
        left = sum(f["unmasked_fn" if name == "after" else "fn"] for f in res[name])
        print(f"{name:<7} {100 * own[0]:12.1f}% {100 * rel[0]:8.1f}% {100 * rep[0]:14.1f}% "
              f"{masked[0]:9.1f} ± {masked[1]:5.1f} {left:>14}")
    print("own positive / relevant / repeated query: share of rows that meet among their in-batch negatives a copy "
          "of their positive / any passage labelled relevant to their query / their own query in another row (the "
          "first two before any mask); masked / epoch: candidates the mask removes per epoch (before: would "
          "remove), mean ± sd over seeds; left unmasked: false negatives (by text) still in a denominator, summed "
          "over the seeds (before: all of them, there is no mask)")
    spurious = sum(f["masked_not_fn"] for f in res["after"])
    print(f"masked candidates that are not false negatives by text (hash collisions): {spurious}")


if __name__ == "__main__":
    main()
