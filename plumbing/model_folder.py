"""
The model folder: what a folder states and records, how every folder this repository writes is saved and loaded,
and its card.
  1. what a folder states: its length limit, pooling, scoring (similarity, Normalize) and the sentence-transformers
     modules after pooling (read here; what the model holds of them, PostPooling and ModelInfo, is modeling_xprt.py's)
  2. save and load: a sentence-transformers folder (save_model_folder), and the XPRTModel folder on top of it
     (save_xprt_folder / load_xprt_folder: the heads, the objective's settings, the lineage); the start's loaders
     (load_mlm_encoder, load_teacher: SDPA attention where the architecture has it)
  3. the card and the Hub: base model, licence, language, usage code, the command without local paths, the scores
     evaluate.py adds, the upload
It imports plumbing/common.py, architectures.py (the encoder's pieces a folder's heads belong to) and modeling_xprt.py
(the model it saves and loads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from modeling_xprt import ModelInfo, PostPooling, max_seq_length
from plumbing.architectures import check_layers, check_mlm_head, head_params, probe_prepared_mask, vocab_matrix
from plumbing.common import (MINILM_ALIASES, UserError, atomic_path, atomic_write, model_file, model_prompts, read_json,
                             resolve_model_path)

logger = logging.getLogger("xprt")

# ==============================================================================================================
# 1. What a folder states: its length limit, pooling, scoring, the modules after pooling
# ==============================================================================================================

def read_max_seq_length(path: str) -> Optional[int]:
    """The length limit a model folder states (sentence-transformers' sentence_bert_config.json max_seq_length), or
    None when it states none."""
    folder = resolve_model_path(path)
    f = os.path.join(folder, "sentence_bert_config.json")
    stated = json.loads(Path(f).read_text()).get("max_seq_length") if os.path.isfile(f) else None
    tok = os.path.join(folder, "tokenizer_config.json")
    if stated is None and os.path.isfile(os.path.join(folder, "modules.json")) and os.path.isfile(tok):
        # sentence-transformers 6 keeps a folder's limit as its tokenizer's model_max_length (transformers writes a
        # huge number there for "no limit")
        m = json.loads(Path(tok).read_text()).get("model_max_length")
        stated = m if isinstance(m, int) and m < 1_000_000 else None
    return stated

def read_pooling(path: str) -> str:
    """The sentence vector a model's sentence-transformers Pooling module makes (model_file: its folder or its Hub
    repository): "mean" or "cls" (either config layout); "mean" for a model without modules.json (docs/plumbing.md:
    read_pooling). Other modes are refused: the losses would train one vector and the saved folder make another."""
    f = model_file(path, "modules.json")
    modules = read_json(f) if f else []
    for m in modules if isinstance(modules, list) else []:
        if m.get("type", "").endswith("Pooling"):
            cfg_file = model_file(path, f"{m.get('path') or ''}/config.json".lstrip("/"))
            cfg = read_json(cfg_file) if cfg_file else {}
            mode = cfg.get("pooling_mode") or next((k[len("pooling_mode_"):] for k, v in cfg.items()
                                                    if k.startswith("pooling_mode_") and v is True), "mean")
            mode = {"cls_token": "cls", "mean_tokens": "mean"}.get(mode, mode)
            if mode not in ("mean", "cls"):
                raise UserError(f"{path}: sentence-transformers pooling {mode!r}; xprt trains and saves mean or "
                                "cls pooling only")
            return mode
    return "mean"

def read_scoring(path: str) -> dict:
    """How a start model's vectors are made and compared, as its folder or Hub repository states it (model_file), for
    ModelInfo: {"pooling" (read_pooling), "normalize" (a Normalize module), "similarity_fn_name" (default cosine)}.
    Without modules.json: mean, Normalize, cosine (docs/plumbing.md: read_scoring)."""
    f = model_file(path, "modules.json")
    modules = read_json(f) if f else None
    if not isinstance(modules, list):
        return {"pooling": read_pooling(path), "normalize": True, "similarity_fn_name": "cosine"}
    st_config = model_file(path, "config_sentence_transformers.json")
    sim = (read_json(st_config) if st_config else {}).get("similarity_fn_name") or "cosine"
    sim = {"cos_sim": "cosine", "dot_score": "dot", "dot_product": "dot"}.get(sim, sim)
    return {"pooling": read_pooling(path), "similarity_fn_name": sim,
            "normalize": any(str(m.get("type", "")).endswith("Normalize") for m in modules)}

def describe_scoring(info) -> str:
    """One phrase for the log and the card: "mean pooling, L2-normalised, cosine similarity", with the modules after
    pooling when there are any ("mean pooling, then 2_Dense(384 -> 128, Tanh), 3_Normalize, 128-d, ...")."""
    modules = f", then {', '.join(info.modules)}, {info.dim}-d" if info.modules else ""
    return (f"{info.pooling} pooling{modules}, {'L2-normalised' if info.normalize else 'not normalised'}, "
            f"{info.similarity_fn_name} similarity")

def check_tokenizer_fits(tokenizer, config, where: str):
    """Refuse a tokenizer that does not fit the model's embedding matrix, naming both sizes (docs/plumbing.md:
    check_tokenizer_fits). A tokenizer may be a little smaller than the matrix (vocabularies padded to a multiple of 8
    or 64), never larger, and not a tenth smaller."""
    n_tok, n_emb = len(tokenizer), config.vocab_size
    if n_tok > n_emb or n_tok < 0.9 * n_emb:
        raise UserError(f"{where}: the tokenizer has {n_tok:,} tokens and the model's embedding matrix {n_emb:,} "
                        "rows: they do not belong together (a folder without its tokenizer files gets transformers' "
                        "5-token fallback); save the model's own tokenizer into the folder")

def _module_folder(name_or_path: str, subfolders: Sequence[str]) -> Optional[Path]:
    """A local folder holding the model's modules.json, config_sentence_transformers.json and `subfolders`: its own
    folder, else its Hub snapshot (those files only), else None."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        return Path(path)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["modules.json", "config_sentence_transformers.json",
                                                            *[f"{s}/*" for s in subfolders]]))
    except Exception:  # noqa: BLE001 - not on the Hub, or no Hub (offline): the model states no modules
        return None

