"""
The MTEB leaderboard: a model's identity (name and revision, as mteb files its results), its complete mteb ModelMeta
from what its folder and run records hold, and the folder a results PR needs (evaluate.py --submission). No paper
step owns this; evaluate.py calls it.
  1. identity: model_name_and_revision, the content hash of a model folder or a task folder (files_hash)
  2. the ModelMeta: mteb's registry entry for a registry model, else model_meta_of (each field, where its value came
     from, and what a submission still lacks)
  3. the submission folder: mteb's ResultCache layout, the ModelMeta PR's Python entry, a README of what is missing
It imports plumbing/common.py and plumbing/model_folder.py (the model card), and mteb.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Optional, Sequence

from plumbing.common import (META_DIR, MINILM_ALIASES, UserError, atomic_path, check_inputs_apart, check_writable,
                             output_files, output_key, read_json, resolve_model_path)

# Importing mteb creates ~/.cache/mteb unless MTEB_CACHE is set (docs/notes.md); keep it inside the repo.
os.environ.setdefault("MTEB_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "mteb"))
import mteb  # noqa: E402
from mteb.models.model_meta import ModelMeta, ScoringFunction  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# 1. A model's identity: mteb files its results under results/<name>/<revision>
# ---------------------------------------------------------------------------------------------------

def model_name_and_revision(name_or_path: str) -> tuple[str, str]:
    """mteb's ModelMeta identity of a model: ("org/name", revision); the results folder is results/<name>/<revision>.

    - the bundled MiniLM alias: its hub name and the revision mteb's registry gives it (the package ships those
      weights), so its results sit beside the public leaderboard's;
    - a hub id: the id, and the commit of the local hub snapshot when there is one;
    - a local folder: named after its run (docs/steps.md, Step 4): the `hub_model_id` its xprt_config.json records, else
      "local/<run>" for train.py's `<run>/model` folders, else "local/<folder name>"; the revision is a hash of the
      weights' and configs' *content* (not the card, which evaluate.py rewrites), so a retrained folder gets a new
      revision and a copied one keeps it.
    """
    path = resolve_model_path(name_or_path)
    if name_or_path in MINILM_ALIASES:
        name = "sentence-transformers/all-MiniLM-L6-v2"
        try:
            return name, mteb.get_model_meta(name).revision or content_revision(path)
        except Exception:  # noqa: BLE001 - a registry without it: fall back to the content
            return name, content_revision(path)
    if not os.path.isdir(path):
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(name_or_path, "config.json")
        rev = Path(hit).parent.name if isinstance(hit, str) else "no_revision_available"
        return (name_or_path if name_or_path.count("/") == 1 else "local/" + name_or_path.replace("/", "__")), rev
    folder = Path(path).resolve()
    hub_id = read_json(folder / "xprt_config.json").get("hub_model_id")
    if isinstance(hub_id, str) and hub_id.count("/") == 1:
        name = hub_id
    else:
        run = folder.parent.name if folder.name == "model" and folder.parent.name else folder.name
        name = "local/" + (run or "model")
    return name, content_revision(path)


def files_hash(root: Path, files) -> str:
    """12 hex digits of common.output_key over `files` (under `root`), named relative to it: the one hash of model
    folders (content_revision) and local task folders (data_fingerprint); at disk speed (about 1 s per 400 MB)."""
    return output_key({f.relative_to(root).as_posix(): f for f in files})[:12]


def content_revision(path: str) -> str:
    """A model folder's revision: 12 hex digits of common.output_key over every file that changes a token or a
    vector (common.output_files: the weights, every config, the tokenizer's whole saved state, the
    sentence-transformers modules; not the card, the decoder heads or the lineage)."""
    return output_key(output_files(path))[:12]


def scoring_function(similarity_fn_name) -> ScoringFunction:
    """mteb's name of a sentence-transformers similarity function (None: cosine, sentence-transformers' default)."""
    functions = {"cosine": ScoringFunction.COSINE, "dot": ScoringFunction.DOT_PRODUCT,
                 "euclidean": ScoringFunction.EUCLIDEAN, "manhattan": ScoringFunction.MANHATTAN}
    return functions[str(similarity_fn_name or "cosine")]


# ---------------------------------------------------------------------------------------------------
# 2. The ModelMeta: the registry's own entry, else every field from what the model records
# ---------------------------------------------------------------------------------------------------


# train.py's and finetune.py's flags whose values are a model's training data (their run.json "inputs"; --train_data
# also as a Hub id in its "flags")
DATA_FLAGS = ("--groups_dir", "--beir_dir", "--train_data")


def registry_entry(name: str, revision: Optional[str]):
    """mteb's own ModelMeta of `name` when its registry holds the model at this revision (or names no revision), else
    None. It is used as it is: never rebuilt, never overwritten by what this repository would say."""
    from mteb.models.model_implementations import MODEL_REGISTRY

    entry = MODEL_REGISTRY.get(name)
    return entry if entry is not None and (not entry.revision or entry.revision == revision) else None


def data_origins(flag: str, path: str) -> list:
    """Where one training input's data came from: a groups folder's own sources (select_groups.py's stats.json
    "dataset", a Hub id, and its .xprt/run_config.json "input" files), else the input itself."""
    if flag == "--groups_dir":
        recorded = read_json(Path(path) / "stats.json").get("dataset")
        files = read_json(Path(path) / META_DIR / "run_config.json").get("input") or []
        if recorded or files:
            return [recorded] * bool(recorded) + list(files)
    return [path]


def training_sources(path: str) -> tuple[list, list, Optional[str]]:
    """What trained a model folder, stage by stage, from the records train.py and finetune.py leave beside the folders
    they write (<run>/run.json beside <run>/model: the inputs, with their paths, and the flags), following each run's
    --model_name_or_path back through the lineage xprt_config.json records -> (sources: [{"stage", "flag",
    "source"}], gaps: the stages whose data no record names, in words, the first stage's local start folder or
    None). Trusted: that run.json is the run that wrote the folder beside it (a folder copied without it is a gap)."""
    folder = Path(resolve_model_path(path))
    lineage = read_json(folder / "xprt_config.json").get("lineage") or []
    sources, gaps, first = [], [], None
    for stage in [s["stage"] for s in lineage[1:]][::-1]:  # the trained stages, the last first
        record = read_json(folder.parent / "run.json") if folder.name in ("model", "best_model") else {}
        if not record.get("inputs"):
            gaps.append(f"{stage}: no run.json beside {folder}")
            break
        inputs, flags = record["inputs"], record.get("flags") or {}
        for flag in DATA_FLAGS:
            found = [s for p in (inputs.get(flag) or {}).get("paths", []) for s in data_origins(flag, p)]
            if not found and isinstance(flags.get(flag[2:]), str):  # a Hub dataset, no path
                found = [flags[flag[2:]]]
            sources += [{"stage": stage, "flag": flag, "source": s} for s in found]
        start = (inputs.get("--model_name_or_path") or {}).get("paths") or []
        if not start:
            break
        folder = Path(start[0])
        first = str(folder) if stage == lineage[1]["stage"] else None
    return sources, gaps, first


def _task_key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


_TASK_KEYS: dict = {}


def mteb_tasks_of(source: str) -> list:
    """The mteb tasks a training source is *named* like: a Hub dataset id equal to a task's dataset id or to its last
    part (mteb/scifact, BeIR/scifact -> SciFact), a local folder or file named as a task or as the last part of its
    dataset id (a folder scifact/ -> SciFact; msmarco.jsonl -> MSMARCO); web text (HuggingFaceFW/fineweb, docs.jsonl)
    names none. Case and punctuation are ignored; every id mteb has (superseded ones too) counts. A name is a guess:
    tasks_of says which tasks a record or the data itself shows."""
    if not _TASK_KEYS:
        for t in mteb.get_tasks(exclude_superseded=False):
            path = t.metadata.dataset.get("path") or ""
            for key in {t.metadata.name, path, path.rsplit("/", 1)[-1]} - {""}:
                _TASK_KEYS.setdefault(_task_key(key), set()).add(t.metadata.name)
    name = Path(source).name.split(".")[0] if os.path.exists(source) else source
    for key in dict.fromkeys([name, name.rsplit("/", 1)[-1]]):
        if _task_key(key) in _TASK_KEYS:
            return sorted(_TASK_KEYS[_task_key(key)])
    return []


def tasks_of(source: str) -> tuple[list, str]:
    """The mteb tasks whose data a training source is, from evidence -> (tasks, how it is known): a Hub dataset id
    that is a task's own dataset id (mteb/scifact -> SciFact: the id the reader recorded), or a local BEIR corpus
    whose statistics are a task's (corpus_tasks: a folder holding corpus.jsonl, or the file itself, as groups
    selected from it record). A name alone (a folder news/ or msmarco/, BeIR/scifact) is no evidence: ([], "")."""
    if not os.path.exists(source):
        tasks = sorted({t.metadata.name for t in mteb.get_tasks(exclude_superseded=False)
                        if _task_key(t.metadata.dataset.get("path") or "-") == _task_key(source)})
        return tasks, "its Hub dataset id" if tasks else ""
    corpus = Path(source) / "corpus.jsonl" if os.path.isdir(source) else Path(source)
    tasks = corpus_tasks(corpus) if corpus.name.startswith("corpus.jsonl") and corpus.is_file() else []
    return tasks, f"its corpus's statistics are {', '.join(tasks)}'s" if tasks else ""


def corpus_tasks(corpus: Path) -> list:
    """The mteb retrieval tasks whose documents a BEIR corpus.jsonl is, by mteb's own descriptive statistics of
    them: the same number of documents, the same shortest and longest (title and text, as mteb joins them) and a
    total length within 1% (SciFact's 5,183 documents here total 7,785,930 characters, mteb's 7,771,451)."""
    from plumbing.common import iter_jsonl

    if not _CORPUS_STATS:  # (documents, shortest, longest, total) of every retrieval task's splits, read once
        for t in mteb.get_tasks(task_types=["Retrieval"], exclude_superseded=False):
            try:
                stats = t.metadata.descriptive_stats or {}
            except Exception:  # noqa: BLE001 - a task without its statistics file: nothing to compare
                continue
            for split in stats.values():
                docs = (split or {}).get("documents_text_statistics") or {}
                _CORPUS_STATS.append((t.metadata.name, split.get("num_documents"), docs.get("min_text_length"),
                                      docs.get("max_text_length"), docs.get("total_text_length") or 0))
    lengths = [len(f"{d.get('title') or ''} {d.get('text') or ''}".strip()) for _, d, _ in iter_jsonl(corpus)
               if isinstance(d, dict)]
    return sorted({name for name, n, low, high, total in _CORPUS_STATS if lengths and n == len(lengths)
                   and (low, high) == (min(lengths), max(lengths)) and abs(sum(lengths) - total) <= 0.01 * total})


_CORPUS_STATS: list = []


# bytes per element of each safetensors dtype (the table mteb reads a Hub repository's weights by, completed)
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def weights_megabytes(folder: Path) -> Optional[int]:
    """The memory the weights take as saved (every *.safetensors of the folder but the decoder heads, each tensor's
    element count x its dtype's size, read from the files' headers), as mteb reckons it from a Hub repository's
    safetensors metadata; None without safetensors files."""
    from safetensors import safe_open

    total, files = 0, [f for f in folder.rglob("*.safetensors") if f.name != "xprt_heads.safetensors"]
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                t = fh.get_slice(k)
                total += math.prod(t.get_shape()) * DTYPE_BYTES.get(t.get_dtype(), 4)
    return round(total / 2**20) if files else None


def model_meta_of(name_or_path: str, path: str, st_model, prompts: dict, max_length: int,
                  given: Optional[dict] = None) -> tuple:
    """A model's complete mteb ModelMeta -> (meta, {field: where its value came from}, [what is still missing for a
    leaderboard submission, in words]).

    A model mteb's registry holds at this revision, unmodified (all-MiniLM-L6-v2, a Hub id), gets the registry's own
    entry as it is. Any other is described from what it records: its folder (the weights, modules.json, the card's
    licence and languages, xprt_config.json's lineage, whose first stage names the start: adapted_from), the run
    records beside it (training_sources, mapped to mteb task names by mteb_tasks_of: training_datasets) and the
    loaded model (parameters, dimension, similarity, length); `given` adds what no record holds:
    public_training_code, public_training_data, training_datasets, adapted_from (evaluate.py's flags of those
    names)."""
    from mteb.languages.iso_mappings import _hf_langs_to_iso_lang_scripts  # mteb's own reading of a card's languages
    from pydantic import ValidationError

    from plumbing.model_folder import card_language, card_license

    given = given or {}
    name, revision = model_name_and_revision(name_or_path)
    folder = Path(path) if os.path.isdir(path) else None
    cfg = read_json(folder / "xprt_config.json") if folder else {}
    entry = None if cfg else registry_entry(name, revision)
    if entry is not None:
        return entry, {"(every field)": f"mteb's registry entry of {name} at revision {entry.revision}, as it is"}, []
    own = os.path.isdir(name_or_path)  # a folder given by its path (else a Hub id, whose snapshot may be here)
    said, missing = identity_said(name, revision, bool(cfg.get("hub_model_id")), own)
    weights = next((f for f in sorted(folder.rglob("*.safetensors")) if f.name != "xprt_heads.safetensors"),
                   None) if folder else None
    release_date = release_date_of(folder, weights, own, said, missing)
    languages = _hf_langs_to_iso_lang_scripts(card_language(name_or_path))
    said["languages"] = "the model card's language, as mteb converts a card's"
    if not languages:
        missing.append("no language: the model card names none")
    n_parameters = sum(p.numel() for p in st_model.parameters())
    said["n_parameters"] = "the loaded sentence-transformers model's parameters"
    memory = weights_megabytes(folder) if folder else None
    said["memory_usage_mb"] = ("the weights as saved (safetensors headers: elements x dtype size)" if memory else
                               "mteb's estimate: n_parameters x 4 bytes")
    if memory is None:
        memory = ModelMeta._calculate_memory_usage_mb(name, n_parameters)
    said["n_embedding_parameters"] = "mteb's reckoning: the tokenizer's vocabulary x the embedding dimension"
    said.update(max_tokens="the length limit the model states (sentence_bert_config.json), at most its positions",
                embed_dim="the loaded model's sentence-embedding dimension",
                similarity_fn_name="config_sentence_transformers.json's similarity_fn_name (cosine when none)",
                use_instructions="whether the model's own prompts (config_sentence_transformers.json) are non-empty",
                framework="the folder's files: sentence-transformers modules, PyTorch, safetensors, transformers' "
                          "config.json", open_weights="the weights are in the folder")
    license_ = card_license(name_or_path)
    said["license"] = "the model card's licence (train.py / finetune.py carry the start's on)"
    start = adapted_from(name_or_path, folder, cfg, said, missing, given)
    training_datasets = training_datasets_of(path, cfg, given, said, missing)
    for field, flag in (("public_training_code", "--public_training_code"),
                        ("public_training_data", "--public_training_data")):
        said[field] = f"{flag}" if given.get(field) else "not given"
        if not given.get(field):
            missing.append(f"no {field.replace('_', ' ')} given: pass {flag} URL")
    with warnings.catch_warnings():  # mteb's helper calls sentence-transformers' renamed dimension method
        warnings.simplefilter("ignore", FutureWarning)
        n_embedding = ModelMeta._get_n_embedding_parameters_from_sentence_transformers(st_model)
    files = {f.name for f in folder.iterdir()} if folder else set()
    framework = ["Sentence Transformers", "PyTorch"] + ["safetensors"] * bool(weights) + [
        "Transformers"] * ("config.json" in files)
    fields = dict(
        loader=None, name=name, revision=revision, release_date=release_date and release_date.isoformat(),
        languages=languages, n_parameters=n_parameters,
        n_embedding_parameters=n_embedding,
        memory_usage_mb=memory, max_tokens=max_length, embed_dim=st_model.get_embedding_dimension(), license=license_,
        open_weights=True, public_training_code=given.get("public_training_code"),
        public_training_data=given.get("public_training_data"), framework=framework,
        reference=None if name.startswith("local/") else f"https://huggingface.co/{name}",
        similarity_fn_name=scoring_function(st_model.similarity_fn_name), use_instructions=any(prompts.values()),
        training_datasets=training_datasets, adapted_from=start, modalities=["text"], model_type=["dense"])
    said["reference"] = "the Hub page of its name" if fields["reference"] else "none (no Hub id)"
    try:
        meta = ModelMeta(**fields)
    except ValidationError:  # a licence mteb's list does not hold: left out, and said
        meta = ModelMeta(**{**fields, "license": None})
        license_ = None
    if license_ is None:
        missing.append(f"no licence mteb accepts (the card says {card_license(name_or_path)!r}): set the card's "
                       "licence (train.py / finetune.py --license) to one of mteb.types.Licenses or a URL")
    return meta, said, missing


def identity_said(name: str, revision: str, hub_id_recorded: bool, own: bool) -> tuple[dict, list]:
    """Where a described model's name and revision came from, and what of them a submission still lacks (a local
    name, a content hash where the leaderboard wants a Hub commit) -> (said, missing)."""
    said = {"name": ("xprt_config.json's hub_model_id" if hub_id_recorded else
                     "local/ + the run's (or the folder's) name, no Hub id recorded" if own else "the Hub id"),
            "revision": ("12 hex digits of a hash of the weights' and configs' content (content_revision)" if own
                         else "the local Hub snapshot's commit")}
    missing = []
    if name.startswith("local/"):
        missing.append("no Hub id: the leaderboard names a model by its Hub repository. Push it (train.py / "
                       "finetune.py --push_to_hub --hub_model_id ORG/NAME) and evaluate the Hub id, whose revision is "
                       "then the Hub commit")
    elif own:
        missing.append(f"revision {revision} is this folder's content hash, not a Hub commit of {name}: evaluate the "
                       "pushed model by its Hub id")
    return said, missing


def release_date_of(folder: Optional[Path], weights: Optional[Path], own: bool, said: dict, missing: list):
    """A folder's release date: the UTC day its weights were written (a Hub model's is its first commit's, which
    needs the Hub: left missing) -> a date or None; where it came from goes into `said`, a gap into `missing`."""
    import datetime

    if own and weights is not None:
        said["release_date"] = f"the day {weights.relative_to(folder)} was written (UTC)"
        return datetime.datetime.fromtimestamp(weights.stat().st_mtime, datetime.timezone.utc).date()
    missing.append("no release date: a Hub model's is its first commit's (ModelMeta.fetch_release_date needs the "
                   "Hub)" if not own else "no release date: the folder holds no safetensors weights to date")
    return None


def adapted_from(name_or_path: str, folder: Optional[Path], cfg: dict, said: dict, missing: list,
                 given: Optional[dict] = None) -> Optional[str]:
    """The model a described model was trained from: --adapted_from when given, else the first stage of
    xprt_config.json's lineage, and for a start given as a local folder what that folder says it is (start_named);
    with no lineage, the model card's base_model. A start mteb cannot follow (unnamed, or not in its registry) goes
    into `missing`, since mteb counts the start's own training data in the zero-shot figure only through its
    registry entry."""
    from plumbing.model_folder import card_data

    lineage = cfg.get("lineage") or []
    start = (lineage[0].get("model") if lineage else None) or cfg.get("base_model")
    said["adapted_from"] = "xprt_config.json's lineage: its first stage, the start model"
    if not folder or not cfg:  # no lineage of ours: what the card says it derives from
        card = card_data(name_or_path)
        start = getattr(card, "base_model", None) if card is not None else None
        start = start[0] if isinstance(start, list) and start else start
        said["adapted_from"] = "the model card's base_model"
    elif start is None and lineage:  # a local start folder: what its own files say it is
        start, said["adapted_from"] = start_named(training_sources(name_or_path)[2])
    if (given or {}).get("adapted_from"):
        start, said["adapted_from"] = given["adapted_from"], "--adapted_from"
    if start is None and (lineage or folder):
        missing.append("no adapted_from: the start model was a local folder whose files name no Hub model (its "
                       "xprt_config.json hub_model_id, config.json _name_or_path, card base_model): pass "
                       "--adapted_from ORG/NAME, or none if it was trained from scratch")
    elif start is not None and start not in mteb_registry_names():
        missing.append(f"adapted_from {start} is not in mteb's registry: its own training data counts in the "
                       "zero-shot figure only once its ModelMeta is added")
    return start


def start_named(start: Optional[str]) -> tuple:
    """What a local start folder says it is -> (a Hub id or None, where that came from): the Hub id its xprt records
    name (model_folder.hub_base_model), config.json's _name_or_path when it is a Hub id that is no local path (what
    transformers loaded it as), else its card's base_model (what it derives from)."""
    from plumbing.model_folder import _HUB_ID, card_data, hub_base_model

    if start is None or not os.path.isdir(start):
        return None, "no local start folder recorded (run.json's --model_name_or_path)"
    if hub_base_model(start):
        return hub_base_model(start), f"the start folder {Path(start).name}'s xprt_config.json"
    loaded = read_json(Path(start) / "config.json").get("_name_or_path")
    if isinstance(loaded, str) and _HUB_ID.fullmatch(loaded) and not os.path.exists(loaded):
        return loaded, f"the start folder {Path(start).name}'s config.json _name_or_path"
    card = card_data(start)
    base = getattr(card, "base_model", None) if card is not None else None
    base = base[0] if isinstance(base, list) and base else base
    return base, f"the start folder {Path(start).name}'s card base_model"


