"""The shared pieces of modeling_xprt.py: model resolution, mean pooling and embed_texts."""

import torch

from modeling_xprt import mean_pool
from plumbing.embed import embed_texts
from plumbing.common import resolve_model_path


def test_minilm_alias_resolves_to_bundled_weights():
    path = resolve_model_path("all-MiniLM-L6-v2")
    assert path.endswith("model")
    import os

    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    # hub ids other than the aliases pass through untouched
    assert resolve_model_path("intfloat/e5-base-unsupervised") == "intfloat/e5-base-unsupervised"


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(mean_pool(hidden, mask), torch.tensor([[2.0, 3.0]]))


def test_embed_texts_matches_sentence_transformers(minilm_path):
    """Our length-sorted batched embedding equals sentence-transformers' encode on MiniLM."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    texts = ["A cat sat on the mat.", "Dense retrieval maps queries and passages to vectors.", "Hi", ""]
    ours = embed_texts(AutoModel.from_pretrained(minilm_path).eval(), AutoTokenizer.from_pretrained(minilm_path), texts,
                       batch_size=3)
    st = SentenceTransformer(minilm_path, device="cpu")
    ref = torch.from_numpy(st.encode(texts, batch_size=3, normalize_embeddings=True))
    assert ours.shape == (4, 384)
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.allclose(ours.norm(dim=-1), torch.ones(4), atol=1e-5)
