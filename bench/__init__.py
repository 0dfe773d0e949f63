"""Benchmarks; run each from the repository root as a module, e.g. `python -m bench.bench_step`."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# offline by default: benchmarks never reach a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tiny(path):
    """A tiny random BertModel (hidden 32, 2 layers) with the real MiniLM tokenizer, saved to `path`: cheap to run,
    real tokenisation (bench_select's and bench_memory's memory measurements)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from plumbing.common import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def add_toy_flag(parser, sizes: str):
    """--toy: the same code end to end at toy size, in seconds on a CPU, so that tests/test_bench_smoke.py keeps every
    benchmark running (a renamed function breaks a test, not a user). Its figures mean nothing."""
    parser.add_argument("--toy", action="store_true",
                        help=f"toy size ({sizes}): the whole script in seconds on a CPU, figures meaningless; "
                             "tests/test_bench_smoke.py runs it")


def toy_sized(args, **sizes):
    """With --toy, these sizes replace the flags' values."""
    if args.toy:
        vars(args).update(sizes)
    return args
