"""The installed distribution's version: ``pyproject.toml`` is its one source."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("jiuwen-kv-affinity")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
