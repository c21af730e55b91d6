"""Training SAGE's segmentation head from paragraph-segmented text (certrag.data.corpora).

Triplets <s1, s2, label> come from documents made of paragraphs: label 1 for consecutive sentences inside one
paragraph, 0 for the last sentence of a paragraph and the first of the next (DESIGN.md). Classes are balanced by
subsampling the larger one. Whole documents are held out for evaluation, chosen by a stable hash of their name.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np

from certrag.data.corpora import ParagraphDocument, load_sources
from certrag.data.splits import stable_fraction
from certrag.segment.sentences import split_sentences

log = logging.getLogger(__name__)


def split_documents(docs: list[ParagraphDocument], held_out: float = 0.2
                    ) -> tuple[list[ParagraphDocument], list[ParagraphDocument]]:
    """Whole documents to train and held-out sets, by a stable hash of the document name."""
    train = [d for d in docs if stable_fraction(d.name) >= held_out]
    test = [d for d in docs if stable_fraction(d.name) < held_out]
    return train, test


def document_sentences(doc: ParagraphDocument) -> tuple[list[str], list[int]]:
    """The document's sentences and, for each, its paragraph index."""
    texts, para = [], []
    for p_index, p in enumerate(doc.paragraphs):
        for s in split_sentences(p):
            texts.append(s.text)
            para.append(p_index)
    return texts, para


def triplets(docs: list[ParagraphDocument], max_pairs: int | None = None, seed: int = 0) -> tuple[list[str], list[str],
                                                                                          np.ndarray]:
    """Balanced <s1, s2, label> triplets: 1 inside a paragraph, 0 across a break."""
    pos, neg = [], []
    for doc in docs:
        texts, para = document_sentences(doc)
        for i in range(len(texts) - 1):
            (pos if para[i] == para[i + 1] else neg).append((texts[i], texts[i + 1]))
    rng = random.Random(seed)
    n = min(len(pos), len(neg))
    if max_pairs is not None:
        n = min(n, max_pairs // 2)
    if n == 0:
        raise ValueError("the documents hold no paragraph break (or no paragraph with two sentences)")
    pairs = [(a, b, 1) for a, b in rng.sample(pos, n)] + [(a, b, 0) for a, b in rng.sample(neg, n)]
    rng.shuffle(pairs)
    return [p[0] for p in pairs], [p[1] for p in pairs], np.array([p[2] for p in pairs], dtype=np.float32)


def _embed_pairs(embedder, s1: list[str], s2: list[str]) -> tuple[np.ndarray, np.ndarray]:
    unique = sorted(set(s1) | set(s2))
    index = {t: i for i, t in enumerate(unique)}
    emb = embedder.embed(unique)
    return emb[[index[t] for t in s1]], emb[[index[t] for t in s2]]


def _metrics(p: np.ndarray, y: np.ndarray) -> dict:
    eps = 1e-7
    loss = float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)))
    pred = p >= 0.5
    tp = float(np.sum(pred & (y == 1)))
    tn = float(np.sum(~pred & (y == 0)))
    fn = float(np.sum(~pred & (y == 1)))
    fp = float(np.sum(pred & (y == 0)))
    # "break" is the positive class of segmentation: label 0.
    prec = tn / max(tn + fn, 1.0)
    rec = tn / max(tn + fp, 1.0)
    return {"loss": loss, "accuracy": (tp + tn) / len(y), "break_precision": prec, "break_recall": rec,
            "break_f1": 2 * prec * rec / max(prec + rec, 1e-12), "n": int(len(y))}


