"""
The baselines of the xPRT paper, as their authors run them: RetroMAE, SimLM and Contriever's random spans.

The paper compares xPRT with established objectives ("Experiments": "the five baselines use their official
implementations"). Each is one class over modeling_xprt.Objective, registered as an --objective of train.py, run under
the same flags, data, steps, batch, schedule and retention term as xPRT; each is written from its authors' code (read,
not copied), one function per equation, with the official numbers:
  RetroMAE  staoxiao/RetroMAE         src/pretrain/{modeling,enhancedDecoder,data,arguments}.py, examples/pretrain
  SimLM     microsoft/unilm           simlm/src/{models/rlm.py, collators/rlm_collator.py, collators/collator_utils.py,
                                      config.py}, simlm/scripts/train_rlm.sh
  Contriever facebookresearch/contriever  src/{data.py, inbatch.py, moco.py, contriever.py, options.py}, README's
                                      training command
  Revela    TRUMANCFY/Revela + TRUMANCFY/transformers (branch adapt): in revela.py, registered at the end of this file
  --objective retromae | simlm | contriever | revela; and, kept from before:
  contrastive_random_span  two random crops of one passage as a positive pair, cosine InfoNCE over in-batch
                           negatives (crops of >= 1 token, no word deletion, the longer crop as the query): Contriever's
                           cropping alone; how it differs from Contriever's code is listed at section 6
  self_reconstruction      the paper's Table 3 ablation: xPRT's own conditioned decoder rebuilds a passage from that
                           passage's own vector (no related passages)

Two settings (--baseline_setting; the one table of what each changes: BASELINE_SETTINGS below):
  official  each baseline as its authors' code runs it: RetroMAE and SimLM condition their decoders on the encoder's
            last-layer [CLS] state and the saved folder pools [CLS] (so evaluate.py scores the vector that was
            trained); Contriever scores dot products of unnormalised mean-pooled vectors / 0.05 against the MoCo
            queue of a momentum encoder (the README's run) and its folder scores by dot product without Normalize;
            SimLM's frozen generator samples in train mode (dropout on).
  paper     the shared setting of the comparison (the default): every arm pooled and scored as the start model is
            (E5: mean pooling, cosine), in-batch negatives, the generator without dropout.
Both settings mask as the official collators do ([UNK] never masked: never_unk). The setting is recorded in the
saved folder (xprt_config.json "heads": baseline_setting; its pooling and similarity in the sentence-transformers
files and xprt_config.json "info").

What the paper's setting changes, for every arm (choices the official code does not make are marked "ours"):
  - The text an arm trains on is the anchor passage of each group (select_groups.py, 128 tokens), as the paper gives
    every method the same groups, steps and batch; the official runs read their own corpora (RetroMAE: Wikipedia +
    BookCorpus at 512 tokens; SimLM: MS MARCO passages at 144; Contriever: 256-token chunks of a token stream that
    runs across documents). Contriever's crops are therefore 10-50% of a passage, not of a 256-token chunk.
  - Every arm pools as the start model does (XPRTModel.encode: mean pooling for E5): RetroMAE and SimLM condition their
    decoders on that vector (fp32 mean, cast to the weights' dtype) in place of the [CLS] state; Contriever's
    "average" pooling is the same mean.
  - Every arm gets the same retention term (XPRTModel's, on the clean anchor and s1: the collators emit its fields).
  - ours: the passage prefix E5 reads ("passage: ") is kept in every input and is never masked, replaced, cropped or
    a prediction target (it is the same in every passage; the official code has no prefix). The masking budget counts
    what the official code counts: [CLS] + the passage + [SEP], not the prefix.
  - SimLM's generator must share the start model's vocabulary (google/electra-base-generator has bert-base-uncased's
    30,522 words, as E5 and MiniLM do); it is checked at start.

Departures from the official code (each named where it is made):
  - RetroMAE: the decoder's per-row attention masks are drawn on the device, in the training step, by the same rule
    (enhanced_decoding_masks), instead of in the data loader with Python lists; the same distribution, other draws.
  - SimLM (paper setting): the frozen generator runs in eval mode (no dropout). In the official code it is a
    registered submodule of the trained model, so the Trainer's model.train() turns its dropout back on after
    `generator.eval()` (rlm.py line 40); the official setting does the same.
  - Contriever: its negatives are --contrastive_mode's (section 5): moco in the official setting, the README's run
    (options.py's default mode: a queue of 65,536 keys, as the README's flags parse (its --moco_queue is no flag of
    options.py; example_scripts pass --queue_size 131072); momentum 0.9995 as example_scripts pass; no gradient
    through the keys), in-batch (src/inbatch.py) in the paper setting, either by the flag in both. In the paper
    setting its scores follow the start model's similarity (ours): cosines for a cosine start (E5, MiniLM: dot
    products put MiniLM's logits in the hundreds and its loss climbed from 0.6 to 7 in 20 demo steps).
    MoCo here: the key encoder is kept in fp32 (a bf16 copy would lose the 0.0005 steps), the queue's first random
    keys come from a generator of the run's seed (moco.py: the global one), and under gradient accumulation each
    micro-batch updates and enqueues (its train.py has no accumulation; Contriever's docstring).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from architectures import (copy_last_layers, decoder_layers, layer_multiply_adds, mask_for_layers,
                           probe_prepared_mask)
from batches import Layout, group_bounds, group_lengths
from common import UserError, momentum, positive_int, rank_and_world, resolve_model_path
from fused_vocab import linear_cross_entropy
from modeling_xprt import (ConditionedDecoder, GroupCollator, Objective, gather_with_grad, info_nce, mlm_loss,
                           register_objective)

SETTINGS = ("paper", "official")
# What --baseline_setting official changes, per objective (the paper setting changes nothing: the start's pooling
# and similarity, the generator in eval mode). ModelInfo fields go to XPRTModel.info (Objective.scoring): training
# pools with them and the saved folder records them.
BASELINE_SETTINGS = {
    # RetroMAE src/pretrain/modeling.py line 40: cls_hiddens = lm_out.hidden_states[-1][:, :1]
    "retromae": {"pooling": "cls"},
    # SimLM simlm/src/models/rlm.py line 76: cls_hidden = encoder_out.hidden_states[-1][:, :1]; line 40:
    # generator.eval(), undone by the Trainer's model.train() (the generator is a registered submodule)
    "simlm": {"pooling": "cls", "generator_train_mode": True},
    # Contriever src/inbatch.py lines 64-73 and src/moco.py forward: encoder(..., normalize=norm_query / norm_doc),
    # both off in the README's run; scores = q . k / temperature; src/contriever.py: "average" pooling (the mean);
    # the README's run: src/options.py's --contrastive_mode moco (momentum encoder, a queue of keys: MoCoState)
    "contriever": {"pooling": "mean", "normalize": False, "similarity_fn_name": "dot", "contrastive_mode": "moco"},
}


# --baseline_setting, a flag of each baseline that has two settings
SETTING_FLAG = {"--baseline_setting": dict(
    choices=SETTINGS, help="'official' runs the baseline as its authors' code does ([CLS] vector for RetroMAE and "
    "SimLM, saved as the folder's pooling; dot products of unnormalised vectors and MoCo's queue for Contriever; "
    "SimLM's generator with dropout), 'paper' pools and scores it as the start model (default; BASELINE_SETTINGS "
    "lists every choice)")}


def setting_of(objective: str, setting: str) -> dict:
    """What `setting` fixes for `objective` (BASELINE_SETTINGS): {} for "paper"."""
    if setting not in SETTINGS:
        raise ValueError(f"--baseline_setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return dict(BASELINE_SETTINGS[objective]) if setting == "official" else {}


def scoring_of(choices: dict) -> dict:
    """The ModelInfo fields among a setting's choices (pooling, normalize, similarity_fn_name)."""
    return {k: v for k, v in choices.items() if k in ("pooling", "normalize", "similarity_fn_name")}


# ==============================================================================================================
# 1. Whole-word masking (RetroMAE and SimLM: the rule of BERT's DataCollatorForWholeWordMask, which both use)
# ==============================================================================================================


