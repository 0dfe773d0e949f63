"""
What a batch holds, on real groups (select_groups.py's output), for train.py's batching: how many rows share their
document with another row of the batch, how many in-batch negatives the same-document mask removes from L_xp, the
padding efficiency; and for the random-span baseline, whether the crops' lengths tell a row's partner apart.

    python -m bench.bench_batches --groups_dir outputs/demo/groups          # the demo's groups (300 documents)
    python -m bench.bench_batches --toy     # seconds: groups of 20 bundled documents, selected with a tiny encoder

The random-span cue: for each row's query crop, the candidates are every key crop of the batch; a scorer that sees
only lengths ranks the candidates by |length(key) - length(query)|, the most different first (a partner is the other
crop of the same anchor: with the views in random order, the other length class). Percentile of the partner's rank:
0.5 = lengths tell nothing. Compared across batchings: random batches, length-grouped, length-grouped with documents
spread (--spread_documents).

Last line `ratio: <same-document share with spreading / without>`.
"""

import argparse
import json
import os
import tempfile

import numpy as np

from bench import ROOT, add_toy_flag, build_tiny, toy_sized  # the repository on sys.path; offline defaults


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups_dir", default="outputs/demo/groups", help="a select_groups.py output folder")
    p.add_argument("--batch_size", type=int, default=16, help="groups per batch")
    p.add_argument("--max_length", type=int, default=128, help="passage tokens, as train.py --max_length")
    p.add_argument("--spread", type=int, nargs="+", default=[1, 4, 8, 16], help="--spread_documents values to compare")
    p.add_argument("--epochs", type=int, default=5, help="epochs (seeds of the order) averaged")
    add_toy_flag(p, "select_groups.py's groups of the first 20 bundled documents with a tiny random encoder, batch 4, "
                    "1 epoch")
    return toy_sized(p.parse_args(argv), groups_dir=None, batch_size=4, spread=[1, 8], epochs=1)


def toy_groups() -> str:
    """select_groups.py's output for the first 20 documents of data/docs.jsonl, encoded by a tiny random BERT (half
    of the passages anchors): real groups, made in seconds."""
    import select_groups

    tmp = tempfile.mkdtemp(prefix="bench-batches-")
    with open(os.path.join(ROOT, "data", "docs.jsonl"), encoding="utf-8") as fh, \
            open(os.path.join(tmp, "docs.jsonl"), "w", encoding="utf-8") as out:
        out.writelines(json.dumps(json.loads(line)) + "\n" for _, line in zip(range(20), fh))
    select_groups.main(["--input", os.path.join(tmp, "docs.jsonl"), "--output_dir", os.path.join(tmp, "groups"),
                        "--model_name_or_path", build_tiny(os.path.join(tmp, "tiny")), "--anchor_share", "0.5"])
    return os.path.join(tmp, "groups")


def composition(batches, doc, tokens):
    """(same-document row share, share of negatives the same-document mask removes, padding efficiency) over batches;
    tokens: (N, 5) each group's passage token counts (the collator pads all of a batch's passages to one length)."""
    same_rows = removed = pairs = real = proc = 0
    for b in batches:
        d = doc[b]
        eq = d[:, None] == d[None, :]
        np.fill_diagonal(eq, False)
        same_rows += int(eq.any(1).sum())
        removed += int(eq.sum())
        pairs += len(b) * (len(b) - 1)
        t = tokens[b]
        real += int(t.sum())
        proc += t.size * int(t.max())
    rows = sum(len(b) for b in batches)
    return same_rows / rows, removed / pairs, real / proc


