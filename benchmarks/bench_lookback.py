"""What recording lookback ratios costs during decoding, against plain generation and the Lookback Lens way.

Model: the bundled Qwen2.5-Coder-0.5B-Instruct (float32, one torch thread: MODELS.md). For each context length
(1k, 4k, 16k tokens) the KV cache is filled to that length and 128 tokens are decoded greedily (min_new_tokens =
max_new_tokens = 128), with
  plain:  transformers' SDPA attention (the default);
  record: certrag's recording attention (certrag.certify.lookback: SDPA output plus span masses for the prompt, the
          generated tokens and 8 chunk spans, every layer and head, every step).
Time per token is the median gap between consecutive decode steps (a logits processor stamps each step); peak
memory is the process's peak resident set size, and its growth during decoding. Each (length, mode) runs in its own
process, modes interleaved, repeated; the ratio record / plain compares runs of the same length.

The cache is filled with random keys and values rather than a real prefill: decoding costs the same whatever the
cache holds, and a real 16k-token prefill takes tens of minutes on one CPU core. The Lookback Lens way (eager
attention with output_attentions through generate, which keeps every layer's full prefill attention matrix) is run
end to end on a real 1k-token prompt beside plain generation of the same prompt; at 4k and 16k its prefill
attention alone needs more memory than the machine has, computed and reported instead of run.

    python benchmarks/bench_lookback.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MODES = ("plain", "record")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(mode: str, length: int, tokens: int, model_name: str, real: bool, repeats: int = 1) -> dict:
    """mode: plain, record or eager (one decode, for peak memory and time), or time (plain and record alternated
    `repeats` times in this one process, for the time ratio)."""
    _common.pin_threads(1)
    import numpy as np
    import torch
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    from certrag.llm import LocalLLM
    from certrag.certify.lookback import recording

    from transformers import AutoModelForCausalLM

    from certrag.llm.models import converted_model_dir

    llm = LocalLLM(model_name)  # its tokenizer; the transformers model is what this benchmark's recorder measures
    model = AutoModelForCausalLM.from_pretrained(str(converted_model_dir(model_name)), local_files_only=True,
                                                 attn_implementation="sdpa").eval()
    cfg = model.config
    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            import time

            stamps.append(time.perf_counter())
            return scores

    chunks = [(16 + i * (length - 64) // 8, 16 + (i + 1) * (length - 64) // 8) for i in range(8)]
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, temperature=None, top_p=None,
              top_k=None, pad_token_id=0, logits_processor=LogitsProcessorList([Stamp()]))
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def inputs():
        if real:  # a real prompt, prefilled by generate itself (the Lookback Lens comparison)
            from certrag.data.corpora import retrieval_corpus

            text = " ".join(d.text for d in retrieval_corpus()[:400])
            return torch.tensor([llm.tokenizer(text, add_special_tokens=False)["input_ids"][:length]]), {}
        g = torch.Generator().manual_seed(0)
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            cache.update(torch.randn(1, cfg.num_key_value_heads, length - 1, hd, generator=g),
                         torch.randn(1, cfg.num_key_value_heads, length - 1, hd, generator=g), layer)
        return torch.randint(1000, 20000, (1, length), generator=g), {"cache": cache}

    generated = {}

    def decode(how: str) -> list[float]:
        stamps.clear()
        ids, extra = inputs()
        with torch.inference_mode():
            if how == "eager":
                model.set_attn_implementation("eager")
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), output_attentions=True,
                                     return_dict_in_generate=True, **kw, **extra).sequences
            elif how in ("record", "record_fused"):
                with recording(model, ids.shape[1], chunks, fused_output=how == "record_fused") as rec:
                    seq = model.generate(ids, attention_mask=torch.ones_like(ids), **kw, **extra)
                assert len(rec.finish().chunk_spans) == 8 and len(rec.masses) >= tokens - 1
            else:
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), **kw, **extra)
        generated.setdefault(how, []).append(seq[0, ids.shape[1]:].tolist())
        return list(np.diff(stamps))

    if mode in ("time", "time_fused"):
        modes = ("plain", "record") if mode == "time" else ("plain", "record", "record_fused")
        gaps = {m: [] for m in modes}
        decode("plain")  # warm-up
        for rep in range(repeats):
            for how in (modes if rep % 2 == 0 else modes[::-1]):
                gaps[how].append(float(np.median(decode(how))))
        reference = generated["plain"][0]
        return {"mode": mode, "length": length, "tokens": tokens, "repeats": repeats,
                **{f"{m}_ms_per_token": float(np.median(gaps[m]) * 1e3) for m in modes},
                **{f"{m}_runs_ms": [g * 1e3 for g in gaps[m]] for m in modes},
                **{f"{m}_same_tokens": all(t == reference for t in generated[m]) for m in modes}}
    before = _rss_mb()
    gaps = decode(mode)
    return {"mode": mode, "length": length, "real_prompt": real, "tokens": len(gaps) + 1,
            "ms_per_token": float(np.median(gaps) * 1e3), "peak_rss_mb": _peak_mb(), "rss_before_decode_mb": before,
            "growth_mb": _peak_mb() - before}


def eager_prefill_gb(cfg, length: int) -> float:
    """Memory generate(output_attentions=True) keeps for the prefill: every layer's (heads, L, L) float32 matrix."""
    return cfg.num_hidden_layers * cfg.num_attention_heads * length * length * 4 / 2**30


