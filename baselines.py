"""
The baselines of the xPRT paper, as their authors run them: RetroMAE, SimLM and Contriever's random spans.

The paper compares xPRT with established objectives "with their official implementations". Each objective here is
written from its authors' code (read, not copied), one function per equation, with the official numbers:
  RetroMAE  staoxiao/RetroMAE         src/pretrain/{modeling,enhancedDecoder,data,arguments}.py, examples/pretrain
  SimLM     microsoft/unilm           simlm/src/{models/rlm.py, collators/rlm_collator.py, collators/collator_utils.py,
                                      config.py}, simlm/scripts/train_rlm.sh
  Contriever facebookresearch/contriever  src/{data.py, inbatch.py, moco.py, contriever.py, options.py}, README's
                                      training command
The Table 3 ablation "self-reconstruction" (xPRT's own decoder rebuilding the passage) stays in modeling_xprt.py.

What the paper's setting changes, for every arm (choices the official code does not make are marked "ours"):
  - The text an arm trains on is the anchor passage of each group (select_groups.py, 128 tokens), as the paper gives
    every method the same groups, steps and batch; the official runs read their own corpora (RetroMAE: Wikipedia +
    BookCorpus at 512 tokens; SimLM: MS MARCO passages at 144; Contriever: 256-token chunks of a token stream that
    runs across documents). Contriever's crops are therefore 10-50% of a passage, not of a 256-token chunk.
  - Every arm pools as the start model does (XPRTModel.pool: mean pooling for E5): RetroMAE and SimLM condition their
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
  - SimLM: the frozen generator runs in eval mode (no dropout). In the official code it is a registered submodule
    of the trained model, so the Trainer's model.train() turns its dropout back on after `generator.eval()`.
  - Contriever: in-batch negatives (the official --contrastive_mode inbatch, src/inbatch.py), not the MoCo queue of
    the README's run (the default mode: 131,072 keys from a momentum encoder, momentum 0.9995, no gradient through
    the keys): the paper's setting gives every arm the same batch. Its scores stay the official dot products of
    unnormalised vectors (--norm_query / --norm_doc off); Contriever(normalize=True) makes them cosines.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from modeling_xprt import VocabSweep, XPRTCollator, gather_with_grad
from support import rank_and_world, resolve_model_path

# ==============================================================================================================
# 1. Whole-word masking (RetroMAE and SimLM: the rule of BERT's DataCollatorForWholeWordMask, which both use)
# ==============================================================================================================


def word_ids_of(encoding, num_rows: int, skip: int = 0) -> torch.Tensor:
    """Each token's word in its row, from a fast tokenizer's pre-tokenizer (BatchEncoding.word_ids): (N, L) int64,
    -1 where a token is no masking candidate: specials, padding and the `skip` tokens after position 0 (the prefix).

    For WordPiece this is the official rule (a "##" piece continues the word before it; [CLS] / [SEP] are never
    candidates): BERT's pre-tokenizer splits on whitespace and punctuation, and "##" pieces are the later pieces of one
    such word (tests: test_word_ids_follow_the_wordpiece_rule). Other tokenizers get their own pre-tokenizer's words."""
    rows = []
    for i in range(num_rows):
        ids = [-1 if w is None else w for w in encoding.word_ids(i)]
        ids[1 : 1 + skip] = [-1] * min(skip, max(0, len(ids) - 1))
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.long)


def whole_word_mask(word_ids: torch.Tensor, num_tokens: torch.Tensor, rate: float,
                    generator: Optional[torch.Generator] = None, max_predictions: int = 512) -> torch.Tensor:
    """The whole-word mask of RetroMAE and SimLM (transformers' DataCollatorForWholeWordMask._whole_word_mask, copied
    into SimLM's collator_utils.whole_word_mask): the words are taken in a random order, each whole, until

        num_to_predict = min(max_predictions, max(1, round(num_tokens * rate)))        (num_tokens with [CLS], [SEP])

    tokens are masked; a word that would overshoot is skipped and later (shorter) words still fill the budget. So the
    rate is a count, not a Bernoulli draw: exactly round(0.3 n) tokens when the words fit (RetroMAE's and SimLM's
    encoder 0.3, decoder 0.5, tests: test_whole_word_mask_*).

    word_ids (N, L) int64 (-1: not a candidate; word_ids_of), num_tokens (N,) -> (N, L) bool. Tensor operations on
    word_ids' device; the one Python loop runs over word slots (at most L), each step over all N rows at once."""
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
    for k in range(int(valid.sum(1).max()) if n else 0):  # no row has more words than candidate tokens
        fits = (sorted_len[:, k] > 0) & (total + sorted_len[:, k] <= budget)
        taken[:, k] = fits
        total += sorted_len[:, k] * fits
    word_taken = torch.zeros_like(taken).scatter_(1, order, taken)  # back from shuffled order to word ids
    return word_taken.gather(1, word) & valid


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


