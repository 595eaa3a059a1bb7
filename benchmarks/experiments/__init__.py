"""One-question experiments (does ``torch.compile`` help the trunk? what does tracing cost the
front? where does the kernel beat a dense copy?): each answer, with its CPU, command and table,
is in docs/performance.md; the script stays to ask the question again on another machine.

Run from the repository root: ``flock /tmp/cpu_bench.lock python -m benchmarks.experiments.NAME``.
"""
