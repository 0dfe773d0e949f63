"""Our local-data scores for all-MiniLM-L6-v2 (results.json here, evaluate.py's output) next to the published MTEB
figures (published.json here). Prints the Markdown table of README.md in this folder: scores x100 to the third
decimal (the published files give five digits), so that agreement to the third decimal shows.

    python experiments/eval_minilm/compare.py
"""
import json
from pathlib import Path

# the metric's name in the table, by task type (evaluate.CATEGORY_METRIC's labels; kept here so that this script
# reads two JSON files without importing mteb)
METRIC_LABEL = {"Retrieval": "nDCG@10", "STS": "Spearman", "Classification": "accuracy"}

here = Path(__file__).resolve().parent
ours = json.loads((here / "results.json").read_text())
pub = json.loads((here / "published.json").read_text())
model = ours["models"][0]


def gap(ours_score: float, published: float) -> str:
    text = f"{ours_score - published:+.3f}"
    return "0.000" if text in ("+0.000", "-0.000") else text


print("| task | metric | ours (local data) | published (MTEB) | gap |")
print("|---|---|---|---|---|")
for t in ours["tasks"]:
    name = t["name"]
    s = ours["summary"]["per_task"][model][name]
    p = pub["scores"].get(name)
    metric = METRIC_LABEL.get(t["type"], ours["results"][model][name]["metric"])
    print(f"| {name} | {metric} | {s:.3f} | " + (f"{p:.3f} | {gap(s, p)} |" if p is not None else "- | - |"))
