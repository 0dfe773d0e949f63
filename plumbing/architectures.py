"""
Any encoder AutoModelForMaskedLM loads, taken apart the way xPRT needs it, and the vocabulary terms computed chunk by
chunk: modeling_xprt.py's one companion. It imports no file of the repository, so modeling_xprt.py and this file,
copied alone into another project, work there (tests/test_lifting.py).

xPRT reuses three parts of its start model besides the encoder pass itself: the token embeddings (the decoder reads
the encoder's own), the Transformer layer (the one-layer decoder is one more layer of the encoder's own kind) and the
MLM head (split into its transform and the vocabulary projection, which the vocabulary terms compute chunk by chunk).
Each architecture arranges these differently (ELECTRA projects its embeddings up to the hidden size, ModernBERT and
DeBERTa-v2 hand their layers rotary or relative positions, DistilBERT keeps its MLM head in four loose modules,
DeBERTa-v2 projects with a bare matmul), so each part is found by one general rule, checked against the encoder's
own forward at load (encoder_pieces), and a model the rule does not fit is refused there, naming what failed.
  - token_embeddings: what the encoder hands its first layer; embedding_module: the modules that compute it;
  - layer_stack: the encoder's layer list, so that architectures.run_layers runs a stack of layers the way the
    encoder runs its own (check_layers); decoder_layers and copy_last_layers (SimLM's decoder) build such stacks;
  - mlm_head: the transform (what the MLM model feeds into its vocabulary matrix), the matrix and its bias;
  - the vocabulary terms (last section): linear_cross_entropy and linear_kl_div, chunk by chunk in one fused pass.
The loaders (load_mlm_encoder, load_teacher) and the model folder are plumbing/model_folder.py's.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("xprt")

class _Stop(Exception):
    """Raised from inside a forward to stop it once the tensor we came for exists (its autograd graph stays)."""

    def __init__(self, value):
        super().__init__("stopped")
        self.value = value

# ==============================================================================================================
# The layer stack: found, copied, run as the encoder runs it
# ==============================================================================================================

def layer_stack(base: nn.Module) -> tuple:
    """(owner, attribute name, nn.ModuleList) of the encoder's Transformer layers: the ModuleList of `base` holding
    the most parameters whose members are all of one class (BERT's encoder.layer, DistilBERT's transformer.layer,
    ModernBERT's layers, ...)."""
    best, best_n = None, -1
    for owner_name, owner in base.named_modules():
        for name, child in owner.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            if len({type(m) for m in child}) != 1:
                continue
            n = sum(_numel(p) for p in child.parameters())
            if n > best_n:
                best, best_n = (owner, name, child), n
    if best is None:
        raise ValueError(f"{type(base).__name__}: no list of Transformer layers found (xprt's decoder is built from "
                         "the encoder's own layers)")
    return best

def run_layers(base: torch.nn.Module, layers: torch.nn.ModuleList, hidden: torch.Tensor,
               attention_mask: torch.Tensor, stack: tuple) -> torch.Tensor:
    """Run `layers` on hidden (N, L, H) with attention_mask (N, L) exactly as `base` runs its own layers -> (N, L, H).
    stack: (owner, attribute name) of the encoder's layer list (architectures.layer_stack finds it once, at load).

    The encoder's forward runs with its layer list swapped for `layers` and the first layer's input replaced by
    `hidden`, so masks, rotary or relative positions and final norms are the encoder's own (checked at load:
    architectures.check_layers)."""
    owner, name = stack

    def replace(_module, args, kwargs):
        if args:
            return (hidden,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    embed_dim = base.get_input_embeddings().embedding_dim
    dummy = hidden.new_zeros(*hidden.shape[:2], embed_dim)
    own = owner._modules[name]
    owner._modules[name] = layers  # the encoder's layer list swapped for `layers` for this one call
    handle = layers[0].register_forward_pre_hook(replace, with_kwargs=True)
    try:
        return base(inputs_embeds=dummy, attention_mask=mask_for_layers(base, attention_mask))[0]
    finally:
        handle.remove()
        owner._modules[name] = own

def mask_for_layers(base: nn.Module, attention_mask: Optional[torch.Tensor]):
    """attention_mask (N, L) -> the mask in the form `base`'s layers take, made here: transformers'
    create_bidirectional_mask for its config and attention implementation, never dropped, which base's forward then
    takes as it is: no host sync (docs/plumbing.md: mask_for_layers). Only for an encoder whose output the load
    probe found the same with this mask (probe_prepared_mask); any other gets its 2D mask back."""
    if attention_mask is None or attention_mask.ndim != 2 or not getattr(base, "xprt_prepared_mask", False):
        return attention_mask
    from transformers.masking_utils import create_bidirectional_mask

    n, l = attention_mask.shape
    # what the mask builder reads of the embeddings: batch, length, dtype (an eager mask's fill value) and device
    shape = torch.empty((n, l, 0), dtype=base.get_input_embeddings().weight.dtype, device=attention_mask.device)
    return create_bidirectional_mask(base.config, shape, attention_mask, allow_is_bidirectional_skip=False)

def probe_prepared_mask(model: nn.Module) -> str:
    """At load, once: whether the encoder gives the same output on a padded probe (2 rows of up to 512 tokens, one
    padded; eval mode) with its layers' mask made by mask_for_layers as with its 2D mask; records the answer on the
    encoder (xprt_prepared_mask) -> the line the start-up message says. An encoder that fails keeps the 2D mask
    (docs/plumbing.md: probe_prepared_mask)."""
    base = getattr(model, "base_model", model)
    base.xprt_prepared_mask = False
    if next(base.parameters()).is_meta:  # a weightless model (the harness's FLOP estimate) runs no mask
        return "attention mask: none (weightless model)"
    # as long as the encoder takes, up to 512 tokens: a local window (ModernBERT's 128) must be shorter than the probe
    length = next(n for n in (512, 256, 128, 64, 32, 16, 6) if n == 6 or runs_at_length(base, n))
    ids, mask = _probe_ids(base, length)
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            want = base(input_ids=ids, attention_mask=mask)[0]
            base.xprt_prepared_mask = True
            got = base(input_ids=ids, attention_mask=mask_for_layers(base, mask))[0]
        same = got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=1e-5, rtol=1e-4)
        why = "" if same else f"its output differs by {(got.float() - want.float()).abs().max().item():.2g}"
    except Exception as err:  # noqa: BLE001 - any refusal of the 4D mask means: keep the 2D one
        same, why = False, f"it refuses it ({type(err).__name__})"
    finally:
        base.train(was_training)
    base.xprt_prepared_mask = same
    if same:
        return "attention mask: prepared per call (no host sync)"
    return f"attention mask: {type(base).__name__}'s own, from the 2D mask (with one prepared here {why})"

def _hidden_arg(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]

def token_embeddings(base: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
    """(N, L) ids -> (N, L, H) the vectors the encoder hands its first layer: its embedding layer and whatever follows
    it before the layers (ELECTRA's embeddings_project from its embedding size up to the hidden size). The encoder's
    forward, stopped at its first layer."""
    _, _, stack = layer_stack(base)

    def stop(_module, args, kwargs):
        raise _Stop(_hidden_arg(args, kwargs))

    handle = stack[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        base(input_ids=input_ids, attention_mask=attention_mask)
    except _Stop as s:
        return s.value
    finally:
        handle.remove()
    raise RuntimeError(f"{type(base).__name__} never called its first layer")

def embedding_module(base: nn.Module) -> nn.Module:
    """token_embeddings as a module of the encoder's own: the chain of its direct children from the one fed the ids
    to the one the first layer reads (ELECTRA: embeddings, then embeddings_project). Found on a probe batch, refused
    unless it gives what the encoder hands its first layer at the real tokens."""
    _, _, stack = layer_stack(base)
    ran = {}  # id(output) -> (module, its first tensor input)

    def record(module, args, kwargs, out):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if isinstance(out, torch.Tensor):
            ran[id(out)] = (module, first)

    hooks = [child.register_forward_hook(record, with_kwargs=True) for child in base.children()
             if not any(m is stack[0] for m in child.modules())]
    ids, mask = _probe_ids(base)
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            want = token_embeddings(base, ids, mask)
            chain, x = [], want
            while id(x) in ran and x is not ids:
                module, x = ran.pop(id(x))
                chain.insert(0, module)
            module = chain[0] if len(chain) == 1 else nn.Sequential(*chain)
            got = module(ids) if chain and x is ids else None
    finally:
        base.train(was_training)
        for h in hooks:
            h.remove()
    if mask is None and got is not None:  # weightless (meta): shapes only, no values to compare
        return module
    real = mask.bool()
    if got is None or got.shape != want.shape or not torch.allclose(got[real], want[real], atol=1e-5):
        raise ValueError(f"{type(base).__name__}: what it hands its first layer is not the output of its modules "
                         "that run before it; xprt's decoder embeds its input with them")
    return module

def _copy_layer(layer: nn.Module, config) -> nn.Module:
    # the copy shares the encoder's config object, so an attention setting made on the encoder holds for it too
    return copy.deepcopy(layer, memo={id(config): config})

def decoder_layers(encoder, n: int) -> nn.ModuleList:
    """n fresh layers of the encoder's own kind: copies of its first layer (the one that reads the embeddings, as the
    decoder's layer does: docs/plumbing.md: decoder_layers), every parameter re-initialised by its _init_weights."""
    base = getattr(encoder, "base_model", encoder)
    _, _, stack = layer_stack(base)
    layers = nn.ModuleList([_copy_layer(stack[0], base.config) for _ in range(n)])
    for m in layers.modules():  # transformers 5 skips modules it marked initialised when it loaded the checkpoint
        if hasattr(m, "_is_hf_initialized"):
            m._is_hf_initialized = False
    layers.apply(encoder._init_weights)
    return layers

def copy_last_layers(encoder, n: int) -> nn.ModuleList:
    """SimLM's decoder: a copy of the encoder's last n layers, weights and all (they train apart from the encoder)."""
    base = getattr(encoder, "base_model", encoder)
    _, _, stack = layer_stack(base)
    if not 1 <= n <= len(stack):
        raise ValueError(f"{type(base).__name__} has {len(stack)} layers; cannot copy the last {n}")
    return nn.ModuleList([_copy_layer(layer, base.config) for layer in stack[len(stack) - n:]])

def check_layers(encoder, name: str = ""):
    """Refuse an encoder whose layers run_layers cannot run as the encoder does: the encoder's own layers, run on the
    vectors token_embeddings gives, must reproduce its output (a tiny input, eval mode). An encoder that reads its
    embedding output elsewhere than through its first layer fails here (docs/plumbing.md: check_layers)."""
    base = getattr(encoder, "base_model", encoder)
    arch = type(base).__name__
    owner, attr, stack = layer_stack(base)
    ids, mask = _probe_ids(base)
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            want = base(input_ids=ids, attention_mask=mask)[0]
            got = run_layers(base, stack, token_embeddings(base, ids, mask), mask, (owner, attr))
    finally:
        base.train(was_training)
    gap = (got.float() - want.float()).abs().max().item()
    if not torch.allclose(got.float(), want.float(), atol=1e-4, rtol=1e-3):
        raise ValueError(f"{name or arch}: {arch} does not run its layers on what it hands its first layer alone "
                         f"(re-running its own layers differs from its output by {gap:.2g}); xprt's decoder, a layer "
                         "of the encoder's own kind run on the decoder's input, cannot be built for it")

def runs_at_length(base: nn.Module, length: int) -> bool:
    """Whether the encoder takes an input of `length` positions: its embedding layer (and what follows it before the
    layers: token_embeddings) run on one row of that length. Measured, not read from the config, so that every
    family's position rule counts as the model applies it (docs/plumbing.md: runs_at_length)."""
    device = next(base.parameters()).device
    # a token that is not padding: RoBERTa-style positions count only the non-padding tokens
    token = 2 if getattr(base.config, "pad_token_id", None) in (0, 1) else 1
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            token_embeddings(base, torch.full((1, length), token, dtype=torch.long, device=device),
                             torch.ones(1, length, dtype=torch.long, device=device))
        return True
    except (IndexError, RuntimeError):  # a position index past the table, a buffer that cannot expand to it
        return False
    finally:
        base.train(was_training)

def longest_input(base: nn.Module, upto: int) -> int:
    """The longest input (at most `upto` positions) the encoder takes (runs_at_length, by bisection)."""
    lo, hi = 0, upto
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if runs_at_length(base, mid) else (lo, mid - 1)
    return lo

def _probe_ids(base, length: int = 6):
    """A tiny batch (2 x `length` ids, the second row padded from two thirds on) for the load-time checks."""
    cfg = base.config
    device = next(base.parameters()).device
    v = cfg.vocab_size
    primes = torch.tensor([5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43], device=device)
    at = torch.arange(length, device=device)
    ids = torch.stack([primes[at % 12], primes[(at + 6) % 12]]) % max(v, 1)
    real = max(1, (2 * length) // 3)
    mask = torch.ones(2, length, dtype=torch.long, device=device)
    mask[1, real:] = 0
    pad = getattr(cfg, "pad_token_id", None)
    if pad is not None and 0 <= pad < v:
        ids = ids.masked_fill(mask == 0, pad)
        ids = torch.where((mask == 1) & (ids == pad), (ids + 1) % v, ids)
    if ids.is_meta:  # a weightless model (the harness's FLOP estimate): no mask, whose checks would read values
        return ids, None
    return ids, mask

# ==============================================================================================================
# The MLM head: transform, vocabulary matrix, bias
# ==============================================================================================================

class MLMHead(NamedTuple):
    """The MLM head split where the vocabulary sweep needs it: logits = transform(h) @ weight.T + bias.
    transform: (M, H) -> (M, D); weight (V, D), the vocabulary matrix (D = H, or ELECTRA's embedding size);
    bias (V,)."""

    transform: Callable
    weight: torch.Tensor
    bias: torch.Tensor

class _ProjectionInput(torch.overrides.TorchFunctionMode):
    """Stops a forward at the first operation that reads the vocabulary matrix (a Linear, or a matmul with its
    transpose as DeBERTa-v2 does) together with another tensor, and hands that other tensor over: the transform's
    output. Operations on the matrix alone (.t(), a dtype cast) are followed, since their results are the matrix too."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight
        self.views = [weight]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(any(a is w for w in self.views) for a in tensors):
            others = [a for a in tensors if not any(a is w for w in self.views) and a.dim() >= 2]
            if others:
                raise _Stop(others[0])
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self.views.append(out)
            return out
        return func(*args, **kwargs)

def _shape(p) -> tuple:
    """A parameter's full shape, also under DeepSpeed ZeRO-3, where each process holds a flat shard of it."""
    return tuple(getattr(p, "ds_shape", p.shape))

def _numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))

def vocab_matrix(mlm) -> torch.Tensor:
    """The (V, D) matrix the logits come from: the output embeddings when they have V rows, else the word embeddings
    (DeBERTa-v2's non-legacy head multiplies by them directly; its get_output_embeddings names a (H, H) layer)."""
    v = mlm.config.vocab_size
    out = mlm.get_output_embeddings()
    for w in (getattr(out, "weight", None), mlm.get_input_embeddings().weight):
        if w is not None and len(_shape(w)) == 2 and _shape(w)[0] == v:
            return w
    raise ValueError(f"{type(mlm).__name__}: no (vocabulary x dim) matrix among its output or input embeddings")

def _vocab_bias(mlm, weight) -> torch.Tensor:
    """The logits' (V,) bias: the output embedding's, else the head's own (V,) parameter (BERT's cls.predictions.bias,
    DeBERTa-v2's lm_head.bias), else zeros (a head without one)."""
    v = mlm.config.vocab_size
    out = mlm.get_output_embeddings()
    b = getattr(out, "bias", None)
    if isinstance(b, torch.Tensor) and _shape(b) == (v,) and getattr(out, "weight", None) is weight:
        return b
    cands = [p for p in head_params(mlm).values() if _shape(p) == (v,)]
    if len(cands) == 1:
        return cands[0]
    if cands:
        raise ValueError(f"{type(mlm).__name__}: {len(cands)} vocabulary-sized vectors in its MLM head; which is the "
                         "logits' bias is ambiguous")
    return torch.zeros(v, dtype=weight.dtype, device=weight.device)

def mlm_head(mlm) -> MLMHead:
    """The MLM head of any *ForMaskedLM model as (transform, weight, bias), logits = transform(h) @ weight.T + bias.

    transform is a module built once from the head's own modules (_transform_module; per architecture:
    docs/plumbing.md: mlm_head). check_mlm_head measures it against the model's logits."""
    weight = vocab_matrix(mlm)
    return MLMHead(_transform_module(mlm, weight), weight, _vocab_bias(mlm, weight))

def _projection_input(mlm, weight, h3: torch.Tensor):
    """What the MLM model's own forward, started from the hidden states h3 (its base model answers with h3 instead of
    running), feeds into its vocabulary matrix: the reference the transform module is measured against."""
    from transformers.modeling_outputs import BaseModelOutput

    base = mlm.base_model
    base.forward = lambda *a, **k: BaseModelOutput(last_hidden_state=h3)  # shadows the class's forward, this call
    try:
        with _ProjectionInput(weight):
            mlm(input_ids=torch.zeros(h3.shape[:2], dtype=torch.long, device=h3.device))
    except _Stop as s:
        return s.value
    finally:
        del base.forward
    raise ValueError(f"{type(mlm).__name__}: its forward never read its vocabulary matrix")

def _without(module: nn.Module, path: str) -> nn.Module:
    """A shallow copy of `module` with its submodule at the dotted `path` replaced by an identity; every other
    submodule and parameter is the original's (shared, so training moves both)."""
    first, _, rest = path.partition(".")
    out = copy.copy(module)
    # its own hook tables: a shallow copy shares the original's, so hooks registered on the original later
    # (DeepSpeed ZeRO-3 hooks every module of the engine's model, reading the module's ds_id) would run on the copy
    for k, v in vars(module).items():
        if "_hooks" in k and isinstance(v, dict):
            setattr(out, k, type(v)())
    out._modules = dict(module._modules)
    out._modules[first] = _without(module._modules[first], rest) if rest else nn.Identity()
    return out

def _transform_module(mlm, weight) -> nn.Module:
    """The head's modules that run before the vocabulary matrix is read, as one module, found on a probe (the matrix's
    submodule replaced by an identity; a bare matmul's module opened by the same rule). Refused unless it gives what
    the forward feeds into the matrix."""
    base = mlm.base_model
    inside = {id(m) for m in base.modules()}
    started, finished = [], set()
    hooks = []
    for m in mlm.modules():
        if m is not mlm and id(m) not in inside:
            hooks.append(m.register_forward_pre_hook(lambda m, _a: started.append(m)))
            hooks.append(m.register_forward_hook(lambda m, _a, _o: finished.add(id(m))))
    ids, mask = _probe_ids(base)
    was_training = mlm.training
    mlm.eval()
    try:
        with torch.no_grad():
            h3 = base(input_ids=ids, attention_mask=mask)[0]
            want = _projection_input(mlm, weight, h3)
    finally:
        for h in hooks:
            h.remove()

    def chain(parent) -> list:
        kids = {id(k) for k in parent.children()}
        out = []
        for m in [m for m in started if id(m) in kids]:
            if id(m) in finished:
                out.append(m)
                continue
            holder = next((n for n, sub in m.named_modules() if any(p is weight for p in sub._parameters.values())),
                          None)
            if holder is None:
                return out + chain(m)
            return out + ([_without(m, holder)] if holder else [])
        return out

    parts = chain(mlm)
    module = parts[0] if len(parts) == 1 else nn.Sequential(*parts)
    if weight.is_meta:  # weightless (the harness's FLOP estimate): shapes only, no values to compare
        mlm.train(was_training)
        return module
    try:
        with torch.no_grad():
            good = module(h3).shape == want.shape and torch.allclose(module(h3), want, atol=1e-5)
    finally:
        mlm.train(was_training)
    if not good:
        raise ValueError(f"{type(mlm).__name__}: its MLM head before the vocabulary matrix is not a chain of its own "
                         "modules; xprt's vocabulary terms need that form")
    return module

class EncoderPieces(NamedTuple):
    """What a training step calls, resolved once when the model is built (encoder_pieces): embed (N, L) ids ->
    (N, L, H), what the encoder hands its first layer (embedding_module); run_layers(layers, hidden, mask), layers run
    as the encoder runs its own (run_layers); the MLM head as transform, vocab_weight (V, D), vocab_bias (V,):
    logits = transform(h) @ vocab_weight.T + vocab_bias (mlm_head)."""

    embed: nn.Module
    run_layers: Callable
    transform: nn.Module
    vocab_weight: torch.Tensor
    vocab_bias: torch.Tensor

def layer_runner(encoder) -> Callable:
    """run_layers bound to the encoder, its layer list found once: (layers, hidden, mask) -> (N, L, H)."""
    base = getattr(encoder, "base_model", encoder)
    return functools.partial(run_layers, base, stack=layer_stack(base)[:2])

def encoder_pieces(mlm) -> EncoderPieces:
    """The pieces of an AutoModelForMaskedLM a step calls, each found by its rule and checked against the encoder's
    own forward here, at load, so a step never searches for them."""
    head = mlm_head(mlm)
    return EncoderPieces(embedding_module(mlm.base_model), layer_runner(mlm), head.transform, head.weight, head.bias)

def check_mlm_head(mlm, name: str = ""):
    """Refuse a model whose mlm_head split does not reproduce its own logits (a tiny input, eval mode)."""
    arch = type(mlm).__name__
    ids, mask = _probe_ids(mlm.base_model)
    was_training = mlm.training
    mlm.eval()
    try:
        with torch.no_grad():
            want = mlm(input_ids=ids, attention_mask=mask).logits
            hidden = mlm.base_model(input_ids=ids, attention_mask=mask)[0]
            head = mlm_head(mlm)
            got = F.linear(head.transform(hidden), head.weight, head.bias)
    except _Stop:
        raise
    finally:
        mlm.train(was_training)
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=1e-4, rtol=1e-3):
        gap = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("nan")
        raise ValueError(f"{name or arch}: {arch}'s MLM head is not a transform followed by one vocabulary projection "
                         f"(the split differs from its logits by {gap:.2g}); xprt's vocabulary terms need that form")

def head_params(mlm_model) -> dict:
    """The MLM head's own parameters (not the base model's, not the projection tied to the word
    embeddings), by name: what xprt_heads.safetensors stores and what mlm_head_from copies."""
    prefix = mlm_model.base_model_prefix + "."
    # named_parameters() drops duplicates, so the tied projection (= word embeddings, seen first
    # in the base model) and BERT's decoder.bias (= predictions.bias) appear once.
    return {k: p for k, p in mlm_model.named_parameters() if not k.startswith(prefix)}

# ==============================================================================================================
# Shapes the FLOP count needs
# ==============================================================================================================

def layer_multiply_adds(encoder) -> tuple:
    """(number of layers, multiply-adds per token of one layer's weight matrices, hidden size), read off the modules
    (every config names them differently: DistilBERT's n_layers / hidden_dim, ModernBERT's gated MLP): the 2-D
    weights of one layer's Linear modules."""
    base = getattr(encoder, "base_model", encoder)
    _, _, stack = layer_stack(base)
    per_token = sum(_numel(m.weight) for m in stack[0].modules() if isinstance(m, nn.Linear))
    return len(stack), per_token, base.config.hidden_size

def head_multiply_adds(encoder) -> int:
    """Multiply-adds per row of the MLM head: its own Linear weights and the vocabulary projection."""
    weight = vocab_matrix(encoder)
    own = sum(_numel(p) for p in head_params(encoder).values() if len(_shape(p)) == 2)
    return own + _numel(weight)

# ==============================================================================================================
# The vocabulary terms, chunk by chunk
# How the vocabulary terms compute (not in the paper): L_MLM, L_cross and L_self (modeling_xprt.py) each project their
# rows onto the vocabulary and take a cross-entropy or a KL; linear_cross_entropy and linear_kl_div do it chunk by chunk
# in one fused pass (_FusedLinearCE), never holding the (rows x V) logits. The math is that of plain F.linear +
# F.cross_entropy / F.kl_div (fused=False; tests/test_modeling.py compares them with allclose).
# ==============================================================================================================
def linear_cross_entropy(hidden, weight, bias, targets, fused: bool = True, chunk_size: int = 1024):
    """mean_i -log softmax(hidden_i W^T + b)[targets_i] = F.cross_entropy(F.linear(hidden, W, b), targets).

    hidden (N, D), weight (V, D), bias (V,), targets (N,). 0 (with a zero gradient) for N = 0."""
    if fused:
        return _FusedLinearCE.apply(hidden, weight, bias, targets, None, chunk_size, torch.is_grad_enabled())[0]
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)

