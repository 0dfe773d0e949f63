"""The documentation cannot drift from the code: every command the READMEs show (code blocks and inline code) that calls
one of the repository's Python scripts or bench / experiments modules passes only flags that script's parser has, and
only values among a flag's choices; every file such a command runs exists; every `file : function` of the README's
paper map exists; every relative link points at a file. The parsers are caught at their first parse call
(main(["--help"]) with argparse's parse stopped),
so no script runs (a main() without an argv parameter gets sys.argv patched). tests/test_paper_map.py checks that
the paper map's functions run."""

import argparse
import importlib
import importlib.util
import inspect
import re
import shlex
import sys
from functools import lru_cache
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(p for p in ROOT.glob("**/*.md")
              if not any(part.startswith(".") or part in ("outputs", "runs") for part in p.relative_to(ROOT).parts))
SEPARATORS = {";", "&&", "||", "|", "&", ">", ">>", "2>&1", "(", ")"}


def code_of(text: str) -> list:
    """The shell text of a Markdown file: each fenced block's commands (continuation lines joined, comments cut) and
    each inline code span."""
    out = []
    for block in re.findall(r"^```[\w-]*\n(.*?)^```", text, flags=re.S | re.M):
        out += [re.sub(r"(^|\s)#.*$", "", line) for line in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return out + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def is_script(token: str) -> bool:
    """A path of the repository's that runs as a script (it has a __main__ block)."""
    path = ROOT / token
    return token.endswith(".py") and path.is_file() and '__name__ == "__main__"' in path.read_text(encoding="utf-8")


def commands(text: str) -> list:
    """[(target, [(flag, value)])]: target is a script path ('train.py', 'experiments/false_negatives.py') or a module
    ('bench.peers') the command runs, flags the --options it passes to it with the word that follows (None if
    another flag, a separator or nothing follows)."""
    found = []
    for line in code_of(text):
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
            lexer.whitespace_split = True
            tokens = [t.strip("[]") for t in lexer]
        except ValueError:  # an unbalanced quote in prose-like code: not a command
            continue
        target = None
        for i, t in enumerate(tokens):
            if t in SEPARATORS:
                target = None
            elif target is not None:
                if t.startswith("--"):
                    flag, _, value = t.partition("=")
                    after = tokens[i + 1] if i + 1 < len(tokens) else None
                    if not value and after is not None and not after.startswith("-") and after not in SEPARATORS:
                        value = after
                    found[-1][1].append((flag, value or None))
            elif is_script(t) and (i == 0 or not tokens[i - 1].startswith("-")):
                target = t
                found.append((t, []))
            elif i > 0 and tokens[i - 1] == "-m" and t.split(".")[0] in ("bench", "experiments"):
                target = t
                found.append((t, []))
    return found


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


@lru_cache(maxsize=None)
def options_of(target: str) -> dict:
    """{option string: argparse action} of a script's (or module's) parser, caught at its first parse call."""
    name = target[:-3].replace("/", ".") if target.endswith(".py") else target
    module = importlib.import_module(name)

    def stop(self, *a, **k):
        raise _Parsed(self)

    takes_argv = bool(inspect.signature(module.main).parameters)
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop), \
            mock.patch.object(sys, "argv", [target, "--help"]):
        try:
            module.main(["--help"]) if takes_argv else module.main()
        except _Parsed as p:
            return dict(p.parser._option_string_actions)
    raise AssertionError(f"{target}: main() never parsed its flags")


@pytest.fixture(autouse=True, scope="module")
def _importable():
    sys.path.insert(0, str(ROOT))
    yield
    sys.path.remove(str(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_readme_passes_exists(doc):
    found = commands(doc.read_text(encoding="utf-8"))
    if doc.name == "README.md" and doc.parent == ROOT:
        assert len(found) >= 10, f"only {len(found)} commands found in README.md: the reader is broken"
    unknown = []
    for target, flags in found:
        if not flags and target.endswith(".py"):
            continue  # a script named, not called with flags
        if target.endswith(".py") or importlib.util.find_spec(target) is not None:
            options = options_of(target)
            for flag, value in flags:
                action = options.get(flag)
                if action is None:
                    unknown.append(f"{target} {flag}")
                elif action.choices and value and value.isidentifier() and value not in action.choices:
                    unknown.append(f"{target} {flag} {value} (choices: {sorted(action.choices)})")
        else:
            unknown.append(f"python -m {target}: no such module")
    assert not unknown, f"{doc.relative_to(ROOT)}: flags (or choices) the scripts do not have: {sorted(set(unknown))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_readme_runs_or_links_exists(doc):
    text = doc.read_text(encoding="utf-8")
    missing = []
    for line in code_of(text):
        for path in re.findall(r"(?:^|\s)(?:bash|sh|python3?|\S*/python)\s+([\w./-]+\.(?:sh|py))", line):
            if not (ROOT / path).is_file():
                missing.append(path)
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in link and not (doc.parent / link).exists():
            missing.append(link)
    assert not missing, f"{doc.relative_to(ROOT)}: not in the repository: {sorted(set(missing))}"


def test_every_function_of_the_paper_map_exists():
    table = (ROOT / "README.md").read_text(encoding="utf-8").split("## Paper map", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"`([\w/]+)\.py : ([^`]+)`", table)
    assert len(entries) >= 15, f"only {len(entries)} `file : function` entries in the paper map"
    missing = []
    for script, names in entries:
        module = importlib.import_module(script.replace("/", "."))
        for name in (n.strip() for n in names.split(",")):
            obj = module
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{script}.py : {name}")
    assert not missing, f"the paper map names what the code lacks: {missing}"


def test_the_reader_finds_flags_in_the_shapes_the_readmes_use():
    text = """```bash
python train.py --model_name_or_path m \\
    --groups_dir g   # a comment --not_a_flag
accelerate launch --config_file c.yaml finetune.py ... --beir_dir b && python -m bench.peers --toy
```
and inline `python evaluate.py --models A B [--rerun]`, `select_groups.py --ranking e5 / tfidf`."""
    assert commands(text) == [("train.py", [("--model_name_or_path", "m"), ("--groups_dir", "g")]),
                              ("finetune.py", [("--beir_dir", "b")]), ("bench.peers", [("--toy", None)]),
                              ("evaluate.py", [("--models", "A"), ("--rerun", None)]),
                              ("select_groups.py", [("--ranking", "e5")])]
