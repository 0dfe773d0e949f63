"""
Benchmark of select_groups.py, measured in one run:

1. time: the whole selection (read, IDF pass, split, embed, TF-IDF, rank, write parquet + stats)
   against the embedding pass alone (embed_texts on the same passages, same model and batch size).
   Goal: <= 1.10, i.e. everything around the encoder costs at most 10% more. Runs alternate
   (E S E S ...) and medians are compared, because the machine may be shared.
2. memory: peak resident memory of a selection run at 1x and 10x the documents, each in its own
   process. Goal: growth <= 1.3x (documents are streamed in chunks of --chunk_docs). A tiny random
   BERT with the real tokenizer is the default encoder here: the model's memory is the same at 1x and
   10x, and a small one lets the 10x run finish in a minute on CPU.

From the repository root (it imports the repository's modules from there):

    python -m bench.bench_select       # defaults: bundled data/docs.jsonl, all-MiniLM-L6-v2
    python -m bench.bench_select --toy  # seconds: 2 documents, tiny encoder, 4 -> 8 documents for memory
    python -m bench.bench_select --executor local --tasks 2   # the same, selection as datatrove stages

Last line: `ratio: <selection CPU time / embedding CPU time>` (wall-time ratio printed above it).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from bench import ROOT, add_toy_flag, build_tiny, toy_sized  # importing bench also sets the offline defaults


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default=os.path.join(ROOT, "data", "docs.jsonl"),
                   help="JSONL documents (id, text).")
    p.add_argument("--num_docs", type=int, default=10, help="Documents for the timing part.")
    p.add_argument("--repeats", type=int, default=3, help="Timed runs of each kind (alternating).")
    p.add_argument("--model_name_or_path", default="all-MiniLM-L6-v2",
                   help="Selection encoder for the timing part ('tiny': as --memory_model).")
    p.add_argument("--batch_size", type=int, default=64, help="Embedding batch size (both sides).")
    p.add_argument("--memory_docs", type=int, default=100,
                   help="Documents of the 1x memory run (the input is repeated with new ids if needed).")
    p.add_argument("--memory_scale", type=int, default=10,
                   help="The large memory run reads this many times --memory_docs.")
    p.add_argument("--memory_model", default="tiny",
                   help="'tiny' (random 2-layer BERT, MiniLM tokenizer) or a model name / folder.")
    p.add_argument("--chunk_docs", type=int, default=25,
                   help="select_groups.py --chunk_docs in the memory runs: 4 chunks at 1x, 40 at 10x.")
    p.add_argument("--executor", choices=("local",), default=None,
                   help="Run the selections as datatrove stages (select_groups_datatrove.py --executor local): the "
                        "timed selection and both memory runs, its tasks run one after another in the process "
                        "(workers 1).")
    p.add_argument("--tasks", type=int, default=1,
                   help="--executor: tasks of the stages; the documents are written as this many files.")
    add_toy_flag(p, "2 documents, 1 repeat, the tiny encoder, memory at 4 and 8 documents")
    p.add_argument("--_child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return toy_sized(p.parse_args(argv), num_docs=2, repeats=1, model_name_or_path="tiny", memory_docs=4,
                     memory_scale=2, chunk_docs=2)


def read_docs(path, n):
    docs = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            docs.append(json.loads(line))
    out = []
    for k in range(n):  # repeat with new ids when more documents are asked than the file has
        d = docs[k % len(docs)]
        out.append({"id": f"{d['id']}#{k // len(docs)}", "text": d["text"]})
    return out


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(d) + "\n" for d in docs)
    return path


def write_input(path, docs, files: int):
    """The documents as one JSONL file, or as a folder of `files` files (datatrove tasks deal whole files)."""
    if files <= 1:
        return write_jsonl(path + ".jsonl", docs)
    os.makedirs(path, exist_ok=True)
    for f in range(files):
        write_jsonl(os.path.join(path, f"part-{f:03d}.jsonl"), docs[f::files])
    return path


def engine_flags(args) -> list:
    """The flags of the engine measured: none (select_groups.py's own processes), or datatrove's local executor
    (select_groups_datatrove.py's)."""
    return ["--executor", "local", "--tasks", str(args.tasks), "--workers", "1"] if args.executor else []


def selection_main(argv):
    """The command the flags name: select_groups_datatrove.py with --executor, else select_groups.py."""
    if "--executor" in argv:
        import select_groups_datatrove

        return select_groups_datatrove.main(argv)
    import select_groups

    return select_groups.main(argv)


def child(argv):
    """Run one selection in this (fresh) process and report its peak resident memory."""
    selection_main(argv)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes
    print(json.dumps({"peak_rss_mb": peak_mb}))


def main(argv=None):
    args = parse_args(argv)
    if args._child is not None:
        return child(args._child)
    import torch
    from transformers import AutoModel, AutoTokenizer

    import select_groups as sg
    from plumbing.embed import embed_texts
    from plumbing.common import resolve_model_path
    from modeling_xprt import max_seq_length
    from plumbing.model_folder import read_max_seq_length

    tmp = tempfile.mkdtemp(prefix="bench-select-")
    # ---- 1. time: selection vs the embedding pass alone, same documents, same process ----
    tiny = None
    if "tiny" in (args.model_name_or_path, args.memory_model):
        tiny = build_tiny(os.path.join(tmp, "tiny"))
    if args.model_name_or_path == "tiny":
        args.model_name_or_path = tiny
    docs = read_docs(args.input, args.num_docs)
    inp = write_input(os.path.join(tmp, "time"), docs, args.tasks if args.executor else 1)
    path = resolve_model_path(args.model_name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    # the settings and the length limit select_groups.py uses, so both sides embed the same token ids
    sel = sg.Selection.from_args(sg.parse_args(["--input", inp, "--output_dir", "x",
                                                "--model_name_or_path", args.model_name_or_path]))
    max_length = max_seq_length(model.config, read_max_seq_length(path))
    passages = [p for ps in sg.split_passages([d["text"] for d in docs], tok, sel.passage_tokens,
                                              sel.min_passage_tokens) for p in ps]
    n_tokens = sum(len(ids) for ids in tok([sel.passage_prefix + p for p in passages], truncation=True,
                                           max_length=max_length)["input_ids"])
    engine = f"datatrove local executor, {args.tasks} task(s)" if args.executor else "select_groups.py's own"
    print(f"timing: {len(docs)} documents, {len(passages)} passages ({n_tokens:,} tokens), {args.model_name_or_path}, "
          f"{torch.get_num_threads()} threads; selection: {engine}")
    embed_texts(model, tok, passages[:64], batch_size=args.batch_size, max_length=max_length,
                prefix=sel.passage_prefix)  # warm-up

    # Wall time and this process's CPU time (all threads). On a shared machine wall time also counts
    # waiting for other jobs, so the CPU-time ratio is the one reported on the last line.
    def timed(fn):
        w, c = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w, time.process_time() - c

    def embedding_only():
        embed_texts(model, tok, passages, batch_size=args.batch_size, max_length=max_length, prefix=sel.passage_prefix)

    def selection(i):
        selection_main(["--input", inp, "--output_dir", os.path.join(tmp, f"sel{i}"), "--model_name_or_path",
                        args.model_name_or_path, "--batch_size", str(args.batch_size), *engine_flags(args)])

    # warm-up selection: the first call pays one-time imports (scikit-learn, scipy, pyarrow), as the
    # embedding warm-up above pays the first-batch costs; neither belongs to a corpus-sized run
    warm = write_jsonl(os.path.join(tmp, "warm.jsonl"), docs[:2])
    selection_main(["--input", warm, "--output_dir", os.path.join(tmp, "warm"), "--model_name_or_path",
                    args.model_name_or_path, *(["--executor", "local"] if args.executor else [])])
    emb, whole = [], []
    for i in range(args.repeats):
        emb.append(timed(embedding_only))
        whole.append(timed(lambda: selection(i)))
    emb.append(timed(embedding_only))
    med = lambda xs, k: statistics.median(x[k] for x in xs)
    for name, xs in (("embedding pass alone", emb), ("whole selection", whole)):
        print(f"{name:21s} wall {', '.join(f'{x[0]:.1f}' for x in xs)} s (median {med(xs, 0):.1f}); "
              f"CPU {', '.join(f'{x[1]:.1f}' for x in xs)} s (median {med(xs, 1):.1f}); "
              f"{len(passages) / med(xs, 0):,.0f} passages/s, {n_tokens / med(xs, 0):,.0f} tokens/s (wall)")
    wall_ratio, ratio = med(whole, 0) / med(emb, 0), med(whole, 1) / med(emb, 1)

    # ---- 2. memory at 1x and 10x the documents, each in a fresh process ----
    mem_model = tiny if args.memory_model == "tiny" else args.memory_model
    peaks = {}
    for scale in (1, args.memory_scale):
        n = args.memory_docs * scale
        f = write_input(os.path.join(tmp, f"mem{scale}"), read_docs(args.input, n), args.tasks if args.executor else 1)
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "bench.bench_select", "--_child", "--input", f,
               "--output_dir", os.path.join(tmp, f"mem{scale}-out"), "--model_name_or_path", mem_model,
               "--chunk_docs", str(args.chunk_docs), *engine_flags(args)]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            raise RuntimeError(res.stderr[-3000:])
        peaks[scale] = json.loads(res.stdout.strip().splitlines()[-1])["peak_rss_mb"]
        groups = json.load(open(os.path.join(tmp, f"mem{scale}-out", "stats.json")))["groups"]
        print(f"memory {scale:>2}x: {n:,} documents, {groups:,} groups, peak RSS {peaks[scale]:.0f} MB "
              f"({time.perf_counter() - t:.0f} s, encoder {args.memory_model}, --chunk_docs {args.chunk_docs})")
    growth = peaks[args.memory_scale] / peaks[1]
    print(f"memory growth {args.memory_scale}x docs: {growth:.3f}x (goal <= 1.3)")
    print(f"time ratio selection / embedding: wall {wall_ratio:.3f}, CPU {ratio:.3f} (goal <= 1.10)")
    print(f"ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
