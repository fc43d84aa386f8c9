"""Benchmarks behind ``treespec bench``: end to end against the baselines (``e2e``) and plain
decoding against the peers' engines (``ar``)."""
