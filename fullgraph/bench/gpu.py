"""GPU measurements (a script, not a test; it needs one CUDA device).

Steps, chosen with ``--steps`` (default: all), each printing JSON lines and a table:

- ``env``: the device, and the ceilings the other figures are quoted against:
  device-to-device copy bandwidth (bytes read + written), host-to-device and
  device-to-host copy rates from pinned memory, and a float32 matrix product rate.
- ``kernels``: on an R-MAT graph generated on the device (``--vertices``,
  ``--edges``, ``--dim`` columns, float32), the weighted SpMM forward and its
  transposed backward through each candidate: torch's CSR product (cuSPARSE) and,
  when Triton is installed, a row-per-program Triton kernel; effective bandwidth
  (``bench.kernels.spmm_bytes``: each edge's index, weight and source row, each
  output row once) against the copy bandwidth; the Triton result checked against
  torch's.
- ``attention``: GAT's attention weights (``attention_softmax``, forward and
  backward) with ``--heads`` heads on the same graph, with segment reductions over
  the CSR and with scatters by destination (``edge_softmax.SEGMENTED``).
- ``beyond``: NeutronTP §4.2 beyond device memory. (a) exactness: a small graph
  trained in float64 with tensor parallelism at world size 1 on the GPU, chunked
  under a small ``--device-memory``, the transform stages on the host
  (``nn_device=cpu``), against the single-process CPU run; (b) with and without the
  side-stream prefetch, the epoch time of the chunked run on a larger graph; (c)
  the demonstration: device memory capped (``torch.cuda.set_per_process_memory_fraction``)
  below the working set of a 2-layer GCN on ``--beyond-vertices`` /
  ``--beyond-edges``: PyG's ``GCNConv`` on the device, then fullgraph's chunked
  tensor parallelism under the same cap.

    python -m fullgraph.bench.gpu --out /tmp/gpu
    python -m fullgraph.bench.gpu --steps kernels --vertices 10000000 --edges 200000000

The model tables against PyG are ``python -m fullgraph.bench.models --device cuda``,
and P2P bins with and without prefetch ``python -m fullgraph.bench.p2p --device cuda``
(``--no-prefetch``).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from fullgraph.bench import entry_point
from fullgraph.bench.kernels import spmm_bytes

STEPS = ("env", "kernels", "attention", "beyond")


def cuda_time(fn: Callable[[], Any], repeats: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def emit(out: Path | None, rec: dict[str, Any]) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    if out is not None:
        with open(out / "gpu.jsonl", "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------- env
def env_step(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    n = 1 << 28  # 1 GiB of float32
    a = torch.rand(n, device=dev)
    b = torch.empty_like(a)
    t_copy = cuda_time(lambda: b.copy_(a))
    host = torch.empty(n, pin_memory=True)
    t_h2d = cuda_time(lambda: a.copy_(host, non_blocking=True), repeats=5)
    t_d2h = cuda_time(lambda: host.copy_(a, non_blocking=True), repeats=5)
    m = torch.randn(8192, 8192, device=dev)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:  # (torch's default is off: the "tf32" figure was float32's too)
        torch.backends.cuda.matmul.allow_tf32 = True
        t_mm = cuda_time(lambda: m @ m, repeats=5)
        torch.backends.cuda.matmul.allow_tf32 = False
        t_mm32 = cuda_time(lambda: m @ m, repeats=5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {"step": "env", "device": props.name, "memory_GiB": props.total_memory / 2**30,
            "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "copy_GBps": 8 * n / t_copy / 1e9,
            "h2d_GBps": 4 * n / t_h2d / 1e9, "d2h_GBps": 4 * n / t_d2h / 1e9,
            "matmul_tf32_TFLOPs": 2 * 8192**3 / t_mm / 1e12,
            "matmul_fp32_TFLOPs": 2 * 8192**3 / t_mm32 / 1e12}


# ---------------------------------------------------------------- kernels
def rmat_csr(vertices: int, edges: int, seed: int, device: torch.device,
             abcd: tuple[float, float, float, float] = (0.57, 0.19, 0.19, 0.05)) -> Any:
    """A directed R-MAT graph drawn on the device (duplicates kept), as a CSR by
    destination; ``vertices`` rounded up to a power of 2 for the draw, ids folded back
    below ``vertices``. The package's generator (``graph.synthetic``) draws on the
    host, a minute or more at 200M edges of a short GPU lease; this takes under one
    second there. Kernel timing only: it is not the package's R-MAT, bit for bit."""
    from fullgraph.graph.csr import Graph

    gen = torch.Generator(device=device).manual_seed(seed)
    levels = max(1, math.ceil(math.log2(vertices)))
    src = torch.zeros(edges, dtype=torch.int64, device=device)
    dst = torch.zeros(edges, dtype=torch.int64, device=device)
    a, b, c, _ = abcd
    for _ in range(levels):
        r = torch.rand(edges, generator=gen, device=device)
        down = (r >= a + b).to(torch.int64)  # quadrants c, d: the source bit
        right = (((r >= a) & (r < a + b)) | (r >= a + b + c)).to(torch.int64)
        src = src * 2 + down
        dst = dst * 2 + right
        del r
    src.remainder_(vertices)
    dst.remainder_(vertices)
    order = torch.argsort(dst * vertices + src)
    src, dst = src[order], dst[order]
    del order
    counts = torch.bincount(dst, minlength=vertices)
    indptr = torch.zeros(vertices + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=indptr[1:])
    graph = Graph(indptr, src.to(torch.int32), num_src=vertices, validate=False)
    del dst
    return graph


