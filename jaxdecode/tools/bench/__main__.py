"""`python -m jaxdecode.tools.bench`: the benchmark's command line (also `python -m jaxdecode.bench`
and `jaxdecode bench`)."""

import sys

from jaxdecode.tools.bench.command import main

if __name__ == "__main__":
  sys.exit(main(prog="python -m jaxdecode.tools.bench"))