def training_datasets_of(path: str, cfg: dict, given: dict, said: dict, missing: list) -> Optional[set]:
    """The mteb tasks whose data trained a model: every stage's recorded data (training_sources) that a record or the
    data itself shows to be a task's (tasks_of), with --training_datasets added -> the set, or None (unknown) while a
    stage's data is unknown and --training_datasets is not given. A local source nothing tells (a name alone is at
    most a guess, said as one) is listed for the user to name with --training_datasets."""
    lineage = cfg.get("lineage") or []
    sources, gaps = training_sources(path)[:2] if cfg else ([], [] if lineage else ["the model's training"])
    told = [(s, *tasks_of(s["source"])) for s in sources]
    tasks = sorted({t for _, found, _ in told for t in found} | set(given.get("training_datasets") or []))
    known = not gaps or given.get("training_datasets") is not None
    if not known:
        missing.append(f"training data unknown ({'; '.join(gaps)}): pass --training_datasets TASK ... (the mteb "
                       "tasks whose data trained it; none when none did)")

    def named(s):
        return Path(s["source"]).name if os.path.exists(s["source"]) else s["source"]

    if given.get("training_datasets") is None:
        for s, found, _ in told:
            guess = mteb_tasks_of(s["source"])
            if found or not os.path.exists(s["source"]) and not guess:
                continue
            what = (f"is named like {', '.join(guess)}, and a name is no evidence of its data" if guess else
                    "names no mteb task")
            missing.append(f"{s['flag']} {named(s)} ({stage_script(s['stage'])}) {what}: if it holds an mteb task's "
                           "data (a train split counts), add the task with --training_datasets")
    said["training_datasets"] = "; ".join(
        [f"{s['flag']} {named(s)} ({stage_script(s['stage'])}) -> "
         + (f"{', '.join(found)} ({how})" if found else "no mteb task") for s, found, how in told]
        + ([f"--training_datasets {' '.join(given['training_datasets']) or '(none)'}"]
           if given.get("training_datasets") is not None else [])) or "no record"
    return set(tasks) if known else None


