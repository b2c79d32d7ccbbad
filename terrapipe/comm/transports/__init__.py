"""The transports: what moves bytes among a group's ranks (the table is in base.py)."""