class AnchorCollator(XPRTCollator):
    """The shared part: the anchor of each group (the text every arm trains on), tokenized as XPRTCollator does
    (the passage prefix, max_length counting the passage's own tokens), its masking candidates (word_ids: the
    prefix, [CLS], [SEP] and padding are none), and the retention fields (doc_ids, retain_input_ids /
    retain_attention_mask: the clean anchor and s1). Seeded generator, checkpointed by state_dict for exact resume."""

    def __init__(self, tokenizer, max_length: int = 128, passage_prefix: str = "", seed: int = 0, **_):
        super().__init__(tokenizer, objective="self_reconstruction", num_related=1, max_length=max_length,
                         passage_prefix=passage_prefix, seed=seed)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("the baselines' whole-word masking needs a fast tokenizer (its word_ids)")

    def anchors(self, rows: list) -> dict:
        """-> input_ids, attention_mask (G, L) clean anchors, word_ids (G, L), num_tokens (G,) the tokens the official
        masking budget counts ([CLS] + passage + [SEP]), targets (G, L) the original token where a loss predicts one
        (every candidate position, -100 elsewhere), and the retention fields."""
        if not rows:
            raise ValueError("empty batch")
        g = len(rows)
        clean = self._tokenize([t for r in rows for t in (r["anchor"], r["related"][0])])
        lr = clean["input_ids"].shape[1]
        enc = self._tokenize([r["anchor"] for r in rows])
        word_ids = word_ids_of(enc, g, skip=len(self.prefix_ids))
        am = enc["attention_mask"]
        return {"input_ids": enc["input_ids"], "attention_mask": am, "word_ids": word_ids,
                "num_tokens": am.sum(1) - len(self.prefix_ids),
                "targets": enc["input_ids"].masked_fill(word_ids < 0, -100),
                "doc_ids": torch.tensor([_doc_hash(r["doc_id"]) for r in rows], dtype=torch.long),
                "retain_input_ids": clean["input_ids"].view(g, 2, lr),
                "retain_attention_mask": clean["attention_mask"].view(g, 2, lr)}


def _doc_hash(doc_id):
    from support import stable_doc_hash

    return stable_doc_hash(doc_id)


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


def retromae_decoder_loss(sweep: VocabSweep, hidden: torch.Tensor, targets: torch.Tensor, weight: float) -> None:
    """RetroMAE's reconstruction term: the enhanced decoder predicts EVERY token of the passage ([CLS] and [SEP]
    excepted, data.py's decoder_labels) through the encoder's MLM head,

        L_dec = mean over the batch's tokens i of -log softmax(head(h_i))[x_i]

    and RetroMAE's loss is L_dec + L_MLM (weights 1 and 1, modeling.py). One cross-entropy of the step's VocabSweep."""
    sweep.cross_entropy("decoder_loss", hidden, targets, weight)


class RetroMAECollator(AnchorCollator):
    """Rows -> RetroMAE's batch: input_ids the anchor whole-word-masked at 30% with BERT's 80/10/10 (the encoder's
    input; data.py: DataCollatorForWholeWordMask + torch_mask_tokens), mlm_labels (G, L) its targets, clean_ids the
    clean anchor (the decoder's content stream), word_ids / num_tokens (the decoder's masks are drawn from them in the
    step: enhanced_decoding_masks), targets (G, L) the decoder's targets, totals the batch's rows per term."""

    def __init__(self, tokenizer, encoder_mask_rate: float = 0.3, **kw):
        super().__init__(tokenizer, **kw)
        self.encoder_mask_rate = encoder_mask_rate

    def __call__(self, rows: list) -> dict:
        batch = self.anchors(rows)
        ids = batch["input_ids"]
        masked = whole_word_mask(batch["word_ids"], batch["num_tokens"], self.encoder_mask_rate, self.generator)
        batch["clean_ids"] = ids
        batch["input_ids"] = bert_corruption(ids, masked, self.tokenizer.mask_token_id, len(self.tokenizer),
                                             self.generator)
        batch["mlm_labels"] = ids.masked_fill(~masked, -100)
        batch["totals"] = {"mlm_loss": int(masked.sum()), "decoder_loss": int((batch["targets"] >= 0).sum())}
        return batch


