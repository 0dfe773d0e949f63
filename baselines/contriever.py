"""Contriever (Izacard et al. 2022), as its authors' code runs it (facebookresearch/contriever src/{data.py,
inbatch.py, moco.py, contriever.py, options.py}, the README's training command): two independent random crops, word
deletion, InfoNCE at tau 0.05 over in-batch negatives or a MoCo queue. --objective contriever; and its cropping
alone, --objective contrastive_random_span (section 2)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from baselines.shared import SETTING_FLAG, AnchorCollator, scoring_of, setting_of
from modeling_xprt import (GroupCollator, Layout, Objective, gather_with_grad, info_nce, pad_to_multiple,
                           register_objective)
from plumbing.architectures import layer_multiply_adds
from plumbing.common import UserError, momentum, positive_int, rank_and_world

# ==============================================================================================================
# 1. Contriever's random spans (Izacard et al. 2022): two independent crops, word deletion, InfoNCE, tau 0.05
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
            batch[f"{name}_input_ids"], batch[f"{name}_attention_mask"] = pad_to_multiple(
                ids, am, self.pad_to_multiple_of, tok.pad_token_id)
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

    def negatives(self, model, batch):  # inbatch: every other row's second crop (gathered); moco: the queue's keys
        docs = batch["doc_ids"]
        n = self.moco.queue.shape[1] if self.moco is not None else len(gather_with_grad(docs)) - 1
        return torch.full_like(docs, n)


# ==============================================================================================================
# 2. Random spans (contrastive_random_span): two random crops of one passage as a positive pair, cosine
#    InfoNCE over in-batch negatives, no augmentation; Contriever's cropping without the rest of its recipe
# How it differs from Contriever's code (src/data.py, inbatch.py, moco.py, options.py, the README's run), which
# section 1 follows:
#   - crop length max(1, round(r n)) here; int(r n) there (floor; 0 for a short text, leaving [CLS] [SEP] only)
#   - no augmentation here; there each token of a crop is deleted with p 0.1 (--augmentation delete
#     --prob_augmentation 0.1 in the README's run and example_scripts/contriever.sh; options.py's default is none)
#   - scores cos / 0.05 here; there dot products of the unnormalised mean-pooled vectors / 0.05 (--norm_query and
#     --norm_doc off): all-MiniLM-L6-v2's vectors have norms 3.9-8.3, so its logits run in the hundreds
#   - the longer crop is always the query here; there the first crop drawn (either length); with a one-direction
#     loss this is a choice of which side the negatives come from, not only a labelling
#   - in-batch negatives here; section 1 has both (in-batch, and the MoCo queue of a momentum encoder the README's
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

    def negatives(self, model, batch):  # every other row's shorter crop, gathered: no document mask
        return torch.full_like(batch["doc_ids"], len(gather_with_grad(batch["doc_ids"])) - 1)


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
            return pad_to_multiple(ids, am, self.pad_to_multiple_of, tok.pad_token_id)

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
