"""The on-disk store: one directory, versioned, written atomically.

    DIR/CURRENT            the live version folder's name and the SHA-256 of its manifest: "v000007 sha256:<hex>"
                           (replaced by rename; format 1 stores hold the name alone)
    DIR/v000007/           one complete version:
        manifest.json      format version, config, model names, counts, and SHA-256 of every other file
        chunks.jsonl       one chunk per line: id, doc_id, start, end, n_tokens, text
        documents.jsonl    one document per line: id, metadata, chunk ids, characters
        embeddings.safetensors   ids int64 (n,), vectors float32 (n, d), aligned with chunks.jsonl
        index.hnsw         the native index (its own header and checksums); a store of N > 1 shards
                           (config index.shards) holds index-000-of-00N.hnsw ... instead, one per shard, each
                           listed with its checksum in the manifest (certrag.shards)
    DIR/.lock              held (flock) by a writable Engine

A write builds a complete new version folder under a temporary name, fsyncs it, renames it into place and then
swaps CURRENT by rename; a crash or a kill at any point leaves the previous version readable. Old versions are
deleted after the swap; a reader that was opening one when it went starts again from CURRENT, so it sees one whole
version. Every byte is checked on open: CURRENT's form, the manifest against the checksum in CURRENT, every other
file against the manifest; any damage raises StoreError with the reason.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from certrag.atomic import fsync_dir, write_durable, write_file_atomic
from certrag.index import HnswIndex, IndexIOError
from certrag.shards import ShardedIndex, check_shards

FORMAT_VERSION = 2  # 2: CURRENT carries the manifest's SHA-256
DATA_FILES = ("chunks.jsonl", "documents.jsonl", "embeddings.safetensors")
FILES = DATA_FILES + ("index.hnsw",)  # an unsharded store's files
_SHARD_FILE = re.compile(r"index-([0-9]{3})-of-([0-9]{3})\.hnsw")


def index_files(shards: int) -> list[str]:
    """The index files of a store with this many shards."""
    return ["index.hnsw"] if shards == 1 else [f"index-{i:03d}-of-{shards:03d}.hnsw" for i in range(shards)]


class StoreError(ValueError):
    """A store that is missing, damaged, incompatible or locked."""


@dataclass
class StoreData:
    config: dict
    models: dict
    chunks: list[dict]
    documents: dict[str, dict]
    ids: np.ndarray  # int64 (n,), chunk ids aligned with chunks and vectors
    vectors: np.ndarray  # float32 (n, d)
    index: HnswIndex | ShardedIndex | None  # None when read with load_index=False
    next_chunk_id: int = 0
    manifest: dict = field(default_factory=dict)
    index_paths: tuple[Path, ...] = ()  # the version's index files, one per shard (set by read_store)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class StoreLock:
    """An exclusive advisory lock on DIR/.lock for the lifetime of a writable engine."""

    def __init__(self, root: Path) -> None:
        self._fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise StoreError(f"{root} is open for writing elsewhere; open it with read_only=True") from None

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


_POINTER = re.compile(r"(v[0-9]{6})(?: sha256:([0-9a-f]{64}))?\n?")


def _pointer(root: Path) -> tuple[str, str | None]:
    """(version folder name, manifest SHA-256 or None for a format 1 store) from CURRENT."""
    pointer = root / "CURRENT"
    if not root.is_dir():
        raise StoreError(f"no store at {root}")
    try:
        raw = pointer.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{root} is not a certrag store (no CURRENT file)") from None
    except OSError as exc:
        raise StoreError(f"{root}/CURRENT is unreadable: {exc}") from None
    m = _POINTER.fullmatch(raw.decode("ascii", errors="replace"))
    if m is None:
        raise StoreError(f"{root}/CURRENT is damaged (it must name a version folder and its manifest's checksum)")
    return m.group(1), m.group(2)


def current_version(root: Path) -> Path:
    name, _ = _pointer(root)
    version = root / name
    if not version.is_dir():
        raise StoreError(f"{root}/CURRENT names {name}, which is missing: the store is damaged")
    return version


_VERSION = re.compile(r"v([0-9]{6})")
_LEFTOVER = re.compile(r"\.tmp-v[0-9]{6}-([0-9]+)|\.CURRENT\.tmp-([0-9]+)-[0-9]+|\..+\.tmp-([0-9]+)-[0-9]+")


def _leftover_pid(name: str) -> int | None:
    """The writer's pid in a name only a write of this store makes (a version folder being built,
    .tmp-v000007-PID; CURRENT's or another file's temporary copy, .CURRENT.tmp-PID-TID, .NAME.tmp-PID-TID)."""
    m = _LEFTOVER.fullmatch(name)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def is_leftover(name: str) -> bool:
    return _leftover_pid(name) is not None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def foreign_entries(root: Path) -> list[str]:
    """What a folder without CURRENT holds that is not the store's own: anything but its lock and a killed write's
    leftovers. A store is built only into a new or empty folder, so that nothing of a user's is ever mixed in."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.name != ".lock" and not is_leftover(p.name))


