"""certrag serve on Ray Serve: the same HTTP app (certrag.serve.app) in an ingress deployment, with the models in
deployments of their own so that each scales on its own.

    Ingress     the FastAPI app (OpenAI routes, /v1/retrieve, /v1/answer, limits, metrics), the store's chunk
                table, and the index -- in this process, or its shards as Ray actors (shard_actors=True)
    Encoders    the embedder and the cross-encoder; @serve.batch gathers concurrent calls from every ingress
                replica into shared forward passes ("retrieval replicas")
    Generator   the local LLM; calls that can be cancelled (every call the HTTP app makes) stream token by token
                and stop decoding when the caller goes; calls without a cancel hook (library callers) are gathered
                by @serve.batch and decoded together when their options agree (LocalLLM.generate_batch)
                ("generation replicas")

The ingress reaches the others through DeploymentHandles wrapped to look like the models they hold (RemoteEmbedder,
RemoteReranker, RemoteLLM), so the engine's retrieval and answering run on them unchanged. Autoscaling: give
`autoscale` (max replicas) to let Serve add Encoders / Generator replicas from `min=1` by ongoing requests per
replica (target_ongoing_requests); see README "Beyond one machine".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from certrag.llm.local import Generation

APP_NAME = "certrag"


class _Described:
    """A backend description that arrived over the wire (certrag.backends.Backend.as_dict)."""

    def __init__(self, d: dict | None) -> None:
        self._d = d

    def as_dict(self) -> dict | None:
        return self._d


# ------------------------------------------------------------------------------------------------ deployments


class Encoders:
    """The embedder and the reranker of a store's config, loaded once per replica."""

    def __init__(self, config: dict, threads: int = 1) -> None:
        import torch

        from certrag.config import EngineConfig
        from certrag.stages import Stages

        torch.set_num_threads(threads)
        stages = Stages.default(EngineConfig.from_dict(config))
        self.embedder, self.reranker = stages.embedder, stages.reranker

    def describe(self) -> dict:
        e, r = self.embedder, self.reranker
        return {"embedder": {"name": e.name, "dim": e.dim, "backend": e.backend.as_dict()},
                "reranker": None if r is None else {
                    "name": r.name, "dense_weight": r.dense_weight, "skip_rule": r.skip_rule, "card": r.card,
                    "identity": r.identity, "backend": r.backend.as_dict()}}

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        return self.embedder.count_tokens(texts)

    async def embed(self, texts: list[str]) -> np.ndarray:
        return await self._embed_batch(texts)

    async def cross_scores(self, questions: list[str], passages: list[str]) -> np.ndarray:
        return await self._score_batch((questions, passages))

    async def _embed_batch(self, calls: list[list[str]]) -> list[np.ndarray]:
        flat = [t for texts in calls for t in texts]
        out = await asyncio.to_thread(self.embedder.embed, flat) if flat else np.zeros((0, self.embedder.dim))
        return _split(out, [len(t) for t in calls])

    async def _score_batch(self, calls: list[tuple[list[str], list[str]]]) -> list[np.ndarray]:
        qs = [q for c in calls for q in c[0]]
        ps = [p for c in calls for p in c[1]]
        out = await asyncio.to_thread(self.reranker.cross_scores, qs, ps) if qs else np.zeros(0, np.float32)
        return _split(out, [len(c[0]) for c in calls])


