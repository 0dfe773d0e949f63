"""Every script's language in select_groups.py, on real Chinese, Japanese and German Wikipedia text
(data/multilingual.jsonl): TF-IDF terms for scripts written without spaces, sentence ends of every script, the
warning when the selection encoder reads the corpus as [UNK], and anchor thresholds per script."""

import json
from pathlib import Path

import numpy as np
import pytest

import select_groups as sg
from plumbing import readers

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "data" / "multilingual.jsonl"


def _sample(lang=None):
    with open(SAMPLE, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    return [d for d in docs if lang is None or d["lang"] == lang]


@pytest.fixture(scope="module")
def tok(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


def test_script_terms_are_scikit_learns_words_on_spaced_text_and_bigrams_on_unspaced():
    from sklearn.feature_extraction.text import HashingVectorizer

    words = HashingVectorizer().build_analyzer()
    with open(ROOT / "data" / "docs.jsonl", encoding="utf-8") as f:
        english = [json.loads(line)["text"] for _, line in zip(range(20), f)]
    for text in english + [d["text"] for d in _sample("de")]:
        assert sg.script_terms(text) == words(text)  # English and German groups stay as they were
    assert sg.script_terms("数学是一门学科") == ["数学", "学是", "是一", "一门", "门学", "学科"]
    assert sg.script_terms("アンパサンド（&）とは、2010年 Wiki") == ["2010", "wiki", "アン", "ンパ", "パサ", "サン",
                                                                 "ンド", "とは", "年"]
    assert words("数学是一门学科，属于形式科学。") == ["数学是一门学科", "属于形式科学"]  # the former terms: clauses


@pytest.mark.parametrize("lang, words_pct, script_pct", [("zh", 96.3, 5.5), ("ja", 94.0, 2.5)])
def test_unspaced_passages_of_one_document_share_tfidf_terms(tok, lang, words_pct, script_pct):
    """Pairs of passages of one document whose TF-IDF cosine is exactly 0 (no term in common): with the former word
    terms nearly all of them in Chinese and Japanese (a clause is one term), with script terms few."""
    texts = [readers.with_title(d["title"], d["text"]) for d in _sample(lang)]
    passages = sg.split_passages(texts, tok, 128, 16)

    def zero_pairs_pct(terms):
        tfidf = sg.CorpusTfidf(2**20, sg.tfidf_analyzer(terms, tok))
        tfidf.add_documents(texts)
        tfidf.finalize()
        zero = total = 0
        for ps in passages:
            c = tfidf.cosines(ps)[np.triu_indices(len(ps), 1)]
            zero, total = zero + int((c == 0).sum()), total + len(c)
        return 100 * zero / total

    assert zero_pairs_pct("words") == pytest.approx(words_pct, abs=0.05)
    assert zero_pairs_pct("script") == pytest.approx(script_pct, abs=0.05)
    assert zero_pairs_pct("encoder") == 0.0  # MiniLM's single CJK characters: some always shared


def test_sentences_end_at_every_scripts_terminals(tok):
    cut = lambda t: [s for s in sg._SENTENCE_END.split(t) if s]  # noqa: E731
    assert cut("数学是一门学科。它研究数量！真的吗？是的。") == ["数学是一门学科。", "它研究数量！", "真的吗？",
                                                                 "是的。"]
    assert cut("「そうだ。」と言った。次") == ["「そうだ。」", "と言った。", "次"]
    assert cut("Er sagte: «Nein.» Dann ging er. Pi ist 3.14 groß.") == ["Er sagte: «Nein.»", "Dann ging er.",
                                                                       "Pi ist 3.14 groß."]
    # paragraphs over a 64-token budget: the Chinese and Japanese passages that end where a sentence ends (the rest
    # were cut at token windows inside a sentence longer than the budget), against the former rule (. ! ? only)
    former = sg.re.compile(r"(?<=[.!?])\s+")
    for lang, want_now, want_before in (("zh", (222, 285), (83, 253)), ("ja", (200, 275), (84, 242))):
        texts = [d["text"] for d in _sample(lang)]
        got = []
        for rule in (sg._SENTENCE_END, former):
            with pytest.MonkeyPatch.context() as m:
                m.setattr(sg, "_SENTENCE_END", rule)
                passages = [p for ps in sg.split_passages(texts, tok, 64, 4) for p in ps]
            assert max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in passages) <= 64 + 2
            got.append((sum(p[-1] in "。！？」" for p in passages), len(passages)))
        assert got == [want_now, want_before], lang


@pytest.fixture(scope="module")
def mixed_runs(tiny_bert, tmp_path_factory):
    """select_groups.py on the whole sample (6 Chinese, 6 Japanese, 6 German articles) with the tiny BERT (MiniLM's
    tokenizer), --anchor_share 0.5 under one threshold and under one per script: (stats, log) of each."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("mixed")
    out = {}
    for name, extra in (("one", []), ("per_script", ["--per_script_anchor_share"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            sg.main(["--input", str(SAMPLE), "--model_name_or_path", str(tiny_bert), "--output_dir",
                     str(tmp / name), "--anchor_share", "0.5", *extra])
        out[name] = json.loads((tmp / name / "stats.json").read_text()), buf.getvalue()
    return out


def test_unknown_token_share_is_counted_and_warned_with_the_models_name(mixed_runs, tiny_bert, tok):
    """The share of [UNK] in stats.json equals the tokenizer's own count over the texts, per script too, and the log
    warns before the passes and at the end, naming the model and the share."""
    stats, log = mixed_runs["one"]
    unk = {}
    for d in _sample():
        ids = tok([line for line in readers.with_title(d["title"], d["text"]).split("\n") if line.strip()],
                  add_special_tokens=False)["input_ids"]
        n, u = unk.get(d["lang"], (0, 0))
        unk[d["lang"]] = (n + sum(map(len, ids)), u + sum(x.count(tok.unk_token_id) for x in ids))
    by = stats["by_script"]
    assert set(by) == {"Han", "Japanese", "Latin"}
    for lang, script in (("zh", "Han"), ("ja", "Japanese"), ("de", "Latin")):
        assert (by[script]["tokens"], by[script]["unknown_tokens"]) == unk[lang]
    assert by["Han"]["unknown_token_pct"] > 50 and by["Latin"]["unknown_token_pct"] == 0.0
    total = sum(n for n, _ in unk.values()), sum(u for _, u in unk.values())
    assert stats["unknown_token_pct"] == pytest.approx(100 * total[1] / total[0], abs=0.01)
    assert f"warning: {tiny_bert} reads {stats['unknown_token_pct']:.1f}% of this corpus's tokens" in log
    assert f"(Han {by['Han']['unknown_token_pct']:.1f}%" in log
    assert f"warning: {tiny_bert} reads" in log.split("IDF over")[0]  # said before the passes too


def test_anchor_share_per_script(mixed_runs):
    """One threshold gives the three scripts different anchor shares (the log says so, per script); one threshold
    per script (--per_script_anchor_share) gives each about --anchor_share (0.5)."""
    one, log = mixed_runs["one"]
    assert "per script" in log and all(f"  {k}" in log for k in one["by_script"])
    per, log_per = mixed_runs["per_script"]
    assert set(per["centrality_threshold_by_script"]) == {"*", "Han", "Japanese", "Latin"}
    for v in per["by_script"].values():
        assert v["anchor_share_pct"] == pytest.approx(50.0, abs=3.0)
    spread = lambda s: np.ptp([v["anchor_share_pct"] for v in s["by_script"].values()])  # noqa: E731
    assert spread(per) < spread(one)


def test_a_documents_script():
    scripts = {d["lang"]: sg.dominant_script(d["text"]) for d in _sample()}
    assert scripts == {"zh": "Han", "ja": "Japanese", "de": "Latin"}
    assert sg.dominant_script("Москва — столица России.") == "Cyrillic"
    assert sg.dominant_script("12345 !!!") == "none"
