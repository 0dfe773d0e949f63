"""Rebuild data/eval/ from ../shared/data (see README.md here): a SciFact sample and the STS-B test set.

    python data/eval/make_sample.py --shared ../shared/data

SciFact: --queries test queries drawn with --seed, every document they judge relevant, and random other
documents up to --docs in all, in the same BEIR layout (corpus.jsonl, queries.jsonl, qrels/test.tsv)
with lines in the source order. STS-B: sts-test.csv and LICENSE.txt copied byte for byte. Labelled pairs for the
README's fine-tuning command (data/pairs.jsonl): the first --pairs (query, relevant document) pairs of SciFact's
*train* split in file order (its queries are not the test split's), as {"query", "positive"} records, the document
as "title\ntext" (its title its first line, as the BEIR readers join them).
"""

import argparse
import json
import random
import shutil
from pathlib import Path

p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--shared", default=str(Path(__file__).resolve().parents[3] / "shared" / "data"),
               help="the shared data folder (SOURCES.md there)")
p.add_argument("--out", default=str(Path(__file__).resolve().parent), help="output folder (this one)")
p.add_argument("--queries", type=int, default=100, help="SciFact test queries to keep")
p.add_argument("--docs", type=int, default=1000, help="SciFact documents in all (relevant ones always kept)")
p.add_argument("--seed", type=int, default=0, help="sampling seed")
p.add_argument("--pairs", type=int, default=200, help="SciFact train pairs written to --pairs_out")
p.add_argument("--pairs_out", default=str(Path(__file__).resolve().parents[1] / "pairs.jsonl"),
               help="where the train pairs go (data/pairs.jsonl)")
args = p.parse_args()
src, out = Path(args.shared), Path(args.out)
rng = random.Random(args.seed)

qrel_lines = (src / "scifact/qrels/test.tsv").read_text().splitlines()
header, rows = qrel_lines[0], [line.split("\t") for line in qrel_lines[1:] if line.strip()]
qids = sorted({r[0] for r in rows}, key=int)
keep_q = set(rng.sample(qids, args.queries))
keep_rows = [r for r in rows if r[0] in keep_q]
relevant = {r[1] for r in keep_rows}
corpus_lines = (src / "scifact/corpus.jsonl").read_text(encoding="utf-8").splitlines()
ids = [json.loads(line)["_id"] for line in corpus_lines]
others = sorted(set(ids) - relevant)
keep_d = relevant | set(rng.sample(others, args.docs - len(relevant)))
(out / "scifact/qrels").mkdir(parents=True, exist_ok=True)
(out / "scifact/corpus.jsonl").write_text(
    "".join(line + "\n" for line, i in zip(corpus_lines, ids) if i in keep_d), encoding="utf-8")
(out / "scifact/queries.jsonl").write_text("".join(
    line + "\n" for line in (src / "scifact/queries.jsonl").read_text(encoding="utf-8").splitlines()
    if json.loads(line)["_id"] in keep_q), encoding="utf-8")
(out / "scifact/qrels/test.tsv").write_text(header + "\n" + "".join("\t".join(r) + "\n" for r in keep_rows))
(out / "stsbenchmark").mkdir(parents=True, exist_ok=True)
for name in ("sts-test.csv", "LICENSE.txt"):
    shutil.copyfile(src / "stsbenchmark" / name, out / "stsbenchmark" / name)
print(f"scifact: {len(keep_q)} queries, {len(keep_rows)} qrels, {len(keep_d)} docs ({len(relevant)} relevant)")

train = [line.split("\t") for line in (src / "scifact/qrels/train.tsv").read_text().splitlines()[1:] if line.strip()]
train = train[:args.pairs]
queries = {json.loads(line)["_id"]: json.loads(line)["text"]
           for line in (src / "scifact/queries.jsonl").read_text(encoding="utf-8").splitlines()}
docs = {}
for line in corpus_lines:
    d = json.loads(line)
    docs[d["_id"]] = (d.get("title") or "").strip() + "\n" + d["text"] if d.get("title") else d["text"]
assert not {q for q, _, _ in train} & keep_q, "a train query among the sampled test queries"
Path(args.pairs_out).write_text("".join(json.dumps({"query": queries[q], "positive": docs[d]}, ensure_ascii=False)
                                        + "\n" for q, d, _ in train), encoding="utf-8")
print(f"pairs: {len(train)} SciFact train pairs -> {args.pairs_out}")
