"""Kernel and single-process epoch benchmark (a script, not a test).

In one process on one machine it measures:
  (a) memory bandwidth (read, copy and triad over arrays far larger than cache),
  (b) GEMM rate,
  (c) SpMM effective bandwidth of our kernel and of torch's CSR ``torch.sparse.mm``,
      each as the operator call (which allocates and zeroes its output) and, for
      numba, the kernel alone into an output allocated before,
  (d) one training epoch (forward + backward + Adam) of a 2-layer GCN
      ``F -> hidden -> classes`` on an R-MAT graph, with fullgraph's single-process
      executor and with torch_geometric's ``GCNConv`` (normalisation cached, sparse
      ``adj_t`` input, the memory-feasible PyG path at this size; where PyG is not
      installed, ``pyg_left_out`` says so),
and prints one JSON object per line plus a readable summary with the roofline bound:
GEMM FLOPs at the measured GEMM rate plus SpMM bytes at the measured read bandwidth
(each the mean of a measurement before and one right after our epochs). The summary
gives SpMM's effective bandwidth as a share of the read bandwidth too.

``--allocators system,tcmalloc`` runs the whole measurement once per allocator, each
in a fresh process with the allocator preloaded, and prints the ratios side by side.
Torch's tensors go on transparent huge pages, as under the ``fullgraph`` command, unless
``--hugepages off`` (the benchmark re-executes itself once to set it before torch loads).

    python -m fullgraph.bench.kernels --vertices 1000000 --edges 20000000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from fullgraph.bench import NO_PYG, entry_point, names


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth(mib: int = 1024, repeats: int = 5) -> dict[str, float]:
    """STREAM-style read (sum), copy and triad in GB/s (bytes read + written).

    SpMM mostly reads, so the read figure is the bandwidth its efficiency is quoted
    against (``bandwidth_GBps`` is the largest of the three).
    """
    n = mib * (1 << 20) // 4
    a, b, c = torch.rand(n), torch.rand(n), torch.zeros(n)
    t_read = _median_time(lambda: a.sum(), repeats)
    t_copy = _median_time(lambda: c.copy_(a), repeats)
    t_triad = _median_time(lambda: torch.add(a, b, alpha=3.0, out=c), repeats)
    out = {"read_GBps": 4 * n / t_read / 1e9, "copy_GBps": 2 * 4 * n / t_copy / 1e9,
           "triad_GBps": 3 * 4 * n / t_triad / 1e9}
    out["bandwidth_GBps"] = max(out.values())
    return out


def gemm_rate(n: int = 200_000, k: int = 256, m: int = 256, repeats: int = 5) -> float:
    """GFLOP/s of a tall-skinny float32 GEMM like the ones GCN layers run."""
    a, b = torch.randn(n, k), torch.randn(k, m)
    t = _median_time(lambda: a @ b, repeats)
    return 2 * n * k * m / t / 1e9


def spmm_bytes(num_dst: int, num_edges: int, dim: int, weighted: bool) -> int:
    """Bytes an SpMM must move at least: indices (+weights), gathered rows, output, indptr."""
    per_edge = 4 + (4 if weighted else 0) + 4 * dim
    return num_edges * per_edge + num_dst * (8 + 4 * dim)


def load_graph(args: argparse.Namespace) -> Any:
    """The benchmark graph, cached in processed form so that allocator runs share it."""
    from fullgraph.graph import store, synthetic

    cache = Path(args.cache) / f"rmat-{args.vertices}-{args.edges}-{args.features}-{args.seed}"
    if store.is_cached(cache):
        return store.load_dataset(cache, mmap=False, verify=False)
    ds = synthetic.rmat(args.vertices, args.edges, seed=args.seed, num_features=args.features,
                        num_classes=args.classes)
    store.save_dataset(ds, cache)
    return ds


def bench_spmm(graph: Any, dim: int, repeats: int) -> dict[str, float]:
    from fullgraph.graph.csr import gcn_norm
    from fullgraph.ops import kernels
    from fullgraph.ops.spmm import aggregate, set_backend

    x = torch.randn(graph.num_src, dim)
    w = gcn_norm(graph)
    nbytes = spmm_bytes(graph.num_dst, graph.num_edges, dim, weighted=True)
    out: dict[str, float] = {}
    backends = ["torch"] + (["numba"] if kernels.HAVE_NUMBA else [])
    for name in backends:
        set_backend(name)
        t = _median_time(lambda: aggregate(graph, x, w, "sum"), repeats)
        out[f"spmm_{name}_s"] = t
        out[f"spmm_{name}_GBps"] = nbytes / t / 1e9
    set_backend("auto")
    if kernels.HAVE_NUMBA:  # the kernel alone, into an output allocated before
        buf = torch.empty(graph.num_dst, dim)
        args = (graph.indptr.numpy(), graph.indices.numpy(), w.numpy(), x.numpy(), buf.numpy())
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            kernels.spmm_scalar(*args)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        out.update(spmm_kernel_s=t, spmm_kernel_GBps=nbytes / t / 1e9)
    return out


def epoch_ours(ds: Any, args: argparse.Namespace) -> dict[str, Any]:
    from fullgraph.config import Config, ModelConfig, TrainConfig
    from fullgraph.parallel.single import SingleProcess
    from fullgraph.train import build, step_seed

    cfg = Config(model=ModelConfig(name="gcn", hidden=args.hidden, dropout=args.dropout),
                 train=TrainConfig(epochs=1))
    model = build(ds, cfg)
    strategy = SingleProcess()
    plan = strategy.setup(ds, model, torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    stats = [strategy.train_step(model, plan, opt, seed=step_seed(0, e))
             for e in range(args.epochs + 1)][1:]
    epoch = statistics.median(s.forward_s + s.backward_s + s.optimizer_s for s in stats)
    return {"ours_epoch_s": epoch, "ours_program": model.signature(),
            "ours_forward_s": statistics.median(s.forward_s for s in stats),
            "ours_backward_s": statistics.median(s.backward_s for s in stats)}


def epoch_pyg(ds: Any, args: argparse.Namespace) -> dict[str, Any]:
    """PyG's epoch, wall time around the whole step (ours is the sum of ``train_step``'s
    phase timers: it leaves out only ``zero_grad`` and reading the loss back); where PyG
    is not installed, ``pyg_left_out`` says so."""
    try:
        from torch_geometric.nn import GCNConv
    except ImportError:
        return {"pyg_left_out": NO_PYG}
    import torch.nn.functional as F

    g = ds.graph
    adj_t = torch.sparse_csr_tensor(g.indptr, g.indices.to(torch.int64),
                                    torch.ones(g.num_edges), size=(g.num_dst, g.num_src))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = GCNConv(args.features, args.hidden, cached=True)
            self.conv2 = GCNConv(args.hidden, args.classes, cached=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.dropout(x, args.dropout, self.training)
            x = F.relu(self.conv1(x, adj_t))
            x = F.dropout(x, args.dropout, self.training)
            return self.conv2(x, adj_t)

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    x, y = ds.data.features_as(torch.float32), ds.data.labels
    mask = ds.data.train_mask

    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(net(x)[mask], y[mask])
        loss.backward()
        opt.step()

    return {"pyg_epoch_s": _median_time(step, args.epochs)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from fullgraph.allocator import active_allocator
    from fullgraph.ops import kernels

    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    rec: dict[str, Any] = {"allocator": active_allocator(), "threads": args.threads,
                           "torch_hugepages": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"}
    rec.update(memory_bandwidth())
    rec["gemm_GFLOPs"] = gemm_rate()
    ds = load_graph(args)
    g = ds.graph.with_self_loops(True)
    rec.update(vertices=g.num_dst, edges_with_loops=g.num_edges)
    rec.update(bench_spmm(g, args.features, args.repeats))
    rec.update(epoch_ours(ds, args))
    # the bound uses the mean of a measurement before and one right after our epochs
    rec["read_after_GBps"] = memory_bandwidth()["read_GBps"]
    rec["gemm_after_GFLOPs"] = gemm_rate()
    rec.update(epoch_pyg(ds, args))
    rec.update(roofline(rec, g.num_dst, g.num_edges, args))
    return rec


def roofline(rec: dict[str, Any], n: int, e: int, args: argparse.Namespace) -> dict[str, float]:
    """Lower bound of our epoch: GEMMs at the GEMM rate + SpMMs at the read bandwidth
    (each the mean of the measurements before and after our epochs). The read figure,
    not the largest of the three: on the 2-core VM, copy and triad measured 70-79 GB/s
    in a process that had run other work, against 38-50 before and 41-50 for reads
    throughout, which made the bound swing by a third between runs.

    Our GCN propagates on the narrower side of each layer: layer 1 aggregates F
    columns forward only (the input needs no gradient), layer 2 aggregates C columns
    forward and backward. GEMMs: layer 1 forward and weight gradient; layer 2
    forward, weight gradient and input gradient.
    """
    f, h, c = args.features, args.hidden, args.classes
    flops = 2 * n * (2 * f * h + 3 * h * c)
    nbytes = spmm_bytes(n, e, f, True) + 2 * spmm_bytes(n, e, c, True)
    bw = (rec["read_GBps"] + rec.get("read_after_GBps", rec["read_GBps"])) / 2 * 1e9
    rate = (rec["gemm_GFLOPs"] + rec.get("gemm_after_GFLOPs", rec["gemm_GFLOPs"])) / 2 * 1e9
    return {"roofline_s": flops / rate + nbytes / bw, "roofline_gemm_s": flops / rate,
            "roofline_spmm_s": nbytes / bw, "roofline_GBps": bw / 1e9,
            "roofline_GFLOPs": rate / 1e9}


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vertices", type=int, default=1_000_000)
    p.add_argument("--edges", type=int, default=20_000_000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=47)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (median)")
    p.add_argument("--repeats", type=int, default=5, help="timed SpMM calls (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    p.add_argument("--allocators", default="",
                   help="comma list (system,tcmalloc,jemalloc): one fresh process each")
    p.add_argument("--hugepages", choices=("on", "off"), default="on",
                   help="torch tensors on transparent huge pages, both systems (default: on "
                        "where the kernel offers them, as the fullgraph command does)")
    args = p.parse_args(argv)
    # (every allocator found before the first run: each run takes minutes at the default size)
    preloads = allocator_preloads(p, args.allocators) if args.allocators else {}
    from fullgraph.allocator import reexec_for_hugepages

    reexec_for_hugepages("fullgraph.bench.kernels", args.hugepages == "on",
                         sys.argv[1:] if argv is None else argv)
    if not args.allocators:
        rec = measure(args)
        print(json.dumps(rec), flush=True)
        print_summary([rec])
        return 0
    rows = [run_with_allocator(name, preload, argv if argv is not None else sys.argv[1:])
            for name, preload in preloads.items()]
    for row in rows:
        print(json.dumps(row))
    print_summary(rows)
    return 1 if any("error" in row for row in rows) else 0


def allocator_preloads(p: argparse.ArgumentParser, value: str) -> dict[str, str | None]:
    """Per allocator of the comma list ``value``, the library to preload (None: the
    system's malloc); an argparse error for a name that is unknown or not installed."""
    from fullgraph.allocator import CANDIDATES, LIB_DIRS

    files = dict(CANDIDATES)
    preloads: dict[str, str | None] = {}
    for name in names(p, "--allocators", value, ("system", *files)):
        if name == "system":
            preloads[name] = None
            continue
        paths = [Path(d) / f for d in LIB_DIRS for f in files[name] if (Path(d) / f).is_file()]
        if not paths:
            p.error(f"--allocators: {name} is not installed (none of {', '.join(files[name])} "
                    f"in {', '.join(LIB_DIRS)}); install it or leave it out")
        preloads[name] = str(paths[0])
    return preloads


def run_with_allocator(name: str, preload: str | None, argv: list[str]) -> dict[str, Any]:
    """The measurement in a fresh process with ``preload`` preloaded; on a failure,
    ``{"allocator": name, "error": ...}`` with the tail of the child's stderr, which
    is also printed, so that the other allocators still run."""
    env = dict(os.environ, FULLGRAPH_ALLOCATOR_ACTIVE="1")
    env.pop("LD_PRELOAD", None)
    if preload is not None:
        env["LD_PRELOAD"] = preload
    rest = [a for a in argv if not a.startswith("--allocators")]
    if "--allocators" in argv:
        i = argv.index("--allocators")
        rest = argv[:i] + argv[i + 2:]
    done = subprocess.run([sys.executable, "-m", "fullgraph.bench.kernels", *rest], env=env,
                          capture_output=True, text=True)
    records = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and records:  # (the JSON line, before the child's own summary)
        return json.loads(records[-1])
    tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-ERROR_LINES:])
    print(f"allocator {name}: the measurement failed (exit {done.returncode}):\n{tail}",
          file=sys.stderr, flush=True)
    return {"allocator": name, "error": tail.splitlines()[-1] if tail else
            f"exit {done.returncode}"}


