"""Helpers shared by the tests (and some benchmarks): tiny models, packets, real Redis servers, network namespaces."""
