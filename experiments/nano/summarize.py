"""The nano experiment's table and curves, from evaluate.py's results of every seed (experiments/nano/run.sh).

Reads <out>/eval_s<seed>/results.json (evaluate.py; models in the order run.sh passed them: the MLM start, then
--arms) and <out>/s<seed>/<arm>/train_log.jsonl, and writes
  <out>/results.md      per task, per category and the average: the MLM start, each arm's mean +- sd over the
                        seeds, and its difference to the MLM start
  <out>/results.json    the same numbers
  <out>/loss_curves.png each arm's training loss (first seed) beside the MLM pre-training curve
--stop_check exits 1 when, after the first seed, the arms' averages lie within --noise points of each other.
"""
import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from plumbing.common import atomic_path, atomic_write  # noqa: E402  (the repository's one atomic-write helper)


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the experiment folder run.sh wrote (OUT)")
    p.add_argument("--arms", nargs="+", required=True, help="arm names, in the order run.sh evaluated them")
    p.add_argument("--noise", type=float, default=1.0,
                   help="stop rule: arms whose averages span less than this many points are within noise")
    p.add_argument("--stop_check", action="store_true",
                   help="only apply the stop rule to the first seed's results (exit 1 = stop)")
    return p.parse_args(argv)


def seed_results(out, arms):
    """{seed: {"start": {task: score}, arm: {task: score}, ...}} and the task -> category map, from every
    eval_s<seed>/results.json; the models are matched by position (the MLM start first, then the arms)."""
    per_seed, category = {}, {}
    for d in sorted(Path(out).glob("eval_s*/results.json")):
        seed = int(re.search(r"eval_s(\d+)", str(d)).group(1))
        res = json.loads(d.read_text())
        models = res["models"]
        if len(models) != len(arms) + 1:
            raise SystemExit(f"{d}: {len(models)} models, expected the MLM start + {len(arms)} arms")
        per_task = res["summary"]["per_task"]
        per_seed[seed] = {name: per_task[m] for name, m in zip(["start"] + list(arms), models)}
        category.update({t["name"]: t["type"] for t in res["tasks"]})
    if not per_seed:
        raise SystemExit(f"no eval_s*/results.json under {out}")
    return dict(sorted(per_seed.items())), category


def rows_of(scores, category):
    """Per task, then per category (mean of its tasks), then the average over tasks (the paper's average)."""
    tasks = list(scores)
    rows = {t: scores[t] for t in tasks}
    for cat in sorted(set(category[t] for t in tasks)):
        rows[f"[{cat}]"] = statistics.mean(scores[t] for t in tasks if category[t] == cat)
    rows["[average]"] = statistics.mean(scores[t] for t in tasks)
    return rows


def mean_sd(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def table(per_seed, category, arms):
    """{row: {"start": score, arm: (mean, sd, delta_mean)}} over all seeds."""
    seeds = list(per_seed)
    start = rows_of(per_seed[seeds[0]]["start"], category)
    arm_rows = {a: [rows_of(per_seed[s][a], category) for s in seeds] for a in arms}
    out = {}
    for r in start:
        out[r] = {"start": start[r]}
        for a in arms:
            m, sd = mean_sd([x[r] for x in arm_rows[a]])
            out[r][a] = (m, sd, m - start[r])
    return out, seeds


def write_markdown(tab, seeds, arms, path):
    head = "| task | MLM start | " + " | ".join(arms) + " |"
    lines = [f"nDCG@10 (SciFact), Spearman x100 (STS), accuracy (Banking77); mean ± sd over seeds "
             f"{', '.join(map(str, seeds))}; (Δ to the MLM start)", "", head,
             "|" + "---|" * (len(arms) + 2)]
    for r, v in tab.items():
        cells = [f"{v[a][0]:.2f} ± {v[a][1]:.2f} ({v[a][2]:+.2f})" for a in arms]
        lines.append(f"| {r} | {v['start']:.2f} | " + " | ".join(cells) + " |")
    atomic_write(path, "\n".join(lines) + "\n")
    return "\n".join(lines)


def plot_curves(out, arms, seed, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    mlm_log = Path(out) / "mlm" / "mlm_log.jsonl"
    if mlm_log.is_file():
        recs = [json.loads(x) for x in mlm_log.read_text().splitlines()]
        tr = [(r["step"], r["loss"]) for r in recs if "loss" in r]
        axes[0].plot(*zip(*tr), label="train")
        ev = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
        if ev:
            axes[0].scatter(*zip(*ev), color="C3", label="held-out", zorder=3)
        axes[0].set(title="MLM pre-training of the nano BERT", xlabel="step", ylabel="MLM loss (nats)")
        axes[0].legend()
    for a in arms:
        f = Path(out) / f"s{seed}" / a / "train_log.jsonl"
        if not f.is_file():
            continue
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        pts = [(r["step"], r["loss"]) for r in recs if "loss" in r and "step" in r]
        if pts:
            axes[1].plot(*zip(*pts), marker=".", label=a)
    axes[1].set(title=f"each arm's total training loss (seed {seed})", xlabel="step", ylabel="loss")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    per_seed, category = seed_results(args.out, args.arms)
    if args.stop_check:
        first = per_seed[next(iter(per_seed))]
        avgs = {a: rows_of(first[a], category)["[average]"] for a in args.arms}
        spread = max(avgs.values()) - min(avgs.values())
        print("first seed averages: " + ", ".join(f"{a} {v:.2f}" for a, v in avgs.items())
              + f"; spread {spread:.2f} vs noise {args.noise}")
        return 0 if spread >= args.noise else 1
    tab, seeds = table(per_seed, category, args.arms)
    print(write_markdown(tab, seeds, args.arms, Path(args.out) / "results.md"))
    atomic_write(Path(args.out, "results.json"), json.dumps(
        {"seeds": seeds, "arms": args.arms, "table": {r: {k: v for k, v in row.items()} for r, row in tab.items()}},
        indent=1))
    plot_curves(args.out, args.arms, seeds[0], Path(args.out) / "loss_curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
