"""Whether a request may pass and what it costs: admission, rate limits, quotas, idempotency,
request rules, usage.
"""
