"""One training epoch of every model against PyG's layers (a script, not a test).

On one cached R-MAT graph (``--vertices``, ``--edges`` after symmetrisation,
``--features``, 16 classes), per model: fullgraph's single-process executor and the
same 2-layer architecture from PyG's layers (``GCNConv`` with cached normalisation,
``SAGEConv`` with mean aggregation, ``GATConv``, ``GINConv`` with a 2-layer MLP), both
trained in this process with dropout 0.5 and Adam; an epoch is forward, loss,
backward and the optimiser step, the median of ``--epochs`` after one warm-up. The two
systems of a model run in turn, ``--rounds`` times, and the medians over rounds are
reported with their ratio. PyG gets the graph as a sparse CSR ``adj_t`` where its
layer takes one (GCN, SAGE, GIN) and as an edge list with self-loops added
beforehand for GAT.

    python -m fullgraph.bench.models
    python -m fullgraph.bench.models --tables attention   # fused GAT attention vs torch ops
    python -m fullgraph.bench.models --vertices 20000 --edges 400000 --epochs 2   # quick
    python -m fullgraph.bench.models --device cuda --models gcn,gat   # on the GPU
    python -m fullgraph.bench.models --models gcn --roofline   # GCN against its bound

On ``--device cuda`` both systems train on the GPU, each step ends with a device
synchronisation, and a system that runs out of device memory is reported as such
(the other one still runs). ``--profile N`` then profiles one more epoch of each
system (``torch.profiler``, on CUDA with the device's kernels) and prints its N
operators of most time, self time on the device first: where an epoch goes.

Both systems share the process, so they share its allocator and its huge pages. As
the ``fullgraph`` command does, the benchmark asks torch for transparent huge pages
(``THP_MEM_ALLOC_ENABLE=1``, re-executing itself once before torch loads) where the
kernel offers them; ``--hugepages off`` keeps 4 KiB pages. Without huge pages an
epoch's fresh (N, hidden) tensors fault in 4 KiB at a time and PyG's epoch came to
depend on which models ran before it in the process (GIN: 3.5 s after GAT, 4.8 s
first; BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fullgraph.bench import entry_point, names, require_cuda
from fullgraph.bench.kernels import _median_time
from fullgraph.bench.rmat import cached_rmat
from fullgraph.extras import require

MODELS = ("gcn", "sage", "gat", "gin")
"""The models both systems build (``PygNet``): fullgraph's others have no PyG side here."""
TABLES = ("models", "attention")
CLASSES = 16


def ours_step(ds: Any, model: str, args: argparse.Namespace) -> Callable[[], None]:
    from fullgraph.config import Config, ModelConfig, TrainConfig
    from fullgraph.parallel.single import SingleProcess
    from fullgraph.train import build, step_seed

    extra = {"heads": args.heads} if model == "gat" else {}
    hidden = args.gat_channels if model == "gat" else args.hidden
    cfg = Config(model=ModelConfig(name=model, hidden=hidden, dropout=0.5, **extra),
                 train=TrainConfig(epochs=1))
    torch.manual_seed(0)
    net = build(ds, cfg)
    strategy = SingleProcess()
    device = torch.device(args.device)
    plan = strategy.setup(ds, net.to(device), device)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    epoch = [0]

    def step() -> None:
        epoch[0] += 1
        strategy.train_step(net, plan, opt, seed=step_seed(0, epoch[0]))

    return synced(step, device)


