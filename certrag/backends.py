"""How the two encoders (the MiniLM embedder and the cross-encoder reranker) run on this CPU.

Backends, measured side by side in benchmarks/bench_encoders.py (RESULTS.md keeps the table, losers included):

- ``float32``: torch float32, the reference every other backend is checked against.
- ``bfloat16``: the weights and activations in bfloat16, accumulated in float32 by oneDNN. Needs a CPU with
  AVX512_BF16 (or AMX) to be fast; without it bfloat16 is emulated and slower than float32, so it falls back.
- ``int8``: every Linear with int8 weights (one scale per output channel) and its input quantised per row (one
  scale per token), multiplied exactly in int32 by fbgemm's VNNI kernels and rescaled to float32; the rest of the
  network runs in float32 (certrag.quantize). Because each token row has its own scale and integer products are
  exact, a text's numbers do not depend on what it is batched with (torch's dynamic quantisation takes one
  activation scale over the whole batch: the same pairs moved by up to 0.23 logits beside others, which under the
  server's dynamic batching would make a request's ranking depend on who else asked; bench_encoders keeps it as
  ``int8-dynamic`` for comparison). Needs VNNI to be fast; it falls back without it. Opt-in.
- ``auto`` (the default): the fastest backend that held the quality bounds and gives a text the same numbers
  whatever its batch -- bfloat16 where the CPU has it natively, else float32. (int8 held the reranker's bounds but
  not segmentation F1, -0.0057; with passes side by side it reranks 20 passages in 206 ms against bfloat16's 227,
  which makes `retrieve` only 5-6% faster here: not enough to make the default two backends; bench_encoders.)

A backend the CPU cannot run natively is never refused: it falls back to float32 at run time, as the native core's
SIMD dispatch does, and says so (``resolve`` returns the reason; ``certrag info`` shows it).

Whatever the backend, batches are sorted by length and each batch is cut to its own longest row, so no row pays for
padding up to the longest text of the call (``length_batches``); with several torch threads a call's batches run as
passes side by side, one thread each, rather than one after another on all threads (``passes``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

log = logging.getLogger(__name__)

BACKENDS = ("auto", "float32", "bfloat16", "int8")


def quiet_transformers() -> None:
    """transformers without its loading progress bars (encoders that certrag.bert does not build load through it)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def import_torch():
    """torch, imported with OpenMP's passive wait policy: spin-waiting OpenMP threads make 2-core machines slower,
    not faster, and the policy is read when the OpenMP runtime starts, so it must be set before torch is first
    imported. Every certrag module that loads torch models imports it through here."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    return torch


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The CPU features the backends depend on: a subset of {"avx512_bf16", "amx_bf16", "vnni"}."""
    found: set[str] = set()
    flags: set[str] = set()
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        break
        except OSError:
            flags = set()
    if "avx512_bf16" in flags:
        found.add("avx512_bf16")
    if "amx_bf16" in flags:
        found.add("amx_bf16")
    if flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        found.add("vnni")
    if "avx512_bf16" not in found:
        try:  # the native core's own CPUID check, which works off Linux too
            from certrag import _core

            if _core.build_info().get("bfloat16_pair_scorer"):
                found.add("avx512_bf16")
        except Exception:  # pragma: no cover - the core is part of the package
            pass
    return frozenset(found)


@dataclass(frozen=True)
class Resolved:
    requested: str
    backend: str  # float32 | bfloat16 | int8
    reason: str

    def as_dict(self) -> dict:
        return {"requested": self.requested, "backend": self.backend, "reason": self.reason}


def check_backend(name: object, argument: str = "backend") -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{argument} must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


def resolve(requested: str = "auto", features: frozenset[str] | None = None) -> Resolved:
    """The backend that runs for `requested` on a CPU with `features` (default: this one's), and why."""
    check_backend(requested)
    feats = cpu_features() if features is None else features
    has_bf16 = bool(feats & {"avx512_bf16", "amx_bf16"})
    if requested == "auto":
        if has_bf16:
            return Resolved(requested, "bfloat16", "auto: the CPU has native bfloat16 (AVX512_BF16/AMX)")
        return Resolved(requested, "float32", "auto: no native bfloat16 on this CPU")
    if requested == "bfloat16" and not has_bf16:
        return Resolved(requested, "float32", "fallback: bfloat16 asked for, but the CPU has no AVX512_BF16/AMX")
    if requested == "int8" and "vnni" not in feats:
        return Resolved(requested, "float32", "fallback: int8 asked for, but the CPU has no VNNI")
    return Resolved(requested, requested, "as configured")


