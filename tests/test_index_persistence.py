"""Saving and loading: round trips, atomic writes, and files that are truncated, corrupted, crafted or foreign."""

import signal
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from certrag import HnswIndex, IndexFormatError
from certrag.data.vectors import clustered_vectors

HEADER = 128
MASK = (1 << 64) - 1
MUL = 0x9E3779B97F4A7C15


# An independent implementation of the documented checksum (csrc/certrag/checksum.h), used to craft files whose
# checksums are right but whose structure is not, so the structural checks are tested rather than the checksum.
def _mix(x):
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    x ^= x >> 33
    return x


def _absorb(lane, word):
    lane = ((lane ^ word) * MUL) & MASK
    return ((lane << 31) | (lane >> 33)) & MASK


def checksum64(data: bytes) -> int:
    lanes = [0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89]
    blocks = len(data) // 32
    words = np.frombuffer(data[: blocks * 32], dtype="<u8").tolist()
    for b in range(blocks):
        for j in range(4):
            lanes[j] = _absorb(lanes[j], words[4 * b + j])
    for i, byte in enumerate(data[blocks * 32:]):
        lanes[i // 8] = _absorb(lanes[i // 8], byte + 0x100 * (i + 1))
    h = (len(data) * MUL) & MASK
    for lane in lanes:
        h = (_mix(h ^ lane) * MUL) & MASK
    return _mix(h)


def reseal(data: bytearray) -> bytes:
    """Recomputes the payload checksum (bytes 80..88) and the header checksum (bytes 120..128)."""
    data[80:88] = struct.pack("<Q", checksum64(bytes(data[HEADER:])))
    data[120:128] = struct.pack("<Q", checksum64(bytes(data[:120])))
    return bytes(data)


def align(x):
    return (x + 63) // 64 * 64


class Layout:
    """Section offsets as documented in csrc/certrag/hnsw.cpp."""

    def __init__(self, data: bytes):
        self.dim, self.M, self.M0 = struct.unpack_from("<III", data, 20)
        self.count = struct.unpack_from("<Q", data, 48)[0]
        self.max_level = struct.unpack_from("<i", data, 36)[0]
        self.entry = struct.unpack_from("<I", data, 64)[0]
        self.stride0 = 4 * (self.M0 + 1) + 4 * self.dim
        self.levels = HEADER
        self.labels = align(self.levels + 4 * self.count)
        self.deleted = align(self.labels + 8 * self.count)
        self.level0 = align(self.deleted + self.count)
        self.upper = align(self.level0 + self.count * self.stride0)

    def level(self, data, node):
        return struct.unpack_from("<i", data, self.levels + 4 * node)[0]


@pytest.fixture
def saved(tmp_path):
    base, queries = clustered_vectors(300, 16, n_queries=20, latent_dim=6, seed=5)
    index = HnswIndex(dim=16, M=4, ef_construction=40, seed=2)
    index.add(base)
    index.remove([5, 6])
    path = tmp_path / "index.crag"
    index.save(path)
    return index, path, queries


def test_the_checksum_reimplementation_agrees_with_the_file(saved):
    _, path, _ = saved
    data = path.read_bytes()
    assert struct.unpack_from("<Q", data, 80)[0] == checksum64(data[HEADER:])
    assert struct.unpack_from("<Q", data, 120)[0] == checksum64(data[:120])


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_round_trip_gives_identical_results(tmp_path, metric, mmap, clustered_1001):
    base, queries = clustered_1001
    index = HnswIndex(dim=48, metric=metric, M=8, ef_construction=60, seed=4)
    index.add(base)
    index.remove([3, 500])
    before = index.search(queries, k=10, ef=50)
    path = tmp_path / "ix"
    index.save(path)
    loaded = HnswIndex.load(path, mmap=mmap)
    after = loaded.search(queries, k=10, ef=50)
    np.testing.assert_array_equal(before.ids, after.ids)
    np.testing.assert_array_equal(before.scores, after.scores)
    assert len(loaded) == len(index) == 999
    assert loaded.metric == metric and loaded.M == 8 and loaded.ef_construction == 60
    assert loaded.stats()["mmapped"] is mmap
    # A loaded index keeps working: adding copies a mapped file into memory, and the file stays as it was.
    file_bytes = path.read_bytes()
    loaded.add(base[:5] * 1.01 + 0.01, ids=np.arange(2000, 2005))
    assert loaded.search(base[0] * 1.01 + 0.01, k=1, ef=64).ids[0, 0] in (0, 2000)
    assert path.read_bytes() == file_bytes
    loaded.save(path)
    assert len(HnswIndex.load(path)) == 1004


def test_empty_index_round_trip(tmp_path):
    path = tmp_path / "empty"
    HnswIndex(dim=3).save(path)
    loaded = HnswIndex.load(path, mmap=True)
    assert len(loaded) == 0
    loaded.add(np.ones((1, 3)))
    assert loaded.search(np.ones(3), k=1).ids[0, 0] == 0


def test_save_leaves_no_temporary_files(saved):
    _, path, _ = saved
    assert sorted(p.name for p in path.parent.iterdir()) == ["index.crag"]


def test_truncation_at_any_offset_raises(saved):
    _, path, _ = saved
    data = path.read_bytes()
    offsets = sorted(set([0, 1, 7, 8, 64, 127, 128, 129, len(data) - 1] + list(range(0, len(data), 97))))
    for cut in offsets:
        path.write_bytes(data[:cut])
        for mmap in (False, True):
            with pytest.raises(IndexFormatError):
                HnswIndex.load(path, mmap=mmap)
    path.write_bytes(data + b"\0")
    with pytest.raises(IndexFormatError, match="truncated or padded"):
        HnswIndex.load(path)


def test_flipped_bytes_anywhere_raise(saved, rng):
    _, path, _ = saved
    data = path.read_bytes()
    positions = list(range(0, HEADER)) + rng.integers(HEADER, len(data), size=300).tolist()
    for pos in positions:
        corrupt = bytearray(data)
        corrupt[pos] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(corrupt))
        with pytest.raises(IndexFormatError):
            HnswIndex.load(path, mmap=bool(pos % 2))
    path.write_bytes(data)
    assert len(HnswIndex.load(path)) == 298


