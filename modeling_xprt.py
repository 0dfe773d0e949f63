"""
xPRT's model and its equations (the xPRT paper, "The objective"; the PAIR paper for the fine-tuning stage).

Read it top to bottom beside the paper:
  1. pooling and gathers (in-batch negatives)
  2. the equations, in the paper's order: L_xp, L_cross, L_self, L_MLM, L_unif, L_retain and w(t); PAIR's L_Q, L_P
  3. the decoder: the 10 passes of a group, the one-layer conditioned decoder
  4. the objectives: one class each (xPRT, PAIR)
  5. what the model is beyond its weights: its length limit, pooling, scoring, the modules after pooling
  6. the model: the encoder with its MLM head, XPRTModel (the step and the gradient cache), the batch embedder
  7. the batch's Layout, which the gradient cache cuts by
  8. the collators: rows -> one batch of tensors and its Layout
It imports one file of the repository, plumbing/architectures.py: the two, copied into another project, build and
train the model (tests/test_lifting.py). Comparison objectives: baselines/; model folders: plumbing/model_folder.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import itertools
import logging
import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plumbing.architectures import (decoder_layers, encoder_pieces, head_params, layer_multiply_adds, layer_runner,
                                    linear_cross_entropy, linear_kl_div, longest_input, mask_for_layers, runs_at_length)

logger = logging.getLogger("xprt")

# ==============================================================================================================
# 1. Pooling and gathers
# ==============================================================================================================

def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors over the attention mask: the sentence vector of E5 and xPRT.

    hidden (B, L, H), attention_mask (B, L) -> (B, H). Not normalised: callers normalise when they need cosines, so
    the same function serves losses that want raw vectors.
    Worked example: token vectors (1, 2), (3, 4) and a padded (9, 9), mask 1 1 0 -> (2, 3)."""
    mask = attention_mask.unsqueeze(-1).to(torch.float32)  # (B, L, 1)
    # fp32 sums: a bf16 encoder's vectors would otherwise carry bf16's 3 significant digits into every cosine;
    # clamp: an all-padding row (never produced by our collators) would otherwise divide by zero
    return (hidden.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)

def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cos(a_i, b_j) as an (A, B) fp32 matrix: what every similarity-based term is built on (L_xp and the baselines'
    InfoNCE, L_unif, the retention KL, PAIR's L_Q and L_P). fp32 with autocast off: bf16 autocast would recast the
    matmul's inputs to bf16 whatever .float() came before it, too coarse at tau = 0.05 (docs/notes.md: Numerics)."""
    with torch.autocast(a.device.type, enabled=False):
        return F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).t()

def gather_with_grad(t: torch.Tensor) -> torch.Tensor:
    """Concatenate `t` from every process along dim 0, keeping gradients (identity when not distributed).

    torch.distributed.nn's all_gather backward SUMS each loss's gradients into the local slice, so each process
    takes its loss on its LOCAL rows; DDP's averaging then gives the global mean's gradient
    (tests/test_modeling.py::test_two_process_gather_equals_single_process). Equal rows per process (drop_last)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return t
    import torch.distributed.nn.functional as dist_fn

    with warnings.catch_warnings():
        # deprecated, but _functional_collectives' backward is a reduce_scatter, which gloo (CPU) lacks
        warnings.simplefilter("ignore", FutureWarning)
        return torch.cat(dist_fn.all_gather(t.contiguous()), dim=0)

# ==============================================================================================================
# 2. The equations, in the paper's order
# L_xp (the main term), L_cross (fill-in), L_self, L_MLM, L_unif, the retention KL; then PAIR's L_Q, L_P and their
# mix. Each returns its value.
# ==============================================================================================================

def info_nce(queries: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, tau: float,
             exclude: Optional[torch.Tensor] = None) -> torch.Tensor:
    """-log softmax(cos(q, k) / tau)[label], averaged over queries.

    Also known as MultipleNegativesRankingLoss; temperature tau = 0.05 is sentence-transformers' scale = 20.
    `exclude` (Q, K) bool marks candidates removed from the denominator (never the label).
    Worked example: q = e1, keys e1 (the label) and e2, tau = 1: -log(e / (e + 1)) = 0.3133;
    K keys at one cosine: ln K."""
    logits = cosines(queries, keys) / tau  # (Q, K), fp32
    if exclude is not None:
        logits = logits.masked_fill(exclude, float("-inf"))
    return F.cross_entropy(logits.float(), labels)

def xp_loss(anchors: torch.Tensor, s1: torch.Tensor, doc_ids: torch.Tensor, tau: float = 0.05) -> torch.Tensor:
    """L_xp, the paper's main term: symmetric InfoNCE between each anchor and its top related passage s1.

        L_xp = -log exp(cos(e_a, e_s1) / tau) / sum_{g'} exp(cos(e_a, e_s1') / tau),   tau = 0.05

    The denominator runs over the s1' of every group g' of the batch - gathered from all processes, with gradients
    (gather_with_grad) - and, in reverse, s1 picks its anchor among all anchors; the two directions are averaged.
    Groups of the same document are never negatives ("they are related too"): their logits are removed, except the
    group's own positive. Worked example (paper): 3 groups, cos 0.8 to the own s1 and 0.5 to the others ->
    p = e^16 / (e^16 + 2 e^10) = 0.995, L_xp = -ln p = ln(1 + 2 e^-6) = 0.0049.

    anchors, s1: (N, H) local rows; doc_ids: (N,) int64. Returns the mean over the local rows."""
    all_anchors, all_s1 = gather_with_grad(anchors), gather_with_grad(s1)  # (N * world, H)
    all_docs = gather_with_grad(doc_ids)
    n = anchors.shape[0]
    rank = torch.distributed.get_rank() if len(all_s1) > n else 0  # gathered from more than one process
    labels = torch.arange(n, device=anchors.device) + rank * n  # own group's index in the gathered batch
    same_doc = doc_ids.unsqueeze(1) == all_docs.unsqueeze(0)  # (N, N * world)
    same_doc[torch.arange(n, device=anchors.device), labels] = False  # the positive stays
    a_to_s = info_nce(anchors, all_s1, labels, tau, same_doc)
    s_to_a = info_nce(s1, all_anchors, labels, tau, same_doc)
    return 0.5 * (a_to_s + s_to_a)

def cross_fill_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L_cross (weight 0.1): masked-token cross-entropy of the conditioned one-layer decoder.

        L_cross = mean over masked positions m of -log softmax(W transform(h_dec[m]) + b)[x_m]

    The anchor's vector -> one linear map -> 4 conditioning vectors inserted after [CLS] of a related passage whose
    tokens are 60% masked; the decoder predicts the masked words through the encoder's own MLM head (transform, then
    the vocabulary projection W, b). Both directions: the anchor fills each of the 4 related passages, each related
    passage fills the anchor (8 of the 10 passes of decoder_pass_plan). hidden: (M, H) decoder states at the masked
    positions of all cross passes of all groups, targets (M,) the original tokens.
    Worked example: uniform logits (W = 0, b = 0) over BERT's V = 30,522 words: ln V = 10.326."""
    # the (M, V) logits are never held: linear_cross_entropy projects and takes the cross-entropy chunk by chunk
    return linear_cross_entropy(model.transform(hidden), model.vocab_weight, model.vocab_bias, targets,
                                fused=model.fused_vocab_loss)