def prepare(model, backend: str, *, per_text: bool = True):
    """The model converted for `backend` (float32 | bfloat16 | int8), in eval mode, its Linears replaced by ones
    whose every row's numbers do not depend on the rest of the batch (float32, bfloat16: per_text_linears, unless
    per_text=False -- an encoder with pad_grid 0, which promises no such thing; int8: certrag.quantize)."""
    import torch

    model = model.eval()
    wrap = per_text_linears if per_text else (lambda m: m)
    if backend == "float32":
        return wrap(model.float())
    if backend == "bfloat16":
        return wrap(model.to(torch.bfloat16))
    if backend == "int8":
        from certrag.quantize import rowwise_int8

        return rowwise_int8(model.float(), reduce_range="vnni" not in cpu_features())
    raise ValueError(f"backend must be float32, bfloat16 or int8; got {backend!r}")


_ALIGN = 64  # bytes: torch's CPU allocator aligns every tensor to this


@functools.lru_cache(maxsize=1)
def _per_text_linear_class():
    import torch

    class PerTextLinear(torch.nn.Module):
        """y = x W^T + b, one GEMM per text (the input's first dimension), on that text's rows alone.

        A BLAS picks its kernel, blocking and order of summation by the shape of the whole call (MKL on an Intel
        Xeon with AVX512_FP16 sums a row's products in another order when the call has more rows, so a text's float32
        embedding moved at 1e-7 with its batch companions; oneDNN's bfloat16 kernels choose by shape too). One call
        per text, its operands 64-byte aligned as a text alone would have them, gives every text the very call it
        gets alone: its numbers are a function of its own tokens (and padded width) whatever the batch, by
        construction rather than by what one CPU's library happens to do. The weights stay read from the cache
        between the calls of one layer (each call is one text's width x in_features)."""

        def __init__(self, linear: "torch.nn.Linear") -> None:
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.weight = linear.weight
            self.bias = linear.bias
            self._packed = _onednn_packed(linear.weight)

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":
            if x.dim() < 2:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            wt = self.weight.t()
            rows = []
            for b in range(x.shape[0]):
                xb = x[b].reshape(-1, self.in_features)
                if not xb.is_contiguous() or xb.data_ptr() % _ALIGN:
                    xb = xb.clone(memory_format=torch.contiguous_format)
                if self._packed is not None:
                    rows.append(torch.ops.mkldnn._linear_pointwise(xb, self._packed, self.bias, "none", [], ""))
                else:
                    rows.append(torch.mm(xb, wt) if self.bias is None else torch.addmm(self.bias, xb, wt))
            return torch.stack(rows).reshape(*x.shape[:-1], self.out_features)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, one GEMM per text"

    return PerTextLinear


def _onednn_packed(weight):
    """bfloat16 weights reordered once into oneDNN's blocked layout, or None (float32, or a torch without the op).

    oneDNN otherwise reorders a bfloat16 weight on every call; with one call per text that cost was a third of a
    short sentence's GEMM (measured: 64 texts of 16 tokens through a 384 x 1536 layer, 10.1 ms against 7.9 packed;
    one batched call 6.3). The packed and the plain call give the same numbers (the same kernel)."""
    import torch

    if weight.dtype != torch.bfloat16:
        return None
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
            probe = torch.ones(2, weight.shape[1], dtype=torch.bfloat16)
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def per_text_linears(module):
    """`module` with every torch.nn.Linear replaced, in place, by a PerTextLinear over the same parameters."""
    import torch

    cls = _per_text_linear_class()
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, cls(child))
        else:
            per_text_linears(child)
    return module


