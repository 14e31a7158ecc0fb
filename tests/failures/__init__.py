"""Tests of what a failing run reports: bad input, dead peers, full disks, damaged checkpoints."""
