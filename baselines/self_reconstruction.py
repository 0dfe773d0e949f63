"""The paper's Table 3 ablation, --objective self_reconstruction: xPRT's own conditioned decoder rebuilds a
passage from that passage's own vector (no related passages)."""

from __future__ import annotations

import torch

from modeling_xprt import (ConditionedDecoder, GroupCollator, Layout, Objective, group_bounds, mlm_loss,
                           register_objective)
from plumbing.architectures import linear_cross_entropy

# ==============================================================================================================
# Self-reconstruction (the paper's Table 3 ablation)
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
