"""Every benchmark in bench/ runs end to end at toy size (--toy) and ends with the line bench/README.md promises,
`ratio: <number>`: a renamed function or attribute breaks this test, not the next person who runs the benchmark.
The toy figures mean nothing; only that the code runs and reports is checked. bench.device_check has its own test
(tests/test_device_check.py, the same --toy mechanism)."""

import argparse
import importlib
import re
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {"device_env"}  # not benchmarks: the device's environment simulated (tests/test_device_env.py)
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__" and p.stem not in TOOLS)
OWN_TEST = {"device_check": "tests/test_device_check.py", "bench_step_ops": "this file"}
RATIO = re.compile(r"ratio: (-?\d+\.\d+|nan|inf)")


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(main):
    """The argparse parser `main` builds, caught at its first parse call: nothing past the flags runs."""
    def stop(self, *a, **k):
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop):
        try:
            main(["--help"])
        except _Parsed as p:
            return p.parser
    raise AssertionError(f"{main.__module__}.main never parsed its flags")


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_has_a_toy_size(name):
    module = importlib.import_module(f"bench.{name}")
    assert "--toy" in parser_of(module.main)._option_string_actions, f"bench/{name}.py has no --toy"


@pytest.mark.parametrize("name", [b for b in BENCHES if b not in OWN_TEST])
def test_bench_runs_at_toy_size_and_reports_its_ratio(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    module.main(["--toy"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines, f"bench.{name} printed nothing"
    assert RATIO.fullmatch(lines[-1]), f"bench.{name}'s last line is {lines[-1]!r}, not 'ratio: <number>'"


def test_bench_step_times_every_objective_against_its_own_floor(capsys):
    """bench.bench_step --objectives: one line per objective train.py offers (or its refusal), then the ratio."""
    import modeling_xprt
    from bench import bench_step

    bench_step.main(["--toy", "--objectives"])
    out = capsys.readouterr().out
    for objective in modeling_xprt.pretraining_objectives():
        assert re.search(rf"^  {objective} +(floor .* -> \d+\.\d+x|refused: )", out, re.M), objective
    assert RATIO.fullmatch(out.strip().splitlines()[-1])


def test_step_ops_counts_each_host_read_once():
    """bench.bench_step_ops's counter: each read of a device value once (an .item() is not counted again as its
    aten._local_scalar_dense), data-dependent shapes (a boolean index, nonzero), nothing for plain ops or views, and
    nothing for AdamW's host-side step counts."""
    import torch

    from bench.bench_step_ops import StepCounter

    x = torch.arange(6.0)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], lr=0.1)  # one tensor at a time on a CPU: reads its step count with .item()
    counter = StepCounter()
    with counter, counter.ops:
        counter.on = True
        x.sum().item()
        bool(x.any())
        x[x > 2]
        torch.nonzero(x)
        (x * 2).view(2, 3)
        opt.step()
        counter.on = False
        x.sum().item()
    reads, aten, where = counter.take()
    assert reads == 4, where
    assert sorted(k.split(" <- ")[0] for k in where) == ["__bool__", "aten.index", "aten.nonzero", "item"]
    assert aten > 8 and counter.take()[:2] == (0, 0)


def test_step_ops_no_host_sync_and_collation_from_tokens(capsys):
    """bench.bench_step_ops at toy size, train.py's own loop: no steady step of an encoder objective reads a device
    value (the attention masks prepared per call: architectures.mask_for_layers); Revela's language model keeps its
    causal mask's 2 checks. Collation from the tokens train.py hands the loader is cheaper than from the texts."""
    from bench import bench_step_ops

    results = bench_step_ops.main(["--toy"])
    assert RATIO.fullmatch(capsys.readouterr().out.strip().splitlines()[-1])
    syncs = {r["objective"]: r["syncs_steady"] for r in results}
    assert syncs == {o: (2.0 if o == "revela" else 0.0) for o in syncs} and len(syncs) == 7
    assert all(r["collate_ms_per_group"] < r["collate_text_ms_per_group"]
               for r in results if r["objective"] != "revela")
