"""Every cache is keyed by what made it (issue 54, item 1): the tokens by the code that computes them, not its name
(train.tokenized); the groups' Arrow cache by the shards' content, not their modification time (train.load_groups);
a recorded hash by a file's stat that a rewrite cannot keep (training.content_digest). On select_groups.py's own
output."""

import os
import time

import pyarrow.parquet as pq
import pytest

import modeling_xprt as mx
import train
from plumbing import training


@pytest.fixture(scope="module")
def groups(tiny_bert, tmp_path_factory):
    """select_groups.py's groups of 12 bundled documents."""
    from test_select_groups import _docs, _write_jsonl

    import select_groups

    tmp = tmp_path_factory.mktemp("cache_groups")
    docs = _write_jsonl(tmp / "docs.jsonl", _docs(12))
    select_groups.main(["--input", str(docs), "--model_name_or_path", str(tiny_bert), "--output_dir",
                        str(tmp / "groups"), "--centrality_threshold", "-1"])
    return tmp / "groups"


def rewrite_keeping_mtime(path, data: bytes):
    """`path` rewritten with `data`, its modification time put back (as cp -p, touch -r or rsync -t leave it); a
    clock tick later than its last change (a kernel without fine-grained timestamps keeps 4-10 ms ones)."""
    st = os.stat(path)
    time.sleep(0.02)
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_changed_token_code_tokenises_again(groups, tiny_bert, monkeypatch):
    """train.tokenized under another passage_tokens (same name, other source) does not read the first call's cache:
    the second call's ids are the variant's."""
    from accelerate import PartialState
    from transformers import AutoTokenizer

    rows = train.load_groups(str(groups))
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    first = train.tokenized(PartialState(), rows, mx.XPRTCollator(tok, max_length=24))
    real = mx.passage_tokens

    def passage_tokens(tokenizer, texts, prefix, length, words=False):  # every passage's ids reversed
        return {k: [v[::-1] for v in values] for k, values in real(tokenizer, texts, prefix, length, words).items()}

    monkeypatch.setattr(mx, "passage_tokens", passage_tokens)
    second = train.tokenized(PartialState(), rows, mx.XPRTCollator(tok, max_length=24))
    assert list(second["anchor_ids"]) == [ids[::-1] for ids in first["anchor_ids"]] != list(first["anchor_ids"])
    assert second.cache_files != first.cache_files


def test_a_shard_rewritten_with_its_mtime_kept_is_read_anew(groups, tmp_path):
    """A groups shard replaced by another valid one (its rows in reverse order: same schema and count) with its
    modification time put back: load_groups returns the new rows, not the old Arrow cache's."""
    import shutil

    folder = shutil.copytree(groups, tmp_path / "groups")
    before = list(train.load_groups(str(folder))["anchor"])
    shard = sorted(folder.glob("*.parquet"))[0]
    table = pq.read_table(shard)
    pq.write_table(table.take(list(range(len(table)))[::-1]), tmp_path / "reversed.parquet")
    rewrite_keeping_mtime(shard, (tmp_path / "reversed.parquet").read_bytes())
    after = list(train.load_groups(str(folder))["anchor"])
    assert after != before and sorted(after) == sorted(before)


def test_content_digest_rehashes_a_file_rewritten_with_its_mtime_kept(tmp_path):
    """Same size, same mtime, other bytes: rehashed (its ctime and inode moved). An old record's [size, mtime,
    sha256] entry is rehashed too."""
    f = tmp_path / "shard.parquet"
    f.write_bytes(b"a" * 100)
    first = training.content_digest([f], {})
    rewrite_keeping_mtime(f, b"b" * 100)
    again = training.content_digest([f], first["files"])
    assert again["sha256"] == training.content_digest([f], {})["sha256"] != first["sha256"]
    old = {str(f): first["files"][str(f)][:3]}  # a record written before ctime and inode were kept
    assert training.content_digest([f], old)["sha256"] == again["sha256"]