def whole_word_mask(word_ids: torch.Tensor, num_tokens: torch.Tensor, rate: float,
                    generator: Optional[torch.Generator] = None, max_predictions: int = 512) -> torch.Tensor:
    """The whole-word mask of RetroMAE and SimLM (transformers' DataCollatorForWholeWordMask._whole_word_mask, copied
    into SimLM's collator_utils.whole_word_mask): the words are taken in a random order, each whole, until

        num_to_predict = min(max_predictions, max(1, round(num_tokens * rate)))        (num_tokens with [CLS], [SEP])

    tokens are masked; a word that would overshoot is skipped and later (shorter) words still fill the budget. So the
    rate is a count, not a Bernoulli draw: exactly round(0.3 n) tokens when the words fit (RetroMAE's and SimLM's
    encoder 0.3, decoder 0.5, tests: test_whole_word_mask_*).

    word_ids (N, L) int64 (-1: not a candidate; GroupCollator._tokenize), num_tokens (N,) -> (N, L) bool. Tensor
    operations on word_ids' device; the one Python loop runs over the L word slots, each step over all N rows at once
    (the greedy skip makes each word's fate depend on the words before it)."""
    n, l = word_ids.shape
    device = word_ids.device
    valid = word_ids >= 0
    word = word_ids.clamp(min=0)  # (N, L); word ids are below L (one word per token at most)
    length = torch.zeros(n, l, dtype=torch.long, device=device).scatter_add_(1, word, valid.long())  # tokens per word
    # random.shuffle of the candidate words: a uniform random order; missing words sort last
    keys = torch.rand(n, l, generator=generator, device=device).masked_fill(length == 0, 2.0)
    order = keys.argsort(dim=1)  # (N, W) word slots in shuffled order
    sorted_len = length.gather(1, order)
    budget = (num_tokens.to(device, torch.float64) * rate).round().long().clamp(min=1, max=max_predictions)
    total = torch.zeros(n, dtype=torch.long, device=device)
    taken = torch.zeros(n, l, dtype=torch.bool, device=device)
    for k in range(l if n else 0):  # L word slots at most; a fixed count: no host sync on a GPU
        fits = (sorted_len[:, k] > 0) & (total + sorted_len[:, k] <= budget)
        taken[:, k] = fits
        total += sorted_len[:, k] * fits
    word_taken = torch.zeros_like(taken).scatter_(1, order, taken)  # back from shuffled order to word ids
    return word_taken.gather(1, word) & valid


def never_unk(masked: torch.Tensor, ids: torch.Tensor, unk_token_id: Optional[int]) -> torch.Tensor:
    """[UNK] is never masked: the official collators draw whole words first (an [UNK] may be drawn and spend its
    budget) and then zero the mask at every special token, [UNK] included (transformers' torch_mask_tokens, copied in
    SimLM's collator_utils.py lines 78-81: get_special_tokens_mask(already_has_special_tokens=True) marks every id in
    all_special_ids). masked, ids (N, L) -> masked without the [UNK] positions."""
    return masked if unk_token_id is None else masked & (ids != unk_token_id)


def bert_corruption(ids: torch.Tensor, masked: torch.Tensor, mask_token_id: int, vocab_size: int,
                    generator: Optional[torch.Generator] = None, all_mask_token: bool = False) -> torch.Tensor:
    """What the encoder reads at the masked positions: BERT's 80% [MASK] / 10% a random token / 10% unchanged
    (transformers' torch_mask_tokens: RetroMAE's encoder), or [MASK] everywhere (all_mask_token: SimLM's
    --all_use_mask_token True in scripts/train_rlm.sh)."""
    if all_mask_token:
        return ids.masked_fill(masked, mask_token_id)
    u = torch.rand(ids.shape, generator=generator)
    out = ids.masked_fill(masked & (u < 0.8), mask_token_id)
    rnd = masked & (u >= 0.8) & (u < 0.9)
    return torch.where(rnd, torch.randint(vocab_size, ids.shape, generator=generator), out)


# ==============================================================================================================
# 2. The collators: the anchors of the groups -> tensors, plus the retention fields every objective gets
# ==============================================================================================================


class AnchorCollator(GroupCollator):
    """What the three baselines' collators share: the anchor of each group (the text every arm trains on), tokenised
    as every collator does (GroupCollator: the passage prefix, max_length counting the passage's own tokens), its
    masking candidates as words (word_ids: the prefix, [CLS], [SEP] and padding are none), the retention fields, and
    a sampler that sorts the groups by their anchors' lengths (the only text these arms read)."""

    needs_words = True

    def __init__(self, tokenizer, **kw):
        super().__init__(tokenizer, **kw)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("the baselines' whole-word masking needs a fast tokenizer (BatchEncoding.word_ids)")

    def sort_lengths(self, groups, seed: int):
        return group_lengths(groups, 0), None  # the anchor's characters only

    def anchors(self, rows: list) -> dict:
        """-> the retention fields, and input_ids, attention_mask (G, L) the clean anchors, word_ids (G, L),
        num_tokens (G,) the tokens the official masking budget counts ([CLS] + passage + [SEP]), targets (G, L) the
        original token at every maskable position (-100 elsewhere)."""
        batch = self.retention_fields(rows)
        enc = self._tokenize([self.passage(r, "anchor") for r in rows])
        word_ids, am = enc["word_ids"], enc["attention_mask"]
        batch.update(input_ids=enc["input_ids"], attention_mask=am, word_ids=word_ids,
                     num_tokens=am.sum(1) - len(self.prefix_ids),
                     targets=enc["input_ids"].masked_fill(word_ids < 0, -100))
        return batch

    @staticmethod
    def token_rows(batch: dict, **targets) -> Layout:
        """The flat index of each named target tensor's positions (<name>_index over the flat G * L token states, and
        <name>_targets), added to `batch`, and the Layout that cuts them into chunks of groups: index tensors built
        here on the CPU, so that the step gathers rows without a host sync."""
        g, l = batch["input_ids"].shape
        flat, bounds = {}, {}
        for name, t in targets.items():
            index = (t.reshape(-1) >= 0).nonzero().squeeze(1)
            batch[f"{name}_index"], batch[f"{name}_targets"] = index, t.reshape(-1)[index]
            flat.update({f"{name}_index": (name, l), f"{name}_targets": (name, 0)})
            bounds[name] = group_bounds(index, l, g)
        return Layout(g, flat, bounds)


# ==============================================================================================================
# 3. RetroMAE (Xiao et al. 2022): encoder MLM at 30%, one-layer decoder with enhanced decoding at 50%
# ==============================================================================================================


def enhanced_decoding_masks(word_ids: torch.Tensor, num_tokens: torch.Tensor, attention_mask: torch.Tensor,
                            rate: float = 0.5, pool: int = 256) -> torch.Tensor:
    """Which positions each row of RetroMAE's decoder may attend to: (G, L, L) bool, visible[g, i, j].

    The official collator (RetroMAECollator) draws, per passage, min(n, 256) whole-word masks at the decoder rate
    (whole_word_mask, 0.5), gives each row i one of them at random (with replacement), masks position i itself in it,
    and the row sees what is left:

        visible[i, j] = not sample_{r(i)}[j]  and  j != i  and  j is not padding,   r(i) ~ U{0 .. min(n, 256) - 1}

    so a row never sees its own token (the issue's "plus position i itself" is the reverse of the code: i is added to
    the MASK), and [CLS] (where the sentence vector sits) and [SEP] are visible to every other row (never
    candidates). Drawn here on the device with tensor operations, from the global random state (the training step's
    prepare), instead of in the data loader with Python lists."""
    g, l = word_ids.shape
    device = word_ids.device
    p = min(l, pool)
    samples = whole_word_mask(word_ids.repeat_interleave(p, 0), num_tokens.repeat_interleave(p, 0), rate)
    samples = samples.view(g, p, l)  # (G, P, L) the passage's pool of masks
    size = num_tokens.to(device).clamp(min=1, max=pool)  # min(n, 256) with n counting [CLS] and [SEP]
    pick = (torch.rand(g, l, device=device) * size.unsqueeze(1)).long()  # (G, L): each row's mask in the pool
    masked = samples.gather(1, pick.unsqueeze(-1).expand(g, l, l))  # (G, L, L): row i's sample
    masked = masked | torch.eye(l, dtype=torch.bool, device=device)
    return ~masked & attention_mask.to(device).bool().unsqueeze(1)


