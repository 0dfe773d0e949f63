"""Maps that stay true: every repository path, `module.name` and `file.py : name` that a comment,
a docstring, a README or a docs/ page names exists, and no section header stands empty.

What counts as a reference (precise, so that a failure is a stale map):
- a path under one of the repository's top folders (`plumbing/batches.py`, `data/eval/scifact`) or
  a bare `name.py` the repository has or had: the file or folder must exist, a glob must match. A
  path with a placeholder (<x>, {a,b}, $X) or one git ignores (a run's output) is not checked. A
  page's path may be relative to the page's folder.
- `module.name[.member]` whose module is a repository module (`modeling_xprt.info_nce`), the last
  part of a package's module (`model_folder.load_mlm_encoder`) or a module the repository had: the
  name must be a top-level definition of that module, the member one of that class's (read from
  the source, nothing imported). A name the module only imports is defined elsewhere: name that.
- `file.py : name` and `file.py:name` (the paper map's form; comma lists inside a code span).
- `section N` in a Python file, or `file.py, section N`: a numbered header `# N. ...` there.
A bare `name.py` the repository never had (nanoGPT's `model.py`) is another project's. A sentence
that dates itself (an issue number, a date, a commit, "before", "former") is history and may name
what the repository had then."""

import ast
import io
import re
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args) -> list:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.split()


FILES = git("ls-files")
PY = [f for f in FILES if f.endswith(".py")]
PRODUCT = [f for f in PY if not f.startswith("tests/")]
PAGES = [f for f in FILES
         if f.endswith(".md") and (Path(f).name == "README.md" or f.startswith("docs/"))]
TOP = sorted({f.split("/")[0] for f in FILES if "/" in f})
MODULES = {f[:-3].replace("/", ".").removesuffix(".__init__"): f for f in PY}
# The file names the repository has or had (its history, where the clone has one): a moved file's
# old name is caught, another project's file (nanoGPT's model.py) passed over.
GONE_FILES = git("log", "--all", "--format=", "--name-only", "--no-renames", "--diff-filter=D")
OURS = {Path(f).name for f in FILES + GONE_FILES}
# Short names: a package module's last part (model_folder.x, as `from plumbing import model_folder`
# reads) where no other module ends so; the stems of modules the repository had (fused_vocab.x).
_last = [m.split(".")[1] for m in MODULES if m.count(".") == 1]
SHORT = {m.split(".")[1]: m for m in MODULES
         if m.count(".") == 1 and _last.count(m.split(".")[1]) == 1}