def load_post_pooling(name_or_path: str, hidden_size: int, trust_remote_code: bool = False) -> PostPooling:
    """The PostPooling of a model: the modules its modules.json lists after Pooling, loaded by sentence-transformers,
    and its truncate_dim. Refused by the module's name, before any work: a module before pooling, one whose output
    depends on the input's kind (Router / Asym), one that does not map (N, hidden_size) vectors to vectors."""
    f = model_file(name_or_path, "modules.json")
    modules = read_json(f) if f else None
    if not isinstance(modules, list) or not modules:
        return PostPooling()
    pooling = [i for i, m in enumerate(modules) if str(m.get("type", "")).rpartition(".")[2] == "Pooling"]
    if not pooling:
        raise ValueError(f"{name_or_path}: modules.json has no Pooling module; xprt makes mean or [CLS] vectors "
                         "with one")
    between = modules[1:pooling[0]]
    if between:
        raise ValueError(f"{name_or_path}: module {between[0].get('path') or between[0].get('name')} "
                         f"({between[0].get('type')}) sits between the transformer and the pooling; xprt pools the "
                         "encoder's token states itself and cannot carry it")
    post = modules[pooling[0] + 1:]
    folder = _module_folder(name_or_path, [m.get("path", "") for m in post])
    truncate = read_json(folder / "config_sentence_transformers.json").get("truncate_dim") if folder else None
    if not post:
        return PostPooling(truncate_dim=truncate)
    if folder is None:
        raise ValueError(f"{name_or_path}: its modules after pooling ({', '.join(m.get('path', '') for m in post)}) "
                         "could not be read (offline?)")
    for m in post:
        if m.get("kwargs"):
            raise ValueError(f"{name_or_path}: module {m.get('path')} ({m.get('type')}) takes {m['kwargs']} per "
                             "call; xprt's losses encode every text alike and cannot carry it")
    import tempfile

    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        # a model folder of the post-pooling modules alone (links to the start's subfolders), loaded by
        # sentence-transformers' own modules.json reader: any module type it can load, loaded as it loads it
        for m in post:
            (Path(tmp) / m["path"]).symlink_to((folder / m["path"]).resolve(), target_is_directory=True)
        (Path(tmp) / "modules.json").write_text(json.dumps(post))
        st = SentenceTransformer(tmp, device="cpu", trust_remote_code=trust_remote_code)
        loaded = list(st)
    for m, module in zip(post, loaded):
        if getattr(module, "forward_kwargs", None):
            raise ValueError(f"{name_or_path}: module {m['path']} ({type(module).__name__}) routes by "
                             f"{sorted(module.forward_kwargs)}; xprt's losses encode every text alike and cannot "
                             "carry it")
    pipeline = PostPooling(loaded, truncate, [m["path"] for m in post])
    try:
        pipeline.eval().dim(hidden_size)
    except Exception as err:  # noqa: BLE001 - any failure of a module on sentence vectors refuses the model
        raise ValueError(f"{name_or_path}: its modules after pooling ({', '.join(pipeline.names)}) do not map "
                         f"{hidden_size}-d sentence vectors to sentence vectors ({type(err).__name__}: {err}); xprt "
                         "cannot carry them") from None
    return pipeline.train()

# ==============================================================================================================
# 2. Save and load
# ==============================================================================================================