def stage_script(stage: str) -> str:
    """The script of a lineage stage ("xprt pretrain (xprt), 2 steps (train.py)" -> "train.py")."""
    found = re.search(r"\((\w+\.py)\)$", stage)
    return found.group(1) if found else stage


def mteb_registry_names() -> set:
    from mteb.models.model_implementations import MODEL_REGISTRY

    return set(MODEL_REGISTRY)


# ---------------------------------------------------------------------------------------------------
# 3. The submission folder (--submission): what a results PR and a ModelMeta PR need
# ---------------------------------------------------------------------------------------------------

def leaderboard_exclusion(t: dict, r: dict) -> Optional[str]:
    """Why a result does not go into a results PR (None: it goes): the leaderboard holds mteb tasks scored on mteb's own
    data, whole, with the model's own settings, so a user's own task, a local copy, a --limit sample and a run with
    forced settings are left out, each with the way to a result that goes."""
    s = r.get("settings") or {}
    if t.get("scored_by") == "own":
        return "the user's own task, not an mteb task"
    if "data" in s:
        return (f"scored on a local copy (data_{s['data']}), which mteb cannot tell is its data: rerun it as "
                f"--tasks {t['name']} (needs the Hub)")
    if "limit" in s:
        return f"a --limit {s['limit']} sample, not the whole task"
    if s:
        return f"scored with settings that are not the model's own ({', '.join(sorted(s))})"
    if not r.get("result_file"):
        return "not written to an mteb results folder"
    return None