ERROR_LINES = 10
"""Lines of a failed child's stderr shown (a traceback's last frames and its error)."""


def print_summary(rows: list[dict[str, Any]]) -> None:
    """The readable form of each measurement: SpMM's effective bandwidth against the
    read bandwidth (``memory_bandwidth``: SpMM mostly reads), the epochs against the
    roofline bound."""
    for r in rows:
        if "error" in r:
            print(f"\n== {r['allocator']}: failed: {r['error']}")
            continue
        print(f"\n== {r['allocator']} ({r['threads']} threads"
              f"{', torch on huge pages' if r.get('torch_hugepages') else ''}), "
              f"{r['vertices']} vertices, {r['edges_with_loops']} edges incl. self-loops")
        print(f"memory bandwidth   read {r['read_GBps']:.1f}, copy {r['copy_GBps']:.1f}, "
              f"triad {r['triad_GBps']:.1f} GB/s")
        print(f"GEMM               {r['gemm_GFLOPs']:.1f} GFLOP/s")
        if "read_after_GBps" in r:
            print(f"after our epochs   read {r['read_after_GBps']:.1f} GB/s, "
                  f"GEMM {r['gemm_after_GFLOPs']:.1f} GFLOP/s (the bound uses the means: "
                  f"{r['roofline_GBps']:.1f} GB/s, {r['roofline_GFLOPs']:.1f} GFLOP/s)")
        bw = r["read_GBps"]
        for name in ("numba", "torch", "kernel"):
            if f"spmm_{name}_GBps" in r:
                print(f"SpMM {name:<6}        {r[f'spmm_{name}_GBps']:.1f} GB/s effective "
                      f"({r[f'spmm_{name}_GBps'] / bw:.0%} of the read bandwidth)"
                      f"{'  (numba kernel, output allocated before)' if name == 'kernel' else ''}")
        print(f"epoch fullgraph    {r['ours_epoch_s']:.3f} s  (roofline {r['roofline_s']:.3f} s: "
              f"GEMM {r['roofline_gemm_s']:.3f} + SpMM {r['roofline_spmm_s']:.3f}; "
              f"{r['ours_epoch_s'] / r['roofline_s']:.2f}x the bound)")
        if "pyg_epoch_s" in r:
            print(f"epoch PyG GCNConv  {r['pyg_epoch_s']:.3f} s  -> fullgraph / PyG = "
                  f"{r['ours_epoch_s'] / r['pyg_epoch_s']:.2f}")
        elif "pyg_left_out" in r:
            print(f"epoch PyG GCNConv  -  ({r['pyg_left_out']})")


if __name__ == "__main__":
    sys.exit(main())
