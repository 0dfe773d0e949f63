"""
The comparison objectives of the xPRT paper ("Experiments": "the five baselines use their official implementations"),
each one class over modeling_xprt.Objective, run by train.py under the same flags, data, steps, batch, schedule and
retention term as xPRT (--objective):
  contrastive_random_span  Contriever-style: two random crops of a passage are a positive pair (InfoNCE)
  self_reconstruction      the paper's Table 3 ablation: xPRT's own conditioned decoder rebuilds a passage from that
                           passage's own vector (no related passages)
What the paper's setting changes for every arm: each pools as the start model does (XPRTModel.pool); each gets the
same retention term on the same pairs (anchor x s1); each trains on the anchors of the same groups.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from modeling_xprt import (ConditionedDecoder, GroupCollator, Layout, Objective, VocabSweep, gather_with_grad,
                           group_bounds, info_nce, mlm_loss, register_objective)
from support import rank_and_world


# ==============================================================================================================
# Random spans (Contriever)
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
        c = contrastive_random_span(vec[:, 0], vec[:, 1], model.tau)  # the longer crop is the query
        return c, {"contrastive_loss": c}


class RandomSpanCollator(GroupCollator):
    """Contriever's random cropping of each group's anchor (ratio uniform in [0.1, 0.5]), plus the retention fields.
    Its batches are grouped by the crops' lengths (sort_lengths), which dealing one document's groups apart would
    undo."""

    DEFAULT_RATES = (0.0, 0.0)
    spread_documents = False

    def __init__(self, tokenizer, crop_ratio: tuple = (0.1, 0.5), **kw):
        super().__init__(tokenizer, **kw)
        self.crop_ratio = crop_ratio

    def __call__(self, rows: list) -> dict:
        batch = self.retention_fields(rows)
        spans = [r["crop_spans"] for r in rows] if "crop_spans" in rows[0] else None
        batch.update(self._crops([r["anchor"] for r in rows], spans))
        batch["layout"] = Layout(len(rows))
        return batch

    def sort_lengths(self, groups, seed: int, batch_size: int = 8192):
        """The random-span baseline's batching: (epoch -> lengths for the sampler, (epoch, row) -> its crop spans).

        Its views are two random crops of each anchor (XPRTCollator._crops), not the texts: grouping rows by text length
        left about half of each batch padding (padding efficiency 0.49-0.53). So the crops are drawn before batching,
        per (seed, epoch) for every row at once (modeling_xprt.crop_spans, from each anchor's token count, counted
        here once: one tokenizer pass over the anchors, an int32 per row), the sampler sorts by the crops' lengths
        (longer, shorter: two tensors, LengthGroupedBatchSampler._longest_first), and the loop hands each row its
        spans. One epoch's spans are kept at a time (16 bytes per row)."""
        num_tokens = np.empty(len(groups), dtype=np.int32)
        pos = 0
        for batch in groups.select_columns(["anchor"]).iter(batch_size=batch_size):
            ids = self.crop_token_ids(batch["anchor"])
            num_tokens[pos:pos + len(ids)] = [len(x) for x in ids]
            pos += len(ids)
        cache = {}

        def spans_for(epoch):
            if epoch not in cache:
                cache.clear()
                cache[epoch] = crop_spans(num_tokens, seed, epoch, self.crop_ratio)
            return cache[epoch]

        def lengths_for(epoch):  # (N, 2): the longer and the shorter crop
            k = spans_for(epoch)[:, :, 1]
            return np.stack([k.max(1), k.min(1)], axis=1)

        return lengths_for, lambda epoch, i: {"crop_spans": spans_for(epoch)[i]}

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

    def crop_token_ids(self, texts) -> list:
        """The tokens random cropping draws from: each text's own tokens, cut to max_length (no specials)."""
        return self.tokenizer(list(texts), add_special_tokens=False, truncation=True,
                              max_length=self.max_length)["input_ids"]


