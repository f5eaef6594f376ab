"""Tests of kvwire.wire: the packet, its codec, encodings, signatures, partial layers, RoPE."""
