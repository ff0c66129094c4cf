"""Vertex matrices on disk: propagation that holds one column chunk in memory.

A decoupled model propagates (N, C) matrices: the output of its dense layers, each
hop's result, the logits, and their gradients. With ``--row-block`` the dense layers
never hold a (N, hidden) tensor, so on a graph of N = 20M and C = 47 these (N, C)
matrices (3.8 GB each, up to three at once) became most of the run's own memory,
and at the ogbn-papers100M shape (111M vertices, 172 classes: 76 GB each) they no
longer fit any single host's RAM.

``Spill`` keeps such matrices in files instead, in shared file mappings whose
files are unlinked as soon as they are mapped: they take page cache,
which the kernel writes back and reclaims under memory pressure, and their disk
space is freed when the tensor is (also when the process dies). A (N, C) matrix
whose columns need more than one chunk is a ``(C, N)`` mapping seen transposed, so
a chunk's columns are contiguous on disk and a block of rows is C contiguous runs;
one whose columns fit a single chunk is kept row-major, as in memory.

``spilled_spmm`` propagates such a matrix a chunk of columns at a time (NeutronTP
§3.1: propagation is independent per column): the chunk is copied into memory as
(N, c) rows, aggregated there, where the SpMM's random reads of source rows hit RAM,
and written back; its backward does the same with the transposed CSR. Only the
chunk's input and output are in memory at once, ``Spill.memory`` bounding them.
Exact: each column is computed by the same kernel as without the spill.
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fullgraph.graph.csr import Graph
from fullgraph.ops.spmm import aggregate, transposed_aggregate
from fullgraph.runlog import fmt_bytes

# how many tensors share a storage (a private torch function: without it, every
# matrix takes a new file)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Spill:
    """Where (N, C) vertex matrices live on disk, and the memory one column chunk of
    them may take while it is propagated.

    Args:
        directory: a directory on a local disk with room for the spilled matrices
            (created if missing); its files are unlinked at once, so nothing is left
            in it after the run.
        memory: bytes a column chunk may hold in memory: its input and output rows.

    Raises:
        ValueError: ``directory`` cannot be created or written, or ``memory`` < 1.
    """

    def __init__(self, directory: str | os.PathLike[str], memory: int) -> None:
        if memory < 1:
            raise ValueError(f"spill memory must be at least 1 byte, got {memory}")
        self.directory, self.memory = Path(directory).expanduser(), int(memory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"spill directory {str(directory)!r} is a file, not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as exc:
            raise ValueError(f"spill directory {str(directory)!r} cannot be written: "
                             f"{exc.strerror or exc}") from exc
        self.made = 0  # files made so far
        self.made_bytes = 0
        self.reused = 0  # files handed out again once no tensor used them
        self._files: list[tuple[int, torch.UntypedStorage]] = []  # every mapping made

    def empty(self, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
        """A (rows, cols) matrix in an unlinked file: column-major when its columns
        take more than one chunk (``column_ranges``), so a chunk's columns are
        contiguous on disk; row-major when one chunk holds them all, so the
        propagation reads it in place, with no transposing copy.

        Its contents are undefined: a file no tensor uses any more is reused (its pages
        are then mapped already; a new file's first writes fault in every page, about
        0.1 s per 188 MB here); a new file reads as zeros.
        """
        if rows * cols == 0:
            return torch.zeros(rows, cols, dtype=dtype)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        storage = self._file(rows * cols * itemsize)
        data = torch.empty(0, dtype=dtype).set_(storage, 0, (rows * cols,), (1,))
        if len(self.column_ranges(rows, cols, itemsize)) == 1:
            return data.view(rows, cols)
        return data.view(cols, rows).t()

    def keep(self, t: Tensor) -> Tensor:
        """A copy of the CPU tensor ``t`` in an unlinked file, for arrays a pass reads
        in order (the graph's), which the kernel may then evict and read again."""
        if t.numel() == 0:
            return t
        return self.array(t.numel(), t.dtype).view(t.shape).copy_(t)

    def array(self, numel: int, dtype: torch.dtype) -> Tensor:
        """An (numel,) array in an unlinked file (contents undefined, as ``empty``'s)."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(0, dtype=dtype).set_(self._file(numel * itemsize), 0, (numel,),
                                                (1,))

    def keep_graph(self, graph: Graph) -> None:
        """Move the arrays setup builds for ``graph``'s backward pass into files: its
        transposed CSR and permutation, and the edge weights in the transpose's order
        that the backward passes copy. The forward CSR stays as it is (memory-mapped
        from the store); the edge weights are made in files by the caller
        (``propagation_inputs(empty=Spill.array)``). A transpose not built yet is built
        straight into files, ``memory`` bytes of its edges at a time
        (``Graph.keep_transpose``), so setup never holds it whole."""
        graph.keep_transpose(self.keep, empty=self.array, memory=self.memory)

    def _file(self, nbytes: int) -> torch.UntypedStorage:
        """A shared mapping of ``nbytes``: one no tensor uses any more, or a new file."""
        for size, storage in self._files:
            if size == nbytes and _use_count is not None and _use_count(storage._cdata) == 1:
                self.reused += 1
                return storage
        fd, path = tempfile.mkstemp(prefix="fullgraph-rows-", suffix=".bin", dir=self.directory)
        try:
            _reserve(fd, nbytes, self.directory)
            storage = torch.from_file(path, shared=True, size=nbytes,
                                      dtype=torch.uint8).untyped_storage()
        finally:
            os.close(fd)
            os.unlink(path)
        self.made += 1
        self.made_bytes += nbytes
        if _use_count is not None:
            self._files.append((nbytes, storage))
        return storage

    def column_ranges(self, rows: int, cols: int, itemsize: int) -> list[tuple[int, int]]:
        """Column chunks whose input and output rows (2 x rows x width) fit ``memory``
        (at least one column each)."""
        width = max(1, min(cols, self.memory // max(1, 2 * rows * itemsize)))
        return [(c, min(cols, c + width)) for c in range(0, cols, width)]

    def describe(self) -> str:
        return (f"(N, C) propagation matrices and the transposed graph in unlinked files "
                f"under {self.directory}, propagated in column chunks of at most "
                f"{fmt_bytes(self.memory)}")

    def summary(self) -> str:
        """What was spilled so far: files made, their bytes, files used again."""
        return (f"spill    {self.made} file(s), {fmt_bytes(self.made_bytes)} made under "
                f"{self.directory} (unlinked: nothing stays), {self.reused} reused")


def spilled_spmm(graph: Graph, x: Tensor, weight: Tensor | None, spill: Spill) -> Tensor:
    """``spmm(graph, x, weight)`` into a matrix of ``spill``, a column chunk at a time.

    Args:
        graph: CSR by destination, on the CPU.
        x: (N_src, D) source rows, spilled or not.
        weight: None or (E,) fixed edge weights (learned ones are not supported: their
            gradient would need ``x`` whole).
        spill: where the output (and, in the backward, the gradient of ``x``) goes.

    Returns:
        (N_dst, D) in a file of ``spill`` (laid out as ``Spill.empty`` lays it out),
        differentiable in ``x``.
    """
    if weight is not None and (weight.requires_grad or weight.dim() != 1):
        raise ValueError("spilled propagation takes fixed (E,) edge weights only "
                         "(learned attention weights need the whole rows)")
    if x.dim() != 2 or x.shape[0] != graph.num_src:
        raise ValueError(f"spilled_spmm: x must be (num_src={graph.num_src}, D), "
                         f"got {tuple(x.shape)}")
    return _SpilledSpMM.apply(x, weight, graph, spill)


def _by_columns(spill: Spill, x: Tensor, rows_out: int, step: Any) -> Tensor:
    out = spill.empty(rows_out, x.shape[1], x.dtype)
    for c0, c1 in spill.column_ranges(max(x.shape[0], rows_out), x.shape[1], x.element_size()):
        out[:, c0:c1] = step(x[:, c0:c1].contiguous())
    return out


class _SpilledSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, graph: Graph, spill: Spill) -> Tensor:
        ctx.graph, ctx.spill = graph, spill
        ctx.save_for_backward(weight)
        return _by_columns(spill, x.detach(), graph.num_dst,
                           lambda xc: aggregate(graph, xc, weight, "sum"))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        graph = ctx.graph
        grad_x = _by_columns(ctx.spill, grad, graph.num_src,
                             lambda gc: transposed_aggregate(graph, gc, weight, "sum"))
        return grad_x, None, None, None


def _reserve(fd: int, nbytes: int, directory: Any) -> None:
    """Size the file ``fd`` to ``nbytes`` of zeros, with its disk space claimed now: a
    mapping of a sparse file whose disk fills up ends the process by SIGBUS at the first
    write that finds no space, with no message.

    Raises:
        OSError: ENOSPC, naming the directory and the bytes asked for.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left for {nbytes} bytes of spilled rows "
                          f"(--spill-dir)", str(directory)) from None
        if exc.errno == errno.EFBIG:
            raise OSError(errno.EFBIG, f"a file of {nbytes} bytes of spilled rows is over "
                          "this process's or file system's file size limit (ulimit -f; "
                          "--spill-dir)", str(directory)) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    except AttributeError:  # no posix_fallocate on this platform
        pass
    os.ftruncate(fd, nbytes)  # sparse: reads as zeros, takes disk where written
