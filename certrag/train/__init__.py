"""Everything certrag trains, behind the CLI: the segmenter head (segmenter.py), the reranker (reranker.py) and the
factuality classifier (factuality.py). Nothing at run time imports this package."""
