"""Tests of kvwire.store: one contract over every backend, Redis Cluster, store faults."""
