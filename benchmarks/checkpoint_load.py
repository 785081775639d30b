"""Memory and time of loading one rank's checkpoint file into a net's parameters, as a resume does: MindSpore's
`load_checkpoint` + `set_data` (the route before 2026-11-28) against `mindrlhf.checkpoint.weights.load_rank_params`
(the mapped file, one tensor at a time). Each route runs in a fresh process; the table shows the peak resident
memory above what the process held with its parameters allocated, and the seconds.

    .venv/bin/python benchmarks/checkpoint_load.py [--gib 1.5] [--rounds 2]

The default file is the size of a SmolLM2-135M rank file (weights and AdamW moments, 1.5 GiB) in 64 MiB tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

from repo_paths import results_path

ROUTES = ("mindspore", "mindrlhf")
TENSOR_ELEMENTS = 16 << 20  # 64 MiB of float32


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load_once(route: str, path: str, tensors: int) -> dict:
    """In this process: parameters like the file's, then the file loaded into them by `route`."""
    import mindspore as ms
    import numpy as np

    params = [ms.Parameter(ms.Tensor(np.zeros(TENSOR_ELEMENTS, np.float32)), name=f"p{i}") for i in range(tensors)]
    held = peak_gib()
    start = time.perf_counter()
    if route == "mindspore":
        loaded = ms.load_checkpoint(path)
        for param in params:
            param.set_data(loaded[param.name])
        del loaded
    else:
        from mindrlhf.checkpoint.weights import load_rank_params

        load_rank_params(params, path)
    seconds = time.perf_counter() - start
    assert float(params[-1][7].asnumpy()) == tensors - 1  # the values arrived
    return {"route": route, "seconds": round(seconds, 3), "held_gib": round(held, 3),
            "peak_above_held_gib": round(peak_gib() - held, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.5, help="size of the rank file")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both routes")
    parser.add_argument("--output", default=results_path("checkpoint_load.json"))
    parser.add_argument("--child", nargs=3, metavar=("ROUTE", "PATH", "TENSORS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        route, path, tensors = args.child
        print(json.dumps(load_once(route, path, int(tensors))))
        return 0

    import numpy as np

    from mindrlhf.utils.checkpoint_file import write_checkpoint

    tensors = max(1, round(args.gib * 2**30 / (4 * TENSOR_ELEMENTS)))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank.ckpt")
        write_checkpoint(((f"p{i}", np.full(TENSOR_ELEMENTS, i, np.float32)) for i in range(tensors)), path)
        for round_ in range(args.rounds):
            for route in ROUTES:
                proc = subprocess.run([sys.executable, __file__, "--child", route, path, str(tensors)],
                                      capture_output=True, text=True, check=True, env=dict(os.environ, GLOG_v="3"))
                runs.append({"round": round_, **json.loads(proc.stdout.strip().splitlines()[-1])})
    from results_io import format_columns, write_results

    print(f"loading a {tensors * 4 * TENSOR_ELEMENTS / 2**30:.2f} GiB rank file ({tensors} tensors) into its "
          "parameters, a fresh process each")
    print(format_columns(["round", "route", "seconds", "peak above the parameters, GiB"],
                         [[r["round"], r["route"], r["seconds"], r["peak_above_held_gib"]] for r in runs]))
    write_results({"file_gib": tensors * 4 * TENSOR_ELEMENTS / 2**30, "runs": runs, "machine": platform.node(),
                   "cpus": os.cpu_count(), "load_average": os.getloadavg()}, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