def save_model_folder(out_dir, base, state_dict: dict, tokenizer, heads: dict, xprt_config: dict, info: ModelInfo,
                      model_card: Optional[str] = None, post_pooling: Optional[PostPooling] = None,
                      code_files: Optional[dict] = None, check=None):
    """A complete sentence-transformers model folder, written to a temporary sibling and renamed into place: the
    encoder `base` with `state_dict` as safetensors, the tokenizer, modules.json (Transformer, Pooling, post_pooling,
    Normalize when info.normalize), config_sentence_transformers.json (prompts, similarity), sentence_bert_config.json
    (the length limit), xprt_heads.safetensors, xprt_config.json (xprt_config plus `info`), the card README.md, and
    the start's code (code_files). check(folder): called on the temporary before the rename; its error leaves
    out_dir as it was."""
    from safetensors.torch import save_file
    from sentence_transformers.sentence_transformer.modules import Normalize

    post = list(post_pooling.modules_) if post_pooling is not None else []
    if info.normalize and not any(isinstance(m, Normalize) for m in post):
        post.append(Normalize())
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    modules += [{"idx": i, "name": str(i), "path": f"{i}_{type(m).__name__}",
                 "type": f"{type(m).__module__}.{type(m).__name__}"} for i, m in enumerate(post, start=2)]
    pooling = {"word_embedding_dimension": base.config.hidden_size,
               "pooling_mode_cls_token": info.pooling == "cls", "pooling_mode_mean_tokens": info.pooling == "mean",
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    xprt_config = {**xprt_config, "start_model": info.start_model, "prompts": info.prompts,
                   "base_model": info.base_model, "hub_model_id": info.hub_model_id, "lineage": info.lineage,
                   "pooling": info.pooling, "normalize": info.normalize,
                   "similarity_fn_name": info.similarity_fn_name, "modules": info.modules, "dim": info.dim}
    st_config = {"prompts": info.prompts, "default_prompt_name": None,
                 "similarity_fn_name": info.similarity_fn_name}
    if post_pooling is not None and post_pooling.truncate_dim is not None:
        st_config["truncate_dim"] = post_pooling.truncate_dim
    with atomic_path(os.path.abspath(out_dir)) as tmp:
        base.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for m in modules[1:]:
            (tmp / m["path"]).mkdir()
        for m, module in zip(modules[2:], post):
            try:  # sentence-transformers' own save of the module (safetensors where it takes the flag)
                module.save(str(tmp / m["path"]), safe_serialization=True)
            except TypeError:
                module.save(str(tmp / m["path"]))
        for name, obj in [("modules.json", modules), ("1_Pooling/config.json", pooling),
                          ("sentence_bert_config.json", {"max_seq_length": info.max_seq_length,
                                                         "do_lower_case": False}),
                          ("xprt_config.json", xprt_config), ("config_sentence_transformers.json", st_config)]:
            (tmp / name).write_text(json.dumps(obj, indent=2))
        save_file(heads, str(tmp / "xprt_heads.safetensors"))
        if model_card:
            (tmp / "README.md").write_text(model_card)
        for name, text in (code_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        if check is not None:
            check(tmp)

def heads_state_dict(model) -> dict:
    """The head_parameters() by name (the objective's, e.g. decoder.*; mlm_head.*), or, for an objective without
    heads of its own (PAIR), the heads of the folder it was loaded from, unchanged; the projection is saved with
    the encoder."""
    sd = dict(model.objective.state_dict()) or dict(model.carried_heads)
    sd.update({f"mlm_head.{k}": v for k, v in head_params(model.encoder).items()})
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}

def heads_config(model) -> dict:
    """What rebuilds the saved heads: {"objective": whose heads, **its config()}."""
    if not dict(model.objective.state_dict()) and model.carried_heads:
        return dict(model.carried_config)
    return {"objective": model.objective_name, **model.objective.config()}

def complete_base_state_dict(model) -> dict:
    """The encoder's weights as AutoModel holds them, with the pooler the MLM base lacks: the start's, else a
    seeded init (docs/plumbing.md: complete_base_state_dict)."""
    sd = dict(model.base.state_dict())
    sd.update({k: v for k, v in getattr(model.encoder, "xprt_base_extras", {}).items() if k not in sd})
    with torch.device("meta"):
        wanted = type(model.base)(model.base.config).state_dict()
    missing = [k for k in wanted if k not in sd]
    if missing:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            fresh = type(model.base)(model.base.config).state_dict()
        dtype = next(iter(sd.values())).dtype
        sd.update({k: fresh[k].to(dtype) for k in missing})
    return sd

def save_xprt_folder(model, out_dir: str, tokenizer, model_card: Optional[str] = None, check=None):
    """The XPRTModel's folder (save_model_folder: the encoder with its start's sentence-transformers modules and
    code, the tokenizer, xprt_heads.safetensors and xprt_config.json: the objective, tau and what rebuilds the
    heads); check(folder) before it replaces out_dir."""
    config = {"objective": model.objective_name, "tau": model.tau, "heads": heads_config(model)}
    save_model_folder(out_dir, model.base, complete_base_state_dict(model), tokenizer, heads_state_dict(model),
                      config, model.info, model_card, model.post_pooling,
                      code_files=getattr(model.encoder, "xprt_code_files", None), check=check)

def load_xprt_folder(cls, path: str, objective: Optional[str] = None, mlm_head_from: Optional[str] = None,
                     trust_remote_code: bool = False, prefixes: str = "auto", hub_model_id: Optional[str] = None, **kw):
    """cls (modeling_xprt.XPRTModel) from any checkpoint (hub id, folder, the MiniLM alias) or a folder written by
    save_xprt_folder.

    A save_pretrained folder gets its MLM head back and, for the same `objective`, its heads and settings; another
    objective's heads are carried through unchanged. Any other checkpoint gets a fresh tied head, or
    `mlm_head_from`'s. kw go to XPRTModel.__init__ and override the folder's settings. prefixes: "auto"
    (common.model_prompts), "e5" or "none". hub_model_id: where the trained model will be pushed."""
    from safetensors.torch import load_file

    name, path = path, resolve_model_path(path)
    cfg_file = os.path.join(path, "xprt_config.json")
    saved = json.loads(Path(cfg_file).read_text()) if os.path.isfile(cfg_file) else {}
    heads_file = os.path.join(path, "xprt_heads.safetensors")
    has_heads = os.path.isfile(heads_file)
    scoring = read_scoring(path)
    mlm, message = load_mlm_encoder(path, mlm_head_from=None if has_heads else mlm_head_from,
                                    trust_remote_code=trust_remote_code, pooling=scoring["pooling"])
    # the start's modules after pooling (Dense, LayerNorm, Normalize, truncate_dim, ...), kept through training and
    # saved back; refused here, by name, when xprt cannot carry them
    post_pooling = load_post_pooling(path, mlm.config.hidden_size, trust_remote_code)
    objective = objective or saved.get("objective", "xprt")
    heads_cfg = dict(saved.get("heads") or {})
    own_heads = heads_cfg.pop("objective", None) == objective
    args = {"tau": saved.get("tau", 0.05), **(heads_cfg if own_heads else {}), **kw}
    # the stages so far: an xprt folder's own record, else the start checkpoint itself
    lineage = saved.get("lineage") or [{"stage": "start", "model": hub_base_model(name)}]
    args["info"] = ModelInfo(start_model=saved.get("start_model") or name, prompts=model_prompts(name, prefixes),
                             max_seq_length=max_seq_length(mlm.config, read_max_seq_length(path), mlm.base_model),
                             base_model=hub_base_model(name), hub_model_id=hub_model_id, lineage=lineage,
                             modules=post_pooling.describe(), dim=post_pooling.dim(mlm.config.hidden_size), **scoring)
    model = cls(mlm, objective=objective, **args)
    model.post_pooling = post_pooling
    model.load_message = message
    if has_heads:
        sd = load_file(heads_file)
        head = head_params(model.encoder)
        head_sd = {k[len("mlm_head."):]: v for k, v in sd.items() if k.startswith("mlm_head.")}
        if set(head_sd) != set(head):
            raise ValueError(f"{heads_file}: MLM head tensors {sorted(head_sd)} do not match the model's "
                             f"{sorted(head)}")
        with torch.no_grad():
            for k, v in head_sd.items():
                head[k].copy_(v)
        own = {k: v for k, v in sd.items() if not k.startswith("mlm_head.")}
        if own_heads:
            model.objective.load_state_dict(own, strict=True)
        else:
            model.carried_heads, model.carried_config = own, dict(saved.get("heads") or {})
        model.load_message = (f"xprt folder {path}: MLM head restored from {heads_file}; " +
                              (f"{objective} heads restored" if own_heads and own else
                               f"{len(own)} tensors of {model.carried_config.get('objective')}'s heads carried "
                               "through unchanged" if own else "no objective heads saved"))
    logger.info(model.load_message)
    return model

# ==============================================================================================================
# 2b. Loading a start model: the MLM encoder and the retention teacher
# ==============================================================================================================

class LoadReportFilter(logging.Filter):
    """Drops transformers' report of missing / unexpected keys of a load (the "LOAD REPORT" table, the tied-weights
    note): see quiet_load_report. A report with shape mismatches or failed conversions passes (transformers raises
    after it and points to it)."""

    def filter(self, record):
        msg = str(record.msg)
        if "LOAD REPORT" in msg:
            return "MISMATCH" in msg or "CONVERSION" in msg
        return "seem corrupted" not in msg

@contextlib.contextmanager
def quiet_load_report():
    """Inside the block, transformers' loading logger (modeling_utils) drops its report of missing / unexpected keys
    and nothing else (a filter, not the logger's level: docs/plumbing.md: quiet_load_report). Used around loads
    whose missing / unexpected keys the caller reads from output_loading_info and reports itself."""
    log, flt = logging.getLogger("transformers.modeling_utils"), LoadReportFilter()
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)

