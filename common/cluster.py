"""Which batch seqs of the plan each host serves and trains: a pure function of the plan.

One torchrun world may span several hosts. Each host runs its own target server and its trainer
ranks read only from it (hidden states stay on the host's /dev/shm ring; only gradients cross the
network). Every epoch's seqs are split into `num_hosts` contiguous shards whose sizes differ by
at most one: host h of H serves [start + n*h//H, start + n*(h+1)//H) of an epoch of n batches.

Contiguous, not strided: a host's trained set stays a few runs per epoch (a strided shard would be
one run per batch, past what a HELLO's `have` may carry), and batch seqs are already in random
order within an epoch (the packer permutes them), so a contiguous shard is as mixed as a strided
one. The target server and the trainer import this one function, so both sides always agree.
"""
from __future__ import annotations

from collections.abc import Sequence

from .seqset import SeqSet


def host_shard(seqs: range, num_hosts: int, host_rank: int) -> range:
    """Host `host_rank`'s share of one epoch's seqs (a step-1 range): contiguous, balanced to one batch."""
    if seqs.step != 1:
        raise ValueError(f"an epoch's seqs are a step-1 range, got {seqs!r}")
    if not 0 <= host_rank < num_hosts:
        raise ValueError(f"host_rank {host_rank} outside [0, {num_hosts})")
    n = len(seqs)
    return range(seqs.start + n * host_rank // num_hosts, seqs.start + n * (host_rank + 1) // num_hosts)


def epoch_ranges(epoch_sizes: Sequence[int]) -> list[range]:
    """Dense global seqs: epoch e owns the e-th range (as the target server numbers them)."""
    out, start = [], 0
    for n in epoch_sizes:
        out.append(range(start, start + n))
        start += n
    return out


def plan_shard(epoch_sizes: Sequence[int], num_hosts: int, host_rank: int) -> SeqSet:
    """Every seq host `host_rank` serves over the epochs of `epoch_sizes` (one run per epoch)."""
    shard = SeqSet()
    for r in epoch_ranges(epoch_sizes):
        if s := host_shard(r, num_hosts, host_rank):
            shard.add_range(s.start, s.stop)
    return shard


def restrict(have: SeqSet, epoch_sizes: Sequence[int], num_hosts: int, host_rank: int) -> SeqSet:
    """The part of a trained set `have` that lies in host `host_rank`'s shard of the plan."""
    if num_hosts == 1:
        return have.copy()
    out = plan_shard(epoch_sizes, num_hosts, host_rank)
    for a, b in list(out.ranges()):   # each run of the shard less the runs `have` lacks there
        for lo, hi in have.difference_ranges(a, b):
            out.remove_range(lo, hi)
    return out


def count_by_host(have: SeqSet, epoch_sizes: Sequence[int], num_hosts: int) -> list[int]:
    """How many seqs of `have` lie in each host's shard of the plan."""
    return [sum(have.count_in(a, b) for a, b in plan_shard(epoch_sizes, num_hosts, h).ranges())
            for h in range(num_hosts)]


def accounting(trained_by_host: Sequence[int], epoch_sizes: Sequence[int]) -> dict:
    """Per-host and total batch accounting, as `dfpipe inspect` and `ctl trainer status` show it."""
    num_hosts = len(trained_by_host)
    planned = [plan_shard(epoch_sizes, num_hosts, h).size for h in range(num_hosts)]
    return {"num_hosts": num_hosts,
            "hosts": [{"host": h, "batches_trained": int(t), "batches_planned": p}
                      for h, (t, p) in enumerate(zip(trained_by_host, planned))],
            "total": {"batches_trained": int(sum(trained_by_host)), "batches_planned": sum(planned)}}
