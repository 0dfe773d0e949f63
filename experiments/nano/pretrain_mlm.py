"""Nano BERT: a small masked-language model pre-trained here, the start of the from-BERT experiment shrunk.

The xPRT paper's clearest comparison starts from a model that only knows masked-language modelling (BERT-base;
100K documents, six epochs). No MLM-only checkpoint can be downloaded here, so this script makes one, with the
standard transformers recipe (run_mlm.py): a WordPiece vocabulary trained on the corpus, texts concatenated and cut
into fixed blocks, 15% dynamic masking (80/10/10) by DataCollatorForLanguageModeling, AdamW with linear warmup and
decay, under the Trainer.

Why an own vocabulary: with MiniLM's 30,522 words the vocabulary projection (hidden x 30,522 per masked token, and per
fill-in target in xPRT) would dominate a model this small; 8,192 WordPiece entries trained on the same text cover it
with few unknown words. The tokenizer keeps BERT's normalisation and special tokens (it is trained from MiniLM's
tokenizer with `train_new_from_iterator`), so every script of the repository reads it as any BERT tokenizer.

Positions: blocks are `--block_size` tokens, and only those positions are trained; the folder's
sentence_bert_config.json and tokenizer limit encoding to that length, so evaluation never reads untrained positions.

Output (`--output_dir`): a BertForMaskedLM folder (safetensors, MLM head included: train.py loads it as is),
tokenizer, sentence_bert_config.json, mlm_log.jsonl (train loss per logging step, held-out loss at the end),
mlm_loss_curve.png, mlm_stats.json. `--causal qwen2` makes a causal language model of the same sizes the same way
(next-token loss; the files keep their names): the language model Revela trains through, where none can be fetched.

    python experiments/nano/pretrain_mlm.py \\
        --inputs ../shared/data/{wikipedia_sample,fineweb_legal_sample,c4_sample}/docs.jsonl \\
        --output_dir outputs/nano/mlm --max_steps 800
"""
import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's modules sit two folders up

from plumbing.common import (UserError, atomic_path, atomic_write, claim_output_folder,  # noqa: E402
                             local_inputs, record_outputs,
                             remove_outputs, resolve_model_path, run_script)


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--inputs", nargs="+", required=True, help="JSONL files of documents with a 'text' field")
    p.add_argument("--output_dir", required=True, help="folder for the model, tokenizer, log and curve")
    p.add_argument("--overwrite", action="store_true",
                   help="replace this script's earlier outputs in --output_dir (only files it recorded writing there)")
    p.add_argument("--base_tokenizer", default=str(ROOT / "bench" / "tokenizer"),
                   help="BERT tokenizer whose normalisation and special tokens the new vocabulary keeps (default: "
                        "the shipped bench/tokenizer, all-MiniLM-L6-v2's, which needs no package: the GPU machine "
                        "has none of the offline model)")
    p.add_argument("--vocab_size", type=int, default=8192, help="WordPiece entries trained on --inputs")
    p.add_argument("--hidden_size", type=int, default=256, help="model width")
    p.add_argument("--num_layers", type=int, default=4, help="transformer layers")
    p.add_argument("--num_heads", type=int, default=4, help="attention heads")
    p.add_argument("--intermediate_size", type=int, default=1024, help="feed-forward width (4 x hidden, as BERT)")
    p.add_argument("--block_size", type=int, default=128, help="tokens per training block (and encoding limit)")
    p.add_argument("--mlm_probability", type=float, default=0.15, help="share of tokens masked (BERT: 0.15)")
    p.add_argument("--causal", default=None, metavar="ARCHITECTURE",
                   help="pre-train a causal language model of this transformers architecture (qwen2, llama) at the "
                        "same sizes instead, by next-token prediction: Revela's language model at the gpu scale")
    p.add_argument("--per_device_train_batch_size", type=int, default=64, help="blocks per step")
    p.add_argument("--learning_rate", type=float, default=1e-3,
                   help="peak AdamW learning rate (small BERTs train at 5e-4 to 1e-3)")
    p.add_argument("--warmup_ratio", type=float, default=0.06, help="linear warmup share of the steps")
    p.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (BERT: 0.01)")
    p.add_argument("--max_steps", type=int, default=800,
                   help="optimizer steps (800 x 64 blocks: about 45 minutes on 2 CPU cores, 3.25 s a step)")
    p.add_argument("--eval_share", type=float, default=0.01, help="share of blocks held out for the MLM loss")
    p.add_argument("--logging_steps", type=int, default=50, help="train-loss logging interval")
    p.add_argument("--seed", type=int, default=42, help="seed of init, masking and data order")
    p.add_argument("--max_docs", type=int, default=0, help="read at most this many documents per file (0 = all)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (a GPU; the Trainer's bf16)")
    p.add_argument("--max_seconds", type=float, default=None,
                   help="stop training after this many seconds even before --max_steps (a time-boxed GPU run: the "
                        "learning-rate schedule is then cut where it stands; mlm_stats.json says where it stopped)")
    args = p.parse_args(argv)
    for f in args.inputs:
        if not os.path.isfile(f):
            p.error(f"--inputs: no such file {f}")
    return args


