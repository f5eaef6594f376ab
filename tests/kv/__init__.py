"""Tests of kvwire.kv: chains of packets and splicing."""
