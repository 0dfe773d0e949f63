"""
Evaluate sentence encoders the way the xPRT paper reports them: MTEB(eng, v2), per category, averaged.

Read it beside the xPRT paper ("Experiments: what the results show"). The paper reports the
41-task MTEB average (`MTEB(eng, v2)`), category averages (retrieval nDCG@10, STS Spearman, ...) and one
analysis of its own: ArguAna queries split into thirds by word overlap with their relevant document,
nDCG@10 per third ("xPRT beats E5 in every third by 3.7 to 8.8 points").

Three ways to pick tasks, one scoring path (mteb's own evaluators, so the numbers are mteb's, not ours):

    python evaluate.py --models intfloat/e5-base-unsupervised runs/xprt/model    # MTEB(eng, v2), online
    python evaluate.py --models minilm --tasks SciFact STSBenchmark              # named mteb tasks, online
    python evaluate.py --models minilm --local_tasks ../shared/data/scifact SICK-R=../shared/data/sick
                                                                                 # local folders, offline

(train.py and finetune.py save the model to `<run>/model`; the run folder beside it holds logs and checkpoints.)

A local folder under an mteb task's name (given as NAME=DIR, or said by its files or its folder's name: scifact/,
sts-test.csv) is loaded into that *stock* mteb task (its class, metadata and metric), only `load_data` is replaced
(docs/notes.md: "mteb 2.26 offline"). Under any other name (given, or the folder's own) it is the user's own task:
mteb's retrieval, STS or classification class with the folder's metadata, scored by mteb's evaluator of that type.
results.md says which of the two scored each task, and each task's data revision, mteb id (an original, or its
cleaned revision: they do not compare) and mteb version. Formats are auto-detected: BEIR retrieval (corpus.jsonl,
queries.jsonl, qrels/test.tsv), the original STS-B / SICK / SemEval STS12-16 / BIOSSES files, and Banking77's
train/test csv.

mteb writes each task's result into its standard results folder (--results_dir, default mteb's own cache):
results/<model>/<revision>/<task>.json, where `mteb.load_results` and `mteb.ResultCache(...).load_results` read
it; a run that differs from the model's standard use (a local folder, --limit, forced prefixes or max length) is
filed as an mteb experiment under .../experiments/<settings>/. A rerun skips finished tasks. The tables are built
from what is read back from that folder: results.md, results.json and results.png in --output_dir. Models are
encoded by sentence-transformers with their own modules (pooling, normalisation, max length); a local xprt
folder gets the scores in its model card: full tasks' in its Evaluation section and model-index, a local copy's
or a --limit sample's in a section of their own, each row saying what was scored (never in model-index).

Prefixes: E5 models were trained with "query: " / "passage: " and lose a lot without them (docs/notes.md);
models trained without them (all-MiniLM-L6-v2) lose with them. `--prefixes auto` (default; the flag train.py and
finetune.py take) applies the repository's one rule (common.model_prompts): a model folder's own
sentence-transformers prompts (train.py and finetune.py write them), else E5's prefixes for an E5 model (by name, or
by the start model a folder records), else none. `--prefixes e5` / `none` force them; `--query_prefix` /
`--passage_prefix` set either string outright.

A comparison compares one thing: what besides the weights decides a model's scores (pooling, normalisation,
similarity function, prefixes, length limit: CONTRACT_KEYS) is printed for every model and tabled beside the scores,
and where the models differ in any of it the report says so above the table (a dot-product start against a
cosine-saved continuation compares two similarities, not two trainings). `--score_as MODEL` scores every model with
MODEL's settings, so that the differences are the weights' alone (filed as an mteb experiment, kept off the cards).

Every model gets a complete mteb ModelMeta from what its folder records, and `--submission DIR` writes the folder an
MTEB leaderboard PR needs, saying what is still missing (plumbing/leaderboard.py; docs/steps.md, Step 4):

    python evaluate.py --models me/xprt-minilm --tasks SciFact --submission runs/submission --public_training_code URL

Plumbing comes from common.py (names, prefixes, files, devices), model_folder.py (the model card) and leaderboard.py
(a model's name, revision, ModelMeta; the submission); modeling_xprt.py gives only the hand-written embedder of the
scores during training (section 4b).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from modeling_xprt import max_seq_length
from plumbing.common import (ArgumentParser, E5_PROMPTS, NO_PROMPTS, UserError, atomic_path, atomic_write,
                             check_model_name, check_writable, claim_output_folder, hub_cached, hub_offline,
                             local_inputs, model_prompts, on_stop, pick_device_and_dtype, positive_int,
                             record_outputs, resolve_model_path, run_script, task_spec)
from plumbing.embed import embed_texts
from plumbing.leaderboard import (check_submission_folder, files_hash, model_meta_of, registry_entry, scoring_function,
                                  write_submission)
from plumbing.model_folder import add_eval_results_to_card, attention_kwargs, check_tokenizer_fits, public_command
from plumbing.readers import load_beir
from plumbing.run_log import EVAL_PREFIX
from plumbing.training import code_revision, gathered_params

# mteb after plumbing.leaderboard, which keeps mteb's cache (MTEB_CACHE) inside the repo before mteb is first imported
import mteb  # noqa: E402
from mteb.models.abs_encoder import AbsEncoder, get_prompt  # noqa: E402
from mteb.models.model_meta import ModelMeta  # noqa: E402
from mteb.types import PromptType  # noqa: E402

logger = logging.getLogger("evaluate")
csv.field_size_limit(sys.maxsize)  # SemEval inputs have long lines; the default 128 KB limit is arbitrary

# Which score a category is summarised by (mteb's main_score for each task type); for the tables.
CATEGORY_METRIC = {
    "Retrieval": "nDCG@10", "STS": "Spearman", "Classification": "accuracy", "Clustering": "V-measure",
    "PairClassification": "max AP", "Reranking": "MAP", "Summarization": "Spearman",
}
DEFAULT_BENCHMARK = "MTEB(eng, v2)"
PER_QUERY_KEY = "xprt_per_query"  # our key in a retrieval result's scores: {query id: {"ndcg_at_10", "overlap"}}


# ---------------------------------------------------------------------------------------------------
# 1. The mteb model wrapper: sentence-transformers' encode with the model's own modules and prompts
# ---------------------------------------------------------------------------------------------------

def check_model_folder(name_or_path: str, flag: str = "--models", trust_remote_code: bool = False) -> str:
    """Resolve a model name and fail early, in words, on a folder that is not a model, a path that does not exist,
    a name the offline Hub cannot give, or custom code without --trust_remote_code (common.check_model_name)."""
    path = check_model_name(name_or_path, flag, trust_remote_code)
    if os.path.isdir(path) and not (Path(path) / "config.json").is_file():
        raise UserError(f"{flag} {name_or_path}: a folder but not a model (no config.json in {path}); pass a folder "
                        "saved by train.py (or save_pretrained), a hub id, or 'all-MiniLM-L6-v2'")
    return path


def describe_pooling(st_model) -> str:
    """The sentence-vector recipe a SentenceTransformer applies, for the log ("cls", "mean", "mean + normalize")."""
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    parts = []
    for module in st_model:
        if isinstance(module, Pooling):
            mode = module.pooling_mode
            parts.append(mode if isinstance(mode, str) else "+".join(map(str, mode)))
        elif isinstance(module, Normalize):
            parts.append("normalize")
    return " + ".join(parts) or "none"


# What besides the weights decides a model's scores: a change of any of them moves every score, so two models that
# differ in one are not compared on their training alone (contract_differences; --score_as).
CONTRACT_KEYS = ("pooling", "normalize", "similarity", "query_prefix", "passage_prefix", "max_length")


def st_scoring(st_model) -> tuple:
    """(pooling mode, normalize) of a SentenceTransformer: its Pooling module's mode ("mean", "cls", ...; "+"-joined
    when several) and whether a Normalize module follows."""
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    mode, normalize = "none", False
    for module in st_model:
        if isinstance(module, Pooling):
            m = module.pooling_mode
            mode = m if isinstance(m, str) else "+".join(map(str, m))
        elif isinstance(module, Normalize):
            normalize = True
    return mode, normalize


def prompt_for(prompts: dict, task_metadata, prompt_type: Optional[PromptType]) -> Optional[str]:
    """The prompt mteb's own sentence-transformers wrapper gives a text (mteb.models.abs_encoder.get_prompt, reused):
    the first of "<task name>-<side>", "<task name>", "<task type>-<side>", "<task type>", "<side>" that the model's
    prompts name, where the side is query or document as the task says; None when none does. A symmetric task (STS,
    classification, clustering: no side) thus gets a prompt only from a task-name or task-type key, never the query
    instruction of a bge-style model. Without task metadata (a direct call, not mteb's) only the side counts."""
    if task_metadata is None:
        return prompts.get(prompt_type.value) if prompt_type is not None else None
    return get_prompt(prompts, task_metadata, prompt_type)


def encode_function(model, prompt_type: Optional[PromptType]):
    """model.encode_query / encode_document for a query / document side, model.encode for none: as mteb's wrapper
    calls a SentenceTransformer (a Router module routes by it)."""
    return {PromptType.query: model.encode_query, PromptType.document: model.encode_document}.get(prompt_type,
                                                                                                   model.encode)


class XPRTEncoder(AbsEncoder):
    """mteb wrapper: `sentence_transformers.SentenceTransformer(folder).encode`, with the repository's prefixes.

    The model's own sentence-transformers config decides the vector: modules.json (pooling: CLS for a BGE-style
    model, mean for E5 / MiniLM / train.py folders; Normalize), the max length of sentence_bert_config.json and the
    similarity function of config_sentence_transformers.json. A plain transformers checkpoint without them gets
    sentence-transformers' default, mean pooling, and a printed note. On GPU the weights run in bf16 (fp16 on GPUs
    older than Ampere), on CPU in fp32 (common.pick_device_and_dtype). Why not embed.embed_texts, the
    hand-written embedder that scores during training: it is mean pooling only, and bench/bench_encode.py measured
    it at 1.04-1.07x (best of 5 interleaved repeats; its token-sorted batches save 8% of the padded tokens), under
    the 1.10x that would justify a second encoder (bench/README.md).

    Prompts (`prefixes`: auto, e5 or none, the rule common.model_prompts applies: in auto every prompt the model
    names; `query_prefix` / `passage_prefix` override the query / document one): picked as mteb picks them
    (prompt_for: task name, then task type, then the query / document side mteb says the text is on), so a symmetric
    task gets no query instruction unless the model names one for it. They go to encode as `prompt=`, so a Pooling
    module that excludes the prompt (include_prompt=False) still works. The attribute `prefixes` says which the rule
    gave: "e5", "none" or "model" (the folder's own prompts).

    The length limit (modeling_xprt.max_seq_length): `max_length` when given, else the one the model states, at most its
    position table.

    `contract` holds what besides the weights decides the scores (CONTRACT_KEYS); `score_as`, another model's
    contract, replaces this model's pooling, normalisation, similarity, prefixes and length limit by that model's
    (--score_as: the start scored as the trained model is, so that a difference between them is the training's).
    """

    def __init__(self, name_or_path: str, prefixes: str = "auto", batch_size: int = 64,
                 max_length: Optional[int] = None, device: Optional[str] = None, dtype: Optional[str] = None,
                 query_prefix: Optional[str] = None, passage_prefix: Optional[str] = None,
                 trust_remote_code: bool = False, show_progress: bool = False, score_as: Optional[dict] = None,
                 model_meta_given: Optional[dict] = None):
        from sentence_transformers import SentenceTransformer

        if prefixes not in ("auto", "e5", "none"):
            raise ValueError(f"prefixes must be auto, e5 or none, got {prefixes!r}")
        path = check_model_folder(name_or_path, trust_remote_code=trust_remote_code)
        self.name = name_or_path
        self.path = path
        self.device, self.dtype = pick_device_and_dtype(device, dtype)
        has_st_config = os.path.isdir(path) and (Path(path) / "modules.json").is_file()
        try:
            self.model = SentenceTransformer(path, device=str(self.device), trust_remote_code=trust_remote_code,
                                             model_kwargs={"dtype": self.dtype,
                                                           **attention_kwargs(path, None, trust_remote_code)[0]})
        except (OSError, ValueError) as err:
            raise UserError(f"could not load a model from {name_or_path!r} ({path}): {err}") from err
        self.model.eval()
        check_tokenizer_fits(self.model.tokenizer, self.model[0].auto_model.config, name_or_path)
        self.pooling = describe_pooling(self.model)
        if os.path.isdir(path) and not has_st_config:
            print(f"model {name_or_path}: no sentence-transformers modules.json: {self.pooling} pooling "
                  "(sentence-transformers' default) is assumed", flush=True)
        prompts = model_prompts(name_or_path, prefixes)
        e5 = prompts == E5_PROMPTS
        self.prefixes = "e5" if e5 else ("none" if prompts == NO_PROMPTS else "model")
        self.query_prefix = query_prefix if query_prefix is not None else prompts["query"]
        self.passage_prefix = passage_prefix if passage_prefix is not None else prompts["document"]
        self.prompts = {**prompts, "query": self.query_prefix, "document": self.passage_prefix}
        # A sentence-transformers model states the length it was trained and scored with (all-MiniLM-L6-v2: 256);
        # the MTEB leaderboard numbers use it, so we do too unless told. A plain checkpoint states none.
        stated = self.model.max_seq_length if has_st_config or not os.path.isdir(path) else None
        self.max_length = int(max_length) if max_length else max_seq_length(self.model[0].auto_model.config, stated,
                                                                                     self.model[0].auto_model)
        self.model.max_seq_length = self.max_length
        self.batch_size = batch_size
        self.show_progress = show_progress
        # what makes this run differ from the model's standard use: an mteb experiment (results/<name>/<revision>/
        # experiments/<settings>/), so such scores never sit where the model's standard ones do
        self.settings = {}
        if prefixes != "auto" or query_prefix is not None or passage_prefix is not None:
            self.settings.update(query_prefix=self.query_prefix, passage_prefix=self.passage_prefix)
        if max_length:
            self.settings["max_length"] = self.max_length
        # the model's own ModelMeta, before any --score_as changes how it is scored (plumbing/leaderboard.py)
        self.mteb_model_meta, self.meta_said, self.meta_missing = model_meta_of(
            name_or_path, path, self.model, self.prompts, self.max_length, model_meta_given)
        self.meta_registry = registry_entry(self.mteb_model_meta.name, self.mteb_model_meta.revision) is \
            self.mteb_model_meta
        if score_as:
            self.score_as(score_as)
        mode, normalize = st_scoring(self.model)
        self.contract = {"pooling": mode, "normalize": normalize,
                         "similarity": str(self.model.similarity_fn_name or "cosine"),
                         "query_prefix": self.query_prefix, "passage_prefix": self.passage_prefix,
                         "max_length": self.max_length, "prompts": self.prompts}

    def score_as(self, contract: dict):
        """Score with another model's contract (its CONTRACT_KEYS): the Pooling module rebuilt with its mode, a
        Normalize module added or removed, its similarity, prefixes and length limit. The run becomes an mteb
        experiment ("scored_as": that model), never filed as this model's standard scores."""
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

        modules = []
        for module in self.model:
            if isinstance(module, Pooling):
                cfg = module.get_config_dict()
                modes = contract["pooling"].split("+")
                modules.append(Pooling(cfg["embedding_dimension"], modes[0] if len(modes) == 1 else modes,
                                       include_prompt=cfg.get("include_prompt", True)))
            elif not isinstance(module, Normalize):
                modules.append(module)
        if contract["normalize"]:
            modules.append(Normalize())
        self.model = SentenceTransformer(modules=modules, device=str(self.device),
                                         similarity_fn_name=contract["similarity"]).eval()
        self.query_prefix, self.passage_prefix = contract["query_prefix"], contract["passage_prefix"]
        self.prompts = {**contract.get("prompts", {}), "query": self.query_prefix, "document": self.passage_prefix}
        self.max_length = self.model.max_seq_length = int(contract["max_length"])
        self.pooling = describe_pooling(self.model)
        prompts = json.dumps([contract["query_prefix"], contract["passage_prefix"]])
        self.settings = {"scored_as": {k: contract[k] for k in ("pooling", "normalize", "similarity", "max_length")},
                         "prompts": hashlib.sha256(prompts.encode()).hexdigest()[:8]}

    def prefix_for(self, task_metadata, prompt_type: Optional[PromptType]) -> str:
        """The prompt of a text of `task_metadata` on side `prompt_type`, "" when none (prompt_for)."""
        return prompt_for(self.prompts, task_metadata, prompt_type) or ""

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str,
               prompt_type: Optional[PromptType] = None, **kwargs: Any) -> np.ndarray:
        texts = [t for batch in inputs for t in batch["text"]]
        # per-batch progress: sentence-transformers' bar moves every batch while a large corpus encodes
        # prompt "" rather than None: sentence-transformers would fall back to its own prompts, mteb's pick stands
        return encode_function(self.model, prompt_type)(texts, prompt=self.prefix_for(task_metadata, prompt_type),
                                                        batch_size=self.batch_size,
                                                        show_progress_bar=self.show_progress, convert_to_numpy=True)


