"""Summarise a train.py run for experiments/train_minilm/: per-term means at the start and the end, and the check
that sentence-transformers loads the saved model and gives the same embeddings as our encoder.

    python experiments/train_minilm/summarize.py --run_dir /tmp/trn/minilm/run --start all-MiniLM-L6-v2 \
        --out experiments/train_minilm
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--run_dir", required=True, help="train.py --output_dir of the run")
    p.add_argument("--start", default="all-MiniLM-L6-v2", help="the run's starting model")
    p.add_argument("--out", default="experiments/train_minilm", help="where summary.json and the copies go")
    p.add_argument("--window", type=int, default=5, help="logged records averaged at each end")
    args = p.parse_args()
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from plumbing.embed import embed_texts
    from plumbing.common import resolve_model_path

    run, out = Path(args.run_dir), Path(args.out)
    recs = {}
    for line in (run / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        recs[r["step"]] = r
    steps = sorted(recs)
    keys = [k for k in recs[steps[-1]] if k.endswith("loss") or k in ("retention_weight", "lr", "padding_efficiency",
                                                                       "tokens_per_s", "time_per_step_s")]
    first, last = steps[: args.window], steps[-args.window:]
    mean = lambda ss, k: sum(recs[s][k] for s in ss) / len(ss)  # noqa: E731
    terms = {k: {"first_steps_mean": mean(first, k), "last_steps_mean": mean(last, k),
                 "min": min(recs[s][k] for s in steps), "max": max(recs[s][k] for s in steps)} for k in keys}

    texts = ["A cat sat on the mat.", "Dense retrieval maps queries and passages to vectors.",
             "The Treaty of Westphalia ended the Thirty Years' War in 1648.", "Hi", ""]
    st = torch.from_numpy(SentenceTransformer(str(run / "model"), device="cpu").encode(texts,
                                                                                     normalize_embeddings=True))
    tok = AutoTokenizer.from_pretrained(run / "model")
    ours = embed_texts(AutoModel.from_pretrained(run / "model"), tok, texts)
    start = embed_texts(AutoModel.from_pretrained(resolve_model_path(args.start)), tok, texts)
    summary = {
        "steps_logged": [steps[0], steps[-1]], "window_records": args.window, "terms": terms,
        "sentence_transformers_vs_ours_max_abs_diff": (st - ours).abs().max().item(),
        "trained_vs_start_cosine_min": (ours * start).sum(-1).min().item(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    shutil.copy(run / "train_log.jsonl", out / "train_log.jsonl")
    shutil.copy(run / "loss_curve.png", out / "loss_curve.png")
    shutil.copy(run / "model" / "README.md", out / "model_card.md")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
