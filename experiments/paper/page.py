"""The harness's results page: evaluate.py's results.json of every seed -> results.md / results.json in the paper's
layout (its Table 1, Table 3, where the gains land, the overlap thirds, the fine-tuning question), with the paper's
published numbers (published.py) beside ours. Scores x100; mean +- sd over seeds where there are several."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from experiments.paper import stages
from experiments.paper.published import E5_SETTING, FROM_MLM_SETTING
from plumbing.common import atomic_write, read_json
from plumbing.training import code_revision

LABELS = {"start": "start", "xprt": "xPRT", "contrastive_random_span": "random spans (Contriever)",
          "self_reconstruction": "self-reconstruction", "retromae": "RetroMAE", "simlm": "SimLM",
          "no_fill_in": "xPRT without fill-in", "random_positive": "xPRT, random positive",
          "e5_ranking": "xPRT, E5-only ranking", "tfidf_ranking": "xPRT, TF-IDF-only ranking",
          "self_reconstruction_5x": "self-reconstruction, 5x steps (as much text as xPRT)", "revela": "Revela",
          "contriever": "Contriever"}


def arm_setting(out: Path, arm: str) -> str:
    """How an arm ran, as its saved folder states it (the first seed's xprt_config.json): the baselines' setting
    (--baseline_setting) and the vector it pools and scores."""
    folders = sorted(out.glob(f"s*/{arm}/model/xprt_config.json"))
    if not folders:
        return ""
    cfg = json.loads(folders[0].read_text())
    info, heads = cfg, cfg.get("heads", {})
    how = f"{info.get('pooling', 'mean')} pooling, {info.get('similarity_fn_name', 'cosine')}"
    return f"{heads['baseline_setting']}: {how}" if heads.get("baseline_setting") else how


def collect(arms: list, results: list) -> dict:
    """{seed index: {"start" | arm: {"average", "per_category", "per_task", "thirds"}}} from evaluate.py's
    results.json files (models in the order the harness passed them: the start, then the arms)."""
    per_seed, cats, tasks = [], [], []
    for path in results:
        r = read_json(path)
        if len(r["models"]) != len(arms) + 1:
            raise SystemExit(f"{path}: {len(r['models'])} models, expected the start + {len(arms)} arms")
        s = r["summary"]
        cats, tasks = s["categories"], list(s["per_task"][r["models"][0]])
        seed = {}
        for name, m in zip(["start"] + arms, r["models"]):
            thirds = {o["task"]: [t["ndcg_at_10"][m] for t in o["thirds"]] for o in r.get("overlap_analysis", [])}
            seed[name] = {"average": s["average"][m], "per_category": s["per_category"][m],
                          "per_task": s["per_task"][m], "thirds": thirds}
        per_seed.append(seed)
    return {"per_seed": per_seed, "categories": cats, "tasks": tasks}


def stat(values: list) -> tuple:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(values: list, signed: bool = False) -> str:
    m, sd = stat(values)
    text = f"{m:+.2f}" if signed else f"{m:.2f}"
    return text + (f" ± {sd:.2f}" if sd is not None else "")


def values(data: dict, model: str, get) -> list:
    return [get(seed[model]) for seed in data["per_seed"]]


def deltas(data: dict, model: str, base: str, get) -> list:
    return [get(seed[model]) - get(seed[base]) for seed in data["per_seed"]]


def published_main(setting: str, arm: str) -> str:
    if setting == "from_mlm":
        avg, ret = FROM_MLM_SETTING["average"].get(arm), FROM_MLM_SETTING["retrieval"].get(arm)
        return f"{avg[0]:.2f} (retrieval {ret[0]:.2f})" if avg else ""
    if arm == "start":
        return ""
    key = arm if arm in ("xprt", "revela") else "baselines"
    return f"{E5_SETTING['average_delta'][key][0]} (Δ start, 41 tasks)"


def other_code(ledger: dict, here: str) -> dict:
    """{run: its code's git commit (or "no record")} of the ledger's runs made by other code than `here` (the sha256 of
    training.code_revision, what a run's report records): their rows are marked on the page."""
    out = {}
    for run, rec in ledger.get("runs", {}).items():
        code = rec.get("code") or {}
        if code.get("sha256") != here:
            out[run] = (code.get("git") or "a commit not recorded")[:12] if code else "no code record"
    return out


def write(exp: dict, out: Path, arms: list, results: list, seconds: float, as_start: list = ()) -> dict:
    """results.md / results.json from evaluate.py's results.json per seed: `results` with each model scored as it
    is used, `as_start` (stages.stage_score) with every model scored as the start is (--score_as)."""
    data = collect(arms, results)
    setting, cats, n = exp.get("setting", "from_mlm"), data["categories"], len(data["per_seed"])
    objectives = [a for a in arms if a not in stages.ABLATIONS]
    ablations = [a for a in arms if a in stages.ABLATIONS]
    paper = "from BERT, 100K documents, six epochs" if setting == "from_mlm" else "from E5, 41 tasks"
    t = exp["train"]
    lines = [f"# The paper's experiments: {exp['name']}", "",
             f"{exp.get('about', '')}", "",
             f"Config `{exp.get('config_path', 'experiments/paper/configs')}`; every arm: the same start, groups and "
             f"budget ({json.dumps({k: v for k, v in t.items() if k not in ('--report_to', '--logging_steps')})}, "
             f"steps {exp.get('steps_used', exp.get('steps'))}); {n} seed(s); tasks: {', '.join(data['tasks'])} "
             f"(evaluate.py {' '.join(f'{k} {v}' for k, v in exp['eval'].items() if k != '--local_tasks' and v)}"
             f"); wall time {seconds:.0f} s. Scores x100" + ("; mean ± sd over seeds." if n > 1 else "."), "",
             f"## Objectives from the same start (paper Table 1; the paper's column: {paper})", "",
             "| method | setting | average | Δ start | " + " | ".join(cats) + " | paper |",
             "|---|---|---|---|" + "---|" * len(cats) + "---|"]
    for a in ["start"] + objectives:
        d = "" if a == "start" else fmt(deltas(data, a, "start", lambda r: r["average"]), True)
        lines.append(f"| {LABELS.get(a, a)} | {arm_setting(out, a)} | "
                     f"{fmt(values(data, a, lambda r: r['average']))} | {d} | " +
                     " | ".join(fmt(values(data, a, lambda r, c=c: r["per_category"][c])) for c in cats) +
                     f" | {published_main(setting, a)} |")
    notes = {a: why for a, why in exp.get("notes", {}).items() if a in arms}  # what a row's number is, measured
    if notes:
        lines += [""] + [f"- {LABELS.get(a, a)}: {why}" for a, why in notes.items()]
    if as_start:  # the same weights scored the start's way: what training did, with no change of scoring in it
        same = collect(arms, as_start)
        above = {a: sum(1 for seed in same["per_seed"] for tk in same["tasks"]
                        if seed[a]["per_task"][tk] > seed["start"]["per_task"][tk]) for a in objectives + ablations}
        lines += ["", "## Every model scored as the start is (evaluate.py --score_as: its pooling and similarity for "
                  "all), beside the scores above", "",
                  "| method | average as used | Δ start as used | average as the start | Δ start as the start | "
                  "task x seed above the start |", "|---|---|---|---|---|---|"]
        for a in ["start"] + objectives + ablations:
            used, same_way = (fmt(values(d, a, lambda r: r["average"])) for d in (data, same))
            d_used, d_same = ("", "") if a == "start" else (
                fmt(deltas(d, a, "start", lambda r: r["average"]), True) for d in (data, same))
            count = "" if a == "start" else f"{above[a]} of {len(same['tasks']) * len(same['per_seed'])}"
            lines.append(f"| {LABELS.get(a, a)} | {used} | {d_used} | {same_way} | {d_same} | {count} |")
    if "xprt" in arms and ablations:
        lines += ["", "## Ablations (paper Table 3, from BERT): difference to xPRT", "",
                  "| ablation | average Δ xPRT | " + " | ".join(f"{c} Δ xPRT" for c in cats) + " | paper |",
                  "|---|---|" + "---|" * len(cats) + "---|"]
        for a in ablations:
            p = FROM_MLM_SETTING["ablation_delta"].get(a, ("", ""))[0]
            lines.append(f"| {LABELS.get(a, a)} | {fmt(deltas(data, a, 'xprt', lambda r: r['average']), True)} | " +
                         " | ".join(fmt(deltas(data, a, "xprt", lambda r, c=c: r["per_category"][c]), True)
                                    for c in cats) + f" | {p} |")
    if "xprt" in arms:
        lines += ["", "## Where the gains land: xPRT - start (the paper's column: from E5, 100K documents)", "",
                  "| category or task | ours | paper |", "|---|---|---|"]
        for c, (p, _) in E5_SETTING["category_delta"].items():
            ours = fmt(deltas(data, "xprt", "start", lambda r, c=c: r["per_category"][c]), True) \
                if c in cats else "not scored"
            lines.append(f"| {c} | {ours} | {p} |")
        for task, (p, _) in E5_SETTING["task_delta"].items():
            ours = fmt(deltas(data, "xprt", "start", lambda r: r["per_task"][task]), True) \
                if task in data["tasks"] else "not scored"
            lines.append(f"| {task} | {ours} | {p} |")
        ours = sum(1 for seed in data["per_seed"] for tk in data["tasks"]
                   if seed["xprt"]["per_task"][tk] > seed["start"]["per_task"][tk])
        lines.append(f"| tasks above the start | {ours} of {len(data['tasks']) * n} (task x seed) | "
                     f"{E5_SETTING['tasks_above_start'][0]} |")
        thirds = data["per_seed"][0]["xprt"]["thirds"]
        if thirds:
            lines += ["", "## Queries in thirds by word overlap with their relevant documents (paper: ArguAna)", "",
                      "| task | low third | mid third | high third | paper |", "|---|---|---|---|---|"]
            for task in thirds:
                cells = [fmt(deltas(data, "xprt", "start", lambda r, i=i: r["thirds"][task][i]), True)
                         for i in range(3)]
                lines.append(f"| {task}: xPRT - start | " + " | ".join(cells) +
                             f" | {E5_SETTING['overlap_thirds']['xprt'][0]} (BoW-DPR "
                             f"{E5_SETTING['overlap_thirds']['bow_dpr'][0]}) |")
    if isinstance(exp.get("exclude"), dict) and exp["exclude"]:  # the config's arms that do not run, with why
        lines += ["", "## Arms not run at this scale", ""] + [f"- {LABELS.get(a, a)}: {why}"
                                                              for a, why in exp["exclude"].items()]
    others = other_code(read_json(out / "ledger.json") or {}, code_revision()["sha256"])
    if others:  # a returned GPU run made by other code than this tree's: its numbers are that code's
        lines += ["", "**Made by other code than this tree's** (the ledger's code record): " + ", ".join(
            f"{run} ({commit})" for run, commit in sorted(others.items())) + "."]
    if exp.get("missing_runs"):
        lines += ["", f"**Not yet trained** (the ledger's missing runs; `--stage build` plans the next GPU run): "
                  f"{', '.join(exp['missing_runs'])}."]
    lines += ["", "## Does the gain survive fine-tuning?", "",
              f"Paper: {E5_SETTING['fine_tuning'][0]} (\"{E5_SETTING['fine_tuning'][1]}\"). This harness does not "
              "fine-tune; `experiments/finetune_scifact.sh` does, for any model folder "
              "(`XPRT_MODEL=<out>/s<seed>/xprt/model`), with the start model fine-tuned the same way beside it.", ""]
    atomic_write(out / "results.md", "\n".join(lines))
    res = {"experiment": exp["name"], "setting": setting, "arms": arms, "seeds": n, **data,
           "scored_as_start": collect(arms, as_start) if as_start else None,
           "published": {"e5": E5_SETTING, "from_mlm": FROM_MLM_SETTING}}
    atomic_write(out / "results.json", json.dumps(res, indent=1))
    return res
