"""The node's model cache (issue 29): ``cache.ModelCache`` keeps one folder per model
revision, ``download`` fetches one file resumably and checked, ``unpack`` opens an
archive source safely."""

from heteroflow.agent.model_cache.cache import CachedModel, ModelCache
from heteroflow.agent.model_cache.download import Progress, ProgressCallback

__all__ = ["CachedModel", "ModelCache", "Progress", "ProgressCallback"]
