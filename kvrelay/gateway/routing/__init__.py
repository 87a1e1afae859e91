"""Routing across upstream replicas: policies (policies.py), the map of which replica
holds which blocks (cache_map.py), the keys a prompt is found by (prefix_keys.py) and the
loop that reads the engines' reports (cache_poll.py)."""