def linear_kl_div(hidden, teacher_hidden, weight, bias, fused: bool = True, chunk_size: int = 1024):
    """mean_i KL(softmax(t_i W^T + b) || softmax(hidden_i W^T + b)), t = teacher_hidden (a target: no gradient).

    hidden, teacher_hidden (N, D), weight (V, D), bias (V,). 0 (with a zero gradient) for N = 0."""
    if fused:
        return _FusedLinearCE.apply(hidden, weight, bias, None, teacher_hidden.detach(), chunk_size,
                                    torch.is_grad_enabled())[0]
    if hidden.shape[0] == 0:
        return hidden.sum() * 0.0
    with torch.no_grad():
        t_logp = F.log_softmax(F.linear(teacher_hidden.detach(), weight, bias).float(), dim=-1)
    return F.kl_div(F.log_softmax(F.linear(hidden, weight, bias).float(), -1), t_logp, log_target=True,
                    reduction="batchmean")

# Scratch (chunk, V) fp32 buffers kept across calls and steps, per device and slot (docs/plumbing.md: _SCRATCH). Only
# the forward of _FusedLinearCE writes them, and nothing that outlives the call points into them.
_SCRATCH: dict = {}

def _scratch(slot: str, rows: int, cols: int, device) -> torch.Tensor:
    key = (slot, str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < rows * cols:
        _SCRATCH[key] = buf = None  # free the old one before the bigger one is made
        _SCRATCH[key] = buf = torch.empty(rows * cols, dtype=torch.float32, device=device)
    return buf[: rows * cols].view(rows, cols)

def _logits_into(out, h, weight, bias):
    """out (r, V) fp32 <- h W^T + b, the product in W's dtype (_padded's), autocast on or off: the matmul straight into
    the reused buffer, then the bias in place (not addmm: docs/plumbing.md: _logits_into); in low precision (or under
    autocast) the matmul runs in its own dtype."""
    h = h.to(weight.dtype)  # (r, H): the cast autocast would make; a no-op where the dtypes agree
    if h.dtype == weight.dtype == out.dtype and not torch.is_autocast_enabled(h.device.type):
        return torch.mm(h, weight.t(), out=out).add_(bias)
    return out.copy_(torch.addmm(bias, h, weight.t()))

# The vocabulary rows padded inside the kernel to a multiple of this (docs/plumbing.md: _PAD). Padded words have a
# zero weight row and a bias of -1e30: probability exactly 0, nothing to a loss or a gradient; their gradient rows cut.
_PAD = 64
_PAD_BIAS = -1e30

def _padded(weight, bias, dtype):
    """(W, b) once per call in the products' dtype (autocast's; None: the weight's own), one cast each, not one per
    chunk (the bias too: under autocast the matmul would recast it every chunk); in low precision or on CUDA, the
    vocabulary padded to a multiple of _PAD, W cast straight into the padded matrix (one pass over W, not a cast and
    a copy) -> (W' (V', H), b' (V',))."""
    pad = dtype is not None or weight.device.type == "cuda"  # fp32 on a CPU: no tiles to fill
    dtype = dtype or weight.dtype
    v = weight.shape[0]
    vp = -(-v // _PAD) * _PAD
    if vp == v or not pad:
        return weight.to(dtype), bias.to(dtype)  # no-ops where the dtypes agree
    w_pad = weight.new_empty((vp, weight.shape[1]), dtype=dtype)
    w_pad[:v].copy_(weight)
    w_pad[v:].zero_()
    # fp16 has no -1e30 (it would round to -inf, and 0 x -inf is a NaN in the KL's sums): its lowest finite value
    b_pad = bias.new_full((vp,), max(_PAD_BIAS, torch.finfo(dtype).min), dtype=dtype)
    b_pad[:v] = bias
    return w_pad, b_pad

_FP32_OUT: dict = {}

def _fp32_out_gemm(device) -> bool:
    """Whether this device's addmm takes low-precision inputs into an fp32 output (out_dtype: CUDA; the CPU has no
    such kernel). Probed once per device type on an 8 x 8 product, outside any dispatch mode: a FLOP counter or a
    profiler active at the first call must not decide the kernel's path for the whole run (docs/plumbing.md:
    _fp32_out_gemm). weight_grad_path probes it at start-up and says which path was chosen."""
    from torch.utils._python_dispatch import _disable_current_modes

    if device.type not in _FP32_OUT:
        with _disable_current_modes():
            try:
                a = torch.ones(8, 8, dtype=torch.bfloat16, device=device)
                c = torch.zeros(8, 8, dtype=torch.float32, device=device)
                torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
                _FP32_OUT[device.type] = bool(c[0, 0].item() == 8.0)
            except (RuntimeError, TypeError, NotImplementedError):
                _FP32_OUT[device.type] = False
    return _FP32_OUT[device.type]

def weight_grad_path(device) -> str:
    """The vocabulary weight gradient's path on this device in low precision (_add_weight_grad), probed now: a
    run's start-up line."""
    if _fp32_out_gemm(torch.device(device)):
        return "bf16 inputs into the fp32 accumulator in one GEMM (addmm out_dtype)"
    return "one bf16 product per chunk added in fp32 (this device has no fp32-output GEMM)"

def _add_weight_grad(grad_w, g, hs, first: bool):
    """grad_w (V', H) fp32 (+)= g^T hs: the step's largest matrix product. In fp32 (g fp32) in place. In low precision
    (g bf16, under autocast) not an in-place addmm_, which autocast never casts (docs/plumbing.md: _add_weight_grad):
    bf16 inputs accumulated in fp32 inside the GEMM, straight into the fp32 accumulator where the device can (CUDA's
    out_dtype), else one bf16 product per chunk added in fp32."""
    beta = 0.0 if first else 1.0  # beta 0: the accumulator starts as uninitialised memory
    hs = hs.to(g.dtype)  # (r, H): a no-op where the rows come in g's dtype (autocast's, or fp32 in fp32)
    if g.dtype == torch.float32:
        return grad_w.addmm_(g.t(), hs, beta=beta)
    with torch.autocast(g.device.type, enabled=False):  # the dtypes are chosen here
        if _fp32_out_gemm(g.device):
            return torch.addmm(grad_w, g.t(), hs, beta=beta, out_dtype=torch.float32, out=grad_w)
        part = torch.mm(g.t(), hs)
        return grad_w.copy_(part) if first else grad_w.add_(part)

def _softmax_(z):
    """z (r, V) <- softmax(z) IN PLACE; returns log-sum-exp (r,) of the input rows."""
    m = z.amax(dim=-1, keepdim=True)
    z.sub_(m).exp_()
    s = z.sum(dim=-1, keepdim=True)
    z.div_(s)
    return (m + s.log()).squeeze(1)

def _kl_rows_(zt, z, u, block: int = 2**22):
    """Row-wise KL(p || q), p = softmax(zt), q = softmax(z), (r, V) fp32; zt <- p, z <- q IN PLACE; u scratch.
    From u = z_t - z - (max z_t - max z) (log p - log q up to a row constant; small where p is large), not as a
    difference of two sums of ~10 that cancels (docs/notes.md: Numerics):
        KL = E_p[u] + log E_p[exp(-u)] = E_p[u] + log1p(E_p[expm1(-u)])."""
    torch.sub(zt, z, out=u)  # exact where z_t and z are close (where the KL is small)
    u.sub_(zt.amax(dim=-1, keepdim=True) - z.amax(dim=-1, keepdim=True))  # small where p is large
    _softmax_(zt)
    _softmax_(z)
    # torch's cascaded row sums, not bmm's dot products (4e-5 off at KL = 4e-4); a small temporary for p u
    mean_u, tail = (torch.empty(zt.shape[0], dtype=torch.float32, device=zt.device) for _ in range(2))
    rows = max(1, block // max(zt.shape[1], 1))
    for s in range(0, zt.shape[0], rows):
        p, ub = zt[s : s + rows], u[s : s + rows]
        mean_u[s : s + rows] = (p * ub).sum(dim=-1)
        tail[s : s + rows] = ub.neg_().expm1_().mul_(p).sum(dim=-1)
    return (mean_u.double() + torch.log1p(tail.double())).float()

class _FusedLinearCE(torch.autograd.Function):
    """Vocabulary projection + cross-entropy (hard targets) and/or KL (soft targets), chunk by chunk.

    Never holds the (N, V) logits: each chunk's logits give its loss and its gradients at once; backward scales them
    by the incoming scalar over N. One fp32 (chunk, V) buffer reused (three for KL: _scratch), softmax in place.
    Rows: hidden[:len(targets)] have hard targets, the rest soft ones (teacher_hidden). Returns (the mean over rows,
    per-row losses (N,), no gradient). docs/plumbing.md: _FusedLinearCE."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher_hidden, chunk_size, compute_grad):
        n = hidden.shape[0]
        ctx.inv_n = 1.0 / max(n, 1)  # the mean
        n_ce = 0 if targets is None else targets.shape[0]
        # no gradient work at all under torch.no_grad (evaluation)
        need = [compute_grad and x for x in ctx.needs_input_grad[:3]]
        row_loss = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        if n == 0:
            ctx.grads = (torch.zeros_like(hidden) if need[0] else None, None, None)
            ctx.mark_non_differentiable(row_loss)
            return hidden.new_zeros((), dtype=torch.float32), row_loss
        v = weight.shape[0]
        # the matrix products run in autocast's dtype (bf16 / fp16) where it is on, else in the weight's own (None)
        lowp = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else None
        w, b = _padded(weight, bias, lowp)  # (V', H), (V',) in the products' dtype, V' a multiple of _PAD
        vp = w.shape[0]
        grad_h = torch.empty_like(hidden) if need[0] else None
        grad_w = torch.empty((vp, weight.shape[1]), dtype=torch.float32, device=hidden.device) if need[1] else None
        grad_b = torch.zeros((vp,), dtype=torch.float32, device=hidden.device) if need[2] else None
        rows = min(chunk_size, n)
        ones = torch.ones(rows, dtype=torch.float32, device=hidden.device)  # grad_b: column sums through addmv
        buf = _scratch("logits", rows, vp, hidden.device)
        tbuf = _scratch("teacher", rows, vp, hidden.device) if teacher_hidden is not None else None
        first = True
        # chunks never straddle the hard/soft boundary
        starts = [(s, min(s + chunk_size, n_ce)) for s in range(0, n_ce, chunk_size)]
        starts += [(s, min(s + chunk_size, n)) for s in range(n_ce, n, chunk_size)]
        for s, e in starts:
            h = hidden[s:e]
            r = e - s
            if s < n_ce:  # hard targets: CE = lse - logit[target]
                tgt = targets[s:e]
                z = _logits_into(buf[:r], h, w, b)
                z_tgt = z.gather(1, tgt.unsqueeze(1)).squeeze(1)
                row_loss[s:e] = _softmax_(z) - z_tgt
                g = z  # softmax - one_hot(target)
                g[torch.arange(r, device=g.device), tgt] -= 1.0
            else:  # soft targets: p = softmax(teacher logits), q = softmax(student logits)
                zt = _logits_into(tbuf[:r], teacher_hidden[s - n_ce : e - n_ce], w, b)
                z = _logits_into(buf[:r], h, w, b)
                row_loss[s:e] = _kl_rows_(zt, z, _scratch("log_ratio", r, vp, hidden.device))  # p, q in place
                g = z.sub_(zt)  # softmax(student) - p
            if grad_b is not None:  # fp32, from the fp32 g
                grad_b.addmv_(g.t(), ones[:r])
            if grad_h is None and grad_w is None:
                continue  # no product of g to feed (evaluation): no cast of it either
            g_mm = g if lowp is None else g.to(lowp)  # one cast of the (r, V') gradient, read by both products
            if grad_h is not None:
                grad_h[s:e] = g_mm.to(w.dtype) @ w  # (r, H): small
            if grad_w is not None:  # the rows as they are: no 1/N on them, no fp32 round trip of the (r, H) rows
                _add_weight_grad(grad_w, g_mm, h, first)
            first = False
        total = row_loss.mean()
        gw = None if grad_w is None else grad_w[:v].to(weight.dtype)  # the padded words' rows cut
        gb = None if grad_b is None else grad_b[:v].to(bias.dtype)
        # The gradients are intermediates (neither inputs nor outputs), so they may live on ctx; backward hands
        # them over (scaled in place) instead of allocating a scaled copy of the (V, H) weight gradient.
        ctx.grads = (grad_h, gw, gb)
        ctx.mark_non_differentiable(row_loss)
        return total, row_loss

    @staticmethod
    def backward(ctx, grad_out, _grad_rows):
        if ctx.grads is None:
            raise RuntimeError("backward ran twice through the fused vocabulary loss (retain_graph=True): "
                               "its gradients were handed over the first time; use fused=False for that")
        grads, ctx.grads = ctx.grads, None
        scale = grad_out * ctx.inv_n  # one fp32 scalar for the three gradients
        return (*(None if g is None else g.mul_(scale) for g in grads), None, None, None, None)
