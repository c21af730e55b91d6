"""Generation: certrag's decode engine against today's transformers path and llama.cpp on the same GGUF file.

Parts (issue 31), each in one run so every ratio is measured against its baseline on the same machine state:
  single       one stream: prefill tok/s on a ~1,000-token prompt and decode tok/s after it, for the engine's q8 and
               float32 formats, today's path (transformers generate in float32 on the converted folder) and
               llama.cpp (llama-cpp-python, built from its source package) on the same GGUF, at 1 and 2 threads,
               interleaved, median of the repeats
  concurrency  aggregate decode tok/s, TTFT and inter-token latency p50/p99 at 1, 2, 4, 8, 16 concurrent streams
               through the engine (short RAG prompts: an NQ-open question with its gold passage)
  recording    decode step time with lookback recording against without, at batch 1 and 8
  quality      q8 against float32 greedy tokens over N prompts (position of the first difference) and the gold
               answer's presence in the answer (NQ-open test questions with their gold passage)
  load         the engine's load time from its warm q8 cache, a first conversion from the GGUF packages into an
               empty CERTRAG_HOME, and the cache's bytes on disk

  serve        the same through `certrag serve` with the openai client, streamed, beside --serialize (one
               generation at a time, as the server ran before the engine)

Usage: python benchmarks/bench_generate.py [--parts single,concurrency,serve,recording,quality,load] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct"


def _gguf_file(scratch: Path) -> Path:
    from certrag.llm.models import BUNDLED_MODELS

    out = scratch / f"{MODEL}.gguf"
    if not out.exists():
        with open(out, "wb") as f:
            for part in BUNDLED_MODELS[MODEL].gguf_parts():
                f.write(part.read_bytes())
    return out


def _long_prompt(tokenizer, target: int = 1000) -> list[int]:
    from certrag.data.nq import load_nq_open

    items = load_nq_open(split="test")
    text = ""
    for it in items:
        text += it.gold_text + "\n\n"
        if len(tokenizer(text)["input_ids"]) > target:
            break
    messages = [{"role": "user", "content": "Summarise these passages at length, passage by passage.\n\n" + text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return ids


def _rag_prompts(llm, n: int, split: str = "test"):
    from certrag.data.nq import load_nq_open
    from certrag.llm.prompts import Passage, plain_messages

    items = load_nq_open(split=split)[:n]
    out = []
    for it in items:
        out.append((it, plain_messages(it.question, [Passage(it.gold_text)])))
    return out


def _long_answer_prompts(n: int):
    """Chats that make long answers (a passage explained sentence by sentence): decode, not prefill, dominates."""
    from certrag.data.nq import load_nq_open

    return [[{"role": "user", "content": "Explain this passage in detail, sentence by sentence:\n\n" + it.gold_text}]
            for it in load_nq_open(split="test")[:n]]


# -- single stream ---------------------------------------------------------------------------------------------

def part_single(args, scratch: Path) -> list[dict]:
    import torch

    from certrag.llm import LocalLLM
    from certrag.llm.engine import Request

    gguf = _gguf_file(scratch)
    llm = LocalLLM(MODEL)
    prompt = _long_prompt(llm.tokenizer)
    n_new = args.decode_tokens
    systems = {}

    def timed(engine):
        """(prefill tok/s, decode tok/s) of one engine on the prompt: a one-token answer, then n_new + 1 tokens."""
        t0 = time.perf_counter()
        engine.generate(Request(prompt=tuple(prompt), max_new_tokens=1))
        t1 = time.perf_counter()
        r = engine.generate(Request(prompt=tuple(prompt), max_new_tokens=n_new + 1))
        t2 = time.perf_counter()
        return len(prompt) / (t1 - t0), (len(r.token_ids) - 1) / ((t2 - t1) - (t1 - t0))

    for threads in args.threads:
        eng = LocalLLM(MODEL, num_threads=threads).engine
        systems[f"certrag q8, {threads} thread(s)"] = lambda eng=eng: timed(eng)
    ref = LocalLLM(MODEL, weights="float32").engine  # torch's products, on the engine's one torch thread
    systems["certrag float32 (reference), 1 thread"] = lambda: timed(ref)
    if not args.no_today:
        from transformers import AutoModelForCausalLM

        from certrag.llm.models import converted_model_dir

        hf = AutoModelForCausalLM.from_pretrained(str(converted_model_dir(MODEL)), local_files_only=True).eval()

        def run_today():
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                torch.set_num_threads(1)
                t0 = time.perf_counter()
                hf.generate(ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
                t1 = time.perf_counter()
                out = hf.generate(ids, max_new_tokens=n_new + 1, min_new_tokens=n_new + 1, do_sample=False)
                t2 = time.perf_counter()
            return len(prompt) / (t1 - t0), (out.shape[1] - len(prompt) - 1) / ((t2 - t1) - (t1 - t0))

        systems["today: transformers generate, float32, 1 thread"] = run_today
    try:
        from llama_cpp import Llama
    except ImportError:
        Llama = None
        print("llama-cpp-python is not installed (make bench-deps): llama.cpp rows skipped", file=sys.stderr)
    if Llama is not None:
        for threads in args.threads:
            lc = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False,
                       n_batch=512)

            def run_llama(lc=lc):
                lc.reset()
                t0 = time.perf_counter()
                lc.eval(prompt)
                t1 = time.perf_counter()
                count = 0
                for _ in lc.generate(prompt, temp=0.0, reset=True):
                    count += 1
                    if count == 1:
                        t_first = time.perf_counter()
                    if count > n_new:
                        break
                t2 = time.perf_counter()
                return len(prompt) / (t1 - t0), n_new / (t2 - t_first)

            systems[f"llama.cpp {getattr(sys.modules.get('llama_cpp'), '__version__', '')}, {threads} thread(s)"] = \
                run_llama
    results = {name: [] for name in systems}
    for name, fn in systems.items():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in systems.items():  # interleaved
            results[name].append(fn())
    rows = []
    for name, runs in results.items():
        rows.append({"part": "single", "system": name, "prompt_tokens": len(prompt), "decode_tokens": n_new,
                     "prefill_tok_s": statistics.median(r[0] for r in runs),
                     "decode_tok_s": statistics.median(r[1] for r in runs), "repeats": len(runs)})
    return rows


# -- concurrency -----------------------------------------------------------------------------------------------

def _run_streams(call, prompts) -> dict:
    """call(messages, stamp) for every prompt at once, a thread each; stamp() marks a streamed piece and call returns
    the stream's token count. Returns the wall time, the tokens, TTFT and inter-piece latencies, and the errors."""
    import numpy as np

    lock = threading.Lock()
    ttft, itl, tokens, errors = [], [], [], []

    def one(messages):
        stamps, start = [], time.perf_counter()
        try:
            count = call(messages, lambda *_: stamps.append(time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 -- counted in the row, e.g. an HTTP status
            with lock:
                errors.append(exc)
            return
        with lock:
            if stamps:
                ttft.append(stamps[0] - start)
                itl.extend(np.diff(stamps).tolist())
            tokens.append(count)

    start = time.perf_counter()
    workers = [threading.Thread(target=one, args=(m,)) for m in prompts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    def pct(values, q, unit=1.0):
        return float(np.percentile(values, q) * unit) if values else float("nan")

    return {"wall": time.perf_counter() - start, "tokens": int(sum(tokens)), "errors": errors,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_ms": pct(itl, 50, 1e3),
            "itl_p99_ms": pct(itl, 99, 1e3)}


def part_concurrency(args, scratch: Path) -> list[dict]:
    from certrag.llm import LocalLLM

    rows = []
    for threads in args.threads:
        llm = LocalLLM(MODEL, num_threads=threads)
        prompts = _long_answer_prompts(max(args.streams))
        llm.generate_batch(prompts[:2], max_new_tokens=4)  # warm-up
        for n in args.streams:
            engine = llm.engine
            decoded, seconds = engine.decoded, engine.decode_seconds
            run = _run_streams(lambda messages, stamp: llm.generate(
                messages, max_new_tokens=args.decode_tokens, on_text=stamp).output_tokens, prompts[:n])
            rows.append({"part": "concurrency", "system": f"certrag q8, {threads} thread(s)", "streams": n,
                         "tokens": run["tokens"], "wall_tok_s": run["tokens"] / run["wall"],
                         "decode_tok_s": (engine.decoded - decoded) / (engine.decode_seconds - seconds),
                         **{k: run[k] for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms")}})
            print(rows[-1], file=sys.stderr)
        llm.close()
    return rows


def _serve(extra: list[str]):
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "certrag.cli", "serve", "--model", MODEL, "--port", str(port),
                             "--queue-depth", "64", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("certrag serve did not become ready")


def part_serve(args, scratch: Path) -> list[dict]:
    """Concurrent streamed chats through `certrag serve` with the openai client: the engine against the server with
    --serialize (one request at a time, as generation ran before: the baseline)."""
    import openai

    rows = []
    prompts = _long_answer_prompts(max(args.streams))
    for label, extra in (("certrag serve (decode engine)", []), ("certrag serve --serialize (today)", ["--serialize"])):
        proc, url = _serve(extra)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            client.chat.completions.create(model=MODEL, messages=prompts[0], max_tokens=4)  # warm-up

            def chat(messages, stamp):
                count = 0
                for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                            max_tokens=args.decode_tokens):
                    if chunk.choices and chunk.choices[0].delta.content:
                        stamp()
                        count += 1
                return count

            for n in args.streams:
                run = _run_streams(chat, prompts[:n])
                statuses = [getattr(e, "status_code", 0) for e in run["errors"]]
                rows.append({"part": "serve", "system": label, "streams": n, "pieces": run["tokens"],
                             "wall_pieces_s": run["tokens"] / run["wall"],
                             "errors_5xx": sum(1 for code in statuses if code >= 500), "errors": len(statuses),
                             **{k: run[k] for k in ("ttft_p50_s", "itl_p50_ms", "itl_p99_ms")}})
                print(rows[-1], file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return rows


# -- recording -------------------------------------------------------------------------------------------------

def part_recording(args, scratch: Path) -> list[dict]:
    import torch

    from certrag.llm.decoder import Decoder, KVCache, Spans
    from certrag.llm.weights import load_q8, q8_cache_dir

    torch.set_num_threads(1)
    w = load_q8(q8_cache_dir(MODEL))
    d = Decoder(w)
    rows = []
    with torch.inference_mode():
        for batch in (1, 8):
            caches = []
            for _ in range(batch):
                c = KVCache.allocate(w, 700)
                c.k.normal_()
                c.v.normal_()
                caches.append(c)
            chunks = [(40 + 60 * i, 90 + 60 * i) for i in range(5)]

            def step(record):
                for c in caches:
                    c.length = 500
                spans = [Spans(500, chunks) if record else None for _ in caches]
                t0 = time.perf_counter()
                for _ in range(8):
                    d.decode(caches, [100] * batch, spans)
                return (time.perf_counter() - t0) / 8

            step(False), step(True)
            plain, rec = [], []
            for _ in range(args.repeats + 2):
                plain.append(step(False))
                rec.append(step(True))
            p, r = statistics.median(plain), statistics.median(rec)
            rows.append({"part": "recording", "batch": batch, "plain_step_ms": p * 1e3, "recording_step_ms": r * 1e3,
                         "ratio": r / p})
    return rows


# -- quality ---------------------------------------------------------------------------------------------------

def part_quality(args, scratch: Path) -> list[dict]:
    from certrag.eval.metrics import answer_in_text, exact_match
    from certrag.llm import LocalLLM

    q8 = LocalLLM(MODEL)
    f32 = LocalLLM(MODEL, weights="float32")
    prompts = _rag_prompts(q8, args.questions)
    rows = []
    results = {}
    for name, llm in (("q8", q8), ("float32", f32)):
        t0 = time.perf_counter()
        results[name] = llm.generate_batch([m for _, m in prompts], max_new_tokens=32)
        print(name, "answered in", time.perf_counter() - t0, file=sys.stderr)
    first_diff = []
    for a, b in zip(results["q8"], results["float32"]):
        d = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if d is None and len(a.token_ids) != len(b.token_ids):
            d = min(len(a.token_ids), len(b.token_ids))
        first_diff.append(d)
    for name in ("q8", "float32"):
        hits = [answer_in_text(g.text, it.answers) for (it, _), g in zip(prompts, results[name])]
        em = [exact_match(g.text, it.answers) for (it, _), g in zip(prompts, results[name])]
        rows.append({"part": "quality", "format": name, "questions": len(prompts),
                     "answer_contains_gold": sum(hits) / len(hits), "em": sum(em) / len(em)})
    same = sum(d is None for d in first_diff)
    rows.append({"part": "quality", "format": "q8 vs float32", "questions": len(prompts), "identical": same,
                 "first_difference_positions": sorted(d for d in first_diff if d is not None)})
    return rows


# -- load ------------------------------------------------------------------------------------------------------

def part_load(args, scratch: Path) -> list[dict]:
    import subprocess

    rows = []
    code = ("import time; t=time.perf_counter(); from certrag.llm import LocalLLM; "
            f"llm=LocalLLM({MODEL!r}); g=llm.generate([{{'role':'user','content':'Say hi.'}}], max_new_tokens=4); "
            "print(time.perf_counter()-t)")
    with tempfile.TemporaryDirectory(dir=scratch) as home:
        env = {**os.environ, "CERTRAG_HOME": home}
        for label in ("first answer on a fresh install (conversion included)", "later loads (warm cache)"):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            rows.append({"part": "load", "what": label, "seconds": float(out.stdout.strip().splitlines()[-1])})
        size = sum(p.stat().st_size for p in Path(home).rglob("*") if p.is_file())
        rows.append({"part": "load", "what": "CERTRAG_HOME bytes after the first answer", "bytes": size})
    from certrag.llm.models import BUNDLED_MODELS

    pkg = sum(p.stat().st_size for p in BUNDLED_MODELS[MODEL].gguf_parts())
    rows.append({"part": "load", "what": "the reader's GGUF packages (site-packages)", "bytes": pkg})
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    out = ["## Generation (bench_generate.py, issue 31)", ""]
    single = [r for r in rows if r["part"] == "single"]
    if single:
        out += [f"One stream, the default reader, a {single[0]['prompt_tokens']}-token prompt, then "
                f"{single[0]['decode_tokens']} greedy tokens; medians of {single[0]['repeats']} interleaved runs.", ""]
        today = next((r for r in single if r["system"].startswith("today")), None)
        lc1 = next((r for r in single if r["system"].startswith("llama.cpp") and r["system"].endswith("1 thread(s)")),
                   None)
        table = []
        for r in single:
            table.append([r["system"], r["prefill_tok_s"], r["decode_tok_s"],
                          r["decode_tok_s"] / today["decode_tok_s"] if today else "",
                          r["decode_tok_s"] / lc1["decode_tok_s"] if lc1 else ""])
        out += [_common.markdown_table(["system", "prefill tok/s", "decode tok/s", "decode vs today",
                                        "decode vs llama.cpp 1 thread"], table), ""]
    conc = [r for r in rows if r["part"] == "concurrency"]
    if conc:
        out += ["Concurrent streams through the engine, all submitted at once (an NQ-open test passage to explain "
                "sentence by sentence, ~150-300 prompt tokens, 64 new tokens at most each). decode tok/s: the tokens "
                "the decode steps made / the time spent in them (the engine's counters); wall tok/s: all tokens / "
                "wall time, prefill included; x one stream: decode tok/s against the one-stream row.", ""]
        one = {r["system"]: r["decode_tok_s"] for r in conc if r["streams"] == 1}
        table = [[r["system"], r["streams"], r["decode_tok_s"], r["decode_tok_s"] / one.get(r["system"], float("nan")),
                  r["wall_tok_s"], r["ttft_p50_s"], r["ttft_p99_s"], r["itl_p50_ms"], r["itl_p99_ms"]] for r in conc]
        out += [_common.markdown_table(["system", "streams", "decode tok/s", "x one stream", "wall tok/s",
                                        "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms"], table), ""]
    srv = [r for r in rows if r["part"] == "serve"]
    if srv:
        out += ["Concurrent streamed chats through `certrag serve` with the openai client (the same long-answer "
                "prompts, 64 tokens at most); pieces = streamed text chunks (about a token each); the baseline is "
                "the same server with --serialize, one generation at a time as before the engine.", ""]
        base = {r["streams"]: r["wall_pieces_s"] for r in srv if "serialize" in r["system"]}
        table = [[r["system"], r["streams"], r["wall_pieces_s"],
                  r["wall_pieces_s"] / base[r["streams"]] if r["streams"] in base else "", r["ttft_p50_s"],
                  r["itl_p50_ms"], r["itl_p99_ms"], r["errors_5xx"]] for r in srv]
        out += [_common.markdown_table(["server", "streams", "pieces/s (wall)", "x serialised", "TTFT p50 s",
                                        "ITL p50 ms", "ITL p99 ms", "5xx"], table), ""]
    rec = [r for r in rows if r["part"] == "recording"]
    if rec:
        out += ["Lookback recording's cost per decode step (500 cached positions, 5 chunk spans):", ""]
        out += [_common.markdown_table(["batch", "plain ms/step", "recording ms/step", "ratio"],
                                       [[r["batch"], r["plain_step_ms"], r["recording_step_ms"], r["ratio"]]
                                        for r in rec]), ""]
    qual = [r for r in rows if r["part"] == "quality"]
    if qual:
        out += ["Quality of the q8 format against the float32 reference (the GGUF de-quantised exactly):", ""]
        for r in qual:
            if "answer_contains_gold" in r:
                out.append(f"- {r['format']}: EM {r['em']:.3f}, gold answer in the answer {r['answer_contains_gold']:.3f} "
                           f"({r['questions']} NQ-open test questions with their gold passage)")
            else:
                out.append(f"- greedy tokens identical on {r['identical']} of {r['questions']} prompts (32 tokens); "
                           f"first differences at positions {r['first_difference_positions']}")
        out.append("")
    load = [r for r in rows if r["part"] == "load"]
    if load:
        out += ["Load and disk:", ""]
        for r in load:
            value = f"{r['seconds']:.1f} s" if "seconds" in r else f"{r['bytes'] / 1e6:.0f} MB"
            out.append(f"- {r['what']}: {value}")
        out.append("")
    return "\n".join(out) + _common.footer(meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="single,concurrency,serve,recording,quality,load")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--questions", type=int, default=300)
    ap.add_argument("--no-today", action="store_true", help="skip today's transformers path (needs its 2.5 GB "
                                                             "float32 conversion)")
    args = ap.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    args.streams = [int(s) for s in args.streams.split(",")]
    _common.pin_threads(max(args.threads))
    parts = args.parts.split(",")
    known = {"single": part_single, "concurrency": part_concurrency, "serve": part_serve,
             "recording": part_recording, "quality": part_quality, "load": part_load}
    for p in parts:
        if p not in known:
            ap.error(f"--parts: unknown part {p!r}; choose from {sorted(known)}")
    scratch = _common.DATA_DIR / "generate"
    scratch.mkdir(parents=True, exist_ok=True)
    previous = []
    results = _common.RESULTS_DIR / "bench_generate.json"
    if results.exists():
        import json

        previous = [r for r in json.loads(results.read_text()).get("rows", []) if r.get("part") not in parts]
    rows = list(previous)
    for p in parts:
        rows += known[p](args, scratch)
        print(f"{p}: done", file=sys.stderr)
    meta = _common.meta({"parts": parts})
    _common.write_rows("bench_generate", rows, meta)
    _common.update_results_md("bench_generate", markdown(rows, meta))


if __name__ == "__main__":
    main()
