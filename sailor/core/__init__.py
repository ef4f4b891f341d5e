"""Layer 0: errors, limits, reading and atomically writing files, schema helpers, units. Imports nothing
else of Sailor."""

__version__ = "0.1.0"  # the distribution's version (pyproject reads it from here)
