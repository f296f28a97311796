"""A service's life after create: the one door for state changes, recovery, faults, sleep and
idle, windows, scaling, draining, rolling update.
"""