def self_fill_loss(model, hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """L_self: the decoder fills a passage's own masked words from that passage's own vector; the target is the
    encoder's word distribution at the same positions of its 15%-masked pass (detached: a teacher):

        L_self = mean over masked positions m of KL( softmax(z_enc[m]) || softmax(z_dec[m]) ),
        z = W transform(h) + b   (the logits over the vocabulary)

    Anchor and s1 only (the 2 self passes of decoder_pass_plan). hidden: (M, H) decoder states, teacher_hidden:
    (M, H) encoder states at the same tokens.
    Worked example: equal distributions (hidden = teacher_hidden) give L_self = 0."""
    with torch.no_grad():
        teacher = model.transform(teacher_hidden.detach())
    return linear_kl_div(model.transform(hidden), teacher, model.vocab_weight, model.vocab_bias,
                         fused=model.fused_vocab_loss)

def mlm_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L_MLM: the encoder's masked-LM cross-entropy on the 15%-masked passes that also give the sentence vectors
    (BERT's 80/10/10 masking, XPRTCollator); it keeps the teacher of L_self from drifting.

        L_MLM = mean over masked positions m of -log softmax(W transform(h_enc[m]) + b)[x_m]

    hidden: (M, H) encoder states at the masked positions, targets (M,) the original tokens.
    Worked example: V = 4, logits (ln 2, 0, 0, 0), target the first word: -log(2 / 5) = 0.916."""
    return linear_cross_entropy(model.transform(hidden), model.vocab_weight, model.vocab_bias, targets,
                                fused=model.fused_vocab_loss)

def uniformity_loss(vectors: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """L_unif (Wang & Isola 2020): log mean_{i != j} exp(-t ||x_i - x_j||^2), x L2-normalised, t = 2.

    On the batch's anchors, so they do not collapse into one cluster. Local batch only: one group gives 0.
    Worked example: two orthogonal unit vectors, ||x - y||^2 = 2: log exp(-2 * 2) = -4; equal: 0."""
    n = vectors.shape[0]
    if n < 2:  # the mean over no pair: nothing to push apart (and log(n (n - 1)) is undefined)
        return vectors.float().sum() * 0.0
    with torch.autocast(vectors.device.type, enabled=False):  # fp32, as in cosines; one normalisation for both sides
        x = F.normalize(vectors.float(), dim=-1)
        sq = (2 - 2 * x @ x.t()).clamp(min=0)  # ||x - y||^2 for unit vectors, (N, N)
    # i != j by a -inf diagonal, not a boolean-mask gather (whose data-dependent size is a device-to-host sync)
    diag = torch.eye(n, dtype=torch.bool, device=vectors.device)
    return torch.logsumexp((-t * sq).masked_fill(diag, float("-inf")).flatten(), dim=0) - math.log(n * (n - 1))

def retention_loss(student_anchors, student_related, teacher_anchors, teacher_related,
                   tau: float = 0.05) -> torch.Tensor:
    """L_retain: keep the frozen starting model's (E5's) view of which passages resemble which.

    S = cos(anchors, related) / tau for the current model and T for the frozen teacher (unmasked text, no gradient),
    both (N, N) over the batch's anchors x top related passages:
        L_retain = 1/2 [ KL(softmax_row(T) || softmax_row(S)) + KL(softmax_col(T) || softmax_col(S)) ],
    each KL averaged over rows/columns. tau = 0.05 (L_xp's) is ours: the paper gives none.
    Worked example: a teacher that tells 2 pairs apart (cos 1 and 0), a student that does not (all
    cos 1): KL(one-hot || uniform) = ln 2 = 0.693; a student equal to the teacher: 0."""
    s = cosines(student_anchors, student_related) / tau
    with torch.no_grad():
        t = cosines(teacher_anchors, teacher_related) / tau

    # rows: KL(softmax_row(T) || softmax_row(S)) averaged over rows; columns: the same on the transposes
    rows = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
    cols = F.kl_div(F.log_softmax(s.t(), -1), F.log_softmax(t.t(), -1), log_target=True, reduction="batchmean")
    return 0.5 * (rows + cols)

def retention_weight(step: int, total: int, start: float = 40.0, end: float = 0.0, shape: str = "linear") -> float:
    """Weight of the retention term at optimiser step t = `step` of T = `total`: the paper's 40 -> 0 decay.

    w(t) = w_0 + (w_T - w_0) s(t / T), s(x) = x (linear), (1 - cos(pi x)) / 2 (cosine) or 0 (constant).
    A function of the step alone (a resume continues the decay). 0 at both ends turns the term off. Step t
    (0 .. T-1) trains with w(t), as the lr schedule: the last step's weight is w(T-1).
    Worked example: 40 -> 0 over T = 6: w(0) = 40, w(3) = 20 (cosine too), w(5) = 6.67, w(6) = 0."""
    frac = min(step / max(1, total), 1.0)
    if shape == "constant":
        frac = 0.0
    elif shape == "cosine":
        frac = 0.5 * (1 - math.cos(math.pi * frac))
    return start + (end - start) * frac

def pair_false_negatives(candidate_ids: torch.Tensor, relevant_ids: torch.Tensor,
                         labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The in-batch false negatives of PAIR's losses, as the `exclude` mask of info_nce:

        exclude[i, c] = (id(c) in R_i) and (c != label_i),   R_i = ids of every passage labelled relevant to q_i

    Ids are stable_doc_hash of the passage text. candidate_ids: (C,) int64, gathered; relevant_ids: (B, R) int64,
    padded by repeating a row's own id (PairCollator); labels: (B,) each row's own column, which stays.
    Returns (B, C) bool."""
    exclude = (relevant_ids.unsqueeze(-1) == candidate_ids.view(1, 1, -1)).any(dim=1)  # (B, R, C) -> (B, C)
    if labels is not None:
        exclude[torch.arange(exclude.shape[0], device=exclude.device), labels] = False
    return exclude

def pair_q_loss(queries: torch.Tensor, passages: torch.Tensor, tau: float = 0.05,
                passage_ids: Optional[torch.Tensor] = None,
                relevant_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PAIR's query-centric L_Q (Eq. 1): the query picks its positive among its positive, its hard negatives and
    every other passage of the batch gathered from all processes (cross-batch negatives):
        L_Q = -log exp(f(q, p+)) / (exp(f(q, p+)) + sum_{p- in N_P} exp(f(q, p-))),  f = cos / tau.
    queries: (B, H); passages: (B, 1 + n, H), positive first. N_P leaves out the false negatives when the ids are
    given (pair_false_negatives): passage_ids (B, 1 + n) int64; relevant_ids (B, R) int64 (None: own positive).
    Worked example: cos(q, p+) = 0.8, cos(q, p-) = 0.5, tau = 0.05: L_Q = ln(1 + e^-6) = 0.0025."""
    b, k, h = passages.shape
    all_p = gather_with_grad(passages.reshape(b * k, h))  # (world * B * k, H)
    rank = torch.distributed.get_rank() if len(all_p) > b * k else 0  # gathered from more than one process
    labels = (torch.arange(b, device=queries.device) + rank * b) * k
    exclude = None
    if passage_ids is not None:
        relevant_ids = passage_ids[:, :1] if relevant_ids is None else relevant_ids
        exclude = pair_false_negatives(gather_with_grad(passage_ids.reshape(b * k)), relevant_ids, labels)
    return info_nce(queries, all_p, labels, tau, exclude)

def pair_p_loss(queries: torch.Tensor, passages: torch.Tensor, tau: float = 0.05,
                passage_ids: Optional[torch.Tensor] = None,
                relevant_ids: Optional[torch.Tensor] = None, form: str = "query",
                normalize: bool = True) -> torch.Tensor:
    """PAIR's passage-centric L_P (Eq. 2): p+ is the anchor, the candidates are N_P (its hard negatives and every
    other query's, gathered across processes) and the label; f(x, y) = cos(x, y) / tau (normalize=False: x.y / tau).
      form="query" (default, PAIR's official code; it enforces s(p+, q) > s(p+, p-)):
        L_P = -log exp(f(p+, q)) / (exp(f(p+, q)) + sum_{p- in N_P} exp(f(p+, p-)))
      form="summary" (papers/pair.md as printed; with unit vectors exp(-f(p+, p+)) = exp(-1 / tau), a constant):
        L_P = -log exp(-f(p+, p+)) / (exp(-f(p+, p+)) + sum_{p- in N_P} exp(f(p+, p-)))
    Worked example: cos(p+, q) = 0.8, cos(p+, p-) = 0.4, tau 0.05: query form ln(1 + e^-8) = 0.00034.
    Both forms (tau 1; p+ = (1, 0), q = (0.6, 0.8), N_P = {(0, 1), (-1, 0)}): query log(1 + e^-0.6 + e^-1.6)
    = 0.5600, summary log(1 + e^1 + e^0) = 1.5514. Needs >= 1 negative per query. With passage_ids /
    relevant_ids (as in pair_q_loss) N_P leaves out the negatives labelled relevant to q (pair_false_negatives)."""
    if form not in ("query", "summary"):
        raise ValueError(f"pair_p_loss: form {form!r} is not 'query' or 'summary'")
    b, k, h = passages.shape
    if k < 2:
        raise ValueError("pair_p_loss needs at least one negative passage per query (num_negatives >= 1)")
    pos = passages[:, 0]  # (B, H)
    all_neg = gather_with_grad(passages[:, 1:].reshape(b * (k - 1), h))  # (world * B * n, H)
    with torch.autocast(pos.device.type, enabled=False):  # fp32, as in cosines; p+ normalised once for both columns
        pos_n, q_n, neg_n = (F.normalize(x.float(), dim=-1) if normalize else x.float()
                             for x in (pos, queries, all_neg))
        label = (pos_n * q_n).sum(-1, keepdim=True) if form == "query" else -(pos_n * pos_n).sum(-1, keepdim=True)
        logits = torch.cat([label, pos_n @ neg_n.t()], dim=1) / tau  # (B, 1 + W*B*n)
    if passage_ids is not None:
        relevant_ids = passage_ids[:, :1] if relevant_ids is None else relevant_ids
        neg_ids = gather_with_grad(passage_ids[:, 1:].reshape(b * (k - 1)))
        # column 0 is the label: never excluded
        exclude = torch.cat([torch.zeros(b, 1, dtype=torch.bool, device=pos.device),
                             pair_false_negatives(neg_ids, relevant_ids)], dim=1)
        logits = logits.masked_fill(exclude, float("-inf"))
    return F.cross_entropy(logits.float(), torch.zeros(b, dtype=torch.long, device=pos.device))

def pair_loss(l_q: torch.Tensor, l_p: torch.Tensor, alpha: float) -> torch.Tensor:
    """PAIR's combined objective (Eq. 3): L = (1 - alpha) L_Q + alpha L_P. alpha = 0 is plain fine-tuning (PAIR's
    second stage); the official code's pre-training stage uses alpha = 0.1 constant, the paper describes a decaying
    alpha: both are schedules of finetune.py (pair_alpha_at).
    Worked example: L_Q = 2, L_P = 4, alpha = 0.1: 0.9 * 2 + 0.1 * 4 = 2.2."""
    return (1.0 - alpha) * l_q + alpha * l_p

@dataclass
class LossWeights:
    """Weights of the xPRT terms. L = xp * L_xp + cross * L_cross + self_fill * L_self + mlm * L_MLM + unif * L_unif
    (+ w(t) L_retain, train.py). xp and cross are the paper's; the rest are OURS, at L_cross's 0.1."""

    xp: float = 1.0
    cross: float = 0.1
    self_fill: float = 0.1  # ours
    mlm: float = 0.1  # ours
    unif: float = 0.1  # ours

# ==============================================================================================================
# 3. The decoder
# A group's 10 passes (8 cross, 2 self) and the one-layer decoder that runs them all in one call. The collator
# builds the passes' inputs and the rows each loss reads from the decoder's output (ConditionedDecoder.output_rows).
# ==============================================================================================================

def decoder_pass_plan(num_related: int, fill_in: bool = True):
    """The decoder passes of one group, in batch order: (condition_source, target, kind) lists.

    0 = anchor, 1 = s1, ..., num_related. With 4: passes 0-3 anchor -> related_k, 4-7 related_k -> anchor (cross),
    8 anchor -> anchor, 9 s1 -> s1 (self): the paper's 10. fill_in=False (the ablation) keeps the 2 self passes."""
    r = list(range(1, num_related + 1))
    source = [0] * num_related + r + [0, 1]
    target = r + [0] * num_related + [0, 1]
    kind = ["cross"] * (2 * num_related) + ["self", "self"]
    keep = [i for i, k in enumerate(kind) if fill_in or k == "self"]
    return [source[i] for i in keep], [target[i] for i in keep], [kind[i] for i in keep]

class ConditionedDecoder(nn.Module):
    """xPRT's fill-in decoder: vector -> one linear map -> C conditioning vectors, inserted right
    after [CLS] of a masked passage embedded by the ENCODER's own embedding layer, then one
    Transformer layer of the encoder's own kind, run as the encoder runs its layers (architectures.decoder_layers,
    run_layers). Predictions go through the encoder's MLM head, so the decoder owns only `condition` and `layers`."""

    def __init__(self, encoder, num_condition_vectors: int = 4, num_layers: int = 1):
        """encoder: the AutoModelForMaskedLM whose architecture the layers take (its config and weight init)."""
        super().__init__()
        config = encoder.config
        self.config = config
        self.num_condition_vectors = num_condition_vectors
        self.condition = nn.Linear(config.hidden_size, num_condition_vectors * config.hidden_size)
        self.layers = decoder_layers(encoder, num_layers)
        # the encoder runs the layers (its masks and positions); outside the module tree: not the decoder's weights
        object.__setattr__(self, "run_layers", layer_runner(encoder))
        self.apply(encoder._init_weights)  # the encoder's init for the fresh decoder, as RetroMAE does
        # ours: C stacked identities (+ the init's noise), so the decoder does not start out ignoring the vector
        with torch.no_grad():
            self.condition.weight += torch.eye(config.hidden_size).repeat(num_condition_vectors, 1)

    def forward(self, vectors, token_embeddings, attention_mask):
        """vectors (N, H), token_embeddings (N, L, H), attention_mask (N, L) -> (N, L + C, H).

        Output position 0 is [CLS], 1..C the conditioning slots, C+1.. the passage's tokens 1..L-1
        (output_rows maps input positions to these rows)."""
        n, _, h = token_embeddings.shape
        c = self.num_condition_vectors
        cond = self.condition(vectors).view(n, c, h)  # (N, C, H)
        x = torch.cat([token_embeddings[:, :1], cond, token_embeddings[:, 1:]], dim=1)  # (N, L + C, H)
        mask = torch.cat([attention_mask[:, :1], attention_mask.new_ones(n, c), attention_mask[:, 1:]], dim=1)
        return self.run_layers(self.layers, x, mask)

    def multiply_adds(self, dec_input_ids: torch.Tensor, layers) -> int:
        """Multiply-adds of the decoder's passes over (..., L) ids, its conditioning vectors included."""
        return layers(dec_input_ids, len(self.layers), self.num_condition_vectors)

    @staticmethod
    def output_rows(index: torch.Tensor, length: int, num_condition_vectors: int) -> torch.Tensor:
        """Flat positions in the decoder's (N, L) input -> flat rows of its (N, L + C, H) output, flattened: the C
        conditioning slots sit after position 0 ([CLS]), so row n's token j > 0 moves by C, and every row by n C."""
        c = num_condition_vectors
        return index + index // length * c + c * (index % length > 0)

# ==============================================================================================================
# 4. The objectives
# One class per --objective, each with the same few methods; XPRTModel.forward and the gradient cache
# (XPRTModel.cached_step) are written once over them.
# ==============================================================================================================

OBJECTIVES: dict = {}  # --objective name -> Objective class, as its module registers it (register_objective)
# Where each train.py --objective is defined, imported on first use (objective_class): an xPRT run imports no baseline
PRETRAINING_OBJECTIVES = {"xprt": "modeling_xprt", "retromae": "baselines.retromae", "simlm": "baselines.simlm",
                          "contriever": "baselines.contriever", "contrastive_random_span": "baselines.contriever",
                          "self_reconstruction": "baselines.self_reconstruction", "revela": "baselines.revela"}

def register_objective(cls):
    """Class decorator: make `cls` an --objective choice under cls.name."""
    OBJECTIVES[cls.name] = cls
    return cls

def objective_class(name: str):
    """The Objective class of --objective `name`, its module imported on first use (PRETRAINING_OBJECTIVES)."""
    if name not in OBJECTIVES and name in PRETRAINING_OBJECTIVES:
        importlib.import_module(PRETRAINING_OBJECTIVES[name])
    if name not in OBJECTIVES:
        raise ValueError(f"objective must be one of {sorted(set(OBJECTIVES) | set(PRETRAINING_OBJECTIVES))}, "
                         f"got {name!r}")
    return OBJECTIVES[name]

def pretraining_objectives() -> list:
    """The train.py --objective choices, without importing them."""
    return list(PRETRAINING_OBJECTIVES)

def objective_flags(names=None) -> dict:
    """{"--flag": (argparse keywords, [the objectives that take it])} over `names` (default: every train.py
    --objective; each imported), in their order."""
    found: dict = {}
    for name in pretraining_objectives() if names is None else names:
        for flag, spec in objective_class(name).flags.items():
            found.setdefault(flag, (spec, []))[1].append(name)
    return found

class Objective(nn.Module):
    """An objective: what one training step computes, split the way the gradient cache needs it.

      prepare(model, batch)              once per step, before any chunking, without gradient (SimLM's generator);
                                         None when there is nothing to prepare
      encode(model, batch)               the encoder passes -> (states, vec): vec (G, K, H) the sentence vectors the
                                         batch-wide terms read; states what the row terms need (token states)
      batch_terms(model, vec, batch)     the terms that couple rows only through their vectors (InfoNCE, L_unif)
      row_terms(model, batch, states, vec)  the terms each row computes from its own states (decoders, vocabulary
                                         terms): each a mean over the WHOLE batch's rows, also when `batch` is a
                                         chunk of it (Layout.row_share)
      total(terms, retention_weight)     the loss: the terms' weighted sum, linear, a missing term counting 0 (the
                                         gradient cache sums it over the batch terms and over each chunk's row terms)
      masked_student(vec)                the anchor and s1 vectors the retention term may reuse (G, 2, H), or None

    batch_terms and row_terms return {term name: value}. Its heads are submodules (xprt_heads.safetensors);
    `config()` is what xprt_config.json records to rebuild it."""

    name = ""
    pretraining = True  # trains on select_groups.py's groups (train.py) and gets the retention term
    trains_every_head = False  # every head parameter (its own, the MLM head's) gets a gradient: DDP needs no search
    forward_only_inputs: tuple = ()  # batch inputs encoded without gradient (MoCo's keys): no saved activations
    prepare = None  # or a method prepare(model, batch) -> batch (SimLM's generator, Revela's language model)
    held_modules: tuple = ()  # models it runs outside the module tree (not saved, not DDP's): SimLM's generator
    # {"--flag": argparse keywords}, each the constructor's option of its name; unset keeps the default
    flags: dict = {}
    model_flags: tuple = ()  # its flags that name a model it loads: checked before the run, recorded among its inputs

    @classmethod
    def options_from_flags(cls, args) -> dict:
        """The constructor's options the parsed flags set: each of cls.flags given on the command line."""
        dests = [f.lstrip("-") for f in cls.flags]
        return {d: getattr(args, d) for d in dests if getattr(args, d, None) is not None}

    def __init__(self, encoder):
        super().__init__()

    def config(self) -> dict:
        return {}

    def encode(self, model, batch: dict):
        raise NotImplementedError

    def batch_terms(self, model, vec, batch: dict, **step) -> dict:
        return {}

    def row_terms(self, model, batch: dict, states, vec) -> dict:
        return {}

    def total(self, terms: dict, retention_weight: float = 0.0, **step):
        """Every term with weight 1, the retention term with its scheduled weight (the baselines' losses)."""
        return sum(v for k, v in terms.items() if k != "retention_loss") + retention_weight * terms.get(
            "retention_loss", 0.0)

    def masked_student(self, vec):
        return None

    def negatives(self, model, batch: dict):  # (N,) each row's in-batch negatives, gathered; None: no such term
        return None

    def multiply_adds(self, model, batch: dict, layers, head: int) -> tuple:
        """(trained, forward-only) multiply-adds of a collated batch (run_log.step_flops): here the encoder on each
        text tensor. layers(ids, n, extra=0): n layers over an (..., L) tensor; head: the MLM head per row."""
        n = layer_multiply_adds(model.encoder)[0]
        keys = ("input_ids", "short_input_ids", "query_input_ids", "passage_input_ids")
        return sum(layers(batch[k], n) for k in keys if k in batch), 0

    def scoring(self) -> dict:
        """The ModelInfo fields this objective's setting fixes (RetroMAE's [CLS]); {}: the start model's."""
        return {}

    def make_collator(self, tokenizer, **kw):
        """The objective's collator (section 8, or baselines/), with the settings of the objective it needs."""
        raise NotImplementedError

TERMS = ("xp_loss", "cross_fill_loss", "self_fill_loss", "mlm_loss", "uniformity_loss", "retention_loss")

@register_objective
class XPRTObjective(Objective):
    """xPRT (the paper's "The objective"), its loss in `total`: batch terms L_xp, L_unif; row terms L_MLM, L_cross,
    L_self. fill_in=False is the paper's "without the fill-in loss" ablation (L_cross off, L_self stays)."""

    name = "xprt"
    trains_every_head = True  # the decoder (its self passes at least) and the MLM head (L_MLM)
    flags = {"--no_fill_in": dict(action="store_true", help="drop the cross fill-in loss L_cross (the paper's "
                                                            "'without the fill-in loss', Table 3); L_self stays"),
             "--xp_weight": dict(type=float, help="weight of L_xp (default 1)"),
             "--cross_weight": dict(type=float, help="weight of L_cross (paper's default: 0.1)"),
             "--self_fill_weight": dict(type=float, help="weight of L_self (not given by the paper; default 0.1)"),
             "--mlm_weight": dict(type=float, help="weight of L_MLM (not given by the paper; default 0.1)"),
             "--unif_weight": dict(type=float, help="weight of L_unif (not given by the paper; default 0.1)")}

    @classmethod
    def options_from_flags(cls, args) -> dict:
        """--no_fill_in -> fill_in=False; the weight flags given -> weights (LossWeights, the others at defaults)."""
        fields = {f: getattr(args, f"{f}_weight", None) for f in ("xp", "cross", "self_fill", "mlm", "unif")}
        fields = {f: v for f, v in fields.items() if v is not None}
        return {**({"weights": LossWeights(**fields)} if fields else {}),
                **({"fill_in": False} if getattr(args, "no_fill_in", None) else {})}

    def __init__(self, encoder, weights=None, fill_in: bool = True, num_condition_vectors: int = 4,
                 decoder_layers: int = 1):
        super().__init__(encoder)
        self.weights = weights if isinstance(weights, LossWeights) else LossWeights(**(weights or {}))
        self.fill_in, self.num_condition_vectors, self.decoder_layers = fill_in, num_condition_vectors, decoder_layers
        self.decoder = ConditionedDecoder(encoder, num_condition_vectors, decoder_layers)

    def config(self) -> dict:
        return {"weights": asdict(self.weights), "fill_in": self.fill_in,
                "num_condition_vectors": self.num_condition_vectors, "decoder_layers": self.decoder_layers}

    def make_collator(self, tokenizer, **kw):
        return XPRTCollator(tokenizer, num_condition_vectors=self.num_condition_vectors, fill_in=self.fill_in, **kw)

    def multiply_adds(self, model, batch: dict, layers, head: int) -> tuple:
        """The encoder on the G x 5 masked passages; the decoder on its G x D passes (with its conditioning
        vectors); the MLM head at L_MLM's, L_cross's and L_self's rows, and L_self's teacher rows forward only."""
        trained, _ = super().multiply_adds(model, batch, layers, head)
        trained += self.decoder.multiply_adds(batch["dec_input_ids"], layers)
        trained += head * sum(batch[k].numel() for k in ("mlm_index", "cross_rows", "self_rows") if k in batch)
        return trained, head * batch["self_enc_index"].numel()

    def encode(self, model, batch):
        """All P passages of all G groups in one encoder call -> (flat (G * P * L, H) token states, (G, P, H)
        vectors: 0 = anchor, 1 = s1, ...)."""
        ids, am = batch["input_ids"], batch["attention_mask"]  # (G, P, L)
        g, p, l = ids.shape
        hidden, vec = model.encode(ids.view(g * p, l), am.view(g * p, l))  # (G*P, L, H), (G*P, H)
        return hidden.reshape(g * p * l, -1), vec.view(g, p, -1)

    def batch_terms(self, model, vec, batch, **step):
        anchors, s1 = vec[:, 0], vec[:, 1]
        return {"xp_loss": xp_loss(anchors, s1, batch["doc_ids"], model.tau),
                "uniformity_loss": uniformity_loss(anchors)}

    def row_terms(self, model, batch, states, vec):
        """L_MLM, L_cross, L_self at the collator's index rows, each times its rows' share (Layout.row_share)."""
        share = batch["layout"].row_share
        dec = self.decode(model, vec, batch, batch["attention_mask"])  # every pass: one decoder call
        terms = {"mlm_loss": share["mlm"] * mlm_loss(model, states.index_select(0, batch["mlm_index"]),
                                                     batch["mlm_targets"])}
        if self.fill_in:
            terms["cross_fill_loss"] = share["cross"] * cross_fill_loss(
                model, dec.index_select(0, batch["cross_rows"]), batch["cross_targets"])
        terms["self_fill_loss"] = share["self"] * self_fill_loss(
            model, dec.index_select(0, batch["self_rows"]), states.index_select(0, batch["self_enc_index"]))
        return terms

    def total(self, terms: dict, retention_weight: float = 0.0, **step):
        """L = L_xp + 0.1 L_cross + w_self L_self + w_mlm L_MLM + w_unif L_unif + w(t) L_retain; a missing term is 0."""
        w, t = self.weights, {k: terms.get(k, 0.0) for k in TERMS}
        return (w.xp * t["xp_loss"] + w.cross * t["cross_fill_loss"] + w.self_fill * t["self_fill_loss"]
                + w.mlm * t["mlm_loss"] + w.unif * t["uniformity_loss"] + retention_weight * t["retention_loss"])

    def decode(self, model, vectors, batch, attention_mask):
        """Every decoder pass of the batch in one call -> the flat (G * D * (L + C), H) output rows.

        vectors (G, P, H) and attention_mask (G, P, L) of the encoder passes: pass d of group g is conditioned on
        vectors[g, dec_source[d]] and fills passage dec_target[d], with that passage's attention mask."""
        ids = batch["dec_input_ids"]  # (G, D, L)
        g, d, l = ids.shape
        h = vectors.shape[-1]
        mask = attention_mask[:, batch["dec_target"]].reshape(g * d, l)
        emb = model.embed(ids.reshape(g * d, l))  # the encoder's own embedding layer
        # (G*D, H); mean_pool's fp32 vectors in the weights' dtype (bf16 under DeepSpeed's bf16)
        cond = vectors[:, batch["dec_source"]].reshape(g * d, h).to(emb.dtype)
        return self.decoder(cond, emb, mask).reshape(-1, h)

    def masked_student(self, vec):
        return vec[:, :2]  # the 15%-masked anchor and s1 (--retention_student masked)

    def negatives(self, model, batch):  # what L_xp's same-document mask leaves each row
        return (batch["doc_ids"].unsqueeze(1) != gather_with_grad(batch["doc_ids"]).unsqueeze(0)).sum(1)

@register_objective
class PairObjective(Objective):
    """PAIR (finetune.py): (1 - alpha) L_Q + alpha L_P on the queries and their positive-first passages."""

    name = "pair"
    pretraining = False

    def make_collator(self, tokenizer, **kw):
        return PairCollator(tokenizer, **kw)

    def encode(self, model, batch):
        """-> (None, (B, 1 + k, H): the query, then its positive and negatives)."""
        _, q = model.encode(batch["query_input_ids"], batch["query_attention_mask"])  # (B, H)
        pids, pam = batch["passage_input_ids"], batch["passage_attention_mask"]  # (B, k, Lp)
        b, k, lp = pids.shape
        _, pv = model.encode(pids.view(b * k, lp), pam.view(b * k, lp))
        return None, torch.cat([q.unsqueeze(1), pv.view(b, k, -1)], dim=1)

    def batch_terms(self, model, vec, batch, pair_alpha: float = 0.0, pair_p_form: str = "query", **step):
        q, pv = vec[:, 0], vec[:, 1:]  # (B, H), (B, 1 + n, H)
        ids = {"passage_ids": batch.get("passage_ids"), "relevant_ids": batch.get("relevant_ids")}  # None: no mask
        terms = {"pair_q_loss": pair_q_loss(q, pv, model.tau, **ids)}
        if pv.shape[1] > 1:
            terms["pair_p_loss"] = pair_p_loss(q, pv, model.tau, **ids, form=pair_p_form)
        elif pair_alpha > 0:
            raise ValueError("pair_alpha > 0 needs hard negatives (PairCollator num_negatives >= 1)")
        return terms

    def total(self, terms: dict, retention_weight: float = 0.0, pair_alpha: float = 0.0, **step):
        return pair_loss(terms.get("pair_q_loss", 0.0), terms.get("pair_p_loss", 0.0), pair_alpha)

    def negatives(self, model, batch):  # L_Q's: every gathered passage but those relevant to the row (its positive)
        if "passage_ids" not in batch:  # no ids, no false-negative mask: every gathered passage but the positive
            p = gather_with_grad(batch["passage_input_ids"])
            return torch.full_like(batch["query_input_ids"][:, 0], p.shape[0] * p.shape[1] - 1)
        ids = gather_with_grad(batch["passage_ids"].reshape(-1))
        return (~(batch["relevant_ids"].unsqueeze(-1) == ids).any(1)).sum(1)

# ==============================================================================================================
# 5. What the model is beyond its weights: its length limit, its vector's pooling and scoring, the modules after
# pooling (a saved folder records them: plumbing/model_folder.py)
# ==============================================================================================================

@dataclass
class ModelInfo:
    """What a model folder records beyond the weights (plumbing/model_folder.py): the start checkpoint, the
    {"query", "document"} prefixes, the length limit, the card's base_model, the Hub repository, and the lineage:
    every stage from the first checkpoint on, [{"stage", "model"}] ("model": a Hub id, or None for a local one)."""

    start_model: str = ""
    prompts: dict = field(default_factory=lambda: dict(query="", document=""))
    max_seq_length: int = 512
    base_model: Optional[str] = None
    hub_model_id: Optional[str] = None
    lineage: list = field(default_factory=list)
    pooling: str = "mean"  # the sentence vector: the mean of the token vectors (E5's, the paper's), or [CLS]'s
    normalize: bool = True  # how the saved folder compares vectors (the start's; the losses train cosines)
    similarity_fn_name: str = "cosine"
    modules: list = field(default_factory=list)  # the start's modules after pooling (PostPooling.describe)
    dim: Optional[int] = None

def max_seq_length(config, stated: Optional[int] = None, model: Optional[nn.Module] = None) -> int:
    """The one length rule: the folder's stated limit, else 512, never more than the position table holds
    (model given: measured by architectures.longest_input; RoBERTa's 66 positions take 64 tokens)."""
    limit = int(min(stated or 512, getattr(config, "max_position_embeddings", 512)))
    return limit if model is None or runs_at_length(model, limit) else longest_input(model, limit)

class PostPooling(torch.nn.Module):
    """The sentence-transformers modules a model applies after its Pooling module (Dense, Normalize, ...), then its
    truncate_dim (model_folder.load_post_pooling); the identity for a model that has none.

    forward: pooled vectors (..., H) -> sentence vectors (..., D). Frozen (ours) and saved back unchanged."""

    def __init__(self, modules=(), truncate_dim: Optional[int] = None, names: Sequence[str] = ()):
        super().__init__()
        self.modules_ = torch.nn.ModuleList(modules)
        self.truncate_dim = truncate_dim
        self.names = list(names) or [type(m).__name__ for m in modules]
        self.requires_grad_(False)

    def forward(self, vec: torch.Tensor) -> torch.Tensor:
        if not len(self.modules_) and self.truncate_dim is None:
            return vec
        shape, dtype = vec.shape, vec.dtype
        weight = next(self.parameters(), None)  # bf16 under DeepSpeed's bf16, which runs without autocast
        # sentence-transformers modules read and write a features dict of (N, H) rows
        features = {"sentence_embedding": vec.reshape(-1, shape[-1]).to(weight.dtype if weight is not None else dtype)}
        for module in self.modules_:
            features = module(features)
        out = features["sentence_embedding"]
        if self.truncate_dim is not None:  # as SentenceTransformer.encode truncates: after every module
            out = out[..., : self.truncate_dim]
        return out.reshape(*shape[:-1], out.shape[-1]).to(dtype)

    def dim(self, hidden_size: int) -> int:
        """The sentence vector's dimension for pooled vectors of hidden_size (a probe through the modules)."""
        with torch.no_grad():
            p = next(self.parameters(), None)
            return self.forward(torch.zeros(2, hidden_size, device=p.device if p is not None else "cpu")).shape[-1]

    def describe(self) -> list:
        """["Dense(384 -> 128, Tanh)", "truncate_dim 64"]: one phrase per module but Normalize, for the log and card."""
        out = []
        for m in self.modules_:
            name = type(m).__name__
            if name == "Normalize":
                continue
            cfg = m.get_config_dict() if hasattr(m, "get_config_dict") else {}
            if "in_features" in cfg and "out_features" in cfg:
                act = str(cfg.get("activation_function", "")).rpartition(".")[2]
                out.append(f"{name}({cfg['in_features']} -> {cfg['out_features']}{', ' + act if act else ''})")
            else:
                out.append(name)
        return out + ([f"truncate_dim {self.truncate_dim}"] if self.truncate_dim is not None else [])

# ==============================================================================================================
# 6. The model
# The encoder with its MLM head, the objective with its heads, and the step: forward and cached_step.
# ==============================================================================================================

@contextlib.contextmanager
def dropout_off(module: nn.Module):
    """Run `module` in eval mode (no dropout, no gradient checkpointing) inside the block, then restore its mode."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)

def _rng_state(device, state=None):
    """The random state dropout draws from (CPU and device), for a chunk's replay: returned, or set to `state`."""
    accel = None if device.type == "cpu" else torch.get_device_module(device.type)
    if state is None:
        return torch.get_rng_state(), (accel.get_rng_state(device) if accel is not None else None)
    torch.set_rng_state(state[0])
    if state[1] is not None:
        accel.set_rng_state(state[1], device)

_NO_NEGATIVE = {"calls": 0, "warned": False}  # XPRTModel.with_negatives: one warning a process

class XPRTModel(nn.Module):
    """The encoder (AutoModelForMaskedLM; the start model's pooling) + one objective (section 4) with its heads.

    forward(batch) and cached_step(batch, ...) are the training step, written once over the objective's methods,
    plus the retention term every pre-training objective gets.

    A loop owes it batches of several documents (one document's rows have no negative; forward warns):
        from plumbing.batches import document_batches  # groups: train.load_groups(folder)
        for rows in document_batches(groups, collator, batch_size=8): model(collator(rows))["loss"].backward()"""

    def __init__(self, mlm_model, objective: str = "xprt", tau: float = 0.05, retention_student: str = "clean",
                 fused_vocab_loss: bool = True, info: Optional[ModelInfo] = None, **options):
        """objective: an --objective name (objective_class); options go to its class. tau: the temperature of every
        cosine softmax (paper: 0.05). retention_student: "clean" (ours: the clean anchor and s1 in one extra pass
        without dropout, 0 at step 0) or "masked" (the paper's 5-pass cost). info: ModelInfo (section 5).
        fused_vocab_loss=False: the vocabulary terms the plain way (the tests' reference)."""
        super().__init__()
        if retention_student not in ("clean", "masked"):
            raise ValueError(f"retention_student must be 'clean' or 'masked', got {retention_student!r}")
        self.encoder = mlm_model
        object.__setattr__(self, "base", mlm_model.base_model)  # the encoder without its MLM head (its own module)
        # embed, run_layers, transform, vocab_*: architectures.encoder_pieces, outside the module tree (the encoder's)
        for k, v in encoder_pieces(mlm_model)._asdict().items():
            object.__setattr__(self, k, v)
        self.objective_name, self.tau, self.retention_student = objective, tau, retention_student
        self.fused_vocab_loss = fused_vocab_loss
        objective_cls = objective_class(objective)
        unknown = set(options) - set(inspect.signature(objective_cls.__init__).parameters)
        if unknown:
            raise ValueError(f"objective {objective!r} takes no option {', '.join(sorted(unknown))} (flags of another "
                             "objective)")
        self.objective = objective_cls(mlm_model, **options)  # an Objective (section 4): its passes, terms, heads
        if retention_student == "masked" and type(self.objective).masked_student is Objective.masked_student:
            raise ValueError(f"--retention_student masked: objective {objective!r} has no masked anchor and s1 "
                             "vectors to reuse; use the clean student")
        self.info = info or ModelInfo(max_seq_length=max_seq_length(mlm_model.config, model=mlm_model.base_model))
        # the objective's setting may fix how vectors are pooled and scored: training and the saved folder follow it
        self.info = replace(self.info, **self.objective.scoring())
        self.post_pooling = PostPooling()  # the similarity terms read its output; the decoders the pooled vector
        self.carried_heads: dict = {}  # a folder's heads of another objective, written back unchanged (from_pretrained)
        self.carried_config: dict = {}
        self.load_message = ""  # how the weights came to be: from_pretrained says

    # -- pieces ----------------------------------------------------------------------------------
    @property
    def prompts(self) -> dict:
        """{"query", "document"} prefixes the model is trained and used with (common.model_prompts)."""
        return self.info.prompts

    @property
    def max_seq_length(self) -> int:
        """The length limit the model is saved and scored with (max_seq_length, section 5)."""
        return self.info.max_seq_length

    def projection(self):
        """(weight (V, D), bias (V,)): the vocabulary projection, weight = the word embeddings when tied."""
        return self.vocab_weight, self.vocab_bias

    def encode(self, input_ids, attention_mask, encoder=None):
        """(N, L) -> hidden (N, L, H), sentence vectors (N, H): mean pooling, or [CLS] for a CLS-pooled start
        (model_folder.read_pooling). encoder: another encoder pooled the same way (default the model's own)."""
        encoder = self.base if encoder is None else encoder
        hidden = encoder(input_ids=input_ids, attention_mask=mask_for_layers(encoder, attention_mask)).last_hidden_state
        return hidden, hidden[:, 0].float() if self.info.pooling == "cls" else mean_pool(hidden, attention_mask)

    # -- the step ----------------------------------------------------------------------------------
    def forward(self, batch: dict, teacher=None, retention_weight: float = 0.0, **step) -> dict:
        """One step's loss -> {"loss": total (with gradient), "<term>_loss": detached value per term}. step: the
        objective's per-step settings (PAIR's pair_alpha)."""
        obj = self.objective
        batch = obj.prepare(self, batch) if obj.prepare else batch
        states, vec = obj.encode(self, batch)
        terms = {**obj.batch_terms(self, self.post_pooling(vec), batch, **step),
                 **obj.row_terms(self, batch, states, vec)}
        if teacher is not None and retention_weight > 0 and obj.pretraining:  # the paper gives every method the term
            student = obj.masked_student(vec) if self.retention_student == "masked" else self.clean_student(batch)
            s, t = self.post_pooling(student), self.teacher_vectors(batch, teacher)  # (G, 2, D): anchor, s1
            terms["retention_loss"] = retention_loss(s[:, 0], s[:, 1], t[:, 0], t[:, 1], self.tau)
        loss = obj.total(terms, retention_weight, **step)
        return self.with_negatives({"loss": loss, **{k: v.detach() for k, v in terms.items()}}, batch)

    def with_negatives(self, out: dict, batch: dict) -> dict:
        """out with each row's in-batch negatives (N,) and their mean (logged); warns once a process when a row has
        none, read at calls 1, 2, 4, ... on a device (a host sync; a flag on the device keeps the calls between)."""
        n, seen = self.objective.negatives(self, batch), _NO_NEGATIVE
        if n is None:
            return out
        seen["any"], seen["calls"] = (n == 0).any() | seen.get("any", False), seen["calls"] + 1
        if not seen["warned"] and (n.device.type == "cpu" or not seen["calls"] & (seen["calls"] - 1)) and seen["any"]:
            seen["warned"] = True
            warnings.warn(f"{self.objective_name}: rows of a batch have no in-batch negative (one document's groups), "
                          "so their contrastive term is 0: plumbing.batches.document_batches", RuntimeWarning)
        return {**out, "negatives": n, "in_batch_negatives": n.double().mean()}

    def clean_student(self, batch, checkpointed: Optional[bool] = None):
        """The retention term's student: the clean anchor and s1 WITHOUT dropout (docs/notes.md) -> (G, 2, H)."""
        if checkpointed is None:  # the layers' own flag (transformers' property is named differently across versions)
            checkpointed = torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False)
                                                           for m in self.encoder.modules())
        if checkpointed:
            # eval mode skips transformers' per-layer checkpointing: the pass is checkpointed whole
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.clean_student, batch, False, use_reentrant=False)
        ids, mask = batch["retain_input_ids"], batch["retain_attention_mask"]
        g, _, lr = ids.shape
        with dropout_off(self.base):
            return self.encode(ids.reshape(g * 2, lr), mask.reshape(g * 2, lr))[1].view(g, 2, -1)

    @torch.no_grad()
    def teacher_vectors(self, batch, teacher):
        """The frozen start model's clean anchor and s1 vectors, pooled as the student's -> (G, 2, D)."""
        ids, mask = batch["retain_input_ids"], batch["retain_attention_mask"]
        g, _, lr = ids.shape
        vec = self.encode(ids.reshape(g * 2, lr), mask.reshape(g * 2, lr), teacher)[1]
        with dropout_off(self.post_pooling):
            return self.post_pooling(vec).view(g, 2, -1)

    # -- the gradient cache (train.py / finetune.py --gradient_cache_chunk) ----------------------------
    def cached_step(self, batch, chunk: int, backward, teacher=None, retention_weight: float = 0.0, **step) -> dict:
        """forward + backward of one step, `chunk` groups (PAIR: rows) at a time: GradCache's gradient cache,
        extended to row terms and the retention term.
          1. every chunk is encoded without gradient, its random state kept: its vectors;
          2. the batch-wide terms (and retention) run on those vectors; their UNscaled gradient wrt the vectors;
          3. every chunk is encoded again with its kept random state, its row terms computed (Layout.row_share),
             and `backward` (accelerator.backward) runs on them plus <vectors, their kept gradient>.
        The gradients are the plain step's on the same dropout. Returns what forward returns, detached."""
        obj, device = self.objective, next(self.parameters()).device
        batch = obj.prepare(self, batch) if obj.prepare else batch
        parts = batch["layout"].chunks(batch, chunk)
        retain = teacher is not None and retention_weight > 0 and obj.pretraining
        clean_student = retain and self.retention_student == "clean"
        states, vecs, cleans = [], [], []
        with torch.no_grad():  # 1.
            for _, part in parts:
                states.append(_rng_state(device))
                vecs.append(obj.encode(self, part)[1])
                if clean_student:
                    cleans.append(self.clean_student(part, False))
        leaves = torch.cat(vecs).requires_grad_()
        clean = torch.cat(cleans).requires_grad_() if clean_student else None
        terms = obj.batch_terms(self, self.post_pooling(leaves), batch, **step)  # 2.
        if retain:
            s = self.post_pooling(clean if clean_student else obj.masked_student(leaves))
            t = torch.cat([self.teacher_vectors(part, teacher) for _, part in parts])
            terms["retention_loss"] = retention_loss(s[:, 0], s[:, 1], t[:, 0], t[:, 1], self.tau)
        loss = torch.as_tensor(obj.total(terms, retention_weight, **step), device=device)
        wrt = [x for x in (leaves, clean) if x is not None]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
        vec_grad, clean_grad = grads[0], (grads[1] if clean is not None else None)
        total = loss.detach()
        decoder_state = _rng_state(device)  # the row terms' own dropout stream, after every encoder draw of step 1
        for ((a, b), part), state in zip(parts, states):  # 3.
            _rng_state(device, state)
            part_states, vec = obj.encode(self, part)
            _rng_state(device, decoder_state)
            local_terms = obj.row_terms(self, part, part_states, vec)
            local = torch.as_tensor(obj.total(local_terms), device=device)
            decoder_state = _rng_state(device)
            surrogate = local
            if vec_grad is not None:
                surrogate = surrogate + (vec * vec_grad[a:b]).sum()
            if clean_grad is not None:
                surrogate = surrogate + (self.clean_student(part, False) * clean_grad[a:b]).sum()
            if surrogate.requires_grad:
                backward(surrogate)
            total = total + local.detach()
            for k, v in local_terms.items():  # each already its chunk's share of the batch's mean
                terms[k] = terms.get(k, 0.0) + v
        return self.with_negatives({"loss": total, **{k: v.detach() if torch.is_tensor(v) else v
                                                      for k, v in terms.items()}}, batch)

    # -- saving and loading ----------------------------------------------------------------------
    def head_parameters(self) -> list:
        """The "heads": the parameters the start model never trained - the objective's own and the MLM head's
        transform and output bias (the tied projection is the encoder's; docs/notes.md)."""
        return list(self.objective.parameters()) + list(head_params(self.encoder).values())

