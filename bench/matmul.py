"""`stallfree bench matmul`: the kernels a quantized model's projections can take, on its own weights, side by side.

For each row count, every projection of every layer in forward order (the weights stream from memory as in a
decode step, none stays in cache between repeats) and the LM head apart, through:
- `code`: the compiled extension's kernel on the GGUF codes (models/cpu_code_matmul.h: AVX512-VNNI, AVX2 or the
  portable loops, as the CPU's tier or STALLFREE_CPU_TIER says),
- `int4`: torch's `_weight_int4pack_mm_for_cpu` on the same codes (the Python path's few-row kernel),
- `onednn`: oneDNN's bfloat16 GEMM on the prepacked dense copy (the path past a few rows on AVX-512; absent below).
Kernels alternate repeat by repeat (a shared machine's load drifts); medians, the bytes each read, and each
kernel's time over the code kernel's. This is where models/quantized.py's CODE_MAX_ROWS and INT4_MAX_ROWS come
from. The JSON records the CPU's flags, its tier and the kernel each name stands for.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stallfree bench matmul", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a GGUF model (its Q4_0/Q4_1/Q8_0 tensors)")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="activation rows per matmul, comma-separated")
    p.add_argument("--repeats", type=int, default=15, help="timed sweeps per kernel and row count (after 2 warm-ups)")
    p.add_argument("--threads", type=int, default=0, help="0: the cores this process is given")
    p.add_argument("--json", default="runs/bench_matmul.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    rows = [int(n) for n in args.rows.split(",") if n.strip()]
    if not rows or min(rows) < 1 or args.repeats < 1:
        print("stallfree bench matmul: error: --rows and --repeats must be positive", file=sys.stderr)
        return 2
    import torch

    from stallfree.node_daemon.models import cpu_decode
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.models.layers import Linear, packed_linear
    from stallfree.node_daemon.models.loader import load_model
    from stallfree.node_daemon.models.quantized import GROUP_SIZE

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading {args.model} and the compiled extension ...", flush=True)
    loaded = load_model(ModelConfig(model=args.model, dtype="bfloat16", threads=args.threads))
    model = loaded.model
    code = cpu_decode.ensure_built(background=False)
    from stallfree.node_daemon.models.cpu_tier import cpu_flags, cpu_tier

    print(f"CPU tier {cpu_tier().describe()}; code kernel: "
          f"{cpu_decode.ops().code_kernel() if code else cpu_decode.why_not()}", flush=True)
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head and m.int4 is not None]
    head = model.tied_lm_head_int4 if model.lm_head is None else None
    if not layers:
        print(f"stallfree bench matmul: error: {args.model} has no int4-mappable projections", file=sys.stderr)
        return 2
    head_packed = model.tied_lm_head_packed
    groups = {"layers": [(m.int4, m.packed) for m in layers]}
    if head is not None:
        groups["head"] = [(head, head_packed)]

    def run(kernel: str, weights, xs) -> None:
        for (w, packed), x in zip(weights, xs):
            if kernel == "code":
                cpu_decode.ops().code_matmul(x, w.tiles.blocks, w.tiles.bits)
            elif kernel == "int4":
                torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat([x, x], 1) if w.planes == 2 else x, w.packed,
                                                           GROUP_SIZE, w.scales_and_zeros)
            else:
                packed_linear(x, packed, None)

    def nbytes(kernel: str, weights) -> int:
        if kernel == "code":
            return sum(w.tiles.nbytes for w, _ in weights)
        if kernel == "int4":
            return sum(w.packed.numel() + w.scales_and_zeros.numel() * w.scales_and_zeros.element_size()
                       for w, _ in weights)
        return sum(p.numel() * 2 for _, p in weights)  # bfloat16

    onednn = all(p is not None for weights in groups.values() for _, p in weights)
    kernels = (["code"] if code else []) + ["int4"] + (["onednn"] if onednn else [])
    if not code:
        print("  (no code kernel here: the extension did not build)", flush=True)
    if not onednn:
        print("  (no oneDNN copies: this tier serves every row count from the codes)", flush=True)
    results = []
    print(f"{'rows':>4} {'group':>6} " + " ".join(f"{k + ' ms':>10}" for k in kernels) + "   " +
          " ".join(f"{k + ' GB/s':>11}" for k in kernels) + "   " +
          " ".join(f"{k + '/' + kernels[0]:>12}" for k in kernels[1:]), flush=True)
    with torch.no_grad():
        for n in rows:
            for group, weights in groups.items():
                xs = [torch.randn(n, w.packed.shape[1] * 2 // w.planes).bfloat16() for w, _ in weights]
                times: dict[str, list[float]] = {k: [] for k in kernels}
                for repeat in range(args.repeats + 2):
                    for kernel in kernels:
                        started = time.perf_counter()
                        run(kernel, weights, xs)
                        if repeat >= 2:
                            times[kernel].append(time.perf_counter() - started)
                ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                gbs = {k: nbytes(k, weights) / (ms[k] / 1e3) / 1e9 for k in kernels}
                results.append({"rows": n, "group": group, "median_ms": ms, "read_gb_s": gbs,
                                "over_" + kernels[0]: {k: ms[k] / ms[kernels[0]] for k in kernels[1:]}})
                print(f"{n:>4} {group:>6} " + " ".join(f"{ms[k]:>10.2f}" for k in kernels) + "   " +
                      " ".join(f"{gbs[k]:>11.1f}" for k in kernels) + "   " +
                      " ".join(f"{ms[k] / ms[kernels[0]]:>11.2f}x" for k in kernels[1:]), flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "threads": torch.get_num_threads(), "cpu_tier": cpu_tier().name,
                               "cpu_flags": cpu_flags().split(":", 1)[-1].split(),
                               "code_kernel": str(cpu_decode.ops().code_kernel()) if code else None,
                               "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