GONE = {name[:-3] for name in OURS if name.endswith(".py")} - {Path(f).stem for f in PY}
EXTENSIONS = "py|md|sh|yaml|yml|json|jsonl|txt|toml|png|parquet|csv|tsv|log|lock"
HISTORY = re.compile(r"\bissue \d+|\b20\d\d-\d\d-\d\d\b|\bbefore\b|\bformer(ly)?\b"
                     r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(map(re.escape, TOP))})/[\w./*-]*|[\w-]+\.py)"
                  r"(?![\w/-])")
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-]|\.\w)")
SECTION = re.compile(r"(?:`?([\w/]+\.py)`?,? )?\bsections? (\d+[a-z]?(?:(?:, | and )\d+[a-z]?)*)\b")
FILE_NAME = re.compile(r"(?<![\w./-])([\w/]+)\.py ?: ?([A-Za-z_][\w.]*(?:, [A-Za-z_][\w.]*)*)")


@lru_cache(maxsize=None)
def definitions(path: str) -> dict:
    """{name: {class-level names} or None}: a module's top-level definitions (functions, classes,
    assignments; a package's __init__ also maps what it imports) and each class's own members."""
    out = {}
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))

    def names_of(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if isinstance(node, (ast.Import, ast.ImportFrom)) and path.endswith("__init__.py"):
            return [(a.asname or a.name).split(".")[0] for a in node.names]  # a package's map
        if isinstance(node, (ast.If, ast.Try)):  # under `if TYPE_CHECKING:` or `try:`
            return [n for child in ast.iter_child_nodes(node) for n in names_of(child)]
        return []

    for node in tree.body:
        for name in names_of(node):
            members = None
            if isinstance(node, ast.ClassDef):
                members = {n for child in node.body for n in names_of(child)}
                members |= {t.attr for f in node.body if isinstance(f, ast.FunctionDef)
                            for n in ast.walk(f) if isinstance(n, (ast.Assign, ast.AnnAssign))
                            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                            if isinstance(t, ast.Attribute)}  # self.x = ... in a method
            out[name] = members
    return out


def resolves(module: str, names: list) -> bool:
    """Whether module (a repository module's dotted name) defines names[0], and names[1] is a member
    of that class (nothing is checked after a non-class or past the first member)."""
    if not names:
        return True
    if module + "." + names[0] in MODULES:  # a submodule: plumbing.common
        return resolves(module + "." + names[0], names[1:])
    table = definitions(MODULES[module])
    if names[0] not in table:
        return False
    members = table[names[0]]
    return members is None or len(names) == 1 or names[1] in members


def path_exists(token: str, where: str):
    """True / False for a repository path; None for a bare name.py the repository never had."""
    if "/" not in token:
        return token in {Path(f).name for f in FILES} if token in OURS else None
    if re.search(r"\.[A-Za-z_]\w*$", token) and not re.search(rf"\.({EXTENSIONS})$", token):
        return dotted_exists(token.replace("/", "."))  # experiments/paper/stages.name
    for base in (ROOT, (ROOT / where).parent):
        if any(ch in token for ch in "*?[") and list(base.glob(token)):
            return True
        if (base / token).exists():
            return True
    return False


def dotted_exists(token: str):
    """True / False for a reference into a repository module; None for anything else."""
    parts = token.split(".")
    if parts[-1] in EXTENSIONS.split("|"):
        return None  # a file name (train.py), checked as a path
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in MODULES:
            return resolves(head, parts[i:])
    if parts[0] in SHORT:
        return resolves(SHORT[parts[0]], parts[1:])
    return False if parts[0] in GONE else None


def references(text: str, where: str) -> list:
    """[(token, exists)] for every reference a piece of prose makes (the module docstring's rules);
    a stale one in a sentence that dates itself is history, so it counts as existing."""
    found = []
    spans = [m.span() for m in re.finditer(r"`[^`\n]+`", text)]

    def add(token, ok, at):
        if ok is False:  # its sentence: between ". ", "; ", list items, blank lines
            cuts = r"\. |; |\n\s*\n|\n\s*[-|]|\n\s*#\s*$"
            start = max([m.end() for m in re.finditer(cuts, text[:at])], default=0)
            end = re.search(cuts, text[at:])
            ok = bool(HISTORY.search(text[start:at + end.start() if end else len(text)]))
        if ok is not None:
            found.append((token, ok))

    for m in PATH.finditer(text):
        token = m.group(1).rstrip(".")  # a sentence's full stop
        if any(ch in token for ch in "<{$") or text[m.end():m.end() + 1] in "<{$":
            continue
        if "/" not in token and re.match(r"[\w-]*/", text[m.end():]):
            continue
        add(token, path_exists(token, where), m.start())
    for m in DOTTED.finditer(text):
        add(m.group(1), dotted_exists(m.group(1)), m.start())
    for m in FILE_NAME.finditer(text):
        module = m.group(1).replace("/", ".")
        if module not in MODULES:
            continue
        in_code = any(a < m.start() < b for a, b in spans)
        names = m.group(2).split(", ") if in_code else m.group(2).split(", ")[:1]
        for name in (n.rstrip(".") for n in names):
            if in_code or ":" + name in m.group(0) or re.search(r"[_.A-Z]", name):  # not a word
                add(f"{m.group(1)}.py : {name}", resolves(module, name.split(".")), m.start())
    for m in SECTION.finditer(text):
        target = m.group(1) or (where if where.endswith(".py") else None)
        if target and "/" not in target:
            target = next((f for f in PY if f == target or f.endswith("/" + target)), None)
        if target in PY:
            numbers = {h[2] for h in headers(target)}
            for n in re.findall(r"\d+[a-z]?", m.group(2)):
                add(f"{target}, section {n}", n in numbers, m.start())
    return found


def ignored(paths: list) -> set:
    """The paths git ignores: a run's outputs (bench/wheels), named by a page but not kept."""
    asked = "\n".join(p for path in paths for p in (path, path.rstrip("/") + "/"))  # file or folder
    run = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT,
                         input=asked, capture_output=True, text=True)
    return {p.rstrip("/") for p in run.stdout.split()} | set(run.stdout.split())