def checkpoint_tensors(path: str, keys: Sequence[str], prefix: str) -> dict:
    """The base model's tensors among `keys` (reported unexpected by the MLM model: BERT's pooler), read from the
    checkpoint's safetensors files and named as the base model names them ("pooler.dense.weight"). A checkpoint
    without safetensors gives {} (a .bin file is a pickle, never opened here); save_pretrained initialises them."""
    from safetensors import safe_open

    keys = [k for k in keys if "position_ids" not in k]
    if not keys:
        return {}
    folder = path
    if not os.path.isdir(folder):  # a hub id: the files from_pretrained just put in the local cache
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(path, allow_patterns=["*.safetensors"], local_files_only=True)
        except Exception:  # noqa: BLE001 - no cached safetensors: the pooler is initialised at save time instead
            return {}
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                name = k[len(prefix):] if k.startswith(prefix) else k
                if k in keys or name in keys:
                    out[name] = st.get_tensor(k)
    return out

def attention_kwargs(path: str, loader=None, trust_remote_code: bool = False) -> tuple:
    """({"attn_implementation": ...}, note) for loading `path` with `loader` (default AutoModel): SDPA where the
    architecture has it, else its default, said in the note (docs/plumbing.md: attention_kwargs)."""
    from transformers import AutoConfig, AutoModel

    loader = loader or AutoModel
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    cls = loader._model_mapping[type(config)] if type(config) in loader._model_mapping else None
    if cls is None or getattr(cls, "_supports_sdpa", False):
        return {"attn_implementation": "sdpa"}, ""
    return {}, f"{cls.__name__} has no SDPA attention: using its own ({config._attn_implementation or 'eager'})"