# ==============================================================================================================
# 7. How a batch is cut: the contract between the collators and the gradient cache (XPRTModel.cached_step)
# ==============================================================================================================

class Layout:
    """How a collated batch is cut into chunks of groups (rows) for the gradient cache; the collator builds it.

    Tensors not in `unsliced` or `flat_index` are sliced on dim 0 (groups). `flat_index`: sorted flat index key ->
    (row set, width: one group's flat size, 0 for targets). bounds: row set -> G + 1 group starts. totals: row set
    -> the WHOLE batch's row count (row_share). Python ints only: no host sync."""

    def __init__(self, groups: int, flat_index: Optional[dict] = None, bounds: Optional[dict] = None,
                 unsliced: Sequence[str] = (), totals: Optional[dict] = None):
        self.groups, self.flat_index, self.bounds = groups, flat_index or {}, bounds or {}
        self.unsliced = set(unsliced)
        self.rows = {k: b[-1] - b[0] for k, b in self.bounds.items()}
        self.totals = dict(totals) if totals is not None else dict(self.rows)
        # row_share[rows]: this batch's (or chunk's) part of the whole batch's rows, 1 for a whole batch
        self.row_share = {k: n / max(1, self.totals[k]) for k, n in self.rows.items()}

    def chunks(self, batch: dict, size: int) -> list:
        """[((a, b), the groups a..b-1 of `batch` as a batch of their own, with its Layout)]."""
        out = []
        for a in range(0, self.groups, size):
            b = min(a + size, self.groups)
            part = {}
            for k, v in batch.items():
                if k in self.flat_index:
                    rows, width = self.flat_index[k]
                    part[k] = v[self.bounds[rows][a]:self.bounds[rows][b]]
                    part[k] = part[k] - a * width if width else part[k]
                elif torch.is_tensor(v) and k not in self.unsliced:
                    part[k] = v[a:b]
                elif k != "layout":
                    part[k] = v
            bounds = {k: [x - bd[a] for x in bd[a:b + 1]] for k, bd in self.bounds.items()}
            part["layout"] = Layout(b - a, self.flat_index, bounds, self.unsliced, self.totals)
            out.append(((a, b), part))
        return out

