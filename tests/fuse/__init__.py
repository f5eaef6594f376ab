"""Tests of kvwire.fuse: cache-to-cache between different models."""
