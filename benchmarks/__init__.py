"""The bench's rooms: what `python bench.py` runs, one module per concern, and the simulator.

Named `benchmarks`, not `bench`: a package `bench/` beside bench.py would take the name `bench`
from the script (`import bench` finds the package first), and bench.py stays the entry point. It
is not installed with nanoflow (pyproject's `packages`): like bench.py, it runs from the
repository's root, where `import benchmarks` finds it.
"""