def group_bounds(index: torch.Tensor, width: int, groups: int) -> list:
    """Where each group's rows start in a sorted flat index over (groups * width) positions: G + 1 ints."""
    return torch.searchsorted(index, torch.arange(groups + 1) * width).tolist()

def group_lengths(groups, num_related: int, batch_size: int = 8192) -> np.ndarray:
    """Characters of each group's anchor plus its first num_related related passages (what length grouping sorts
    by), as a numpy int64 array. pyarrow compute on Arrow batches of the two columns (no cache file written: every
    process can run it at once); utf8_length counts code points like Python's len."""
    import pyarrow.compute as pc

    out = np.empty(len(groups), dtype=np.int64)
    pos = 0
    for batch in groups.select_columns(["anchor", "related"]).with_format("arrow").iter(batch_size=batch_size):
        anchor = batch["anchor"].combine_chunks()
        related = pc.list_slice(batch["related"].combine_chunks(), 0, num_related)
        flat = pc.utf8_length(pc.list_flatten(related)).to_numpy(zero_copy_only=False)
        per_group = np.bincount(pc.list_parent_indices(related).to_numpy(zero_copy_only=False), weights=flat,
                                minlength=len(anchor))  # float64: exact for sums below 2**53
        anchor_len = pc.utf8_length(anchor).to_numpy(zero_copy_only=False)
        out[pos:pos + len(anchor)] = anchor_len + per_group.astype(np.int64)
        pos += len(anchor)
    return out