def load_mlm_encoder(name_or_path: str, mlm_head_from: Optional[str] = None, trust_remote_code: bool = False,
                     pooling: str = "mean"):
    """Any checkpoint AutoModelForMaskedLM loads, SDPA where it has it -> (model, message); refused before any work
    when xprt cannot take it apart. Without an MLM head it gets a fresh one, or `mlm_head_from`'s
    (docs/plumbing.md: load_mlm_encoder). pooling ("mean" or "cls"): for the message."""
    from transformers import AutoModelForMaskedLM

    path = resolve_model_path(name_or_path)
    attn, attn_note = attention_kwargs(path, AutoModelForMaskedLM, trust_remote_code)
    # transformers' LOAD REPORT for this call lists the head as MISSING and the pooler as UNEXPECTED, which reads like
    # an error; the message below states the same facts (and a missing encoder weight still raises)
    with quiet_load_report():
        model, info = AutoModelForMaskedLM.from_pretrained(
            path, output_loading_info=True, trust_remote_code=trust_remote_code, **attn
        )
    prefix = model.base_model_prefix + "."
    # the base model's tensors the MLM model has no module for (BERT's pooler): kept as they are, and written back by
    # model_folder.save_xprt_folder so the saved folder is a complete AutoModel checkpoint
    model.xprt_base_extras = checkpoint_tensors(path, [k for k in info["unexpected_keys"]], prefix)
    # the start's own code (config.json's auto_map), carried into every folder the model is saved to
    model.xprt_code_files = remote_code_files(name_or_path, model.config, trust_remote_code)
    missing_head = sorted(k for k in info["missing_keys"] if not k.startswith(prefix))
    missing_base = sorted(k for k in info["missing_keys"] if k.startswith(prefix) and "position_ids" not in k)
    if missing_base:
        raise ValueError(f"{name_or_path}: encoder weights missing from the checkpoint: {missing_base[:5]}")
    check_layers(model, name_or_path)
    check_mlm_head(model, name_or_path)
    weight = vocab_matrix(model)
    tied = weight is model.get_input_embeddings().weight
    if mlm_head_from:
        donor, dinfo = AutoModelForMaskedLM.from_pretrained(
            resolve_model_path(mlm_head_from), output_loading_info=True, trust_remote_code=trust_remote_code
        )
        donor_missing = [k for k in dinfo["missing_keys"] if not k.startswith(donor.base_model_prefix + ".")]
        if donor_missing:
            raise ValueError(f"--mlm_head_from {mlm_head_from} has no trained MLM head either "
                             f"(missing {donor_missing[:3]})")
        ours, theirs = head_params(model), head_params(donor)
        if set(ours) != set(theirs) or any(ours[k].shape != theirs[k].shape for k in ours):
            raise ValueError(f"MLM head of {mlm_head_from} does not fit {name_or_path} "
                             "(different architecture or vocabulary)")
        with torch.no_grad():
            for k in ours:
                ours[k].copy_(theirs[k])
        message = (f"MLM head copied from {mlm_head_from} ({len(ours)} tensors); vocabulary projection "
                   f"{'tied to' if tied else 'NOT tied to'} {name_or_path}'s word embeddings")
    elif missing_head:
        message = (f"{name_or_path} has no MLM head ({len(missing_head)} missing keys, e.g. {missing_head[0]}): "
                   f"initialised fresh, projection {'tied to the word embeddings' if tied else 'NOT tied'}")
    else:
        message = f"MLM head loaded from {name_or_path}"
    if model.xprt_base_extras:
        vector = "the [CLS] token's last hidden state" if pooling == "cls" else "the mean of the token vectors"
        message += (f"; kept {', '.join(sorted(model.xprt_base_extras))} unchanged so the saved folder is a complete "
                    f"{type(model.base_model).__name__} checkpoint (the sentence vector is {vector}, not this "
                    "pooler's output)")
    if attn_note:
        message += f"; {attn_note}"
    message += f"; {probe_prepared_mask(model)}"
    logger.info(message)
    return model, message

def remote_code_files(name_or_path: str, config, trust_remote_code: bool) -> dict:
    """The code a model's config.json `auto_map` names, and the files those import relatively -> {file name: text}
    (docs/plumbing.md: remote_code_files). Another repository's entry is left to the Hub; with --trust_remote_code
    a named file that cannot be read is refused before any work."""
    from transformers.dynamic_module_utils import get_relative_imports
    from transformers.utils import cached_file

    refs = [r for v in (getattr(config, "auto_map", None) or {}).values()
            for r in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(r, str) and "--" not in r]
    todo, files = sorted({r.split(".")[0] + ".py" for r in refs}), {}
    while todo:
        name = todo.pop()
        if name in files:
            continue
        found = cached_file(resolve_model_path(name_or_path), name, _raise_exceptions_for_missing_entries=False)
        if found is None:
            if trust_remote_code:
                raise UserError(f"{name_or_path}: config.json's auto_map names {name}, which is not in the model's "
                                "folder or repository: its custom code cannot travel with the trained model")
            continue
        files[name] = Path(found).read_text(encoding="utf-8")
        todo += [f"{m}.py" for m in get_relative_imports(found)]
    return files

def load_teacher(name_or_path: str, trust_remote_code: bool = False):
    """The frozen starting model for the retention term: AutoModel, eval mode, no gradients, SDPA attention where the
    architecture has it. A start saved with an MLM head (a *ForMaskedLM checkpoint) has tensors AutoModel has no
    module for: transformers' LOAD REPORT is silenced and the facts logged (the teacher's message)."""
    from transformers import AutoModel

    path = resolve_model_path(name_or_path)
    attn, attn_note = attention_kwargs(path, AutoModel, trust_remote_code)
    with quiet_load_report():
        teacher, info = AutoModel.from_pretrained(path, output_loading_info=True, trust_remote_code=trust_remote_code,
                                                  **attn)
    missing = sorted(k for k in info["missing_keys"] if "position_ids" not in k)
    unused = sorted(info["unexpected_keys"])
    message = f"teacher {name_or_path}: {type(teacher).__name__}, frozen"
    if unused:
        message += f"; {len(unused)} checkpoint tensors it has no module for (e.g. {unused[0]}: an MLM head) left out"
    if missing:
        message += f"; {len(missing)} weights not in the checkpoint, initialised fresh (e.g. {missing[0]})"
    if attn_note:
        message += f"; {attn_note}"
    message += f"; {probe_prepared_mask(teacher)}"
    logger.info(message)
    teacher.xprt_load_message = message
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher

