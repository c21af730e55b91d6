"""The certification every store starts with: a conformal calibration made on the NQ-open *calibration* split with
a shipped reranker, shipped beside it (certrag/<reranker>/calibration-nq-open.json), used by a store that has no
calibration of its own (certrag.engine.Engine.calibration: source "default").

Store: the NQ-open gold passages of every split and the bundled Wikipedia leads, one chunk per passage (the store of
benchmarks/_nq.py), built in a temporary folder with the default embedder and the given reranker. Calibration:
certrag.certify.calibration.calibrate on 'nq-open:calibration' (alpha 0.1, 30% of it held out for the diagnostics),
20 candidates. The test split is never read here.

    python -m certrag.train.default_calibration                       # the default reranker
    python -m certrag.train.default_calibration --reranker certrag-minilm-l3-cross-encoder
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from certrag.certify.conformal import DEFAULT_CALIBRATION_FILE as DEFAULT_FILE

SOURCE = ("calibrated on NQ-open (its calibration split, a store of its passages and Wikipedia leads), not on this "
          "store: run `certrag calibrate` on your data for a stated coverage there")


def nq_store(path: Path, reranker_name: str):
    from certrag.config import EngineConfig, IndexConfig, RetrievalConfig
    from certrag.data.corpora import retrieval_corpus
    from certrag.engine import Engine
    from certrag.segment import SegmenterConfig

    config = EngineConfig(chunker="fixed_sentence", segmenter=SegmenterConfig(min_tokens=1, max_tokens=256),
                          index=IndexConfig(ef_search=128), retrieval=RetrievalConfig(candidates=20),
                          reranker=reranker_name)
    return Engine.build(retrieval_corpus(), path, config)


def make(reranker_name: str, alpha: float = 0.1) -> Path:
    from certrag.certify.calibration import calibrate
    from certrag.rerank import PACKAGE_RERANKERS

    out = Path(PACKAGE_RERANKERS[reranker_name]) / DEFAULT_FILE
    with tempfile.TemporaryDirectory(prefix="certrag-nq-store-") as scratch:
        with nq_store(Path(scratch) / "store", reranker_name) as engine:
            record, _, _ = calibrate(engine, "nq-open:calibration", alpha=alpha, holdout=0.3, candidates=20)
    import dataclasses

    record = dataclasses.replace(record, chunks=None, source=SOURCE)  # any store: its size says nothing here
    record.save(out)
    return out


def main() -> None:
    from certrag.rerank import DEFAULT_RERANKER, PACKAGE_RERANKERS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reranker", choices=list(PACKAGE_RERANKERS), default=DEFAULT_RERANKER)
    p.add_argument("--alpha", type=float, default=0.1)
    args = p.parse_args()
    print(make(args.reranker, args.alpha))


if __name__ == "__main__":
    main()
