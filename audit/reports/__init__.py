"""Reports computed from audit files alone: non-targetability (routes) and residue.

These modules need the `reports` extra (scipy, matplotlib); nodes never import
them, so a node carries neither.
"""