def _split(rows: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    out, at = [], 0
    for n in sizes:
        out.append(rows[at:at + n])
        at += n
    return out


def _generation(g: Generation) -> dict:
    d = dataclasses.asdict(dataclasses.replace(g, lookback=None))
    d["token_ids"], d["token_logprobs"] = list(g.token_ids), list(g.token_logprobs)
    return d


class Generator:
    """The local LLM, loaded once per replica."""

    def __init__(self, model: str | None = None, threads: int = 1) -> None:
        from certrag.llm import LocalLLM

        self.llm = LocalLLM(model, num_threads=threads) if model else LocalLLM(num_threads=threads)

    def describe(self) -> dict:
        return {"name": self.llm.name, "weights": self.llm.weights, "context_length": self.llm.context_length,
                "path": self.llm.path}

    def prefix_tokens(self, token_ids: list[int], text: str) -> int:
        return self.llm.prefix_tokens(token_ids, text)

    async def next_token_probs(self, prompts: list[list[int]], token_ids: list[int],
                               batch_size: int = 16) -> np.ndarray:
        return await asyncio.to_thread(self.llm.next_token_probs, prompts, token_ids, batch_size=batch_size)

    async def stream(self, messages: list[dict], options: dict):
        """Yields {"piece": text} as the answer is decoded (in a worker thread, so the replica keeps taking calls),
        then {"done": the Generation as a dict}. When the caller goes (Serve cancels this generator), the decoding
        stops at its next token."""
        from certrag.runtime.streams import DONE, ITEM, ThreadStream

        stream = ThreadStream(lambda emit: self.llm.generate(messages, on_text=emit, cancelled=stream.cancel.is_set,
                                                             **options), name="certrag-ray-stream")
        async for kind, value in stream.events():
            if kind == ITEM:
                yield {"piece": value}
            elif kind == DONE:
                yield {"done": _generation(value)}
            else:
                raise value

    async def generate(self, messages: list[dict], options: dict) -> dict:
        return await self._generate_batch((messages, options))

    async def _generate_batch(self, calls: list[tuple[list[dict], dict]]) -> list[dict]:
        return await asyncio.to_thread(self._decode_together, calls)

    def _decode_together(self, calls: list[tuple[list[dict], dict]]) -> list:
        """Calls whose options are the same and plain (max_new_tokens, temperature, seed) decode as one padded
        batch; any other call decodes alone. An error is that call's alone."""
        out: list = [None] * len(calls)
        groups: dict[str, list[int]] = {}
        for i, (_, options) in enumerate(calls):
            plain = set(options) <= {"max_new_tokens", "temperature", "seed"}
            groups.setdefault(json.dumps(options, sort_keys=True) if plain else f"alone-{i}", []).append(i)
        for key, rows in groups.items():
            try:
                if len(rows) > 1:
                    gens = self.llm.generate_batch([calls[i][0] for i in rows], **calls[rows[0]][1])
                else:
                    gens = [self.llm.generate(calls[rows[0]][0], **calls[rows[0]][1])]
                for i, g in zip(rows, gens):
                    out[i] = _generation(g)
            except Exception as exc:  # noqa: BLE001 -- handed to each caller of the group
                for i in rows:
                    out[i] = exc
        return out


class Ingress:
    """The HTTP app of certrag.serve.app over a read-only engine whose models are the other deployments."""

    def __init__(self, store: str, serve_config: dict, encoders, generator, shard_actors: bool = False) -> None:
        self.store, self.serve_config, self.shard_actors = store, serve_config, shard_actors
        self.encoders, self.generator = encoders, generator

    async def __serve_build_asgi_app__(self):
        from certrag.engine import Engine
        from certrag.serve.app import ServeConfig, create_app
        from certrag.stages import Stages

        described = await self.encoders.describe.remote()
        embedder = RemoteEmbedder(self.encoders, described["embedder"])
        reranker = RemoteReranker(self.encoders, described["reranker"]) if described["reranker"] else None
        llm = RemoteLLM(self.generator, await self.generator.describe.remote())
        await asyncio.to_thread(lambda: llm.tokenizer)  # loaded now, not by the first request
        stages = Stages(embedder=embedder, reranker=reranker, llm=llm)
        engine = await asyncio.to_thread(Engine.open, self.store, read_only=True, stages=stages,
                                         shard_actors=self.shard_actors)
        return create_app(llm, engine, ServeConfig(**self.serve_config), batch_encoders=False)


# ------------------------------------------------------------------------------- the handles, as models


class RemoteEmbedder:
    """An Embedder whose forward passes run in the Encoders deployment."""

    def __init__(self, handle, info: dict) -> None:
        self._h = handle
        self.name, self.dim, self.backend = info["name"], int(info["dim"]), _Described(info.get("backend"))

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self._h.embed.remote(list(texts)).result(), dtype=np.float32)

    def count_tokens(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self._h.count_tokens.remote(list(texts)).result())


