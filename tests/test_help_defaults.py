"""Each flag's default said once in --help, over every step script's parser: no flag's help states
two defaults (argparse's "(default: None)" after the help's own "(default 1)"), and every flag whose
default is not None shows it (plumbing.common.HelpFormatter)."""

import argparse
import importlib
import re
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["select_groups", "select_groups_datatrove", "train", "finetune", "evaluate"]


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(script: str) -> argparse.ArgumentParser:
    """The script's own parser, caught at its first parse (nothing else of the script runs)."""
    sys.path.insert(0, str(ROOT))
    try:
        module = importlib.import_module(script)

        def stop(self, *a, **k):
            raise _Parsed(self)

        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop):
            try:
                module.parse_args(["--help"])
            except _Parsed as p:
                return p.parser
    finally:
        sys.path.remove(str(ROOT))
    raise AssertionError(f"{script}.parse_args never parsed")


def shown(value) -> list:
    """The ways --help may write a default: 0.1, 1e-4 (as 0.0001), a list's items; a switch's in
    words ("by default the scores are written")."""
    if isinstance(value, bool):
        return [""]
    if isinstance(value, (list, tuple)):
        return [" ".join(map(str, value)), ",".join(map(str, value)), str(value)]
    out = [str(value)]
    if isinstance(value, float):
        out += [f"{value:g}", f"{value:.0e}".replace("e-0", "e-"), str(int(value))]
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_default_said_once_and_every_default_shown(script):
    parser = parser_of(script)
    formatter = parser._get_formatter()
    twice, unshown = [], []
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        text = " ".join(formatter._expand_help(action).split())
        flag = action.option_strings[-1]
        # a statement of the default: "(default 1)", "(default: 0.05)", "Default: linear for ..."
        if len(re.findall(r"\(default\b|\bdefault:", text, re.I)) > 1 or "default: None" in text:
            twice.append(f"{flag}: {text}")
        said = re.search(r"\bdefault\b", text, re.I)
        if action.default not in (None, argparse.SUPPRESS) and not (
                said and any(v in text for v in shown(action.default))):
            unshown.append(f"{flag} (default {action.default!r}): {text}")
    assert not twice, f"{script}.py --help states a default twice:\n" + "\n".join(twice)
    assert not unshown, f"{script}.py --help hides a default:\n" + "\n".join(unshown)
