"""
xPRT as a sentence-transformers loss: `XPRTLoss(model)` trains a SentenceTransformer on
select_groups.py's groups with SentenceTransformerTrainer, by modeling_xprt.py's own step
(XPRTModel.forward: XPRTObjective.encode, batch_terms, row_terms, total), so the loss, every term
and the gradients are train.py's (tests/test_sentence_transformers.py).

    L = L_xp + 0.1 L_cross + w_self L_self + w_mlm L_MLM + w_unif L_unif + w(t) L_retain

L_xp is a symmetric InfoNCE (MultipleNegativesSymmetricRankingLoss at scale 20 = tau 0.05) between
each anchor and its top related passage s1, the other groups' s1 gathered from every process as
negatives, a document's own groups never among them; L_cross and L_self are fill-ins by a one-layer
decoder conditioned on a passage's vector (60% of the words masked); L_MLM the encoder's masked LM
on its 15%-masked passes; L_unif keeps the anchors apart; the retention KL to the frozen start
model weighs 40 -> 0 over the trainer's steps.

Args (XPRTLoss):
    model: the SentenceTransformer to train (a Transformer module first, mean or [CLS] pooling). Its
        encoder is trained in place; the decoder and the MLM head are the loss's own parameters, as
        DenoisingAutoEncoderLoss (TSDAE) holds its decoder, restored from the model's folder when
        train.py or this loss saved them there.
    start: the folder or Hub id of the start (heads, teacher); default the one `model` came from.
    num_related, max_length, positive, fill_in, weights, encoder_mask_rate, decoder_mask_rate:
        train.py's --num_related, --max_length, --positive (s1 | random: the ablation),
        --no_fill_in (fill_in=False: the ablation), the --*_weight flags (LossWeights' fields).
    retention_weight, retention_final_weight, retention_schedule, retention_student, teacher: w(t)
        and its teacher, as train.py's flags (0 at both ends: no teacher).
    max_document_groups_per_batch, spread_documents: the sampler's one-document cap and spread.
    gradient_cache_chunk: groups XPRTModel.cached_step holds at once; 0 = the plain step.

References: the xPRT paper (README.md's paper map); GradCache, https://arxiv.org/abs/2101.06983.

Requirements: sentence-transformers >= 6.2 with its [train] extra; select_groups.py's groups; the
trainer given `batch_sampler=loss.batch_sampler` and `**loss.trainer_kwargs()` (the collator, and
the callback that hands the loss the trainer's step, resumes the heads and logs every term).

Inputs:
    +----------------------------------------------------------------+--------+
    | Texts                                                          | Labels |
    +================================================================+========+
    | groups_dataset(): doc_id, anchor, related, random_passage, row | none   |
    +----------------------------------------------------------------+--------+

Example:
    ::

        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers import SentenceTransformerTrainingArguments as Args
        from xprt_sentence_transformers import XPRTLoss

        model = SentenceTransformer("runs/xprt/model")
        loss = XPRTLoss(model, max_length=64)
        args = Args("runs/st", max_steps=10, per_device_train_batch_size=8,
                    batch_sampler=loss.batch_sampler)
        trainer = SentenceTransformerTrainer(model, args, loss=loss,
                                             train_dataset=loss.groups_dataset("runs/groups"),
                                             **loss.trainer_kwargs())
        trainer.train()
        model.save_pretrained("runs/st/model")  # with xprt_heads.safetensors, as train.py saves

Where the trainer's loop differs from train.py's (the step is the same): it clips the gradient norm
of the SentenceTransformer's parameters alone (max_grad_norm; the heads unclipped; train.py clips
all together); the schedule and optimiser groups are its arguments' (train.py's
--head_learning_rate: learning_rate_mapping={r"^xprt\\.": 1e-4}, the heads being exactly the loss's
parameters named xprt.*); under several processes its logged `loss` is process 0's, while XPRTLoss
logs each term and the total (xprt_loss) as the processes' mean, as train.py does.

Large batches: sentence-transformers' GradCache engine (base/losses/gradcache.py, CachedLossMixin)
re-embeds each mini-batch as `model(features)["sentence_embedding"]` and back-propagates into those
vectors only; xPRT's row terms (L_MLM, L_cross, L_self) read the encoder's token states, so that
engine cannot carry them. gradient_cache_chunk runs modeling_xprt's own cache instead
(XPRTModel.cached_step: the batch terms on the cached vectors, each chunk's row terms re-encoded),
as train.py --gradient_cache_chunk does.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import TrainerCallback

from modeling_xprt import (ConditionedDecoder, LossWeights, XPRTModel,
                           group_lengths, retention_weight)
from plumbing.architectures import encoder_pieces, head_params, layer_runner, vocab_matrix
from plumbing.batches import LengthGroupedBatchSampler, SeededCollate, document_keys
from plumbing.model_folder import heads_config, heads_state_dict, load_teacher, load_xprt_folder

PREFIX = "xprt_"  # on every key of a batch: the trainer hands the loss one feature dict of them all


def share_encoder(xprt: XPRTModel, auto_model: nn.Module) -> XPRTModel:
    """Make `xprt`'s encoder the SentenceTransformer's own (its Transformer module's model): the
    base model inside the MLM model becomes `auto_model`, the vocabulary projection is re-tied to
    its word embeddings when it was tied, and the pieces a step calls are found again
    (architectures.encoder_pieces, the decoder's layer runner). One set of encoder weights: what the
    loss trains is what the SentenceTransformer encodes with."""
    mlm = xprt.encoder
    old = mlm.base_model
    if set(old.state_dict()) - set(auto_model.state_dict()):
        raise ValueError(f"{type(auto_model).__name__} is not the start's {type(old).__name__}")
    tied = vocab_matrix(mlm) is mlm.get_input_embeddings().weight
    setattr(mlm, mlm.base_model_prefix, auto_model)
    if tied:
        mlm.get_output_embeddings().weight = auto_model.get_input_embeddings().weight
    object.__setattr__(xprt, "base", auto_model)
    for k, v in encoder_pieces(mlm)._asdict().items():
        object.__setattr__(xprt, k, v)
    for m in xprt.objective.modules():
        if isinstance(m, ConditionedDecoder):
            object.__setattr__(m, "run_layers", layer_runner(mlm))
    return xprt


def distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _AverageGradients(torch.autograd.Function):
    """Identity on the loss; its backward queues, for the end of the backward pass, the average over
    the processes of every gradient the loss's parameters hold (train.py's DDP average). The
    trainer wraps the SentenceTransformer in DDP, but the loss never calls that wrapper (it runs the
    encoder through XPRTModel), so DDP syncs nothing, and the heads are outside it: the one sync.
    gather_with_grad's backward sums every process's gradients into its rows; the average then gives
    the global mean loss's gradient, as DDP does. With accumulation each micro-batch averages what
    the parameters hold: the sum of the micro-batches' averages, the same sum DDP ends with."""

    @staticmethod
    def forward(ctx, loss, params):
        ctx.params = params
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        callback = functools.partial(average_gradients, ctx.params)
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        return grad, None


def average_gradients(params):
    """All-reduce the gradients `params` hold (one set on every process: one graph), flattened."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat)
    flat /= torch.distributed.get_world_size()
    for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(avg)


class XPRTLoss(nn.Module):
    """The xPRT objective for SentenceTransformerTrainer (the module's docstring: args, example)."""

    def __init__(self, model, start: Optional[str] = None, num_related: int = 4,
                 max_length: int = 128, positive: str = "s1", fill_in: bool = True,
                 weights: Optional[dict] = None, encoder_mask_rate: Optional[float] = None,
                 decoder_mask_rate: Optional[float] = None, retention_weight: float = 40.0,
                 retention_final_weight: float = 0.0, retention_schedule: str = "linear",
                 retention_student: str = "clean", teacher: Optional[str] = None,
                 max_document_groups_per_batch: Optional[int] = None, spread_documents: int = 16,
                 gradient_cache_chunk: int = 0):
        super().__init__()
        self.model, self.tokenizer = model, model.tokenizer
        auto_model = model[0].auto_model
        self.start = start or auto_model.name_or_path
        options = {"weights": LossWeights(**weights)} if weights else {}
        # train.py's model loaded as train.py loads it (an xprt folder's heads, else a fresh MLM
        # head and decoder), then run on the SentenceTransformer's encoder
        xprt = load_xprt_folder(XPRTModel, self.start, objective="xprt", fill_in=fill_in,
                                retention_student=retention_student, **options)
        self.xprt = share_encoder(xprt, auto_model).to(model.device)
        self.settings = dict(num_related=num_related, max_length=max_length, positive=positive,
                             encoder_mask_rate=encoder_mask_rate,
                             decoder_mask_rate=decoder_mask_rate)
        self.retention = (retention_weight, retention_final_weight, retention_schedule)
        self.teacher = None
        if retention_weight > 0 or retention_final_weight > 0:  # frozen: no gradient, no optimiser
            self.teacher = load_teacher(teacher or self.start).to(model.device)
        self.cap, self.spread = max_document_groups_per_batch, spread_documents
        self.chunk = gradient_cache_chunk
        self.state, self.accumulation = None, 1  # the trainer's (XPRTCallback hands them over)
        self.sampler, self.keys, self.merged, self.seed = None, None, {}, 0
        self.numbers, self.numbers_epoch, self.collators = {}, None, {}
        self.logged: dict = {}  # each term's values since the last log
        self.synced = False
        # every save of the model writes the heads beside it as train.py does (checkpoints included)
        original = model.save

        @functools.wraps(original)
        def save(path, *a, **k):
            original(path, *a, **k)
            self.save_heads(path)

        object.__setattr__(model, "save", save)

    # -- the data: the groups, their sampler, their collator -------------------------------------
    def groups_dataset(self, groups_dir: str, max_groups: Optional[int] = None):
        """select_groups.py's folder as the datasets.Dataset the trainer takes: train.py's
        load_groups and tokens (train.tokenized: each passage tokenised once, cached), and `row`,
        each group's index, by which the collator finds its batch's place in the run. Each group's
        document (batches.document_keys: a doc_id joined with every id sharing an anchor or positive
        text) is what the sampler caps and the collator hands L_xp's mask."""
        from accelerate import PartialState

        import train

        rows = train.load_groups(groups_dir, max_groups)
        rows = train.tokenized(PartialState(), rows, self.collator_for(0))
        self.keys, self.merged = document_keys(rows, positive=self.settings["positive"])
        return rows.add_column("row", list(range(len(rows))))

    def collator_for(self, seed: int):
        """train.py's XPRTCollator with this loss's settings (its draws seeded by SeededCollate)."""
        if seed not in self.collators:
            self.collators[seed] = self.xprt.objective.make_collator(
                self.tokenizer, passage_prefix=self.xprt.prompts["document"], seed=seed,
                **self.settings)
        return self.collators[seed]

    @property
    def batch_sampler(self):
        """SentenceTransformerTrainingArguments(batch_sampler=loss.batch_sampler): make_sampler, as
        a callable the trainer's arguments can pickle (they are saved with every checkpoint)."""
        return _SamplerHook(self)

    def make_sampler(self, dataset, batch_size, drop_last=True, valid_label_columns=None,
                     generator=None, seed=0):
        """train.py's sampler: length-grouped batches, a function of (seed, epoch), at most
        max_document_groups_per_batch groups of a document in a batch (default half of it), runs of
        spread_documents batches dealt round-robin (batches.LengthGroupedBatchSampler)."""
        if self.keys is None or len(self.keys) != len(dataset):
            self.keys, self.merged = document_keys(dataset, positive=self.settings["positive"])
        cap = max(batch_size // 2, 1) if self.cap is None else self.cap
        lengths = group_lengths(dataset, self.settings["num_related"])
        self.sampler = LengthGroupedBatchSampler(lengths, batch_size, seed, spread=self.spread,
                                                 keys=self.keys, max_per_key=cap)
        self.seed = seed
        return self.sampler

    def batch_key(self, rows: list) -> tuple:
        """(epoch, number) of the batch of these rows in the sampler's epoch: KeyedBatches' key."""
        if self.sampler is None:
            raise ValueError("XPRTLoss needs its batch sampler: pass "
                             "batch_sampler=loss.batch_sampler to the training arguments")
        epoch = self.sampler.epoch
        if self.numbers_epoch != epoch:
            self.numbers = {tuple(b): n for n, b in enumerate(self.sampler.batches())}
            self.numbers_epoch = epoch
        n = self.numbers.get(tuple(rows))
        if n is None:
            raise ValueError("a batch XPRTLoss's sampler did not make: pass "
                             "batch_sampler=loss.batch_sampler")
        return epoch, n

    def collate(self, rows: list) -> dict:
        """The trainer's data_collator: train.py's batch of these rows (SeededCollate: the masks
        drawn from (seed, epoch, batch number, process); the merged doc_id), every key prefixed so
        the trainer hands the loss the whole batch as one feature dict."""
        epoch, n = self.batch_key([r["row"] for r in rows])
        process = torch.distributed.get_rank() if distributed() else 0
        merged = self.merged

        def make_row(e, i, row):
            return {**row, "doc_id": merged[i]} if i in merged else row

        collate = SeededCollate(self.collator_for(self.seed), self.seed, process, make_row)
        batch = collate([((epoch, n, r["row"]), r) for r in rows])
        return {PREFIX + k: v for k, v in batch.items()}

    def trainer_kwargs(self) -> dict:
        """SentenceTransformerTrainer(..., **loss.trainer_kwargs()): the collator, the callback."""
        return {"data_collator": _Collator(self), "callbacks": [XPRTCallback(self)]}

    # -- the step --------------------------------------------------------------------------------
    def forward(self, features, labels=None):
        """XPRTModel.forward on the collated batch with w(t) at the trainer's step (cached_step with
        gradient_cache_chunk) -> the loss; each term kept for the log (XPRTCallback.on_log)."""
        batch = next(f for f in features if "layout" in f)
        if distributed() and not self.synced:  # every process starts from process 0's weights
            for p in self.parameters():  # the heads (outside DDP), a fresh pooler's draws
                torch.distributed.broadcast(p.data, 0)
            self.synced = True
        state = self.state
        step, total = (state.global_step, state.max_steps) if state is not None else (0, 1)
        w = retention_weight(step, total, *self.retention) if self.teacher is not None else 0.0
        if self.chunk and torch.is_grad_enabled():
            # forward and backward chunk by chunk here, over the accumulation count (train.py's
            # gradient_cache_step); the trainer's backward then only reaches the gradient average
            def backward(surrogate):
                (surrogate / self.accumulation).backward()

            out = self.xprt.cached_step(batch, self.chunk, backward, teacher=self.teacher,
                                        retention_weight=w)
            loss = out["loss"].detach().requires_grad_()
        else:
            out = self.xprt(batch, teacher=self.teacher, retention_weight=w)
            loss = out["loss"]
        # the scalars (in_batch_negatives too; not the per-row counts) as train.py logs them;
        # the total as xprt_loss: the trainer logs its own "loss"
        for k, v in out.items():
            if torch.is_tensor(v) and v.dim() == 0:
                self.logged.setdefault("xprt_loss" if k == "loss" else k, []).append(float(v.detach()))
        if distributed() and loss.requires_grad:
            return _AverageGradients.apply(loss, [p for p in self.parameters() if p.requires_grad])
        return loss

    # -- the heads in the model's folder ---------------------------------------------------------
    def save_heads(self, path: str):
        """xprt_heads.safetensors and xprt_config.json beside the saved SentenceTransformer, in
        save_xprt_folder's form (heads_state_dict, heads_config, the ModelInfo), so that train.py,
        finetune.py and evaluate.py read the folder as one of theirs."""
        from safetensors.torch import save_file

        if distributed() and torch.distributed.get_rank() != 0:
            return
        info = self.xprt.info
        stage = {"stage": "xprt pretrain (XPRTLoss, sentence-transformers)", "model": None}
        config = {"objective": self.xprt.objective_name, "tau": self.xprt.tau,
                  "heads": heads_config(self.xprt), "start_model": info.start_model,
                  "prompts": info.prompts, "base_model": info.base_model,
                  "hub_model_id": info.hub_model_id, "lineage": [*info.lineage, stage],
                  "pooling": info.pooling, "normalize": info.normalize,
                  "similarity_fn_name": info.similarity_fn_name, "modules": info.modules,
                  "dim": info.dim}
        save_file(heads_state_dict(self.xprt), os.path.join(path, "xprt_heads.safetensors"))
        Path(path, "xprt_config.json").write_text(json.dumps(config, indent=2))

    def load_heads(self, path: str):
        """The heads of a folder save_heads or train.py wrote: the trainer's resume restores the
        encoder, this the decoder and the MLM head."""
        from safetensors.torch import load_file

        sd = load_file(os.path.join(path, "xprt_heads.safetensors"))
        head = head_params(self.xprt.encoder)
        with torch.no_grad():
            for k, v in sd.items():
                if k.startswith("mlm_head."):
                    head[k[len("mlm_head."):]].copy_(v)
        own = {k: v for k, v in sd.items() if not k.startswith("mlm_head.")}
        self.xprt.objective.load_state_dict(own)

    def get_config_dict(self) -> dict:
        """What the model card's training section shows of the loss."""
        return {"start": self.start, **self.settings, "retention": list(self.retention),
                "weights": vars(self.xprt.objective.weights),
                "fill_in": self.xprt.objective.fill_in, "gradient_cache_chunk": self.chunk}

    @property
    def citation(self) -> str:
        return ("@misc{xprt,\n  title={Cross-Passage Retrieval Pretraining (xPRT)},\n"
                "  note={reference implementation: modeling_xprt.py}\n}")


class _SamplerHook:
    """loss.batch_sampler: calls loss.make_sampler; pickled as its name (the trainer saves its
    arguments with every checkpoint)."""

    def __init__(self, loss: XPRTLoss):
        self.loss = loss

    def __call__(self, dataset, **kw):
        return self.loss.make_sampler(dataset, **kw)

    def __reduce__(self):
        return str, ("XPRTLoss.batch_sampler",)


class _Collator:
    """The trainer's data_collator (loss.collate); no label columns (xPRT's batch has none)."""

    valid_label_columns: list = []

    def __init__(self, loss: XPRTLoss):
        self.loss = loss

    def __call__(self, rows: list) -> dict:
        return self.loss.collate(rows)


class XPRTCallback(TrainerCallback):
    """The trainer's side of XPRTLoss: hands it the trainer's state (w(t) at global_step of
    max_steps) and accumulation count; on a resumed run restores the heads from the checkpoint the
    trainer resumed (<output_dir>/checkpoint-<global_step>); adds each term's mean since the last
    log to the log (averaged over the processes)."""

    def __init__(self, loss: XPRTLoss):
        self.loss = loss

    def on_train_begin(self, args, state, control, **kwargs):
        self.loss.state, self.loss.accumulation = state, args.gradient_accumulation_steps
        if state.global_step > 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if not os.path.isfile(os.path.join(folder, "xprt_heads.safetensors")):
                raise FileNotFoundError(f"{folder}: no xprt_heads.safetensors to resume the heads")
            self.loss.load_heads(folder)

    def on_step_begin(self, args, state, control, **kwargs):
        self.loss.state = state

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not self.loss.logged:
            return
        means = {k: sum(v) / len(v) for k, v in self.loss.logged.items()}
        if distributed():
            t = torch.tensor(list(means.values()), dtype=torch.float64)
            torch.distributed.all_reduce(t)
            means = dict(zip(means, (t / torch.distributed.get_world_size()).tolist()))
        self.loss.logged = {}
        logs.update({k: round(v, 4) for k, v in means.items()})
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(logs)
