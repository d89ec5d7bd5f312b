"""`python -m jaxdecode.bench`: the benchmark suite's entry point (the code is the package
`jaxdecode.tools.bench`, whose public names can be imported from here too).

Importing this module imports nothing: the core never depends on the tools above it. A name read
from it (`from jaxdecode.bench import kernel_table`) imports the tools then, and only then.
"""


def __getattr__(name):
  from jaxdecode.tools import bench  # pylint: disable=import-outside-toplevel
  try:
    return getattr(bench, name)
  except AttributeError:
    raise AttributeError(f"module 'jaxdecode.bench' has no attribute {name!r}") from None


def __dir__():
  from jaxdecode.tools import bench  # pylint: disable=import-outside-toplevel
  return sorted(set(dir(bench)) | {"__doc__", "__name__"})


if __name__ == "__main__":
  import sys

  from jaxdecode.tools.bench import command

  sys.exit(command.main())
