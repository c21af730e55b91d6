"""Certified retrieval and factual confidence: how far an answer can be trusted.

conformal.py     the split-conformal statistics, the stored Calibration, Diagnostics (m1, m2, coverage) and the
                 Certification of one retrieval
calibration.py   making a calibration: items, the judge of correct chunks, calibrate, the coverage sweep and plot
lookback.py      lookback ratios recorded during generation (the CPU path and the Triton kernel's caller)
factuality.py    the runtime classifier: P(supported) from lookback features (training: certrag.train.factuality)
"""
