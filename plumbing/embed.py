"""The repository's one batch embedder: a model's sentence vectors of a list of texts, as select_groups.py (centrality
and the E5 ranking), finetune.py (hard-negative mining) and evaluate.py's scoring during training compute them. It
imports modeling_xprt.py (the pooling) only.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from modeling_xprt import dropout_off, mean_pool


@torch.inference_mode()
def embed_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 64, max_length: int = 512,
                prefix: str = "", show_progress: bool = False, desc: str = "embedding",
                pooling: str = "mean", normalize: bool = True, post_pooling=None) -> torch.Tensor:
    """Sentence vectors of `texts` (mean-pooled, or [CLS] with pooling="cls"; then the model's modules after pooling,
    post_pooling (modeling_xprt.PostPooling: Dense, Normalize, truncate_dim, ...); L2-normalised unless normalize=False,
    as a dot-product model's folder makes them), in input order, as a CPU float32 (N, D) tensor.

    The one batch embedder of the repository: select_groups.py (centrality and the E5 ranking), finetune.py
    (hard-negative mining) and evaluate.py's scoring during training (--eval_tasks) call it. `model` is any
    transformers encoder (AutoModel, or an *ForMaskedLM whose base model is called), used on the device and dtype it
    sits on.
      - the whole list is tokenised once and sorted by *token* count, so each batch pads to within a token or
        two of its own texts (longest first: an out-of-memory error shows up on the first batch);
      - a batch without padding runs with no attention mask, which lets SDPA take its unmasked path;
      - a text that occurs several times is encoded once (STS sets repeat sentences: SICK's 19,854 sentences
        hold about 6,000 distinct ones).
    """
    from tqdm.auto import tqdm

    unique = list(dict.fromkeys(texts))  # first-occurrence order
    if len(unique) < len(texts):
        vecs = embed_texts(model, tokenizer, unique, batch_size, max_length, prefix, show_progress, desc, pooling,
                           normalize, post_pooling)
        where = {t: i for i, t in enumerate(unique)}
        return vecs[[where[t] for t in texts]]
    base = getattr(model, "base_model", model)
    device = next(base.parameters()).device
    n = len(texts)
    dim = post_pooling.dim(base.config.hidden_size) if post_pooling is not None else base.config.hidden_size
    out = torch.empty(n, dim, dtype=torch.float32)
    if n == 0:
        return out
    ids = tokenizer([prefix + t for t in texts], truncation=True, max_length=max_length,
                    add_special_tokens=True, return_attention_mask=False)["input_ids"]
    order = sorted(range(n), key=lambda i: -len(ids[i]))
    pad_id = tokenizer.pad_token_id or 0
    for start in tqdm(range(0, n, batch_size), desc=desc, disable=not show_progress, unit="batch"):
        idx = order[start : start + batch_size]
        lens = [len(ids[i]) for i in idx]
        width = lens[0]
        input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        for row, i in enumerate(idx):
            input_ids[row, : lens[row]] = torch.tensor(ids[i])
        input_ids = input_ids.to(device)
        if pooling == "cls":
            mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).long().to(device)
            vec = base(input_ids=input_ids, attention_mask=mask).last_hidden_state[:, 0].float()
        elif lens[-1] == width:  # no padding in this batch: plain mean, no mask
            vec = base(input_ids=input_ids).last_hidden_state.float().mean(dim=1)
        else:
            mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).long().to(device)
            vec = mean_pool(base(input_ids=input_ids, attention_mask=mask).last_hidden_state.float(), mask)
        if post_pooling is not None:
            with dropout_off(post_pooling):  # as SentenceTransformer.encode runs it: eval mode
                vec = post_pooling(vec).float()
        out[torch.tensor(idx)] = (F.normalize(vec, dim=-1) if normalize else vec).cpu()
    return out
