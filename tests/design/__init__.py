"""Tests of the repository's rules: import layers, docs/design.md, flag reference, wording."""
