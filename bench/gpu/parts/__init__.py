"""The parts of the GPU benchmark, a module each (`part_<name>(ctx) -> verdict`), in run_all.sh order:
env, tests, copycheck, p1, p5, p5d, p23, fp8, services, p7, scale, placements, fp8lib, long.
gpu_bench.py is their runner (the flags, the registry, one process a part); bench/gpu/README.md
has the table of what each runs and measures, results.py the one schema of their figures."""
