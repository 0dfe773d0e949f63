"""Each passage tokenised once at load (train.tokenized), the collators only masking and padding (issue 42: collation
was 95% tokenising): the batches equal those collated from the texts, for every objective on select_groups.py's own
output, and the collators' one tokenisation equals the tokenizer's own padded call over a family of tokenizers
(WordPiece with [CLS] / [SEP], byte-level BPE with <s> / </s>, a Unigram with only a </s> tail, padded on the left)."""

import json
from pathlib import Path

import pytest
import torch
from test_revela import build_tiny_lm

import modeling_xprt as mx
import train

ROOT = Path(__file__).resolve().parent.parent


def paragraphs(n: int = 200) -> list:
    out = []
    with open(ROOT / "data" / "docs.jsonl", encoding="utf-8") as f:
        for line in f:
            out += [p for p in json.loads(line)["text"].split("\n") if len(p) > 40]
    return out[:n]


@pytest.fixture(scope="module")
def rows(tiny_bert, tmp_path_factory):
    """select_groups.py's own groups of 12 bundled documents, read as train.py reads them."""
    from test_select_groups import _docs, _write_jsonl

    import select_groups

    tmp = tmp_path_factory.mktemp("tokens_groups")
    docs = _write_jsonl(tmp / "docs.jsonl", _docs(12))
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir",
                        str(tmp / "groups"), "--centrality_threshold", "-1"])
    return train.load_groups(str(tmp / "groups"))


OBJECTIVES = [("xprt", {}), ("xprt", {"positive": "random"}), ("xprt", {"fill_in": False}), ("retromae", {}),
              ("simlm", {}), ("contriever", {}), ("contrastive_random_span", {}), ("self_reconstruction", {}),
              ("revela", {})]


@pytest.mark.parametrize("objective,collator_options", [(o, dict(kw)) for o, kw in OBJECTIVES],
                         ids=[o + "".join(f"-{k}" for k in kw) for o, kw in OBJECTIVES])