def triton_spmm() -> Callable[..., Tensor] | None:
    """A row-per-program CSR SpMM in Triton (float32), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(indptr, indices, weight, x, out, dim, perm, HAS_PERM: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        cmask = cols < dim
        start = tl.load(indptr + row)
        end = tl.load(indptr + row + 1)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for e0 in range(start, end, BLOCK_E):
            eids = e0 + tl.arange(0, BLOCK_E)
            emask = eids < end
            src = tl.load(indices + eids, mask=emask, other=0).to(tl.int64)
            if HAS_PERM:
                wid = tl.load(perm + eids, mask=emask, other=0)
            else:
                wid = eids
            w = tl.load(weight + wid, mask=emask, other=0.0)
            xv = tl.load(x + src[:, None] * dim + cols[None, :],
                         mask=emask[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(xv * w[:, None], axis=0)
        tl.store(out + row.to(tl.int64) * dim + cols, acc, mask=cmask)

    def spmm(indptr: Tensor, indices: Tensor, weight: Tensor, x: Tensor,
             perm: Tensor | None = None, block_e: int = 16, block_d: int = 128,
             warps: int = 4) -> Tensor:
        n, d = indptr.numel() - 1, x.shape[1]
        out = torch.empty(n, d, dtype=x.dtype, device=x.device)
        grid = (n, triton.cdiv(d, block_d))
        kernel[grid](indptr, indices, weight, x, out, d, perm if perm is not None else indices,
                     HAS_PERM=perm is not None, BLOCK_E=block_e, BLOCK_D=block_d,
                     num_warps=warps)
        return out

    return spmm


def kernels_step(args: argparse.Namespace, out_dir: Path | None) -> list[dict[str, Any]]:
    from fullgraph.graph.csr import gcn_norm
    from fullgraph.ops.spmm import aggregate, set_backend

    dev = torch.device("cuda")
    t0 = time.perf_counter()
    graph = rmat_csr(args.vertices, args.edges, args.seed, dev)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    n, e, d = graph.num_dst, graph.num_edges, args.dim
    w = gcn_norm(graph)
    x = torch.randn(n, d, device=dev)
    t0 = time.perf_counter()
    tr = graph.transpose()
    torch.cuda.synchronize()
    transpose_s = time.perf_counter() - t0
    nbytes = spmm_bytes(n, e, d, weighted=True)
    base = {"step": "kernels", "vertices": n, "edges": e, "dim": d, "graph_s": gen_s,
            "transpose_s": transpose_s, "spmm_bytes": nbytes,
            "max_in_degree": int(graph.in_degrees().max())}
    recs = []
    set_backend("torch")
    w_t = w[tr.perm].contiguous()
    ref = aggregate(graph, x, w, "sum")
    ref_t = aggregate(tr.graph, x, w_t, "sum")
    cands: dict[str, tuple[Callable[[], Tensor], Callable[[], Tensor]]] = {
        "torch-csr": (lambda: aggregate(graph, x, w, "sum"),
                      lambda: aggregate(tr.graph, x, w_t, "sum"))}
    tri = triton_spmm()
    if tri is not None:
        ip, ix = graph.indptr, graph.indices
        tp, tix, perm = tr.graph.indptr, tr.graph.indices, tr.perm
        for be, bd, warps in ((8, 128, 4), (16, 128, 4), (32, 128, 8), (16, 64, 2)):
            name = f"triton-e{be}-d{bd}-w{warps}"
            cands[name] = (partial(tri, ip, ix, w, x, None, be, bd, warps),
                           partial(tri, tp, tix, w, x, perm, be, bd, warps))
    for name, (fwd, bwd) in cands.items():
        rec = dict(base, kernel=name)
        for label, fn, want in (("forward", fwd, ref), ("transposed", bwd, ref_t)):
            got = fn()
            rec[f"{label}_rel_err"] = float((got - want).norm() / want.norm())
            del got
            t = cuda_time(fn, repeats=args.repeats)
            rec[f"{label}_s"] = t
            rec[f"{label}_GBps"] = nbytes / t / 1e9
        emit(out_dir, rec)
        recs.append(rec)
    del ref, ref_t, cands
    torch.cuda.empty_cache()
    set_backend("auto")
    return recs


def attention_step(args: argparse.Namespace, out_dir: Path | None,
                   graph: Any = None) -> list[dict[str, Any]]:
    """GAT's attention weights (``attention_softmax``), forward and backward, with the
    segment reductions and with scatters by destination."""
    import importlib

    from fullgraph.ops.edge_softmax import attention_softmax

    softmax_module = importlib.import_module("fullgraph.ops.edge_softmax")
    dev = torch.device("cuda")
    if graph is None:
        graph = rmat_csr(args.vertices, args.edges, args.seed, dev)
    n, e = graph.num_dst, graph.num_edges
    base = {"step": "attention", "vertices": n, "edges": e}
    recs = []
    h = args.heads
    s_src = torch.randn(n, h, device=dev, requires_grad=True)
    s_dst = torch.randn(n, h, device=dev, requires_grad=True)
    grad = torch.randn(e, h, device=dev)

    def attention() -> None:
        attention_softmax(graph, s_src, s_dst, 0.2).backward(grad)

    def attention_fwd() -> None:
        with torch.no_grad():
            attention_softmax(graph, s_src, s_dst, 0.2)

    # at least: forward writes E x H weights and reads the CSR; backward reads the
    # weights and the gradient and writes the edge term once
    fwd_bytes = e * h * 4 + e * 4 + n * 8 + 2 * n * h * 4
    bwd_bytes = 3 * e * h * 4 + e * 4 + n * 8 + 4 * n * h * 4
    attention()
    graph.transpose()  # built once, as a training run does
    for segmented in (True, False):
        softmax_module.SEGMENTED["cuda"] = segmented
        torch.cuda.reset_peak_memory_stats()
        t_fwd = cuda_time(attention_fwd, repeats=args.repeats)
        t_all = cuda_time(attention, repeats=args.repeats)
        rec = dict(base, kernel="attention_softmax", heads=h,
                   reduction="segments" if segmented else "scatter", forward_s=t_fwd,
                   forward_GBps=fwd_bytes / t_fwd / 1e9, forward_backward_s=t_all,
                   forward_backward_GBps=(fwd_bytes + bwd_bytes) / t_all / 1e9,
                   peak_GiB=torch.cuda.max_memory_allocated() / 2**30)
        emit(out_dir, rec)
        recs.append(rec)
    softmax_module.SEGMENTED["cuda"] = False
    return recs


# ---------------------------------------------------------------- beyond device memory
def _tensor_run(ds: Any, device: torch.device, epochs: int, dtype: torch.dtype,
                options: Any | None, hidden: int) -> tuple[list[float], list[float], Any]:
    """Losses and epoch seconds of a 2-layer GCN; ``options`` None: single process."""
    from fullgraph.models import build_model
    from fullgraph.parallel.single import SingleProcess
    from fullgraph.parallel.tensor import TensorParallel
    from fullgraph.train import step_seed

    torch.manual_seed(0)
    model = build_model("gcn", ds.data.num_features, hidden, ds.data.num_classes,
                        num_layers=2, dropout=0.5).to(dtype)
    strategy: Any = SingleProcess() if options is None else TensorParallel(options)
    model_device = device if options is None or options.nn_device is None \
        else torch.device(options.nn_device)
    model = model.to(model_device)
    plan = strategy.setup(ds, model, device, None, dtype) if options is not None \
        else strategy.setup(ds, model, device, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses, secs = [], []
    for epoch in range(1, epochs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = strategy.train_step(model, plan, opt, seed=step_seed(0, epoch))
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
        losses.append(float(stats.loss))
    return losses, secs, plan


def beyond_step(args: argparse.Namespace, out_dir: Path | None) -> list[dict[str, Any]]:
    from fullgraph.bench.rmat import cached_rmat
    from fullgraph.graph import store
    from fullgraph.graph.synthetic import sbm
    from fullgraph.parallel.tensor import TensorParallel

    dev = torch.device("cuda", torch.cuda.current_device())
    recs = []
    rec: dict[str, Any]
    # (a) exactness, float64
    small = sbm(3000, 5, avg_degree=12.0, num_features=32, seed=3)
    ref, _, _ = _tensor_run(small, torch.device("cpu"), 3, torch.float64, None, 16)
    for prefetch in (True, False):
        opts = TensorParallel.Options(device_memory="256KB", nn_device="cpu", prefetch=prefetch)
        got, _, plan = _tensor_run(small, dev, 3, torch.float64, opts, 16)
        rec = {"step": "beyond-exact", "prefetch": prefetch, "chunks": len(plan.chunks),
               "losses_cpu": ref, "losses_gpu_chunked": got,
               "max_abs_diff": max(abs(a - b) for a, b in zip(ref, got))}
        emit(out_dir, rec)
        recs.append(rec)
    # (b) prefetch on / off, float32, on a larger graph
    ds = store.load_dataset(cached_rmat(args.cache, args.beyond_vertices, args.beyond_edges,
                                        args.beyond_features, 16, 0), mmap=False, verify=False)
    for nn_device in ("cpu", None):
        # without prefetch; with it on the same chunks (overlap alone); with it on the
        # chunks the budget gives it (half the size: two on the device at once)
        same = None
        for prefetch, variant in ((False, "budget"), (True, "same chunks"), (True, "budget")):
            opts = TensorParallel.Options(device_memory=args.beyond_budget, nn_device=nn_device,
                                          prefetch=prefetch) if variant == "budget" else \
                TensorParallel.Options(num_chunks=same, nn_device=nn_device, prefetch=prefetch)
            torch.cuda.reset_peak_memory_stats()
            losses, secs, plan = _tensor_run(ds, dev, args.epochs + 1, torch.float32, opts,
                                             args.hidden)
            same = same or len(plan.chunks)
            rec = {"step": "beyond-prefetch", "nn_device": nn_device or "cuda",
                   "prefetch": prefetch, "chunking": variant, "budget": args.beyond_budget,
                   "chunks": len(plan.chunks), "epoch_s": statistics.median(secs[1:]),
                   "losses": losses, "device_peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
                   "vertices": ds.graph.num_nodes, "edges": ds.graph.num_edges}
            emit(out_dir, rec)
            recs.append(rec)
            del plan
            torch.cuda.empty_cache()
    # (c) a capped device: PyG out of memory, fullgraph chunked trains
    cap = args.beyond_cap_gib * 2**30
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    pyg = _pyg_gcn(ds, dev, args)
    emit(out_dir, pyg)
    recs.append(pyg)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    opts = TensorParallel.Options(device_memory=args.beyond_budget, nn_device="cpu")
    try:
        losses, secs, plan = _tensor_run(ds, dev, args.epochs + 1, torch.float32, opts,
                                         args.hidden)
        rec = {
            "step": "beyond-capped", "system": "fullgraph tensor chunked",
            "cap_GiB": args.beyond_cap_gib, "ok": True, "epoch_s": statistics.median(secs[1:]),
            "losses": losses, "chunks": len(plan.chunks),
            "device_peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
            "working_set_GiB": pyg.get("working_set_GiB")}
    except torch.OutOfMemoryError as err:
        rec = {"step": "beyond-capped", "system": "fullgraph tensor chunked", "ok": False,
               "error": str(err).splitlines()[0]}
    emit(out_dir, rec)
    recs.append(rec)
    torch.cuda.set_per_process_memory_fraction(1.0, dev)
    return recs


def _pyg_gcn(ds: Any, dev: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """PyG's 2-layer GCNConv on the device under the cap: an epoch, or out of memory.
    ``working_set_GiB`` is what the uncapped run would need (graph, features, the
    activations and gradients of one step), counted from the shapes."""
    import torch.nn.functional as F

    from fullgraph.bench.models import PygNet

    g = ds.graph.with_self_loops(False)
    n, e, f, h = g.num_dst, g.num_edges, ds.data.num_features, args.hidden
    working = (e * 12 + n * 8 + n * f * 4 + 4 * n * h * 4 + 4 * n * 16 * 4) / 2**30
    rec: dict[str, Any] = {"step": "beyond-capped", "system": "pyg GCNConv",
                           "cap_GiB": args.beyond_cap_gib, "working_set_GiB": working}
    try:
        adj = torch.sparse_csr_tensor(g.indptr, g.indices.to(torch.int64), torch.ones(e),
                                      size=(n, n), check_invariants=False).to(dev)
        x = ds.data.features_as(torch.float32).to(dev)
        y, mask = ds.data.labels.to(dev), ds.data.train_mask.to(dev)
        net = PygNet("gcn", f, args).to(dev)  # bench.models' PyG GCN (16 classes)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        secs = []
        for _ in range(args.epochs + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(net(x, adj)[mask], y[mask]).backward()
            opt.step()
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
        rec.update(ok=True, epoch_s=statistics.median(secs[1:]))
    except torch.OutOfMemoryError as err:
        rec.update(ok=False, error=str(err).splitlines()[0])
    return rec


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", default=",".join(STEPS), help="comma list of " + ", ".join(STEPS))
    p.add_argument("--out", default=None, help="directory for gpu.jsonl (appended)")
    p.add_argument("--vertices", type=int, default=10_000_000)
    p.add_argument("--edges", type=int, default=200_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    p.add_argument("--beyond-vertices", type=int, default=2_000_000)
    p.add_argument("--beyond-edges", type=int, default=60_000_000)
    p.add_argument("--beyond-features", type=int, default=128)
    p.add_argument("--beyond-budget", default="1GB", help="--device-memory of the chunked runs")
    p.add_argument("--beyond-cap-gib", type=float, default=4.0,
                   help="device memory the capped comparison may use")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("no CUDA device is visible")
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"--steps: unknown {unknown}; expected some of {', '.join(STEPS)}")
    if "env" in steps:
        emit(out, env_step(args))
    if "kernels" in steps:
        kernels_step(args, out)
    if "attention" in steps:
        attention_step(args, out)
    if "beyond" in steps:
        beyond_step(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
