"""Tests of kvwire.pipeline: specs, linear and graph runs, agents as processes, cost and fidelity."""
