"""Tenants and what they share and spend: tenants, quotas, sharing groups, token usage, GPU
time, platform switches.
"""