def pad_to_multiple(ids: torch.Tensor, mask: torch.Tensor, multiple: int, pad_id: int, left: bool = False) -> tuple:
    """(N, L) ids and attention mask, widened with masked padding to a multiple of `multiple` (train.py and
    finetune.py --pad_to_multiple_of: a compiled step meets few shapes); as they are at 1. `left`: a left-padding
    tokenizer's side."""
    extra = -ids.shape[-1] % multiple
    if not extra:
        return ids, mask
    pad = (extra, 0) if left else (0, extra)
    return F.pad(ids, pad, value=pad_id), F.pad(mask, pad, value=0)

def unpadded_rand(where: torch.Tensor, generator=None, left=False, high=None, width=None) -> torch.Tensor:
    """torch.rand (randint(high)) of where's shape (..., L), drawn over the real width (`width`, else where's extent;
    from the right if `left`), padded with 1.0 (0): --pad_to_multiple_of and --compile (8) change no mask."""
    if width is None:  # a host read: the collators run on the CPU; a device caller passes width
        cols = where.reshape(-1, where.shape[-1]).any(0).nonzero()
        width = 0 if not len(cols) else where.shape[-1] - int(cols[0]) if left else int(cols[-1]) + 1
    shape, kw = (*where.shape[:-1], width), dict(generator=generator, device=where.device)
    u = torch.randint(high, shape, **kw) if high is not None else torch.rand(shape, **kw)
    return F.pad(u, (where.shape[-1] - width, 0) if left else (0, where.shape[-1] - width), value=float(high is None))

