"""Where work goes: planning a create (and its dry run), the fleet read model, the scheduler
round, dedup.
"""
