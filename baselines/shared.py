"""What the comparison arms share: the two settings (--baseline_setting), whole-word masking (RetroMAE and
SimLM) and the collator of each group's anchor passage. The arms and their departures: baselines/__init__.py."""

from __future__ import annotations

from typing import Optional

import torch

from modeling_xprt import GroupCollator, Layout, group_bounds, group_lengths, unpadded_rand

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
                    generator: Optional[torch.Generator] = None, max_predictions: int = 512,
                    width: Optional[int] = None) -> torch.Tensor:
    """The whole-word mask of RetroMAE and SimLM (transformers' DataCollatorForWholeWordMask._whole_word_mask, copied
    into SimLM's collator_utils.whole_word_mask): the words are taken in a random order, each whole, until

        num_to_predict = min(max_predictions, max(1, round(num_tokens * rate)))        (num_tokens with [CLS], [SEP])

    tokens are masked; a word that would overshoot is skipped and later (shorter) words still fill the budget. So the
    rate is a count, not a Bernoulli draw: exactly round(0.3 n) tokens when the words fit (RetroMAE's and SimLM's
    encoder 0.3, decoder 0.5, tests: test_whole_word_mask_*).

    word_ids (N, L) int64 (-1: not a candidate; GroupCollator._tokenize), num_tokens (N,) -> (N, L) bool; the
    shuffle's keys are drawn over the real width (unpadded_rand; `width`: the batch's, given on a device). Tensor
    operations on word_ids' device; the one Python loop runs over the L word slots, each step over all N rows at once
    (the greedy skip makes each word's fate depend on the words before it)."""
    n, l = word_ids.shape
    device = word_ids.device
    valid = word_ids >= 0
    word = word_ids.clamp(min=0)  # (N, L); word ids are below L (one word per token at most)
    length = torch.zeros(n, l, dtype=torch.long, device=device).scatter_add_(1, word, valid.long())  # tokens per word
    # random.shuffle of the candidate words: a uniform random order; missing words sort last
    keys = unpadded_rand(length > 0, generator, width=width).masked_fill(length == 0, 2.0)
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
                    generator: Optional[torch.Generator] = None, all_mask_token: bool = False,
                    left: bool = False) -> torch.Tensor:
    """What the encoder reads at the masked positions: BERT's 80% [MASK] / 10% a random token / 10% unchanged
    (transformers' torch_mask_tokens: RetroMAE's encoder), or [MASK] everywhere (all_mask_token: SimLM's
    --all_use_mask_token True in scripts/train_rlm.sh). Drawn over the masked positions' real width
    (unpadded_rand; left: a left-padding tokenizer's)."""
    if all_mask_token:
        return ids.masked_fill(masked, mask_token_id)
    u = unpadded_rand(masked, generator, left)
    out = ids.masked_fill(masked & (u < 0.8), mask_token_id)
    rnd = masked & (u >= 0.8) & (u < 0.9)
    return torch.where(rnd, unpadded_rand(masked, generator, left, high=vocab_size), out)


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
        original token at every maskable position (-100 elsewhere), real_width the unpadded width (a Python int: the
        step's draws on the device are made over it, unpadded_rand)."""
        batch = self.retention_fields(rows)
        enc = self._tokenize([self.passage(r, "anchor") for r in rows])
        word_ids, am = enc["word_ids"], enc["attention_mask"]
        batch.update(input_ids=enc["input_ids"], attention_mask=am, word_ids=word_ids,
                     num_tokens=am.sum(1) - len(self.prefix_ids),
                     targets=enc["input_ids"].masked_fill(word_ids < 0, -100), real_width=int(am.any(0).sum()))
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