def check_submission_folder(folder: Path, overwrite: bool, inputs: dict):
    """--submission DIR, checked before any scoring. It is written whole, in one rename (atomic_path), so it may be
    absent, or hold an earlier --submission (its submission.json says so), replaced with --overwrite; anything else,
    a folder inside an input or holding one, and a place that cannot be written are refused in one line."""
    check_inputs_apart(folder, inputs, "--submission")
    if folder.exists():
        if read_json(folder / "submission.json").get("written_by") != SUBMISSION_MARK:
            raise UserError(f"--submission {folder} exists and is no folder evaluate.py --submission wrote: it is "
                            "never replaced; choose another")
        if not overwrite:
            raise UserError(f"--submission {folder} holds an earlier submission: pass --overwrite to replace it")
    check_writable(folder.parent, "--submission")


SUBMISSION_MARK = "evaluate.py --submission"


def pr_meta(meta, registry: bool, prompts: dict):
    """The ModelMeta a ModelMeta PR adds: the model's own, loaded by mteb's sentence-transformers wrapper with its
    prompts (as mteb's E5 entries give theirs); a registry entry as it is."""
    from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper

    if registry:
        return meta
    own = {k: v for k, v in (prompts or {}).items() if v}
    return meta.model_copy(update={"loader": SentenceTransformerEncoderWrapper, "experiment_kwargs": None,
                                   "loader_kwargs": {"model_prompts": own} if own else {}})


