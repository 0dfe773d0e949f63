"""
The flag a user most likely meant by one the parser does not know (common.ArgumentParser's hint).
Imported only when a flag is refused, so no run pays for it.

A typed flag is read as words: its chunks (split at "_" and "-") are cut into pieces, each standing
for one word of a real flag, in order: its prefix ("--out" output), its initials ("--lr" learning
rate, "--wd" weight decay), its letters in order ("--ckpt" checkpoint), or a near spelling
("--learnig"); words may be left out ("--num_epochs" num_train_epochs). The real flag that
accounts for most typed letters wins, then the one with most words covered ("--lr": learning_rate,
2 words, over lr_scheduler_type's 1). Other trainers' spellings (HF Trainer, sentence-transformers:
--lr, --bs, --epochs, --model) go first to the flag they mean here, where the parser has it.
"""

from __future__ import annotations

import difflib
import functools
import re

# other tools' spellings -> the flag meant here (used only where the parser has that flag)
ALIASES = {
    "lr": "learning_rate", "bs": "per_device_train_batch_size",
    "batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
    "epochs": "num_train_epochs", "max_steps": "max_train_steps", "steps": "max_train_steps",
    "model": "model_name_or_path", "model_name": "model_name_or_path",
    "model_path": "model_name_or_path", "temperature": "tau", "temp": "tau",
    "fp16": "mixed_precision", "bf16": "mixed_precision", "output": "output_dir",
    "out": "output_dir",
    "resume": "resume_from_checkpoint", "workers": "dataloader_num_workers",
    "num_workers": "dataloader_num_workers", "grad_accum": "gradient_accumulation_steps",
}


def _words(name: str) -> list:
    return [w for w in re.split(r"[_\-]+", name.lower().lstrip("-")) if w]


def _in_order(short: str, long: str) -> bool:
    """Whether `short` (3 letters or more) is `long`'s first letter, then others of it in order."""
    rest = iter(long[1:])
    return len(short) >= 3 and short[0] == long[0] and all(c in rest for c in short[1:])


def _letters_read(piece: str, word: str, whole_chunk: bool) -> int:
    """How many of a typed piece's letters stand for a word (0: it does not). All of them for its
    prefix; one fewer (a prefix is the likelier reading) for its letters in order ("ckpt"
    checkpoint) or, for a whole typed chunk, where the word abbreviates it ("documents" docs); else,
    for a whole chunk, the letters shared with a spelling at least 80% alike ("learnig")."""
    if word.startswith(piece):
        return len(piece)
    if _in_order(piece, word) or (whole_chunk and _in_order(word, piece)):
        return len(piece) - 1
    if whole_chunk and len(piece) >= 4:
        near = difflib.SequenceMatcher(None, piece, word)
        if near.ratio() >= 0.8:
            return sum(block.size for block in near.get_matching_blocks())
    return 0


def _fit(typed: str, words: tuple) -> tuple:
    """(typed letters accounted for, words covered, whether its first piece reads the first word)
    of the best reading of `typed` as pieces of `words` in order."""
    chunks = _words(typed)
    text, ends = "".join(chunks), set()
    for c in chunks:
        ends.add(len(c) + max(ends | {0}))

    @functools.lru_cache(maxsize=None)
    def best(pos: int, wi: int) -> tuple:
        at_chunk = pos == 0 or pos in ends
        if pos == len(text) or wi == len(words):  # the chunks left unread, but never half of one
            return (0, 0, 0) if at_chunk else (-len(text), 0, 0)
        # leave the word out, or (from a chunk's start) the whole chunk unread
        nxt = min(e for e in ends if e > pos)
        options = [best(pos, wi + 1)] + ([best(nxt, wi)] if at_chunk else [])
        for end in range(pos + 1, nxt + 1):
            read = _letters_read(text[pos:end], words[wi], at_chunk and end in ends)
            if read:
                letters, covered, _ = best(end, wi + 1)
                options.append((letters + read, covered + 1, int(pos == wi == 0)))
        return max(options)

    return best(0, 0)


def likely_flags(typed: str, flags) -> list:
    """The real flags (of `flags`, "--name"s) `typed` most likely meant (ties all named, at most 3);
    [] when none is near. E.g. "--lr" -> ["--learning_rate"]; "--outdir" -> ["--output_dir"]."""
    flags = [f for f in flags if f.startswith("--") and f != "--help"]
    key = "_".join(_words(typed))
    if f"--{ALIASES.get(key)}" in flags:
        return [f"--{ALIASES[key]}"]
    typed_letters = len(key.replace("_", ""))
    if not typed_letters:
        return []
    scored = []
    for f in flags:
        words = tuple(_words(f))
        letters, covered, starts = _fit(key, words)
        if letters / typed_letters >= 0.5:
            # most typed letters read, most words covered, a flag that starts as typed, the largest
            # share of its words covered, the closest spelling
            closeness = difflib.SequenceMatcher(None, key, "_".join(words)).ratio()
            scored.append(((letters, covered, starts, covered / len(words), closeness), f))
    if not scored:
        return difflib.get_close_matches(typed, flags, n=1, cutoff=0.75)
    top = max(s for s, _ in scored)
    return sorted(f for s, f in scored if s == top)[:3]


def hinted(message: str, flags) -> str:
    """argparse's "unrecognized arguments: ..." with each unknown flag's likeliest meaning."""
    hints = []
    for arg in message.split(": ", 1)[1].split():
        flag = arg.split("=")[0]
        near = likely_flags(flag, flags) if re.match(r"--?[a-zA-Z]", flag) else []  # not a value: "1e-5"
        hints += [f"{flag}: did you mean {' or '.join(near)}?"] if near else []
    return message + (f" ({'; '.join(hints)})" if hints else "")
