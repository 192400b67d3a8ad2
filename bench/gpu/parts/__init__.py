"""The parts of the GPU benchmark, a module each (`part_<name>(ctx) -> verdict`), run by gpu_bench.py
(registry PARTS); bench/gpu/README.md has the table of what each measures, results.py their schema."""
