"""BERT encoders (the bundled embedder and rerankers) built from their safetensors in torch alone.

transformers' BERT classes pull in torch._dynamo, its masking utilities and the hub integrations: 2.5-3 s of
imports before the first sentence is embedded, most of a cold `certrag search`. The forward pass of a BERT encoder
is a few lines of torch; this module builds it from the folder's config.json and weights with the same parameter
names, so backends.prepare (per-text Linears, bfloat16, int8) and the tests' Hugging Face oracles apply unchanged.
Folders this does not describe (another architecture, relative positions, another activation) load through
transformers as before (`supported`)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

_ACTIVATIONS = ("gelu",)  # transformers' "gelu": the exact (erf) GELU, torch's default


def supported(config: dict) -> bool:
    """Whether `config` (a config.json) describes an encoder this module builds exactly as transformers does."""
    return (config.get("model_type") == "bert"
            and config.get("position_embedding_type", "absolute") == "absolute"
            and config.get("hidden_act", "gelu") in _ACTIVATIONS
            and not config.get("is_decoder", False)
            and not config.get("add_cross_attention", False)
            and config.get("problem_type") in (None, "regression", "single_label_classification"))


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def load(model_dir: str | Path, torch, *, classifier: bool):
    """The encoder in `model_dir` as a float32 torch module in eval mode, or None when `supported` says no.

    classifier=False: BertModel's interface, model(input_ids, attention_mask, token_type_ids).last_hidden_state;
    classifier=True: BertForSequenceClassification's, .logits (n, num_labels) from the pooled first token."""
    config = read_config(model_dir)
    if not supported(config):
        return None
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    num_labels = len(config.get("id2label") or {0: 0}) if classifier else 0
    model = _classes(torch)[1 if classifier else 0](config, num_labels)  # (not on torch's meta device: it imports
    # torch._refs and friends, 3 s, to skip a random initialisation that takes 0.1 s)
    if not classifier and not any(k.startswith("embeddings.") for k in state):  # a classifier's folder as encoder
        state = {k[len("bert."):]: v for k, v in state.items() if k.startswith("bert.")}
    if not any(k.endswith("pooler.dense.weight") for k in state):
        if classifier:
            raise ValueError(f"{model_dir}: a sequence classifier needs its pooler weights")
        model.pooler = None
    state = {k: v.float() for k, v in state.items() if not k.endswith("position_ids")}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match a BERT encoder (missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
    return model.eval()


@lru_cache(maxsize=1)
def _classes(torch):
    """The module classes, made once (torch is imported by the caller, lazily, as everywhere in certrag)."""
    nn, F = torch.nn, torch.nn.functional

    class Embeddings(nn.Module):
        def __init__(self, c: dict) -> None:
            super().__init__()
            self.word_embeddings = nn.Embedding(c["vocab_size"], c["hidden_size"])
            self.position_embeddings = nn.Embedding(c["max_position_embeddings"], c["hidden_size"])
            self.token_type_embeddings = nn.Embedding(c.get("type_vocab_size", 2), c["hidden_size"])
            self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c.get("layer_norm_eps", 1e-12))

        def forward(self, input_ids, token_type_ids):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
                 + self.position_embeddings(positions)[None])
            return self.LayerNorm(x)

    class SelfAttention(nn.Module):
        def __init__(self, c: dict) -> None:
            super().__init__()
            h = c["hidden_size"]
            self.heads = c["num_attention_heads"]
            self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

        def forward(self, x, mask):
            b, n, h = x.shape

            def split(t):  # (b, n, h) -> (b, heads, n, h / heads)
                return t.view(b, n, self.heads, h // self.heads).transpose(1, 2)

            ctx = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)),
                                                 attn_mask=mask)
            return ctx.transpose(1, 2).reshape(b, n, h)

    class Residual(nn.Module):  # BertSelfOutput / BertOutput: LayerNorm(dense(x) + input)
        def __init__(self, c: dict, width: int) -> None:
            super().__init__()
            self.dense = nn.Linear(width, c["hidden_size"])
            self.LayerNorm = nn.LayerNorm(c["hidden_size"], eps=c.get("layer_norm_eps", 1e-12))

        def forward(self, x, residual):
            return self.LayerNorm(self.dense(x) + residual)

    class Attention(nn.Module):
        def __init__(self, c: dict) -> None:
            super().__init__()
            self.self = SelfAttention(c)
            self.output = Residual(c, c["hidden_size"])

        def forward(self, x, mask):
            return self.output(self.self(x, mask), x)

    class Intermediate(nn.Module):
        def __init__(self, c: dict) -> None:
            super().__init__()
            self.dense = nn.Linear(c["hidden_size"], c["intermediate_size"])

        def forward(self, x):
            return F.gelu(self.dense(x))

    class Layer(nn.Module):
        def __init__(self, c: dict) -> None:
            super().__init__()
            self.attention = Attention(c)
            self.intermediate = Intermediate(c)
            self.output = Residual(c, c["intermediate_size"])

        def forward(self, x, mask):
            a = self.attention(x, mask)
            return self.output(self.intermediate(a), a)

    class Encoder(nn.Module):
        def __init__(self, c: dict) -> None:
            super().__init__()
            self.layer = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))

    class Pooler(nn.Module):
        def __init__(self, c: dict) -> None:
            super().__init__()
            self.dense = nn.Linear(c["hidden_size"], c["hidden_size"])

        def forward(self, hidden):
            return torch.tanh(self.dense(hidden[:, 0]))

    class Bert(nn.Module):
        """BertModel's forward for inference: token, position and segment embeddings, then the layers; every key
        a padding position holds is masked out of attention (attention_mask 0)."""

        def __init__(self, c: dict, num_labels: int = 0) -> None:
            super().__init__()
            self.config = SimpleNamespace(**c)
            self.embeddings = Embeddings(c)
            self.encoder = Encoder(c)
            self.pooler = Pooler(c)

        def hidden(self, input_ids, attention_mask=None, token_type_ids=None):
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            mask = attention_mask.bool()[:, None, None, :]  # (b, 1, 1, n): which keys each query may see
            x = self.embeddings(input_ids, token_type_ids)
            for layer in self.encoder.layer:
                x = layer(x, mask)
            return x

        def forward(self, input_ids, attention_mask=None, token_type_ids=None):
            return SimpleNamespace(last_hidden_state=self.hidden(input_ids, attention_mask, token_type_ids))

    class BertClassifier(nn.Module):
        """BertForSequenceClassification's forward for inference: a linear head on the pooled first token."""

        def __init__(self, c: dict, num_labels: int) -> None:
            super().__init__()
            self.config = SimpleNamespace(**c)
            self.bert = Bert(c)
            self.classifier = nn.Linear(c["hidden_size"], num_labels)

        def forward(self, input_ids, attention_mask=None, token_type_ids=None):
            pooled = self.bert.pooler(self.bert.hidden(input_ids, attention_mask, token_type_ids))
            return SimpleNamespace(logits=self.classifier(pooled))

    return Bert, BertClassifier
