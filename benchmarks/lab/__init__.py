"""Probes and diagnostics: scripts that answer a question about the ring or the kernels (where a
hop's host time goes, whether the GPU idles between recorded hops, which tile configuration is
fastest) and reproduce no table of the README or docs/RESULTS.md. They import the benchmarks'
plumbing (``benchmarks.common``) and the library; nothing outside this folder imports them.
Each script's docstring says what it measures and how to run it; ``benchmarks/README.md``
lists them."""
