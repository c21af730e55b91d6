"""What entry points wrap stages with: dynamic batching of the encoders (batching.py), the one bridge from a worker
thread to a synchronous or asynchronous stream (streams.py). Ray's remote handles are in certrag.scale.serving."""