def train_head(x1: np.ndarray, x2: np.ndarray, y: np.ndarray, *, hidden: int = 256, epochs: int = 30,
               lr: float = 1e-3, batch_size: int = 256, weight_decay: float = 1e-4, seed: int = 0,
               eval_data: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               val_data: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, progress: bool = True):
    """Trains the head with Adam on precomputed embeddings; returns (SegmenterHead, history).

    With val_data (pairs from training documents kept aside), the weights of the epoch with the lowest validation
    loss are returned (early stopping); eval_data is only reported, never used to choose.
    """
    from certrag.backends import import_torch
    from certrag.segment.head import SegmenterHead

    torch = import_torch()
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    d = x1.shape[1]
    model = torch.nn.Sequential(torch.nn.Linear(4 * d, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    a, b = torch.from_numpy(x1), torch.from_numpy(x2)
    feats = torch.cat([a, b, a - b, a * b], dim=1)
    target = torch.from_numpy(y)
    gen = torch.Generator().manual_seed(seed)
    history = []
    best = None

    def head_now():
        w1 = model[0].weight.detach().numpy().copy()
        return SegmenterHead(w1, model[0].bias.detach().numpy().copy(), model[2].weight.detach().numpy()[0].copy(),
                             float(model[2].bias.detach().numpy()[0]))

    bar = tqdm(range(epochs), desc="training segmenter head", disable=not progress)
    for epoch in bar:
        model.train()
        perm = torch.randperm(len(target), generator=gen)
        total = 0.0
        for start in range(0, len(perm), batch_size):
            idx = perm[start:start + batch_size]
            logits = model(feats[idx]).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        row = {"epoch": epoch + 1, "train_loss": total / len(target)}
        if val_data is not None:
            row["val_loss"] = _metrics(head_now().score_adjacent_pairs(*val_data[:2]), val_data[2])["loss"]
            if best is None or row["val_loss"] < best[0]:
                best = (row["val_loss"], epoch + 1, {k: v.clone() for k, v in model.state_dict().items()})
        if eval_data is not None:
            row.update({f"held_out_{k}": v for k, v in
                        _metrics(head_now().score_adjacent_pairs(*eval_data[:2]), eval_data[2]).items()})
        history.append(row)
        bar.set_postfix({k: round(v, 4) for k, v in row.items() if k in ("train_loss", "val_loss")})
    if best is not None:
        model.load_state_dict(best[2])
        history.append({"selected_epoch": best[1], "val_loss": best[0]})
    return head_now(), history


def train_segmenter(out: str | Path, *, sources: tuple[str, ...] = ("wiki", "pydoc"), max_pairs: int = 24000,
                    hidden: int = 256, epochs: int = 30, lr: float = 1e-3, seed: int = 0, held_out: float = 0.2,
                    embedder=None, documents: list[ParagraphDocument] | None = None, progress: bool = True):
    """Builds triplets, embeds them, trains the head, evaluates on held-out documents and saves head + card."""
    from certrag.embed import Embedder

    started = time.time()
    embedder = embedder or Embedder.default()
    docs = documents if documents is not None else load_sources(list(sources), seed=seed)
    train_docs, test_docs = split_documents(docs, held_out)
    # A validation slice of the training documents picks the epoch; the held-out documents only report.
    fit_docs = [d for d in train_docs if stable_fraction("val:" + d.name) >= 0.1]
    val_docs = [d for d in train_docs if stable_fraction("val:" + d.name) < 0.1]
    s1, s2, y = triplets(fit_docs, max_pairs, seed)
    v1, v2, vy = triplets(val_docs, max(2, max_pairs // 8), seed + 2)
    t1, t2, ty = triplets(test_docs, max(2, max_pairs // 4), seed + 1)
    log.info("embedding %d training and %d held-out pairs", len(y), len(ty))
    x1, x2 = _embed_pairs(embedder, s1, s2)
    e1, e2 = _embed_pairs(embedder, t1, t2)
    f1, f2 = _embed_pairs(embedder, v1, v2)
    from certrag.segment.head import SegmenterHead

    untrained = SegmenterHead.random(embedder.dim, hidden, seed)
    before = _metrics(untrained.score_adjacent_pairs(e1, e2), ty)
    head, history = train_head(x1, x2, y, hidden=hidden, epochs=epochs, lr=lr, seed=seed,
                               eval_data=(e1, e2, ty), val_data=(f1, f2, vy), progress=progress)
    after = _metrics(head.score_adjacent_pairs(e1, e2), ty)
    head.card = {
        "kind": "certrag segmenter head (SAGE)",
        "architecture": "sigmoid(w2 . relu(W1 [x1, x2, x1 - x2, x1 * x2] + b1) + b2)",
        "embedder": embedder.name, "dim": embedder.dim, "hidden": hidden,
        "sources": list(sources) if documents is None else ["custom"],
        "documents": {"train": len(fit_docs), "validation": len(val_docs), "held_out": len(test_docs),
                      "held_out_rule": f"sha256(document name) < {held_out}",
                      "validation_rule": "sha256('val:' + name) < 0.1 among the rest; picks the epoch"},
        "pairs": {"train": int(len(y)), "validation": int(len(vy)), "held_out": int(len(ty)), "balanced": True},
        "training": {"optimizer": "Adam", "lr": lr, "weight_decay": 1e-4, "batch_size": 256, "epochs": epochs,
                     "steps": int(epochs * -(-len(y) // 256)), "seed": seed, "embedder_frozen": True,
                     "selected_epoch": history[-1].get("selected_epoch")},
        "held_out_before_training": before, "held_out": after,
        "history": history,
        "seconds": round(time.time() - started, 1),
        "remake": f"certrag train-segmenter --out {out} --sources {','.join(sources)} --max-pairs {max_pairs} "
                  f"--epochs {epochs} --seed {seed}",
    }
    head.save(out)
    return head