# What this script writes into --output_dir (common.claim_output_folder records them): --overwrite replaces these
# and nothing else, so a corpus or a start model that shares the folder is never deleted.
OUTPUTS = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "vocab.txt", "sentence_bert_config.json", "mlm_log.jsonl", "mlm_loss_curve.png",
           "mlm_stats.json", "trainer", "training_args.bin")


def read_texts(paths, max_docs):
    """Every document's text, file by file; a line that is not a JSON object with a text is an error naming it."""
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if max_docs and n > max_docs:
                    break
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise SystemExit(f"{path}:{n}: not a JSON object with a 'text' field ({e!r})")
                if text.strip():
                    texts.append(text)
    return texts


def train_tokenizer(texts, base, vocab_size):
    """A WordPiece vocabulary of `vocab_size` trained on `texts`, with `base`'s normaliser and special tokens."""
    from transformers import AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(resolve_model_path(base))
    return base_tok.train_new_from_iterator((texts[i:i + 1000] for i in range(0, len(texts), 1000)), vocab_size)


def blocks_dataset(texts, tokenizer, block_size, seed, eval_share):
    """run_mlm.py's group_texts: documents tokenised, each closed by [SEP], concatenated and cut into blocks of
    `block_size` tokens that start with [CLS]; the remainder under one block is dropped. -> (train, held-out)."""
    from datasets import Dataset

    ds = Dataset.from_dict({"text": texts})
    sep, cls = tokenizer.sep_token_id, tokenizer.cls_token_id
    body = block_size - 1  # room for the [CLS] each block starts with

    def tokenize(batch):
        # whole documents, cut into blocks below: no length warning
        ids = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
        return {"ids": [x + [sep] for x in ids]}

    def group(batch):
        flat = [t for x in batch["ids"] for t in x]
        n = len(flat) // body * body
        return {"input_ids": [[cls] + flat[i:i + body] for i in range(0, n, body)]}

    ds = ds.map(tokenize, batched=True, remove_columns=["text"], desc="tokenising")
    ds = ds.map(group, batched=True, batch_size=1000, remove_columns=["ids"], desc=f"blocks of {block_size}")
    split = ds.train_test_split(test_size=eval_share, seed=seed)
    return split["train"], split["test"]


