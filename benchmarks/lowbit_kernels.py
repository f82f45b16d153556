"""Low-bit codecs' throughput beside the network they save bytes on (issue 39).

    python benchmarks/lowbit_kernels.py                      # what `make bench` runs
    python benchmarks/lowbit_kernels.py --sizes 65536 --reps 3 --world 0   # kernels only, quick

Two measurements, one report (``<out>/lowbit_kernels.json`` and ``.md``):

* **kernels**: encode and decode time per format (``int8``, ``int4``, ``fp8_e4m3``,
  ``fp8_e5m2``, blocks of ``--block-size``) per message size, as GB/s of float32 values (input
  bytes for encode, output bytes for decode); the same :class:`sharded.LowBit` codec functions on
  CUDA tensors when a GPU is present (``--device``). Every row checks that each decoded element is
  within the codec's stated ``error_bound`` (a kernel that is fast and wrong shows as ``False``).
* **network** (``--world``, default 2, gloo on the CPU): the exact float32 broadcast and
  all-gather of the same sizes against the low-bit ones through :class:`LowBitWire` (encode,
  the ``uint8`` collective, decode: what a stage runs), median seconds over ``--reps``.

The **break-even**: low-bit wins on a link of bandwidth ``B`` when
``encode + decode + wire / B < exact / B``, that is when ``B < (exact - wire) / (encode + decode)``
(bytes per second; ``wire`` and ``exact`` the bytes one rank sends). The table gives that
bandwidth from the kernel times, beside gloo's own measured bandwidth for the exact message: where
gloo's is above the break-even (loopback on one machine), the codec costs more than it saves;
across nodes of a few GB/s or less it is the other way round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import finish_rank, init_rank, launch  # noqa: E402  (benchmarks/bench.py: the ranks' setup)

from sharded import LowBit  # noqa: E402
from sharded._common import comm  # noqa: E402
from sharded._common.lowbit import FORMATS, LowBitWire  # noqa: E402

SIZES = [2**16, 2**20, 2**22]  # elements of one message: a small bucket, a typical one, a large shard
COLLECTIVES = ("broadcast", "all_gather")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], Any], reps: int, device: torch.device) -> float:
    """The median wall time of ``run()`` over ``reps`` calls, after one untimed call."""
    run()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_rows(device: torch.device, sizes: list[int], block_size: int, reps: int) -> list[dict[str, Any]]:
    """Encode/decode seconds and GB/s per format and size on ``device``, each row with whether
    every decoded element kept the codec's bound."""
    rows = []
    generator = torch.Generator().manual_seed(0)
    for numel in sizes:
        x = torch.randn(numel, generator=generator).mul_(0.02).to(device)
        for name, codec in FORMATS.items():
            message = codec.encode(x, block_size)
            decoded = codec.decode(message, numel, block_size)
            within = bool(((decoded - x).abs() <= codec.error_bound(x, block_size)).all())
            encode_s = median_seconds(lambda: codec.encode(x, block_size), reps, device)
            decode_s = median_seconds(lambda: codec.decode(message, numel, block_size), reps, device)
            exact, wire = 4 * numel, codec.message_numel(numel, block_size)
            rows.append({"device": device.type, "format": name, "numel": numel, "exact_bytes": exact, "wire_bytes": wire,
                         "encode_s": encode_s, "decode_s": decode_s, "encode_gbps": exact / encode_s / 1e9,
                         "decode_gbps": exact / decode_s / 1e9, "within_bound": within,
                         "break_even_gbps": (exact - wire) / (encode_s + decode_s) / 1e9})
    return rows