class RemoteReranker:
    """A CrossEncoderReranker whose forward passes run in the Encoders deployment."""

    def __init__(self, handle, info: dict) -> None:
        self._h = handle
        self.name, self.dense_weight, self.skip_rule = info["name"], float(info["dense_weight"]), info["skip_rule"]
        self.card, self.identity, self.backend = info["card"], info["identity"], _Described(info.get("backend"))

    def cross_scores(self, questions: list[str], passages: list[str], *, batch_size: int | None = None) -> np.ndarray:
        if len(questions) != len(passages):
            raise ValueError("questions and passages must have the same length")
        return np.asarray(self._h.cross_scores.remote(list(questions), list(passages)).result(), dtype=np.float32)

    def score(self, question: str, passages: list[str], dense_scores: np.ndarray, *,
              batch_size: int | None = None) -> np.ndarray:
        from certrag.rerank import fused_scores

        return fused_scores(self, question, passages, dense_scores)


class RemoteLLM:
    """A LocalLLM in the Generator deployment: generate() streams token by token when given on_text or cancelled
    (and stops decoding in the replica when cancelled() turns true); a call with neither is one unary call, batched
    with others by the deployment. Lookback recording needs the model in this process, so confidence is not offered
    here."""

    records_lookback = False
    streams_text = True

    def __init__(self, handle, info: dict) -> None:
        self._h = handle
        self.name, self.context_length, self.path = info["name"], int(info["context_length"]), info["path"]
        # the weight format too, so that the engine's answer-presence judge (Engine._judge_model) is this model when
        # the rule names it, rather than a second copy loaded into the ingress
        self.weights = info.get("weights")
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from certrag.llm.models import BUNDLED_MODELS
            from certrag.llm.weights import q8_cache_dir

            path = q8_cache_dir(self.name) if self.name in BUNDLED_MODELS else Path(self.path)
            self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return self._tokenizer

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Counted here with the model's own tokenizer (the server checks every prompt's length on its event
        loop, where a call to another deployment may not wait)."""
        from certrag.llm.local import chat_prompt_ids

        return chat_prompt_ids(self.tokenizer, messages)

    def count_tokens(self, text: str) -> int:
        """As LocalLLM.count_tokens, with the model's own tokenizer here (the server's admission check)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_tokens(self, token_ids, text: str) -> int:
        return self._h.prefix_tokens.remote(list(token_ids), text).result()

    def next_token_probs(self, prompts, token_ids, *, batch_size: int = 16) -> np.ndarray:
        return self._h.next_token_probs.remote([list(p) for p in prompts], list(token_ids), batch_size).result()

    def generate(self, messages: list[dict], *, on_text=None, cancelled=None, **options) -> Generation:
        if options.get("record_lookback"):
            raise ValueError("record_lookback needs the model in this process (certrag LocalLLM); this server's "
                             "model runs in its Generator deployment")
        options.pop("record_lookback", None)
        options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items()}
        if on_text is None and cancelled is None:
            return self._unary(messages, options)
        # a call that can be cancelled streams: the stream's decoding stops at the next token when the caller goes,
        # where a batched decode would run on to max_new_tokens in the replica
        return self._streamed(messages, options, on_text or (lambda piece: None), cancelled)

    def _unary(self, messages, options) -> Generation:
        out = self._h.generate.remote(messages, options).result()
        if isinstance(out, BaseException):
            raise out
        return _from_dict(out)

    def _streamed(self, messages, options, on_text, cancelled) -> Generation:
        started, pieces = time.perf_counter(), []
        stream = self._h.options(stream=True).stream.remote(messages, options)
        for item in stream:
            if "done" in item:
                return _from_dict(item["done"])
            pieces.append(item["piece"])
            on_text(item["piece"])
            if cancelled is not None and cancelled():
                stream.cancel()
                return Generation(text="".join(pieces).strip(), input_tokens=0, output_tokens=len(pieces),
                                  seconds=time.perf_counter() - started, finish_reason="cancelled")
        raise RuntimeError("the Generator's stream ended without its result")


