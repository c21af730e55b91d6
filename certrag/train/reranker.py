"""Training the fused cross-encoder reranker (certrag.rerank) on the NQ-open train split.

Data: for each train-split question (DESIGN.md's split; never calibration or test), the gold passage is the positive
and hard negatives are the bi-encoder's top-ranked other passages of a mining corpus (the train split's gold passages
plus 10k Wikipedia leads), skipping any that contain a gold answer string (likely false negatives). A slice of the
train questions (by stable hash) is kept aside to choose the epoch; held-out metrics are measured on it.

Model: BertForSequenceClassification (one logit) started from the bundled MiniLM encoder; its output layer starts at
zero and the fused score ce + w * cos starts with w = w0, so step 0 ranks exactly like the bi-encoder. Loss: softmax
cross-entropy over each group (positive first, then negatives) of fused scores.

Distillation (teacher=, layers=): a smaller reranker for where the cross-encoder is the query's cost. The student
starts from the teacher's own weights with only `layers` of its encoder layers kept (evenly spaced, ending with the
last, whose output the classifier reads), its fusion weight from the teacher's card, and learns from the gold
label and the teacher's fused scores over the same group: loss = cross-entropy(gold) + KL(teacher || student) of
the group's softmax. The teacher's scores are computed once, before training.

Held out, beside MRR@10, the separation: the AUROC of the gold passage's fused score against the best answer-free
candidate's, across validation questions -- what an abstention threshold on the best score sees (a listwise loss
fixes only the order within one question). A pointwise term (the gold above one learnt offset, the negatives below)
was tried for it and lowered it (0.892 -> 0.884, commit a210d5f; benchmarks/results/reranker_l3_pointwise_card.json).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import string
import time
from pathlib import Path

import numpy as np

from certrag.atomic import publish_folder
from certrag.data.splits import stable_fraction
from certrag.rerank import L6_RERANKER

log = logging.getLogger(__name__)


def _normalise(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


VAL_FRACTION = 0.15  # the train questions a reranker holds out to choose its epoch (both shipped ones: this rule)


def held_out(question: str, fraction: float = VAL_FRACTION) -> bool:
    """Whether a train-split question is in the rerankers' validation slice: never learned from, so what is tuned
    on the reranker's scores (a selection threshold) can be chosen on it without the reranker's memory of the rest
    of train flattering it."""
    return stable_fraction("rerank-val:" + question) < fraction


def mrr_at_10(score_lists: list[np.ndarray], gold_positions: list[int]) -> float:
    """Mean reciprocal rank (cut at 10) of the gold candidate, given each question's candidate scores."""
    total = 0.0
    for scores, gold in zip(score_lists, gold_positions):
        if gold < 0:
            continue
        rank = int(np.sum(scores > scores[gold])) + 1
        total += 1.0 / rank if rank <= 10 else 0.0
    return total / max(1, len(score_lists))


def kept_layers(total: int, keep: int) -> list[int]:
    """keep of total layer indices, evenly spaced and ending with the last (6 -> 3: [1, 3, 5])."""
    if not 1 <= keep <= total:
        raise ValueError(f"keep must be between 1 and {total}; got {keep}")
    return [total - 1 - round(i * total / keep) for i in reversed(range(keep))]


def separation_auroc(score_lists: list[np.ndarray], gold_positions: list[int],
                     answer_free: list[np.ndarray]) -> float:
    """AUROC of the gold candidate's score against the best answer-free candidate's, across questions (questions
    without a gold candidate or without an answer-free one are left out of their side)."""
    from certrag.train.factuality import auroc

    golds = [float(s[g]) for s, g in zip(score_lists, gold_positions) if g >= 0]
    tops = [float(np.max(s[free])) for s, free in zip(score_lists, answer_free) if np.any(free)]
    if not golds or not tops:
        raise ValueError("separation_auroc needs at least one gold and one answer-free candidate")
    return auroc(np.r_[np.ones(len(golds)), np.zeros(len(tops))], np.r_[golds, tops])