def _versions(root: Path) -> list[str]:
    """The store's version folders: named as write_store names them and holding a certrag manifest."""
    found = []
    for p in root.iterdir():
        if _VERSION.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            try:
                manifest = json.loads((p / "manifest.json").read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(manifest, dict) and manifest.get("format") == "certrag-store":
                found.append(p.name)
    return sorted(found)


def _clean_leftovers(root: Path) -> None:
    """Removes what killed writes left behind: temporary names of writers that are no longer running."""
    for p in root.iterdir():
        pid = _leftover_pid(p.name)
        if pid is None or (pid != os.getpid() and _alive(pid)):
            continue
        if pid == os.getpid() and p.name.startswith(".") and not p.name.startswith((".tmp-v", ".CURRENT.tmp-")):
            continue  # another thread of this process may be writing that file now
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def write_store(root: Path, data: StoreData) -> Path:
    """Writes data as a new version of the store at root and makes it current. Afterwards the versions it replaced
    are deleted: folders named as versions (v000007) that hold a certrag manifest, never anything else."""
    from safetensors.numpy import save

    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    existing = _versions(root)
    taken = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name))]
    number = max(taken) + 1 if taken else 1
    name = f"v{number:06d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    try:
        chunks = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in data.chunks).encode()
        write_durable(tmp / "chunks.jsonl", chunks)
        docs = "".join(json.dumps({"id": k, **v}, ensure_ascii=False) + "\n" for k, v in data.documents.items())
        write_durable(tmp / "documents.jsonl", docs.encode())
        vectors = data.vectors if len(data.vectors) else np.zeros((0, data.index.dim), np.float32)
        write_durable(tmp / "embeddings.safetensors",
               save({"ids": np.ascontiguousarray(data.ids, dtype=np.int64),
                     "vectors": np.ascontiguousarray(vectors, dtype=np.float32)}))
        shards = data.index.shards if isinstance(data.index, ShardedIndex) else [data.index]
        names = index_files(len(shards))
        for shard, fname in zip(shards, names):
            shard.save(tmp / fname)
        manifest = {
            "format": "certrag-store",
            "format_version": FORMAT_VERSION,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": data.config,
            "models": data.models,
            "counts": {"documents": len(data.documents), "chunks": len(data.chunks),
                       "dim": int(data.index.dim)},
            "next_chunk_id": int(data.next_chunk_id),
            "files": {f: {"sha256": _sha256(tmp / f), "bytes": (tmp / f).stat().st_size}
                      for f in DATA_FILES + tuple(names)},
            "index": {"shards": len(shards), "files": names, "live": [len(x) for x in shards]},
        }
        for key, value in data.manifest.items():
            if key not in manifest:
                manifest[key] = value
        manifest_bytes = (json.dumps(manifest, indent=2) + "\n").encode()
        write_durable(tmp / "manifest.json", manifest_bytes)
        fsync_dir(tmp)
        tmp.rename(root / name)
        fsync_dir(root)
        write_file_atomic(root / "CURRENT", f"{name} sha256:{hashlib.sha256(manifest_bytes).hexdigest()}\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in existing:
        shutil.rmtree(root / old, ignore_errors=True)
    data.manifest = manifest
    return root / name


def read_store(root: Path, *, verify: bool = True, mmap: bool = False, attempts: int = 5,
               load_index: bool = True) -> StoreData:
    """Opens the current version, checking CURRENT, the manifest's checksum and format version and (with verify)
    every file's SHA-256. A version deleted by a writer while this reader opened it is retried from CURRENT (up to
    `attempts` times), so a reader sees one whole version or a StoreError, never a missing file. load_index=False
    leaves the index to the caller (StoreData.index is None; index_paths name its files): a server whose shards
    live in other processes (certrag.shards.RayShardedIndex)."""
    for attempt in range(attempts):
        name, manifest_sha = _pointer(root)
        try:
            return _read_version(root, name, manifest_sha, verify=verify, mmap=mmap, load_index=load_index)
        except (FileNotFoundError, NotADirectoryError, IndexIOError, _VersionGone) as exc:
            if _pointer(root)[0] == name or attempt == attempts - 1:
                raise StoreError(f"{root}: {name} is incomplete ({exc}): the store is damaged") from None
    raise AssertionError("unreachable")


class _VersionGone(Exception):
    """A file of the version being read vanished (a writer replaced the version meanwhile)."""


MAX_CHUNK_ID = 2**63 - 1
_CHUNK_FIELDS = {"id": int, "doc_id": str, "start": int, "end": int, "n_tokens": int, "text": str}
INDEX_SAMPLE = 64  # vectors of the index compared with embeddings.safetensors on open


def _check_rows(root: Path, chunks: list, documents: dict) -> None:
    """Every chunk and document row has the fields the engine reads, of their types, and they agree: a hand-edited
    or crafted file raises StoreError naming the field, never a KeyError or TypeError later."""
    def bad(where: str, what: str) -> StoreError:
        return StoreError(f"{root}: {where} {what}: the store is damaged")

    for n, c in enumerate(chunks, 1):
        if not isinstance(c, dict):
            raise bad(f"chunks.jsonl line {n}", "is not an object")
        for name, kind in _CHUNK_FIELDS.items():
            v = c.get(name)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise bad(f"chunks.jsonl line {n}", f"has no {kind.__name__} {name!r}")
        if c["doc_id"] not in documents:
            raise bad(f"chunks.jsonl line {n}", f"names document {c['doc_id']!r}, which documents.jsonl lacks")
    owner = {c["id"]: c["doc_id"] for c in chunks}
    for doc_id, d in documents.items():
        if not isinstance(doc_id, str):
            raise bad("documents.jsonl", f"has a document whose id is not a string ({doc_id!r})")
        if not isinstance(d, dict):
            raise bad(f"document {doc_id!r}", "is not an object")
        cids = d.get("chunk_ids")
        if not isinstance(cids, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in cids):
            raise bad(f"document {doc_id!r}", "has no list of integer 'chunk_ids'")
        if any(owner.get(i) != doc_id for i in cids):
            raise bad(f"document {doc_id!r}", "lists chunk ids that are not its chunks in chunks.jsonl")
        if d.get("metadata") is not None and not isinstance(d["metadata"], dict):
            raise bad(f"document {doc_id!r}", "has 'metadata' that is not an object")
    if sum(len(d["chunk_ids"]) for d in documents.values()) != len(chunks):
        raise StoreError(f"{root}: documents.jsonl and chunks.jsonl disagree on the chunks: the store is damaged")


def _check_index(root: Path, index, ids: np.ndarray, vectors: np.ndarray) -> None:
    """The index holds exactly the embeddings' ids, and a sample of its vectors is theirs: an index whose vectors were
    moved against their ids (checksums recomputed) would return other documents at the same scores."""
    if not np.array_equal(np.sort(index.ids()), np.sort(ids)):
        raise StoreError(f"{root}: the index and embeddings.safetensors hold different chunk ids: the store is damaged")
    if not len(ids):
        return
    sample = np.unique(np.linspace(0, len(ids) - 1, min(INDEX_SAMPLE, len(ids))).astype(np.int64))
    got = index.get_vectors(ids[sample]).astype(np.float64)
    want = vectors[sample].astype(np.float64)
    if index.metric == "cosine":
        want = want / np.maximum(np.linalg.norm(want, axis=1, keepdims=True), 1e-30)
    if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise StoreError(f"{root}: the index's vectors do not match embeddings.safetensors for their ids: "
                         "the store is damaged")


def _index_names(root: Path, manifest: dict) -> list[str]:
    """The manifest's index files (format 2 stores before sharding: index.hnsw), checked to be the names a store
    of that many shards has, so a damaged manifest cannot name a file outside the version."""
    entry = manifest.get("index")
    if entry is None:
        return ["index.hnsw"]
    try:
        names, shards = list(entry["files"]), check_shards(entry["shards"])
    except (TypeError, KeyError, ValueError) as exc:
        raise StoreError(f"{root}: manifest.json's index entry is damaged ({exc})") from None
    if names != index_files(shards):
        raise StoreError(f"{root}: manifest.json's index files do not match its {shards} shards: the store is damaged")
    return names


def _manifest(root: Path, name: str, manifest_sha: str | None) -> dict:
    """Version `name`'s manifest, checked against CURRENT's checksum and for a format this build reads."""
    version = root / name
    if not version.is_dir():
        raise _VersionGone(f"{name} is missing")
    try:
        raw = (version / "manifest.json").read_bytes()
    except (IsADirectoryError, PermissionError) as exc:
        raise StoreError(f"{version}/manifest.json is unreadable ({exc.strerror}): the store is damaged") from None
    if manifest_sha is not None and hashlib.sha256(raw).hexdigest() != manifest_sha:
        raise StoreError(f"{root}: manifest.json fails its checksum: the store is damaged")
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{version}/manifest.json is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "certrag-store":
        raise StoreError(f"{root} is not a certrag store")
    fv = manifest.get("format_version")
    if not isinstance(fv, int) or fv < 1:
        raise StoreError(f"{root}: invalid format version {fv!r}")
    if fv > FORMAT_VERSION:
        raise StoreError(f"{root} was written by a newer certrag (store format {fv}); this build reads up to "
                         f"{FORMAT_VERSION}: upgrade certrag")
    if fv >= 2 and manifest_sha is None:
        raise StoreError(f"{root}/CURRENT is damaged: it lacks the manifest's checksum")
    return manifest


def read_manifest(root: str | Path) -> dict:
    """The current version's manifest (what it holds: counts, models, config, index layout), read and checked
    against CURRENT without reading the data files: what `certrag info STORE` prints, in milliseconds."""
    root = Path(root)
    for _ in range(5):  # a writer may publish a new version (and remove this one) between the two reads
        name, sha = _pointer(root)
        try:
            return _manifest(root, name, sha)
        except _VersionGone:
            continue
    raise StoreError(f"{root}: the current version kept changing while it was read")


def _read_version(root: Path, name: str, manifest_sha: str | None, *, verify: bool, mmap: bool,
                  load_index: bool = True) -> StoreData:
    """Reads version `name`, whose manifest must hash to manifest_sha (format 1 stores: None)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    version = root / name
    manifest = _manifest(root, name, manifest_sha)
    files = manifest.get("files")
    if not isinstance(files, dict) or not isinstance(manifest.get("config"), dict) or \
            not isinstance(manifest.get("models"), dict):
        raise StoreError(f"{root}: manifest.json is damaged (files, config or models missing)")
    names = _index_names(root, manifest)
    for f in DATA_FILES + tuple(names):
        path = version / f
        expected = files.get(f)
        if not isinstance(expected, dict):
            raise StoreError(f"{root}: manifest.json does not list {f}: the store is damaged")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _VersionGone(f"{f} is missing") from None
        if size != expected.get("bytes"):
            raise StoreError(f"{root}: {f} has the wrong size: the store is damaged")
        if verify and _sha256(path) != expected.get("sha256"):
            raise StoreError(f"{root}: {f} fails its checksum: the store is damaged")
    try:
        chunks = [json.loads(line) for line in (version / "chunks.jsonl").read_text("utf-8").splitlines() if line]
        documents = {}
        for line in (version / "documents.jsonl").read_text("utf-8").splitlines():
            if line:
                row = json.loads(line)
                documents[row.pop("id")] = row
        tensors = load_file(str(version / "embeddings.safetensors"))
        index = None
        if load_index:
            loaded = [HnswIndex.load(version / f, mmap=mmap) for f in names]
            index = loaded[0] if manifest.get("index") is None or len(loaded) == 1 else ShardedIndex(loaded)
        ids, vectors = tensors["ids"], tensors["vectors"]
        next_chunk_id = manifest.get("next_chunk_id", 0)
        if not isinstance(next_chunk_id, int) or isinstance(next_chunk_id, bool):
            raise ValueError(f"next_chunk_id is {next_chunk_id!r}")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, SafetensorError) as exc:
        raise StoreError(f"{root}: damaged store ({exc})") from None
    _check_rows(root, chunks, documents)
    chunk_ids = [c["id"] for c in chunks]
    if not (len(chunks) == len(ids) == len(vectors) == (len(index) if index is not None else len(ids))):
        raise StoreError(f"{root}: chunks, embeddings and index disagree on the count")
    if chunk_ids != ids.tolist():
        raise StoreError(f"{root}: chunks and embeddings disagree on the chunk ids")
    if not 0 <= next_chunk_id <= MAX_CHUNK_ID:
        raise StoreError(f"{root}: manifest.json's next_chunk_id {next_chunk_id} is outside 0 .. 2**63 - 1")
    if len(ids) and next_chunk_id <= int(ids.max()):
        raise StoreError(f"{root}: next_chunk_id {next_chunk_id} is not above the largest chunk id {int(ids.max())}")
    if index is not None:
        _check_index(root, index, ids, vectors)
    return StoreData(config=manifest["config"], models=manifest["models"], chunks=chunks, documents=documents,
                     ids=ids, vectors=vectors, index=index, next_chunk_id=next_chunk_id, manifest=manifest,
                     index_paths=tuple(version / f for f in names))