def test_batches_from_the_tokens_equal_the_batches_from_the_texts(objective, collator_options, rows, tiny_bert,
                                                                 tmp_path):
    """Every objective's collator over the same rows, seeded alike: from the texts (tokenised in the batch) and from
    the rows train.py hands the loader (tokenised once): every tensor equal, the passage prefix included."""
    from accelerate import PartialState
    from transformers import AutoTokenizer

    from plumbing.model_folder import load_mlm_encoder

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    mlm, _ = load_mlm_encoder(str(tiny_bert))
    options = ({"generator_name_or_path": str(tiny_bert)} if objective == "simlm" else
               {"lm_name_or_path": build_tiny_lm(tmp_path / "lm", tiny_bert)} if objective == "revela" else {})
    if "fill_in" in collator_options:  # an option of the objective, which hands it to its collator
        options["fill_in"] = collator_options.pop("fill_in")
    model = mx.XPRTModel(mlm, objective=objective, **options)
    collator = model.objective.make_collator(tok, max_length=24, passage_prefix="passage: ", seed=5,
                                             **collator_options)
    tokens = train.tokenized(PartialState(), rows, collator)
    fields = {f"{f}_ids" for f in collator.passage_fields}  # Revela reads texts: none
    assert fields == ({"anchor_ids", "related_ids", "random_passage_ids"} if objective != "revela" else set())
    assert fields <= set(tokens.column_names) and ("anchor_words" in tokens.column_names) == (
        collator.needs_words and objective != "revela")
    _, extras = collator.sort_lengths(rows, 0)
    picked = list(range(0, len(rows), max(1, len(rows) // 8)))[:8]
    batches = []
    for table in (rows, tokens):
        collator.generator.manual_seed(11)
        batches.append(collator([table[i] if extras is None else {**table[i], **extras(0, i)} for i in picked]))
    text, once = batches
    assert set(text) == set(once)
    for key, value in text.items():
        if torch.is_tensor(value):
            assert torch.equal(value, once[key]), key


def tokenizer_family(texts) -> dict:
    """Three fast tokenizers built here (no hub): WordPiece with BERT's template, byte-level BPE with RoBERTa's
    (<s> passage </s>), a Unigram (SentencePiece-style) with only a </s> tail, padded on the left."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from plumbing.common import resolve_model_path

    bert = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=[
        "<s>", "<pad>", "</s>", "<unk>", "<mask>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.RobertaProcessing(("</s>", bpe.token_to_id("</s>")),
                                                      ("<s>", bpe.token_to_id("<s>")))
    roberta = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                                      sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer, uni.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    uni.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=400, unk_token="<unk>", special_tokens=[
        "<pad>", "</s>", "<unk>", "<mask>"]))
    uni.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[
        ("</s>", uni.token_to_id("</s>"))])
    t5 = PreTrainedTokenizerFast(tokenizer_object=uni, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                 mask_token="<mask>", padding_side="left")
    return {"wordpiece": bert, "byte_bpe": roberta, "unigram_left": t5}


@pytest.mark.parametrize("kind", ["wordpiece", "byte_bpe", "unigram_left"])
@pytest.mark.parametrize("prefix", ["", "passage: "])
def test_one_tokenisation_equals_the_tokenizers_padded_call(kind, prefix):
    """GroupCollator._tokenize (passage_tokens, then the template and the padding added here) equals the tokenizer's
    own call with special tokens, truncation and padding, as the collators tokenised before: the same input_ids and
    attention_mask; the candidates are the passage's tokens (no special token, padding or prefix); the tokens'
    words are the tokenizer's word_ids. Texts long and short, some cut at max_length."""
    texts = paragraphs()
    tok = tokenizer_family(texts)[kind]
    collator = mx.GroupCollator(tok, max_length=20, passage_prefix=prefix)
    batch_texts = texts[:7] + ["short one.", "a"]
    got = collator._tokenize(batch_texts)
    want = tok([prefix + t for t in batch_texts], padding=True, truncation=True, max_length=collator.seq_length,
               return_tensors="pt", return_special_tokens_mask=True)
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["attention_mask"],
                                                                            want["attention_mask"])
    assert (got["attention_mask"].sum(1) < got["input_ids"].shape[1]).any()  # padding was added somewhere
    assert (got["attention_mask"].sum(1) == collator.seq_length).any()  # and some passage was cut
    content = want["attention_mask"].bool() & ~want["special_tokens_mask"].bool()
    expected = content.clone()
    for i in range(len(batch_texts)):  # the prefix: the first len(prefix_ids) tokens of the passage
        expected[i, content[i].nonzero().squeeze(1)[:len(collator.prefix_ids)]] = False
    assert torch.equal(got["candidates"], expected)
    words = mx.GroupCollator(tok, max_length=20, passage_prefix=prefix)
    words.needs_words = True
    word_ids = words._tokenize(batch_texts)["word_ids"]
    for i in range(len(batch_texts)):
        official = torch.tensor([-1 if w is None else w for w in want.word_ids(i)])
        assert torch.equal(word_ids[i][expected[i]], official[expected[i]])
        assert (word_ids[i][~expected[i]] == -1).all()


def test_a_second_run_reads_the_tokens_back(rows, tiny_bert):
    """The tokens are written once: a second train.tokenized over the same groups, tokenizer, prefix and length reads
    the first one's Arrow cache; another --max_length tokenises again."""
    from accelerate import PartialState
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    first = train.tokenized(PartialState(), rows, mx.XPRTCollator(tok, max_length=24))
    again = train.tokenized(PartialState(), rows, mx.XPRTCollator(tok, max_length=24, seed=9))
    other = train.tokenized(PartialState(), rows, mx.XPRTCollator(tok, max_length=16))
    assert again.cache_files == first.cache_files and other.cache_files != first.cache_files
    assert max(len(ids) for ids in other["anchor_ids"]) == 16 < max(len(ids) for ids in first["anchor_ids"])


def test_several_processes_tokenise_what_one_does(rows, tiny_bert):
    """A large groups folder is tokenised by several processes (datasets.map's num_proc): the tokens of one call."""
    from accelerate import PartialState
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    collator = mx.XPRTCollator(tok, max_length=19)  # a length no other test tokenises at: nothing cached yet
    several = train.tokenized(PartialState(), rows, collator, groups_per_process=len(rows) // 2)
    assert len(several.cache_files) == 2  # an Arrow file per process
    assert several["anchor_ids"] == mx.passage_tokens(tok, rows["anchor"], "", 19)["ids"]
    related = mx.passage_tokens(tok, [t for texts in rows["related"] for t in texts], "", 19)["ids"]
    assert [ids for group in several["related_ids"] for ids in group] == related


def test_a_batch_read_at_once_equals_the_rows_read_one_by_one(rows):
    """RowsDataset.__getitems__ (the DataLoader's batched fetch: one Arrow take) hands the rows __getitem__ does."""
    from plumbing.batches import RowsDataset

    keys = [(1, 2, i) for i in (5, 0, 3, 3)]
    assert RowsDataset(rows).__getitems__(keys) == [RowsDataset(rows)[k] for k in keys]
    plain = [dict(rows[i]) for i in range(4)]
    assert RowsDataset(plain).__getitems__([0, 2]) == [(0, plain[0]), (2, plain[2])]
