"""`python -m jaxdecode.bench`: the benchmark suite's entry point (the code is `jaxdecode.tools.bench`).

Importing this module imports nothing: the core never depends on the tools above it.
"""

if __name__ == "__main__":
  import sys

  from jaxdecode.tools import bench

  sys.exit(bench.main())
