"""schedctl: the core library and operator CLI of the scheduled-d job scheduler."""

__version__ = "0.1.0"
