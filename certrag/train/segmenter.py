"""Training SAGE's segmentation head from paragraph-segmented text (certrag.data.corpora).

Triplets <s1, s2, label> come from documents made of paragraphs: label 1 for consecutive sentences inside one
paragraph, 0 for the last sentence of a paragraph and the first of the next (DESIGN.md). Negatives also include
topic changes: a sentence of one document followed by a sentence of another, taken anywhere in it (a share
`topic_fraction` of the negatives), so the head learns that a change of subject is a cut and not only what paragraph
openings and endings look like (trained on breaks alone it scored "Mount Everest is the highest mountain on Earth." ->
"Mitochondria produce most of the cell's energy." 0.92, the same chunk). Classes are balanced by subsampling the
larger one. Whole documents are held out for evaluation, chosen by a stable hash of their name.

The cut threshold is chosen on training documents (a validation slice of them): the one that maximises boundary F1
over their adjacent sentences, read in order with the paragraphs joined (every paragraph break a gold cut). It is
saved in the card, and SegmenterConfig(threshold=None), the default, uses it.

With finetune_embedder, the encoder is then trained together with the head (SAGE trains both), starting from the
frozen-embedder head, and saved beside the head as a folder of its own (``<head stem>.embedder/``).
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


def topic_changes(docs: list[ParagraphDocument], n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n pairs (a sentence of one document, a sentence of another document), both drawn anywhere in them."""
    sentences = [document_sentences(d)[0] for d in docs]
    usable = [i for i, s in enumerate(sentences) if s]
    if len(usable) < 2:
        return []
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        a, b = rng.sample(usable, 2)
        out.append((rng.choice(sentences[a]), rng.choice(sentences[b])))
    return out