def enhanced_decoding(layer: nn.Module, query: torch.Tensor, content: torch.Tensor, visible: torch.Tensor
                      ) -> torch.Tensor:
    """RetroMAE's enhanced decoding: one Transformer layer whose queries and keys/values are two streams.

        q_i = v + p_i                      (the sentence vector plus position i's embedding)
        k_j = v_j = [v, e(x_1), ..., e(x_{L-1})]_j   (the vector in place of [CLS], then the unmasked passage's
                                            embeddings: word + position + type, LayerNorm)
        a_i = softmax_j( (q_i W_Q)(k_j W_K)^T / sqrt(d) + M_ij ) (v_j W_V),  M_ij = 0 if visible[i, j] else min
        h_i = FFN(LN(q_i + a_i W_O))       (the residual runs through the query stream, enhancedDecoder.py)

    layer: a fresh layer of the encoder's own class (BERT naming: attention.self.{query,key,value}, attention.output,
    intermediate, output). query, content (G, L, H), visible (G, L, L) bool -> (G, L, H). A row with nothing visible
    (padding) attends uniformly, as the official additive mask with finfo.min does; its output is never a target."""
    sa = layer.attention.self
    g, l, h = query.shape
    heads = sa.num_attention_heads
    d = h // heads

    def split(x):
        return x.view(g, l, heads, d).transpose(1, 2)  # (G, heads, L, d)

    q, k, v = split(sa.query(query)), split(sa.key(content)), split(sa.value(content))
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, torch.finfo(q.dtype).min)
    dropout = sa.dropout.p if layer.training else 0.0
    att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(1), dropout_p=dropout)
    att = layer.attention.output(att.transpose(1, 2).reshape(g, l, h), query)
    return layer.output(layer.intermediate(att), att)


def retromae_decoder_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """RetroMAE's reconstruction term: the enhanced decoder predicts EVERY token of the passage ([CLS] and [SEP]
    excepted, data.py's decoder_labels) through the encoder's MLM head,

        L_dec = mean over the batch's tokens i of -log softmax(head(h_i))[x_i]

    and RetroMAE's loss is L_dec + L_MLM (weights 1 and 1, modeling.py). hidden (M, H) at the batch's tokens."""
    return linear_cross_entropy(model.transform(hidden), model.vocab_weight, model.vocab_bias, targets,
                                fused=model.fused_vocab_loss)


class RetroMAECollator(AnchorCollator):
    """Rows -> RetroMAE's batch: input_ids the anchor whole-word-masked at 30% with BERT's 80/10/10 (the encoder's
    input; data.py: DataCollatorForWholeWordMask + torch_mask_tokens), mlm_* its targets, clean_ids the clean anchor
    (the decoder's content stream), dec_* the decoder's targets (every token but [CLS] and [SEP]), word_ids /
    num_tokens / decoder_mask_rate from which the step draws the decoder's masks (enhanced_decoding_masks)."""

    DEFAULT_RATES = (0.30, 0.50)  # arguments.py's encoder_mlm_probability / decoder_mlm_probability

    def __call__(self, rows: list) -> dict:
        batch = self.anchors(rows)
        ids = batch["input_ids"]
        masked = whole_word_mask(batch["word_ids"], batch["num_tokens"], self.encoder_mask_rate, self.generator)
        masked = never_unk(masked, ids, self.tokenizer.unk_token_id)
        batch["clean_ids"] = ids
        batch["input_ids"] = bert_corruption(ids, masked, self.tokenizer.mask_token_id, len(self.tokenizer),
                                             self.generator)
        batch["decoder_mask_rate"] = self.decoder_mask_rate
        batch["layout"] = self.token_rows(batch, mlm=ids.masked_fill(~masked, -100), dec=batch.pop("targets"))
        return batch


@register_objective
class RetroMAE(Objective):
    """RetroMAE: loss = L_dec (enhanced decoding, 50%) + L_MLM (encoder, 30%), weights 1 and 1. Owns its one fresh
    decoder layer, of the encoder's own layer class, with the encoder's initialisation (modeling.py's
    c_head.apply(lm._init_weights)); the embeddings and the MLM head are the encoder's."""

    name = "retromae"
    trains_every_head = True  # the decoder layer and the MLM head (both terms)
    flags = SETTING_FLAG

    def __init__(self, encoder, baseline_setting: str = "paper"):
        super().__init__(encoder)
        self.baseline_setting, self.choices = baseline_setting, setting_of(self.name, baseline_setting)
        # enhanced decoding splits a layer's attention into its query and key / value streams (BERT's layer layout,
        # as RetroMAE's enhancedDecoder.py) and adds absolute position embeddings to the query stream: an encoder
        # without either is refused here, before any data is read
        base = encoder.base_model
        layer = decoder_layers(encoder, 1)[0]  # a fresh layer of the encoder's own kind, the encoder's init
        lacks = [what for what, ok in (
            ("a BERT-style attention (attention.self.query / key / value, attention.output)",
             hasattr(getattr(getattr(layer, "attention", None), "self", None), "query")),
            ("absolute position embeddings of the hidden size (embeddings.position_embeddings)",
             getattr(getattr(getattr(base, "embeddings", None), "position_embeddings", None), "embedding_dim", None)
             == encoder.config.hidden_size)) if not ok]
        if lacks:
            raise ValueError(f"--objective retromae: {type(base).__name__} lacks {' and '.join(lacks)}, which "
                             "RetroMAE's enhanced decoding needs")
        self.decoder = layer

    def config(self) -> dict:
        return {"baseline_setting": self.baseline_setting}

    def scoring(self) -> dict:
        return scoring_of(self.choices)

    def make_collator(self, tokenizer, **kw):
        return RetroMAECollator(tokenizer, **kw)

    def prepare(self, model, batch: dict) -> dict:
        """The decoder's per-row masks, drawn on the batch's device (no gradient): visible (G, L, L)."""
        with torch.no_grad():
            visible = enhanced_decoding_masks(batch["word_ids"], batch["num_tokens"], batch["attention_mask"],
                                              batch["decoder_mask_rate"])
        return {**batch, "visible": visible}

    def encode(self, model, batch: dict):
        """-> ((token states (G, L, H), pooled vectors (G, H)) of the 30%-masked anchor, (G, 0, H): no batch term)."""
        hidden, vec = model.encode(batch["input_ids"], batch["attention_mask"])
        return (hidden, vec), vec.new_zeros(vec.shape[0], 0, vec.shape[1])

    def multiply_adds(self, model, batch: dict, layers, head: int) -> tuple:
        """(trained, forward-only) multiply-adds of a batch, for train.py's FLOP count: the encoder on the masked
        anchor, the one decoder layer on every position, the MLM head at both terms' rows."""
        trained = layers(batch["input_ids"], layer_multiply_adds(model.encoder)[0]) + layers(batch["clean_ids"], 1)
        return trained + head * (batch["mlm_index"].numel() + batch["dec_index"].numel()), 0

    def row_terms(self, model, batch: dict, states, vec):
        hidden, sent = states
        emb = model.base.embeddings
        l = batch["clean_ids"].shape[1]
        v = sent.to(hidden.dtype).unsqueeze(1)  # (G, 1, H): the [CLS] state (official) or the start's pooled vector
        content = torch.cat([v, model.embed(batch["clean_ids"])[:, 1:]], dim=1)  # (G, L, H)
        query = emb.position_embeddings(emb.position_ids[:, :l]) + v  # (G, L, H)
        dec = enhanced_decoding(self.decoder, query, content, batch["visible"])
        share, h = batch["layout"].row_share, hidden.shape[-1]
        return {"mlm_loss": share["mlm"] * mlm_loss(model, hidden.reshape(-1, h).index_select(0, batch["mlm_index"]),
                                                    batch["mlm_targets"]),
                "decoder_loss": share["dec"] * retromae_decoder_loss(
                    model, dec.reshape(-1, h).index_select(0, batch["dec_index"]), batch["dec_targets"])}


# ==============================================================================================================
# 4. SimLM (Wang et al. 2023): replaced language modelling, a frozen ELECTRA generator, a 2-layer decoder
# ==============================================================================================================


def simlm_masks(word_ids: torch.Tensor, num_tokens: torch.Tensor, encoder_rate: float = 0.3,
                decoder_rate: float = 0.5, generator: Optional[torch.Generator] = None):
    """SimLM's two masks (rlm_collator.py): the encoder's, whole words at 30%; the decoder's, the encoder's plus an
    independent whole-word mask at the rate that brings the union to 50%:

        encoder_rate + (1 - encoder_rate) x = decoder_rate   =>   x = (0.5 - 0.3) / (1 - 0.3) = 0.2857

    -> (encoder mask, decoder mask), each (G, L) bool. With x <= 1e-4 the decoder's mask is the encoder's."""
    enc = whole_word_mask(word_ids, num_tokens, encoder_rate, generator)
    extra = (decoder_rate - encoder_rate) / (1 - encoder_rate)
    dec = enc | whole_word_mask(word_ids, num_tokens, extra, generator) if extra > 1e-4 else enc
    return enc, dec