def python_entry(meta, missing: Sequence[str]) -> str:
    """The ModelMeta as the Python source a ModelMeta PR adds to mteb/models/model_implementations/ (ModelMeta's own
    to_python), with its imports and, on top, what is still missing."""
    import textwrap

    var = re.sub(r"\W+", "_", meta.name.rsplit("/", 1)[-1]).strip("_").lower() or "model"
    todo = "".join("\n".join(textwrap.wrap(m, 116, initial_indent="#   - ", subsequent_indent="#     ")) + "\n"
                   for m in missing) or "#   nothing\n"
    return (f"# The ModelMeta of {meta.name} at revision {meta.revision}, as a ModelMeta PR adds it to mteb\n"
            f"# (mteb/models/model_implementations/), written by xprt's {SUBMISSION_MARK}. Still missing:\n{todo}"
            "from mteb.models.model_meta import ModelMeta, ScoringFunction\n"
            "from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper\n\n"
            f"{var} = {meta.to_python()}\n")


def write_submission(out: dict, folder: Path, run: dict) -> dict:
    """The folder a results PR needs (--submission), written whole in one rename -> its record (submission.json).

    For each model: results/<org__name>/<revision>/ in mteb's ResultCache layout, so that `mteb.ResultCache(folder)`
    reads it and its submit_results copies it into the results repository: the task JSONs mteb wrote (only those the
    leaderboard takes: leaderboard_exclusion), model_meta.json (ModelMeta.to_dict, as mteb's own save_to_cache
    writes it, the loader by name) and run_settings.jsonl (mteb's own lines for the task, merged by mteb's own
    writer, with "xprt": the code, the command and flags, the prompts, dtype, device, batch size, length limit, and
    the task's dataset revision, mteb id and the mteb version its result names); model_meta/<org__name>.py, the
    ModelMeta PR's entry (none for a model mteb's registry holds); mock_run/<org__name>.md, mteb.mock_run's report
    (out["mock_runs"], the output the model PR asks for); README.md, what it holds and what is still
    missing. The PRs themselves are not made (they need the network and a GitHub token): README.md says how."""
    from mteb.results.task_result import _read_run_settings_from_file, _write_and_merge_keyed_json

    record = {"written_by": SUBMISSION_MARK, "mteb_version": mteb.__version__, "code": run["code"],
              "command": run["command"], "models": {}}
    with atomic_path(folder) as tmp:
        for m in out["models"]:
            info = out["model_meta"][m]
            meta = pr_meta(out["metas"][m], info["registry"], out["runtime"][m].get("prompts"))
            dest = tmp / "results" / meta.model_name_as_path() / str(meta.revision)
            dest.mkdir(parents=True)
            submitted, left_out, settings = [], {}, []
            for t in out["tasks"]:
                r = out["results"][m][t["name"]]
                why = leaderboard_exclusion(t, r)
                if why:
                    left_out[t["name"]] = why
                    continue
                source = Path(r["result_file"])
                (dest / source.name).write_bytes(source.read_bytes())
                submitted.append(t["name"])
                xprt = {"code": run["code"], "command": run["command"], **run["settings"], **out["runtime"][m],
                        "task": {"dataset": t.get("dataset"), "mteb_ids": t.get("variant"),
                                 "result_mteb_version": r.get("mteb_version"), "result_date": r.get("date")}}
                theirs = [e for e in _read_run_settings_from_file(source.parent / "run_settings.jsonl")
                          if e.get("task") == t["name"]] or [{"task": t["name"], "splits": [t["split"]],
                                                              "subsets": ["default"]}]
                settings += [{**e, "xprt": xprt} for e in theirs]
            (dest / "model_meta.json").write_text(json.dumps(meta.to_dict(), default=str, indent=4))
            if settings:
                _write_and_merge_keyed_json(dest / "run_settings.jsonl", settings)
            missing = list(info["missing"]) + ([] if submitted else [
                "no result the leaderboard takes: " + ("; ".join(f"{k}: {v}" for k, v in left_out.items())
                                                       or "no task was scored")])
            checked = out.get("mock_runs", {}).get(m)
            mock = tmp / "mock_run" / f"{meta.model_name_as_path()}.md" if checked else None
            if checked:  # mteb's own report (MockRunResults.to_markdown), as its `mteb mock-run` writes it
                mock.parent.mkdir(exist_ok=True)
                mock.write_text(checked["markdown"] + "\n", encoding="utf-8")
                missing += [] if checked["all_passed"] else [f"mteb's mock run failed tasks: {mock.name}"]
            entry = None
            if not info["registry"]:
                entry = tmp / "model_meta" / f"{meta.model_name_as_path()}.py"
                entry.parent.mkdir(exist_ok=True)
                entry.write_text(python_entry(meta, missing))
            record["models"][m] = {
                "name": meta.name, "revision": meta.revision, "registry": info["registry"],
                "results": str(dest.relative_to(tmp)), "tasks": submitted, "left_out": left_out,
                "python_entry": str(entry.relative_to(tmp)) if entry else None, "missing": missing,
                "mock_run": {"report": str(mock.relative_to(tmp)), "all_passed": checked["all_passed"]}
                if checked else None,
                "said": info["said"], "model_meta": json.loads(json.dumps(meta.to_dict(), default=str))}
        (tmp / "submission.json").write_text(json.dumps(record, indent=1))
        (tmp / "README.md").write_text(submission_readme(record, folder))
    return record