def triplets(docs: list[ParagraphDocument], max_pairs: int | None = None, seed: int = 0,
             topic_fraction: float = 0.25) -> tuple[list[str], list[str], np.ndarray]:
    """Balanced <s1, s2, label> triplets: 1 inside a paragraph, 0 across a paragraph break or (a share
    topic_fraction of the negatives) across a change of document."""
    if not 0.0 <= topic_fraction <= 1.0:
        raise ValueError(f"topic_fraction must be in [0, 1]; got {topic_fraction}")
    pos, neg = [], []
    for doc in docs:
        texts, para = document_sentences(doc)
        for i in range(len(texts) - 1):
            (pos if para[i] == para[i + 1] else neg).append((texts[i], texts[i + 1]))
    rng = random.Random(seed)
    n = len(pos) if topic_fraction == 1.0 else min(len(pos), int(len(neg) / (1.0 - topic_fraction)))
    if max_pairs is not None:
        n = min(n, max_pairs // 2)
    n_topic = n - min(len(neg), n - int(round(n * topic_fraction)))
    topic = topic_changes(docs, n_topic, seed + 7919) if n_topic else []
    if n == 0 or len(topic) < n_topic:
        raise ValueError("the documents hold no paragraph break (or no paragraph with two sentences)")
    negatives = rng.sample(neg, n - n_topic) + topic
    pairs = [(a, b, 1) for a, b in rng.sample(pos, n)] + [(a, b, 0) for a, b in negatives]
    rng.shuffle(pairs)
    return [p[0] for p in pairs], [p[1] for p in pairs], np.array([p[2] for p in pairs], dtype=np.float32)


def sequence_pairs(docs: list[ParagraphDocument]) -> tuple[list[str], list[str], np.ndarray]:
    """Every adjacent sentence pair of the documents read in order: 1 inside a paragraph, 0 at a break."""
    s1, s2, y = [], [], []
    for doc in docs:
        texts, para = document_sentences(doc)
        for i in range(len(texts) - 1):
            s1.append(texts[i])
            s2.append(texts[i + 1])
            y.append(float(para[i] == para[i + 1]))
    return s1, s2, np.array(y, dtype=np.float32)


def choose_threshold(p: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(threshold, boundary F1): the cut threshold (cut where p < t) on a grid of 0.01 that maximises the F1 of
    the cuts against the gold breaks (y == 0); ties go to the threshold nearest 0.5."""
    best = (-1.0, 0.5)
    breaks = y == 0
    for t in np.round(np.arange(0.05, 0.96, 0.01), 2):
        cut = p < t
        tp = float(np.sum(cut & breaks))
        prec = tp / max(float(cut.sum()), 1.0)
        rec = tp / max(float(breaks.sum()), 1.0)
        f1 = 2 * prec * rec / max(prec + rec, 1e-12)
        if f1 > best[0] + 1e-12 or (abs(f1 - best[0]) <= 1e-12 and abs(t - 0.5) < abs(best[1] - 0.5)):
            best = (f1, float(t))
    return best[1], best[0]


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


def _evaluate(head, embedder, threshold: float, mixed, breaks, topic, sequence) -> dict:
    """Held-out figures of one head with one embedder: balanced pairs as trained, paragraph breaks alone, topic
    changes (the share cut at the threshold), and the documents read in order (boundary F1 at the threshold)."""
    out = {}
    for name, (a, b, y) in (("mixed", mixed), ("breaks", breaks)):
        out[name] = _metrics(head.score_adjacent_pairs(*_embed_pairs(embedder, a, b)), y)
    p = head.score_adjacent_pairs(*_embed_pairs(embedder, [a for a, _ in topic], [b for _, b in topic]))
    out["topic_changes"] = {"cut_at_threshold": float(np.mean(p < threshold)), "median_p_same": float(np.median(p)),
                            "n": len(topic)}
    a, b, y = sequence
    p = head.score_adjacent_pairs(*_embed_pairs(embedder, a, b))
    cut, gold = p < threshold, y == 0
    tp = float(np.sum(cut & gold))
    prec, rec = tp / max(float(cut.sum()), 1.0), tp / max(float(gold.sum()), 1.0)
    out["in_order"] = {"threshold": threshold, "break_precision": prec, "break_recall": rec,
                       "break_f1": 2 * prec * rec / max(prec + rec, 1e-12), "pairs": int(len(y)),
                       "breaks": int(gold.sum())}
    return out


FINETUNE = {"optimizer": "AdamW", "lr": 2e-5, "head_lr": 1e-4, "batch_size": 32}  # finetune_embedder's defaults


def finetune_embedder(embedder, head, s1: list[str], s2: list[str], y: np.ndarray, out_dir: Path, *,
                      epochs: int = 1, lr: float = FINETUNE["lr"], head_lr: float = FINETUNE["head_lr"],
                      batch_size: int = FINETUNE["batch_size"],
                      max_length: int = 128, seed: int = 0, progress: bool = True):
    """Trains the encoder and the head together on the pairs (binary cross-entropy on p(same chunk) over
    mean-pooled, normalised embeddings, as the Embedder computes them), starting from `embedder` and `head`.
    Writes the encoder to out_dir (config.json, tokenizer.json, model.safetensors: an Embedder folder) and
    returns (Embedder over it, the new head). Needs an encoder certrag.bert builds (BERT-style)."""
    import shutil

    from certrag import bert
    from certrag.backends import import_torch
    from certrag.embed import Embedder
    from certrag.segment.head import SegmenterHead
    from tokenizers import Tokenizer
    from tqdm.auto import tqdm

    torch = import_torch()
    torch.manual_seed(seed)
    src = Path(embedder.model_dir)
    model = bert.load(src, torch, classifier=False)
    if model is None:
        raise ValueError(f"fine-tuning needs a BERT-style encoder; {src} is not one certrag.bert can build")
    model.train()
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.enable_truncation(max_length)
    pad_id = tok.token_to_id("[PAD]") or 0
    tok.enable_padding(pad_id=pad_id)
    mlp = torch.nn.Sequential(torch.nn.Linear(4 * head.dim, head.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(head.hidden, 1))
    with torch.no_grad():
        mlp[0].weight.copy_(torch.from_numpy(head.w1))
        mlp[0].bias.copy_(torch.from_numpy(head.b1))
        mlp[2].weight.copy_(torch.from_numpy(head.w2)[None])
        mlp[2].bias.fill_(head.b2)
    opt = torch.optim.AdamW([{"params": model.parameters(), "lr": lr}, {"params": mlp.parameters(), "lr": head_lr}],
                            weight_decay=1e-4)

    def embed(texts):
        enc = tok.encode_batch(texts)
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        hidden = model.hidden(ids, mask)
        m = mask[..., None].float()
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
        return torch.nn.functional.normalize(pooled, dim=1)

    target = torch.from_numpy(y)
    gen = torch.Generator().manual_seed(seed)
    steps = epochs * -(-len(y) // batch_size)
    bar = tqdm(total=steps, desc="fine-tuning embedder + head", disable=not progress)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=gen).tolist()
        for start in range(0, len(perm), batch_size):
            idx = perm[start:start + batch_size]
            a, b = embed([s1[i] for i in idx]), embed([s2[i] for i in idx])
            logits = mlp(torch.cat([a, b, a - b, a * b], dim=1)).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.update(1)
            bar.set_postfix(loss=round(float(loss.detach()), 4))
    bar.close()
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(staging / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        shutil.copy2(src / name, staging / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    new_head = SegmenterHead(mlp[0].weight.detach().numpy().copy(), mlp[0].bias.detach().numpy().copy(),
                             mlp[2].weight.detach().numpy()[0].copy(), float(mlp[2].bias.detach().numpy()[0]))
    tuned = Embedder(model_dir=out_dir, name=f"{embedder.name}+segmenter-finetuned", backend=embedder.backend.backend)
    return tuned, new_head


def train_segmenter(out: str | Path, *, sources: tuple[str, ...] = ("wiki", "pydoc"), max_pairs: int = 24000,
                    hidden: int = 256, epochs: int = 30, lr: float = 1e-3, seed: int = 0, held_out: float = 0.2,
                    topic_fraction: float = 0.25, finetune_epochs: int = 0, embedder=None,
                    documents: list[ParagraphDocument] | None = None, progress: bool = True):
    """Builds triplets, embeds them, trains the head, chooses its threshold on training documents, evaluates on
    held-out documents and saves head + card. With finetune_epochs > 0 the encoder is then trained with the head
    for that many epochs and saved beside it (``<stem>.embedder/``; the card's "embedder_dir" names it)."""
    from certrag.embed import Embedder

    started = time.time()
    out = Path(out)
    embedder = embedder or Embedder.default()
    docs = documents if documents is not None else load_sources(list(sources), seed=seed)
    train_docs, test_docs = split_documents(docs, held_out)
    # A validation slice of the training documents picks the epoch and the threshold; held-out documents report.
    fit_docs = [d for d in train_docs if stable_fraction("val:" + d.name) >= 0.1]
    val_docs = [d for d in train_docs if stable_fraction("val:" + d.name) < 0.1]
    s1, s2, y = triplets(fit_docs, max_pairs, seed, topic_fraction)
    v1, v2, vy = triplets(val_docs, max(2, max_pairs // 8), seed + 2, topic_fraction)
    held = {"mixed": triplets(test_docs, max(2, max_pairs // 4), seed + 1, topic_fraction),
            "breaks": triplets(test_docs, max(2, max_pairs // 4), seed + 3, 0.0),
            "topic": topic_changes(test_docs, max(2, max_pairs // 8), seed + 5),
            "sequence": sequence_pairs(test_docs)}
    log.info("embedding %d training pairs", len(y))
    x1, x2 = _embed_pairs(embedder, s1, s2)
    f1, f2 = _embed_pairs(embedder, v1, v2)
    e1, e2 = _embed_pairs(embedder, *held["mixed"][:2])
    ty = held["mixed"][2]
    from certrag.segment.head import SegmenterHead

    untrained = SegmenterHead.random(embedder.dim, hidden, seed)
    before = _metrics(untrained.score_adjacent_pairs(e1, e2), ty)
    head, history = train_head(x1, x2, y, hidden=hidden, epochs=epochs, lr=lr, seed=seed,
                               eval_data=(e1, e2, ty), val_data=(f1, f2, vy), progress=progress)
    val_sequence = sequence_pairs(val_docs)

    def threshold_for(h, emb):
        return choose_threshold(h.score_adjacent_pairs(*_embed_pairs(emb, *val_sequence[:2])), val_sequence[2])

    threshold, val_f1 = threshold_for(head, embedder)
    figures = _evaluate(head, embedder, threshold, held["mixed"], held["breaks"], held["topic"], held["sequence"])
    finetuned = None
    if finetune_epochs > 0:
        emb_dir = out.with_name(out.stem + ".embedder")
        tuned, tuned_head = finetune_embedder(embedder, head, s1, s2, y, emb_dir, epochs=finetune_epochs, seed=seed,
                                              progress=progress)
        tuned_threshold, tuned_val_f1 = threshold_for(tuned_head, tuned)
        finetuned = {"embedder_dir": emb_dir.name, "epochs": finetune_epochs, **FINETUNE, "threshold": tuned_threshold,
                     "validation_in_order_f1": tuned_val_f1,
                     "held_out": _evaluate(tuned_head, tuned, tuned_threshold, held["mixed"], held["breaks"],
                                           held["topic"], held["sequence"])}
        frozen_figures = figures
        head, threshold, val_f1, figures = tuned_head, tuned_threshold, tuned_val_f1, finetuned["held_out"]
    head.card = {
        "kind": "certrag segmenter head (SAGE)",
        "architecture": "sigmoid(w2 . relu(W1 [x1, x2, x1 - x2, x1 * x2] + b1) + b2)",
        "embedder": embedder.name if finetuned is None else f"{embedder.name}+segmenter-finetuned",
        "dim": embedder.dim, "hidden": hidden,
        "threshold": threshold,
        "threshold_rule": "maximises boundary F1 over the validation documents' adjacent sentences, read in order "
                          f"(validation F1 {val_f1:.3f})",
        "sources": list(sources) if documents is None else ["custom"],
        "documents": {"train": len(fit_docs), "validation": len(val_docs), "held_out": len(test_docs),
                      "held_out_rule": f"sha256(document name) < {held_out}",
                      "validation_rule": "sha256('val:' + name) < 0.1 among the rest; picks the epoch and the "
                                         "threshold"},
        "pairs": {"train": int(len(y)), "validation": int(len(vy)), "held_out": int(len(ty)), "balanced": True,
                  "topic_fraction": topic_fraction},
        "training": {"optimizer": "Adam", "lr": lr, "weight_decay": 1e-4, "batch_size": 256, "epochs": epochs,
                     "steps": int(epochs * -(-len(y) // 256)), "seed": seed, "embedder_frozen": finetuned is None,
                     "selected_epoch": history[-1].get("selected_epoch")},
        "held_out_before_training": before, "held_out": figures["mixed"],
        "held_out_figures": figures,
        "history": history,
        "seconds": round(time.time() - started, 1),
        "remake": f"certrag train-segmenter --out {out} --sources {','.join(sources)} --max-pairs {max_pairs} "
                  f"--epochs {epochs} --seed {seed} --topic-fraction {topic_fraction}"
                  + (f" --finetune-epochs {finetune_epochs}" if finetune_epochs else ""),
    }
    if finetuned is not None:
        head.card["embedder_dir"] = finetuned["embedder_dir"]
        head.card["finetune"] = {k: v for k, v in finetuned.items() if k != "held_out"}
        head.card["held_out_figures_frozen_embedder"] = frozen_figures
    head.save(out)
    return head
