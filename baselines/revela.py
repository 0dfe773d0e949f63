"""
Revela (the xPRT paper's fifth baseline): a retriever trained only through a language model's in-batch attention.

Written from the authors' code (read, not copied):
  TRUMANCFY/Revela        src/tevatron/llm_retriever/modeling/encoder.py (EncoderModel.forward, calculate_attn,
                          build), collator.py (LLMEnhancedCollator), arguments.py, train.sh (the run's flags)
  TRUMANCFY/transformers  branch adapt, src/transformers/models/qwen2/modeling_qwen2.py (Qwen2SdpaAttention.forward,
                          lines 684-765: the in-batch attention added to each layer) and models/llama/modeling_llama.py
                          (the same change)
Their forked transformers becomes one attention function registered with transformers' AttentionInterface
(revela_attention), and their LoRA is peft's, so any causal LM transformers runs with SDPA (Qwen2, Llama) can be the
language model.

One step, for each group of P passages (the xPRT paper's setting: the group's anchor, its 4 related passages and 11
anchors of other documents of the batch, P = 16; the official run's --train_group_size 16):
  1. the retriever (the model being trained, XPRTModel.encode, pooled as the start model pools) embeds the P passages;
     their cosines, divided by the attention temperature, diagonal excluded, softmaxed over the other passages, are
     the in-batch attention weights A (revela_attention_weights);
  2. the language model (LoRA-adapted) reads every passage alone and keeps each layer's keys and values;
  3. it reads every passage again, and in every layer each token also attends to every OTHER passage's kept keys and
     values, one softmax per passage, and adds their outputs weighted by A (in_batch_attention); its next-token
     cross-entropy over every passage is the loss (revela_loss). The retriever's only gradient is through A.

What the xPRT paper's setting changes (each marked "ours" where it is made):
  - The retriever is the arm's start model (E5 or BERT, pooled as it pools), not an LLM with EOS pooling; its passages
    carry the start model's passage prefix, as every arm's do. The official run's query side (--first_half: the first
    half of each passage with "query: " scored against the whole passages) is not run: every passage is scored against
    every other whole passage (the official code's path without passage_query, encoder.py lines 142-148).
  - The language model's targets are every token but padding, read off the attention mask; the official collator
    sets labels == pad_token_id to -100, the same when the pad token only pads (LLaMA's and Qwen's base tokenizers
    add no EOS to a passage).
  - The loss of a batch of G groups is the token mean over all its groups' passages (the official per-device batch is
    one group, averaged over accumulation steps).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from modeling_xprt import GroupCollator, Layout, Objective, group_bounds, pad_to_multiple, register_objective
from plumbing.common import dropout_rate, non_negative_int, positive_float, positive_int, resolve_model_path

ATTENTION = "revela_sdpa"  # the name the language model's layers look their attention function up by
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # arguments.py default


# ==============================================================================================================
# 1. The equations
# ==============================================================================================================


def revela_attention_weights(vectors: torch.Tensor, attn_temperature: float = 1e-4) -> torch.Tensor:
    """The in-batch attention weights of each group's passages (encoder.py, EncoderModel.forward lines 138-154 and
    calculate_attn lines 99-125):

        A_ij = softmax_j( cos(e_i, e_j) / tau_attn ),   A_ii = 0 (the diagonal set to -inf before the softmax)

    tau_attn = 1e-4 in the official run (train.sh --attn_temperature 0.0001; arguments.py's default is 1.0).
    vectors (G, P, H) the retriever's vectors of each group's P passages -> (G, P, P) fp32, rows summing to 1."""
    with torch.autocast(vectors.device.type, enabled=False):
        v = F.normalize(vectors.float(), dim=-1)
        scores = v @ v.transpose(1, 2) / attn_temperature  # (G, P, P)
    eye = torch.eye(scores.shape[-1], dtype=torch.bool, device=scores.device)
    return scores.masked_fill(eye, float("-inf")).softmax(-1)


def in_batch_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor,
                       weights: torch.Tensor, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """What the fork adds to each layer's attention output before o_proj (modeling_qwen2.py, branch adapt,
    Qwen2SdpaAttention.forward lines 722-765, the path without is_one_hot and with the value norm): every token t of
    passage i attends to the kept (first-pass, rotary-encoded) keys and values of each passage j on its own, with its
    padding masked, and the outputs are added up weighted by A:

        o_ij,t = sum_s softmax_s( q_i,t . k_j,s * scaling + pad_j,s ) v_j,s
        n_ij,t = sum_s softmax_s( ... ) ||v_j,s||                 (the value norm the fork divides by, eps 1e-6)
        out_i,t = sum_j A_ij o_ij,t / (n_ij,t + 1e-6)

    query (G*P, heads, L, d) of the second pass; keys, values (G*P, kv_heads, L, d) of the first (repeated to the
    query heads, as repeat_kv); key_mask (G*P, L) bool, True at real tokens; weights (G, P, P) = A. -> (G*P, heads,
    L, d). One scaled_dot_product_attention over all (i, j) pairs, the norm carried as an extra value channel, so
    the (P x P x heads x L x L) probabilities the fork materialises are never stored (memory-efficient kernels)."""
    n, heads, l, d = query.shape
    g, p = weights.shape[:2]
    rep = heads // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1)  # (G*P, heads, L, d): repeat_kv
    v = values.repeat_interleave(rep, dim=1)
    v = torch.cat([v, v.norm(dim=-1, keepdim=True)], dim=-1)  # (G*P, heads, L, d + 1)
    pairs = (g, p, p, heads, l)
    q = query.view(g, p, 1, heads, l, d).expand(*pairs, d).reshape(-1, heads, l, d)  # (G*P*P, heads, L, d)
    k = k.view(g, 1, p, heads, l, d).expand(*pairs, d).reshape(-1, heads, l, d)
    v = v.view(g, 1, p, heads, l, d + 1).expand(*pairs, d + 1).reshape(-1, heads, l, d + 1)
    mask = key_mask.bool().view(g, 1, p, 1, 1, l).expand(g, p, p, 1, 1, l).reshape(-1, 1, 1, l)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    out = out[..., :d] / (out[..., d:] + 1e-6)  # (G*P*P, heads, L, d)
    out = out.view(g, p, p, heads, l, d)
    return torch.einsum("gij,gijhld->gihld", weights.to(out.dtype), out).reshape(n, heads, l, d)


class RevelaPass:
    """What the two passes of revela_loss hand the attention function, through the model's **kwargs: the first pass
    fills `kv` (layer index -> (keys, values)); the second reads them with `weights` and `key_mask` set."""

    def __init__(self):
        self.kv, self.weights, self.key_mask = {}, None, None


def revela_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     revela: Optional[RevelaPass] = None, **kwargs):
    """The language model's attention under Revela, registered as ATTENTION (transformers.AttentionInterface): the
    model's own causal SDPA attention, plus, in the second pass, in_batch_attention (the fork's `attn_output +
    inbatch_attn_output`, line 765). Without `revela` it is plain SDPA. -> ((B, L, heads, d), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, attn = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       **kwargs)
    if revela is None:
        return out, attn
    if revela.weights is None:  # the first pass: keep this layer's keys and values (rotary applied), with gradient
        revela.kv[module.layer_idx] = (key, value)
        return out, attn
    keys, values = revela.kv[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    extra = in_batch_attention(query, keys, values, revela.key_mask, revela.weights, scale, dropout)
    return out + extra.transpose(1, 2).to(out.dtype), attn


def register_revela_attention():
    """Make ATTENTION a name transformers' models accept as attn_implementation (its masks: SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTENTION, revela_attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def revela_loss(lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, weights: torch.Tensor,
                index: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Revela's loss (encoder.py, EncoderModel.forward lines 156-171): the language model reads every passage alone
    (its keys and values kept, with gradient: the official first pass is not under no_grad), then again with
    in-batch attention weighted by A = `weights`, and predicts every passage's next tokens:

        L = mean over the target tokens (i, t) of -log p_LM(x_i,t+1 | x_i,<=t, the other passages' keys and values, A)

    lm: the causal LM (attn_implementation ATTENTION); input_ids, attention_mask (G*P, L) its tokens of the groups'
    passages; weights (G, P, P); index (T,) flat positions (over G*P*L) whose next token is a target, targets (T,)
    those tokens. The vocabulary projection runs on the T rows only."""
    base, head = lm.base_model, lm.get_output_embeddings()
    passes = RevelaPass()
    base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, revela=passes)
    passes.weights, passes.key_mask = weights, attention_mask.bool()
    hidden = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, revela=passes).last_hidden_state
    logits = head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, index))
    return F.cross_entropy(logits.float(), targets)


