"""Every benchmark in bench/ runs end to end at toy size (--toy) and ends with the line bench/README.md promises,
`ratio: <number>`: a renamed function or attribute breaks this test, not the next person who runs the benchmark.
The toy figures mean nothing; only that the code runs and reports is checked. The list of scripts is read from bench/,
so a new script without --toy fails here. bench.device_check has its own test (tests/test_device_check.py, the same
--toy mechanism), bench.bench_step_ops one below that also checks its counts (OWN_TEST); bench.device_env is a tool,
not a benchmark (TOOLS)."""

import argparse
import importlib
import re
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
# not benchmarks (no figure, no ratio line): device_env builds and enters the GPU machine's package environment
# simulated here, for device_check's command (tests/test_device_env.py runs it)
TOOLS = {"device_env"}
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__" and p.stem not in TOOLS)
# run at toy size by a test of their own, which checks more than the ratio line
OWN_TEST = {"device_check": "tests/test_device_check.py", "bench_step_ops": "tests/test_bench_smoke.py"}
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


def test_every_script_in_bench_is_run_or_excused():
    """TOOLS and OWN_TEST name scripts that exist, and each OWN_TEST file does run its script's main with --toy."""
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__"}
    assert TOOLS <= scripts and set(OWN_TEST) <= scripts, (TOOLS | set(OWN_TEST)) - scripts
    for name, test_file in OWN_TEST.items():
        text = (ROOT / test_file).read_text(encoding="utf-8")
        assert re.search(rf"""{name}\.main\(\[\s*["']--toy["']""", text), f"{test_file} never runs {name} --toy"


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


@pytest.mark.slow  # train.main for every objective under two dispatch modes: about 65 s CPU at toy size
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


def test_vocab_bf16_reads_the_kernel_in_either_layout(capsys):
    """bench.bench_vocab_bf16 --before REV: the kernel from plumbing/architectures.py (HEAD; the toy run above takes
    the default revision's fused_vocab.py), and a revision with neither file named with what was tried."""
    from bench import bench_vocab_bf16

    bench_vocab_bf16.main(["--toy", "--before", "HEAD"])
    assert RATIO.fullmatch(capsys.readouterr().out.strip().splitlines()[-1])
    with pytest.raises(SystemExit, match="plumbing/architectures.py.*fused_vocab.py"):
        bench_vocab_bf16.kernel_at("no-such-revision")
