"""Tests of whole runs through the launch scripts and the shipped sample data."""
