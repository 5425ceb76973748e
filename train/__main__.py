"""``python -m train --config configs/NAME.py [--only GLOB ...] [--plot PNG] [--distributed]
[--command-buffers] [key=value ...]``

Runs the config's experiment, or each of its ``VARIANTS`` in sequence (``--only`` selects them by
glob, e.g. ``--only 'len/*'``), with the ``key=value`` overrides of ``train.config`` on top
(an unknown key is an error listing the valid ones), and ends with a table of each run's final
loss and held-out accuracy (and, with ``--plot``, a PNG of every run's loss curve).

On GPUs, XLA's command buffers (CUDA graphs) are off unless ``--command-buffers`` is given or
``XLA_FLAGS`` sets ``--xla_gpu_enable_command_buffer`` itself: without them a 340M step runs
12 % faster, while a small host-bound model may want them (``train.xla_flags``).

Multi-host: start the same command on every host with ``--distributed``; it calls
``jax.distributed.initialize()`` first, which finds the coordinator, process count and index on
Cloud TPU, SLURM, Open MPI and Kubernetes (JobSet), or reads them from the environment:
JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES, JAX_PROCESS_ID. Each host then reads its
share of every batch (``train.data``) and only process 0 prints and writes metrics; checkpoint
directories must be on storage all hosts share.
"""

import argparse
import os
import sys

import jax

from train.config import load_runs
from train.loop import train
from train.metrics import NonFiniteLossError
from train.plots import plot_runs
from train.xla_flags import set_command_buffers


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", required=True, help="a configs/NAME.py file")
    parser.add_argument("--only", action="append", default=[], metavar="GLOB",
                        help="run only the variants matching GLOB (repeatable)")
    parser.add_argument("--plot", metavar="PNG", help="write every run's loss curve to this PNG")
    parser.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize()")
    parser.add_argument("--command-buffers", action="store_true",
                        help="keep XLA's command buffers (CUDA graphs) on: for small, host-bound steps")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def initialize_distributed():
    """``jax.distributed.initialize``, from the JAX_* environment variables when they are set."""
    names = ("coordinator_address", "num_processes", "process_id")
    env = {k: os.environ.get(f"JAX_{k.upper()}") for k in names}
    kwargs = {k: (v if k == "coordinator_address" else int(v)) for k, v in env.items() if v}
    jax.distributed.initialize(**kwargs)


def summary_table(results) -> str:
    """A text table of each run's final training loss and held-out accuracy."""
    rows = [("run", "model", "params", "steps", "train loss", "eval accuracy")]
    for r in results:
        loss = r.losses[max(r.losses)] if r.losses else float("nan")
        accuracy = r.evaluation.get("accuracy")
        rows.append((r.name, r.variant, f"{r.num_params / 1e6:.2f}M", str(r.step), f"{loss:.4f}",
                     "-" if accuracy is None else f"{accuracy:.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    set_command_buffers(args.command_buffers)
    if args.distributed:
        initialize_distributed()
    try:
        runs = load_runs(args.config, args.overrides, args.only)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = []
    try:
        for cfg in runs.values():
            results.append(train(cfg))
            if results[-1].stopped:
                break
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if results and jax.process_index() == 0:
            print("\n" + summary_table(results))
            if args.plot:
                print(f"loss curves: {plot_runs(results, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
