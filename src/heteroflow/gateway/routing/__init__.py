"""Which backend answers: the router, balancing, model=auto, backend health and probes, the
snapshot store and poller, the routes file, holding for a wake, /v1/models.
"""