def submission_readme(record: dict, folder: Path) -> str:
    """The submission folder's README.md: per model what it holds, its ModelMeta field by field with where each value
    came from, what was left out and what is still missing; then the steps that need the network."""
    lines = [f"# An mteb leaderboard submission, written by xprt's {SUBMISSION_MARK}", "",
             f"mteb {record['mteb_version']}; xprt code {record['code'].get('git') or 'no git commit'} (scripts' "
             f"sha256 {record['code']['sha256'][:12]}). Command: `{record['command']}`", ""]
    for m in record["models"].values():
        lines += [f"## {m['name']} at revision {m['revision']}", "",
                  f"- `{m['results']}/`: {len(m['tasks'])} task result(s) ({', '.join(m['tasks']) or 'none'}), "
                  "`model_meta.json`" + (", `run_settings.jsonl`" if m["tasks"] else "")
                  + ", in mteb's ResultCache layout",
                  f"- `{m['python_entry']}`: the ModelMeta PR's entry" if m["python_entry"] else
                  f"- its ModelMeta is mteb's registry entry (`mteb.get_model_meta({m['name']!r})`), used as it is: "
                  "no ModelMeta PR"]
        if m.get("mock_run"):
            lines.append(f"- `{m['mock_run']['report']}`: mteb.mock_run's report (all passed: "
                         f"{m['mock_run']['all_passed']}), the mock-run output the model PR asks for")
        lines += [f"- left out: {task}: {why}" for task, why in m["left_out"].items()]
        if not m["registry"]:
            lines += ["", "| field | value | from |", "|---|---|---|"]
            lines += [f"| {k} | `{json.dumps(v)}` | {m['said'][k]} |" for k, v in m["model_meta"].items()
                      if k in m["said"]]
        lines += ["", "Still missing for a valid submission:", ""]
        lines += [f"- {x}" for x in m["missing"]] or ["- nothing"]
        lines.append("")
    lines += ["## The steps that need the network (not taken here)", "",
              "1. The ModelMeta PR: add each `model_meta/*.py` entry to mteb's `mteb/models/model_implementations/`, "
              "with its `mock_run/*.md` report as the PR asks.",
              "2. The results PR, by mteb's own code (it clones embeddings-benchmark/results and commits on a branch):",
              "", "```bash", *([f"python -c \"import mteb; mteb.ResultCache('{folder}').submit_results('{m['name']}', "
                                 "create_pr=True)\"" for m in record["models"].values() if m["tasks"]]
                               or ["# no model has a result the leaderboard takes yet"]), "```", ""]
    return "\n".join(lines)
