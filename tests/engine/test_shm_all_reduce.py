import multiprocessing as mp
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvconnect.engine.shm_all_reduce import ShmAllReduce, ShmAllReduceHandle, ShmAllReduceOwner
from tests.helpers import free_port

pytestmark = pytest.mark.slow  # three processes


def rank_main(handle: ShmAllReduceHandle, rank: int, port: int, out: Any) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=handle.world_size,
        timeout=timedelta(seconds=30),
    )
    ar = ShmAllReduce(handle, rank)
    results = []
    for step in range(60):  # mixed sizes and dtypes, many calls: both parities, reuse
        dtype = torch.float64 if step % 3 == 0 else torch.float32
        n = 1 + (step * 37) % 300
        x = torch.arange(n, dtype=dtype) * (rank + 1) + step
        results.append(ar(x).tolist())
    big = torch.ones(10_000) * (rank + 1)  # larger than a slot: falls back to gloo
    results.append(ar(big).tolist())  # plain lists: tensors would go through fd sharing
    out.put((rank, results, ar.num_fallbacks))
    ar.close()
    dist.destroy_process_group()


def test_shared_memory_all_reduce_sums_exactly_across_ranks() -> None:
    ctx = mp.get_context("spawn")
    world = 3
    owner = ShmAllReduceOwner(ctx, world, capacity=4096)
    port = free_port()  # gloo's rendezvous, in this xdist worker's own ports
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(owner.handle, r, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(world):
        r, res, fallbacks = out.get(timeout=60)
        got[r] = (res, fallbacks)
    for p in procs:
        p.join(timeout=30)
    owner.close()
    for step in range(60):
        dtype = torch.float64 if step % 3 == 0 else torch.float32
        n = 1 + (step * 37) % 300
        expected = sum(torch.arange(n, dtype=dtype) * (r + 1) + step for r in range(world))
        for r in range(world):
            assert got[r][0][step] == expected.tolist()
    for r in range(world):
        assert got[r][0][-1] == [6.0] * 10_000
        assert got[r][1] == 1