def replace_tokens(generator: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   masked: torch.Tensor, max_logits: int = 2 ** 27) -> torch.Tensor:
    """SimLM's replacement (rlm.py _replace_tokens): the frozen generator reads the masked text, and at each masked
    position a token is SAMPLED from its distribution (Categorical(logits), temperature 1; it may be the original);
    other positions keep their token:  x~_i = sample(softmax(G(x_masked))_i) if i masked else x_masked_i.
    No gradient. Rows go through the generator in chunks of at most max_logits (rows x L x V) logits."""
    g, l = input_ids.shape
    rows = max(1, max_logits // max(1, l * generator.config.vocab_size))
    out = input_ids.clone()
    with torch.no_grad():
        for a in range(0, g, rows):
            mask = mask_for_layers(generator.base_model, attention_mask[a:a + rows])
            logits = generator(input_ids=input_ids[a:a + rows], attention_mask=mask).logits
            # validate_args=False: the check that the logits are finite reads a device value (a host sync each
            # call; bench/bench_step_ops.py); it draws nothing, so the samples are the same
            sampled = torch.distributions.Categorical(logits=logits.float(), validate_args=False).sample()
            out[a:a + rows] = torch.where(masked[a:a + rows], sampled, input_ids[a:a + rows])
    return out


def simlm_replaced_lm_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """SimLM's replaced language modelling: the encoder (on its 30%-replaced text) and the decoder (on its 50%-replaced
    text, after the sentence vector) each predict the ORIGINAL token at every position, replaced or not, through the
    shared MLM head (every special token excepted, rlm_collator.py's labels):

        L_enc = mean_i -log softmax(head(h^enc_i))[x_i],   L_dec = mean_i -log softmax(head(h^dec_i))[x_i]
        L = L_dec + L_enc        (rlm.py; its generator MLM term has weight 0.2 but is 0: the generator is frozen)

    One call per term (L_enc: the encoder's states, L_dec: the decoder's), hidden (M, H) at the batch's tokens."""
    return linear_cross_entropy(model.transform(hidden), model.vocab_weight, model.vocab_bias, targets,
                                fused=model.fused_vocab_loss)


class SimLMCollator(AnchorCollator):
    """Rows -> SimLM's batch: enc_input_ids / dec_input_ids (G, L) the anchor masked by simlm_masks (every masked
    token [MASK]: train_rlm.sh's --all_use_mask_token True; False: BERT's 80/10/10, config.py's default),
    enc_masked / dec_masked (G, L) the positions the generator fills (prepare), tok_* the targets: the original token
    at every non-special position."""

    DEFAULT_RATES = (0.30, 0.50)  # config.py's rlm_encoder_mask_prob / rlm_decoder_mask_prob

    def __init__(self, tokenizer, all_mask_token: bool = True, **kw):
        super().__init__(tokenizer, **kw)
        self.all_mask_token = all_mask_token

    def __call__(self, rows: list) -> dict:
        batch = self.anchors(rows)
        ids = batch["input_ids"]
        enc, dec = simlm_masks(batch["word_ids"], batch["num_tokens"], self.encoder_mask_rate,
                               self.decoder_mask_rate, self.generator)
        tok = self.tokenizer
        enc, dec = never_unk(enc, ids, tok.unk_token_id), never_unk(dec, ids, tok.unk_token_id)
        corrupt = [bert_corruption(ids, m, tok.mask_token_id, len(tok), self.generator, self.all_mask_token)
                   for m in (enc, dec)]
        # every special token is no target, [UNK] included (rlm_collator.py: labels[labels == special_id] = -100)
        targets = batch.pop("targets").masked_fill(torch.isin(ids, torch.tensor(tok.all_special_ids)), -100)
        batch.update(enc_input_ids=corrupt[0], dec_input_ids=corrupt[1], enc_masked=enc, dec_masked=dec)
        batch["layout"] = self.token_rows(batch, tok=targets)
        return batch


@register_objective
class SimLM(Objective):
    """SimLM: loss = L_dec + L_enc (simlm_replaced_lm_loss). Owns its decoder, a copy of the encoder's last two layers
    taken at the start (rlm.py: copy.deepcopy(encoder.layer[-2:])), reading the sentence vector followed by the
    encoder's embeddings of the decoder's replaced text. The frozen generator (--generator_name_or_path, official
    default google/electra-base-generator) is kept OUT of the module tree: not trained, not saved, not in the
    optimiser, not wrapped by DDP; prepare moves it to the batch's device."""

    name = "simlm"
    trains_every_head = True  # the decoder and the MLM head (both terms)
    flags = {**SETTING_FLAG, "--generator_name_or_path": dict(
        help="the frozen generator that samples the replaced tokens (default: SimLM's, google/electra-base-generator); "
             "it must share the start model's vocabulary")}

    def __init__(self, encoder, generator_name_or_path: str = "google/electra-base-generator",
                 decoder_layers: int = 2, baseline_setting: str = "paper"):
        super().__init__(encoder)
        from transformers import AutoModelForMaskedLM

        self.baseline_setting, self.choices = baseline_setting, setting_of(self.name, baseline_setting)
        self.generator_name_or_path, self.decoder_layers = generator_name_or_path, decoder_layers
        self.decoder = copy_last_layers(encoder, decoder_layers)
        self.encoder_config = encoder.config
        gen = AutoModelForMaskedLM.from_pretrained(resolve_model_path(generator_name_or_path))
        if gen.config.vocab_size != encoder.config.vocab_size:
            raise ValueError(f"generator {generator_name_or_path} has {gen.config.vocab_size} words, the encoder "
                             f"{encoder.config.vocab_size}: SimLM's generator must share the encoder's vocabulary")
        # frozen; its mode follows the objective's in the official setting (the Trainer's model.train() reaches it),
        # eval mode (no dropout) in the paper's (prepare)
        gen.eval().requires_grad_(False)
        probe_prepared_mask(gen)  # its masks made per call: no host sync (architectures.mask_for_layers)
        self._generator = (gen,)  # a tuple: nn.Module does not register what it holds

    @property
    def generator(self) -> nn.Module:
        return self._generator[0]

    def config(self) -> dict:
        return {"generator_name_or_path": self.generator_name_or_path, "decoder_layers": self.decoder_layers,
                "baseline_setting": self.baseline_setting}

    def scoring(self) -> dict:
        return scoring_of(self.choices)

    def make_collator(self, tokenizer, **kw):
        return SimLMCollator(tokenizer, **kw)

    def prepare(self, model, batch: dict) -> dict:
        """The generator's replacements, for the encoder's and the decoder's text (no gradient)."""
        gen = self.generator
        ids = batch["enc_input_ids"]
        if next(gen.parameters()).device != ids.device:
            gen.to(ids.device)
        gen.train(self.training and self.choices.get("generator_train_mode", False))
        am = batch["attention_mask"]
        return {**batch, "enc_input_ids": replace_tokens(gen, ids, am, batch["enc_masked"]),
                "dec_input_ids": replace_tokens(gen, batch["dec_input_ids"], am, batch["dec_masked"])}

    def multiply_adds(self, model, batch: dict, layers, head: int) -> tuple:
        """(trained, forward-only) multiply-adds of a batch, for train.py's FLOP count: the encoder and the decoder on
        their replaced texts, the MLM head at every target for both; the generator's two passes forward only."""
        ids = batch["enc_input_ids"]
        trained = layers(ids, layer_multiply_adds(model.encoder)[0]) + layers(batch["dec_input_ids"],
                                                                              self.decoder_layers)
        gc = self.generator.config
        hg, length = gc.hidden_size, ids.shape[-1]
        per_token = gc.num_hidden_layers * (4 * hg * hg + 2 * hg * gc.intermediate_size + 2 * length * hg)
        per_token += hg * getattr(gc, "embedding_size", hg) + getattr(gc, "embedding_size", hg) * gc.vocab_size
        return trained + 2 * head * batch["tok_index"].numel(), 2 * ids.numel() * per_token

    def encode(self, model, batch: dict):
        """-> ((token states (G, L, H), pooled vectors (G, H)) of the replaced anchor, (G, 0, H): no batch term)."""
        hidden, vec = model.encode(batch["enc_input_ids"], batch["attention_mask"])
        return (hidden, vec), vec.new_zeros(vec.shape[0], 0, vec.shape[1])

    def row_terms(self, model, batch: dict, states, vec):
        hidden, sent = states
        am = batch["attention_mask"]
        emb = model.embed(batch["dec_input_ids"])  # (G, L, H)
        x = torch.cat([sent.to(emb.dtype).unsqueeze(1), emb[:, 1:]], dim=1)  # the vector in place of [CLS]
        x = model.run_layers(self.decoder, x, am)  # the copied layers, run as the encoder runs its own
        index, targets, h = batch["tok_index"], batch["tok_targets"], x.shape[-1]
        share = batch["layout"].row_share["tok"]
        return {"encoder_rlm_loss": share * simlm_replaced_lm_loss(model, hidden.reshape(-1, h).index_select(0, index),
                                                                   targets),
                "decoder_rlm_loss": share * simlm_replaced_lm_loss(model, x.reshape(-1, h).index_select(0, index),
                                                                   targets)}


# ==============================================================================================================
# 5. Contriever's random spans (Izacard et al. 2022): two independent crops, word deletion, InfoNCE, tau 0.05
# ==============================================================================================================


def random_crop(n: int, ratio: tuple, generator: torch.Generator) -> tuple:
    """Contriever's randomcrop (src/data.py): length = int(n * r), r ~ U[0.1, 0.5] (floor; 0 for a short text),
    start ~ U{0 .. n - length}. -> (start, length)."""
    lo, hi = ratio
    r = lo + (hi - lo) * torch.rand((), generator=generator).item()
    length = int(n * r)
    return int(torch.randint(0, n - length + 1, (), generator=generator)), length


def delete_words(tokens: list, p: float, generator: torch.Generator) -> list:
    """Contriever's "delete" augmentation (src/data.py deleteword), its README's run: each token of a crop is dropped
    independently with probability p = 0.1."""
    keep = torch.rand(len(tokens), generator=generator) > p
    return [t for t, k in zip(tokens, keep.tolist()) if k]


def contriever_loss(q: torch.Tensor, k: torch.Tensor, tau: float = 0.05, normalize: bool = False) -> torch.Tensor:
    """Contriever's in-batch InfoNCE (src/inbatch.py), one direction, the first crop q picking its own second crop k
    among the second crops of the whole batch (gathered across processes):

        L = -mean_i log softmax_j( s(q_i, k_j) / tau )[i],   s = dot product, tau = 0.05

    s is the plain dot product of the mean-pooled vectors (--norm_query / --norm_doc off, the README's run); normalize
    makes it the cosine. q, k (N, H) local rows."""
    with torch.autocast(q.device.type, enabled=False):  # fp32 logits, as modeling_xprt.cosines
        q, all_k = q.float(), gather_with_grad(k).float()
        if normalize:
            q, all_k = F.normalize(q, dim=-1), F.normalize(all_k, dim=-1)
        scores = q @ all_k.t() / tau
    labels = torch.arange(q.shape[0], device=q.device) + rank_and_world()[0] * q.shape[0]
    return F.cross_entropy(scores, labels)


class CropsBeforeBatching:
    """What the collators of two random crops of each anchor share (Contriever, random spans): the crops are drawn
    per (seed, epoch) before batching (sort_lengths: presampled_crops) and handed to each row as its "crop_spans", the
    sampler grouping rows by the crops' lengths (crop_by: "views" or "longer_shorter", as the collator's two tensors
    are cut), which dealing one document's groups apart would undo. crop_floor: random_crop's int(n r)."""

    spread_documents = False
    crop_by, crop_floor = "views", False

    def sort_lengths(self, groups, seed: int):
        return presampled_crops(groups, self.crop_token_ids, seed, self.crop_ratio, by=self.crop_by,
                                floor=self.crop_floor)

    def crop_token_ids(self, texts) -> list:
        """The tokens the crops are drawn from: each anchor's own tokens, cut to max_length (no specials)."""
        return self.tokenizer(list(texts), add_special_tokens=False, truncation=True,
                              max_length=self.max_length)["input_ids"]


class ContrieverCollator(CropsBeforeBatching, AnchorCollator):
    """Rows -> two views of each anchor: q_input_ids / q_attention_mask and k_input_ids / k_attention_mask (G, L_v),
    each an independent random_crop of the anchor's own tokens (ratio U[0.1, 0.5]; in train.py drawn before batching,
    a row's "crop_spans", so that batches group by crop length), then delete_words (p 0.1), then
    [CLS] prefix ... [SEP] around it (data.py's add_bos_eos; the prefix is never cropped), in drawn order (q: the first
    crop, as data.py's q_tokens), each view padded to its own longest."""

    DEFAULT_RATES = (0.0, 0.0)
    crop_by, crop_floor = "views", True  # sorted by (q crop, k crop); random_crop's int(n r)

    def __init__(self, tokenizer, crop_ratio: tuple = (0.1, 0.5), delete_prob: float = 0.1, **kw):
        super().__init__(tokenizer, **kw)
        self.crop_ratio, self.delete_prob = tuple(crop_ratio), delete_prob

    def __call__(self, rows: list) -> dict:
        batch = self.retention_fields(rows)
        tok = self.tokenizer
        first = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        last = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
        views = ([], [])
        spans = [r["crop_spans"] for r in rows] if "crop_spans" in rows[0] else None  # drawn before batching
        for i, toks in enumerate(self.crop_token_ids([r["anchor"] for r in rows])):
            for v in range(2):
                start, length = (int(spans[i][v][0]), int(spans[i][v][1])) if spans is not None else random_crop(
                    len(toks), self.crop_ratio, self.generator)
                crop = delete_words(toks[start:start + length], self.delete_prob, self.generator)
                views[v].append([first] + self.prefix_ids + crop + [last])
        for name, vs in zip("qk", views):
            ids = torch.full((len(vs), max(map(len, vs))), tok.pad_token_id, dtype=torch.long)
            am = torch.zeros_like(ids)
            for j, v in enumerate(vs):
                ids[j, :len(v)], am[j, :len(v)] = torch.tensor(v), 1
            batch[f"{name}_input_ids"], batch[f"{name}_attention_mask"] = ids, am
        batch["layout"] = Layout(len(rows))
        return batch


CONTRASTIVE_MODES = ("inbatch", "moco")  # src/options.py --contrastive_mode (its default: moco)


def moco_queue_init(dim: int, size: int, seed: int) -> torch.Tensor:
    """The queue MoCo starts from (src/moco.py MoCo.__init__: randn(projection_size, queue_size), normalised along the
    feature dimension): K = 65,536 columns q_j ~ N(0, I_D), each scaled to |q_j| = 1 -> (D, K) fp32. Drawn from a
    generator of its own (seed: the run's), on the CPU, so every process holds the same queue and the run's other
    random streams are left as they were."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(dim, size, generator=g), dim=0)


@torch.no_grad()
def momentum_update(key_params, query_params, m: float = 0.9995):
    """The key encoder's step (src/moco.py _momentum_update_key_encoder), parameter by parameter:

        w_k <- m w_k + (1 - m) w_q,   m = 0.9995 (example_scripts/contriever.sh, the README's run)

    w_k is kept in fp32 whatever w_q's dtype: in bf16, 0.0005 of a weight's change is below a weight's last bit."""
    for wk, wq in zip(key_params, query_params):
        wk.copy_(wk * m + wq.detach().to(wk.dtype) * (1.0 - m))


def moco_loss(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, tau: float = 0.05,
              label_smoothing: float = 0.0) -> torch.Tensor:
    """MoCo's InfoNCE (src/moco.py _compute_logits and forward), one direction: the first crop q_i picks its own
    second crop's key k_i among the queue's K keys:

        L = -mean_i log softmax([q_i . k_i, q_i . queue_1, ..., q_i . queue_K] / tau)[0],   tau = 0.05, K = 65,536

    label smoothing 0 (options.py's default; the README's run sets none). q (N, D) local rows, with gradient; k (N, D)
    the momentum encoder's keys and queue (D, K), both without. fp32 logits, as contriever_loss."""
    with torch.autocast(q.device.type, enabled=False):
        q = q.float()
        logits = torch.cat([(q * k.float()).sum(-1, keepdim=True), q @ queue.float()], dim=1) / tau
    labels = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)  # the positive key is column 0
    return F.cross_entropy(logits, labels, label_smoothing=label_smoothing)


@torch.no_grad()
def enqueue(queue: torch.Tensor, ptr: int, keys: torch.Tensor) -> int:
    """MoCo's dequeue-and-enqueue (src/moco.py _dequeue_and_enqueue): the B keys of the step (gathered across
    processes) replace the oldest columns,

        queue[:, ptr : ptr + B] = keys^T,   ptr <- (ptr + B) mod K

    -> the new ptr. As there, K must be a multiple of B (the official code asserts it)."""
    b, size = keys.shape[0], queue.shape[1]
    if size % b:
        raise UserError(f"--moco_queue_size {size} is no multiple of the keys a step enqueues ({b}: the batch of "
                        "every process), as MoCo requires (src/moco.py asserts it)")
    queue[:, ptr:ptr + b] = keys.t().to(queue.dtype)
    return (ptr + b) % size


class MoCoState:
    """Contriever's MoCo state: the momentum key encoder (a copy of the encoder's base model, frozen, fp32) and the
    queue of keys with its pointer.

    Not a module of the model, on purpose: the optimiser, DDP, the gradient clip and the saved folder (the query
    encoder only) never see it. train.py registers it for checkpoints (accelerator.register_for_checkpointing:
    state_dict / load_state_dict), so --resume_from_checkpoint continues with the same keys. Made on first use, as a
    copy of the encoder's weights at that moment (the start, or what a resumed checkpoint then overwrites), on the
    encoder's device; a run that starts from a saved folder starts a fresh key encoder and queue (the folder has
    neither, as the official model files have neither).

    step(model, ids, mask) is MoCo.forward's middle, once per call: the momentum update, then the keys, without
    gradient; the key encoder runs in the model's mode, as the official encoder_k, a submodule of the trained
    module, does (train: dropout on). The objective calls it once per forward (Contriever.batch_terms)."""

    def __init__(self, encoder, queue_size: int = 65536, momentum: float = 0.9995):
        self.encoder, self.queue_size, self.momentum = encoder, queue_size, momentum
        self.seed = torch.initial_seed()  # the run's seed (train.py seeds before the model is made): the queue's draws
        self.key_encoder, self.queue, self.ptr = None, None, 0

    def _make_key_encoder(self):
        """The key encoder: a frozen fp32 copy of the encoder's base model as it is now, on its device (moco.py
        __init__: encoder_k = deepcopy(encoder_q), requires_grad False)."""
        import copy

        base = self.encoder.base_model
        if any(hasattr(p, "ds_id") for p in base.parameters()):
            raise UserError("--contrastive_mode moco under DeepSpeed ZeRO-3: the key encoder copies the encoder's "
                            "whole weights, which ZeRO-3 partitions; use DDP or ZeRO-2")
        self.key_encoder = copy.deepcopy(base).float().requires_grad_(False)

    def step(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: bool) -> torch.Tensor:
        """Momentum update (momentum_update), then the keys of the second crops: the key encoder's pooled vectors
        through the model's modules after pooling (frozen, shared), normalised when the scores are cosines (--norm_doc)
        -> (N, D) fp32, no gradient. The first call makes the key encoder (w_k = w_q) and the queue."""
        with torch.no_grad():
            if self.key_encoder is None:
                self._make_key_encoder()
            momentum_update(self.key_encoder.parameters(), model.base.parameters(), self.momentum)
            self.key_encoder.train(model.training)
            k = model.post_pooling(model.encode(input_ids, attention_mask, self.key_encoder)[1]).float()
            if self.queue is None:
                self.queue = moco_queue_init(k.shape[-1], self.queue_size, self.seed).to(k.device)
            return F.normalize(k, dim=-1) if normalize else k

    def push(self, keys: torch.Tensor):
        """enqueue the step's keys, gathered from every process (gather_with_grad), as moco.py does."""
        self.ptr = enqueue(self.queue, self.ptr, gather_with_grad(keys.contiguous()))

    # -- checkpoints (train.py registers this object with the accelerator) --
    def state_dict(self) -> dict:
        if self.key_encoder is None:
            return {"moco": True}  # nothing made yet: a checkpoint before the first step
        return {"moco": True, "key_encoder": self.key_encoder.state_dict(), "queue": self.queue,
                "ptr": torch.tensor(self.ptr)}

    def load_state_dict(self, state: dict):
        if not state.get("moco"):
            raise UserError("the checkpoint holds no MoCo state in this place: it was written by a run without "
                            "--contrastive_mode moco; resume with the flags it was written with")
        if "queue" not in state:
            return
        if self.key_encoder is None:
            self._make_key_encoder()
        self.key_encoder.load_state_dict(state["key_encoder"])
        self.queue = state["queue"].to(next(self.key_encoder.parameters()).device, torch.float32)
        self.ptr = int(state["ptr"])


@register_objective
class Contriever(Objective):
    """Contriever's random spans: the two crops' pooled vectors, a batch term only, with either of the official
    negatives (--contrastive_mode):
      inbatch  the other rows' second crops (src/inbatch.py): contriever_loss; both crops through the encoder
      moco     a queue of the last K = 65,536 keys of a momentum encoder (src/moco.py): moco_loss; the first crop
               through the encoder, the second through the key encoder without gradient (MoCoState). Once per
               forward, in batch_terms (once per step also under the gradient cache, which calls encode twice per
               chunk but batch_terms once; the key pass runs on the whole batch without gradient): the momentum
               update, the keys, the loss on the queue as it was, then the keys enqueued. Under gradient
               accumulation each micro-batch does all four, as each forward of the official code does (its
               train.py has no accumulation): the key encoder moves A times per optimiser step towards the same
               query weights, and a micro-batch's negatives include the earlier micro-batches' keys.
    temperature: --temperature of the official run (0.05). normalize: --norm_query / --norm_doc; None (ours) scores as
    the start model does: dot products of unnormalised vectors, as the official run, for a dot-product start;
    cosines for a cosine start (E5, MiniLM), whose vectors' norms (MiniLM: 3.9-8.3) would otherwise put the logits
    in the hundreds, and whose contract (the similarity it is scored with) the comparison must keep.
    baseline_setting "official" (BASELINE_SETTINGS): dot products of unnormalised vectors, MoCo, and a saved folder
    that scores them so."""

    name = "contriever"
    flags = {**SETTING_FLAG,
             "--contrastive_mode": dict(choices=CONTRASTIVE_MODES, help=(
                 "'inbatch' (the other rows' second crops, src/inbatch.py) or 'moco' (a queue of a momentum key "
                 "encoder's keys, src/moco.py); default: inbatch in the paper setting, moco with --baseline_setting "
                 "official (the README's run)")),
             "--moco_queue_size": dict(type=positive_int, help=(
                 "moco: keys in the queue (default 65536, options.py's --queue_size; a multiple of the global "
                 "batch)")),
             "--moco_momentum": dict(type=momentum, help=(
                 "moco: momentum m of the key encoder, w_k = m w_k + (1 - m) w_q once per forward (default 0.9995, "
                 "example_scripts/contriever.sh)"))}

    def __init__(self, encoder, temperature: float = 0.05, normalize: Optional[bool] = None,
                 baseline_setting: str = "paper", contrastive_mode: Optional[str] = None,
                 moco_queue_size: int = 65536, moco_momentum: float = 0.9995):
        super().__init__(encoder)
        self.baseline_setting, self.choices = baseline_setting, setting_of(self.name, baseline_setting)
        self.temperature = temperature
        self.normalize = self.choices.get("normalize", normalize)  # official: the README run's, unnormalised
        # the flag wins over the setting's choice (official: moco, the README's run; paper: in-batch)
        self.contrastive_mode = contrastive_mode or self.choices.get("contrastive_mode", "inbatch")
        if self.contrastive_mode not in CONTRASTIVE_MODES:
            raise UserError(f"--contrastive_mode must be one of {', '.join(CONTRASTIVE_MODES)}, "
                            f"got {self.contrastive_mode!r}")
        self.moco_queue_size, self.moco_momentum = moco_queue_size, moco_momentum
        # a plain attribute, not a submodule: see MoCoState
        self.moco = MoCoState(encoder, moco_queue_size, moco_momentum) if self.contrastive_mode == "moco" else None
        self.forward_only_inputs = ("k_input_ids",) if self.moco is not None else ()  # the key encoder's, no gradient

    def config(self) -> dict:
        return {"temperature": self.temperature, "normalize": self.normalize, "baseline_setting": self.baseline_setting,
                "contrastive_mode": self.contrastive_mode, "moco_queue_size": self.moco_queue_size,
                "moco_momentum": self.moco_momentum}

    def scoring(self) -> dict:
        return scoring_of(self.choices)

    def make_collator(self, tokenizer, **kw):
        return ContrieverCollator(tokenizer, **kw)

    def multiply_adds(self, model, batch: dict, layers, head: int) -> tuple:
        """(trained, forward-only) multiply-adds of a batch, for train.py's FLOP count: the encoder on both crops
        (inbatch); the encoder on the first crop and the key encoder's forward on the second (moco)."""
        n = layer_multiply_adds(model.encoder)[0]
        q, k = layers(batch["q_input_ids"], n), layers(batch["k_input_ids"], n)
        return (q, k) if self.moco is not None else (q + k, 0)

    def encode(self, model, batch: dict):
        """-> (None, (G, 2, H): the first crop's vector, the second's); moco: (G, 1, H), the first crop's only (the
        second is the key encoder's, in batch_terms)."""
        q = model.encode(batch["q_input_ids"], batch["q_attention_mask"])[1]
        if self.moco is not None:
            return None, q[:, None]
        k = model.encode(batch["k_input_ids"], batch["k_attention_mask"])[1]
        return None, torch.stack([q, k], dim=1)

    def batch_terms(self, model, vec, batch: dict, **step):
        normalize = self.normalize if self.normalize is not None else model.info.similarity_fn_name != "dot"
        if self.moco is None:
            return {"contrastive_loss": contriever_loss(vec[:, 0], vec[:, 1], self.temperature, normalize)}
        keys = self.moco.step(model, batch["k_input_ids"], batch["k_attention_mask"], normalize)
        q = F.normalize(vec[:, 0].float(), dim=-1) if normalize else vec[:, 0]
        # the queue as it was (a copy: the loss's backward reads it after the enqueue), then this step's keys in it
        loss = moco_loss(q, keys, self.moco.queue.clone(), self.temperature)
        self.moco.push(keys)
        return {"contrastive_loss": loss}


# ==============================================================================================================
# 6. Random spans (contrastive_random_span): two random crops of one passage as a positive pair, cosine
#    InfoNCE over in-batch negatives, no augmentation; Contriever's cropping without the rest of its recipe
# How it differs from Contriever's code (src/data.py, inbatch.py, moco.py, options.py, the README's run), which
# section 5 follows:
#   - crop length max(1, round(r n)) here; int(r n) there (floor; 0 for a short text, leaving [CLS] [SEP] only)
#   - no augmentation here; there each token of a crop is deleted with p 0.1 (--augmentation delete
#     --prob_augmentation 0.1 in the README's run and example_scripts/contriever.sh; options.py's default is none)
#   - scores cos / 0.05 here; there dot products of the unnormalised mean-pooled vectors / 0.05 (--norm_query and
#     --norm_doc off): all-MiniLM-L6-v2's vectors have norms 3.9-8.3, so its logits run in the hundreds
#   - the longer crop is always the query here; there the first crop drawn (either length); with a one-direction
#     loss this is a choice of which side the negatives come from, not only a labelling
#   - in-batch negatives here; section 5 has both (in-batch, and the MoCo queue of a momentum encoder the README's
#     run uses: 65,536 keys as its flags parse, momentum 0.9995, no gradient through the keys)
#   - the same: two independent crops of one text, ratio U[0.1, 0.5] (example_scripts: 0.05), one direction, tau 0.05,
#     average pooling, [CLS] / [SEP] around each crop; crops there come from 256-token chunks of a token stream
# ==============================================================================================================


def contrastive_random_span(view1: torch.Tensor, view2: torch.Tensor, tau: float = 0.05) -> torch.Tensor:
    """Contriever-style baseline: two independent random crops of one passage (length ratio
    uniform in [0.1, 0.5], RandomSpanCollator) form the positive pair; InfoNCE, tau = 0.05, with the
    (gathered) in-batch crops as negatives, one direction (view1 -> view2) as in Contriever.

    The longer crop is view1: batches are grouped by the crops' lengths, and with the views in drawn order a query's
    partner would be the candidate of the other length class, a cue a length-only scorer uses
    (bench/bench_batches.py). The crops are exchangeable, so which one is the query is the labelling only."""
    all_v2 = gather_with_grad(view2)
    n = view1.shape[0]
    labels = torch.arange(n, device=view1.device) + rank_and_world()[0] * n
    return info_nce(view1, all_v2, labels, tau)


@register_objective
class RandomSpanObjective(Objective):
    """contrastive_random_span on the two crops of each group's anchor: a batch term only."""

    name = "contrastive_random_span"

    def make_collator(self, tokenizer, **kw):
        return RandomSpanCollator(tokenizer, **kw)

    def encode(self, model, batch):
        """-> (None, (G, 2, H): the longer crop, the shorter), each crop padded to its own length."""
        _, v_long = model.encode(batch["input_ids"], batch["attention_mask"])  # (G, H)
        _, v_short = model.encode(batch["short_input_ids"], batch["short_attention_mask"])
        return None, torch.stack([v_long, v_short], dim=1)

    def batch_terms(self, model, vec, batch, **step):
        return {"contrastive_loss": contrastive_random_span(vec[:, 0], vec[:, 1], model.tau)}  # the longer crop: query


class RandomSpanCollator(CropsBeforeBatching, GroupCollator):
    """Contriever's random cropping of each group's anchor (ratio uniform in [0.1, 0.5]), plus the retention fields.
    Its batches are grouped by the crops' lengths (sort_lengths), which dealing one document's groups apart would
    undo."""

    DEFAULT_RATES = (0.0, 0.0)
    crop_by = "longer_shorter"  # its tensors: the longer and the shorter crop of each row

    def __init__(self, tokenizer, crop_ratio: tuple = (0.1, 0.5), **kw):
        super().__init__(tokenizer, **kw)
        self.crop_ratio = crop_ratio

    def __call__(self, rows: list) -> dict:
        batch = self.retention_fields(rows)
        spans = [r["crop_spans"] for r in rows] if "crop_spans" in rows[0] else None
        batch.update(self._crops([r["anchor"] for r in rows], spans))
        batch["layout"] = Layout(len(rows))
        return batch

    def _crops(self, texts, spans=None):
        """Contriever's random cropping: two independent spans of each text, each of length
        ratio ~ U[crop_ratio] of its tokens (at least one token), re-wrapped in [CLS] prefix ... [SEP]
        (the prefix is not cropped: every view is a passage as E5 reads it).

        spans (G, 2, 2) [start, length] per view: drawn before batching (crop_spans, sort_lengths: so that batches can
        be grouped by the crops' lengths); None draws them here from the collator's generator.
        Layout: the longer crop of each row in input_ids / attention_mask (G, L), the shorter in short_input_ids /
        short_attention_mask (G, L_short), each padded to its own longest, and view1_is_long (G,) to put them back
        in view order: padding both views to one length would pad every short crop to the longest long one."""
        tok = self.tokenizer
        body = self.crop_token_ids(texts)
        lo, hi = self.crop_ratio
        # BERT's [CLS]/[SEP]; RoBERTa-style tokenizers have <s>/</s> as bos/eos
        first = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        last = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
        views = []
        for i, toks in enumerate(body):
            for v in range(2):
                n = len(toks)
                if spans is None:
                    ratio = lo + (hi - lo) * torch.rand((), generator=self.generator).item()
                    k = max(1, int(round(ratio * n)))
                    start = int(torch.randint(0, max(1, n - k + 1), (), generator=self.generator))
                else:
                    start, k = int(spans[i][v][0]), int(spans[i][v][1])
                views.append([first] + self.prefix_ids + toks[start : start + k] + [last])
        g = len(texts)
        view1_is_long = torch.tensor([len(views[2 * i]) >= len(views[2 * i + 1]) for i in range(g)])
        long = [views[2 * i + (0 if view1_is_long[i] else 1)] for i in range(g)]
        short = [views[2 * i + (1 if view1_is_long[i] else 0)] for i in range(g)]

        def pad(vs):
            ids = torch.full((len(vs), max(len(v) for v in vs)), tok.pad_token_id, dtype=torch.long)
            am = torch.zeros_like(ids)
            for j, v in enumerate(vs):
                ids[j, : len(v)] = torch.tensor(v)
                am[j, : len(v)] = 1
            return ids, am

        (ids, am), (sids, sam) = pad(long), pad(short)
        return {"input_ids": ids, "attention_mask": am, "short_input_ids": sids, "short_attention_mask": sam,
                "view1_is_long": view1_is_long}



def presampled_crops(groups, token_ids, seed: int, crop_ratio: tuple, by: str, floor: bool = False,
                     batch_size: int = 8192):
    """Batching for the baselines that read two random crops of each anchor (random spans, Contriever): (epoch ->
    lengths for the sampler, (epoch, row) -> its crop spans).

    Their views are crops, not the texts: grouping rows by text length left about half of each batch padding (padding
    efficiency 0.49-0.53). So the crops are drawn before batching, per (seed, epoch) for every row at once (crop_spans,
    from each anchor's token count, counted here once: one tokenizer pass over the anchors, an int32 per row), the
    sampler sorts by the crops' lengths (two tensors, LengthGroupedBatchSampler._longest_first) and the loop hands each
    row its spans. by: "longer_shorter" (tensors of the longer and the shorter crop: random spans) or "views" (the
    first and the second crop drawn, as Contriever's q and k). One epoch's spans are kept at a time (16 bytes a row)."""
    num_tokens = np.empty(len(groups), dtype=np.int32)
    pos = 0
    for batch in groups.select_columns(["anchor"]).iter(batch_size=batch_size):
        ids = token_ids(batch["anchor"])
        num_tokens[pos:pos + len(ids)] = [len(x) for x in ids]
        pos += len(ids)
    cache = {}

    def spans_for(epoch):
        if epoch not in cache:
            cache.clear()
            cache[epoch] = crop_spans(num_tokens, seed, epoch, crop_ratio, floor=floor)
        return cache[epoch]

    def lengths_for(epoch):  # (N, 2)
        k = spans_for(epoch)[:, :, 1]
        return k if by == "views" else np.stack([k.max(1), k.min(1)], axis=1)

    return lengths_for, lambda epoch, i: {"crop_spans": spans_for(epoch)[i]}


def crop_spans(num_tokens, seed: int, epoch: int, crop_ratio: tuple = (0.1, 0.5), floor: bool = False):
    """Both random crops of every row, drawn at once for an epoch: (N, 2, 2) int64 [start, length] per view, from
    num_tokens (N,) (crop_token_ids' lengths). A function of (seed, epoch) only, so the batch sampler can group rows by
    their crops' lengths before any batch is collated, and a resumed run draws the same crops.
    The draws of RandomSpanCollator._crops: length = max(1, round(ratio * n)), ratio ~ U[crop_ratio], start uniform over
    the places the span fits; floor: Contriever's random_crop, length = int(n * ratio) (0 for a short text)."""
    n = np.asarray(num_tokens, dtype=np.int64)[:, None]  # (N, 1)
    rng = np.random.default_rng([seed, epoch])
    lo, hi = crop_ratio
    ratio = lo + (hi - lo) * rng.random((len(n), 2))
    k = np.floor(ratio * n).astype(np.int64) if floor else np.maximum(1, np.round(ratio * n).astype(np.int64))
    start = np.floor(rng.random((len(n), 2)) * np.maximum(1, n - k + 1)).astype(np.int64)
    return np.stack([start, k], axis=-1)


# ==============================================================================================================
# 7. Self-reconstruction (the paper's Table 3 ablation)
# ==============================================================================================================


def self_reconstruction(model, dec_hidden: torch.Tensor, dec_targets: torch.Tensor, enc_hidden: torch.Tensor,
                        enc_targets: torch.Tensor, shares=(1.0, 1.0)) -> dict:
    """The paper's self-reconstruction ablation: L = L_recon + L_MLM, weights 1 and 1. The encoder reads the passage
    30%-masked (L_MLM, mlm_loss); xPRT's one-layer conditioned decoder rebuilds the passage, 50%-masked, from the
    passage's own vector (L_recon: cross-entropy at the decoder's masked positions). -> {"recon_loss", "mlm_loss"},
    each times its share of the batch's rows when the rows are a chunk of it (shares: Layout.row_share); L is their sum
    (Objective.total). RetroMAE proper (two-stream decoding) is its own objective."""
    recon = linear_cross_entropy(model.transform(dec_hidden), model.vocab_weight, model.vocab_bias, dec_targets,
                                 fused=model.fused_vocab_loss)
    return {"recon_loss": shares[0] * recon, "mlm_loss": shares[1] * mlm_loss(model, enc_hidden, enc_targets)}


@register_objective
class SelfReconstructionObjective(Objective):
    """self_reconstruction on each group's anchor: row terms only (the decoder reads the anchor's own vector)."""

    name = "self_reconstruction"
    trains_every_head = True

    def __init__(self, encoder, num_condition_vectors: int = 4, decoder_layers: int = 1):
        super().__init__(encoder)
        self.num_condition_vectors, self.decoder_layers = num_condition_vectors, decoder_layers
        self.decoder = ConditionedDecoder(encoder, num_condition_vectors, decoder_layers)

    def config(self) -> dict:
        return {"num_condition_vectors": self.num_condition_vectors, "decoder_layers": self.decoder_layers}

    def make_collator(self, tokenizer, **kw):
        return SelfReconstructionCollator(tokenizer, num_condition_vectors=self.num_condition_vectors, **kw)

    def multiply_adds(self, model, batch: dict, layers, head: int) -> tuple:
        """The encoder on the masked anchor, the decoder on its pass, the MLM head at both terms' rows."""
        trained, _ = super().multiply_adds(model, batch, layers, head)
        trained += self.decoder.multiply_adds(batch["dec_input_ids"], layers)
        return trained + head * (batch["mlm_index"].numel() + batch["dec_rows"].numel()), 0

    def encode(self, model, batch):
        ids, am = batch["input_ids"], batch["attention_mask"]  # (G, L)
        hidden, vec = model.encode(ids, am)
        return hidden.reshape(-1, hidden.shape[-1]), vec.unsqueeze(1)  # (G * L, H), (G, 1, H)

    def row_terms(self, model, batch, states, vec):
        ids, am = batch["dec_input_ids"], batch["attention_mask"]  # (G, L)
        emb = model.embed(ids)
        dec_flat = self.decoder(vec[:, 0].to(emb.dtype), emb, am).reshape(-1, emb.shape[-1])
        layout = batch["layout"]
        return self_reconstruction(model, dec_flat.index_select(0, batch["dec_rows"]), batch["dec_targets"],
                            states.index_select(0, batch["mlm_index"]), batch["mlm_targets"],
                            shares=(layout.row_share["dec"], layout.row_share["mlm"]))


class SelfReconstructionCollator(GroupCollator):
    """Each group's anchor, 30%-masked for the encoder (BERT's 80/10/10) and, independently, 50%-masked (all [MASK])
    for the decoder (RetroMAE's rates)."""

    DEFAULT_RATES = (0.30, 0.50)

    def __init__(self, tokenizer, num_condition_vectors: int = 4, **kw):
        super().__init__(tokenizer, **kw)
        self.num_condition_vectors = num_condition_vectors

    def __call__(self, rows: list) -> dict:
        batch = self.retention_fields(rows)
        enc = self._tokenize([self.passage(r, "anchor") for r in rows])
        ids, am = enc["input_ids"], enc["attention_mask"]
        g, l = ids.shape
        cand = enc["candidates"]
        masked, labels = self._mask(ids, cand, self.encoder_mask_rate)
        dec_ids, dec_labels = self._mask(ids, cand, self.decoder_mask_rate, bert=False)
        mlm_index = (labels != -100).reshape(-1).nonzero().squeeze(1)
        dec_index = (dec_labels != -100).reshape(-1).nonzero().squeeze(1)
        c = self.num_condition_vectors
        batch.update({"input_ids": masked, "attention_mask": am, "mlm_labels": labels, "dec_input_ids": dec_ids,
                      "dec_labels": dec_labels,
                      "mlm_index": mlm_index, "mlm_targets": labels.reshape(-1)[mlm_index],
                      "dec_rows": ConditionedDecoder.output_rows(dec_index, l, c),
                      "dec_targets": dec_labels.reshape(-1)[dec_index]})
        batch["layout"] = Layout(g, {"mlm_index": ("mlm", l), "mlm_targets": ("mlm", 0), "dec_rows": ("dec", l + c),
                                     "dec_targets": ("dec", 0)},
                                 {"mlm": group_bounds(mlm_index, l, g), "dec": group_bounds(dec_index, l, g)})
        return batch


# ==============================================================================================================
# 8. Revela (the paper's fifth baseline), in a file of its own: its language model, LoRA and attention function
# ==============================================================================================================
import revela  # noqa: E402,F401  (registers --objective revela)
