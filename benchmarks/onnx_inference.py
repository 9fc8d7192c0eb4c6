"""Inference speed of the exported graphs: the GTAFL hard-vote graph in ONNX Runtime vs PyTorch eager
vs a single-head graph on the same extractor; batch 1 and 64; 2 threads.

    python benchmarks/onnx_inference.py [CHECKPOINT]   (default: a paper-width ResNet-8 GTAFL
                                                       checkpoint of the DermaMNIST benchmark run)

Targets (issue 5): the three-expert graph within 5 % of the single-head graph's throughput, and
ONNX Runtime at least as fast as eager PyTorch. Writes benchmarks/results/onnx_inference.{json,md}.
All variants run interleaved in one process, so the ratios are comparable.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.packaging.export import OPSET, SingleHeadGraph, build_graph  # noqa: E402
from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.models import ModelConfig, build_model  # noqa: E402

THREADS = 2


def export(graph, names, path, x):
    dyn = {"image": {0: "batch"}, **{n: {0: "batch"} for n in names}}
    with torch.no_grad():
        torch.onnx.export(graph, (torch.from_numpy(x[:2]),), str(path), input_names=["image"], output_names=list(names),
                          dynamic_axes=dyn, opset_version=OPSET, dynamo=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def timeit(fn, reps):
    fn()  # warm-up
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    torch.set_num_threads(THREADS)
    default = REPO / "benchmarks" / "out" / "gtafl_dermamnist" / "final.pt"
    ck_path = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    ck = load_checkpoint(ck_path)
    graph, experts, _ = build_graph(ck)
    mcfg = ModelConfig.from_dict(ck["model_config"])
    single_model = build_model(mcfg).eval()
    single_model.load_state_dict(ck["state"]["weights"])
    single = SingleHeadGraph(single_model, mcfg.is_vit, mcfg.img_size).eval()
    rng = np.random.default_rng(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        x64 = rng.normal(size=(64, mcfg.in_chans, mcfg.img_size, mcfg.img_size)).astype(np.float32)
        ens_sess = export(graph, type(graph).outputs, Path(tmp) / "ens.onnx", x64)
        one_sess = export(single, SingleHeadGraph.outputs, Path(tmp) / "one.onnx", x64)
        for bs in (1, 64):
            x = x64[:bs]
            xt = torch.from_numpy(x)
            reps = 200 if bs == 1 else 30
            variants = {
                "gtafl_onnxruntime": lambda: ens_sess.run(None, {"image": x}),
                "single_head_onnxruntime": lambda: one_sess.run(None, {"image": x}),
                "gtafl_pytorch_eager": lambda: graph(xt),
            }
            times = {k: [] for k in variants}
            with torch.no_grad():
                for _ in range(3):  # interleave rounds so drift hits every variant alike
                    for k, fn in variants.items():
                        times[k] += timeit(fn, reps // 3)
            for k, ts in times.items():
                med = statistics.median(ts)
                results[f"{k}_b{bs}"] = {"batch": bs, "median_latency_ms": 1000 * med,
                                         "p90_latency_ms": 1000 * float(np.percentile(ts, 90)),
                                         "throughput_img_s": bs / med}
    r = results
    ratios = {
        f"b{bs}": {"gtafl_vs_single_head_throughput": r[f"gtafl_onnxruntime_b{bs}"]["throughput_img_s"]
                   / r[f"single_head_onnxruntime_b{bs}"]["throughput_img_s"],
                   "onnxruntime_vs_eager_throughput": r[f"gtafl_onnxruntime_b{bs}"]["throughput_img_s"]
                   / r[f"gtafl_pytorch_eager_b{bs}"]["throughput_img_s"]} for bs in (1, 64)}
    out = {"checkpoint": str(ck_path), "backbone": mcfg.backbone, "width": mcfg.width, "img_size": mcfg.img_size,
           "experts": [e.name for e in experts], "threads": THREADS, "date": time.strftime("%Y-%m-%d"),
           "onnxruntime": ort.__version__, "torch": torch.__version__, "results": results, "ratios": ratios,
           "targets": {"gtafl_vs_single_head_throughput": ">= 0.95", "onnxruntime_vs_eager_throughput": ">= 1.0"}}
    res = REPO / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "onnx_inference.json").write_text(json.dumps(out, indent=2))
    lines = [f"# ONNX inference ({mcfg.backbone} width {mcfg.width}, {mcfg.img_size}px, {THREADS} threads, "
             f"{out['date']})", "", "| variant | batch | median ms | p90 ms | images/s |", "|---|---|---|---|---|"]
    for k, v in results.items():
        lines.append(f"| {k.rsplit('_b', 1)[0]} | {v['batch']} | {v['median_latency_ms']:.2f} | "
                     f"{v['p90_latency_ms']:.2f} | {v['throughput_img_s']:.0f} |")
    lines += ["", "| batch | GTAFL / single-head throughput (target ≥ 0.95) | ONNX Runtime / eager (target ≥ 1.0) |",
              "|---|---|---|"]
    for b, rr in ratios.items():
        lines.append(f"| {b[1:]} | {rr['gtafl_vs_single_head_throughput']:.3f} | "
                     f"{rr['onnxruntime_vs_eager_throughput']:.2f} |")
    (res / "onnx_inference.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