def crop_spans(num_tokens, seed: int, epoch: int, crop_ratio: tuple = (0.1, 0.5)):
    """Both random crops of every row, drawn at once for an epoch: (N, 2, 2) int64 [start, length] per view, from
    num_tokens (N,) (RandomSpanCollator.crop_token_ids' lengths). A function of (seed, epoch) only, so the batch sampler
    can group rows by their crops' lengths before any batch is collated, and a resumed run draws the same crops.
    The draws of RandomSpanCollator._crops: length = max(1, round(ratio * n)), ratio ~ U[crop_ratio], start uniform over
    the places the span fits."""
    n = np.asarray(num_tokens, dtype=np.int64)[:, None]  # (N, 1)
    rng = np.random.default_rng([seed, epoch])
    lo, hi = crop_ratio
    ratio = lo + (hi - lo) * rng.random((len(n), 2))
    k = np.maximum(1, np.round(ratio * n).astype(np.int64))
    start = np.floor(rng.random((len(n), 2)) * np.maximum(1, n - k + 1)).astype(np.int64)
    return np.stack([start, k], axis=-1)


# ==============================================================================================================
# Self-reconstruction (the paper's Table 3 ablation)
# ==============================================================================================================


def self_reconstruction(sweep: VocabSweep, dec_hidden: torch.Tensor, dec_targets: torch.Tensor,
                        enc_hidden: torch.Tensor, enc_targets: torch.Tensor, shares=(1.0, 1.0)) -> None:
    """The paper's self-reconstruction ablation: L = L_recon + L_MLM, weights 1 and 1. The encoder reads the passage
    30%-masked (L_MLM, mlm_loss); xPRT's one-layer conditioned decoder rebuilds the passage, 50%-masked, from the
    passage's own vector (L_recon: cross-entropy at the decoder's masked positions). Both terms go to the step's
    VocabSweep, whose weighted sum is this loss. shares: (L_recon's, L_MLM's) share of the batch's rows when the rows
    are a chunk of it (Layout.share). RetroMAE proper (two-stream decoding) is its own objective."""
    sweep.cross_entropy("recon_loss", dec_hidden, dec_targets, 1.0, shares[0])
    mlm_loss(sweep, enc_hidden, enc_targets, 1.0, shares[1])


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

    def encode(self, model, batch):
        ids, am = batch["input_ids"], batch["attention_mask"]  # (G, L)
        hidden, vec = model.encode(ids, am)
        return hidden.reshape(-1, hidden.shape[-1]), vec.unsqueeze(1)  # (G * L, H), (G, 1, H)

    def row_terms(self, model, batch, states, vec):
        ids, am = batch["dec_input_ids"], batch["attention_mask"]  # (G, L)
        emb = model.token_embeddings(ids, am)
        dec_flat = self.decoder(vec[:, 0].to(emb.dtype), emb, am).reshape(-1, emb.shape[-1])
        layout, sweep = batch["layout"], VocabSweep(model)
        self_reconstruction(sweep, dec_flat.index_select(0, batch["dec_rows"]), batch["dec_targets"],
                            states.index_select(0, batch["mlm_index"]), batch["mlm_targets"],
                            shares=(layout.share("dec"), layout.share("mlm")))
        return sweep.run()


class SelfReconstructionCollator(GroupCollator):
    """Each group's anchor, 30%-masked for the encoder (BERT's 80/10/10) and, independently, 50%-masked (all [MASK])
    for the decoder (RetroMAE's rates)."""

    DEFAULT_RATES = (0.30, 0.50)

    def __init__(self, tokenizer, num_condition_vectors: int = 4, **kw):
        super().__init__(tokenizer, **kw)
        self.num_condition_vectors = num_condition_vectors

    def __call__(self, rows: list) -> dict:
        batch = self.retention_fields(rows)
        enc = self._tokenize([r["anchor"] for r in rows])
        ids, am = enc["input_ids"], enc["attention_mask"]
        g, l = ids.shape
        cand = self._candidates(enc)
        masked, labels = self._mask_bert(ids, cand, self.encoder_mask_rate)
        dec_ids, dec_labels = self._mask_all(ids, cand, self.decoder_mask_rate)
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
