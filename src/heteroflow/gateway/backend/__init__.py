"""Talking to engines: upstream connections, forwarding with failover, relaying the answer,
retries, engine metrics.
"""
