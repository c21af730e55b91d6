"""Decode attention's kernels against each other on this CPU: the native call per layer (certrag._core.decode_attention)
at the default reader's shape, and the default reader's decoding end to end, once per SIMD level the CPU has
(CERTRAG_SIMD caps the kernel choice when the module loads, so each level runs in its own process; the portable
kernel is the baseline measured in the same run).

    python benchmarks/bench_decode_attention.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

LEVELS = ("scalar", "avx2", "avx512")
CONTEXTS = (256, 1024, 2048)


def measure(args, generate: bool) -> dict:
    """This process's kernel: the attention of one decode step over every layer at each context length (median of
    repeats, one thread); with generate, the reader's time per decode step after a long prompt (median of repeats)."""
    from certrag import _core
    from certrag.llm.weights import q8_cache_dir

    c = json.loads((q8_cache_dir(args.model) / "config.json").read_text())  # the shape only: no weights loaded
    heads, kv, d, layers = c["heads"], c["kv_heads"], c["head_dim"], c["layers"]
    out = {"kernel": _core.decode_attention_kernel(d), "shape": {"heads": heads, "kv_heads": kv, "head_dim": d,
                                                                  "layers": layers}, "attention_ms": {}}
    rng = np.random.default_rng(0)
    cap = max(CONTEXTS)
    ks = [rng.standard_normal((layers, kv, cap, d)).astype(np.float32)]
    vs = [rng.standard_normal((layers, kv, cap, d)).astype(np.float32)]
    q = rng.standard_normal((1, heads, d)).astype(np.float32)
    new = rng.standard_normal((1, kv, d)).astype(np.float32)

    def step(n):
        for layer in range(layers):
            _core.decode_attention(q, new, new, ks, vs, layer, [n], [None], d ** -0.5, 1)

    for n in CONTEXTS:
        out["attention_ms"][str(n)] = _common.median_time(lambda: step(n), repeats=args.repeats, warmup=2) * 1e3
    if not generate:
        return out
    from certrag.data.corpora import wiki_leads
    from certrag.llm import LocalLLM

    llm = LocalLLM(args.model, weights="q8", num_threads=args.threads)

    text = " ".join(x for _, x, _ in wiki_leads()[:60])
    ids = llm.tokenizer.encode(text)[: args.prompt_tokens]
    messages = [{"role": "user", "content": llm.tokenizer.decode(ids) + "\n\nSummarise the passages above in "
                 "detail."}]
    llm.generate(messages, max_new_tokens=4)  # warm-up
    per_token, tokens = [], []
    for _ in range(args.repeats_generate):
        before = llm.engine.decode_seconds  # the engine's time in decode steps (the prefill is not one)
        g = llm.generate(messages, max_new_tokens=args.new_tokens)
        per_token.append((llm.engine.decode_seconds - before) / max(g.output_tokens - 1, 1))
        tokens.append(g.output_tokens)
    out.update(decode_ms_per_token=float(np.median(per_token)) * 1e3, generated_tokens=int(np.median(tokens)),
               prompt_tokens=g.input_tokens)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--repeats-generate", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    _common.pin_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args, generate=os.environ.get("CERTRAG_SIMD") == "auto")))
        return
    rows = []
    for level in (*LEVELS, "auto"):
        env = {**os.environ, "CERTRAG_SIMD": level}
        got = subprocess.run([sys.executable, __file__, "--measure", *sys.argv[1:]], env=env, capture_output=True,
                             text=True)
        if got.returncode != 0:
            raise SystemExit(f"CERTRAG_SIMD={level} failed:\n{got.stderr[-3000:]}")
        row = json.loads(got.stdout.strip().splitlines()[-1])
        if level == "auto":
            best = row
        elif row["kernel"] == level:  # else the CPU lacks this level (the cap never raises the choice)
            rows.append(row)
            print(level, row)
    base = rows[0]
    assert base["kernel"] == "scalar"
    if args.no_write:
        print(best)
        return
    meta = _common.meta({"model": args.model, "threads": args.threads})
    _common.write_rows("bench_decode_attention", [*rows, {"end_to_end": best}], meta)
    shape, far = base["shape"], str(max(CONTEXTS))
    # at the prompt's length, interpolated between the measured context lengths
    at_prompt = {r["kernel"]: float(np.interp(best["prompt_tokens"], CONTEXTS,
                                              [r["attention_ms"][str(n)] for n in CONTEXTS])) for r in rows}
    md = ["### Decode attention's kernels (bench_decode_attention.py)\n",
          f"One decode step's attention over all {shape['layers']} layers of {args.model} ({shape['heads']} query "
          f"heads, {shape['kv_heads']} key-value heads, head_dim {shape['head_dim']}), one thread, median of "
          f"{args.repeats}; each kernel in its own process (CERTRAG_SIMD caps the choice); the portable kernel is "
          "the baseline of the same run.\n",
          _common.markdown_table(
              ["kernel"] + [f"ms/token at {n} positions" for n in CONTEXTS] + [f"speed-up at {far}"],
              [[r["kernel"]] + [round(r["attention_ms"][str(n)], 2) for n in CONTEXTS] +
               [f"{base['attention_ms'][far] / r['attention_ms'][far]:.2f}x"] for r in rows]),
          f"\nThe reader decoding at this CPU's best level ({best['kernel']} attention, its q8 products at their "
          f"own best), one thread: {best['decode_ms_per_token']:.1f} ms per token after a "
          f"{best['prompt_tokens']:,}-token prompt (median of {args.repeats_generate}, {best['generated_tokens']} "
          f"tokens; the engine's time in decode steps, the prefill left out). Its attention costs "
          f"{at_prompt[best['kernel']]:.1f} ms of that; the portable kernel would cost "
          f"{at_prompt['scalar']:.1f} ms (interpolated at the prompt's length): "
          f"{(at_prompt['scalar'] - at_prompt[best['kernel']]) / best['decode_ms_per_token']:.0%} of a token's time "
          "saved there.\n"]
    _common.update_results_md("bench_decode_attention", "\n".join(md) + "\n" + _common.footer(meta))
    print("\n".join(md))


if __name__ == "__main__":
    main()
