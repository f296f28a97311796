"""What the gateway serves: endpoints and keys, model routes, the routing snapshot, each
service's capabilities.
"""
