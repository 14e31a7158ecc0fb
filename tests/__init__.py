"""The project's tests. REPO (the repository) and TESTS (this folder, with the shared
modules, data/ and golden/) are the same paths from a test file at any depth."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