def length_cue(batches, spans, view1_is_long: bool) -> float:
    """Mean percentile of the partner's rank under the length-only scorer (0.5: no cue); spans (N, 2, 2) [start,
    length] per view. view1_is_long: the query is the longer crop (train.py now), else view 1 as drawn."""
    ks = spans[:, :, 1]
    q = ks.max(1) if view1_is_long else ks[:, 0]
    k = ks.min(1) if view1_is_long else ks[:, 1]
    pct = []
    rng = np.random.default_rng(0)
    for b in batches:
        score = np.abs(k[b][None, :] - q[b][:, None]) + 1e-6 * rng.random((len(b), len(b)))  # ties broken at random
        rank = (score > score[np.arange(len(b)), np.arange(len(b))][:, None]).sum(1)  # candidates scored higher
        pct += list(rank / (len(b) - 1))
    return float(np.mean(pct))


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoTokenizer

    import train
    from baselines.contriever import RandomSpanCollator
    from modeling_xprt import group_lengths as mx_group_lengths
    from plumbing import batches, common

    if args.toy:
        args.groups_dir = toy_groups()
    groups = train.load_groups(args.groups_dir)
    tok = AutoTokenizer.from_pretrained(common.resolve_model_path("all-MiniLM-L6-v2"))
    doc = np.asarray(groups["doc_id"])
    passages = [[a] + list(r[:4]) for a, r in zip(groups["anchor"], groups["related"])]
    counts = tok([t for p in passages for t in p], truncation=True, max_length=args.max_length + 2)["input_ids"]
    tokens = np.asarray([len(c) for c in counts]).reshape(len(passages), 5)
    lengths = mx_group_lengths(groups, 4)
    print(f"{args.groups_dir}: {len(groups)} groups of {len(set(doc))} documents, batch {args.batch_size}, "
          f"{args.epochs} epochs")
    print(f"{'batching':32s} {'same-doc rows':>14s} {'negatives removed':>18s} {'padding eff.':>13s}")
    results = {}
    for name, spread, group in [("random batches", 1, False)] + [(f"length-grouped, spread {s}", s, True)
                                                                 for s in args.spread]:
        figs = []
        for epoch in range(args.epochs):
            s = batches.LengthGroupedBatchSampler(lengths, args.batch_size, seed=epoch, group_by_length=group,
                                                  spread=spread)
            figs.append(composition(s.batch_matrix(), doc, tokens))
        m = np.mean(figs, axis=0)
        results[name] = m
        print(f"{name:32s} {m[0]:14.3f} {m[1]:18.3f} {m[2]:13.3f}")
    # the random-span baseline: crops drawn per (seed, epoch), rows grouped by the crops' lengths
    collator = RandomSpanCollator(tok, max_length=args.max_length)
    lengths_for, row_extras = collator.sort_lengths(groups, seed=0)
    spans = np.stack([row_extras(0, i)["crop_spans"] for i in range(len(groups))])
    ks = spans[:, :, 1]
    crop_tokens = np.stack([ks.max(1), ks.min(1)], 1) + 2
    print("\nrandom-span baseline (crops of the anchors): length-only scorer's partner percentile (0.5 = no cue)")
    for name, group, spread, long_first in [("random batches, views as drawn", False, 1, False),
                                            ("crop-grouped, views as drawn", True, 1, False),
                                            ("crop-grouped, query = longer crop", True, 1, True),
                                            ("crop-grouped, spread 8, query = longer", True, 8, True)]:
        s = batches.LengthGroupedBatchSampler(lengths_for, args.batch_size, seed=0, group_by_length=group,
                                              spread=spread)
        b = s.batch_matrix()
        long_pad = np.mean([crop_tokens[x, 0].sum() / (len(x) * crop_tokens[x, 0].max()) for x in b])
        short_pad = np.mean([crop_tokens[x, 1].sum() / (len(x) * crop_tokens[x, 1].max()) for x in b])
        print(f"  {name:40s} percentile {length_cue(b, spans, long_first):.3f}   padding efficiency longer / shorter "
              f"{long_pad:.3f} / {short_pad:.3f}")
    spread_key = next((k for k in results if k.endswith("spread 8")), list(results)[-1])
    print(f"ratio: {results[spread_key][0] / results['length-grouped, spread 1'][0]:.3f}")


if __name__ == "__main__":
    main()
