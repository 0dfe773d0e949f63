"""RetroMAE (Xiao et al. 2022), as its authors' code runs it (staoxiao/RetroMAE src/pretrain/{modeling,
enhancedDecoder,data,arguments}.py, examples/pretrain): encoder MLM at 30% whole-word masking, a one-layer decoder
with enhanced decoding at 50%. --objective retromae."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from baselines.shared import (SETTING_FLAG, AnchorCollator, bert_corruption, never_unk, scoring_of, setting_of,
                              whole_word_mask)
from modeling_xprt import Objective, mlm_loss, register_objective, unpadded_rand
from plumbing.architectures import decoder_layers, layer_multiply_adds, linear_cross_entropy

# ==============================================================================================================
# RetroMAE (Xiao et al. 2022): encoder MLM at 30%, one-layer decoder with enhanced decoding at 50%
# ==============================================================================================================


def enhanced_decoding_masks(word_ids: torch.Tensor, num_tokens: torch.Tensor, attention_mask: torch.Tensor,
                            rate: float = 0.5, pool: int = 256, width: Optional[int] = None) -> torch.Tensor:
    """Which positions each row of RetroMAE's decoder may attend to: (G, L, L) bool, visible[g, i, j].

    The official collator (RetroMAECollator) draws, per passage, min(n, 256) whole-word masks at the decoder rate
    (whole_word_mask, 0.5), gives each row i one of them at random (with replacement), masks position i itself in it,
    and the row sees what is left:

        visible[i, j] = not sample_{r(i)}[j]  and  j != i  and  j is not padding,   r(i) ~ U{0 .. min(n, 256) - 1}

    so a row never sees its own token (the issue's "plus position i itself" is the reverse of the code: i is added to
    the MASK), and [CLS] (where the sentence vector sits) and [SEP] are visible to every other row (never
    candidates). Drawn here on the device with tensor operations, from the global random state (the training step's
    prepare), instead of in the data loader with Python lists. width: the batch's real (unpadded) width, over which
    every draw is made (unpadded_rand), so that --pad_to_multiple_of changes none; default L."""
    g, l = word_ids.shape
    device = word_ids.device
    width = l if width is None else width
    p = min(width, pool)
    samples = whole_word_mask(word_ids.repeat_interleave(p, 0), num_tokens.repeat_interleave(p, 0), rate,
                              width=width)
    samples = samples.view(g, p, l)  # (G, P, L) the passage's pool of masks
    size = num_tokens.to(device).clamp(min=1, max=pool)  # min(n, 256) with n counting [CLS] and [SEP]
    pick = (unpadded_rand(attention_mask.bool(), width=width) * size.unsqueeze(1)).long().clamp(max=p - 1)  # (G, L)
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
                                             self.generator, left=self.tokenizer.padding_side == "left")
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
                                              batch["decoder_mask_rate"], width=batch.get("real_width"))
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
