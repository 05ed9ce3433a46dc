"""ftrun: a fault-tolerant torchrun, and the worker API that lets a script recover in place."""

__version__ = "0.1.0"