def train_reranker(out: str | os.PathLike, *, negatives: int = 7, candidates: int = 30, epochs: int = 2,
                   lr: float = 3e-5, max_length: int = 192, dense_weight: float = 20.0, val_fraction: float = VAL_FRACTION,
                   seed: int = 0, max_questions: int | None = None, time_budget_s: float | None = None,
                   progress: bool = True, teacher: str | os.PathLike | None = None, layers: int | None = None,
                   evals_per_epoch: int = 1) -> dict:
    from tqdm.auto import tqdm

    from certrag.backends import import_torch
    from certrag.embed import Embedder, EmbeddingCache, default_model_dir
    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import load_nq_open, passage_text
    from certrag.home import certrag_home

    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers must be a positive integer; got {layers!r}")
    if isinstance(evals_per_epoch, bool) or not isinstance(evals_per_epoch, int) or evals_per_epoch < 1:
        raise ValueError(f"evals_per_epoch must be a positive integer; got {evals_per_epoch!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in (0, 1); got {val_fraction!r}")
    teacher_card = None
    if teacher is not None:
        teacher = Path(teacher)
        if not (teacher / "card.json").exists():
            raise FileNotFoundError(f"teacher: no reranker card at {teacher / 'card.json'}")
        teacher_card = json.loads((teacher / "card.json").read_text())
        dense_weight = float(teacher_card["dense_weight"])
    torch = import_torch()
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertForSequenceClassification

    started = time.time()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    embedder = Embedder(cache=EmbeddingCache(certrag_home() / "embeddings-all-MiniLM-L6-v2.safetensors"))
    train = load_nq_open(split="train")
    if max_questions:
        train = train[:max_questions]
    corpus = sorted({it.gold_text for it in train} | {passage_text(t, x) for t, x, _ in wiki_leads()})
    log.info("mining corpus: %d passages; %d train questions", len(corpus), len(train))
    def embed_all(texts: list[str], desc: str) -> np.ndarray:
        # in slices, for a progress bar: a row's vector does not depend on its batch (certrag.embed pads to a grid)
        parts = [embedder.embed(texts[i:i + 1024])
                 for i in tqdm(range(0, len(texts), 1024), desc=desc, unit="x1024", disable=not progress)]
        return np.concatenate(parts) if parts else np.zeros((0, embedder.dim), np.float32)

    corpus_emb = embed_all(corpus, "embedding the mining corpus")
    q_emb = embed_all([it.question for it in train], "embedding the train questions")
    position = {t: i for i, t in enumerate(corpus)}

    groups, val = [], []
    for it, q in tqdm(list(zip(train, q_emb)), desc="mining hard negatives", unit="q", disable=not progress):
        scores = corpus_emb @ q
        top = np.argsort(-scores)[:candidates]
        gold = position[it.gold_text]
        answers = [_normalise(a) for a in it.answers if _normalise(a)]
        if held_out(it.question, val_fraction):
            cand = list(top) if gold in top else list(top[:-1]) + [gold]
            free = np.array([i != gold and not any(a in _normalise(corpus[i]) for a in answers) for i in cand])
            val.append((it.question, [corpus[i] for i in cand], scores[cand].astype(np.float32), cand.index(gold),
                        free))
            continue
        negs = [i for i in top if i != gold and not any(a in _normalise(corpus[i]) for a in answers)]
        if not negs:
            continue
        chosen = negs[:negatives]
        groups.append((it.question, [corpus[gold]] + [corpus[i] for i in chosen],
                       np.array([scores[gold]] + [scores[i] for i in chosen], dtype=np.float32)))
    log.info("%d training groups, %d validation questions", len(groups), len(val))

    base = default_model_dir()
    source = base if teacher is None else teacher
    config = BertConfig.from_pretrained(str(source), num_labels=1, local_files_only=True)
    model = BertForSequenceClassification.from_pretrained(str(source), config=config, local_files_only=True,
                                                          dtype=torch.float32)
    if teacher is None:
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.zero_()
    total_layers = len(model.bert.encoder.layer)
    if layers is not None and layers > total_layers:  # said before the teacher's scores take minutes
        raise ValueError(f"layers must be at most the model's {total_layers}; got {layers}")
    w = torch.nn.Parameter(torch.tensor(float(dense_weight)))
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.enable_truncation(max_length, strategy="only_second")
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")

    def forward(question: str, passages: list[str]):
        enc = tokenizer.encode_batch([(question, p) for p in passages])
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        types = torch.tensor([e.type_ids for e in enc])
        return model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits[:, 0]

    targets, kept = None, None
    if teacher is not None:
        model.eval()
        with torch.inference_mode():
            targets = [forward(q, passages) + dense_weight * torch.from_numpy(dscores)
                       for q, passages, dscores in tqdm(groups, desc="the teacher's scores", unit="group",
                                                        disable=not progress)]
        model.train()
    if layers is not None and layers < total_layers:
        kept = kept_layers(total_layers, layers)
        model.bert.encoder.layer = torch.nn.ModuleList([model.bert.encoder.layer[i] for i in kept])
        model.config.num_hidden_layers = layers

    def evaluate() -> tuple[float, float, float]:
        """(fused MRR@10, the bi-encoder's MRR@10, the fused scores' separation AUROC) on the validation questions."""
        model.eval()
        fused, dense = [], []
        with torch.inference_mode():
            for q, passages, dscores, _, _ in val:
                ce = forward(q, passages).numpy()
                fused.append(ce + float(w.detach()) * dscores)
                dense.append(dscores)
        model.train()
        golds = [v[3] for v in val]
        return (mrr_at_10(fused, golds), mrr_at_10(dense, golds),
                separation_auroc(fused, golds, [v[4] for v in val]))

    opt = torch.optim.AdamW([{"params": model.parameters(), "lr": lr}, {"params": [w], "lr": 1e-2}],
                            weight_decay=0.01)
    total_steps = epochs * len(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / max(1, total_steps // 10)) * max(0.0, 1 - step / max(1, total_steps)))
    mrr0, dense_mrr, sep0 = evaluate()
    history = [{"step": 0, "val_mrr10": mrr0, "dense_mrr10": dense_mrr, "val_separation_auroc": sep0,
                "dense_weight": float(w.detach())}]
    best = (mrr0, 0, {k: v.detach().clone() for k, v in model.state_dict().items()}, float(w.detach()), sep0)
    log.info("step 0: validation MRR@10 %.4f (bi-encoder %.4f), separation AUROC %.4f", mrr0, dense_mrr, sep0)
    step, stopped = 0, False
    model.train()
    order = list(range(len(groups)))
    checkpoints = {round(len(groups) * (k + 1) / evals_per_epoch) for k in range(evals_per_epoch)}
    running = 0.0
    for epoch in range(epochs):
        rng.shuffle(order)
        bar = tqdm(order, desc=f"reranker epoch {epoch + 1}/{epochs}", disable=not progress)
        for done, g in enumerate(bar, 1):
            q, passages, dscores = groups[g]
            scores = forward(q, passages) + w * torch.from_numpy(dscores)
            loss = torch.nn.functional.cross_entropy(scores[None, :], torch.zeros(1, dtype=torch.long))
            if targets is not None:
                loss = loss + torch.nn.functional.kl_div(torch.log_softmax(scores, 0),
                                                         torch.log_softmax(targets[g], 0), log_target=True,
                                                         reduction="sum")
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            running = 0.98 * running + 0.02 * float(loss.detach()) if step > 1 else float(loss.detach())
            bar.set_postfix(loss=round(running, 4), w=round(float(w.detach()), 2))
            if time_budget_s and time.time() - started > time_budget_s:
                stopped = True
            if stopped or done in checkpoints:
                mrr, _, sep = evaluate()
                history.append({"step": step, "epoch": round(epoch + done / len(groups), 3), "val_mrr10": mrr,
                                "val_separation_auroc": sep, "dense_weight": float(w.detach()),
                                "train_loss_ema": running})
                log.info("step %d: validation MRR@10 %.4f (bi-encoder %.4f), separation AUROC %.4f", step, mrr,
                         dense_mrr, sep)
                if mrr > best[0]:
                    best = (mrr, step, {k: v.detach().clone() for k, v in model.state_dict().items()},
                            float(w.detach()), sep)
            if stopped:
                break
        if stopped:
            break

    model.load_state_dict(best[2])
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.half().save_pretrained(str(tmp), safe_serialization=True)
    shutil.copy(base / "tokenizer.json", tmp / "tokenizer.json")
    n_layers = len(model.bert.encoder.layer)
    if teacher is None:
        origin = "sentence-transformers/all-MiniLM-L6-v2 (encoder weights; new output layer, zero-initialised)"
        if kept is not None:
            origin += f"; encoder layers {kept} kept"
        remake = f"certrag train-reranker --out {out} --epochs {epochs} --negatives {negatives} --seed {seed}"
    else:
        origin = (f"distilled from {teacher_card.get('name', teacher)} ({teacher}): its weights with encoder layers "
                  f"{kept if kept is not None else list(range(n_layers))} kept, its fusion weight to start")
        remake = (f"certrag train-reranker --out {out} --teacher {teacher} --layers {n_layers} --epochs {epochs} "
                  f"--negatives {negatives} --lr {lr} --evals-per-epoch {evals_per_epoch} --seed {seed}")
    name = L6_RERANKER if teacher is None and kept is None else f"certrag-minilm-l{n_layers}-cross-encoder"
    if val_fraction != VAL_FRACTION:  # a probe for tuning on unseen train questions, not a shipped reranker
        name += f"-val{val_fraction:g}"
        remake += f" --val-fraction {val_fraction:g}"
    if time_budget_s:
        remake += f" --time-budget {time_budget_s:g}"
    card = {
        "name": name,
        "kind": "cross-encoder reranker fused with the dense score: ce(q, p) + dense_weight * cos(q, p)",
        "base_model": origin,
        "layers": n_layers,
        "dense_weight": best[3],
        "data": {"source": "NQ-open train split (certrag.data.splits.split_of)", "groups": len(groups),
                 "negatives_per_group": negatives, "mined_from_top": candidates,
                 "mining_corpus": f"{len(corpus)} passages: train-split gold passages + Wikipedia leads",
                 "false_negative_filter": "negatives containing a gold answer string are skipped",
                 "validation_questions": len(val), "validation_rule": f"sha256('rerank-val:' + q) < {val_fraction}"},
        "training": {"optimizer": "AdamW", "lr": lr, "dense_weight_lr": 1e-2, "warmup": "10% linear, then linear decay",
                     "epochs": epochs, "steps": step, "selected_step": best[1], "max_length": max_length,
                     "loss": "softmax cross-entropy over each group" + (
                         "" if teacher is None else " + KL(teacher || student) of the group's softmax"),
                     "seed": seed, "evals_per_epoch": evals_per_epoch,
                     "stopped_by_time_budget": stopped},
        "held_out": {"mrr10_reranker": best[0], "mrr10_bi_encoder": dense_mrr, "separation_auroc": best[4],
                     "separation_auroc_at_start": sep0,
                     "note": "validation questions from the train split, never calibration or test"},
        "history": history,
        "dtype": "float16",
        "seconds": round(time.time() - started, 1),
        "remake": remake,
    }
    (tmp / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    publish_folder(tmp, out, replace=True)
    return card
