"""Measured benchmarks: cenote against its peers and against itself, side by side in one sitting.

Run each as a module from the repository root, under the shared CPU lock, e.g.
``flock /tmp/cpu_bench.lock python -m benchmarks.embed_offline``: the benchmarks import each
other, ``benchmarks.common`` and the test helpers (``tests.server_fixture``, ``tests.factories``)
as packages. ``experiments/`` holds the one-question measurements whose answers are recorded in
docs/performance.md.
"""