def stable_doc_hash(doc_id: str) -> int:
    """Deterministic int64 id of a document (Python's hash() is salted per process): the in-batch document label of
    L_xp, and PAIR's passage ids (of the passage *text*, so that duplicated corpus entries get one id)."""
    return int.from_bytes(hashlib.blake2b(str(doc_id).encode("utf-8"), digest_size=8).digest(), "little", signed=True)

# ==============================================================================================================
# 8. Collators
# Rows -> one batch dict of tensors. All masking, cropping and index building happens here, drawn from a generator
# seeded per batch (batches.SeededCollate); each batch carries its Layout (section 7): the model computes no index.
# Batch layout of xPRT (XPRTCollator): G groups, P = 1 + num_related passages per group (0 = anchor, 1 = s1, ...),
# L tokens, D decoder passes per group (2 * num_related + 2; 2 without fill-in), C conditioning vectors:
#   input_ids, attention_mask, mlm_labels   (G, P, L)   masked encoder input, its MLM targets (-100 elsewhere)
#   dec_input_ids, dec_labels               (G, D, L)   masked decoder inputs, their targets
#   dec_source, dec_target                  (D,)        passage whose vector conditions each pass / passage it fills
#   mlm_index, mlm_targets                  (M,)        masked encoder positions in the flat (G * P * L) states
#   cross_rows, cross_targets               (M_c,)      L_cross's rows of the flat (G * D * (L + C)) decoder output
#   self_rows, self_enc_index               (M_s,)      L_self's decoder rows, the same tokens in the encoder states
# and, for every pre-training objective (GroupCollator.retention_fields):
#   retain_input_ids, retain_attention_mask (G, 2, L")  clean anchor and s1 (teacher and clean student)
#   doc_ids                                 (G,)        stable int64 hash of the document id
# PAIR (PairCollator): query_input_ids / query_attention_mask (B, Lq), passage_input_ids / passage_attention_mask
# (B, 1 + n, Lp), passage_ids (B, 1 + n), relevant_ids (B, R).
# ==============================================================================================================