def prose_of_python(path: str) -> str:
    """A Python file's comments and docstrings, one piece a line (code and strings left out)."""
    source = (ROOT / path).read_text(encoding="utf-8")
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    pieces = [t.string for t in tokens if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                pieces.append(doc)
    return "\n".join(pieces)


def stale(paths: list) -> list:
    out = []
    for path in paths:
        text = (prose_of_python(path) if path.endswith(".py")
                else (ROOT / path).read_text(encoding="utf-8"))
        bad = [token for token, ok in references(text, path) if not ok]
        out += [f"{path}: {token}" for token in set(bad) - ignored(bad)]
    return sorted(out)


def test_every_reference_in_the_code_exists():
    assert len(PRODUCT) > 40 and len(PAGES) > 8, "git ls-files found no repository"
    found = stale(PRODUCT)
    assert not found, (f"{len(found)} comments or docstrings name what the repository lacks:\n"
                       + "\n".join(found))


def test_every_reference_in_the_pages_exists():
    found = stale(PAGES)
    assert not found, (f"{len(found)} README / docs references the repository lacks:\n"
                       + "\n".join(found))


def test_the_reader_finds_each_shape_and_passes_over_other_projects():
    text = ("See plumbing/batches.py, `select_groups.py : centrality, rrf_score`, "
            "modeling_xprt.py:info_nce, common.UserError, plumbing.common.UserError, "
            "modeling_xprt.XPRTModel.encode; modeling_xprt.py, section 4. Not ours: nanoGPT's "
            "model.py, apps/main/train.py, outputs/demo/results.md, torch.nn.functional, "
            "train.jsonl, bench/wheels. Stale: selection_stages.py, plumbing/gone.py, "
            "common.NoSuchError, modeling_xprt.XPRTModel.gone, `train.py : nothing_here`, "
            "modeling_xprt.py, section 40. History: selection_stages.py before issue 53.")
    got = references(text, "README.md")
    history = ["selection_stages.py"] if "selection_stages.py" in OURS else []  # shallow: none
    assert sorted(k for k, ok in got if ok) == sorted([
        "plumbing/batches.py", "select_groups.py", "select_groups.py : centrality",
        "select_groups.py : rrf_score", "modeling_xprt.py", "modeling_xprt.py : info_nce",
        "common.UserError", "plumbing.common.UserError", "modeling_xprt.XPRTModel.encode",
        "modeling_xprt.py", "modeling_xprt.py, section 4", "train.py", "modeling_xprt.py",
        *history])
    stale_ones = [k for k, ok in got if not ok]
    assert sorted(set(stale_ones) - ignored(stale_ones)) == sorted(history + [
        "plumbing/gone.py", "common.NoSuchError", "modeling_xprt.XPRTModel.gone",
        "train.py : nothing_here", "modeling_xprt.py, section 40"])


RULE = re.compile(r"#\s*[-=]{20,}\s*$")
NUMBERED = re.compile(r"#\s*(\d+[a-z]?)\.(\s|$)")


def headers(path: str) -> list:
    """[(first line, last line, number or None)] of a file's section headers: a top-level comment
    framed by rule lines (# ----, # ====), or a top-level numbered comment line (# 2. Samplers)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if RULE.match(lines[i]):
            j = i + 1
            while j < len(lines) and lines[j].startswith("#") and not RULE.match(lines[j]):
                j += 1
            if j < len(lines) and RULE.match(lines[j]) and j > i + 1:
                number = NUMBERED.match(lines[i + 1])
                out.append((i, j, number and number.group(1)))
                i = j + 1
                continue
        elif NUMBERED.match(lines[i]):
            out.append((i, i, NUMBERED.match(lines[i]).group(1)))
        i += 1
    return out


def test_no_section_header_stands_empty():
    """A header followed by blank lines only, up to the next header or the end, heads nothing."""
    empty = []
    for path in PY:
        lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
        found = headers(path)
        for (first, last, _), after in zip(found, [h[0] for h in found[1:]] + [len(lines)]):
            if not any(line.strip() for line in lines[last + 1:after]):
                title = lines[first + 1 if first < last else first].strip()
                empty.append(f"{path}:{first + 1}: {title[:70]}")
    assert not empty, f"{len(empty)} section headers head nothing:\n" + "\n".join(empty)
