"""cudagraphify: one-decorator, always-correct CUDA Graphs for PyTorch modules and functions.

    from cudagraphify import graphify
    model = graphify(model)          # then call it as usual

See README.md for how it decides what to capture and when a graph applies.
"""

from ._bucket import Bucketed, bucketed
from ._cache import CachePolicy
from ._errors import CudagraphifyError, CudagraphifyUsageError, CudagraphifyWarning
from ._region import GraphRegion, graph_region
from ._share import ShareGroup
from ._signature import Signature, mark_static
from ._options import Stats
from ._policy import OpPolicy
from ._sizes import Captured, capture_sizes
from .api import explain, graphify, mark_safe, share_graph, stats, tag_op, ungraphify

__all__ = [
    "graphify",
    "ungraphify",
    "graph_region",
    "share_graph",
    "capture_sizes",
    "bucketed",
    "Bucketed",
    "Captured",
    "ShareGroup",
    "explain",
    "mark_static",
    "stats",
    "tag_op",
    "mark_safe",
    "Tag",
    "OpPolicy",
    "CachePolicy",
    "GraphRegion",
    "Signature",
    "Stats",
    "CudagraphifyError",
    "CudagraphifyUsageError",
    "CudagraphifyWarning",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``Tag`` extends Thunder's TagBase, so it is built (and Thunder imported) on first use.
    if name == "Tag":
        from ._tags import tag_class

        return tag_class()
    raise AttributeError(f"module 'cudagraphify' has no attribute {name!r}")