class RetroMAE(nn.Module):
    """RetroMAE: loss = L_dec (enhanced decoding, 50%) + L_MLM (encoder, 30%). Owns its one fresh decoder layer
    (BERT's initialisation, as modeling.py's c_head.apply(lm._init_weights)); the embeddings and the MLM head are the
    encoder's own."""

    name = "retromae"
    collator_class = RetroMAECollator

    def __init__(self, encoder, decoder_mask_rate: float = 0.5, **_):
        super().__init__()
        layers = _encoder_layers(encoder.base_model)
        self.decoder = type(layers[0])(encoder.config)
        self.decoder.apply(encoder._init_weights)
        self.decoder_mask_rate = decoder_mask_rate

    def prepare(self, model, batch: dict) -> dict:
        """The decoder's per-row masks, on the batch's device (no gradient)."""
        with torch.no_grad():
            visible = enhanced_decoding_masks(batch["word_ids"], batch["num_tokens"], batch["attention_mask"],
                                              self.decoder_mask_rate)
        return {**batch, "visible": visible}

    def encode(self, model, batch: dict):
        hidden, vec = model.encode(batch["input_ids"], batch["attention_mask"])  # (G, L, H), (G, H)
        return (hidden, vec), vec.new_zeros(vec.shape[0], 0, vec.shape[1])  # no term couples the rows

    def batch_terms(self, model, vec, batch: dict):
        return vec.new_zeros(()), {}

    def row_terms(self, model, batch: dict, states, vec):
        hidden, sent = states
        emb = model.base.embeddings
        ids = batch["clean_ids"]
        g, l = ids.shape
        v = sent.to(hidden.dtype).unsqueeze(1)  # (G, 1, H) the pooled vector in place of [CLS]
        content = torch.cat([v, emb(input_ids=ids)[:, 1:]], dim=1)  # (G, L, H)
        query = emb.position_embeddings(emb.position_ids[:, :l]) + v  # (G, L, H)
        dec = enhanced_decoding(self.decoder, query, content, batch["visible"])
        return vocab_terms(model, batch, [("mlm_loss", hidden, batch["mlm_labels"]),
                                          ("decoder_loss", dec, batch["targets"])])


def vocab_terms(model, batch: dict, terms: list):
    """[(name, states (G, L, H), targets (G, L) with -100 where no loss)] -> VocabSweep.run()'s (weighted sum, terms):
    each term the mean over the WHOLE batch's target tokens (batch["totals"][name]), also when `batch` is a chunk."""
    sweep, shares = VocabSweep(model), []
    for name, states, targets in terms:
        index = (targets.reshape(-1) >= 0).nonzero().squeeze(1)  # a host sync per term and step
        share = index.numel() / max(1, batch["totals"][name])
        shares.append(share)
        sweep.cross_entropy(name, states.reshape(-1, states.shape[-1]).index_select(0, index),
                            targets.reshape(-1).index_select(0, index), share)
    total, values = sweep.run()
    # each value weighted by its share, so that the chunks' values add up to the batch's means
    return total, {name: v * (index_share) for (name, v), index_share in zip(values.items(), shares)}


def _encoder_layers(base) -> nn.ModuleList:
    """The encoder's Transformer layers (BERT naming: base.encoder.layer)."""
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(base).__name__}: no encoder.layer list to build the baseline's decoder from")
    return layers


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
            logits = generator(input_ids=input_ids[a:a + rows], attention_mask=attention_mask[a:a + rows]).logits
            sampled = torch.distributions.Categorical(logits=logits.float()).sample()
            out[a:a + rows] = torch.where(masked[a:a + rows], sampled, input_ids[a:a + rows])
    return out


