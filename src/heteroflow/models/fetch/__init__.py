"""Model sources fetched (issue 29): a source resolved to a manifest, over HTTP.

``manifest`` is the data (``Manifest``, ``SourceFailed``, the ``Resolver`` protocol and
its fake), ``resolve`` the real resolver (Hugging Face, ModelScope, https), ``http`` the
one request helper both it and the node's cache (``agent.model_cache``) use.
"""