# ---------------------------------------------------------------------------------------------------
# 2. Local task folders -> the data layout of the stock mteb task
# ---------------------------------------------------------------------------------------------------


def _sts_rows_semeval(folder: Path) -> list[tuple[str, str, float]]:
    """SemEval STS12-16: STS.input.<set>.txt (s1 TAB s2) beside STS.gs.<set>.txt (gold or empty line).

    Unscored pairs (empty gold line, STS15/16) are skipped; a gold file without its input (STS13 SMT,
    withdrawn for licensing) is skipped too, as in MTEB. ALL files are concatenations, not sets.
    """
    rows = []
    for inp in sorted(folder.glob("*.input.*.txt")):
        gs = inp.with_name(inp.name.replace(".input.", ".gs."))
        if not gs.is_file() or ".ALL." in inp.name:
            continue
        with open(inp, encoding="utf-8") as fi, open(gs, encoding="utf-8") as fg:
            inputs, golds = fi.read().split("\n"), fg.read().split("\n")
        inputs = inputs[:-1] if inputs and inputs[-1] == "" else inputs
        golds = golds[:-1] if golds and golds[-1] == "" else golds
        if len(inputs) != len(golds):
            raise UserError(f"{inp}: {len(inputs)} pairs but {len(golds)} gold lines in {gs.name}")
        for line, gold in zip(inputs, golds):
            if gold.strip():
                s1, s2 = line.split("\t")[:2]
                rows.append((s1, s2, float(gold)))
    return rows


