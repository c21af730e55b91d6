"""certrag.bert: the bundled encoders built in torch alone equal transformers' classes on the same files, load
without importing transformers (a cold `certrag search`), and anything else falls back to transformers."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from certrag import bert  # noqa: E402
from certrag.embed import Embedder, default_model_dir  # noqa: E402
from certrag.rerank import PACKAGE_RERANKERS  # noqa: E402

PAIRS = [("who wrote hamlet", "Hamlet is a tragedy written by William Shakespeare between 1599 and 1601."),
         ("boiling point of water", "Water boils at 100 degrees Celsius at sea level; the rest of this passage is "
          "longer than the first so that the batch holds padding " * 3),
         ("a", "b")]


def _hf_tokens(folder, pairs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tok([q for q, _ in pairs], [p for _, p in pairs], return_tensors="pt", padding=True, truncation=True,
               max_length=128)


@pytest.mark.parametrize("name", list(PACKAGE_RERANKERS))
def test_shipped_rerankers_equal_transformers_classifier(name):
    """Oracle: AutoModelForSequenceClassification on the same folder, one padded batch with segment ids."""
    from transformers import AutoModelForSequenceClassification

    folder = PACKAGE_RERANKERS[name]
    enc = _hf_tokens(folder, PAIRS)
    ours = bert.load(folder, torch, classifier=True)
    theirs = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True,
                                                                dtype=torch.float32).eval()
    with torch.inference_mode():
        got, want = ours(**enc).logits, theirs(**enc).logits
    assert got.shape == want.shape == (len(PAIRS), 1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-5)


def test_shipped_embedder_hidden_states_equal_transformers():
    from transformers import AutoModel

    folder = default_model_dir()
    enc = _hf_tokens(folder, PAIRS)
    enc["token_type_ids"].zero_()
    ours = bert.load(folder, torch, classifier=False)
    theirs = AutoModel.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
    with torch.inference_mode():
        got, want = ours(**enc).last_hidden_state, theirs(**enc).last_hidden_state
    real = enc["attention_mask"].bool()  # padding positions' states are never read
    np.testing.assert_allclose(got[real].numpy(), want[real].numpy(), atol=2e-5)


def test_the_default_encoders_load_without_transformers():
    """A cold `certrag search` paid 2.5-3 s importing transformers' BERT classes; the bundled encoders need none."""
    code = ("import sys\n"
            "from certrag.embed import Embedder\n"
            "from certrag.rerank import CrossEncoderReranker\n"
            "Embedder.default().embed(['a question'])\n"
            "CrossEncoderReranker.default().cross_scores(['a question'], ['a passage'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _folder_like(tmp_path, **config_changes):
    """A tiny random-weight BERT with the bundled tokenizer, its config changed as given."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=128, **config_changes)
    torch.manual_seed(7)
    BertModel(config).save_pretrained(str(tmp_path))
    shutil.copy(default_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


def test_an_encoder_this_module_does_not_describe_loads_through_transformers(tmp_path):
    folder = _folder_like(tmp_path, position_embedding_type="relative_key")
    assert not bert.supported(json.loads((folder / "config.json").read_text()))
    assert bert.load(folder, torch, classifier=False) is None
    e = Embedder(folder, name="tiny-relative", backend="float32", memo_size=0)
    vectors = e.embed(["one short text", "and a second, somewhat longer one to pad the batch"])
    assert type(e.model).__module__.startswith("transformers")
    assert vectors.shape == (2, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)


def test_a_supported_tiny_encoder_matches_transformers_and_bad_weights_name_the_folder(tmp_path):
    from transformers import AutoModel

    folder = _folder_like(tmp_path / "ok", hidden_act="gelu")
    e = Embedder(folder, name="tiny", backend="float32", memo_size=0)
    texts = ["one short text", "and a second, somewhat longer one to pad the batch"]
    got = e.embed(texts)
    assert type(e.model).__module__ == bert.__name__
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    ref = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.inference_mode():
        enc = tok(texts, return_tensors="pt", padding=True)
        enc["token_type_ids"].zero_()
        h = ref(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        want = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=1).numpy()
    np.testing.assert_allclose(got, want, atol=2e-5)

    broken = _folder_like(tmp_path / "broken", hidden_act="gelu")
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the weights hold two
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="broken.*missing"):
        bert.load(broken, torch, classifier=False)
