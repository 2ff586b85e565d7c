"""cudagraphify: one-decorator, always-correct CUDA Graphs for PyTorch modules and functions.

    from cudagraphify import graphify
    model = graphify(model)          # then call it as usual

See README.md for how it decides what to capture and when a graph applies.
"""

from ._cache import CachePolicy
from ._engine import Stats
from ._errors import CudagraphifyError, CudagraphifyUsageError, CudagraphifyWarning
from ._region import GraphRegion, graph_region
from ._signature import Signature, mark_static
from .api import explain, graphify, share_graph, stats, ungraphify

__all__ = [
    "graphify",
    "ungraphify",
    "graph_region",
    "share_graph",
    "explain",
    "mark_static",
    "stats",
    "CachePolicy",
    "GraphRegion",
    "Signature",
    "Stats",
    "CudagraphifyError",
    "CudagraphifyUsageError",
    "CudagraphifyWarning",
]

__version__ = "0.1.0"