def simlm_replaced_lm_loss(sweep: VocabSweep, name: str, hidden: torch.Tensor, targets: torch.Tensor,
                           weight: float) -> None:
    """SimLM's replaced language modelling: the encoder (on its 30%-replaced text) and the decoder (on its 50%-replaced
    text, after the sentence vector) each predict the ORIGINAL token at every position, replaced or not, through the
    shared MLM head (every special token excepted, rlm_collator.py's labels):

        L_enc = mean_i -log softmax(head(h^enc_i))[x_i],   L_dec = mean_i -log softmax(head(h^dec_i))[x_i]
        L = L_dec + L_enc        (rlm.py; its generator MLM term has weight 0.2 but is 0: the generator is frozen)

    One cross-entropy of the step's VocabSweep per call (name: encoder_rlm_loss or decoder_rlm_loss)."""
    sweep.cross_entropy(name, hidden, targets, weight)


class SimLMCollator(AnchorCollator):
    """Rows -> SimLM's batch: enc_input_ids / dec_input_ids (G, L) the anchor masked by simlm_masks (every masked
    token [MASK]: train_rlm.sh's --all_use_mask_token True), enc_masked / dec_masked (G, L) the positions the
    generator fills (prepare), targets (G, L) the original token at every non-special position, totals."""

    def __init__(self, tokenizer, encoder_mask_rate: float = 0.3, decoder_mask_rate: float = 0.5,
                 all_mask_token: bool = True, **kw):
        super().__init__(tokenizer, **kw)
        self.encoder_mask_rate, self.decoder_mask_rate, self.all_mask_token = (encoder_mask_rate, decoder_mask_rate,
                                                                               all_mask_token)

    def __call__(self, rows: list) -> dict:
        batch = self.anchors(rows)
        ids = batch["input_ids"]
        enc, dec = simlm_masks(batch["word_ids"], batch["num_tokens"], self.encoder_mask_rate,
                               self.decoder_mask_rate, self.generator)
        tok = self.tokenizer
        corrupt = [bert_corruption(ids, m, tok.mask_token_id, len(tok), self.generator, self.all_mask_token)
                   for m in (enc, dec)]
        # every special token is no target, [UNK] included (rlm_collator.py: labels[labels == special_id] = -100)
        special = torch.isin(ids, torch.tensor(tok.all_special_ids))
        batch["targets"] = batch["targets"].masked_fill(special, -100)
        n = int((batch["targets"] >= 0).sum())
        batch.update(enc_input_ids=corrupt[0], dec_input_ids=corrupt[1], enc_masked=enc, dec_masked=dec,
                     totals={"encoder_rlm_loss": n, "decoder_rlm_loss": n})
        return batch


class SimLM(nn.Module):
    """SimLM: loss = L_dec + L_enc (simlm_replaced_lm_loss). Owns its decoder, a copy of the encoder's last two layers
    (rlm.py: copy.deepcopy(encoder.layer[-2:])), reading the sentence vector followed by the encoder's embeddings of
    the decoder's replaced text. The frozen generator (--generator_name_or_path, official default
    google/electra-base-generator) is kept OUT of the module tree: not trained, not saved, not in the optimiser."""

    name = "simlm"
    collator_class = SimLMCollator

    def __init__(self, encoder, generator_name_or_path: str = "google/electra-base-generator",
                 decoder_layers: int = 2, **_):
        super().__init__()
        from transformers import AutoModelForMaskedLM

        self.decoder = copy.deepcopy(_encoder_layers(encoder.base_model)[-decoder_layers:])
        self.config = encoder.config
        gen = AutoModelForMaskedLM.from_pretrained(resolve_model_path(generator_name_or_path))
        if gen.config.vocab_size != encoder.config.vocab_size:
            raise ValueError(f"generator {generator_name_or_path} has {gen.config.vocab_size} words, the encoder "
                             f"{encoder.config.vocab_size}: SimLM's generator must share the encoder's vocabulary")
        # eval mode (no dropout): the official generator is a submodule that model.train() puts back in train mode
        gen.eval().requires_grad_(False)
        self._generator = (gen,)  # a tuple: nn.Module does not register what it holds

    @property
    def generator(self) -> nn.Module:
        return self._generator[0]

    def prepare(self, model, batch: dict) -> dict:
        """The generator's replacements, for the encoder's and the decoder's text (no gradient)."""
        gen = self.generator
        ids = batch["enc_input_ids"]
        if next(gen.parameters()).device != ids.device:
            gen.to(ids.device)
        am = batch["attention_mask"]
        return {**batch, "enc_input_ids": replace_tokens(gen, ids, am, batch["enc_masked"]),
                "dec_input_ids": replace_tokens(gen, batch["dec_input_ids"], am, batch["dec_masked"])}

    def encode(self, model, batch: dict):
        hidden, vec = model.encode(batch["enc_input_ids"], batch["attention_mask"])
        return (hidden, vec), vec.new_zeros(vec.shape[0], 0, vec.shape[1])

    def batch_terms(self, model, vec, batch: dict):
        return vec.new_zeros(()), {}

    def row_terms(self, model, batch: dict, states, vec):
        from transformers.masking_utils import create_bidirectional_mask

        hidden, sent = states
        emb = model.base.embeddings(input_ids=batch["dec_input_ids"])  # (G, L, H)
        x = torch.cat([sent.to(emb.dtype).unsqueeze(1), emb[:, 1:]], dim=1)  # the vector in place of [CLS]
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x, attention_mask=batch["attention_mask"])
        for layer in self.decoder:
            x = layer(x, mask)
        return vocab_terms(model, batch, [("encoder_rlm_loss", hidden, batch["targets"]),
                                          ("decoder_rlm_loss", x, batch["targets"])])


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