# ==============================================================================================================
# 3. The model card and the Hub
# Base model, licence, language, usage code, the training command without local paths; evaluate.py adds the
# scores; the upload.
# ==============================================================================================================

ALL_MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

EVAL_SECTION_START, EVAL_SECTION_END = "<!-- xprt:evaluation -->", "<!-- /xprt:evaluation -->"

LOCAL_SECTION_START, LOCAL_SECTION_END = "<!-- xprt:local-evaluation -->", "<!-- /xprt:local-evaluation -->"

def hub_base_model(name_or_path: str) -> Optional[str]:
    """The Hub id a model card's base_model can name for a start model, or None when there is none to name.

    The MiniLM alias names sentence-transformers/all-MiniLM-L6-v2; our folder its hub_model_id, else its recorded
    base_model; another local folder none; any other name is a Hub id."""
    if name_or_path in MINILM_ALIASES:
        return ALL_MINILM_HUB_ID
    if os.path.isdir(name_or_path):
        cfg = read_json(Path(name_or_path) / "xprt_config.json")
        return cfg.get("hub_model_id") or cfg.get("base_model") or None
    return name_or_path if _HUB_ID.fullmatch(name_or_path) and not os.path.exists(name_or_path) else None

def card_data(name_or_path: Optional[str]):
    """The metadata of a model's card (a local folder's README.md, the bundled MiniLM's, or a Hub card when the Hub
    can be reached), or None when there is no card."""
    from huggingface_hub import ModelCard

    if not name_or_path:
        return None
    path = resolve_model_path(name_or_path)
    try:
        return ModelCard.load(os.path.join(path, "README.md") if os.path.isdir(path) else path).data
    except Exception:  # noqa: BLE001 - no card, or no Hub (offline): nothing is known
        return None

def card_license(name_or_path: Optional[str]) -> Optional[str]:
    """The licence in a model's card metadata (card_data), or None when no card says: a derived model is bound by
    its start's licence, so train.py / finetune.py default --license to it rather than guess one."""
    data = card_data(name_or_path)
    return data.license if data is not None else None

def card_language(name_or_path: Optional[str]):
    """The language(s) in a model's card metadata (card_data), or None when no card says: a derived model works in
    its start's languages, and a card should not claim one it was never told (a multilingual start is not "en")."""
    data = card_data(name_or_path)
    return (data.language or None) if data is not None else None

# Flags whose values are local paths: the card's command and flags show a placeholder instead (a path of the training
# machine means nothing to a reader, and may say more than its owner wants). Secrets never reach the card.
LOCAL_PATH_FLAGS = ("--output_dir", "--groups_dir", "--beir_dir", "--triples_file", "--mined_negatives")

SECRET_FLAGS = ("--hub_token",)

def _public_value(flag: str, value):
    """A flag's value as the card shows it: a local path (any value of LOCAL_PATH_FLAGS; any other value that exists
    on disk or is absolute) becomes the flag's name in capitals (GROUPS_DIR); a Hub id or a plain value stays."""
    if not isinstance(value, str):
        return value
    if flag in LOCAL_PATH_FLAGS or os.path.isabs(value) or os.path.exists(value):
        return flag.lstrip("-").upper()
    return value

def public_command(script: str, argv) -> str:
    """The command line that trained the model, for its card: the flags as given, local paths as placeholders
    (_public_value), --hub_token dropped."""
    import shlex

    words, flag, skip = [f"python {script}"], "", False
    for tok in argv:
        if tok.startswith("--"):
            flag, _, value = tok.partition("=")
            skip = flag in SECRET_FLAGS
            if not skip:
                words.append(flag if not value else f"{flag}={shlex.quote(str(_public_value(flag, value)))}")
        elif not skip:
            words.append(shlex.quote(str(_public_value(flag, tok))))
    return " ".join(words)

def card_metadata(args, info: ModelInfo, datasets: Optional[list] = None):
    """The card's Hub metadata (huggingface_hub.ModelCardData): base model, datasets, language and licence (the start
    folder's own card first, local, and it carries an xprt start's licence on; then the Hub's), library, tags."""
    from huggingface_hub import ModelCardData

    base_model = info.base_model
    license_ = args.license or card_license(args.model_name_or_path) or card_license(base_model)
    language = card_language(args.model_name_or_path) or card_language(base_model)
    return ModelCardData(base_model=base_model, datasets=datasets or None,
                         language=language, license=license_, library_name="sentence-transformers",
                         pipeline_tag="sentence-similarity",
                         tags=["sentence-transformers", "sentence-similarity", "feature-extraction", "xprt",
                               "retrieval"])

