"""pitstop: declarative, Hydra-driven PyTorch training built for goodput."""

from pitstop.errors import ConfigError, DataError, PitstopError

__all__ = ["ConfigError", "DataError", "PitstopError"]
__version__ = "0.1.0"
