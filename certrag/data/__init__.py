"""Library data: NQ-open and its fixed splits, the retrieval and segmentation corpora, synthetic vectors, and the
stable hash every split is drawn from. Imported by eval/ and train/ (and by calibration for 'nq-open:<split>');
nothing here imports a stage above it."""