def network_rank(rank: int, world: int, sizes: list[int], block_size: int, reps: int, store_path: str, results_path: str) -> None:
    """Exact against low-bit broadcast and all-gather of each size over gloo (rank 0 writes)."""
    device = init_rank(rank, world, store_path)
    torch.set_num_threads(1)  # the ranks share this machine's cores: one each, as the tests run
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).mul_(0.02)
        gathered = torch.empty(world * numel)
        exact = {"broadcast": lambda: comm.broadcast(x, 0, None, async_op=False),
                 "all_gather": lambda: comm.all_gather_into_tensor(gathered, x, None, async_op=False)}
        for collective in COLLECTIVES:
            seconds = _slowest(median_seconds(_barriered(exact[collective]), reps, device))
            rows.append({"collective": collective, "format": "exact", "numel": numel, "seconds": seconds,
                         "sent_bytes": _sent(4 * numel, world)})
        for name, codec in FORMATS.items():
            wire = LowBitWire(LowBit(params="int8", block_size=block_size), None)
            lowbit = {"broadcast": lambda: wire.broadcast(codec, x, 0).wait(),
                      "all_gather": lambda: wire.all_gather(codec, x).wait()}
            for collective in COLLECTIVES:
                seconds = _slowest(median_seconds(_barriered(lowbit[collective]), reps, device))
                rows.append({"collective": collective, "format": name, "numel": numel, "seconds": seconds,
                             "sent_bytes": _sent(codec.message_numel(numel, block_size), world)})
    if rank == 0:
        Path(results_path).write_text(json.dumps(rows))
    finish_rank()


def _barriered(run: Callable[[], Any]) -> Callable[[], Any]:
    def timed() -> Any:
        dist.barrier()
        return run()

    return timed


def _slowest(seconds: float) -> float:
    mine = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def _sent(nbytes: int, world: int) -> int:
    """Bytes the busiest rank puts on the wire: a broadcast's source sends to ``W - 1`` ranks, an
    all-gather sends each rank's piece to ``W - 1`` ranks (LowBitWire's counting)."""
    return nbytes * (world - 1)


def markdown(run: dict[str, Any]) -> str:
    """The report's two tables: kernels (with the break-even) and the network, as Markdown."""
    head = ["device", "format", "elements", "encode GB/s", "decode GB/s", "bytes/elem", "within bound",
            "break-even link GB/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in run["kernels"]:
        lines.append(f"| {r['device']} | {r['format']} | {r['numel']:,} | {r['encode_gbps']:.2f} | {r['decode_gbps']:.2f} | "
                     f"{r['wire_bytes'] / r['numel']:.3f} | {r['within_bound']} | {r['break_even_gbps']:.2f} |")
    if run.get("network"):
        lines += ["", f"gloo, world {run['meta']['world']}: median ms of the slowest rank (low-bit: encode + collective + decode)",
                  "", _network_table(run["network"])]
    return "\n".join(lines)


def _network_table(rows: list[dict[str, Any]]) -> str:
    formats = list(dict.fromkeys(r["format"] for r in rows))
    head = ["collective", "elements", "gloo GB/s (exact)"] + [f"{f} ms" for f in formats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["collective"], r["numel"]) for r in rows))
    for collective, numel in keys:
        cells = {r["format"]: r for r in rows if r["collective"] == collective and r["numel"] == numel}
        exact = cells["exact"]
        gbps = exact["sent_bytes"] / exact["seconds"] / 1e9
        lines.append(f"| {collective} | {numel:,} | {gbps:.2f} | " + " | ".join(f"{1e3 * cells[f]['seconds']:.2f}" for f in formats) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(n) for n in s.split(",")], default=SIZES, help="elements per message")
    parser.add_argument("--block-size", type=int, default=LowBit().block_size)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per measurement (median)")
    parser.add_argument("--world", type=int, default=2, help="ranks of the network measurement (0: skip it)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="kernels' device (auto: CUDA when present, and the CPU)")
    parser.add_argument("--out", type=Path, default=Path("bench_out/lowbit_kernels"))
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    devices = [torch.device("cpu")] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        devices.append(torch.device("cuda", 0))
    kernels = [row for device in devices for row in kernel_rows(device, args.sizes, args.block_size, args.reps)]
    network = launch(network_rank, args.world, args.sizes, args.block_size, args.reps) if args.world > 1 else []
    meta = {"world": args.world, "block_size": args.block_size, "torch": torch.__version__, "cpu_threads": 1,
            "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2), "command": " ".join(sys.argv)}
    run = {"meta": meta, "kernels": kernels, "network": network}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lowbit_kernels.json").write_text(json.dumps(run, indent=1))
    text = markdown(run)
    (args.out / "lowbit_kernels.md").write_text(f"<!-- {meta} -->\n\n{text}\n")
    print(text)
    if not all(r["within_bound"] for r in kernels):
        raise SystemExit("a codec decoded an element outside its stated bound: see within_bound")


if __name__ == "__main__":
    main()
