"""Our local-data scores for all-MiniLM-L6-v2 (results.json here) next to the published MTEB figures
(published.json here). Prints a Markdown table; used for README.md in this folder.

    python experiments/eval_minilm/compare.py
"""
import json
from pathlib import Path

here = Path(__file__).resolve().parent
ours = json.loads((here / "results.json").read_text())
pub = json.loads((here / "published.json").read_text())
model = ours["models"][0]
print("| task | metric | ours (local data) | published (MTEB) | gap |")
print("|---|---|---|---|---|")
for t in ours["tasks"]:
    name = t["name"]
    s = ours["summary"]["per_task"][model][name]
    p = pub["scores"].get(name)
    metric = ours["results"][model][name]["metric"]
    print(f"| {name} | {metric} | {s:.2f} | " + (f"{p:.2f} | {s - p:+.2f} |" if p is not None else "- | - |"))