def load_sts_folder(folder: Path) -> tuple[str, list[tuple[str, str, float]]]:
    """Detects the STS format of `folder`, returns (default mteb task name, [(s1, s2, score)])."""
    if (folder / "sts-test.csv").is_file():  # STS Benchmark: genre file year id score s1 s2 [sources]
        with open(folder / "sts-test.csv", encoding="utf-8") as f:
            rows = [(r[5], r[6], float(r[4])) for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
        return "STSBenchmark", rows
    if (folder / "SICK.txt").is_file() or (folder / "SICK_test_annotated.txt").is_file():
        # MTEB SICK-R (mteb/sickr-sts) scores all 9,927 pairs of the full release, not the 4,927-pair
        # SemEval test file; use SICK.txt when present and say so when only the test split is there.
        fname = "SICK.txt" if (folder / "SICK.txt").is_file() else "SICK_test_annotated.txt"
        if fname != "SICK.txt":
            warnings.warn(f"{folder}: SICK.txt absent; using the SemEval test split, MTEB SICK-R uses all 9,927 pairs")
        with open(folder / fname, encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            rows = [(r["sentence_A"], r["sentence_B"], float(r["relatedness_score"])) for r in reader]
        return "SICK-R", rows
    if (folder / "biosses.tsv").is_file():
        with open(folder / "biosses.tsv", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            rows = [(r["sentence1"], r["sentence2"], float(r["score"])) for r in reader]
        return "BIOSSES", rows
    if list(folder.glob("*.input.*.txt")):
        m = re.search(r"sts(\d\d)", folder.name.lower())
        return (f"STS{m.group(1)}" if m else ""), _sts_rows_semeval(folder)
    raise UserError(f"{folder}: no known STS file")


def load_classification_folder(folder: Path) -> dict:
    """Banking77 layout: train.csv and test.csv with a header `text,<label>`; labels -> ints."""
    splits = {}
    for split in ("train", "test"):
        with open(folder / f"{split}.csv", encoding="utf-8", newline="") as f:
            reader = csv.reader(f)
            header = next(reader)
            splits[split] = [(r[0], r[1]) for r in reader if r]
        if header[0] != "text":
            raise UserError(f"{folder}/{split}.csv: expected a header 'text,<label>', got {header}")
    cats_file = folder / "categories.json"
    names = json.loads(cats_file.read_text()) if cats_file.is_file() else sorted({c for _, c in splits["train"]})
    label = {c: i for i, c in enumerate(names)}
    unknown = {c for s in splits.values() for _, c in s if c not in label}
    if unknown:
        raise UserError(f"{folder}: labels not in categories.json: {sorted(unknown)[:5]}")
    return {s: {"text": [t for t, _ in rows], "label": [label[c] for _, c in rows]} for s, rows in splits.items()}


def detect_local_format(folder: Path) -> tuple[str, str]:
    """(kind, the mteb task the folder's files or name say, "" when none) for a local folder; kind is retrieval, sts
    or classification."""
    if not folder.is_dir():
        raise UserError(f"local task folder not found: {folder}")
    if (folder / "corpus.jsonl").is_file() or (folder / "qrels").is_dir():
        name = {t.metadata.name.lower(): t.metadata.name for t in mteb.get_tasks(task_types=["Retrieval"])}.get(
            folder.name.lower(), "")
        return "retrieval", name
    if (folder / "train.csv").is_file() and (folder / "test.csv").is_file():
        return "classification", "Banking77Classification" if "banking77" in folder.name.lower() else ""
    try:
        name, _ = load_sts_folder(folder)
        return "sts", name
    except ValueError:
        raise UserError(f"{folder}: not a known task layout (BEIR corpus.jsonl/queries.jsonl/qrels, STS-B "
                        "sts-test.csv, SICK.txt, STS.input/STS.gs, biosses.tsv, or train.csv+test.csv)") from None


def mteb_task(name: str, flag: str = "--tasks"):
    """mteb.get_task(name), a name mteb does not know refused in one line (with mteb's closest name)."""
    try:
        return mteb.get_task(name)
    except KeyError as err:
        raise UserError(f"{flag} {name}: {str(err.args[0]).removeprefix('KeyError: ')}") from None


def check_task_data(task, flag: str = "--tasks"):
    """An mteb task by name reads its data from the Hub: while the Hub is offline (HF_HUB_OFFLINE), a task none of
    whose data is cached (the Hub's cache or datasets') is refused now, before any model loads, pointing to
    --local_tasks."""
    path = task.metadata.dataset.get("path", "")
    if not hub_offline() or not path or hub_cached(path, "dataset"):
        return
    import datasets

    if (Path(datasets.config.HF_DATASETS_CACHE) / path.replace("/", "___")).is_dir():
        return
    raise UserError(f"{flag} {task.metadata.name}: mteb reads its data from the Hub ({path}), which is offline "
                    f"(HF_HUB_OFFLINE) with no cached copy: give a local copy, --local_tasks {task.metadata.name}=DIR "
                    "(data/eval/README.md)")


def local_retrieval_split(folder: Path, wanted: str) -> str:
    """The qrels split a local BEIR folder is scored on: `wanted` (the mteb task's evaluation split) when the folder
    has it, else its one split other than train (a dev-only folder: qrels/dev.tsv)."""
    if not (folder / "qrels").is_dir():  # BEIR's corpus and queries without the judgements: nothing to score by
        raise UserError(f"{folder}: corpus.jsonl and queries.jsonl but no qrels/ folder: a BEIR folder's relevance "
                        f"judgements are qrels/{wanted}.tsv (BEIR's tab-separated query-id, corpus-id, score)")
    splits = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
    if wanted in splits:
        return wanted
    scored = [s for s in splits if s != "train"]
    if len(scored) != 1:
        raise UserError(f"{folder}: no qrels/{wanted}.tsv to score, and qrels/ holds {splits or 'no .tsv'}: name the "
                        "split to score qrels/test.tsv")
    return scored[0]


# A local folder's kind -> the mteb class, task type and main score of a task of the user's own (own_task): the
# evaluator and metrics every mteb task of that type uses.
OWN_TASK_KINDS = {
    "retrieval": ("mteb.abstasks.retrieval", "AbsTaskRetrieval", "Retrieval", "ndcg_at_10"),
    "sts": ("mteb.abstasks.sts", "AbsTaskSTS", "STS", "cosine_spearman"),
    "classification": ("mteb.abstasks.classification", "AbsTaskClassification", "Classification", "accuracy"),
}


def stock_task(name: str, kind: str):
    """The mteb task called `name`, or None when mteb has none (a name of the user's own). A task of another type than
    the folder's kind is refused in one line (a BEIR folder named STS12 cannot be scored as STS12)."""
    try:
        task = mteb.get_task(name)
    except KeyError:
        return None
    if task.metadata.type != OWN_TASK_KINDS[kind][2]:
        raise UserError(f"--local_tasks {name}: mteb's {name} is a {task.metadata.type} task, the folder a "
                        f"{OWN_TASK_KINDS[kind][2]} one; give the folder a name of your own (NAME=DIR)")
    return task


def parse_local_spec(spec: str) -> tuple[str, Path, str]:
    """"DIR" or "NAME=DIR" -> (task name, folder, kind).

    The name is the one given, else the mteb task the folder's files or name say (detect_local_format: scifact/ ->
    SciFact, sts-test.csv -> STSBenchmark), else the folder's own name. A name mteb knows is that stock task scored on
    the folder's data; any other is the user's own task (own_task). A BEIR folder that holds no qrels split of the
    stock task (a dev-only copy: qrels/dev.tsv) is its own task, under the folder's name, on its own split: never
    reported as the stock task's evaluation."""
    name, path = task_spec(spec)
    folder = Path(path).expanduser()
    kind, default = detect_local_format(folder)
    name = name or default or folder.name
    if kind == "retrieval":
        stock = stock_task(name, kind)
        wanted = stock.metadata.eval_splits[0] if stock is not None else "test"
        split = local_retrieval_split(folder, wanted)
        if stock is not None and split != wanted:
            name = folder.name if stock_task(folder.name, kind) is None else f"{folder.name}-{split}"
    return name, folder, kind


def own_task(name: str, folder: Path, kind: str):
    """The user's own task: a class of mteb's (AbsTaskRetrieval, AbsTaskSTS or AbsTaskClassification, with
    _XPRTTaskMixin's loader in front) whose TaskMetadata is the folder's: `name`, its split, its path, the main score
    every mteb task of that type reports. So mteb's own evaluator scores it and writes its result file under `name`;
    no stock task's metadata (name, dataset id, revision) is borrowed."""
    import importlib

    from mteb.abstasks.task_metadata import TaskMetadata

    module, class_name, task_type, main_score = OWN_TASK_KINDS[kind]
    base = getattr(importlib.import_module(module), class_name)
    split = local_retrieval_split(folder, "test") if kind == "retrieval" else "test"
    attrs = {"metadata": TaskMetadata(
        name=name, description=f"The user's own {task_type} task from the local folder {folder.name} "
                               "(xprt evaluate.py --local_tasks); not an mteb task.",
        dataset={"path": str(folder), "revision": "local"}, type=task_type, category="t2t", modalities=["text"],
        eval_splits=[split], eval_langs=["und-Zzzz"],  # language and script undetermined: the folder does not say
        main_score=main_score), "_xprt_own": True}
    if kind == "sts":  # the folder's own scale (mteb normalises the gold scores by it; Spearman does not change)
        gold = [s for _, _, s in load_sts_folder(folder)[1]]
        attrs.update(min_score=min(gold, default=0), max_score=max(gold, default=1))
    return type(re.sub(r"\W", "_", f"OwnTask_{name}"), (_XPRTTaskMixin, base), attrs)()


# ---------------------------------------------------------------------------------------------------
# 3. The task mix-in: local data, --limit sampling, per-query scores for the overlap analysis
# ---------------------------------------------------------------------------------------------------


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def word_overlap(query: str, relevant_docs: Sequence[str]) -> float:
    """Share of the query's distinct words that occur in its relevant document(s) (title + text).

    The paper splits ArguAna queries "by word overlap with the counter-argument" without a formula;
    this is ours: |words(q) ∩ words(docs)| / |words(q)|, lower-cased \\w+ tokens, no stop-word list.
    """
    q = _words(query)
    if not q:
        return 0.0
    d = set().union(*(_words(x) for x in relevant_docs)) if relevant_docs else set()
    return len(q & d) / len(q)


def subsample_retrieval(data: dict, limit: int, corpus_limit: Optional[int], seed: int) -> dict:
    """`limit` random judged queries, all their relevant documents, plus random other documents up to
    `corpus_limit` in all: a smaller but consistent task (every kept qrel still points into the corpus)."""
    rng = random.Random(seed)
    qids = sorted(data["qrels"])
    keep_q = sorted(rng.sample(qids, min(limit, len(qids))))
    qrels = {q: data["qrels"][q] for q in keep_q}
    needed = {d for ds in qrels.values() for d in ds}
    others = sorted(set(data["corpus"]) - needed)
    n_other = max(0, (corpus_limit or 10 * limit) - len(needed))
    keep_d = needed | set(rng.sample(others, min(n_other, len(others))))
    return {"corpus": {d: data["corpus"][d] for d in data["corpus"] if d in keep_d},
            "queries": {q: data["queries"][q] for q in keep_q}, "qrels": qrels}


class _XPRTTaskMixin:
    """Put in front of a stock mteb task's class, or of mteb's abstract class of a user's own task (see `build_task`):
    the metadata and metrics stay mteb's."""

    _xprt_local: Optional[tuple[Path, str]] = None
    _xprt_limit: Optional[int] = None
    _xprt_corpus_limit: Optional[int] = None
    _xprt_seed: int = 0

    def load_data(self, num_proc=None, **kwargs):  # noqa: D401 - mteb's hook
        if self.data_loaded:
            return
        if self._xprt_local is None:
            super().load_data(num_proc=num_proc, **kwargs)  # online: mteb's own loader
            if self._xprt_limit:
                self._subsample_loaded()
        else:
            self._load_local()
        self.data_loaded = True

    def _load_local(self):
        from datasets import Dataset, DatasetDict
        from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData

        folder, kind = self._xprt_local
        split = self.metadata.eval_splits[0]
        lim, rng = self._xprt_limit, random.Random(self._xprt_seed)
        if kind == "retrieval":
            data = load_beir(folder, split)
            if lim:
                data = subsample_retrieval(data, lim, self._xprt_corpus_limit, self._xprt_seed)
            corpus = Dataset.from_dict({"id": list(data["corpus"]), "title": [t for t, _ in data["corpus"].values()],
                                        "text": [x for _, x in data["corpus"].values()]})
            queries = Dataset.from_dict({"id": list(data["queries"]), "text": list(data["queries"].values())})
            self.dataset = {"default": {split: RetrievalSplitData(corpus=corpus, queries=queries,
                                                                  relevant_docs=data["qrels"], top_ranked=None)}}
        elif kind == "sts":
            _, rows = load_sts_folder(folder)
            if not rows:
                raise UserError(f"{folder}: no scored sentence pairs")
            if lim:
                rows = rng.sample(rows, min(lim, len(rows)))
            s1, s2, sc = zip(*rows)
            self.dataset = {"default": {split: Dataset.from_dict({"sentence1": list(s1), "sentence2": list(s2),
                                                                  "score": list(sc)})}}
        elif kind == "classification":
            data = load_classification_folder(folder)
            if lim:
                keep = sorted(rng.sample(range(len(data["test"]["text"])), min(lim, len(data["test"]["text"]))))
                data["test"] = {k: [v[i] for i in keep] for k, v in data["test"].items()}
            dd = DatasetDict({"train": Dataset.from_dict(data["train"]), split: Dataset.from_dict(data["test"])})
            self.dataset = {"default": dd}
        else:
            raise ValueError(f"unknown local task kind {kind!r}")

    def _subsample_loaded(self):
        """--limit for an online task: the same sampling, applied to what mteb loaded."""
        from datasets import Dataset
        lim, seed = self._xprt_limit, self._xprt_seed
        for subset in self.dataset.values():
            for split in self.metadata.eval_splits:
                if split not in subset:
                    continue
                ds = subset[split]
                if isinstance(ds, dict) and "relevant_docs" in ds:
                    corpus = {r["id"]: (r.get("title") or "", r["text"]) for r in ds["corpus"]}
                    data = subsample_retrieval({"corpus": corpus, "qrels": dict(ds["relevant_docs"]),
                                                "queries": {r["id"]: r["text"] for r in ds["queries"]}},
                                               lim, self._xprt_corpus_limit, seed)
                    ds["relevant_docs"] = data["qrels"]
                    ds["queries"] = ds["queries"].filter(lambda r: r["id"] in data["queries"])
                    ds["corpus"] = ds["corpus"].filter(lambda r: r["id"] in data["corpus"])
                elif isinstance(ds, Dataset) and len(ds) > lim:
                    subset[split] = ds.shuffle(seed=seed).select(range(lim))

    def task_specific_scores(self, scores, qrels, results, hf_split, hf_subset):
        """mteb hands retrieval tasks the per-query pytrec_eval scores here: keep nDCG@10 per query and
        the query's word overlap with its relevant documents, for the overlap analysis."""
        data = self.dataset[hf_subset][hf_split] if hf_subset in self.dataset else self.dataset[hf_split]
        q_text = dict(zip(data["queries"]["id"], data["queries"]["text"]))
        needed = {d for q in scores for d in qrels.get(q, {}) if qrels[q][d] > 0}
        doc_text = {}
        for did, title, text in zip(data["corpus"]["id"],
                                    data["corpus"]["title"] if "title" in data["corpus"].column_names else
                                    [""] * len(data["corpus"]), data["corpus"]["text"]):
            if did in needed:
                doc_text[did] = f"{title} {text}"
        per_query = {
            q: {"ndcg_at_10": s.get("ndcg_cut_10", 0.0),
                "overlap": word_overlap(q_text.get(q, ""), [doc_text[d] for d in qrels.get(q, {})
                                                            if qrels[q][d] > 0 and d in doc_text])}
            for q, s in scores.items()
        }
        # into mteb's own score dict, so the result file in the results folder carries what the overlap analysis
        # needs and a rerun read from that folder can redo it
        return {**super().task_specific_scores(scores, qrels, results, hf_split, hf_subset),
                PER_QUERY_KEY: per_query}


def build_task(name: str, local: Optional[tuple[Path, str]] = None, limit: Optional[int] = None,
               corpus_limit: Optional[int] = None, seed: int = 0, task=None):
    """The task to score, with `_XPRTTaskMixin` in front of its class (our loader, --limit, per-query scores): the stock
    mteb task `name` (or the instance `task`, e.g. from a benchmark, with its language filters), with mteb's metadata
    and metric, on mteb's data or on the local folder `local` = (folder, kind); or, for a local folder under a name
    mteb does not know, the user's own task (own_task)."""
    if task is not None:
        stock = task
    elif local is not None:
        stock = stock_task(name, local[1])
    else:
        stock = mteb_task(name)
    if stock is None:  # a local folder under a name mteb does not know
        task = own_task(name, *local)
    else:
        cls = type(type(stock).__name__, (_XPRTTaskMixin, type(stock)), {})
        # A new instance of the subclass with the stock instance's state (a benchmark's language and split
        # filters live there); __class__ assignment is refused by some task classes' layouts.
        task = cls.__new__(cls)
        task.__dict__.update(stock.__dict__)
    task._xprt_local, task._xprt_limit, task._xprt_corpus_limit, task._xprt_seed = local, limit, corpus_limit, seed
    return task


# ---------------------------------------------------------------------------------------------------
# 4. Running: one model at a time, every task, mteb's results folder (reruns skip finished tasks)
# ---------------------------------------------------------------------------------------------------


def data_fingerprint(folder: Optional[Path]) -> str:
    """A local task folder's name in its experiment settings: files_hash of every file under it (SciFact's 8 MB:
    ~20 ms), so a copy keeps its results and an edit gets new ones; "online" for mteb's own data."""
    if folder is None:
        return "online"
    return files_hash(folder, [f for f in folder.rglob("*") if f.is_file()])


def card_data(name: str, local, settings: dict, result: dict) -> Optional[str]:
    """What a model card says was scored when it is not the full standard task (None when it is): the local folder's
    name and content hash (never its path), the queries scored, the --limit sample."""
    if local is None and "limit" not in settings:
        return None
    parts = [f"local copy {Path(local[0]).name} (data_{settings['data']})"] if local is not None else [f"mteb {name}"]
    if result.get("per_query"):
        parts.append(f"{len(result['per_query'])} queries")
    if "limit" in settings:
        parts.append(f"a --limit {settings['limit']} sample (corpus at most {settings['corpus_limit']}, seed "
                     f"{settings['seed']})")
    return ", ".join(parts)


def run_settings(local: Optional[tuple[Path, str]], limit: Optional[int], corpus_limit: Optional[int],
                 seed: int, encoder_settings: Optional[dict] = None) -> dict:
    """What makes a run differ from mteb's standard run of the model on the task, as mteb's `experiment_kwargs`.

    mteb files a run with experiment kwargs under results/<model>/<revision>/experiments/<kwargs>/: a --limit
    sample, a local folder (mteb cannot know it holds the task's data: named by the content hash), or forced
    prefixes / max length never land where the model's standard scores (and the public leaderboard's) do, and
    a change of any of them is a new run rather than a stale reuse. An empty dict: the standard place."""
    settings = dict(encoder_settings or {})
    if local is not None:
        settings["data"] = data_fingerprint(local[0])
    if limit:
        settings.update(limit=limit, corpus_limit=corpus_limit or 10 * limit, seed=seed)
    return settings


def evaluate_model_on_task(encoder, task, batch_size: int, cache=None, settings: Optional[dict] = None,
                           rerun: bool = False, show_progress: bool = False) -> dict:
    """One mteb run, written to mteb's results folder (`cache`, a mteb.ResultCache) and read back from it ->
    {"task", "type", "main_score" (x100), "metric", "scores", "per_query", "result_file"}.

    mteb skips the task when the folder already holds it for this model, revision and settings ("only-missing";
    `rerun` forces it). Without a cache (tests, train.py's scores during training) nothing is written."""
    base = encoder.mteb_model_meta
    meta = base.model_copy(update={"experiment_kwargs": settings or None})
    encoder.mteb_model_meta = meta
    try:
        res = mteb.evaluate(encoder, [task], cache=cache, overwrite_strategy="always" if rerun else "only-missing",
                            encode_kwargs={"batch_size": batch_size, "show_progress_bar": show_progress},
                            show_progress_bar=False, co2_tracker=False, raise_error=True)
    finally:
        encoder.mteb_model_meta = base
    name = task.metadata.name
    if cache is not None:  # the numbers of the table are the ones in the folder
        path = cache.get_task_result_path(name, meta)
        tr = mteb.TaskResult.from_disk(path)
    else:
        path, tr = None, res.task_results[0]
    per_query = {}
    for split in task.metadata.eval_splits:
        for entry in tr.scores.get(split, []):
            per_query.update(entry.get(PER_QUERY_KEY) or {})
    slim = {split: [{k: v for k, v in e.items() if k != PER_QUERY_KEY} for e in entries]
            for split, entries in tr.scores.items()}
    return {"task": name, "type": task.metadata.type, "metric": task.metadata.main_score,
            "main_score": 100.0 * float(tr.get_score()), "scores": slim, "per_query": per_query,
            "result_file": str(path) if path else None, "settings": dict(settings or {}),
            # what the result file says made it (a finished task read back may come from an earlier run)
            "mteb_version": tr.mteb_version, "dataset_revision": tr.dataset_revision,
            "date": tr.date.isoformat() if tr.date else None}


def card_results(results: dict) -> tuple[dict, dict]:
    """One model's results for model_folder.add_eval_results_to_card -> (full standard tasks: {task: {"metric", "score",
    "dataset_id", "split", "revision"}}, local data and samples: {task: {"metric", "score", "data"}})."""
    standard, local = {}, {}
    for t, r in results.items():
        entry = {"metric": r["metric"], "score": round(r["main_score"], 2)}
        if r.get("card_data"):  # a local copy or a --limit sample: what was scored, without a path
            local[t] = {**entry, "data": r["card_data"]}
        else:
            ds = r.get("dataset") or {}
            standard[t] = {**entry, "dataset_id": ds.get("path"), "split": r.get("split"),
                           "revision": ds.get("revision")}
    return standard, local


def check_outputs_writable(models, results_dir: str):
    """Before any scoring: mteb's results folder (each task's result is written there as it finishes) and the
    folder of every model whose card update_model_card will write can be written (a probe file, common.check_writable),
    or the run stops in one line now, not after the scoring."""
    check_writable(results_dir, "--results_dir")
    for name in models:
        path = resolve_model_path(name)
        if os.path.isdir(path) and (Path(path) / "xprt_config.json").is_file() and (Path(path) / "README.md").is_file():
            try:
                check_writable(path, "--models")
            except UserError as err:
                raise UserError(f"{err}: evaluate.py writes the scores into its model card (README.md); pass "
                                "--no_card_update to leave it as it is") from None


def update_model_card(model_name: str, results: dict, source: str) -> bool:
    """After scoring a local xprt folder (xprt_config.json present): full standard tasks into its card's
    Evaluation section and model-index, local data and samples into a section of their own."""
    path = resolve_model_path(model_name)
    if not (os.path.isdir(path) and (Path(path) / "xprt_config.json").is_file()):
        return False
    if not (Path(path) / "README.md").is_file():
        print(f"model {model_name}: no model card (README.md) to write the scores into", flush=True)
        return False
    standard, local = card_results(results)
    if standard:
        add_eval_results_to_card(path, standard, source)
    if local:
        add_eval_results_to_card(path, local, source, local=True)
    return True


def describe_contract(c: dict) -> str:
    """One phrase of a scoring contract (CONTRACT_KEYS) for the log and the report."""
    return (f"{c['pooling']} pooling, {'normalised' if c['normalize'] else 'not normalised'}, {c['similarity']} "
            f"similarity, prefixes {c['query_prefix']!r} / {c['passage_prefix']!r}, at most {c['max_length']} tokens")


def contract_differences(out: dict) -> dict:
    """{key: {model: value}} for each CONTRACT_KEYS entry on which the compared models differ: a difference between
    their scores then mixes the change of that setting with what training did (a dot-product start scored against
    its cosine-saved continuation compares two similarities). Empty when they are scored alike."""
    contracts = out.get("contracts") or {}
    if len(contracts) < 2:
        return {}
    return {k: {m: c[k] for m, c in contracts.items()} for k in CONTRACT_KEYS
            if len({json.dumps(c[k]) for c in contracts.values()}) > 1}


def task_variant(metadata) -> str:
    """Which of mteb's ids of a task this is, so that two result pages compare like with like. mteb 2.21+ gives a
    revised dataset (deduplicated, corrected: a "cleaned" variant) a new id, `Name.v2`, whose `adapted_from` names the
    earlier id, and marks the earlier id `superseded_by` the new one; scores on the two do not compare (mteb#5228).
    -> "revised id of X: <what its description says changed>", "original id; revised as Y ...", or "the only id"."""
    m = metadata

    def superseded_by(name):
        try:
            return mteb.get_task(name).metadata.superseded_by
        except KeyError:
            return None

    parents = [p for p in m.adapted_from or [] if superseded_by(p) == m.name or re.fullmatch(rf"{re.escape(p)}\.v\d+",
                                                                                              m.name)]
    if parents:
        said = re.search(r"[^.]*\bversion\b[^.]*\.", m.description, re.IGNORECASE)
        return f"revised id of {', '.join(parents)}" + (f": {said.group(0).strip()}" if said else "")
    if m.superseded_by:
        return (f"original id; mteb revised it as {m.superseded_by}: scores on the two do not compare (a benchmark "
                "that lists this id still scores it)")
    return "the only id"


def task_record(name: str, task, local, sample: bool, data_hash: Optional[str]) -> dict:
    """What the report says of a task: {"name", "type", "source", "data", "sample", "scored_by", "main_score",
    "split", "dataset" (mteb's id and revision of its data), "variant" (task_variant), "data_hash"}. scored_by: "mteb"
    (the stock task on mteb's data), "stock" (the stock task on a local folder's data) or "own" (the user's own task
    from a local folder, own_task)."""
    m = task.metadata
    scored_by = "own" if getattr(task, "_xprt_own", False) else ("stock" if local else "mteb")
    return {"name": name, "type": m.type, "source": str(local[0]) if local else "mteb (online)",
            "data": {"mteb": "mteb", "stock": "local copy", "own": "local folder"}[scored_by], "sample": sample,
            "scored_by": scored_by, "main_score": m.main_score, "split": m.eval_splits[0],
            "dataset": None if scored_by == "own" else {k: m.dataset.get(k) for k in ("path", "revision")},
            "variant": None if scored_by == "own" else task_variant(m), "data_hash": data_hash}


def scored_by_phrase(t: dict) -> str:
    """What scored a task, in words (results.md)."""
    folder = Path(t["source"]).name
    if t.get("scored_by") == "own":
        return (f"the user's own task, from folder `{folder}`, scored by mteb's {t['type'].lower()} evaluator "
                f"({t['main_score']})")
    if t.get("scored_by") == "stock":
        return f"the stock mteb task {t['name']} on the folder `{folder}`'s data"
    return f"the stock mteb task {t['name']} on mteb's data"


def task_specs(local_tasks: Sequence[str], tasks: Sequence[str], benchmark: Optional[str]) -> list:
    """--local_tasks, --tasks and --benchmark's tasks as (name, (folder, kind) or None, benchmark task or None)."""
    specs = [(name, (folder, kind), None) for name, folder, kind in map(parse_local_spec, local_tasks)]
    specs += [(name, None, None) for name in tasks]
    if benchmark:
        try:
            bench = mteb.get_benchmark(benchmark)
        except KeyError as err:  # a misspelled name: mteb's message suggests the right one
            raise UserError(f"--benchmark {benchmark}: {err.args[0]}") from None
        specs += [(t.metadata.name, None, t) for t in bench.tasks]
    if not specs:
        raise UserError("no task: give --local_tasks, --tasks or --benchmark")
    names = [name for name, _, _ in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # two folders called alike (a/data, b/data) would file their results under one name
        raise UserError(f"two tasks are called {twice[0]}: name the local ones apart, --local_tasks NAME=DIR")
    return specs


def record_encoder(out: dict, model_name: str, encoder):
    """What a model is scored as, into run_evaluation's report and printed: its contract, max length (a warning when
    the models' differ), mteb name and revision, pooling and prefixes."""
    if getattr(encoder, "contract", None):
        out["contracts"][model_name] = dict(encoder.contract)
        print(f"model {model_name}: scored with {describe_contract(encoder.contract)}", flush=True)
    lengths = out.setdefault("max_length", {})
    lengths[model_name] = getattr(encoder, "max_length", None)
    if len(set(lengths.values())) > 1:  # e.g. MiniLM's folder says 256, a train.py save says 512
        warnings.warn(f"models run with different max lengths {lengths}: long documents are cut differently; "
                      "pass --max_length to compare like with like")
    meta = encoder.mteb_model_meta
    # the complete ModelMeta (plumbing/leaderboard.py), where each field came from and what a submission still
    # lacks; the object itself for --submission, and what the model ran with for its run settings
    out["model_meta"][model_name] = {"name": meta.name, "revision": meta.revision,
                                     "registry": bool(getattr(encoder, "meta_registry", False)),
                                     "fields": json.loads(json.dumps(meta.to_dict(), default=str)),
                                     "said": getattr(encoder, "meta_said", {}),
                                     "missing": getattr(encoder, "meta_missing", [])}
    out.setdefault("metas", {})[model_name] = meta
    out.setdefault("runtime", {})[model_name] = {
        "prompts": getattr(encoder, "prompts", None), "dtype": str(getattr(encoder, "dtype", None)),
        "device": str(getattr(encoder, "device", None)), "max_length": getattr(encoder, "max_length", None)}
    print(f"model {model_name}: mteb name {meta.name}, revision {meta.revision}; pooling "
          f"{getattr(encoder, 'pooling', '?')}", flush=True)
    print(f"model {model_name}: prefixes: query {getattr(encoder, 'query_prefix', '')!r}, "
          f"passage {getattr(encoder, 'passage_prefix', '')!r}", flush=True)


def run_evaluation(models: Sequence[str], tasks: Sequence[str] = (), local_tasks: Sequence[str] = (),
                   benchmark: Optional[str] = None, limit: Optional[int] = None,
                   corpus_limit: Optional[int] = None, seed: int = 0, prefixes: str = "auto",
                   batch_size: int = 64, max_length: Optional[int] = None, device: Optional[str] = None,
                   dtype: Optional[str] = None, query_prefix: Optional[str] = None,
                   passage_prefix: Optional[str] = None, results_dir: Optional[str] = None, rerun: bool = False,
                   trust_remote_code: bool = False, show_progress: bool = True, encoder_factory=None,
                   update_cards: bool = False, score_as: Optional[str] = None,
                   model_meta_given: Optional[dict] = None, mock_run: bool = False) -> dict:
    """Evaluate every model on every task; the function the CLI wraps (and the demo, through the CLI).
    mock_run (--submission): each model also through mteb.mock_run, mteb's check of a model implementation on its
    built-in mock tasks (offline), which its model PR asks for: out["mock_runs"][model] = its markdown report.

    results_dir: mteb's results folder (mteb.ResultCache(results_dir)); every task result is written there by mteb
    and the returned scores are read back from it; finished tasks are skipped unless `rerun`. None: nothing written.
    Returns {"models": [...], "results": {model: {task: result}}, "tasks": [{"name","type","source"}], ...}.
    prefixes, query_prefix, passage_prefix, max_length, device, dtype, trust_remote_code: XPRTEncoder's.
    `encoder_factory(name) -> AbsEncoder` replaces XPRTEncoder (tests use it).
    update_cards: write the scores into a local xprt folder's model card (full standard tasks into its model-index,
    local data and --limit samples into a section of their own).
    score_as: a model whose scoring contract (pooling, normalisation, similarity, prefixes, length) every model is
    scored with (XPRTEncoder.score_as), so that the differences between them are their weights'. Without it, models
    whose contracts differ are compared as each is used, and the report says how they differ (contract_differences).
    model_meta_given: what each model's ModelMeta takes beyond its records (model_meta_of's `given`:
    public_training_code, public_training_data, training_datasets, adapted_from).
    """
    from tqdm.auto import tqdm

    if not models:
        raise ValueError("give at least one model (--models)")
    specs = task_specs(local_tasks, tasks, benchmark)
    cache = mteb.ResultCache(results_dir) if results_dir else None
    # what the scores are: a --limit sample and local copies are not the tasks as the MTEB leaderboard scores them
    out = {"models": list(models), "results": {}, "tasks": [], "model_meta": {},
           "results_dir": str(cache.cache_path) if cache else None,
           "sample": {"limit": limit, "corpus_limit": corpus_limit, "seed": seed} if limit else None}
    # once per task, not per model: the fingerprint reads every file of the folder
    task_settings = {name: run_settings(local, limit, corpus_limit, seed) for name, local, _ in specs}
    for name, local, bench_task in specs:
        t = build_task(name, local=local, task=bench_task)
        if local is None:
            check_task_data(t, "--benchmark" if bench_task is not None else "--tasks")
        out["tasks"].append(task_record(name, t, local, bool(limit), task_settings[name].get("data")))
    def make_encoder(n, contract=None):
        return XPRTEncoder(n, prefixes=prefixes, batch_size=batch_size, max_length=max_length, device=device,
                           dtype=dtype, query_prefix=query_prefix, passage_prefix=passage_prefix,
                           trust_remote_code=trust_remote_code, show_progress=show_progress, score_as=contract,
                           model_meta_given=model_meta_given)

    reference = None
    if score_as:  # the contract every model is scored with: the one its own folder gives it
        ref = (encoder_factory or make_encoder)(score_as)
        reference = {**ref.contract, "model": score_as}
        out["score_as"] = reference
        print(f"every model scored as {score_as} is: {describe_contract(reference)} (--score_as)", flush=True)
        del ref
    out["contracts"] = {}
    for model_name in models:
        encoder = (encoder_factory or make_encoder)(model_name, *([reference] if reference else []))
        record_encoder(out, model_name, encoder)
        out["results"][model_name] = {}
        for name, local, bench_task in tqdm(specs, desc=f"tasks [{model_name}]", disable=not show_progress):
            task = build_task(name, local=local, limit=limit, corpus_limit=corpus_limit, seed=seed, task=bench_task)
            settings = {**getattr(encoder, "settings", {}), **task_settings[name]}
            result = evaluate_model_on_task(encoder, task, batch_size, cache=cache, settings=settings,
                                            rerun=rerun, show_progress=show_progress)
            result["source"] = str(local[0]) if local else "mteb (online)"
            result.update(dataset=dict(task.metadata.dataset), split=task.metadata.eval_splits[0],
                          card_data=card_data(name, local, task_settings[name], result))
            out["results"][model_name][name] = result
            logger.info("%s | %s: %s = %.2f (%s)", model_name, name, result["metric"], result["main_score"],
                        result["result_file"] or "not written")
        if update_cards and update_model_card(model_name, out["results"][model_name],
                                              f"xprt's evaluate.py (mteb {mteb.__version__}, main scores)"):
            print(f"model {model_name}: evaluation written into its model card", flush=True)
        if mock_run:
            checked = mteb.mock_run(encoder)
            out.setdefault("mock_runs", {})[model_name] = {"markdown": checked.to_markdown(),
                                                           "all_passed": checked.all_passed}
        del encoder
    return out


# ---------------------------------------------------------------------------------------------------
# 4b. Scores during training (train.py / finetune.py --eval_steps): the model being trained, on bounded tasks
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def preserved_rng():
    """The Python / numpy / torch (CPU and CUDA) random states restored after the block: scoring during training must
    not change the run that follows (mteb and datasets draw from the global generators; a resumed run must draw the
    same masks and dropout)."""
    import torch

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


@contextlib.contextmanager
def eval_mode_and_rng(module):
    """Every submodule in eval mode (no dropout) inside the block, then each back in its own mode (finetune.py keeps
    frozen heads as they were), with the random states preserved (preserved_rng)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with preserved_rng():
            yield
    finally:
        for m, was_training in modes:
            m.training = was_training


class TrainingEncoder(AbsEncoder):
    """mteb wrapper of the encoder being trained: embed.embed_texts (with the pooling, normalisation and
    similarity train.py saves: the start model's) under the model's prompts, no gradient.

    With several processes every process runs the same mteb evaluation, and each encode call is split: the distinct
    texts are cut into one equal slice per process (padded to equal length, so that every process runs the same
    number of forward passes, as DeepSpeed ZeRO-3 needs), each process encodes its slice, and the vectors are
    all-gathered. No process encodes alone while the others wait at a barrier (NCCL ends such a wait after 10
    minutes); the scoring itself (similarities, nDCG) is repeated on every process and stays small under
    --eval_limit."""

    def __init__(self, encoder, tokenizer, prompts: dict, max_length: int, batch_size: int, accelerator=None,
                 pooling: str = "mean", normalize: bool = True, similarity_fn_name: str = "cosine",
                 post_pooling=None):
        self.encoder, self.tokenizer, self.prompts, self.pooling = encoder, tokenizer, prompts, pooling
        self.normalize, self.post_pooling = normalize, post_pooling
        self.max_length, self.batch_size, self.accelerator = max_length, batch_size, accelerator
        self.mteb_model_meta = ModelMeta(
            loader=None, name="local/training", revision="in-training", release_date=None, languages=None,
            n_parameters=None, memory_usage_mb=None, max_tokens=max_length,
            embed_dim=post_pooling.dim(encoder.config.hidden_size) if post_pooling is not None else
            encoder.config.hidden_size,
            license=None, open_weights=True, public_training_code=None, public_training_data=None,
            framework=["PyTorch"], similarity_fn_name=scoring_function(similarity_fn_name), use_instructions=False,
            training_datasets=None)

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str,
               prompt_type: Optional[PromptType] = None, **kwargs: Any) -> np.ndarray:
        texts = [t for batch in inputs for t in batch["text"]]
        prefix = prompt_for(self.prompts, task_metadata, prompt_type) or ""
        acc = self.accelerator
        world = acc.num_processes if acc is not None else 1
        autocast = acc.autocast() if acc is not None else contextlib.nullcontext()
        if world == 1:
            with autocast:
                return embed_texts(self.encoder, self.tokenizer, texts, self.batch_size, self.max_length,
                                   prefix, pooling=self.pooling, normalize=self.normalize,
                                   post_pooling=self.post_pooling).numpy()
        unique = list(dict.fromkeys(texts))
        per = math.ceil(len(unique) / world)
        mine = unique[acc.process_index * per:(acc.process_index + 1) * per]
        mine += [f"[xprt eval padding {i}]" for i in range(per - len(mine))]
        with autocast:
            vecs = embed_texts(self.encoder, self.tokenizer, mine, self.batch_size, self.max_length, prefix,
                               pooling=self.pooling, normalize=self.normalize, post_pooling=self.post_pooling)
        every = acc.gather(vecs.to(acc.device)).cpu()  # (world * per, H), in process order
        where = {t: i for i, t in enumerate(unique)}
        return every[[where[t] for t in texts]].numpy()


def load_training_eval_tasks(specs: Sequence[str], limit: Optional[int], seed: int = 0) -> list:
    """The tasks of --eval_tasks (local folders, TaskName=DIR, or mteb task names), each cut to `limit` queries /
    pairs / test texts (corpus 10 x) and loaded once, so every scoring during training uses the same sample."""
    tasks = []
    with preserved_rng():  # loading draws from the global generators too
        for spec in specs:
            if os.path.isdir(task_spec(spec)[1]):
                name, folder, kind = parse_local_spec(spec)
                task = build_task(name, local=(folder, kind), limit=limit, seed=seed)
            else:  # an mteb task name: mteb's own loader (the hub)
                task = build_task(spec, limit=limit, seed=seed)
            task.load_data()
            tasks.append(task)
    return tasks


def score_during_training(model, tokenizer, tasks: Sequence, prompts: dict, max_length: int, batch_size: int = 64,
                          accelerator=None) -> dict:
    """{task name: main score x100} of the model being trained (an XPRTModel, possibly wrapped by DDP / DeepSpeed:
    pass the accelerator), in eval mode, then back in training mode."""
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    info = unwrapped.info  # scored as its saved folder would be: its pooling, normalisation and similarity
    enc = TrainingEncoder(unwrapped.encoder, tokenizer, prompts, max_length, batch_size, accelerator, info.pooling,
                          info.normalize, info.similarity_fn_name, unwrapped.post_pooling)
    scores = {}
    with eval_mode_and_rng(unwrapped):
        for task in tasks:
            scores[task.metadata.name] = evaluate_model_on_task(enc, task, batch_size)["main_score"]
    return scores


def check_task_specs(specs: Sequence[str]):
    """train.py / finetune.py --eval_tasks, checked at parse time: a local folder that is no known task stops the
    run before it starts, not after its first --eval_steps."""
    for spec in specs:
        if os.path.isdir(task_spec(spec)[1]):
            try:
                parse_local_spec(spec)
            except (ValueError, FileNotFoundError) as err:
                raise UserError(f"--eval_tasks {spec}: {err}") from None
        else:  # an mteb task by name: known to mteb, and its data reachable
            check_task_data(mteb_task(spec, "--eval_tasks"), "--eval_tasks")


class TrainingScorer:
    """--eval_tasks during training: the tasks loaded once by every process (each scores, each encodes a share of
    the texts), and a call per scoring -> a train_log.jsonl record {"step", "epoch", "eval_<task>": score x100,
    "scoring_time_s"}, also sent to the trackers. The model is scored as its saved folder would be (its prompts and
    length limit), dropout off and no gradient inside, training mode and random states restored after."""

    def __init__(self, accelerator, args, tokenizer):
        self.accelerator, self.tokenizer, self.batch_size = accelerator, tokenizer, args.eval_batch_size
        self.tasks = load_training_eval_tasks(args.eval_tasks, args.eval_limit or None, seed=args.seed)
        self.last_step = -1
        accelerator.print(f"scores during training: {', '.join(t.metadata.name for t in self.tasks)} every "
                          f"{args.eval_steps or '-'} steps and at the end, at most {args.eval_limit or 'all'} "
                          f"queries / pairs each, the texts split across {accelerator.num_processes} process(es)")

    def __call__(self, model, step: int, epoch: int) -> dict:
        """Score `model` (prepared) at `step` -> the record; its "scoring_time_s" is what the loop leaves out of the
        training time (LogWindow.exclude)."""
        import time

        acc, unwrapped = self.accelerator, self.accelerator.unwrap_model(model)
        t0 = time.time()
        with gathered_params(acc, model):  # ZeRO-3: the whole weights for the scoring's forward passes (no-op else)
            scores = score_during_training(model, self.tokenizer, self.tasks, unwrapped.prompts,
                                           unwrapped.max_seq_length, self.batch_size, acc)
        rec = {"step": step, "epoch": epoch, **{EVAL_PREFIX + k: v for k, v in scores.items()},
               "scoring_time_s": time.time() - t0}
        acc.log({k: v for k, v in rec.items() if k != "step"}, step=step)
        acc.print("step {}: {} ({:.1f} s)".format(step, ", ".join(f"{k} {v:.2f}" for k, v in scores.items()),
                                                  rec["scoring_time_s"]))
        self.last_step = step
        return rec


# ---------------------------------------------------------------------------------------------------
# 5. Tables, overlap analysis and the bar chart
# ---------------------------------------------------------------------------------------------------


def summarize(out: dict) -> dict:
    """Per task, per category (task type) and overall averages (x100), and each model's difference to
    the first. The overall average is the mean over tasks, as the MTEB average the paper reports."""
    models, tasks = out["models"], out["tasks"]
    per_task = {m: {t["name"]: out["results"][m][t["name"]]["main_score"] for t in tasks} for m in models}
    cats = sorted({t["type"] for t in tasks})
    per_cat = {m: {c: float(np.mean([per_task[m][t["name"]] for t in tasks if t["type"] == c])) for c in cats}
               for m in models}
    avg = {m: float(np.mean(list(per_task[m].values()))) for m in models}
    first = models[0]
    return {"per_task": per_task, "per_category": per_cat, "average": avg, "categories": cats,
            "delta_per_task": {m: {t: per_task[m][t] - per_task[first][t] for t in per_task[m]} for m in models},
            "delta_per_category": {m: {c: per_cat[m][c] - per_cat[first][c] for c in cats} for m in models},
            "delta_average": {m: avg[m] - avg[first] for m in models}}


def overlap_analysis(out: dict, task: str) -> dict:
    """The paper's analysis: queries split into thirds by word overlap with their relevant documents
    (low / mid / high, ties broken by query id), mean nDCG@10 (x100) of each model in each third.

    The thirds are fixed by the data (the overlap does not depend on the model); the paper's result on
    ArguAna: xPRT above E5 in every third, by 3.7 to 8.8 points.
    """
    models = out["models"]
    per_q = out["results"][models[0]][task].get("per_query") or {}
    if not per_q:
        raise ValueError(f"{task}: no per-query scores (is it a retrieval task?)")
    qids = sorted(per_q, key=lambda q: (per_q[q]["overlap"], q))
    thirds = [list(x) for x in np.array_split(np.array(qids, dtype=object), 3)]
    res = {"task": task, "thirds": []}
    for label, qs in zip(("low", "mid", "high"), thirds):
        row = {"third": label, "n_queries": len(qs),
               "overlap_range": [per_q[qs[0]]["overlap"], per_q[qs[-1]]["overlap"]] if qs else [None, None],
               "ndcg_at_10": {}}
        for m in models:
            pq = out["results"][m][task]["per_query"]
            row["ndcg_at_10"][m] = 100.0 * float(np.mean([pq[q]["ndcg_at_10"] for q in qs])) if qs else float("nan")
        res["thirds"].append(row)
    return res


def column_labels(models: Sequence[str]) -> dict:
    """{model: its column label}: the fewest trailing parts of its path that tell it from the others. Its folder's
    name, "<run>/model" for train.py's `<run>/model` folders (every run's folder is called model/), and more parts
    where two still end alike (A/run/model and B/run/model: "A/run/model", "B/run/model")."""
    parts = {m: Path(m.rstrip("/")).parts or (m,) for m in models}
    depth = {m: 2 if len(p) > 1 and p[-1] == "model" else 1 for m, p in parts.items()}
    while True:
        label = {m: "/".join(parts[m][-depth[m]:]) for m in models}
        alike = [m for m in models if depth[m] < len(parts[m]) and list(label.values()).count(label[m]) > 1]
        if not alike:
            return label
        for m in alike:
            depth[m] += 1


def to_markdown(out: dict, summ: dict, overlaps: Sequence[dict] = ()) -> str:
    models, first = out["models"], out["models"][0]
    name = column_labels(list(models) + [m for m in out.get("contracts", {}) if m not in models])
    short = lambda m: name.get(m, m)  # a model's unique column label
    head = "| " + " | ".join(["task", "type", "metric"] + [short(m) for m in models]
                             + [f"Δ {short(m)}" for m in models[1:]]) + " |"
    sep = "|" + "---|" * (3 + 2 * len(models) - 1)
    lines = ["# Evaluation results", "", f"Scores x100 (mteb's metrics). Δ = difference to {short(first)}.", ""]
    if out.get("sample"):
        s = out["sample"]
        lines += [f"**A sample, not the full tasks**: at most {s['limit']} queries / pairs / test texts per task "
                  f"(`--limit {s['limit']}`, seed {s['seed']}"
                  + (f", corpus at most {s['corpus_limit']}" if s.get("corpus_limit") else "")
                  + "): these scores do not compare with full-task scores such as the MTEB leaderboard's.", ""]
    diffs, ref = contract_differences(out), out.get("score_as")
    if ref:
        lines += [f"**Every model is scored as {short(ref['model'])} is** (`--score_as`): {describe_contract(ref)}; "
                  "a Δ is the difference of the weights alone.", ""]
    elif diffs:
        said = "; ".join(f"{k}: " + ", ".join(f"{short(m)} {v!r}" for m, v in per.items()) for k, per in diffs.items())
        lines += [f"**The models are scored differently, not only trained differently** ({said}): a Δ mixes the "
                  "change of scoring with what training did. `--score_as MODEL` scores every model as MODEL is "
                  "scored, so that the Δ isolates training.", ""]
    if out.get("contracts"):
        lines += ["| model | scored with |", "|---|---|"] + [
            f"| {short(m)} | {describe_contract(c)} |" for m, c in out["contracts"].items()] + [""]
    local = [t for t in out["tasks"] if t.get("data") in ("local copy", "local folder")]
    if local:
        lines += ["Local task folders (`--local_tasks`): " + "; ".join(f"{t['name']}: {scored_by_phrase(t)}"
                                                                         for t in local)
                  + ". A folder that holds a subset of a task gives that subset's score.", ""]
    lines += ["## Per task", "", head, sep]
    for t in out["tasks"]:
        n = t["name"]
        metric = out["results"][first][n]["metric"]
        cells = [n, t["type"], metric] + [f"{summ['per_task'][m][n]:.2f}" for m in models]
        cells += [f"{summ['delta_per_task'][m][n]:+.2f}" for m in models[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Per category", "", head.replace("| task | type | metric", "| category | tasks | metric"), sep]
    for c in summ["categories"]:
        k = sum(t["type"] == c for t in out["tasks"])
        cells = [c, str(k), CATEGORY_METRIC.get(c, "main score")]
        cells += [f"{summ['per_category'][m][c]:.2f}" for m in models]
        cells += [f"{summ['delta_per_category'][m][c]:+.2f}" for m in models[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["**average**", str(len(out["tasks"])), "mean over tasks"]
    cells += [f"**{summ['average'][m]:.2f}**" for m in models]
    cells += [f"{summ['delta_average'][m]:+.2f}" for m in models[1:]]
    lines.append("| " + " | ".join(cells) + " |")
    for ov in overlaps:
        lines += ["", f"## Overlap analysis: {ov['task']} (nDCG@10 per third of queries by word overlap)", "",
                  "| third | queries | overlap range | " + " | ".join(short(m) for m in models)
                  + "".join(f" | Δ {short(m)}" for m in models[1:]) + " |",
                  "|" + "---|" * (3 + 2 * len(models) - 1)]
        for row in ov["thirds"]:
            lo, hi = row["overlap_range"]
            cells = [row["third"], str(row["n_queries"]), "-" if lo is None else f"{lo:.2f}-{hi:.2f}"]
            cells += [f"{row['ndcg_at_10'][m]:.2f}" for m in models]
            cells += [f"{row['ndcg_at_10'][m] - row['ndcg_at_10'][first]:+.2f}" for m in models[1:]]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *task_versions_table(out, short)]
    sources = sorted({t["source"] for t in out["tasks"]})
    lines += ["", "Data: " + ", ".join(sources), ""]
    return "\n".join(lines)


def task_versions_table(out: dict, short) -> list:
    """results.md's "Tasks" section: for each task what scored it (scored_by_phrase), its data (mteb's dataset id at its
    revision, or the local folder by its content hash), which of mteb's ids it is (task_variant: an original id and
    its cleaned revision do not compare) and the mteb version each model's result file names, so that two result
    pages can be checked to compare like with like."""
    lines = ["## Tasks: what scored each, on which data, which version", "",
             "| task | scored by | data (revision) | mteb's ids | mteb version of the result |",
             "|---|---|---|---|---|"]
    for t in out["tasks"]:
        ds = t.get("dataset") or {}
        mteb_data = f"{ds.get('path')} @ {str(ds.get('revision'))[:12]}" if ds else ""
        if t.get("scored_by") in ("stock", "own"):
            data = f"local folder `{Path(t['source']).name}` (data_{t.get('data_hash')})"
            data += f", in place of {mteb_data}" if mteb_data else ""
        else:
            data = mteb_data
        versions = {}
        for m in out["models"]:
            versions.setdefault(out["results"][m][t["name"]].get("mteb_version") or "?", []).append(short(m))
        said = ", ".join(v if len(versions) == 1 else f"{v} ({', '.join(ms)})" for v, ms in versions.items())
        lines.append(f"| {t['name']} | {scored_by_phrase(t)} | {data} | {t.get('variant') or 'not an mteb task'} | "
                     f"{said} |")
    return lines


def plot_bars(summ: dict, models: Sequence[str], path: Path):
    """Grouped bars: each task and category average, one bar per model (the PNG next to the table)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summ["per_task"][models[0]])
    groups = tasks + [f"{c} avg" for c in summ["categories"]] + ["average"]
    vals = {m: [summ["per_task"][m][t] for t in tasks] + [summ["per_category"][m][c] for c in summ["categories"]]
            + [summ["average"][m]] for m in models}
    x = np.arange(len(groups))
    w = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(max(6, 0.75 * len(groups) * max(1, len(models) / 2) + 2), 4.2))
    for i, m in enumerate(models):
        bars = ax.bar(x + (i - (len(models) - 1) / 2) * w, vals[m], w, label=column_labels(models)[m])
        ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
    ax.set_xticks(x, groups, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("score x100 (mteb main score)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8)
    ax.set_title("per task, per category and average")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130)
    plt.close(fig)


REPORT_FILES = ("results.md", "results.json", "results.png")  # what evaluate.py writes in --output_dir


def write_report(out: dict, output_dir: Path, overlap_tasks: Sequence[str] = (), overwrite: bool = False) -> dict:
    """results.md, results.json and results.png in output_dir (refused if present, unless overwrite), each replaced
    in one rename (common.atomic_write)."""
    existing = [n for n in REPORT_FILES if (output_dir / n).exists()]
    if existing and not overwrite:
        raise UserError(f"{output_dir} already has {existing}; pass --overwrite (the results folder keeps "
                        "finished tasks)")
    output_dir.mkdir(parents=True, exist_ok=True)
    summ = summarize(out)
    overlaps = [overlap_analysis(out, t) for t in overlap_tasks]
    atomic_write(output_dir / "results.md", to_markdown(out, summ, overlaps))
    slim = {m: {t: {k: v for k, v in r.items() if k != "per_query"} for t, r in rs.items()}
            for m, rs in out["results"].items()}
    atomic_write(output_dir / "results.json", json.dumps(
        {"models": out["models"], "tasks": out["tasks"], "summary": summ, "overlap_analysis": overlaps,
         "results_dir": out.get("results_dir"), "model_meta": out.get("model_meta", {}), "sample": out.get("sample"),
         "contracts": out.get("contracts", {}), "contract_differences": contract_differences(out),
         "score_as": out.get("score_as"), "results": slim}, indent=1))
    plot_bars(summ, out["models"], output_dir / "results.png")
    return {"summary": summ, "overlap_analysis": overlaps}


# ---------------------------------------------------------------------------------------------------
# 6. Command line
# ---------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", required=True,
                   help="model folders (train.py output), hub ids or 'all-MiniLM-L6-v2'; the first is the "
                        "baseline every other model's difference is taken to")
    p.add_argument("--benchmark", default=None,
                   help=f"mteb benchmark by name (online); default {DEFAULT_BENCHMARK!r} when neither --tasks "
                        "nor --local_tasks is given")
    p.add_argument("--tasks", nargs="*", default=[], help="mteb task names, e.g. SciFact STSBenchmark (online)")
    p.add_argument("--local_tasks", nargs="*", default=[],
                   help="local folders, optionally NAME=DIR (offline; format detected): under an mteb task's name "
                        "(given, or said by the folder) the stock task scored on the folder's data; under any other "
                        "(given, or the folder's own) the user's own task, scored by mteb's evaluator of its type")
    p.add_argument("--output_dir", default="outputs/eval", help="where results.md/.json/.png go")
    p.add_argument("--overwrite", action="store_true", help="replace existing results.* in --output_dir")
    p.add_argument("--results_dir", default=None,
                   help="mteb's results folder (mteb.ResultCache): results/<model>/<revision>/<task>.json, read by "
                        "mteb.load_results / ResultCache.load_results; reruns skip finished tasks. Default: mteb's "
                        "own ($MTEB_CACHE, here .cache/mteb)")
    p.add_argument("--rerun", action="store_true", help="run every task again, replacing its result in --results_dir")
    p.add_argument("--prefixes", choices=("auto", "e5", "none"), default="auto",
                   help="text prefixes, as train.py / finetune.py take them: auto = the model's own (its "
                        "sentence-transformers prompts, else E5's 'query: ' / 'passage: ' when it is an E5 model, "
                        "else none: common.model_prompts); e5 / none force them")
    p.add_argument("--query_prefix", default=None,
                   help="the query prefix as a string, over --prefixes (also used for symmetric tasks)")
    p.add_argument("--passage_prefix", default=None,
                   help="the passage (retrieval document) prefix as a string, over --prefixes")
    p.add_argument("--overlap_analysis", nargs="*", default=None, metavar="TASK",
                   help="the paper's overlap analysis (nDCG@10 per third of queries by word overlap); no "
                        "names = every retrieval task")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="quick check: at most this many queries / pairs / test texts per task (seeded sample); a "
                        "model card gets these scores labelled as the sample they are, apart from full tasks'")
    p.add_argument("--corpus_limit", type=positive_int, default=None,
                   help="with --limit: corpus size (relevant documents always kept); default 10 x --limit")
    p.add_argument("--seed", type=int, default=0, help="seed of the --limit sample")
    p.add_argument("--batch_size", type=positive_int, default=64, help="texts per forward pass")
    p.add_argument("--max_length", type=positive_int, default=None,
                   help="token limit; default: the one the model states (sentence-transformers' "
                        "max_seq_length), else 512, at most its position table (modeling_xprt.max_seq_length)")
    p.add_argument("--score_as", default=None, metavar="MODEL",
                   help="score every model with MODEL's pooling, normalisation, similarity function, prefixes and "
                        "length limit (e.g. the trained model, so that its start is scored the same way and the Δ is "
                        "training's alone); filed as an mteb experiment. Without it each model is scored as it is "
                        "used, and the report says where their scoring differs")
    p.add_argument("--no_card_update", action="store_true",
                   help="leave the model card (README.md) of a scored xprt folder as it is (a folder you may not "
                        "write); by default the scores are written into it: full tasks' into its Evaluation section "
                        "and model-index, local copies' and --limit samples' labelled, in 'Scores on local data'")
    p.add_argument("--submission", default=None, metavar="DIR",
                   help="also write the folder an mteb leaderboard submission needs: each model's task results in "
                        "mteb's ResultCache layout (results/<org__name>/<revision>/<Task>.json, model_meta.json, "
                        "run_settings.jsonl), its ModelMeta as the Python entry a ModelMeta PR adds, and README.md "
                        "saying what is still missing; only mteb tasks scored on mteb's data, whole, with the "
                        "model's own settings go in. The PRs are not made (README.md says how)")
    p.add_argument("--public_training_code", default=None, metavar="URL",
                   help="the public training code, for each model's ModelMeta (e.g. this repository at its commit); "
                        "a submission lists it as missing without it")
    p.add_argument("--public_training_data", default=None, metavar="URL",
                   help="the public training data, for each model's ModelMeta; a submission lists it as missing "
                        "without it")
    p.add_argument("--training_datasets", nargs="*", default=None, metavar="TASK",
                   help="mteb tasks whose data trained the models beyond what their run records name (given with no "
                        "name: none); needed when a stage's records are gone (a folder copied without its run.json)")
    p.add_argument("--adapted_from", default=None, metavar="ORG/NAME",
                   help="the Hub model the models were trained from, for their ModelMeta, when their records cannot "
                        "tell (a start given as a local folder whose files name none)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: bf16 (fp16 before Ampere) on GPU, fp32 on CPU")
    p.add_argument("--trust_remote_code", action="store_true", help="allow custom model code from the hub")
    args = p.parse_args(argv)
    if not args.tasks and not args.local_tasks and not args.benchmark:
        args.benchmark = DEFAULT_BENCHMARK
    for name in args.training_datasets or []:  # mteb's names, or the zero-shot figure would count nothing
        mteb_task(name, "--training_datasets")
    return args


