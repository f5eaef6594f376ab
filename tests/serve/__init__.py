"""Tests of kvwire.serve: the OpenAI-compatible server."""
