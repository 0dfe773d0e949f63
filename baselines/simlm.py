"""SimLM (Wang et al. 2023), as its authors' code runs it (microsoft/unilm simlm/src/{models/rlm.py,
collators/rlm_collator.py, collators/collator_utils.py, config.py}, simlm/scripts/train_rlm.sh): replaced language
modelling with a frozen ELECTRA generator and a 2-layer decoder. --objective simlm."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from baselines.shared import (SETTING_FLAG, AnchorCollator, bert_corruption, never_unk, scoring_of, setting_of,
                              whole_word_mask)
from modeling_xprt import Objective, register_objective
from plumbing.architectures import (copy_last_layers, layer_multiply_adds, linear_cross_entropy, mask_for_layers,
                                    probe_prepared_mask)
from plumbing.common import resolve_model_path

# ==============================================================================================================
# SimLM (Wang et al. 2023): replaced language modelling, a frozen ELECTRA generator, a 2-layer decoder
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
                   masked: torch.Tensor, max_logits: int = 2 ** 27, width: Optional[int] = None) -> torch.Tensor:
    """SimLM's replacement (rlm.py _replace_tokens): the frozen generator reads the masked text, and at each masked
    position a token is SAMPLED from its distribution (Categorical(logits), temperature 1; it may be the original);
    other positions keep their token:  x~_i = sample(softmax(G(x_masked))_i) if i masked else x_masked_i.
    No gradient. Rows go through the generator in chunks of at most max_logits (rows x L x V) logits. Sampled at the
    first `width` positions only (the batch's real width; default L), so --pad_to_multiple_of changes no sample."""
    g, l = input_ids.shape
    width = l if width is None else width
    rows = max(1, max_logits // max(1, width * generator.config.vocab_size))
    out = input_ids.clone()
    with torch.no_grad():
        for a in range(0, g, rows):
            mask = mask_for_layers(generator.base_model, attention_mask[a:a + rows])
            logits = generator(input_ids=input_ids[a:a + rows], attention_mask=mask).logits
            # validate_args=False: the check that the logits are finite reads a device value (a host sync each
            # call; bench/bench_step_ops.py); it draws nothing, so the samples are the same
            sampled = torch.distributions.Categorical(logits=logits[:, :width].float(), validate_args=False).sample()
            out[a:a + rows, :width] = torch.where(masked[a:a + rows, :width], sampled, input_ids[a:a + rows, :width])
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
        corrupt = [bert_corruption(ids, m, tok.mask_token_id, len(tok), self.generator, self.all_mask_token,
                                   tok.padding_side == "left") for m in (enc, dec)]
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
    model_flags = ("--generator_name_or_path",)
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
        self.held_modules = (gen,)  # a tuple: nn.Module does not register what it holds

    @property
    def generator(self) -> nn.Module:
        return self.held_modules[0]

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
        w = batch.get("real_width")
        return {**batch, "enc_input_ids": replace_tokens(gen, ids, am, batch["enc_masked"], width=w),
                "dec_input_ids": replace_tokens(gen, batch["dec_input_ids"], am, batch["dec_masked"], width=w)}

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