def synced(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` that returns once the device has finished its work."""
    if device.type != "cuda":
        return step

    def run() -> None:
        step()
        torch.cuda.synchronize(device)

    return run


class PygNet(nn.Module):
    """Two PyG layers with dropout on each input and ReLU between (as fullgraph's)."""

    def __init__(self, model: str, in_dim: int, args: argparse.Namespace) -> None:
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv

        h = args.hidden
        if model == "gcn":
            self.convs = nn.ModuleList([GCNConv(in_dim, h, cached=True),
                                        GCNConv(h, CLASSES, cached=True)])
        elif model == "sage":
            self.convs = nn.ModuleList([SAGEConv(in_dim, h), SAGEConv(h, CLASSES)])
        elif model == "gat":
            c, heads = args.gat_channels, args.heads
            self.convs = nn.ModuleList([
                GATConv(in_dim, c, heads=heads, dropout=0.5, add_self_loops=False),
                GATConv(c * heads, CLASSES, heads=1, dropout=0.5, add_self_loops=False)])
        elif model == "gin":
            def mlp(i: int, o: int) -> nn.Module:
                return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))
            self.convs = nn.ModuleList([GINConv(mlp(in_dim, h)), GINConv(mlp(h, CLASSES))])
        else:  # (never another architecture under this model's name)
            raise ValueError(f"PyG side of model {model!r}: none here; expected one of "
                             f"{', '.join(MODELS)}")

    def forward(self, x: Tensor, graph: Tensor) -> Tensor:
        x = self.convs[0](F.dropout(x, 0.5, self.training), graph)
        return self.convs[1](F.dropout(F.relu(x), 0.5, self.training), graph)


def pyg_step(ds: Any, model: str, args: argparse.Namespace) -> Callable[[], None]:
    g = ds.graph
    if model == "gat":
        looped = g.with_self_loops(True)
        src, dst = looped.edges()
        graph = torch.stack([src, dst])
    else:
        if g.has_self_loops():
            g = g.with_self_loops(False)  # GCNConv adds its own, SAGE/GIN take none
        graph = torch.sparse_csr_tensor(g.indptr, g.indices.to(torch.int64),
                                        torch.ones(g.num_edges), size=(g.num_dst, g.num_src),
                                        check_invariants=False)
    device = torch.device(args.device)
    torch.manual_seed(0)
    net = PygNet(model, ds.data.num_features, args).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    x, y, mask = ds.data.features_as(torch.float32), ds.data.labels, ds.data.train_mask
    x, y, mask, graph = (t.to(device) for t in (x, y, mask, graph))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(net(x, graph)[mask], y[mask]).backward()
        opt.step()

    return synced(step, device)


def attention_table(ds: Any, args: argparse.Namespace) -> list[str]:
    """GAT's attention weights (forward and backward) fused against the same from torch
    ops, on the graph with self-loops, ``--heads`` heads, medians of ``--epochs`` calls
    each over ``--rounds`` alternating rounds."""
    from fullgraph.ops import kernels
    from fullgraph.ops.edge_softmax import attention_softmax, edge_softmax

    g = ds.graph.with_self_loops(True)
    g.transpose()
    gen = torch.Generator().manual_seed(0)
    s_src = torch.randn(g.num_src, args.heads, generator=gen)
    s_dst = torch.randn(g.num_dst, args.heads, generator=gen)
    grad = torch.randn(g.num_edges, args.heads, generator=gen)

    def composite(a: Tensor, b: Tensor) -> Tensor:
        src, dst = g.edges()
        return edge_softmax(g, F.leaky_relu(a[src] + b[dst], 0.2))

    def fused(a: Tensor, b: Tensor) -> Tensor:
        return attention_softmax(g, a, b, 0.2)

    def call(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[], None]:
        def run() -> None:
            a, b = s_src.clone().requires_grad_(), s_dst.clone().requires_grad_()
            fn(a, b).backward(grad)
        return run

    times: dict[str, list[float]] = {"fused": [], "composite": []}
    for _ in range(args.rounds):
        for name, fn in (("fused", fused), ("composite", composite)):
            times[name].append(_median_time(call(fn), args.epochs))
    ours, theirs = statistics.median(times["fused"]), statistics.median(times["composite"])
    path = kernel_path(fused(s_src.clone().requires_grad_(), s_dst))
    why = "numba is not installed (pip install 'fullgraph[fast]')" if not kernels.HAVE_NUMBA \
        else "the SpMM backend is torch"
    note = [] if path != "torch ops" else [
        f"(no fused kernel ran: {why}, so attention_softmax took torch ops, as the other "
        "column does)", ""]
    return [f"GAT attention weights, forward and backward, {g.num_edges} edges x {args.heads} "
            "heads:", "", *note, f"| fused ({path}) s | torch ops s | fused / torch ops |",
            "| --- | --- | --- |", f"| {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} |"]


ATTENTION_PATHS = {"_AttentionSoftmaxBackward": "numba", "_TritonAttentionBackward": "triton",
                   "_SegmentedAttentionBackward": "segmented torch",
                   "_EdgeSoftmaxBackward": "torch ops"}
"""``attention_softmax``'s paths (``ops.edge_softmax``), by the autograd node of their
output: the table names the one that ran, not the one it hoped for."""


def kernel_path(weights: Tensor) -> str:
    """Which path of ``attention_softmax`` made ``weights``: numba, triton, segmented
    torch or torch ops."""
    name = type(weights.grad_fn).__name__
    return ATTENTION_PATHS.get(name, name)


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vertices", type=int, default=200_000)
    p.add_argument("--edges", type=int, default=4_000_000, help="after symmetrisation")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8, help="GAT heads of the hidden layer")
    p.add_argument("--gat-channels", type=int, default=8, help="GAT columns per head")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma list of {', '.join(MODELS)}: the models PyG's side builds")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per round (median)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both systems in turn")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", default="/tmp/fullgraph-bench")
    p.add_argument("--tables", default="models", help=f"comma list of {', '.join(TABLES)}")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both systems)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the table, the N operators of most time in one epoch of each "
                        "system (0: no profile)")
    p.add_argument("--roofline", action="store_true",
                   help="after the table, GCN's epoch against its bound: the GEMMs at the "
                        "device's measured GEMM rate and the SpMMs at its read bandwidth "
                        "(both measured before and after the models, as bench.kernels does)")
    p.add_argument("--hugepages", choices=("on", "off"), default="on",
                   help="torch tensors on transparent huge pages, both systems (default: on "
                        "where the kernel offers them, as the fullgraph command does)")
    args = p.parse_args(argv)
    # (every name checked before any work: a model PyG has no layer for here would be
    # timed against another architecture, and a bad name would end half a table)
    args.models = names(p, "--models", args.models, MODELS)
    tables = names(p, "--tables", args.tables, TABLES)
    require_cuda(p, args.device)
    from fullgraph.allocator import memory_line, reexec_for_hugepages

    reexec_for_hugepages("fullgraph.bench.models", args.hugepages == "on",
                         sys.argv[1:] if argv is None else argv)
    if "models" in tables:
        require("torch_geometric", "the comparison with PyG (--tables models)")
    from fullgraph.graph import store
    from fullgraph.ops import kernels

    torch.set_num_threads(args.threads)
    kernels.set_threads(args.threads)
    ds = store.load_dataset(cached_rmat(args.cache, args.vertices, args.edges, args.features,
                                        CLASSES, 0), mmap=False, verify=False)
    print(f"python -m fullgraph.bench.models {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"{args.threads} threads, torch {torch.__version__}; "
          f"R-MAT {ds.graph.num_nodes} vertices, {ds.graph.num_edges} edges, "
          f"{args.features} features, {CLASSES} classes; hidden {args.hidden} (GAT "
          f"{args.heads} heads x {args.gat_channels})\n{memory_line()}\n")
    if "attention" in tables:
        print("\n".join(attention_table(ds, args)) + "\n", flush=True)
    if "models" not in tables:
        return 0
    roofline = args.roofline and "gcn" in args.models
    before = device_ceilings(args.device) if roofline else None
    print("| model | fullgraph epoch, s | PyG epoch, s | fullgraph / PyG |")
    print("| --- | --- | --- | --- |")
    gcn_epoch = None
    for model in args.models:
        times = model_times(ds, model, args)
        got = {k: statistics.median(v) if v else None for k, v in times.items()}
        ours, theirs = got["ours"], got["pyg"]
        cells = ["out of memory" if t is None else f"{t:.3f}" for t in (ours, theirs)]
        ratio = f"{ours / theirs:.2f}" if ours is not None and theirs is not None else "-"
        print(f"| {model} | {cells[0]} | {cells[1]} | {ratio} |", flush=True)
        gcn_epoch = ours if model == "gcn" else gcn_epoch
    if before is not None:
        print("\n" + roofline_line(gcn_epoch, ds.graph, args, before,
                                   device_ceilings(args.device)), flush=True)
    if args.profile:
        for model in args.models:
            for name, make in (("fullgraph", ours_step), ("PyG", pyg_step)):
                step = _unless_oom(lambda: make(ds, model, args))
                if step is not None:
                    print(f"\n{name} {model}, one epoch after {WARMUPS} warm-ups:\n"
                          f"{profile_table(step, args.device, args.profile)}", flush=True)
    return 0


def device_ceilings(device: str) -> dict[str, float]:
    """The device's read bandwidth (GB/s: a 1 GiB float32 sum) and float32 GEMM rate
    (GFLOP/s: a (200,000 x 256) by (256 x 256) product, the shape of GCN's layers), the
    two rates ``bench.kernels.roofline`` divides by. On CUDA, timed with events, at the
    matmul precision torch is set to (float32 unless TF32 was allowed)."""
    from fullgraph.bench.kernels import gemm_rate, memory_bandwidth

    if not device.startswith("cuda"):
        return {"read_GBps": memory_bandwidth()["read_GBps"], "gemm_GFLOPs": gemm_rate()}
    from fullgraph.bench.gpu import cuda_time

    dev = torch.device(device)
    n, rows, k = 1 << 28, 200_000, 256
    with torch.cuda.device(dev):  # (the events are recorded on the current device)
        t_read = cuda_time(torch.rand(n, device=dev).sum)  # the 1 GiB freed on return
        x, w = torch.randn(rows, k, device=dev), torch.randn(k, k, device=dev)
        t_mm = cuda_time(lambda: x @ w)
    return {"read_GBps": 4 * n / t_read / 1e9, "gemm_GFLOPs": 2 * rows * k * k / t_mm / 1e9}


def roofline_line(epoch: float | None, graph: Any, args: argparse.Namespace,
                  before: dict[str, float], after: dict[str, float]) -> str:
    """GCN's median epoch against ``bench.kernels.roofline`` for this graph with a
    self-loop on every vertex (as GCN aggregates it) and these widths, at the mean of
    the rates measured before and after the models."""
    from fullgraph.bench.kernels import roofline

    rec = {"read_GBps": before["read_GBps"], "read_after_GBps": after["read_GBps"],
           "gemm_GFLOPs": before["gemm_GFLOPs"], "gemm_after_GFLOPs": after["gemm_GFLOPs"]}
    widths = argparse.Namespace(features=args.features, hidden=args.hidden, classes=CLASSES)
    looped = graph.with_self_loops(True)
    r = roofline(rec, looped.num_dst, looped.num_edges, widths)
    bound = (f"roofline {r['roofline_s']:.4f} s: GEMM {r['roofline_gemm_s']:.4f} + SpMM "
             f"{r['roofline_spmm_s']:.4f} at {r['roofline_GBps']:.1f} GB/s read and "
             f"{r['roofline_GFLOPs']:.1f} GFLOP/s (before {before['read_GBps']:.1f} / "
             f"{before['gemm_GFLOPs']:.1f}, after {after['read_GBps']:.1f} / "
             f"{after['gemm_GFLOPs']:.1f})")
    if epoch is None:
        return f"GCN epoch: out of memory; {bound}"
    return f"GCN epoch {epoch:.4f} s, {epoch / r['roofline_s']:.2f}x its {bound}"


WARMUPS = 2
"""Epochs before the profiled one. The second of ours puts GCN's fixed edge weights in
the transposed CSR's order once (``csr.Transposed.weights_in_order``: 0.45 s on a 1M-vertex
R-MAT, a sixth of the profiled epoch when only one epoch came before it)."""


def profile_table(step: Callable[[], None], device: str, rows: int) -> str:
    """The ``rows`` operators of most time in one call of ``step`` (after ``WARMUPS``
    calls), by self time on the device where it is CUDA, else on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUPS):
        step()
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
    table = prof.key_averages()
    if not device.startswith("cuda"):
        return str(table.table(sort_by="self_cpu_time_total", row_limit=rows))
    # the device's time first; then the host's, which shows launches and Python
    return (f"{table.table(sort_by='self_cuda_time_total', row_limit=rows)}\n"
            f"by self CPU time:\n{table.table(sort_by='self_cpu_time_total', row_limit=rows)}")


def model_times(ds: Any, model: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per system, its median epoch of each round; empty for a system that ran out of
    device memory (set up or trained)."""
    makers = {"ours": ours_step, "pyg": pyg_step}
    steps: dict[str, Callable[[], None] | None] = {}
    for name, make in makers.items():
        steps[name] = _unless_oom(lambda: make(ds, model, args))
    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(args.rounds):
        for name, step in steps.items():
            if step is None:
                continue
            t = _unless_oom(lambda: _median_time(step, args.epochs))
            if t is None:
                steps[name], times[name] = None, []
            else:
                times[name].append(t)
    return times


def _unless_oom(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when it ran out of device memory (whose cache is then emptied)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


if __name__ == "__main__":
    sys.exit(main())