def transformers_usage(info: ModelInfo, model_id: str) -> tuple:
    """The plain-transformers usage of the saved model: its pooling (and L2) and its similarity as code lines, and a
    note for FlagEmbedding users of a mean-pooled model -> (pool_code, score_code, flag_note)."""
    if info.pooling == "cls":
        pool_code = "embeddings = hidden[:, 0]  # [CLS] pooling"
        flag_note = ""
    else:
        pool_code = ('mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)\n'
                     "embeddings = (hidden * mask).sum(1) / mask.sum(1)  # mean pooling")
        flag_note = ("\nFlagEmbedding's `FlagModel` pools [CLS] unless told otherwise: load this model with "
                     f'`FlagModel("{model_id}", pooling_method="mean")`.\n')
    if info.modules:  # Dense, truncate_dim, ...: plain transformers would need each module's own code
        pool_code += ("\n# then the modules after pooling, as sentence-transformers applies them: "
                      f"{', '.join(info.modules)} (use sentence-transformers)")
    elif info.normalize:
        pool_code += "\nembeddings = F.normalize(embeddings, dim=-1)  # L2, as the Normalize module does"
    score_code = {"cosine": "F.cosine_similarity(embeddings[0], embeddings[1], dim=0)",
                  "dot": "embeddings[0] @ embeddings[1]",
                  "euclidean": "-torch.dist(embeddings[0], embeddings[1])",
                  "manhattan": "-torch.dist(embeddings[0], embeddings[1], p=1)"}.get(info.similarity_fn_name,
                                                                                   "embeddings[0] @ embeddings[1]")
    return pool_code, score_code, flag_note

def model_card(args, info: ModelInfo, title: str, script: str, argv: Sequence[str], summary: dict,
               datasets: Optional[list] = None) -> str:
    """The saved folder's README.md: Hub metadata, usage code (sentence-transformers, transformers_usage), the
    training command without local paths, a loss summary. args: the flags; info: ModelInfo; script, argv: the
    command; summary: {"steps", "processes", "rows", "unit", "last_logged_step"}; datasets: the Hub datasets."""
    from huggingface_hub import ModelCard

    prompts, base_model, hub_id = info.prompts, info.base_model, args.hub_model_id
    model_id = hub_id or f"path/to/{Path(args.output_dir).name}/model"
    data = card_metadata(args, info, datasets)
    max_len = info.max_seq_length  # as save_model_folder writes it into sentence_bert_config.json
    q, d = prompts["query"], prompts["document"]
    start = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a local checkpoint"
    lineage = " -> ".join(f"{s['stage']} ({s['model'] or 'local'})" for s in info.lineage)
    pool_code, score_code, flag_note = transformers_usage(info, model_id)
    scoring = describe_scoring(info)
    if info.normalize and info.similarity_fn_name == "cosine":
        trained_note = ""
    else:  # the losses compare L2-normalised vectors (cosines) whatever the start's scoring
        trained_note = (f" Trained with cosine similarity (the losses compare L2-normalised vectors); saved with its "
                        f"start model's scoring ({scoring}), so it is used and scored as its start was; "
                        "`--saved_similarity cosine` saves cosine scoring instead.")
    prefixes = (f"Prefixes: queries `{json.dumps(q)}`, documents `{json.dumps(d)}`, saved as the `query` / "
                "`document` prompts, so "
                "`encode_query` / `encode_document` add them; with plain transformers, add them yourself."
                if q or d else "No prefixes (the start model uses none).")
    modules_note = (f" The modules after pooling ({', '.join(info.modules)}) are the start model's, kept frozen: the "
                    "encoder was trained under them (the similarity losses read the vectors they make) and they are "
                    "saved unchanged." if info.modules else "")
    body = f"""
# {hub_id or Path(args.output_dir).name}

{title}, trained from {start} with this repository's `{script}`. Lineage: {lineage}.
A sentence-transformers model: {scoring} (`modules.json`, `config_sentence_transformers.json`), at most
{max_len} tokens.{trained_note}{modules_note} {prefixes}

## Usage (sentence-transformers)

```python
from sentence_transformers import SentenceTransformer

model_id = "{model_id}"
model = SentenceTransformer(model_id)
queries = model.encode_query(["which passages does an anchor retrieve?"])
documents = model.encode_document(["Anchors are the passages closest to their document's mean vector."])
print(model.similarity(queries, documents))
```

## Usage (transformers)

```python
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

model_id = "{model_id}"
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModel.from_pretrained(model_id).eval()
texts = [{json.dumps(q + "which passages does an anchor retrieve?")},
         {json.dumps(d + "Anchors are the passages closest to their document's mean vector.")}]
batch = tokenizer(texts, padding=True, truncation=True, max_length={max_len}, return_tensors="pt")
with torch.no_grad():
    hidden = model(**batch).last_hidden_state
{pool_code}
print({score_code})  # {info.similarity_fn_name} similarity
```
{flag_note}
{training_section(args, script, argv, summary)}"""
    return str(ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n" + body))

def training_section(args, script: str, argv: Sequence[str], summary: dict) -> str:
    """The card's "Training" and "Configuration" sections: the command without local paths, the run's size, the
    loss terms of the last logged step, and every flag."""
    last = summary.get("last_logged_step") or {}
    terms = {k: v for k, v in last.items() if k == "loss" or k.endswith("_loss")}
    loss_rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in terms.items())
    cfg = {k: _public_value(f"--{k}", v) for k, v in sorted(vars(args).items()) if k != "hub_token"}
    return f"""
## Training

```bash
{public_command(script, argv)}
```

{summary.get("steps")} optimiser step(s) over {summary.get("rows")} {summary.get("unit")}; batch
{args.per_device_train_batch_size} per device x {summary.get("processes")} process(es) x
{args.gradient_accumulation_steps} accumulation; peak learning rate {args.learning_rate}. Losses at the last logged
step ({last.get("step", "none")}):

| term | value |
|---|---|
{loss_rows}

## Configuration (flags; local paths as placeholders)

```json
{json.dumps(cfg, indent=1, default=str)}
```
"""

