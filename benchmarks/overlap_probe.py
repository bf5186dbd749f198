"""Does an all-to-all run under the expert GEMMs? Each alone, then both at once, on every rank.

`--ep_chunks` overlaps a chunk's all-to-all with another chunk's experts
(te_mixtral/distributed/dispatch.py). That only pays if the GPU runs the two at the same
time. NCCL moves data with kernels of its own, which need free multiprocessors, and our
grouped GEMMs are persistent: one program per SM (experts/kernels/schedule.py) that stays
until the GEMM ends. This probe times, per rank, at one MoE layer's shapes:

    comm      the dispatch all-to-all of T*K rows (even splits), alone
    experts   the expert FFN forward over the rows a rank receives (custom_grouped), alone
    both      the all-to-all launched asynchronously, the experts, then its wait
    matmul    the same FLOPs as one cuBLAS matmul, and with the all-to-all under it

and prints how much of the shorter one the pair hid: (comm + experts - both) / min(comm,
experts); 1 is a perfect overlap, 0 none.

    torchrun --nproc_per_node 4 -m benchmarks.overlap_probe [--tokens 8192] [--family 8x7b] [--json F]

(under torchrun, as `python3 -m benchmarks.overlap_probe` is for one process: it needs two GPUs or more).

Every figure is the median of REPS repetitions between CUDA events. Not common.median_ms: it
sizes its repetitions by each rank's own first call, and ranks that run different numbers of
all-to-alls wait for each other forever.
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from benchmarks import common
from te_mixtral.experts.registry import make_tier

NUM_EXPERTS, TOP_K = 8, 2
WARMUP, REPS = 3, 20


def median_ms(step) -> float:
    """Median of REPS timed calls of `step` after WARMUP untimed ones, the same count on every rank."""
    for _ in range(WARMUP):
        step()
    dist.barrier()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    for begin, end in events:
        begin.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(end) for begin, end in events)


def hidden_share(comm_ms: float, work_ms: float, both_ms: float) -> float:
    """How much of the shorter of two jobs ran under the other: 1 all of it, 0 none."""
    return (comm_ms + work_ms - both_ms) / min(comm_ms, work_ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank (T)")
    parser.add_argument("--family", choices=sorted(common.FAMILIES), default="8x7b")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    if common.cuda_or_refuse("overlap_probe") is None:
        return 2

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = common.FAMILIES[args.family]
    local_experts = NUM_EXPERTS // world
    rows = args.tokens * TOP_K  # sent, and (even splits) received
    gen = torch.Generator(device).manual_seed(rank)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    sent, received = randn(rows, shapes.hidden), torch.empty(rows, shapes.hidden, dtype=torch.bfloat16, device=device)
    x_RD = randn(rows, shapes.hidden)
    gate_up = randn(local_experts, 2 * shapes.ffn, shapes.hidden, scale=0.02)
    down = randn(local_experts, shapes.hidden, shapes.ffn, scale=0.02)
    counts = torch.full((local_experts,), rows // local_experts, device=device)
    # One matmul of the experts' forward FLOPs (3 R D F): R x D times D x 3F.
    dense = randn(shapes.hidden, 3 * shapes.ffn, scale=0.02)
    tier = make_tier("custom_grouped")

    def exchange():
        return dist.all_to_all_single(received, sent, async_op=True)

    jobs = {"experts": lambda: tier(x_RD, counts, gate_up, down), "matmul": lambda: x_RD @ dense}
    comm_ms = median_ms(lambda: exchange().wait())
    results = {"comm_ms": comm_ms}
    for name, job in jobs.items():
        alone = median_ms(job)

        def both(job=job):
            work = exchange()
            job()
            work.wait()

        together = median_ms(both)
        results[name] = {"alone_ms": alone, "with_comm_ms": together,
                         "hidden_share": hidden_share(comm_ms, alone, together)}

    header = common.run_header(device, tokens=args.tokens, family=args.family, world=world, rows=rows)
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        print(common.header_line(header))
        print("rank  comm ms  experts ms  +comm ms  hidden   matmul ms  +comm ms  hidden")
        for r, res in enumerate(everyone):
            e, m = res["experts"], res["matmul"]
            print(f"{r:4d} {res['comm_ms']:8.2f} {e['alone_ms']:11.2f} {e['with_comm_ms']:9.2f} {e['hidden_share']:7.2f}"
                  f" {m['alone_ms']:11.2f} {m['with_comm_ms']:9.2f} {m['hidden_share']:7.2f}")
        common.write_json(args.json, {"header": header, "ranks": everyone})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
