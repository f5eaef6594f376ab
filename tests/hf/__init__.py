"""Tests of kvwire.hf and kvwire.models: exactness on tiny models, the engine, kernels, LoRA, real models."""
