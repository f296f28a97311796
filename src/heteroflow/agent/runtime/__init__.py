"""HeteroFlow."""
