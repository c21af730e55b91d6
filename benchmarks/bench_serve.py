"""certrag serve under load, against the serialised server it replaces and a plain FastAPI composition of the same
models, in one run.

Servers (each its own process, started and stopped here, on the NQ benchmark store of bench_retrieval):
- certrag: `certrag serve` as shipped (batched encoders, bounded generation queue, no request-wide lock);
- serialised: the same with --serialize (one request at a time, as the server ran before issue 17);
- plain: what a user would write without certrag -- FastAPI, the same MiniLM embedder and cross-encoder called
  through transformers per request (float32, padded batch), hnswlib over the store's vectors (see plain_app below).

Load: closed-loop clients (threads, one keep-alive HTTP connection each) at 1, 4, 16 and 64 concurrent clients, each
sending its share of NQ-open test questions to /v1/retrieve (rerank on and off); /v1/answer with --reader (default
the small one), streamed, for time to first token. --store scale runs on bench_scale's 125k-chunk store instead.
Reported: throughput, p50/p90/p99, status counts, and whether the results equal the serialised server's. Python
threads as clients: no extra dependency, and the clients' cost is the same for every server (it shares the 2 cores
with the server, which the numbers include).

    python benchmarks/bench_serve.py
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

SMALL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, store: Path, model: str = SMALL, extra: list[str] | None = None):
    port = _free_port()
    if kind == "plain":
        args = [sys.executable, str(Path(__file__).resolve()), "--plain-server", str(store), "--port", str(port)]
    else:
        args = [sys.executable, "-c", "from certrag.cli import main; main()", "serve", str(store), "--model", model,
                "--port", str(port), "--queue-depth", "16", "--timeout", "300"]
        if kind == "serialised":
            args.append("--serialize")
        args += extra or []
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + 300
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def load(port: int, path: str, payloads: list[dict], clients: int, stream: bool = False) -> dict:
    """Closed loop: `clients` threads share the payloads; each posts its next one as soon as the last returned."""
    import numpy as np

    lock = threading.Lock()
    work = list(enumerate(payloads))
    lat, ttft, statuses, bodies = [], [], {}, {}

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while True:
            with lock:
                if not work:
                    break
                i, payload = work.pop()
            t = time.perf_counter()
            first = None
            try:
                conn.request("POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                if stream and resp.status == 200:
                    chunks = []
                    while True:
                        line = resp.readline()
                        if not line:
                            break
                        if first is None and line.startswith(b"event: token"):
                            first = time.perf_counter() - t
                        chunks.append(line)
                    body = b"".join(chunks)
                else:
                    body = resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException):
                status, body = "connection error", b""
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            dt = time.perf_counter() - t
            with lock:
                lat.append(dt)
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                if first is not None:
                    ttft.append(first)
                if status == 200 and not stream:
                    bodies[i] = body
        conn.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    out = {"clients": clients, "requests": len(lat), "throughput_rps": len(lat) / wall, "statuses": statuses,
           **_common.percentiles_ms(lat)}
    if ttft:
        out["ttft_p50_ms"] = float(np.median(ttft)) * 1e3
    out["_bodies"] = bodies
    return out


def ranked_ids(body: bytes) -> list:
    data = json.loads(body)
    if "candidates" in data:
        return [c["chunk_id"] for c in data["candidates"]]
    return data["ids"]


# ------------------------------------------------------------------------------------- the plain FastAPI baseline


def _plain_question():
    from pydantic import BaseModel

    class PlainQuestion(BaseModel):
        question: str
        rerank: bool | None = True

    return PlainQuestion


if __name__ == "__main__" and "--plain-server" in sys.argv:
    PlainQuestion = _plain_question()  # module level: FastAPI resolves the route's annotation here


def plain_app(store: Path):
    """The same models the way a user composes them without certrag: transformers per request, hnswlib."""
    import hnswlib
    import numpy as np
    import torch
    from fastapi import FastAPI
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    from certrag.embed import default_model_dir
    from certrag.engine import Engine
    from certrag.rerank import PACKAGE_RERANKER

    torch.set_num_threads(2)
    engine = Engine.open(store, read_only=True)
    chunks = engine._data.chunks
    vectors = engine._data.vectors
    index = hnswlib.Index(space="ip", dim=vectors.shape[1])
    index.init_index(max_elements=len(vectors), ef_construction=200, M=16)
    index.add_items(vectors, np.arange(len(vectors)))
    index.set_ef(128)
    etok = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    emodel = AutoModel.from_pretrained(str(default_model_dir()), local_files_only=True).eval()
    rtok = AutoTokenizer.from_pretrained(str(PACKAGE_RERANKER), local_files_only=True)
    rmodel = AutoModelForSequenceClassification.from_pretrained(str(PACKAGE_RERANKER), local_files_only=True,
                                                                dtype=torch.float32).eval()
    weight = json.loads((PACKAGE_RERANKER / "card.json").read_text())["dense_weight"]
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/v1/retrieve")
    def retrieve(q: PlainQuestion):
        with torch.inference_mode():
            enc = etok([q.question], return_tensors="pt", truncation=True, max_length=256)
            h = emodel(**enc).last_hidden_state
            v = torch.nn.functional.normalize(h.mean(1), dim=1).numpy()
            labels, dist = index.knn_query(v, k=20)
            ids, dense = labels[0], 1 - dist[0]
            if q.rerank is not False:
                texts = [chunks[i]["text"] for i in ids]
                enc = rtok([q.question] * len(texts), texts, return_tensors="pt", padding=True,
                           truncation="only_second", max_length=256)
                ce = rmodel(**enc).logits[:, 0].numpy()
                order = np.argsort(-(ce + weight * dense))
                ids = ids[order]
        return {"ids": [int(chunks[i]["id"]) for i in ids]}

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--requests", type=int, default=128, help="requests per load level")
    p.add_argument("--answers", type=int, default=8, help="streamed /v1/answer requests per level")
    p.add_argument("--servers", default="serialised,certrag,plain",
                   help="which servers to run (the serialised one is the reference for identical rankings)")
    p.add_argument("--encoder-depth", type=int, default=None, help="certrag serve --encoder-depth for this run")
    p.add_argument("--rerank-instances", type=int, default=None,
                   help="certrag serve --rerank-instances for the shipped server (the serialised one keeps one)")
    p.add_argument("--store", choices=("nq", "scale"), default="nq",
                   help="nq: the 12.7k-chunk NQ store; scale: bench_scale's 125k-chunk store (build it with "
                        "benchmarks/bench_scale.py first)")
    p.add_argument("--reader", default=SMALL, help="the reader behind /v1/answer (a bundled model name)")
    p.add_argument("--plain-server", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.plain_server is not None:
        import uvicorn

        uvicorn.run(plain_app(args.plain_server), host="127.0.0.1", port=args.port, log_level="warning")
        return

    from certrag.data.nq import load_nq_open

    from _nq import cached_embedder, nq_store

    if args.store == "scale":
        from certrag.engine import Engine

        store = _common.DATA_DIR / "scale_store"
        if not (store / "CURRENT").exists():
            p.error(f"--store scale: no store at {store}; build it with: python benchmarks/bench_scale.py")
        engine = Engine.open(store, read_only=True)
    else:
        engine, _ = nq_store(cached_embedder(), None)
    store, chunks = engine.path, len(engine)
    engine.close()
    store_name = ("bench_scale's store of 32-token chunks" if args.store == "scale" else "the NQ benchmark store")
    questions = [it.question for it in load_nq_open(split="test")]
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    reference: dict[tuple, dict] = {}
    servers = [k.strip() for k in args.servers.split(",") if k.strip()]
    for kind in servers:
        extra = ["--encoder-depth", str(args.encoder_depth)] if args.encoder_depth and kind != "plain" else []
        if args.rerank_instances and kind == "certrag":
            extra += ["--rerank-instances", str(args.rerank_instances)]
        proc, port = start(kind, store, args.reader, extra=extra)
        try:
            for rerank in (True, False):
                payloads = [{"question": q, "rerank": rerank} for q in questions[: args.requests]]
                load(port, "/v1/retrieve", payloads[:4], 1)  # warm-up
                for clients in levels:
                    r = load(port, "/v1/retrieve", payloads, clients)
                    bodies = r.pop("_bodies")
                    ids = {i: ranked_ids(b) for i, b in bodies.items()}
                    key = (rerank, clients)
                    if kind == "serialised":
                        reference[key] = ids
                    row = {"server": kind, "route": f"/v1/retrieve rerank={rerank}", **r}
                    if key in reference:
                        row["same_as_serialised"] = sum(ids[i] == reference[key].get(i) for i in ids) / max(1, len(ids))
                    rows.append(row)
                    print(json.dumps(rows[-1]), file=sys.stderr)
            if kind != "plain" and args.answers:
                payloads = [{"question": q, "stream": True, "max_new_tokens": 32}
                            for q in questions[: args.answers]]
                for clients in (1, 4):
                    r = load(port, "/v1/answer", payloads, clients, stream=True)
                    r.pop("_bodies")
                    rows.append({"server": kind, "route": f"/v1/answer stream ({args.reader})", **r})
                    print(json.dumps(rows[-1]), file=sys.stderr)
        finally:
            stop(proc)

    def row(kind, route, clients):
        return next((x for x in rows if x["server"] == kind and x["route"] == route and x["clients"] == clients),
                    None)

    verdicts = []
    for rerank, need in ((False, 2.0), (True, 1.5)):
        route = f"/v1/retrieve rerank={rerank}"
        a, b = row("certrag", route, 16), row("serialised", route, 16)
        if a and b:
            ratio = a["throughput_rps"] / b["throughput_rps"]
            verdicts.append(f"{route} at 16 clients: {a['throughput_rps']:.1f} req/s against the serialised "
                            f"server's {b['throughput_rps']:.1f} ({ratio:.2f}x; target >= {need}x: "
                            f"{'met' if ratio >= need else 'NOT met'})")
    fives = sum(v for x in rows if x["server"] == "certrag" for k, v in x["statuses"].items() if k.startswith("5"))
    refused = sum(x["statuses"].get("429", 0) for x in rows if x["server"] == "certrag")
    verdicts.append(f"certrag under every load: {fives} responses 5xx, {refused} refused with 429")
    name = "bench_serve" if args.store == "nq" else f"bench_serve-{args.store}"  # each store keeps its section
    plot = name.replace("bench_serve", "serve_latency")
    meta = _common.meta({"bench": name, "store_chunks": chunks, "reader": args.reader})
    lines = [f"### certrag serve under load (bench_serve.py{' --store ' + args.store if args.store != 'nq' else ''})\n",
             "**Verdict:** " + "; ".join(verdicts) + ".\n",
             f"Store: {store_name} ({chunks:,} chunks). Clients: closed-loop threads on the same 2 cores as the "
             f"server, "
             f"{args.requests} requests per level.\n",
             _common.markdown_table(
                 ["server", "route", "clients", "req/s", "p50 ms", "p90 ms", "p99 ms", "TTFT p50 ms", "statuses",
                  "same ranking as serialised"],
                 [[x["server"], x["route"], x["clients"], x["throughput_rps"], x["p50_ms"], x["p90_ms"], x["p99_ms"],
                   x.get("ttft_p50_ms", "-"), " ".join(f"{k}:{v}" for k, v in sorted(x["statuses"].items())),
                   f"{x['same_as_serialised']:.0%}" if "same_as_serialised" in x else "-"] for x in rows]),
             f"\n![p50 latency against concurrent clients](results/{plot}.png)\n",
             _common.footer(meta)]
    text = "\n".join(lines)
    print(text)
    try:
        if args.no_write:
            raise ImportError  # a trial run writes nothing, the plot included
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, rerank in zip(axes, (True, False)):
            for kind in ("certrag", "serialised", "plain"):
                pts = [x for x in rows if x["server"] == kind and x["route"] == f"/v1/retrieve rerank={rerank}"]
                ax.plot([x["clients"] for x in pts], [x["p50_ms"] for x in pts], "o-", label=f"{kind} p50")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel("latency ms")
            ax.set_title(f"/v1/retrieve rerank={rerank}")
            ax.legend()
        fig.tight_layout()
        _common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        fig.savefig(_common.RESULTS_DIR / f"{plot}.png", dpi=100)
    except ImportError:
        pass
    if not args.no_write:
        _common.write_rows(name, rows, meta)
        _common.update_results_md(name, text)


if __name__ == "__main__":
    main()