def fused_report(args, rows: list[dict]) -> None:
    table = [[r["length"], r["plain_ms_per_token"], r["record_ms_per_token"] / r["plain_ms_per_token"],
              r["record_fused_ms_per_token"] / r["plain_ms_per_token"], "yes" if r["record_same_tokens"] else "no",
              "yes" if r["record_fused_same_tokens"] else "no"] for r in rows]
    meta = _common.meta({"bench": "bench_lookback_fused", "model": args.model, "tokens": args.tokens,
                         "repeats": args.repeats, "threads": 1})
    text = "\n".join([
        "### Recording in one pass on the CPU (bench_lookback.py --fused)\n",
        (f"**Verdict:** with `recording(fused_output=True)` recording costs at most "
         f"{max(r[3] for r in table):.3f}x plain generation per token (target <= 1.10x: "
         f"{'met' if max(r[3] for r in table) <= 1.10 else 'NOT met'}); the default two-pass recording costs at most "
         f"{max(r[2] for r in table):.3f}x in the same processes. Tokens equal to plain generation's: "
         f"{'all' if all(r[5] == 'yes' for r in table) else 'NOT all'} with the fused output, "
         f"{'all' if all(r[4] == 'yes' for r in table) else 'NOT all'} with the default.\n"),
        (f"{args.model}, float32, one torch thread, {args.tokens} tokens decoded greedily after a KV cache filled to "
         "the context length (as above); plain, record (SDPA's output, then the masses from a second read of the "
         "keys) and record fused (one matmul with the keys, one softmax, the masses and the output = weights x V "
         f"from it, no SDPA call) alternated in one process per length, {args.repeats} decodes each; median step "
         f"gap. Same tokens: every decode's {args.tokens} tokens equal plain's first decode.\n"),
        _common.markdown_table(["context", "plain ms/token", "record / plain", "fused / plain", "record same tokens",
                                "fused same tokens"], table),
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_lookback_fused", rows, meta)
        _common.update_results_md("bench_lookback_fused", text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="decodes per mode in the alternating timing process")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--fused", action="store_true",
                   help="time plain, record and record with fused_output=True (one pass: the output from the "
                        "masses' own softmax weights) alternated, and check their tokens against plain's")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        mode, length, real = args.worker
        print(json.dumps(worker(mode, int(length), args.tokens, args.model, real == "real", args.repeats)))
        return


    def run(mode, length, real=False, tokens=args.tokens):
        out = subprocess.run([sys.executable, __file__, "--worker", mode, str(length), "real" if real else "cache",
                              "--tokens", str(tokens), "--model", args.model, "--repeats", str(args.repeats)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"worker {mode} {length} failed:\n{out.stderr[-3000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(row, file=sys.stderr, flush=True)
        return row

    lengths = [int(x) for x in args.lengths.split(",")]
    if args.fused:
        fused_report(args, [run("time_fused", length) for length in lengths])
        return
    rows = []
    for length in lengths:
        rows.append(run("time", length))
        for mode in MODES:  # peak memory, each mode alone in its process (32 tokens suffice)
            rows.append(run(mode, length, tokens=32))
    from transformers import AutoConfig

    from certrag.llm.models import converted_model_dir

    cfg = AutoConfig.from_pretrained(str(converted_model_dir(args.model)), local_files_only=True)
    lens_rows = [run("plain", 1024, real=True), run("eager", 1024, real=True)]

    def mem(mode, length, key):
        return next(r[key] for r in rows if r["mode"] == mode and r["length"] == length)

    table = []
    for length in lengths:
        t = next(r for r in rows if r["mode"] == "time" and r["length"] == length)
        table.append([length, t["plain_ms_per_token"], t["record_ms_per_token"],
                      t["record_ms_per_token"] / t["plain_ms_per_token"], mem("plain", length, "peak_rss_mb"),
                      mem("record", length, "peak_rss_mb"), mem("plain", length, "growth_mb"),
                      mem("record", length, "growth_mb")])
    worst = max(r[3] for r in table)
    lp, le = lens_rows
    meta = _common.meta({"bench": "bench_lookback", "model": args.model, "tokens": args.tokens,
                         "repeats": args.repeats, "threads": 1})
    text = "\n".join([
        "### Recording lookback ratios while decoding (bench_lookback.py)\n",
        f"**Verdict:** recording costs at most {worst:.3f}x plain generation's time per token over "
        f"{', '.join(map(str, lengths))}-token contexts (target <= 1.10x: {'met' if worst <= 1.10 else 'NOT met'}); "
        f"its peak memory is within {max(abs(r[5] - r[4]) for r in table):.0f} MB of plain generation's.\n",
        f"{args.model}, float32, one torch thread, {args.tokens} tokens decoded greedily after a KV cache filled to "
        f"the context length; recording = span masses for the prompt, the generated tokens and 8 chunks, every "
        f"layer and head, every step. Time: the median step gap of each decode, median over {args.repeats} decodes "
        f"per mode, plain and record alternated in one process per length; memory: each mode alone in its own "
        f"process (32 tokens).\n",
        _common.markdown_table(["context", "plain ms/token", "record ms/token", "record / plain",
                                "plain peak RSS MB", "record peak RSS MB", "plain growth MB", "record growth MB"],
                               table),
        "\nThe Lookback Lens way (eager attention, `output_attentions=True` through `generate`) on a real 1,024-token "
        "prompt, beside plain generation of the same prompt (prefill included):\n",
        _common.markdown_table(
            ["mode", "ms/token (decode)", "peak RSS MB", "growth MB"],
            [["plain (sdpa)", lp["ms_per_token"], lp["peak_rss_mb"], lp["growth_mb"]],
             ["eager + output_attentions", le["ms_per_token"], le["peak_rss_mb"], le["growth_mb"]],
             ["ratio eager / plain", le["ms_per_token"] / lp["ms_per_token"], le["peak_rss_mb"] / lp["peak_rss_mb"],
              le["growth_mb"] / max(lp["growth_mb"], 1.0)]]),
        "\nAt longer contexts the eager way's prefill attention alone would need "
        + ", ".join(f"{eager_prefill_gb(cfg, L):.0f} GB at {L}" for L in lengths if L > 1024)
        + f" (this machine has {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GB): not run. The Triton kernel on a GPU: "
          "bench_lookback_gpu.py.\n",
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_lookback", rows + lens_rows, meta)
        _common.update_results_md("bench_lookback", text)


if __name__ == "__main__":
    main()
