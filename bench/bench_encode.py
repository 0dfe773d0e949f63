"""
Encoding throughput of embed.embed_texts (the hand-written batch embedder of select_groups.py,
finetune.py's mining and the scores during training) against sentence-transformers' `encode`, same run. It decided
evaluate.py's encoder: sentence-transformers (with the model's own pooling and prompts) unless the hand-written path
is >= 1.10x faster.

Same model, same texts, same batch size, same max length, same device and dtype; both produce
L2-normalised mean-pooled vectors, and the script checks they agree (cosine > 0.999 per text) before
it reports speed. Each method runs `--repeats` times, interleaved so that load from other processes
hits both alike; the best time of each counts (the usual micro-benchmark convention).

From the repository root (it imports the repository's modules from there):

    python -m bench.bench_encode                          # bundled data/eval texts, all-MiniLM-L6-v2
    python -m bench.bench_encode --data ../shared/data --num_texts 2000 --batch_size 64
    python -m bench.bench_encode --toy                    # seconds: 16 texts

Where the speed comes from (embed.embed_texts' docstring): one tokenizer call for the whole list,
batches sorted by token count (sentence-transformers sorts by character count), no attention mask
when a batch has no padding (SDPA's unmasked path), inference_mode. The tokens each ordering pads its batches to
are printed: the work the sorting saves, independent of the machine's load. On a shared machine the CPU time of
the process (all its threads) is printed beside the wall time: other jobs move it less. Last line: `ratio: <x>`
(sentence-transformers time / ours, best of each; > 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def load_texts(data: Path, n: int, seed: int) -> list[str]:
    """A mix like an evaluation run's: retrieval queries and documents, STS sentences, Banking77 texts.

    Reads whichever of these exist under `data` (the bundled data/eval or ../shared/data layout).
    """
    texts: list[str] = []
    for sub in ("scifact", "scifact_sample"):
        d = data / sub
        if (d / "corpus.jsonl").is_file():
            with open(d / "corpus.jsonl", encoding="utf-8") as f:
                texts += [(r.get("title", "") + " " + r["text"]).strip() for r in map(json.loads, f)]
            with open(d / "queries.jsonl", encoding="utf-8") as f:
                texts += [r["text"] for r in map(json.loads, f)]
    for sub in ("stsbenchmark",):
        f = data / sub / "sts-test.csv"
        if f.is_file():
            with open(f, encoding="utf-8") as fh:
                for r in csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE):
                    texts += [r[5], r[6]]
    f = data / "banking77" / "test.csv"
    if f.is_file():
        with open(f, encoding="utf-8", newline="") as fh:
            texts += [r[0] for r in list(csv.reader(fh))[1:]]
    if not texts:
        raise SystemExit(f"no texts found under {data} (expected scifact/, stsbenchmark/ or banking77/)")
    rng = random.Random(seed)
    return rng.sample(texts, min(n, len(texts)))


def main(argv=None):
    from bench import add_toy_flag, toy_sized

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="model folder, hub id or 'all-MiniLM-L6-v2'")
    p.add_argument("--data", default=str(ROOT / "data" / "eval"),
                   help="folder with scifact/, stsbenchmark/, banking77/")
    p.add_argument("--num_texts", type=int, default=1024, help="texts to encode (a seeded sample of the mix)")
    p.add_argument("--batch_size", type=int, default=64, help="batch size, the same for both")
    p.add_argument("--max_length", type=int, default=256, help="token limit, the same for both (MiniLM: 256)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (best counts)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: bf16/fp16 on GPU, fp32 on CPU; the same for both")
    p.add_argument("--seed", type=int, default=0, help="seed of the text sample")
    add_toy_flag(p, "16 texts of at most 32 tokens, batches of 8, 1 repeat")
    args = toy_sized(p.parse_args(argv), num_texts=16, max_length=32, batch_size=8, repeats=1)
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from plumbing.embed import embed_texts
    from plumbing.common import pick_device_and_dtype, resolve_model_path

    path = resolve_model_path(args.model)
    device, dtype = pick_device_and_dtype(args.device, args.dtype)
    texts = load_texts(Path(args.data), args.num_texts, args.seed)

    st = SentenceTransformer(path, device=str(device), model_kwargs={"dtype": dtype})
    st.max_seq_length = args.max_length
    tok = AutoTokenizer.from_pretrained(path)
    ours = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    n_tok = sum(min(len(x), args.max_length) for x in tok(texts, add_special_tokens=True)["input_ids"])
    print(f"model {args.model} on {device} ({dtype}), {len(texts)} texts, {n_tok} tokens, batch {args.batch_size}, "
          f"max_length {args.max_length}, torch threads {torch.get_num_threads()}")
    lens = [min(len(x), args.max_length) for x in tok(texts, add_special_tokens=True)["input_ids"]]

    def padded(order):  # tokens processed when batches of `order` pad to their longest text
        return sum(max(lens[i] for i in order[b:b + args.batch_size]) * len(order[b:b + args.batch_size])
                   for b in range(0, len(order), args.batch_size))

    ours_pad = padded(sorted(range(len(texts)), key=lambda i: -lens[i]))  # embed_texts: by token count
    st_pad = padded(sorted(range(len(texts)), key=lambda i: -len(texts[i])))  # sentence-transformers: by characters
    print(f"padded tokens: sentence-transformers {st_pad}, ours {ours_pad} (ratio {st_pad / ours_pad:.3f})")

    def run_st():
        return st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True,
                         show_progress_bar=False)

    def run_ours():
        return embed_texts(ours, tok, texts, batch_size=args.batch_size, max_length=args.max_length).numpy()

    cpu = {"st": [], "ours": []}

    def timed(fn, key=None):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if key:
            cpu[key].append(time.process_time() - c0)
        return time.perf_counter() - t0, out

    # warm-up (allocator, kernels, tokenizer caches), and the equivalence check
    _, a = timed(run_st)
    _, b = timed(run_ours)
    cos = (np.asarray(a, dtype=np.float32) * b).sum(axis=1)
    tol = 0.999 if dtype == torch.float32 else 0.99
    print(f"agreement: min cosine(ours, sentence-transformers) = {cos.min():.6f}")
    if cos.min() < tol:
        raise SystemExit(f"the two encoders disagree (min cosine {cos.min():.4f} < {tol}); speed not reported")

    t_st, t_ours = [], []
    for r in range(args.repeats):  # interleaved
        t_st.append(timed(run_st, "st")[0])
        t_ours.append(timed(run_ours, "ours")[0])
        print(f"repeat {r + 1}: sentence-transformers {t_st[-1]:.2f} s (CPU {cpu['st'][-1]:.1f} s), "
              f"ours {t_ours[-1]:.2f} s (CPU {cpu['ours'][-1]:.1f} s)")
    best_st, best_ours = min(t_st), min(t_ours)
    # on a shared machine the spread is large; the median and total ratios are printed for context
    print(f"median ratio {np.median(t_st) / np.median(t_ours):.3f}, total-time ratio {sum(t_st) / sum(t_ours):.3f}")
    # CPU time of this process (all its threads): less sensitive than wall time to other jobs on a shared machine
    if device.type == "cpu":
        print(f"CPU-time ratio (best) {min(cpu['st']) / min(cpu['ours']):.3f}, "
              f"(median) {np.median(cpu['st']) / np.median(cpu['ours']):.3f}")
    print(f"sentence-transformers encode: {len(texts) / best_st:.1f} texts/s ({n_tok / best_st:.0f} tokens/s)")
    print(f"embed.embed_texts:    {len(texts) / best_ours:.1f} texts/s ({n_tok / best_ours:.0f} tokens/s)")
    print(f"ratio: {best_st / best_ours:.3f}")


if __name__ == "__main__":
    main()