# ==============================================================================================================
# 2. The collator: each group's P passages, for the retriever and for the language model
# ==============================================================================================================


def revela_passages(rows: list, num_related: int, extra_anchors: int) -> list:
    """Each group's passages: its anchor, its first num_related related passages, and the anchors of the next
    `extra_anchors` groups of the batch (cyclically) that come from other documents (the xPRT paper's 11). A batch
    with fewer other-document groups than that for some group gives every group as many as the scarcest has, so the
    groups stay the same size. -> G lists of P = 1 + num_related + k texts."""
    g = len(rows)
    others = [[rows[(i + s) % g]["anchor"] for s in range(1, g) if rows[(i + s) % g]["doc_id"] != rows[i]["doc_id"]]
              for i in range(g)]
    k = min([extra_anchors] + [len(o) for o in others])
    return [[r["anchor"], *r["related"][:num_related], *o[:k]] for r, o in zip(rows, others)]


class RevelaCollator(GroupCollator):
    """Rows -> Revela's batch: input_ids / attention_mask (G, P, L) the groups' passages for the retriever (with its
    prefix), lm_input_ids / lm_attention_mask (G, P, L') the same texts in the language model's tokens (no prefix,
    its own specials; truncated to max_length plus them), lm_index / lm_targets the next-token targets (every
    position whose next token is not padding), plus the retention fields. No masking."""

    DEFAULT_RATES = (0.0, 0.0)
    # its passages are read as texts (the language model tokenises them too): train.py tokenises none at load, which
    # would only add columns to read (bench_step_ops: 0.8x the collation without them)
    passage_fields = ()

    def __init__(self, tokenizer, lm_tokenizer=None, extra_anchors: int = 11, **kw):
        super().__init__(tokenizer, **kw)
        self.lm_tokenizer, self.extra_anchors = lm_tokenizer, extra_anchors

    def __call__(self, rows: list) -> dict:
        batch = self.retention_fields(rows)
        groups = revela_passages(rows, self.num_related, self.extra_anchors)
        g, p = len(groups), len(groups[0])
        flat = [t for texts in groups for t in texts]
        enc = self._tokenize(flat)
        batch["input_ids"] = enc["input_ids"].view(g, p, -1)
        batch["attention_mask"] = enc["attention_mask"].view(g, p, -1)
        lt = self.lm_tokenizer
        lm = lt(flat, padding=True, truncation=True, return_tensors="pt",
                max_length=self.max_length + lt.num_special_tokens_to_add(pair=False))
        ids, am = pad_to_multiple(lm["input_ids"], lm["attention_mask"], self.pad_to_multiple_of,
                                  lt.pad_token_id if lt.pad_token_id is not None else 0, lt.padding_side == "left")
        # (G*P, L')
        l = ids.shape[1]
        follows = torch.zeros_like(am, dtype=torch.bool)
        follows[:, :-1] = am[:, 1:].bool()  # position t predicts t + 1, a real token
        index = follows.reshape(-1).nonzero().squeeze(1)
        batch.update(lm_input_ids=ids.view(g, p, l), lm_attention_mask=am.view(g, p, l), lm_index=index,
                     lm_targets=ids.reshape(-1)[index + 1])
        batch["layout"] = Layout(g, {"lm_index": ("lm", p * l), "lm_targets": ("lm", 0)},
                                 {"lm": group_bounds(index, p * l, g)})
        return batch


