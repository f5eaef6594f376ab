"""Tests of the kvwire command."""
