"""kvstrata.impl: the real implementation (torch pools, radix cache, transfer controller, storage
backends). It imports ``kvstrata.model`` for shared value types and lifecycle tables, never the other
way round. See docs/architecture.md for the layout as it grows.
"""

__version__ = "0.1.0"