def test_foreign_and_missing_files(tmp_path, rng):
    junk = tmp_path / "junk"
    junk.write_bytes(rng.integers(0, 256, size=4096, dtype=np.uint8).tobytes())
    with pytest.raises(IndexFormatError, match="wrong magic"):
        HnswIndex.load(junk)
    text = tmp_path / "text"
    text.write_text("hello\n" * 100)
    with pytest.raises(IndexFormatError, match="wrong magic"):
        HnswIndex.load(text)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(IndexFormatError, match="shorter than"):
        HnswIndex.load(empty)
    with pytest.raises(IndexFormatError, match="not a regular file"):
        HnswIndex.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        HnswIndex.load(tmp_path / "absent")


def test_newer_format_version_is_refused_clearly(saved):
    _, path, _ = saved
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 2)
    path.write_bytes(reseal(data))
    with pytest.raises(IndexFormatError, match="newer certrag .*version 2"):
        HnswIndex.load(path)


def _crafted(path, edit):
    data = bytearray(path.read_bytes())
    lay = Layout(bytes(data))
    edit(data, lay)
    path.write_bytes(reseal(data))


def _first_node_with_level(data, lay, minimum):
    return next(i for i in range(lay.count) if lay.level(data, i) >= minimum)


CRAFTED = {
    "level-0 neighbour out of range": (
        lambda d, lay: struct.pack_into("<II", d, lay.level0, 1, 10**6), "links to a node out of range"),
    "too many level-0 links": (
        lambda d, lay: struct.pack_into("<I", d, lay.level0, lay.M0 + 1), "too many level-0 links"),
    "level above the top": (
        lambda d, lay: struct.pack_into("<i", d, lay.levels, lay.max_level + 1), "invalid level"),
    "entry point below the top": (
        lambda d, lay: struct.pack_into("<I", d, 64, next(i for i in range(lay.count) if lay.level(d, i) == 0)),
        "entry point"),
    "duplicate live label": (
        lambda d, lay: struct.pack_into("<q", d, lay.labels + 8, struct.unpack_from("<q", d, lay.labels)[0]),
        "live twice"),
    "negative label": (lambda d, lay: struct.pack_into("<q", d, lay.labels, -4), "negative label"),
    "bad deleted flag": (lambda d, lay: struct.pack_into("<B", d, lay.deleted, 7), "deleted flag"),
    "non-finite vector": (
        lambda d, lay: struct.pack_into("<f", d, lay.level0 + 4 * (lay.M0 + 1), float("nan")), "non-finite"),
    "upper link to a node absent from the layer": (
        lambda d, lay: struct.pack_into(
            "<II", d, lay.upper, 1, next(i for i in range(lay.count) if lay.level(d, i) == 0)),
        "absent from its layer"),
    "node count beyond the file": (lambda d, lay: struct.pack_into("<Q", d, 48, 10**9), "does not fit the file"),
    "M0 not 2M": (lambda d, lay: struct.pack_into("<I", d, 28, 5), "Mmax0"),
    "unknown metric": (lambda d, lay: struct.pack_into("<I", d, 16, 9), "unknown metric"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_files_with_valid_checksums_raise(saved, case):
    _, path, _ = saved
    edit, message = CRAFTED[case]
    _crafted(path, edit)
    for mmap in (False, True):
        with pytest.raises(IndexFormatError, match=message):
            HnswIndex.load(path, mmap=mmap)


@pytest.mark.slow  # starts a subprocess
def test_a_kill_during_save_leaves_a_loadable_file(tmp_path):
    path = tmp_path / "ix"
    script = textwrap.dedent(f"""
        import numpy as np
        from certrag import HnswIndex
        from certrag.data.vectors import clustered_vectors
        base, _ = clustered_vectors(20000, 64, seed=1)
        index = HnswIndex(dim=64, M=8, ef_construction=20)
        index.add(base)
        print("ready", flush=True)
        while True:
            index.save({str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.time() + 60
        while not path.exists() and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.137)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    loaded = HnswIndex.load(path)
    assert len(loaded) == 20000
    # The interrupted write may leave its temporary file behind, never a damaged target.
    assert all(p.name == "ix" or p.name.startswith("ix.tmp-") for p in tmp_path.iterdir())
