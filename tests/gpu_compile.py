"""Compile every launch that the GPU kernels' wrappers make, for a Hopper GPU (sm_90),
on a machine without one: ``python tests/gpu_compile.py`` prints one line per
compiled variant and ``compiled N``, or exits 1 naming the launch that failed.

The wrappers run on small CPU tensors with their launches recorded instead of made;
each recorded launch (its tensors' dtypes, its integers' widths, its constants and
compiler options) is compiled to a cubin by the CUDA backend that Triton's wheel
carries. It runs as a process of its own: kernels defined under Triton's interpreter
(``TRITON_INTERPRET=1``, which the test session sets on the CPU) break the compiler
in the same process. ``tests/ops/test_gpu_kernels_compile.py`` runs it."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

os.environ.pop("TRITON_INTERPRET", None)
os.environ["FULLGRAPH_TRITON"] = "interpret"  # (the wrappers' launches on CPU tensors)

import torch  # noqa: E402

from fullgraph.ops import gpu_kernels  # noqa: E402

TARGET = ("cuda", 90, 32)
_TYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16",
          torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32"}


class _Recorder:
    """``kernel[grid](*args, **keywords)`` noted, not run."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.fn, args, kw))


def record() -> list:
    """The wrappers' launches, for float32 and float64, int32 and int64 indices, every
    SpMM variant, one head and one column a head, seeds on both sides of 2**31."""
    kernels = gpu_kernels._kernels()
    launches: list = []
    gpu_kernels._kernels = lambda: SimpleNamespace(  # type: ignore[assignment]
        **{name: _Recorder(fn, launches) for name, fn in vars(kernels).items()})
    indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int64)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(3, 8, dtype=dtype)
        for seed in (5, 2**32 - 1):  # (a launcher types an int past int32 as i64)
            gpu_kernels.dropout_into(x, torch.arange(3), seed, 2**31, 2.0,
                                     torch.empty_like(x))
        for index_dtype in (torch.int32, torch.int64):
            indices = torch.tensor([0, 2, 1, 1, 0], dtype=index_dtype)
            for heads in (4, 1):  # (1: GAT's output layer, a constant to the launcher)
                s = torch.randn(3, heads, dtype=dtype)
                alpha = gpu_kernels.attention_forward(indptr, indices, s, s, 0.2)
                assert alpha is not None
                gpu_kernels.attention_backward(indptr, indices, s, s, alpha, alpha, 0.2)
            w = torch.randn(5, 2, dtype=dtype)
            perm = torch.tensor([4, 3, 2, 1, 0], dtype=index_dtype)
            for weight, p in ((w, None), (w, perm), (None, None)):
                gpu_kernels.spmm_heads(indptr, indices, x, weight, 2, perm=p)
            gpu_kernels.spmm_heads(indptr, indices, x[:, :1], None, 1)  # one column
            gpu_kernels.sddmm_heads(indptr, indices, x, x, 2)
            gpu_kernels.sddmm_heads(indptr, indices, x, x, 8)  # one column a head
    assert not gpu_kernels._FAILED, gpu_kernels._FAILED
    return launches


def signature(fn, args, keywords) -> tuple[dict, dict, dict]:
    """Triton's signature, constants and compiler options for one launch, its values
    typed as Triton's launcher types them: a tensor as a pointer to its dtype, an int
    as i32 or i64 by its value, an int equal to 1 as the constant 1 unless the kernel
    says ``do_not_specialize``. (The launcher's divisibility-by-16 hints on pointers
    and ints are not given: they let the compiler vectorise, not change what it
    accepts.)"""
    sig, const = {}, {}
    values = iter(args)
    for i, name in enumerate(fn.arg_names):
        if name in keywords:
            sig[name], const[(i,)] = "constexpr", keywords[name]
            continue
        v = next(values)
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
        elif not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{fn.fn.__name__}: argument {name} is a {type(v).__name__}; "
                            "this check types tensors and ints only")
        elif v == 1 and not getattr(fn.params[i], "do_not_specialize", False):
            sig[name], const[(i,)] = "constexpr", 1
        else:
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
    options = {k: v for k, v in keywords.items() if k not in fn.arg_names}
    return sig, const, options


def main() -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    launches = record()
    kinds = {fn.fn.__name__ for fn, _, _ in launches}
    want = {"_dropout_kernel", "_attention_fwd_kernel", "_attention_bwd_kernel",
            "_spmm_heads_kernel", "_sddmm_heads_kernel"}
    if kinds != want:
        print(f"launched {sorted(kinds)}, expected {sorted(want)}")
        return 1
    done = set()
    for fn, args, keywords in launches:
        sig, const, options = signature(fn, args, keywords)
        if options != {"enable_fp_fusion": gpu_kernels.FP_FUSION}:
            print(f"{fn.fn.__name__}: compiler options {options}, expected fp fusion's")
            return 1
        key = (fn.fn.__name__, tuple(sig.items()), repr(sorted(const.items(), key=str)))
        if key in done:
            continue
        try:
            binary = compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget(*TARGET),
                             options=options)
        except Exception as err:  # (the compiler's message names the kernel's line)
            print(f"FAILED {fn.fn.__name__} with {sig} and {keywords}:\n{err}")
            return 1
        print(f"{fn.fn.__name__} {' '.join(t for t in sig.values() if t != 'constexpr')} "
              f"{ {n: keywords[n] for n in keywords if n in fn.arg_names} }: "
              f"{len(binary.asm['cubin'])} bytes of cubin")
        done.add(key)
    print(f"compiled {len(done)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