# ==============================================================================================================
# 3. The objective
# ==============================================================================================================


@register_objective
class Revela(Objective):
    """Revela: loss = revela_loss, the LoRA-adapted language model's next-token cross-entropy with in-batch attention
    weighted by the retriever's similarities (a row term: each group's P passages are the LM's batch).

    The language model (--lm_name_or_path, default Qwen/Qwen2.5-0.5B as the xPRT paper runs Revela) is loaded in fp32,
    its attention set to ATTENTION, and LoRA-adapted by peft (encoder.py build, lines 292-301: r, alpha, dropout and
    target modules from the flags; the official run's r 256, alpha 64 (arguments.py's default), dropout 0.1, every
    linear layer of the blocks). Its frozen weights are kept OUT of the module tree (not saved, not wrapped by DDP;
    prepare moves them to the batch's device, and its train / eval mode follows the objective's); its LoRA matrices
    are the objective's heads (`adapters`): trained, at --head_learning_rate, saved in xprt_heads.safetensors."""

    name = "revela"
    trains_every_head = True  # every LoRA matrix gets a gradient (B starts at zero, A's gradient is then zero)
    # defaults: the official run's (TRUMANCFY/Revela train.sh)
    flags = {"--lm_name_or_path": dict(help="the causal language model the retriever trains through (default "
                                            "Qwen/Qwen2.5-0.5B, as the xPRT paper runs Revela)"),
             "--lora_rank": dict(type=positive_int, help="LoRA rank of the language model (default 256)"),
             "--lora_alpha": dict(type=positive_float, help="LoRA alpha (default 64)"),
             "--lora_dropout": dict(type=dropout_rate, help="LoRA dropout (default 0.1)"),
             "--lora_target_modules": dict(type=lambda text: [n for n in text.split(",") if n], help=(
                 "comma-separated module names LoRA adapts (default every linear layer of the blocks: "
                 "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")),
             "--attn_temperature": dict(type=positive_float, help=(
                 "temperature of the softmax over the retriever's cosines that weights the in-batch attention "
                 "(default 1e-4)")),
             "--extra_anchors": dict(type=non_negative_int, help=(
                 "anchors of other documents added to each group's anchor and related passages (default 11: 16 "
                 "passages per group, as the xPRT paper runs it)"))}

    def __init__(self, encoder, lm_name_or_path: str = "Qwen/Qwen2.5-0.5B", lora_rank: int = 256,
                 lora_alpha: float = 64.0, lora_dropout: float = 0.1, lora_target_modules=LORA_TARGETS,
                 attn_temperature: float = 1e-4, extra_anchors: int = 11, lm: Optional[nn.Module] = None,
                 lm_tokenizer=None):
        """lm, lm_tokenizer: a language model and tokenizer already built, in place of lm_name_or_path's (the
        harness's FLOP estimate builds the model on the meta device)."""
        super().__init__(encoder)
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import LoraLayer
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if attn_temperature <= 0:
            raise ValueError(f"--attn_temperature must be positive, got {attn_temperature}")
        self.lm_name_or_path, self.attn_temperature = lm_name_or_path, attn_temperature
        self.extra_anchors = extra_anchors
        self.lora_rank, self.lora_alpha, self.lora_dropout = lora_rank, lora_alpha, lora_dropout
        self.lora_target_modules = list(lora_target_modules)
        register_revela_attention()
        if lm is None:
            path = resolve_model_path(lm_name_or_path)
            lm = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTENTION, dtype=torch.float32)
            lm_tokenizer = AutoTokenizer.from_pretrained(path)
        self.lm_tokenizer = lm_tokenizer
        if self.lm_tokenizer.pad_token is None:  # LLaMA's; the official build sets pad_token_id 0 on the config
            self.lm_tokenizer.pad_token = self.lm_tokenizer.eos_token
        get_peft_model(lm, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                      target_modules=self.lora_target_modules))  # in place: lm's Linears gain LoRA
        self.adapters = nn.ModuleDict({name.replace(".", "_"): nn.ModuleDict({"A": m.lora_A["default"],
                                                                               "B": m.lora_B["default"]})
                                       for name, m in lm.named_modules() if isinstance(m, LoraLayer)})
        if not self.adapters:
            raise ValueError(f"--lora_target_modules {','.join(self.lora_target_modules)}: no such module in "
                             f"{lm_name_or_path}")
        self.held_modules = (lm,)  # a tuple: nn.Module does not register what it holds

    @property
    def lm(self) -> nn.Module:
        return self.held_modules[0]

    def config(self) -> dict:
        return {"lm_name_or_path": self.lm_name_or_path, "lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha,
                "lora_dropout": self.lora_dropout, "lora_target_modules": self.lora_target_modules,
                "attn_temperature": self.attn_temperature, "extra_anchors": self.extra_anchors}

    def make_collator(self, tokenizer, **kw):
        return RevelaCollator(tokenizer, lm_tokenizer=self.lm_tokenizer, extra_anchors=self.extra_anchors, **kw)

    def prepare(self, model, batch: dict) -> dict:
        """The language model on the batch's device, in the objective's mode (its LoRA dropout)."""
        device = batch["lm_input_ids"].device
        if next(self.lm.parameters()).device != device:
            self.lm.to(device)
        self.lm.train(self.training)
        return batch

    def encode(self, model, batch: dict):
        """-> (None, (G, P, H): the retriever's vectors of each group's passages)."""
        ids, am = batch["input_ids"], batch["attention_mask"]  # (G, P, L)
        g, p, l = ids.shape
        return None, model.encode(ids.view(g * p, l), am.view(g * p, l))[1].view(g, p, -1)

    def row_terms(self, model, batch: dict, states, vec):
        ids, am = batch["lm_input_ids"], batch["lm_attention_mask"]  # (G, P, L')
        g, p, l = ids.shape
        # (G, P, P), on the sentence vectors the start's modules after pooling make, as every similarity term reads
        weights = revela_attention_weights(model.post_pooling(vec), self.attn_temperature)
        return {"revela_loss": batch["layout"].row_share["lm"] * revela_loss(
            self.lm, ids.view(g * p, l), am.view(g * p, l), weights, batch["lm_index"], batch["lm_targets"])}

    def multiply_adds(self, model, batch: dict, layers, head: int) -> tuple:
        """(trained, forward-only) multiply-adds of a batch, for train.py's FLOP count: the retriever on every
        passage (trained); the language model's two passes over every passage, its in-batch attention over the P
        passages of the group and its vocabulary projection at the targets, counted as forward-only twice over (its
        frozen weights take no weight gradient, but the backward runs through them: about 2x the forward)."""
        from plumbing.architectures import layer_multiply_adds

        trained = layers(batch["input_ids"], layer_multiply_adds(model.encoder)[0])
        cfg = self.lm.config
        ids = batch["lm_input_ids"]
        n_layers, per_token, _ = layer_multiply_adds(self.lm)
        g, p, l = ids.shape
        kv = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        causal = 2 * l * kv  # scores and sums over the passage itself
        in_batch = 2 * p * l * kv  # over each of the P passages (the diagonal too: its weight is 0, not its cost)
        lm = n_layers * ids.numel() * (2 * (per_token + causal) + in_batch)  # pass 1, pass 2 (+ in-batch)
        lm += batch["lm_index"].numel() * cfg.hidden_size * cfg.vocab_size
        return trained, 2 * lm
