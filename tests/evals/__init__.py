"""Tests of kvwire.evals: question sets."""