def special_template(tokenizer) -> tuple[list, list]:
    """The special tokens around one passage -> (head, tail) ids: [CLS] / [SEP] for BERT, none / </s> for T5,
    found by tokenising a probe with and without them; a template other than head + passage + tail is refused."""
    probe = "probe, 12 words: the template holds around any text."
    full = tokenizer(probe)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    for at in range(len(full) - len(plain) + 1):
        if full[at:at + len(plain)] == plain:
            return full[:at], full[at + len(plain):]
    raise ValueError(f"{type(tokenizer).__name__}: its special tokens are not a head and a tail around the passage")

def passage_tokens(tokenizer, texts, prefix: str, length: int, words: bool = False) -> dict:
    """Passages without special tokens: prefix + text tokenised together (a BPE merges across the space), cut to
    `length` -> {"ids": [[int]], "words": [[int]] each token's word, with words}. The collators' one tokenisation."""
    enc = tokenizer([prefix + t for t in texts], add_special_tokens=False, truncation=True, max_length=length)
    out = {"ids": enc["input_ids"]}
    if words:
        out["words"] = [[-1 if w is None else w for w in enc.word_ids(i)] for i in range(len(texts))]
    return out

def tokenize_groups(batch: dict, tokenizer, prefix: str, length: int, words: bool, fields) -> dict:
    """datasets.map's function over the groups (train.py): each passage column in `fields` tokenised once
    (passage_tokens) -> <field>_ids (and <field>_words) beside the text: a list per passage, a list of lists for
    "related". The collators then only mask and pad (GroupCollator.passage)."""
    out = {}
    for name in fields:
        column = batch[name]
        nested = bool(column) and isinstance(column[0], list)
        flat = [t for texts in column for t in texts] if nested else column
        tokens = passage_tokens(tokenizer, flat, prefix, length, words)
        for key, values in tokens.items():
            if nested:  # back into each group's list of related passages
                ends = np.cumsum([len(texts) for texts in column])
                values = [values[e - len(texts):e] for e, texts in zip(ends, column)]
            out[f"{name}_{key}"] = values
    return out

class GroupCollator:
    """What every pre-training collator shares: tokenising with the passage prefix, BERT-style masking drawn from
    self.generator, the retention fields, and the batch sampler's lengths. max_length counts the passage's own
    tokens (select_groups.py's --passage_tokens), specials and prefix come on top. The prefix ("passage: " for E5) is
    never masked. Mask rates left at None take DEFAULT_RATES (encoder, decoder)."""

    DEFAULT_RATES = (0.15, 0.0)
    spread_documents = True  # the sampler may deal one document's groups into different batches (train.py)
    needs_words = False  # the baselines' whole-word masking reads each token's word (AnchorCollator)
    passage_fields = ("anchor", "related", "random_passage")  # the text columns train.py tokenises once

    def __init__(self, tokenizer, num_related: int = 4, max_length: int = 128,
                 encoder_mask_rate: Optional[float] = None, decoder_mask_rate: Optional[float] = None,
                 passage_prefix: str = "", positive: str = "s1", seed: int = 0, pad_to_multiple_of: int = 1):
        if positive not in ("s1", "random"):
            raise ValueError(f"positive must be 's1' or 'random', got {positive!r}")
        if num_related < 1:
            raise ValueError("num_related must be >= 1")
        self.tokenizer, self.num_related, self.max_length, self.positive = tokenizer, num_related, max_length, positive
        # every batch's width a multiple of this (train.py --pad_to_multiple_of): few shapes for a compiled step
        self.pad_to_multiple_of = pad_to_multiple_of
        enc_d, dec_d = self.DEFAULT_RATES
        self.encoder_mask_rate = enc_d if encoder_mask_rate is None else encoder_mask_rate
        self.decoder_mask_rate = dec_d if decoder_mask_rate is None else decoder_mask_rate
        for name, r in [("encoder_mask_rate", self.encoder_mask_rate), ("decoder_mask_rate", self.decoder_mask_rate)]:
            if not 0.0 <= r < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {r}")
        self.passage_prefix = passage_prefix
        self.prefix_ids = tokenizer(passage_prefix, add_special_tokens=False)["input_ids"] if passage_prefix else []
        self.seq_length = max_length + len(self.prefix_ids) + tokenizer.num_special_tokens_to_add(pair=False)
        self.head, self.tail = special_template(tokenizer)
        self.generator = torch.Generator().manual_seed(seed)  # training re-seeds it per batch (batches.SeededCollate)

    def sort_lengths(self, groups, seed: int):
        """What the batch sampler sorts the groups by -> (lengths, or a function epoch -> lengths; a function
        (epoch, row index) -> extra fields of the row, or None)."""
        return group_lengths(groups, self.num_related), None

    # -- helpers -------------------------------------------------------------------------------
    def passage(self, row: dict, field: str, j: Optional[int] = None):
        """A row's passage (`field`, j-th for "related") as _tokenize takes it: its tokens (train.py), else its text."""
        if field + "_ids" not in row:
            return row[field] if j is None else row[field][j]
        ids, words = row[field + "_ids"], row.get(field + "_words")
        if j is not None:
            ids, words = ids[j], None if words is None else words[j]
        return ids, words

    def _tokenize(self, passages) -> dict:
        """Passages (texts, or (ids, words) tokenised before: passage_tokens) -> the encoder's padded batch:
        input_ids, attention_mask (N, L) with the tokenizer's special tokens around each passage and its padding
        side; "candidates": the maskable positions (never a special token, padding or the prefix); with
        needs_words, "word_ids" (N, L): each candidate's word, -1 elsewhere. Texts go through passage_tokens too."""
        texts = [i for i, p in enumerate(passages) if isinstance(p, str)]
        if texts:
            done = passage_tokens(self.tokenizer, [passages[i] for i in texts], self.passage_prefix,
                                  len(self.prefix_ids) + self.max_length, self.needs_words)
            passages = list(passages)
            for k, i in enumerate(texts):
                passages[i] = done["ids"][k], done["words"][k] if self.needs_words else None
        head, tail, skip = self.head, self.tail, len(self.head) + len(self.prefix_ids)
        lengths = np.fromiter((len(ids) for ids, _ in passages), dtype=np.int64, count=len(passages))
        n, width = len(passages), len(head) + len(tail) + int(lengths.max())
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of  # rounded up: the padding is masked
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = np.full((n, width), pad, dtype=np.int64)
        # each row's first token: its padding before it on a left-padding tokenizer
        left = self.tokenizer.padding_side == "left"
        at = width - lengths - len(head) - len(tail) if left else np.zeros_like(lengths)
        col = np.arange(width)
        rel = col[None, :] - at[:, None]  # (N, L) each position's place in its row's tokens
        am = (rel >= 0) & (rel < (lengths + len(head) + len(tail))[:, None])
        cand = (rel >= skip) & (rel < (lengths + len(head))[:, None])  # the passage's own tokens, the prefix left out
        # the passages' tokens in one assignment (row, column) <- the flat token list
        rows = np.repeat(np.arange(n), lengths)
        cols = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths) + np.repeat(
            at + len(head), lengths)
        ids[rows, cols] = np.fromiter(itertools.chain.from_iterable(p for p, _ in passages), dtype=np.int64,
                                      count=len(rows))
        for k, t in enumerate(head):  # the template's special tokens around each passage
            ids[np.arange(n), at + k] = t
        for k, t in enumerate(tail):
            ids[np.arange(n), at + len(head) + lengths + k] = t
        am = am.astype(np.int64)
        words = None
        if self.needs_words:  # each candidate's word (the prefix's words dropped), -1 elsewhere
            words = np.full((n, width), -1, dtype=np.int64)
            words[rows, cols] = np.fromiter(itertools.chain.from_iterable(w for _, w in passages), dtype=np.int64,
                                            count=len(rows))
            words[~cand] = -1
        out = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(am),
               "candidates": torch.from_numpy(cand)}
        if words is not None:
            out["word_ids"] = torch.from_numpy(words)
        return out

    def _mask(self, ids, candidates, rate, bert: bool = True, pick=None):
        """Mask Bernoulli(rate) of the candidate positions (..., L), at least one in each row that has any, or the
        positions `pick` -> (masked ids, labels: the ids there, -100 elsewhere). bert: BERT's 80% [MASK] / 10% random
        / 10% unchanged; else every picked token becomes [MASK] (the decoders' inputs)."""
        g, left = self.generator, self.tokenizer.padding_side == "left"  # draws over the real width: unpadded_rand
        if pick is None:
            pick = (unpadded_rand(candidates, g, left) < rate) & candidates
            empty = ~pick.any(-1) & candidates.any(-1)
            if empty.any():  # a short passage drew no mask: mask one random candidate so every row has a target
                scores = unpadded_rand(candidates, g, left).masked_fill(~candidates, -1.0)
                one = torch.zeros_like(pick).scatter_(-1, scores.argmax(-1, keepdim=True), True)
                pick = pick | (one & empty.unsqueeze(-1))
        labels = torch.where(pick, ids, torch.full_like(ids, -100))
        if not bert:
            return ids.masked_fill(pick, self.tokenizer.mask_token_id), labels
        u = unpadded_rand(candidates, g, left)
        masked = ids.clone()
        masked[pick & (u < 0.8)] = self.tokenizer.mask_token_id
        rnd = pick & (u >= 0.8) & (u < 0.9)
        masked[rnd] = unpadded_rand(candidates, g, left, high=len(self.tokenizer))[rnd]
        return masked, labels

    def retention_fields(self, rows: list) -> dict:
        """doc_ids and the clean anchor and s1 of every group: the retention term's pairs are anchor x s1 whatever
        the objective and the positive (the paper gives every method the same term)."""
        if not rows:
            raise ValueError("empty batch")
        for r in rows:
            if len(r["related"]) < self.num_related:
                raise ValueError(f"group of {r['doc_id']} has {len(r['related'])} related passages, "
                                 f"need {self.num_related}")
        g = len(rows)
        clean = self._tokenize([p for r in rows
                               for p in (self.passage(r, "anchor"), self.passage(r, "related", 0))])
        lr = clean["input_ids"].shape[1]
        return {"doc_ids": torch.tensor([stable_doc_hash(r["doc_id"]) for r in rows], dtype=torch.long),
                "retain_input_ids": clean["input_ids"].view(g, 2, lr),
                "retain_attention_mask": clean["attention_mask"].view(g, 2, lr)}

