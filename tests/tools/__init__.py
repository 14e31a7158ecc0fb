"""Tests of tools/ and profiling/ scripts."""
