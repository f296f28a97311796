"""The agent protocol and what flows over it: nodes and heartbeats, node tokens, task logs,
file requests.
"""