class ContrieverCollator(AnchorCollator):
    """Rows -> two views of each anchor: q_input_ids / q_attention_mask and k_input_ids / k_attention_mask (G, L_v),
    each an independent random_crop of the anchor's own tokens (ratio U[0.1, 0.5]), then delete_words (p 0.1), then
    [CLS] prefix ... [SEP] around it (data.py's add_bos_eos; the prefix is never cropped), in drawn order (q: the first
    crop, as data.py's q_tokens)."""

    def __init__(self, tokenizer, crop_ratio: tuple = (0.1, 0.5), delete_prob: float = 0.1, **kw):
        super().__init__(tokenizer, **kw)
        self.crop_ratio, self.delete_prob = tuple(crop_ratio), delete_prob

    def __call__(self, rows: list) -> dict:
        batch = {k: v for k, v in self.anchors(rows).items() if k in ("doc_ids", "retain_input_ids",
                                                                      "retain_attention_mask")}
        tok = self.tokenizer
        first = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        last = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
        views = ([], [])
        for toks in self.crop_token_ids([r["anchor"] for r in rows]):
            for v in range(2):
                start, length = random_crop(len(toks), self.crop_ratio, self.generator)
                crop = delete_words(toks[start:start + length], self.delete_prob, self.generator)
                views[v].append([first] + self.prefix_ids + crop + [last])
        for name, vs in zip("qk", views):
            ids = torch.full((len(vs), max(map(len, vs))), tok.pad_token_id, dtype=torch.long)
            am = torch.zeros_like(ids)
            for j, v in enumerate(vs):
                ids[j, :len(v)], am[j, :len(v)] = torch.tensor(v), 1
            batch[f"{name}_input_ids"], batch[f"{name}_attention_mask"] = ids, am
        return batch


class Contriever(nn.Module):
    """Contriever's random spans with in-batch negatives: contriever_loss on the two crops' pooled vectors. No heads."""

    name = "contriever"
    collator_class = ContrieverCollator

    def __init__(self, encoder, tau: float = 0.05, normalize: bool = False, **_):
        super().__init__()
        self.tau, self.normalize = tau, normalize

    def prepare(self, model, batch: dict) -> dict:
        return batch

    def encode(self, model, batch: dict):
        q = model.encode(batch["q_input_ids"], batch["q_attention_mask"])[1]
        k = model.encode(batch["k_input_ids"], batch["k_attention_mask"])[1]
        return None, torch.stack([q, k], dim=1)  # (G, 2, H)

    def batch_terms(self, model, vec, batch: dict):
        c = contriever_loss(vec[:, 0], vec[:, 1], self.tau, self.normalize)
        return c, {"contrastive_loss": c}

    def row_terms(self, model, batch: dict, states, vec):
        return vec.new_zeros(()), {}
