"""fla's Triton kernels compiled ahead of a benchmark, on every core.

fla's first call at each new shape autotunes: each kernel's configurations are
compiled one after the other, then timed, which takes minutes a shape for its
backward (more than ten at head size 256 on an H100's host). The
compiling is CPU work and Triton keeps what it compiles on disk, keyed by the
kernel, its constants and the configuration alone. So `warm` starts `workers`
processes that each run the given calls once with every autotuned kernel
narrowed to its own share of the configurations (i, i + workers, ...): each
configuration is compiled once, by one of them, into the shared cache. The
benchmark's own process then autotunes over all of them as usual, finding each
one compiled, and times them itself; what it chooses and times is fla's own
choice. A worker's failure (memory, say) costs only its share of the head start;
each worker holds its calls' tensors, so N workers need N times fla's memory.
"""
import multiprocessing
import time
import traceback


def _size(config):
    """How much a configuration asks of an SM, roughly: its stages, warps and tile sizes."""
    tiles = 1
    for value in config.kwargs.values():
        if isinstance(value, int):
            tiles *= value
    return (config.num_stages, config.num_warps, tiles)


def _narrowed(index, workers):
    """Triton's autotuner, from now on in this process, trying only this worker's
    share of each kernel's configurations plus the smallest one: a share whose
    own configurations all need more shared memory than an SM has (or an empty
    share, where a kernel has fewer configurations than there are workers)
    would otherwise leave the call nothing to run, and the rest of the worker's
    calls uncompiled."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def prune_share(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        share = configs[index::workers]
        smallest = min(configs, key=_size)
        return share if smallest in share else share + [smallest]

    Autotuner.prune_configs = prune_share


def _worker(index, workers, target, items):
    _narrowed(index, workers)
    import torch

    for item in items:
        try:
            target(item)
        except Exception:  # noqa: BLE001 - a worker's failure leaves its share to the benchmark
            print(f"fla_warm: worker {index} on {item!r}:\n{traceback.format_exc(limit=3)}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def warm(target, items, workers):
    """Runs target(item) for each item in `workers` processes, each compiling its
    share of every autotuned kernel's configurations. target: a module-level
    function (the processes are spawned, so it travels by name)."""
    if workers < 1 or not items:
        return
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(i, workers, target, list(items))) for i in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(f"fla_warm: {len(items)} calls in {workers} processes, {time.perf_counter() - start:.0f} s", flush=True)
