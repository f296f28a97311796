"""Live time series (issue 33): the store, the sampler and the reads (``core/series.py``
holds the pure part)."""
