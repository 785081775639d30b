"""Explicit SPMD parallelism: layouts, tensor-parallel layers, strategy files, online reshard, host swap.

Import from the submodules (nothing is imported here, so that a submodule never pulls in the others):

- `layout`: `Layout` (data, tensor and pipeline parallel ranks and their communication groups);
- `layers`, `comm`: tensor-parallel layers and the collectives with their backward;
- `spmd`, `pipeline`, `schedule`: train steps (gradients reduced over dp and clipped; pipeline stages);
- `strategy`: strategy files (`ParallelStrategyMap`); `reshard`: online resharding (`Resharder`);
- `swap`: host swap of idle models;
- `array_collectives`: gathers and sums of numpy arrays between the phases of a step (`ArrayCollectives`);
- `shared_memory`: AllReduce(SUM) through shared memory for CPU ranks on one host (`SharedMemoryGroup`);
- `host_setup`: a process's CPU threads, cores and memory pool, and the shared-memory data-parallel sums.
"""