def _from_dict(d: dict) -> Generation:
    return Generation(**{**d, "token_ids": tuple(d["token_ids"]), "token_logprobs": tuple(d["token_logprobs"])})


# ------------------------------------------------------------------------------------------------ the app


def build_app(store: str | Path, *, serve_config: dict | None = None, model: str | None = None,
              retrieval_replicas: int = 1, generation_replicas: int = 1, ingress_replicas: int = 1,
              autoscale: int | None = None, shard_actors: bool = False, threads: int = 1,
              max_batch: int = 64, max_wait_ms: float = 2.0):
    """The Serve application (Ingress bound to Encoders and Generator). retrieval_replicas / generation_replicas /
    ingress_replicas: fixed replica counts; autoscale=N instead lets Serve scale Encoders and Generator between 1
    and N replicas by ongoing requests. threads: torch threads per model replica. max_batch / max_wait_ms: the
    @serve.batch settings of the encoders (the Generator gathers up to 8 calls for 10 ms)."""
    from ray import serve

    from certrag.engine import Engine

    for name, value in (("retrieval_replicas", retrieval_replicas), ("generation_replicas", generation_replicas),
                        ("ingress_replicas", ingress_replicas), ("threads", threads), ("max_batch", max_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    if autoscale is not None and (isinstance(autoscale, bool) or not isinstance(autoscale, int) or autoscale < 1):
        raise ValueError(f"autoscale must be a positive integer (the most replicas); got {autoscale!r}")
    with Engine.open(store, read_only=True, verify=False) as probe:  # a clear error for a bad store, here
        config = probe.config.to_dict()

    def scaling(replicas: int) -> dict:
        if autoscale is None:
            return {"num_replicas": replicas}
        return {"autoscaling_config": {"min_replicas": 1, "max_replicas": autoscale, "target_ongoing_requests": 4}}

    # Replicas ask Ray for no CPU slot: their torch threads are the real budget (threads per replica), and a slot
    # per replica would stop a small cluster from starting the three deployments at all.
    actor = {"num_cpus": 0}
    enc_cls = type("Encoders", (Encoders,), {
        "_embed_batch": serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=max_wait_ms / 1e3)(
            Encoders._embed_batch),
        "_score_batch": serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=max_wait_ms / 1e3)(
            Encoders._score_batch)})
    gen_cls = type("Generator", (Generator,), {
        "_generate_batch": serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)(Generator._generate_batch)})
    encoders = serve.deployment(enc_cls, name="Encoders", ray_actor_options=actor, max_ongoing_requests=256,
                                **scaling(retrieval_replicas)).bind(config, threads)
    generator = serve.deployment(gen_cls, name="Generator", ray_actor_options=actor, max_ongoing_requests=64,
                                 **scaling(generation_replicas)).bind(model, threads)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", ray_actor_options=actor,
                               num_replicas=ingress_replicas, max_ongoing_requests=512)
    return ingress.bind(str(Path(store).resolve()), dict(serve_config or {}), encoders, generator, shard_actors)


def run(store: str | Path, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
        blocking: bool = True, **options):
    """Starts Serve's HTTP proxy on host:port and runs build_app(store, **options) as the application "certrag".
    With blocking, waits until interrupted (SIGINT / SIGTERM), then shuts Serve down."""
    import signal
    import threading

    from ray import serve

    from certrag.scale.cluster import connect

    connect(address)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(store, **options), name=APP_NAME, route_prefix="/")
    if not blocking:
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
