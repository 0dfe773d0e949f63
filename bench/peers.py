"""Our training steps beside the stock implementations people would otherwise use, same weights, same batches.

  contrastive  the random-span baseline's step (XPRTModel, objective contrastive_random_span: one-direction
               InfoNCE, tau 0.05, mean pooling) vs sentence-transformers' MultipleNegativesRankingLoss step
               (scale 20 = 1 / tau, the same all-MiniLM-L6-v2 weights, mean pooling), each forward + backward +
               AdamW step, on the same crops of real text (SciFact abstracts, varied lengths): the crops our collator
               cuts, handed to MNRL as its two columns of token ids, each padded to its own longest (what its
               tokenizer does per column).
  MLM          our L_MLM path (encoder, MLM head only at the masked positions, fused chunked cross-entropy) vs stock
               transformers BertForMaskedLM(labels=...) (full vocabulary logits at every position), forward +
               backward, the same model object (same weights) and the same 15% masks (XPRTCollator).

Timings are interleaved (ours, peer, peer, ours, ...) so load changes on a shared machine hit both alike; each
batch pair gives a ratio ours / peer; reported: median of the ratios and a 95% bootstrap interval of that median.
The last line is `ratio: <contrastive step / MNRL step>`.

    python -m bench.peers                 # ~5 min on 2 CPU cores
    python -m bench.peers --rounds 2      # quick
    python -m bench.peers --toy           # seconds: the same code on 1 batch of 5 short texts
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

import modeling_xprt as mx
from bench import ROOT, add_toy_flag, toy_sized  # importing bench sets the offline defaults
from plumbing import common, model_folder

DEFAULT_CORPUS = os.path.join(os.path.dirname(ROOT), "shared", "data", "scifact", "corpus.jsonl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help="BEIR corpus.jsonl of real text (title + text); falls back to the repo's data/docs.jsonl")
    p.add_argument("--batch_size", type=int, default=32, help="pairs per contrastive batch / passages per MLM batch")
    p.add_argument("--batches", type=int, default=4, help="distinct batches of each kind")
    p.add_argument("--rounds", type=int, default=3, help="timed passes over the batches (after one warm-up pass)")
    p.add_argument("--max_length", type=int, default=128, help="passage tokens (crops are cut from these)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--skip_mlm", action="store_true", help="time the contrastive comparison only")
    add_toy_flag(p, "1 batch of 5 texts cut to 16 tokens, 1 round")
    return toy_sized(p.parse_args(argv), batch_size=5, batches=1, rounds=1, max_length=16)


def read_texts(path, n):
    """The first n non-empty texts (title + text) of a corpus.jsonl."""
    if not os.path.exists(path):
        path = os.path.join(ROOT, "data", "docs.jsonl")
    texts = []
    for r in common.read_jsonl(path):
        t = " ".join(x for x in (r.get("title", ""), r.get("text", "")) if x).strip()
        if t:
            texts.append(t)
        if len(texts) == n:
            break
    if len(texts) < n:
        raise ValueError(f"{path}: {len(texts)} texts, need {n}")
    return texts


def interleaved(pairs, rounds):
    """pairs: [(ours_fn, peer_fn)] (one per batch). Times each after a warm-up pass, alternating which goes first;
    -> per-pair ratios ours / peer, ours' times, peer's times."""
    for a, b in pairs:
        a(), b()
    ratios, ta, tb = [], [], []
    for r in range(rounds):
        for i, (a, b) in enumerate(pairs):
            order = [(a, ta), (b, tb)] if (r + i) % 2 == 0 else [(b, tb), (a, ta)]
            for fn, acc in order:
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
            ratios.append(ta[-1] / tb[-1])
    return ratios, ta, tb


def median_ci(x, n_boot=2000, seed=0):
    """Median and a 95% bootstrap interval of the median."""
    x = np.asarray(x)
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, len(x), (n_boot, len(x)))], axis=1)
    return float(np.median(x)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def report(name, ratios, ta, tb, ours, peer):
    med, lo, hi = median_ci(ratios)
    print(f"{name}: ours {statistics.median(ta):.3f} s, {peer} {statistics.median(tb):.3f} s (medians of "
          f"{len(ta)}); ratio ours/{peer} median {med:.3f} (95% interval {lo:.3f}-{hi:.3f})", flush=True)
    return med


def bench_contrastive(args, texts, path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    st = SentenceTransformer(path, device="cpu")
    mlm, _ = model_folder.load_mlm_encoder(path)
    ours = mx.XPRTModel(mlm, objective="contrastive_random_span").train()
    # the very same weights (the start model has a pooler, unused by both: mean pooling)
    res = ours.encoder.base_model.load_state_dict(st[0].auto_model.state_dict(), strict=False)
    if res.missing_keys or set(res.unexpected_keys) - {"pooler.dense.weight", "pooler.dense.bias"}:
        raise RuntimeError(f"the two encoders differ: {res}")
    st.train()
    mnrl = MultipleNegativesRankingLoss(st, scale=1.0 / ours.tau)  # scale 20 = tau 0.05
    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-5)
    opt_st = torch.optim.AdamW(st.parameters(), lr=1e-5)
    collator = ours.objective.make_collator(st.tokenizer, max_length=args.max_length, seed=0)
    bs = args.batch_size
    pairs, real, ours_tok, st_tok = [], 0, 0, 0
    for i in range(args.batches):
        rows = [{"doc_id": str(j), "anchor": t, "related": [t] * 4, "random_passage": t}
                for j, t in enumerate(texts[i * bs : (i + 1) * bs])]
        b = collator(rows)
        views = [[], []]  # MNRL's two columns: view 1 and view 2 of each row, each padded to its own longest
        for r in range(bs):
            long = b["input_ids"][r][b["attention_mask"][r].bool()]
            short = b["short_input_ids"][r][b["short_attention_mask"][r].bool()]
            v1, v2 = long, short  # the longer crop is the query, as in random_span_step
            views[0].append(v1), views[1].append(v2)
        feats = []
        for col in views:
            ids = torch.nn.utils.rnn.pad_sequence(col, batch_first=True, padding_value=st.tokenizer.pad_token_id)
            am = torch.nn.utils.rnn.pad_sequence([torch.ones_like(v) for v in col], batch_first=True)
            feats.append({"input_ids": ids, "attention_mask": am, "token_type_ids": torch.zeros_like(ids)})
        real += sum(int(f["attention_mask"].sum()) for f in feats)
        ours_tok += b["input_ids"].numel() + b["short_input_ids"].numel()
        st_tok += sum(f["input_ids"].numel() for f in feats)

        def step_ours(b=b):
            opt_ours.zero_grad(set_to_none=True)
            ours(b)["loss"].backward()
            opt_ours.step()

        def step_st(feats=feats):
            opt_st.zero_grad(set_to_none=True)
            mnrl(feats, None).backward()
            opt_st.step()

        pairs.append((step_ours, step_st))
    # same loss on the same batch and weights, before any step (a check that the two do the same work)
    with torch.no_grad():
        ours.eval(), st.eval()
        l_ours = float(ours(b)["loss"])
        l_st = float(mnrl(feats, None))
        ours.train(), st.train()
    print(f"contrastive: {args.batches} batches x {bs} pairs of crops; loss on the last batch ours {l_ours:.5f}, "
          f"MNRL {l_st:.5f} (eval mode); tokens processed ours {ours_tok}, MNRL {st_tok}, real {real}", flush=True)
    ratios, ta, tb = interleaved(pairs, args.rounds)
    return report("contrastive step (fwd + bwd + AdamW)", ratios, ta, tb, "ours", "MNRL")


def bench_mlm(args, texts, path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    mlm, _ = model_folder.load_mlm_encoder(path)
    model = mx.XPRTModel(mlm).train()  # wraps the same BertForMaskedLM object: the same weights for both paths
    collator = mx.XPRTCollator(tok, max_length=args.max_length, seed=0, num_related=4)
    per = args.batch_size // 5  # groups of 5 passages
    pairs = []
    for i in range(args.batches):
        rows = [{"doc_id": str(j), "anchor": texts[j], "related": texts[j + 1 : j + 5], "random_passage": texts[j]}
                for j in range(i * per * 5, (i + 1) * per * 5, 5)]
        b = collator(rows)
        g, p, l = b["input_ids"].shape
        ids, am, labels = (b[k].view(g * p, l) for k in ("input_ids", "attention_mask", "mlm_labels"))

        def ours_fn(b=b, ids=ids, am=am):
            model.zero_grad(set_to_none=True)
            hidden, _ = model.encode(ids, am)
            flat = hidden.reshape(-1, hidden.shape[-1])
            mx.mlm_loss(model, flat.index_select(0, b["mlm_index"]), b["mlm_targets"]).backward()

        def stock_fn(ids=ids, am=am, labels=labels):
            mlm.zero_grad(set_to_none=True)
            mlm(input_ids=ids, attention_mask=am, labels=labels).loss.backward()

        pairs.append((ours_fn, stock_fn))
    with torch.no_grad():
        model.eval()
        hidden, _ = model.encode(ids, am)
        mine = mx.mlm_loss(model, hidden.reshape(-1, hidden.shape[-1]).index_select(0, b["mlm_index"]),
                           b["mlm_targets"])
        stock = mlm(input_ids=ids, attention_mask=am, labels=labels).loss
        model.train()
    print(f"MLM: {args.batches} batches x {g * p} passages (15% masked); loss on the last batch ours "
          f"{float(mine):.5f}, "
          f"stock {float(stock):.5f} (eval mode)", flush=True)
    ratios, ta, tb = interleaved(pairs, args.rounds)
    return report("MLM loss path (fwd + bwd)", ratios, ta, tb, "ours", "BertForMaskedLM")


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = common.resolve_model_path("all-MiniLM-L6-v2")
    texts = read_texts(args.corpus, args.batch_size * args.batches)
    print(f"all-MiniLM-L6-v2, CPU fp32, {torch.get_num_threads()} threads; texts from {args.corpus}", flush=True)
    out = {}
    if not args.skip_mlm:
        out["mlm"] = bench_mlm(args, texts, path)
    out["contrastive"] = bench_contrastive(args, texts, path)
    print(json.dumps(out))
    print(f"ratio: {out['contrastive']:.3f}")


if __name__ == "__main__":
    main()
