"""The repository's shape, kept: the import graph has no circle, the plumbing imports no step script and no arm,
modeling_xprt.py imports one file of the repository (its companion, plumbing/architectures.py, which imports none),
and an xPRT run of train.py imports no baseline, no select_groups and no evaluate, in at most 6,200 lines.

    python tests/test_structure.py      # prints the floors, the arrows up, the circles and the closures
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_SCRIPTS = {"select_groups", "select_groups_datatrove", "train", "finetune", "evaluate"}


def modules() -> dict:
    """{module name: path} of every Python file of the root, plumbing/, baselines/, experiments/ and bench/."""
    out = {}
    for folder in (ROOT, ROOT / "plumbing", ROOT / "baselines", ROOT / "experiments", ROOT / "experiments" / "paper",
                   ROOT / "experiments" / "nano", ROOT / "bench"):
        for p in sorted(folder.glob("*.py")):
            rel = p.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(path: Path, known: dict) -> set:
    """The repository modules `path` imports, at module level or inside a function (lazy imports count: they are
    arrows a run can take), and modules a string table names for importlib (modeling_xprt.PRETRAINING_OBJECTIVES)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def graph() -> dict:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def circles(g: dict) -> list:
    """Every strongly connected set of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def floors(g: dict) -> dict:
    """{module: floor}: 0 for a module importing no repository module, else one more than the highest it imports."""
    memo = {}

    def floor(m, seen=()):
        if m not in memo:
            memo[m] = 1 + max((floor(d, seen + (m,)) for d in g[m] if d not in seen), default=-1)
        return memo[m]

    return {m: floor(m) for m in g}


def test_no_circle():
    assert circles(graph()) == []


def test_the_plumbing_imports_no_step_script_and_no_arm():
    g = graph()
    for m, deps in g.items():
        if m.startswith("plumbing"):
            up = {d for d in deps if d in STEP_SCRIPTS or d.startswith("baselines")}
            assert not up, (m, sorted(up))


def test_modeling_xprt_imports_only_its_companion():
    g = graph()
    assert g["modeling_xprt"] == {"plumbing.architectures"}
    assert g["plumbing.architectures"] == set()


def runtime_closure(tmp: Path, tiny_bert: Path, groups: Path) -> dict:
    """The repository modules a one-step xPRT run of train.py imports, with their lines (a child process, so that
    nothing the test process imported counts)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import train
train.main({["--model_name_or_path", str(tiny_bert), "--groups_dir", str(groups), "--output_dir", str(tmp / "run"),
             "--max_train_steps", "1", "--per_device_train_batch_size", "4", "--max_document_groups_per_batch", "0",
             "--max_length", "32", "--report_to", "none", "--no_save_model"]!r})
known = {json.dumps({m: str(p) for m, p in modules().items()})}
print("CLOSURE " + json.dumps({{m: p for m, p in known.items() if m in sys.modules}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("CLOSURE "))
    return {m: len(Path(p).read_text().splitlines()) for m, p in json.loads(line[len("CLOSURE "):]).items()}


def test_an_xprt_run_imports_no_baseline_and_stays_small(tmp_path, tiny_bert):
    import select_groups
    from test_select_groups import _docs, _write_jsonl

    docs, groups = tmp_path / "docs.jsonl", tmp_path / "groups"
    _write_jsonl(docs, _docs(12))
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir", str(groups),
                        "--centrality_threshold", "-1"])
    closure = runtime_closure(tmp_path, tiny_bert, groups)
    print(f"train.py's run-time closure for xPRT: {len(closure)} files, {sum(closure.values()):,} lines: "
          + ", ".join(f"{m} {n}" for m, n in sorted(closure.items())))
    assert not {m for m in closure if m.startswith("baselines") or m in {"select_groups", "evaluate", "finetune"}}
    # 5,952 after issue 53's move; issue 54's memory refusal and launch check, issue 55's --compile and shapes and
    # issue 55's casts brought it to ~6,130: the budget is raised to 6,200, never silently
    assert sum(closure.values()) <= 6200


if __name__ == "__main__":
    g = graph()
    fl = floors(g)
    lines = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    for f in sorted(set(fl.values()), reverse=True):
        print(f"floor {f}: " + ", ".join(f"{m} ({lines[m]})" for m in sorted(m for m in fl if fl[m] == f)))
    up = [(m, d) for m, deps in g.items() for d in deps if fl[d] >= fl[m]]
    print(f"imports that run back up (or sideways): {up or 'none'}")
    print(f"circles: {circles(g) or 'none'}")

    def closure(m, seen=None):
        seen = set() if seen is None else seen
        if m not in seen:
            seen.add(m)
            for d in g[m]:
                closure(d, seen)
        return seen

    for m in ("modeling_xprt", "train"):
        c = closure(m)
        print(f"static closure of {m}: {len(c)} files, {sum(lines[x] for x in c):,} lines")