class XPRTCollator(GroupCollator):
    """Rows of the groups dataset (select_groups.py) -> the batch XPRTObjective reads: anchor + num_related related
    passages per group (positive="random": slot 1 holds `random_passage`, the paper's ablation); 15% encoder masking
    (BERT's 80/10/10), and one 60%-masked copy (all [MASK]) of the target passage for each decoder pass
    (decoder_pass_plan; rows: ConditionedDecoder.output_rows)."""

    DEFAULT_RATES = (0.15, 0.60)

    def __init__(self, tokenizer, num_condition_vectors: int = 4, fill_in: bool = True, **kw):
        super().__init__(tokenizer, **kw)
        self.num_condition_vectors, self.fill_in = num_condition_vectors, fill_in

    def __call__(self, rows: list) -> dict:
        batch = self.retention_fields(rows)
        g, p = len(rows), 1 + self.num_related
        second = [self.passage(r, "random_passage") if self.positive == "random" else self.passage(r, "related", 0)
                  for r in rows]
        enc = self._tokenize([p for r, s in zip(rows, second) for p in [self.passage(r, "anchor"), s] +
                              [self.passage(r, "related", j) for j in range(1, self.num_related)]])
        ids, am = enc["input_ids"], enc["attention_mask"]
        l = ids.shape[1]
        cand = enc["candidates"]
        masked, labels = self._mask(ids, cand, self.encoder_mask_rate)
        ids3, cand3 = ids.view(g, p, l), cand.view(g, p, l)
        source, target, kind = decoder_pass_plan(self.num_related, self.fill_in)
        # The masks of all 2R + 2 passes are drawn, kept or not: the "no fill-in" ablation then sees the same masks in
        # its self passes, and the same encoder masks in later batches, as the full method.
        _, all_target, all_kind = decoder_pass_plan(self.num_related)
        tgt = torch.tensor(all_target)
        # (G, 2R+2, L): every picked token becomes [MASK]
        dec_ids, dec_labels = self._mask(ids3[:, tgt], cand3[:, tgt], self.decoder_mask_rate, bert=False)
        if not self.fill_in:
            keep = torch.tensor([i for i, k in enumerate(all_kind) if k == "self"])
            dec_ids, dec_labels = dec_ids[:, keep], dec_labels[:, keep]  # (G, D, L)
        batch.update({"input_ids": masked.view(g, p, l), "attention_mask": am.view(g, p, l),
                      "mlm_labels": labels.view(g, p, l), "dec_input_ids": dec_ids, "dec_labels": dec_labels,
                      "dec_source": torch.tensor(source), "dec_target": torch.tensor(target)})
        batch.update(self._loss_positions(labels.view(g, p, l), dec_labels, target, kind))
        return batch

    def _loss_positions(self, mlm_labels, dec_labels, target, kind) -> dict:
        """The rows each vocabulary term reads, as flat row-major index tensors (and their targets), built on the CPU
        once per batch, so the model gathers with index_select, never a boolean mask (a host sync).

        mlm_index, mlm_targets: masked encoder positions in the flat (G * P * L) encoder states. Decoder rows are rows
        of the flat (G * D * (L + C)) decoder output (ConditionedDecoder.output_rows): cross_rows, cross_targets at
        the masked positions of the cross passes; self_rows at those of the self passes and self_enc_index the same
        tokens in the encoder states (L_self's teacher). target, kind: the passes' target passage and kind
        (decoder_pass_plan)."""
        g, p, l = mlm_labels.shape
        d, c = len(kind), self.num_condition_vectors
        enc_w, dec_w = p * l, d * (l + c)  # one group's flat size in the encoder states and the decoder output
        mlm_index = (mlm_labels.reshape(-1) != -100).nonzero().squeeze(1)
        out = {"mlm_index": mlm_index, "mlm_targets": mlm_labels.reshape(-1)[mlm_index]}
        bounds = {"mlm": group_bounds(mlm_index, enc_w, g)}
        flat = {"mlm_index": ("mlm", enc_w), "mlm_targets": ("mlm", 0)}
        picked = dec_labels != -100  # (G, D, L)
        is_self = torch.tensor([k == "self" for k in kind]).view(1, d, 1)
        if self.fill_in:
            index = (picked & ~is_self).reshape(-1).nonzero().squeeze(1)
            out.update(cross_rows=ConditionedDecoder.output_rows(index, l, c),
                       cross_targets=dec_labels.reshape(-1)[index])
            bounds["cross"] = group_bounds(index, d * l, g)
            flat.update(cross_rows=("cross", dec_w), cross_targets=("cross", 0))
        self_index = (picked & is_self).reshape(-1).nonzero().squeeze(1)
        grp, pas, j = self_index // (d * l), self_index // l % d, self_index % l
        out.update(self_rows=ConditionedDecoder.output_rows(self_index, l, c),
                   self_enc_index=(grp * p + torch.tensor(target)[pas]) * l + j)
        bounds["self"] = group_bounds(self_index, d * l, g)
        flat.update(self_rows=("self", dec_w), self_enc_index=("self", enc_w))
        out["layout"] = Layout(g, flat, bounds, unsliced=("dec_source", "dec_target"))
        return out

def pair_text_ids(rows: list, num_negatives: int) -> tuple:
    """The ids of PAIR's false-negative mask (pair_false_negatives) for rows {"query", "positive", "negatives",
    optional "relevant"}: stable_doc_hash of the passage *text*, so a duplicated corpus entry gets its copy's id.

    passage_ids (B, 1 + num_negatives) int64: every passage slot, the positive first.
    relevant_ids (B, R) int64: the row's positive, then its "relevant" texts, padded by repeating the positive's id."""
    slots = [[r["positive"]] + list(r.get("negatives") or [])[:num_negatives] for r in rows]
    passage_ids = torch.tensor([[stable_doc_hash(t) for t in texts] for texts in slots], dtype=torch.long)
    relevant = [list(dict.fromkeys([stable_doc_hash(r["positive"])] +
                                   [stable_doc_hash(t) for t in r.get("relevant") or []])) for r in rows]
    width = max(len(x) for x in relevant)
    relevant_ids = torch.tensor([x + [x[0]] * (width - len(x)) for x in relevant], dtype=torch.long)
    return passage_ids, relevant_ids

class PairCollator:
    """Fine-tuning rows {"query", "positive", "negatives"} -> batch for PairObjective: query_input_ids /
    query_attention_mask (B, Lq); passage_input_ids / passage_attention_mask (B, 1 + num_negatives, Lp), the positive
    first (PAIR's max lengths: 32 / 128); passage_ids and relevant_ids (pair_text_ids)."""

    def __init__(self, tokenizer, query_max_length: int = 32, passage_max_length: int = 128, query_prefix: str = "",
                 passage_prefix: str = "", num_negatives: int = 1, pad_to_multiple_of: int = 1):
        if num_negatives < 0:
            raise ValueError("num_negatives must be >= 0")
        self.tokenizer, self.qlen, self.plen = tokenizer, query_max_length, passage_max_length
        self.pad_to_multiple_of = pad_to_multiple_of  # every batch's widths a multiple of this (pad_to_multiple)
        self.query_prefix, self.passage_prefix, self.num_negatives = query_prefix, passage_prefix, num_negatives

    def __call__(self, rows: list) -> dict:
        b, k = len(rows), 1 + self.num_negatives
        passages = []
        for r in rows:
            negs = list(r.get("negatives") or [])
            if len(negs) < self.num_negatives:
                raise ValueError(f"query {r['query'][:50]!r} has {len(negs)} negatives, need {self.num_negatives}")
            passages += [r["positive"]] + negs[: self.num_negatives]
        tok, left = self.tokenizer, self.tokenizer.padding_side == "left"
        q = tok([self.query_prefix + r["query"] for r in rows], padding=True, truncation=True, max_length=self.qlen,
                return_tensors="pt")
        p = tok([self.passage_prefix + t for t in passages], padding=True, truncation=True, max_length=self.plen,
                return_tensors="pt")
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        q["input_ids"], q["attention_mask"] = pad_to_multiple(q["input_ids"], q["attention_mask"],
                                                              self.pad_to_multiple_of, pad, left)
        p["input_ids"], p["attention_mask"] = pad_to_multiple(p["input_ids"], p["attention_mask"],
                                                              self.pad_to_multiple_of, pad, left)
        lp = p["input_ids"].shape[1]
        passage_ids, relevant_ids = pair_text_ids(rows, self.num_negatives)
        return {"query_input_ids": q["input_ids"], "query_attention_mask": q["attention_mask"],
                "passage_input_ids": p["input_ids"].view(b, k, lp),
                "passage_attention_mask": p["attention_mask"].view(b, k, lp),
                "passage_ids": passage_ids, "relevant_ids": relevant_ids, "layout": Layout(b)}
