"""The allocator module: torch asked for huge pages before it loads, when the kernel
offers them, and the user's own settings win."""
from __future__ import annotations

import os
import subprocess
import sys

from fullgraph import allocator

PROBE = """
import resource
from fullgraph.allocator import memory_line, use_hugepages
used = use_hugepages()
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)  # 64 MB: 16,384 faults on 4 KB pages, 32 on 2 MB ones
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(used, faults < 4096, memory_line().endswith("(THP_MEM_ALLOC_ENABLE=1)"))
"""


def probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("THP_MEM_ALLOC_ENABLE", "FULLGRAPH_HUGEPAGES")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, text=True,
                         capture_output=True, check=True).stdout
    return out.split()


def test_torch_gets_huge_pages_where_the_kernel_offers_them():
    offered = allocator.transparent_hugepages() in ("madvise", "always")
    used, few_faults, said = probe()
    assert used == str(offered) and said == str(offered)
    if offered:  # torch read the variable: a large tensor is faulted in 2 MB at a time
        assert few_faults == "True"


def test_the_users_settings_win():
    assert probe(FULLGRAPH_HUGEPAGES="0")[0] == "False"
    assert probe(THP_MEM_ALLOC_ENABLE="0")[0] == "False"