def grid_width(length: int, grid: int) -> int:
    """length rounded up to a multiple of grid (grid 0: unchanged)."""
    return -(-length // grid) * grid if grid > 0 else length


def length_batches(lengths: Sequence[int], batch_size: int, grid: int = 0,
                   max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Indices of rows in batches of at most batch_size, sorted by length (longest first, so that a memory problem
    shows in the first batch), so that each batch pads only to its own longest row.

    grid > 0: every row is padded to its length rounded up to a multiple of grid, and a batch holds rows of one
    padded width only. A row's result then depends on its own text alone, not on what it is batched with (a
    forward pass gives each row the same numbers whatever the batch size when no row is padded beyond its own
    width), so the dynamic batcher's answers are the ones a request gets alone. max_tokens: a batch also stops
    before its rows x padded width passes this (short rows go many to a batch, long ones few)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    budget = max_tokens if max_tokens is not None else np.iinfo(np.int64).max
    if grid <= 0:
        order = np.argsort(-lengths, kind="stable")
        start = 0
        while start < len(order):  # longest first: the first row of a batch is its width
            end = start + 1
            while end < len(order) and end - start < batch_size and (end - start + 1) * lengths[order[start]] <= budget:
                end += 1
            yield order[start:end]
            start = end
        return
    widths = -(-lengths // grid) * grid
    order = np.lexsort((np.arange(len(lengths)), -widths))
    start = 0
    while start < len(order):
        end, width = start + 1, widths[order[start]]
        while (end < len(order) and end - start < batch_size and widths[order[end]] == width
               and (end - start + 1) * width <= budget):
            end += 1
        yield order[start:end]
        start = end


def padded(encodings: list, rows: np.ndarray, pad_id: int = 0, grid: int = 0) -> dict[str, np.ndarray]:
    """input_ids, attention_mask and token_type_ids (int64, (len(rows), L)) of unpadded tokenizers Encodings, padded
    on the right to the rows' own longest length L (rounded up to a multiple of grid when grid > 0)."""
    width = grid_width(max(len(encodings[i].ids) for i in rows), grid)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    types = np.zeros((len(rows), width), dtype=np.int64)
    for r, i in enumerate(rows):
        e = encodings[i]
        n = len(e.ids)
        ids[r, :n] = e.ids
        mask[r, :n] = 1
        types[r, :n] = e.type_ids
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


# ------------------------------------------------------------------------------------- passes side by side

MAX_PASSES = 8
MIN_PASS_TOKENS = 256  # a call of fewer padded tokens runs as one pass (on one worker): cutting it costs more than it saves


class _PassPool:
    """MAX_PASSES threads whose torch runs on one thread each, set once when they start.

    torch keeps the intra-op thread count per thread but also as a process default that threads read when they first
    run an operation; setting it in a worker per task would leave that default at 1 for a moment, and a thread that
    started then (a server's request thread) would keep one thread for good. So the workers set theirs once, at
    start, and the default is put back before the pool is used."""

    def __init__(self, torch) -> None:
        import queue

        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = 0  # tasks queued or running
        self._idle = threading.Condition()
        ready = threading.Barrier(MAX_PASSES + 1)
        before = torch.get_num_threads()
        for i in range(MAX_PASSES):
            threading.Thread(target=self._work, args=(torch, ready), name=f"certrag-pass-{i}", daemon=True).start()
        ready.wait()
        torch.set_num_threads(before)  # the process default again, as it was

    def _work(self, torch, ready) -> None:
        torch.get_num_threads()  # this thread's own setting is made now, from the default
        torch.set_num_threads(1)
        ready.wait()
        while True:
            fn, arg, future = self._tasks.get()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(arg))
                    except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                        future.set_exception(exc)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def submit(self, fn, arg):
        from concurrent.futures import Future

        future: Future = Future()
        with self._idle:
            self._busy += 1
        self._tasks.put((fn, arg, future))
        return future

    def drain(self, timeout: float) -> bool:
        """Waits until no task is queued or running (True), or timeout seconds pass (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)


class LazyModel:
    """An encoder's prepared torch model, built on first use (once, under a lock): opening a store needs only an
    encoder's name and dimension, so it loads no torch. build(torch) returns the float32 model; it is prepared for
    `backend` (prepare). Replicas of an encoder share one LazyModel, so its weights load once."""

    def __init__(self, build, backend: str, *, per_text: bool) -> None:
        self._build, self._backend, self._per_text = build, backend, per_text
        self._loaded = None  # (torch, model)
        self._lock = threading.Lock()

    def get(self):
        """(torch, the prepared model)."""
        if self._loaded is None:
            with self._lock:
                if self._loaded is None:
                    torch = import_torch()
                    self._loaded = (torch, prepare(self._build(torch), self._backend, per_text=self._per_text))
        return self._loaded

    def set(self, model) -> None:
        """Another variant of the same weights in its place (bench_encoders: torch's dynamic int8)."""
        self._loaded = (self.get()[0], model)


class TorchThread:
    """One dedicated thread whose torch runs on num_threads intra-op threads, set once when it starts (the way
    _PassPool's workers set theirs): a model given its own thread count (a server's reranker instances) runs its
    calls here instead of setting and restoring the count on each caller's thread, which would move the process
    default under other threads for a moment. call(fn) runs fn there and returns its result (or raises its error);
    calls run one at a time, in order. A forked child starts its own thread on first use."""

    def __init__(self, num_threads: int, name: str = "certrag-torch") -> None:
        self.num_threads, self.name = num_threads, name
        self._pid, self._tasks = None, None
        self._start_lock = threading.Lock()

    def _start(self) -> None:
        import queue

        torch = import_torch()
        self._tasks = queue.SimpleQueue()
        ready = threading.Event()
        before = torch.get_num_threads()

        def work(tasks) -> None:
            torch.get_num_threads()  # this thread's own setting is made now, from the default
            torch.set_num_threads(self.num_threads)
            ready.set()
            while True:
                fn, future = tasks.get()
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                        future.set_exception(exc)

        threading.Thread(target=work, args=(self._tasks,), name=self.name, daemon=True).start()
        ready.wait()
        torch.set_num_threads(before)  # the process default again, as it was
        self._pid = os.getpid()

    def call(self, fn):
        from concurrent.futures import Future

        with self._start_lock:
            if self._pid != os.getpid():
                self._start()
        future: Future = Future()
        self._tasks.put((fn, future))
        return future.result()


_PASS_POOL: _PassPool | None = None
_PASS_POOL_LOCK = threading.Lock()


def _pass_pool(torch) -> _PassPool:
    global _PASS_POOL
    with _PASS_POOL_LOCK:
        if _PASS_POOL is None:
            _PASS_POOL = _PassPool(torch)
        return _PASS_POOL


def _forget_pass_pool() -> None:
    """In a forked child: its copy of the pool has no worker threads (and its lock may be held), so it makes its own."""
    global _PASS_POOL, _PASS_POOL_LOCK
    _PASS_POOL, _PASS_POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pass_pool)


def drain_passes(timeout: float = 60.0) -> bool:
    """Waits for the passes in flight to finish. The pool's threads are daemons: one still inside torch when the
    interpreter finalises is stopped as it takes the GIL back, which unwinds through C++ frames and aborts the process
    ("terminate called without an active exception", SIGABRT: Ctrl-C during `certrag index` did this 7 times in 9).
    So a caller whose call was interrupted (KeyboardInterrupt) drains before it exits; so does interpreter exit."""
    pool = _PASS_POOL
    return True if pool is None else pool.drain(timeout)


atexit.register(drain_passes)


def pass_groups(batches: list[np.ndarray], widths: Sequence[int], workers: int) -> list[list[np.ndarray]]:
    """The batches of one call shared among `workers` threads: costliest first (rows x padded width), each to the
    least loaded so far."""
    groups: list[list[np.ndarray]] = [[] for _ in range(max(1, workers))]
    load = [0] * len(groups)
    for rows in sorted(batches, key=lambda r: -len(r) * max(widths[i] for i in r)):
        k = load.index(min(load))
        groups[k].append(rows)
        load[k] += len(rows) * max(widths[i] for i in rows)
    return [g for g in groups if g]


def passes(torch, lengths: Sequence[int], batch_size: int, grid: int, run: Callable[[np.ndarray], None], *,
           max_tokens: int | None = None, max_passes: int = MAX_PASSES) -> None:
    """Calls run(rows) for every length batch of a call (length_batches), inside inference mode.

    With several torch threads the call's rows are batched for that many passes and the passes run side by side,
    one torch thread each, on a shared pool, instead of one pass after another on all threads: the encoders'
    matrices are small, and one pass on two threads spends much of its time waiting at the synchronisation of each
    operation (20 reranked NQ passages on 2 cores: 227 against 358 ms; benchmarks/bench_encoders.py); run must
    write disjoint rows only.

    A row's numbers do not depend on its batch: every pass runs on one torch thread (a pool worker, or the caller
    when its torch has one thread), so a BLAS never splits a product across threads differently for a larger call;
    the grid gives a row the same padded width in any batch; and the prepared models compute each text with calls of
    its own (certrag.backends.prepare). A call of fewer than MIN_PASS_TOKENS padded tokens is one pass, on one
    worker. grid 0 (rows padded to their batch's longest) or max_passes 1 keep one pass after another on all the
    caller's threads, without that promise."""
    from concurrent.futures import wait

    widths = [grid_width(n, grid) for n in lengths]
    invariant = grid > 0 and max_passes > 1
    threads = max(1, min(torch.get_num_threads(), max_passes, MAX_PASSES, len(lengths))) if invariant else 1
    here = not invariant or torch.get_num_threads() == 1
    if threads > 1 and sum(widths) < MIN_PASS_TOKENS:
        threads = 1
    if threads > 1:
        batch_size = min(batch_size, -(-len(lengths) // threads))  # at least one batch per thread
    batches = list(length_batches(lengths, batch_size, grid, max_tokens))
    if here:
        with torch.inference_mode():
            for rows in batches:
                run(rows)
        return

    def work(group: list[np.ndarray]) -> None:
        with torch.inference_mode():
            for rows in group:
                run(rows)

    pool = _pass_pool(torch)
    futures = [pool.submit(work, g) for g in pass_groups(batches, widths, threads)]
    wait(futures)  # every pass has finished writing before the call returns or raises
    for future in futures:
        future.result()