def _task_type(metric: str) -> str:
    """The model-index task type of a main metric (mteb's task types: retrieval, STS, classification)."""
    m = metric.lower()
    if any(k in m for k in ("ndcg", "map", "mrr", "recall", "precision")):
        return "Retrieval"
    if any(k in m for k in ("spearman", "pearson")):
        return "STS"
    if any(k in m for k in ("accuracy", "f1")):
        return "Classification"
    return "Other"

def add_eval_results_to_card(model_dir, results: dict, source: str, local: bool = False) -> Path:
    """(Re)write an evaluation section of a saved folder's model card (README.md), atomically; returns its path.

    results: {task: {"metric": mteb's main metric (e.g. "ndcg_at_10"), "score": percent, optional "dataset_id",
    "split", "revision" (the task's Hub dataset), "data" (what was scored, for local runs)}}; source: how they were
    obtained (never a local path). Full standard tasks (local=False) go into "Evaluation" and the Hub's
    `model-index`; local data and --limit samples (local=True) into "Scores on local data" only. A task scored
    again replaces its row (the replaced score printed)."""
    from huggingface_hub import EvalResult, ModelCard

    path = Path(model_dir) / "README.md"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no model card to add results to (is {model_dir} a saved model folder?)")
    for task, r in results.items():
        if not isinstance(r, dict) or not {"metric", "score"} <= set(r):
            raise ValueError(f"results[{task!r}] must be {{'metric': name, 'score': percent}}, got {r!r}")
    card = ModelCard(path.read_text(encoding="utf-8"))
    if local:  # kept in the card's metadata under a key of ours (not model-index), rebuilt from it each time
        merged = dict(getattr(card.data, "xprt_local_evaluation", None) or {})
        for task, r in results.items():
            old = merged.get(task)
            if old and old["score"] != round(float(r["score"]), 2):
                print(f"{path}: local {task} score {old['score']:.2f} ({old['data']}) replaced", flush=True)
            merged[task] = {"metric": r["metric"], "score": round(float(r["score"]), 2), "data": r.get("data", "")}
        card.data.xprt_local_evaluation = merged
        rows = "\n".join(f"| {t} | {e['data']} | {e['metric']} | {e['score']:.2f} |" for t, e in merged.items())
        section = (f"{LOCAL_SECTION_START}\n## Scores on local data\n\nNot the tasks the MTEB leaderboard scores: "
                   "local copies or samples of their data, so not in the card's `model-index`.\n\n| task | data | "
                   f"main metric | score |\n|---|---|---|---|\n{rows}\n\nScores in percent; the last update came "
                   f"from {source}.\n{LOCAL_SECTION_END}")
        card.text = _replace_section(card.text, LOCAL_SECTION_START, LOCAL_SECTION_END, section)
        atomic_write(path, str(card))
        return path
    merged = {e.dataset_name: e for e in (card.data.eval_results or [])}
    for task, r in results.items():
        old = merged.get(task)
        if old is not None and old.metric_value != round(float(r["score"]), 2):
            print(f"{path}: {task} score {old.metric_value:.2f} replaced", flush=True)
        merged[task] = EvalResult(task_type=_task_type(r["metric"]), dataset_type=r.get("dataset_id") or task,
                                  dataset_name=task, dataset_split=r.get("split"),
                                  dataset_revision=r.get("revision"), metric_type=r["metric"],
                                  metric_value=round(float(r["score"]), 2))
    card.data.eval_results = list(merged.values()) or None
    cfg = read_json(Path(model_dir) / "xprt_config.json")
    folder = Path(model_dir).resolve()
    # the model's name on the Hub, else its run's (train.py saves <run>/model)
    card.data.model_name = card.data.model_name or cfg.get("hub_model_id") or (
        folder.parent.name if folder.name == "model" else folder.name)
    rows = "\n".join(f"| {e.dataset_name} | {e.task_type} | {e.metric_type} | {e.metric_value:.2f} |"
                     for e in card.data.eval_results or [])
    section = (f"{EVAL_SECTION_START}\n## Evaluation\n\n| task | type | main metric | score |\n|---|---|---|---|\n"
               f"{rows}\n\nScores in percent on the full tasks; the last update came from {source}. The same "
               "figures are in the card's `model-index` metadata.\n"
               f"{EVAL_SECTION_END}")
    card.text = _replace_section(card.text, EVAL_SECTION_START, EVAL_SECTION_END, section)
    atomic_write(path, str(card))
    return path

def _replace_section(text: str, start: str, end: str, section: str) -> str:
    """`text` with the part between the markers replaced by `section` (appended when absent)."""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + section + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + section + "\n"

def push_to_hub(args, folder: Path):
    """Upload the saved model folder to --hub_model_id (huggingface_hub: create_repo, then upload_folder). Run by the
    main process after training has ended, with no barrier after it: an upload that outlasts NCCL's 10-minute
    timeout cannot stall the other processes."""
    from huggingface_hub import HfApi

    api = HfApi(token=args.hub_token)  # None: $HF_TOKEN, else the stored login
    repo = api.create_repo(args.hub_model_id, private=args.hub_private or None, exist_ok=True)
    commit = api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder),
                               commit_message=f"xprt: upload {folder.name}/")
    print(f"pushed {folder} to https://huggingface.co/{repo.repo_id}")
    return commit