def public_task_flags(argv: Sequence[str]) -> list:
    """argv with each --local_tasks folder as DIR (NAME=DIR keeps its NAME), for the command a submission records:
    model_folder.public_command hides the other local paths."""
    words, flag = [], ""
    for word in map(str, argv):
        flag = word if word.startswith("--") else flag
        if flag == "--local_tasks" and word != flag:
            name = task_spec(word)[0]
            word = f"{name}=DIR" if name else "DIR"
        words.append(word)
    return words


def stop_account(results_dir: str, since: float, rerun: bool) -> str:
    """What a stopped evaluation keeps, and the command that continues (common.on_stop): the task results mteb
    wrote into --results_dir since `since` (each as its task finished), which a rerun reads instead of scoring."""
    done = sorted({p.stem for p in Path(results_dir).rglob("*.json")
                   if p.name != "model_meta.json" and p.stat().st_mtime >= since})
    return (f"kept: {len(done)} task result(s) scored in this run ({', '.join(done) or 'none'}) in {results_dir}; "
            f"the same command{' without --rerun' if rerun else ''} reads them back and scores the rest")


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for name in args.models:  # a model that is not here, before any task or model loads
        check_model_folder(name, "--models", args.trust_remote_code)
    if args.score_as:
        check_model_folder(args.score_as, "--score_as", args.trust_remote_code)
    out_dir = Path(args.output_dir)
    # refused before hours of encoding, not after: inputs inside the folder, a stranger's results.*, earlier
    # results without --overwrite, a folder that cannot be written (common.claim_output_folder)
    inputs = local_inputs(models=args.models, local_tasks=[task_spec(t)[1] for t in args.local_tasks],
                          score_as=args.score_as)
    existing = claim_output_folder(out_dir, "evaluate.py", REPORT_FILES, inputs)
    if existing and not args.overwrite:
        raise UserError(f"{out_dir} already has {[p.name for p in existing]}; pass --overwrite (finished tasks come "
                        "from the results folder)")
    if args.submission:
        check_submission_folder(Path(args.submission), args.overwrite, inputs)
    results_dir = args.results_dir or str(mteb.ResultCache().cache_path)
    update_cards = not args.score_as and not args.no_card_update
    check_outputs_writable(args.models if update_cards else [], results_dir)
    record_outputs(out_dir, "evaluate.py", REPORT_FILES)
    started = time.time()
    on_stop(lambda: stop_account(results_dir, started, args.rerun))  # a stop signal's line: the scored tasks
    out = run_evaluation(args.models, tasks=args.tasks, local_tasks=args.local_tasks, benchmark=args.benchmark,
                         limit=args.limit, corpus_limit=args.corpus_limit, seed=args.seed,
                         prefixes=args.prefixes, batch_size=args.batch_size, max_length=args.max_length,
                         device=args.device, dtype=args.dtype, query_prefix=args.query_prefix,
                         passage_prefix=args.passage_prefix,
                         results_dir=results_dir, rerun=args.rerun,
                         trust_remote_code=args.trust_remote_code, update_cards=update_cards,
                         score_as=args.score_as, model_meta_given={
                             k: getattr(args, k) for k in ("public_training_code", "public_training_data",
                                                           "training_datasets", "adapted_from")},
                          mock_run=bool(args.submission))
    retrieval = [t["name"] for t in out["tasks"] if t["type"] == "Retrieval"]
    overlap = [] if args.overlap_analysis is None else (args.overlap_analysis or retrieval)
    bad = [t for t in overlap if t not in retrieval]
    if bad:
        raise UserError(f"--overlap_analysis needs retrieval tasks that were run; not: {bad}")
    rep = write_report(out, out_dir, overlap, overwrite=args.overwrite)
    print((out_dir / "results.md").read_text())
    if args.submission:
        # what a reviewer of the results asks for when scores disagree; local paths left out (public_command shows
        # them as placeholders), as on a model card
        paths = ("models", "output_dir", "results_dir", "submission", "local_tasks", "score_as")
        run = {"code": code_revision(),
               "command": public_command("evaluate.py", public_task_flags(sys.argv[1:] if argv is None else argv)),
               "settings": {"batch_size": args.batch_size, "mteb_version": mteb.__version__,
                            "flags": {k: v for k, v in sorted(vars(args).items()) if k not in paths}}}
        rep["submission"] = write_submission(out, Path(args.submission), run)
        for m in rep["submission"]["models"].values():
            print(f"submission {args.submission}: {m['name']} at {m['revision']}: {len(m['tasks'])} task result(s)"
                  + "".join(f"\n  missing: {x}" for x in m["missing"]), flush=True)
        print(f"submission {args.submission}: the PRs are not made here; {args.submission}/README.md says how",
              flush=True)
    return rep


if __name__ == "__main__":
    run_script(main)