def plot_curve(log, path, what="MLM"):
    """Train loss per logging step and the held-out loss at the end, on one axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["loss"]) for r in log if "loss" in r]
    ev = [(r["step"], r["eval_loss"]) for r in log if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*zip(*tr), label=f"train {what} loss")
    if ev:
        ax.scatter(*zip(*ev), color="C3", zorder=3, label=f"held-out {what} loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(f"nano model, {what} pre-training")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def TimeBox(seconds: float):
    """A TrainerCallback that ends training once `seconds` have passed since it began (checked after each step)."""
    from transformers import TrainerCallback

    class _TimeBox(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, **kw):
            if time.time() - self.t0 > seconds:
                control.should_training_stop = True

    return _TimeBox()


def main(argv=None):
    args = parse_args(argv)
    import torch
    from transformers import (BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments,
                              set_seed)

    set_seed(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    previous = claim_output_folder(out, "pretrain_mlm.py", OUTPUTS,
                                   local_inputs(inputs=args.inputs, base_tokenizer=args.base_tokenizer))
    if previous and not args.overwrite:
        raise UserError(f"{previous[0]} exists (an earlier run's output): pass --overwrite to replace this script's "
                        "outputs, or choose another --output_dir")
    record_outputs(out, "pretrain_mlm.py", OUTPUTS)
    if previous:
        remove_outputs(out, "pretrain_mlm.py", previous)
    t0 = time.time()
    texts = read_texts(args.inputs, args.max_docs)
    tokenizer = train_tokenizer(texts, args.base_tokenizer, args.vocab_size)
    t_tok = time.time() - t0
    train_ds, eval_ds = blocks_dataset(texts, tokenizer, args.block_size, args.seed, args.eval_share)
    print(f"{len(texts)} documents -> vocabulary {len(tokenizer)} ({t_tok:.0f} s) -> {len(train_ds)} training and "
          f"{len(eval_ds)} held-out blocks of {args.block_size} tokens; {args.max_steps} steps x "
          f"{args.per_device_train_batch_size} blocks = "
          f"{args.max_steps * args.per_device_train_batch_size / max(1, len(train_ds)):.2f} epochs", flush=True)

    # BERT's architecture at a small size; positions beyond the block are never trained (and never read: the
    # folder's encoding limit is the block). --causal: a decoder of the same sizes, its loss the next token's (the
    # collator's mlm=False: labels are the inputs, shifted inside the model)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                 num_attention_heads=args.num_heads, intermediate_size=args.intermediate_size,
                 max_position_embeddings=max(512, args.block_size), pad_token_id=tokenizer.pad_token_id)
    if args.causal:
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(args.causal, num_key_value_heads=args.num_heads,
                                                                      **sizes))
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:
        model = BertForMaskedLM(BertConfig(**sizes))
        collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=args.mlm_probability)
    n_params = sum(p.numel() for p in model.parameters())
    targs = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size, per_device_eval_batch_size=128,
        learning_rate=args.learning_rate, warmup_steps=math.ceil(args.warmup_ratio * args.max_steps),
        lr_scheduler_type="linear", weight_decay=args.weight_decay, logging_steps=args.logging_steps,
        save_strategy="no", eval_strategy="no", report_to="none", seed=args.seed, data_seed=args.seed,
        # pinning is for host-to-GPU copies
        disable_tqdm=True, dataloader_pin_memory=torch.cuda.is_available(), bf16=args.bf16)
    trainer = Trainer(model=model, args=targs, data_collator=collator, train_dataset=train_ds, eval_dataset=eval_ds,
                      callbacks=[TimeBox(args.max_seconds)] if args.max_seconds else None)
    t1 = time.time()
    trainer.train()
    t_train = time.time() - t1
    metrics = trainer.evaluate()  # also appended to log_history, with the step
    log = trainer.state.log_history

    trainer.save_model(str(out))  # safetensors
    (out / "training_args.bin").unlink(missing_ok=True)  # a pickle: nothing in a model folder should need unpickling
    tokenizer.model_max_length = args.block_size  # the encoding limit: the trained positions
    tokenizer.save_pretrained(str(out))
    # sentence-transformers' encoding limit: the trained positions only
    atomic_write(out / "sentence_bert_config.json", json.dumps({"max_seq_length": args.block_size,
                                                                "do_lower_case": False}))
    atomic_write(out / "mlm_log.jsonl", "".join(json.dumps(r) + "\n" for r in log))
    plot_curve(log, out / "mlm_loss_curve.png", "next-token" if args.causal else "MLM")
    shutil.rmtree(out / "trainer", ignore_errors=True)
    stats = {"documents": len(texts), "vocab_size": len(tokenizer), "parameters": n_params,
             "train_blocks": len(train_ds), "heldout_blocks": len(eval_ds), "steps": trainer.state.global_step,
             "epochs": trainer.state.global_step * args.per_device_train_batch_size / max(1, len(train_ds)),
             "first_logged_loss": next((r["loss"] for r in log if "loss" in r), None),
             "heldout_loss": metrics["eval_loss"], "heldout_perplexity": math.exp(metrics["eval_loss"]),
             "tokenizer_seconds": round(t_tok), "train_seconds": round(t_train),
             "args": {k: v for k, v in vars(args).items() if k not in ("inputs", "output_dir")},
             "inputs": [os.path.basename(os.path.dirname(f)) or f for f in args.inputs]}
    atomic_write(out / "mlm_stats.json", json.dumps(stats, indent=1))
    print(f"held-out {'next-token' if args.causal else 'MLM'} loss {metrics['eval_loss']:.3f} "
          f"(perplexity {math.exp(metrics['eval_loss']):.1f}); "
          f"{n_params / 1e6:.1f}M parameters; training {t_train / 60:.1f} min; wrote {out}")
    return stats


if __name__ == "__main__":
    run_script(main)
