"""samepath's benchmarks: per-op timings and an end-to-end rollout + trainer step, each against its
stock baselines measured in the same run on the same device.

    python -m bench [--device cuda] [--quick] [--ops varlen_fwd,paged_decode,...] [--out DIR]
    python bench/tune.py [--device cuda]          # numerics-neutral launch-parameter sweep
    bash bench/gpu_check.sh [--dry-run]           # one device lease: bitwise checks, bench, tuning

On the CPU the kernels run under Triton's interpreter: those numbers only prove that the bench
runs, and every output says so.
"""
